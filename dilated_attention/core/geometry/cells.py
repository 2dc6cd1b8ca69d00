"""Results for a sparse set of (row, head) cells, kept compact and merged into dense running values.

Note [Compact cell results]
    Some results touch few (row, head) cells of a sequence: ring dilated attention's branches that
    span ranks reach 1/r of a rank's cells (Note [Spanning results stay compact] in
    ``distributed/rings/ring_dilated.py``). Such results are kept as one row of D per cell, in
    float32, and merged into the running (out, lse), or added into float32 gradients, one block of
    positions and heads at a time: the blocks the fused engine's scratch holds (its ``extra``
    callback, Note [Fused branch engine]) or the whole sequence.

Shape legend: B batch, N positions, H heads, D head dim, M cells.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..merge import merge_partial


@dataclass(frozen=True)
class Cells:
    """Distinct (row, head) cells, sorted by row then head (Note [Compact cell results])."""

    rows: torch.Tensor  # (M,)
    heads: torch.Tensor  # (M,)
    _blocks: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(
        cls,
        rows: list[torch.Tensor],
        heads: list[torch.Tensor],
        num_heads: int,
        device: torch.device | str | None = None,
    ) -> tuple[Cells, list[torch.Tensor]]:
        """The cells of the given (rows, heads) pieces and each piece's positions among them
        (no pieces: no cells, with their indices on ``device``)."""
        pairs = zip(rows, heads, strict=True)
        parts = [r.flatten() * num_heads + h.flatten() for r, h in pairs]
        flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.long, device=device)
        cells, where = torch.unique(flat, return_inverse=True)
        pieces = list(where.split([r.numel() for r in rows]))
        return cls(cells // num_heads, cells % num_heads), pieces

    def to(self, device: torch.device | str) -> Cells:
        """The same cells with their indices on ``device``."""
        return Cells(self.rows.to(device), self.heads.to(device))

    def within(
        self, start: int, end: int, h0: int, h1: int, seq_len: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The cells in positions [start, end) and heads [h0, h1): ``(positions among the cells,
        flat index into a (B, end - start, h1 - h0, D) block seen as (B, rows * heads, D),
        flat index into a whole (B, H, seq_len) lse seen as (B, H * seq_len))``. Cached, since
        finding them syncs with the device."""
        key = (start, end, h0, h1, seq_len)
        if key not in self._blocks:
            inside = (self.rows >= start) & (self.rows < end)
            inside &= (self.heads >= h0) & (self.heads < h1)
            pos = torch.nonzero(inside).flatten()
            rows, heads = self.rows[pos], self.heads[pos]
            block = (rows - start) * (h1 - h0) + (heads - h0)
            self._blocks[key] = (pos, block, heads * seq_len + rows)
        return self._blocks[key]

    def slot_rows(self, rate: int, num_heads: int, seq_len: int) -> torch.Tensor | None:
        """Where the cells are exactly those of one slot of ``rate`` whose one segment holds the
        ``seq_len`` positions (position ``(h mod r) + r * m`` of every head ``h``; Note [Branch
        slots merged once] in ``slots.py``): each cell's row among the slot's ``ceil(N / r) *
        H`` rows, ``m * H + h`` (M,); else None. Cached, since checking syncs with the
        device."""
        key = ("slot", rate, num_heads, seq_len)
        if key not in self._blocks:
            offset = self.heads % rate
            expected = sum(-(-(seq_len - h % rate) // rate) for h in range(num_heads))
            exact = self.rows.numel() == expected and bool(
                (((self.rows - offset) % rate == 0) & (self.rows < seq_len)).all()
            )
            index = (self.rows - offset) // rate * num_heads + self.heads
            self._blocks[key] = index if exact else None
        return self._blocks[key]


def merge_cells(
    cells: Cells,
    cell_out: torch.Tensor,
    cell_lse: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    start: int,
    end: int,
    h0: int,
    h1: int,
) -> None:
    """Merge the compact results (``cell_out`` (B, M, D), ``cell_lse`` (B, M)) of the cells in
    positions [start, end) and heads [h0, h1) into ``out`` (B, end - start, h1 - h0, D) and the
    whole ``lse`` (B, H, N), both contiguous. Rows of ``out`` with ``lse = -inf`` may hold
    anything (the fused engine's unwritten scratch): they get weight zero without being read."""
    batch, dim = out.shape[0], out.shape[-1]
    pos, block, lse_index = cells.within(start, end, h0, h1, lse.shape[-1])
    if pos.numel() == 0:
        return
    flat_out, flat_lse = out.view(batch, -1, dim), lse.view(batch, -1)
    old_lse = flat_lse.index_select(1, lse_index)  # (B, m)
    reached = (old_lse > float("-inf")).unsqueeze(-1)
    old = torch.where(reached, flat_out.index_select(1, block), 0.0)
    new_out, new_lse = merge_partial(
        old, old_lse, cell_out.index_select(1, pos), cell_lse.index_select(1, pos)
    )
    flat_out.index_copy_(1, block, new_out.to(out.dtype))
    flat_lse.index_copy_(1, lse_index, new_lse)


def add_cells(
    cells: Cells, cell_grad: torch.Tensor, grad: torch.Tensor, start: int, end: int, h0: int,
    h1: int,
) -> None:  # fmt: skip
    """Add the compact gradients ``cell_grad`` (B, M, D) of the cells in positions [start, end)
    and heads [h0, h1) into ``grad`` (B, end - start, h1 - h0, D), contiguous."""
    pos, block, _ = cells.within(start, end, h0, h1)
    if pos.numel():
        flat = grad.view(grad.shape[0], -1, grad.shape[-1])
        flat.index_add_(1, block, cell_grad.index_select(1, pos).to(grad.dtype))
