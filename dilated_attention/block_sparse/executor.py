"""Running a block-sparse plan through any dense kernel: each call's ``(out, lse)`` merged into
float32 accumulators, and the backward replaying the calls with the merged statistics (Note
[Block-sparse plan] in ``plan.py``).

Shape legend: B batch, Nq/Nk query/key tokens, H query heads, Hkv key/value heads, D head dim,
G query pieces stacked in one call, Lq/Lk rows per piece.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..backends.base import Backend
from ..core.higher_order import RowCall, differentiable_grads
from ..core.merge import merge_partial
from .plan import SparseCall


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def new_accumulators(
    q: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` (B, Nq, H, D) zeros and ``lse`` (B, Nq, H) ``-inf``, float32 (float64)."""
    batch, rows, heads, dim = q.shape
    acc = _acc_dtype(q.dtype)
    out = torch.zeros(batch, rows, heads, dim, dtype=acc, device=q.device)
    lse = torch.full((batch, rows, heads), float("-inf"), dtype=acc, device=q.device)
    return out, lse


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(B, N, h, D) and (G, L) -> (B * G, L, h, D)."""
    batch, _, heads, dim = x.shape
    g, length = index.shape
    return x.index_select(1, index.flatten()).view(batch * g, length, heads, dim)


def forward_calls(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    calls: list[SparseCall],
    backend: Backend,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    auxes: list[Any],
) -> None:
    """Run ``calls`` and merge each result into ``out`` (B, Nq, H, D) / ``lse`` (B, Nq, H).

    Args:
        q: (B, Nq, H, D) local queries; k, v: (B, Nk', Hkv, D), the rows ``kv_index`` reads.
        auxes: each call's kernel ``aux`` is appended, in call order.
    """
    batch, _, heads, dim = q.shape
    for call in calls:
        g, lq = call.q_index.shape
        res = backend.forward(
            _rows(q, call.q_index), _rows(k, call.kv_index), _rows(v, call.kv_index),
            scale=scale, is_causal=call.causal,
        )  # fmt: skip
        auxes.append(res.aux)
        rows = call.q_index.flatten()
        part_out = res.out.reshape(batch, g * lq, heads, dim)
        part_lse = res.lse.view(batch, g, heads, lq).transpose(2, 3).reshape(batch, g * lq, heads)
        new_out, new_lse = merge_partial(
            out.index_select(1, rows), lse.index_select(1, rows), part_out, part_lse
        )
        out.index_copy_(1, rows, new_out)
        lse.index_copy_(1, rows, new_lse)


def backward_calls(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    calls: list[SparseCall],
    backend: Backend,
    scale: float,
    auxes: Iterator[Any],
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
) -> None:
    """Replay ``calls`` with the merged statistics and add the gradients into dq, dk, dv.

    Args:
        dout, q, out: (B, Nq, H, D); lse: (B, H, Nq) merged; k, v: (B, Nk', Hkv, D).
        auxes: the forward's ``aux`` values, consumed in call order.
        dq: (B, Nq, H, D); dk, dv: (B, Nk', Hkv, D) accumulators (float32 or float64).
    """
    batch, _, heads, dim = q.shape
    kv_heads = k.shape[2]
    for call in calls:
        g, lq = call.q_index.shape
        lk = call.kv_index.shape[1]
        rows, keys = call.q_index.flatten(), call.kv_index.flatten()
        lse_rows = lse.index_select(2, rows).view(batch, heads, g, lq).transpose(1, 2)
        dq_c, dk_c, dv_c = backend.backward(
            _rows(dout, call.q_index), _rows(q, call.q_index), _rows(k, call.kv_index),
            _rows(v, call.kv_index), _rows(out, call.q_index),
            lse_rows.reshape(batch * g, heads, lq), next(auxes), scale=scale,
            is_causal=call.causal,
        )  # fmt: skip
        dq.index_add_(1, rows, dq_c.reshape(batch, g * lq, heads, dim).to(dq.dtype))
        dk.index_add_(1, keys, dk_c.reshape(batch, g * lk, kv_heads, dim).to(dk.dtype))
        dv.index_add_(1, keys, dv_c.reshape(batch, g * lk, kv_heads, dim).to(dv.dtype))


class BlockSparseFunction(torch.autograd.Function):
    """Autograd of :func:`forward_calls` / :func:`backward_calls` on one process.

    Returns ``out`` (B, Nq, H, D) in the input dtype and ``lse`` (B, H, Nq), not differentiable.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        calls: list[SparseCall],
        backend: Backend,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out_acc, lse_acc = new_accumulators(q)
        auxes: list[Any] = []
        forward_calls(q, k, v, calls, backend, scale, out_acc, lse_acc, auxes)
        out = out_acc.to(q.dtype)
        lse = lse_acc.transpose(1, 2).contiguous()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.calls, ctx.backend, ctx.scale, ctx.auxes = calls, backend, scale, auxes
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, dout: torch.Tensor, _dlse: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True (Note [Double backward])
            grads = _differentiable_grads(dout, q, k, v, lse, ctx.calls, ctx.scale)
            return (*grads, None, None, None)
        acc = _acc_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        backward_calls(
            dout.contiguous(), q, k, v, out, lse, ctx.calls, ctx.backend, ctx.scale,
            iter(ctx.auxes), dq, dk, dv,
        )  # fmt: skip
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def _differentiable_grads(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    calls: list[SparseCall],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of the calls' merged attention, differentiable to any order (Note [Double
    backward] in ``core/higher_order.py``); dout, q: (B, Nq, H, D), k, v: (B, Nk, Hkv, D)."""
    heads, kv_heads = q.shape[2], k.shape[2]
    rows = [RowCall.from_positions(c.q_index, c.kv_index, heads, kv_heads, c.causal) for c in calls]
    return differentiable_grads(dout, q, k, v, lse, rows, scale=scale)
