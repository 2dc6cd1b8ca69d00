"""Block-sparse attention through our Triton kernels (Note [Block-sparse Triton kernels] in
``backends/triton_kernels/block_sparse.py``): their block lists, of a pattern (on the host, once) or
of a run-time mask (on the device, per call), and their autograd.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from ..core.autograd import Backward, Forward, Grads, Inputs, Saved
from ..core.higher_order import no_higher_order_message
from ..patterns import Pattern
from .lists import compact_rows
from .plan import causal_block_mask, num_blocks, recomputed_grads
from .runtime import FIRST_ORDER_MESSAGE


@functools.cache
def _triton_block_sparse() -> ModuleType:
    from ..backends.triton_kernels import block_sparse as _triton_block_sparse

    return _triton_block_sparse


@torch.compiler.disable
@functools.lru_cache(maxsize=32)
def _triton_lists(
    pattern: Pattern,
    block_size: int,
    query_len: int,
    key_len: int,
    is_causal: bool,
    device: torch.device,
) -> Any:
    """The pattern's ``BlockLists`` (causal applied) on ``device``, built once per shape."""
    nq, nk = num_blocks(query_len, block_size), num_blocks(key_len, block_size)
    mask = causal_block_mask(pattern.block_mask(nq, nk), is_causal)
    return _triton_block_sparse().block_lists(mask, device)


def runtime_lists(kept: torch.Tensor) -> Any:
    """The ``BlockLists`` of a run-time mask's kept blocks (Bm, Hm, Mq, Mk) bool (causal
    applied; Note [Run-time block masks] in ``runtime.py``), made on their device: per batch
    row and mask head, each query block's key blocks and each key block's query blocks."""
    by_query, by_key = compact_rows(kept), compact_rows(kept.transpose(-1, -2))
    return _triton_block_sparse().padded_lists(by_query, by_key)


_SOFTCAP_MESSAGE = no_higher_order_message(
    "block_sparse_attention with softcap",
    "the differentiable recompute of the gradients applies causality only",
    "Call it without softcap for a gradient penalty or other double backward.",
)


@dataclass(frozen=True)
class TritonBlockSparseRunner:
    """Our block-sparse Triton kernels as a :class:`~dilated_attention.core.autograd.Runner`
    over ``lists`` (``BlockLists``, causal applied: a pattern's, or with ``run_time`` a
    run-time mask's); under ``create_graph=True`` a pattern's calls take the recompute over the
    fallback's calls for the same block pairs (Note [Double backward]), except with ``softcap``
    (the scores soft-capped; Note [Scores a kernel call transforms] in ``core/contract.py``).
    A run-time mask's gradients are first order only (Note [Run-time block masks])."""

    lists: Any
    block_size: int
    is_causal: bool
    scale: float
    softcap: float | None = None
    run_time: bool = False

    @property
    def first_order_message(self) -> str:
        if self.run_time:
            return FIRST_ORDER_MESSAGE
        return "" if self.softcap is None else _SOFTCAP_MESSAGE

    def forward(self, x: Inputs) -> Forward:
        q, k, v, _ = x  # no key padding mask here
        out, lse = _triton_block_sparse().forward(
            q, k, v, self.lists, block_size=self.block_size, is_causal=self.is_causal,
            scale=self.scale, softcap=self.softcap,
        )  # fmt: skip
        return Forward(out, lse, saved=(k, v))

    def backward(self, b: Backward) -> Grads:
        dout, q, out, lse, saved, _ = b
        k, v = saved
        return _triton_block_sparse().backward(  # type: ignore[no-any-return]
            dout.contiguous(), q, k, v, out, lse, self.lists, block_size=self.block_size,
            is_causal=self.is_causal, scale=self.scale, softcap=self.softcap,
        )  # fmt: skip

    def saved_without_forward(self, x: Inputs) -> Saved:
        return x.k, x.v

    def differentiable_backward(self, b: Backward) -> Grads | None:
        if self.softcap is not None or self.run_time:
            return None  # the recompute knows causality only, and a pattern's pairs
        # The same pairs as the fallback's calls, from the kernels' block lists (one set, CSR).
        lists, block_size = self.lists, self.block_size
        nq, nk = num_blocks(b.q.shape[1], block_size), num_blocks(b.saved[0].shape[1], block_size)
        counts = lists.key_count.flatten().long().cpu()
        mask = torch.zeros(nq, nk, dtype=torch.bool)
        mask[torch.arange(nq).repeat_interleave(counts), lists.key_blocks.long().cpu()] = True
        return recomputed_grads(b, mask, block_size, self.is_causal, self.scale)
