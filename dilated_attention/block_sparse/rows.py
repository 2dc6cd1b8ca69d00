"""Run-time block masks on any dense kernel: the executor's calls, one query block at a time,
each reading its row of the block mask as its key mask.

Note [Run-time masks on a dense kernel]
    A pattern's plan gathers the kept blocks, known on the host (Note [Block-sparse plan]). A
    run-time mask's are not (reading them would synchronise), so this fallback's calls follow
    from the shapes alone: query block ``i`` (rows ``[i * bs, (i + 1) * bs)``) against every key
    it may see, each call's key mask (B, 1 or H, Lk) taken from row ``i`` of the kept blocks
    (a key of an unkept block is ignored). Not causal: one call against all ``Nk`` keys.
    Causal (rows at positions ``Nk - Nq + r``): one call against the keys before the block's
    first position, and the square causal call of its own positions. So ``Mq`` calls (``2 Mq``
    causal), each scoring ``bs x Lk`` pairs per head: memory of one block row of scores, never
    ``Nq x Nk``, and the time of dense attention (every pair scored, then masked). It is the
    CPU's path and the reference; on CUDA the three block-sparse kernels walk only the kept
    pairs. The executor merges the calls by log-sum-exp and its backward replays them with the
    merged statistics (Note [One executor]), so the gradients are exact; they are first order
    only (Note [Run-time block masks]).

Shape legend: B batch, Nq query rows, Nk key rows, H query heads, Hkv key/value heads, bs block
size, Mq/Mk query/key blocks, Lq/Lk rows of a call.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from ..core.autograd import Backward, Forward, Grads, Inputs, Saved
from ..core.execution.executor import PlanRunner
from ..core.geometry.calls import put_view
from ..core.geometry.plan import Plan
from ..core.higher_order import RowCall
from .plan import num_blocks
from .runtime import FIRST_ORDER_MESSAGE

__all__ = ["BlockRowCall", "MaskedRowsRunner", "row_plan"]


@dataclass(frozen=True)
class BlockRowCall:
    """Query rows ``q`` (of query block ``block``) against key rows ``kv``, both slices of
    positions, top-left causal when ``causal``; the executor's ``Call`` whose key mask is the
    block's row of the kept blocks it is given in place of a key padding mask, or of ``kept``
    where the call carries its own (a ring step's columns of the kept blocks, its keys being
    another rank's: Note [Run-time masks over the ring] in ``distributed/rings/masked_ring.py``)."""

    q: slice
    kv: slice
    causal: bool
    block: int
    block_size: int
    kept: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def q_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, self.q]

    def kv_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, self.kv]

    def key_mask(self, kept: torch.Tensor | None) -> torch.Tensor | None:
        """``kept`` (B, 1 or H, Mq, Mk) bool (the call's own where it carries one) -> the
        call's (B, 1 or H, Lk), True = ignore."""
        if self.kept is not None:
            kept = self.kept
        assert kept is not None  # MaskedRowsRunner runs these calls with the kept blocks
        start, stop, size = self.kv.start, self.kv.stop, self.block_size
        first = start // size
        row = kept[:, :, self.block, first : num_blocks(stop, size)]
        keep = row.repeat_interleave(size, dim=-1)[..., start - first * size :]
        return ~keep[..., : stop - start]

    def put_q(self, dest: torch.Tensor, rows: torch.Tensor, *, accumulate: bool) -> None:
        put_view(dest[:, self.q], rows, accumulate)

    def put_kv(self, dest: torch.Tensor, rows: torch.Tensor, *, accumulate: bool) -> None:
        put_view(dest[:, self.kv], rows, accumulate)

    def row_call(self, q: torch.Tensor, k: torch.Tensor) -> RowCall:
        raise NotImplementedError(FIRST_ORDER_MESSAGE)  # MaskedRowsRunner never asks


@functools.lru_cache(maxsize=64)
def row_plan(query_len: int, key_len: int, block_size: int, is_causal: bool) -> Plan:
    """The calls of Note [Run-time masks on a dense kernel], from the shapes alone."""
    shift = key_len - query_len if is_causal else 0
    calls = []
    for block in range(num_blocks(query_len, block_size)):
        r0, r1 = block * block_size, min((block + 1) * block_size, query_len)
        if not is_causal:
            calls.append(BlockRowCall(slice(r0, r1), slice(0, key_len), False, block, block_size))
            continue
        if shift + r0 > 0:  # the keys before the block's first position: every row sees them
            before = slice(0, shift + r0)
            calls.append(BlockRowCall(slice(r0, r1), before, False, block, block_size))
        own = slice(shift + r0, shift + r1)
        calls.append(BlockRowCall(slice(r0, r1), own, True, block, block_size))
    return Plan(tuple(calls))


@dataclass(frozen=True)
class MaskedRowsRunner:
    """The executor over :func:`row_plan`'s calls as a
    :class:`~dilated_attention.core.autograd.Runner`: its inputs carry the kept blocks
    (B, 1 or H, Mq, Mk) where a plan's carry the key padding mask; first-order gradients."""

    runner: PlanRunner
    first_order_message = FIRST_ORDER_MESSAGE

    def forward(self, x: Inputs) -> Forward:
        return self.runner.forward(x)

    def backward(self, b: Backward) -> Grads:
        return self.runner.backward(b)

    def differentiable_backward(self, b: Backward) -> None:
        return None

    def saved_without_forward(self, x: Inputs) -> Saved | None:
        return self.runner.saved_without_forward(x)
