"""Block-sparse attention through our Triton kernels (Note [Block-sparse Triton kernels] in
``backends/_triton_block_sparse.py``): when they can run a call, their block lists, and their
autograd.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import torch

from ..core.higher_order import differentiable_grads
from ..patterns import Pattern
from .plan import causal_block_mask, num_blocks, plan_calls


@functools.cache
def _triton_block_sparse() -> ModuleType:
    from ..backends import _triton_block_sparse

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


class TritonBlockSparseFunction(torch.autograd.Function):
    """Autograd of the block-sparse Triton kernels.

    Returns ``out`` (B, Nq, H, D) in the input dtype and ``lse`` (B, H, Nq) float32, not
    differentiable.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        lists: Any,
        block_size: int,
        is_causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = _triton_block_sparse().forward(
            q, k, v, lists, block_size=block_size, is_causal=is_causal, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.lists, ctx.block_size, ctx.is_causal, ctx.scale = lists, block_size, is_causal, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, dout: torch.Tensor, _dlse: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True (Note [Double backward])
            # The same pairs as the fallback's calls, from the kernels' block lists.
            lists, block_size = ctx.lists, ctx.block_size
            nq, nk = num_blocks(q.shape[1], block_size), num_blocks(k.shape[1], block_size)
            counts = (lists.key_start[1:] - lists.key_start[:-1]).long().cpu()
            mask = torch.zeros(nq, nk, dtype=torch.bool)
            mask[torch.arange(nq).repeat_interleave(counts), lists.key_blocks.long().cpu()] = True
            calls = plan_calls(
                mask, block_size=block_size, query_len=q.shape[1], key_len=k.shape[1],
                is_causal=ctx.is_causal,
            )  # fmt: skip
            calls = [c.to(q.device) for c in calls]
            rows = [call.row_call(q, k) for call in calls]
            grads = differentiable_grads(dout, q, k, v, lse, rows, scale=ctx.scale)
            return (*grads, None, None, None, None)
        dq, dk, dv = _triton_block_sparse().backward(
            dout.contiguous(), q, k, v, out, lse, ctx.lists, block_size=ctx.block_size,
            is_causal=ctx.is_causal, scale=ctx.scale,
        )  # fmt: skip
        return dq, dk, dv, None, None, None, None
