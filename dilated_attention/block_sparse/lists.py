"""The kernels' lists of a run-time block mask, made on its device: each row's kept columns
(:func:`compact_rows`), and FlashAttention-4's and FlexAttention's 128 x 128 tile lists
(:func:`runtime_tile_lists`). On the GPU one Triton pass makes each (Note [Lists of a run-time
mask in one pass] in ``backends/triton_kernels/compact.py``); elsewhere torch operations do.

Shape legend: Bm batch rows of the mask (1 or B), Hm its heads, H query heads, Mq / Mk query /
key blocks, Tq / Tk query / key tiles.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..backends.triton import kernel_module
from .plan import num_blocks
from .runtime import per_query_head
from .tiles import KERNEL_TILE, kernel_tiles

__all__ = ["TileLists", "compact_rows", "runtime_tile_lists"]


class TileLists(NamedTuple):
    """One direction's tile lists, int32 on the mask's device: per row tile the tiles that need
    the mask (``partial``) and those that do not (``full``), each a count (Bm, H, R) and an
    index list (Bm, H, R, W) (Note [Kernel tiles of a block mask] in ``tiles.py``)."""

    partial_count: torch.Tensor
    partial_index: torch.Tensor
    full_count: torch.Tensor
    full_index: torch.Tensor


def _on_gpu(x: torch.Tensor) -> Any:
    """The one-pass Triton compaction where it takes ``x`` (4-D, on the GPU), else None."""
    module = kernel_module("compact") if x.is_cuda and x.dim() == 4 else None
    return None if module is None else module.compact


def compact_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's kept columns in increasing order, as the kernels' lists: no host read, no
    sort (one Triton pass on the GPU; a cumulative sum and a scatter elsewhere).

    Args:
        rows: (..., R, C) bool, any strides.

    Returns:
        ``count`` (..., R) int32 and ``index`` (..., R, C) int32, contiguous: row ``r``'s
        columns in ``index[..., r, :count[..., r]]`` (the entries after them are 0).
    """
    kernel = _on_gpu(rows)
    if kernel is not None:
        return kernel(rows, heads=rows.shape[1])  # type: ignore[no-any-return]
    cols = rows.shape[-1]
    count = rows.sum(-1, dtype=torch.int32)
    slot = torch.where(rows, rows.cumsum(-1) - 1, cols)  # an unkept column: the spare slot
    index = torch.zeros(*rows.shape[:-1], cols + 1, dtype=torch.int32, device=rows.device)
    column = torch.arange(cols, dtype=torch.int32, device=rows.device).expand(rows.shape)
    index.scatter_(-1, slot, column)
    return count, index[..., :cols].contiguous()


def _heads(kept: torch.Tensor, num_heads: int) -> int:
    return 1 if kept.shape[1] == 1 else num_heads


def runtime_tile_lists(
    kept: torch.Tensor,
    *,
    block_size: int,
    query_len: int,
    key_len: int,
    is_causal: bool,
    num_heads: int,
    backward: bool = False,
) -> TileLists:
    """The forward (per query tile, its key tiles) or, with ``backward``, the backward (per key
    tile, its query tiles) tile lists of a run-time mask's kept blocks, per batch row and query
    head (1 where the mask has one head).

    When tiles lie inside blocks (``block_size`` a multiple of 128) and, causal, queries and
    keys have one length, the partial tiles are the kept diagonal ones and the full tiles the
    kept ones off it, read from the block mask directly (one pass on the GPU); otherwise the
    tiles are classified from prefix sums (:func:`~.tiles.kernel_tiles`).

    Args:
        kept: (Bm, Hm, Mq, Mk) bool, causal applied; Hm in {1, Hkv, H}.

    Returns:
        :class:`TileLists`, rows of query tiles (forward) or key tiles (backward).
    """
    heads = _heads(kept, num_heads)
    aligned = block_size % KERNEL_TILE == 0 and (not is_causal or query_len == key_len)
    if not aligned:
        full, partial = kernel_tiles(
            per_query_head(kept, num_heads), block_size=block_size, query_len=query_len,
            key_len=key_len, is_causal=is_causal,
        )  # fmt: skip
        if backward:
            full, partial = full.transpose(-1, -2), partial.transpose(-1, -2)
        return TileLists(*compact_rows(partial), *compact_rows(full))
    repeat = block_size // KERNEL_TILE
    rows, cols = num_blocks(query_len, KERNEL_TILE), num_blocks(key_len, KERNEL_TILE)
    causal = 1 if is_causal else 0
    if backward:
        kept, rows, cols, causal = kept.transpose(-1, -2), cols, rows, 2 * causal
    return TileLists(*_diagonal_tiles(kept, heads, repeat, is_causal, rows),
                     *_full_tiles(kept, heads, repeat, causal, rows, cols))  # fmt: skip


def _full_tiles(
    kept: torch.Tensor, heads: int, repeat: int, causal: int, rows: int, cols: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(count (Bm, heads, rows), index (Bm, heads, rows, cols)) of the kept tiles, ``repeat``
    a block side, before (``causal`` 1) or after (2) the diagonal, or all (0)."""
    kernel = _on_gpu(kept)
    if kernel is not None:
        return kernel(  # type: ignore[no-any-return]
            kept, heads=heads, repeat=repeat, causal=causal, rows=rows, cols=cols
        )
    tiles = per_query_head(kept, heads)
    tiles = tiles.repeat_interleave(repeat, -2).repeat_interleave(repeat, -1)[..., :rows, :cols]
    if causal:
        row = torch.arange(rows, device=kept.device)[:, None]
        col = torch.arange(cols, device=kept.device)[None, :]
        tiles = tiles & (col < row if causal == 1 else col > row)
    return compact_rows(tiles)


def _diagonal_tiles(
    kept: torch.Tensor, heads: int, repeat: int, is_causal: bool, tiles: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial tiles of aligned tiles: with ``is_causal`` (queries and keys of one length)
    the kept diagonal tile of each row, none otherwise; (count (Bm, heads, T),
    index (Bm, heads, T, 1)), T = ``tiles`` rows."""
    batch = kept.shape[0]
    index = torch.arange(tiles, dtype=torch.int32, device=kept.device)
    index = index.view(1, 1, tiles, 1).expand(batch, heads, tiles, 1).contiguous()
    if not is_causal:
        return torch.zeros(batch, heads, tiles, dtype=torch.int32, device=kept.device), index
    diagonal = torch.diagonal(kept, dim1=-2, dim2=-1)  # (Bm, Hm, min(Mq, Mk))
    diagonal = per_query_head(diagonal, heads).repeat_interleave(repeat, -1)[..., :tiles]
    return diagonal.to(torch.int32).contiguous(), index
