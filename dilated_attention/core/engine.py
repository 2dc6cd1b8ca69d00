"""The dilated attention engine: run every row group through a kernel, merge, and differentiate.

Note [Exact gradients through the branch mix]
    The forward merges each group's ``(o_i, lse_i)`` into a running ``(out, lse)``
    (Note [Merging partial softmaxes]), which is LongNet Eq. 10: one softmax over the multiset union
    of the branches' keys. The mixing weights ``exp(lse_i - LSE)`` depend on q and k, so their
    gradient matters. Writing the merged result as that single softmax, its gradient with respect to
    the rows of branch ``i`` is exactly one attention backward over those rows with the *merged*
    ``out`` and ``LSE`` (Note [Backward with external statistics]). The backward therefore re-reads
    each group's rows, calls the kernel's backward with the merged statistics, and adds the row
    gradients into dq, dk, dv: no per-branch outputs are stored, and torchscale's no-grad weights
    are avoided.

Shape legend: B batch, N seq_len, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from .higher_order import (
    RowCall,
    calls_from_plan,
    differentiable_grads,
    first_order_only,
    no_higher_order_message,
)
from .merge import merge_partial
from .segment import RowGroup, gather_rows, scatter_rows


class KernelBackend(Protocol):
    """What the engine needs from a backend (``backends.base.Backend`` provides it)."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float,
        is_causal: bool = ...,
        key_mask: torch.Tensor | None = ...,
        dropout_p: float = ...,
    ) -> Any: ...

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        aux: Any,
        *,
        scale: float,
        is_causal: bool = ...,
        key_mask: torch.Tensor | None = ...,
        dropout_p: float = ...,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _GroupRows:
    """Indices of one row group for the query-head and key/value-head tensors."""

    def __init__(self, group: RowGroup, num_kv_heads: int, device: torch.device) -> None:
        self.group = group
        heads = group.num_heads
        if group.is_dense:
            self.q_index = self.kv_index = self.one_index = None
        else:
            per_kv = heads // num_kv_heads
            self.q_index = group.index(group.heads, heads, device)
            self.kv_index = group.index([h // per_kv for h in group.heads], num_kv_heads, device)
            self.one_index = group.index([0] * len(group.heads), 1, device)

    def q(self, x: torch.Tensor) -> torch.Tensor:
        return gather_rows(x, self.group, self.q_index)

    def kv(self, x: torch.Tensor) -> torch.Tensor:
        return gather_rows(x, self.group, self.kv_index)

    def lse(self, lse_bnh1: torch.Tensor) -> torch.Tensor:
        """(B, N, H, 1) -> (B * n, Hc, c)."""
        return gather_rows(lse_bnh1, self.group, self.q_index).squeeze(-1).transpose(1, 2)

    def key_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """(B, N) bool -> (B * n, Hc or 1, c)."""
        if mask is None:
            return None
        rows = gather_rows(mask.view(*mask.shape, 1, 1), self.group, self.one_index)
        return rows.squeeze(-1).transpose(1, 2)


def _covers_all_once(plan: tuple[RowGroup, ...], seq_len: int) -> bool:
    return len(plan) == 1 and plan[0].is_dense and plan[0].start == 0 and plan[0].stop == seq_len


def dilated_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    plan: tuple[RowGroup, ...],
    backend: KernelBackend,
    *,
    is_causal: bool,
    scale: float,
    dropout_p: float,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
    """Forward over every row group, merged (Note [Exact gradients through the branch mix]).

    Args:
        q: (B, N, H, D), contiguous.
        k: (B, N, Hkv, D), contiguous.
        v: (B, N, Hkv, D), contiguous.
        key_padding_mask: (B, N) bool (``True`` = ignore) or None.
        plan: from ``segment.plan_branches``.
        out_dtype: dtype of ``out`` (default ``q.dtype``; float32 keeps the merge unrounded for a
            caller that merges further, e.g. ring dilated attention).

    Returns:
        ``out`` (B, N, H, D), ``lse`` (B, H, N) float32 (float64 for float64 inputs;
        ``-inf`` where no key is seen), and each group's backend ``aux`` for the backward.
    """
    batch, seq_len, heads, dim = q.shape
    acc_dtype = _accumulator_dtype(q.dtype)
    merging = len(plan) > 1
    work_dtype = acc_dtype if merging else q.dtype
    out = torch.zeros(batch, seq_len, heads, dim, dtype=work_dtype, device=q.device)
    lse = torch.full((batch, seq_len, heads, 1), float("-inf"), dtype=acc_dtype, device=q.device)
    auxes = []
    for group in plan:
        rows = _GroupRows(group, k.shape[2], q.device)
        res = backend.forward(
            rows.q(q), rows.kv(k), rows.kv(v), scale=scale, is_causal=is_causal,
            key_mask=rows.key_mask(key_padding_mask), dropout_p=dropout_p,
        )  # fmt: skip
        auxes.append(res.aux)
        group_lse = res.lse.transpose(1, 2).unsqueeze(-1)
        if merging:
            prev_out, prev_lse = rows.q(out), rows.q(lse)
            new_out, new_lse = merge_partial(
                prev_out, prev_lse.squeeze(-1), res.out, group_lse.squeeze(-1)
            )
            scatter_rows(out, group, rows.q_index, new_out, accumulate=False)
            scatter_rows(lse, group, rows.q_index, new_lse.unsqueeze(-1), accumulate=False)
        else:
            scatter_rows(out, group, rows.q_index, res.out, accumulate=False)
            scatter_rows(lse, group, rows.q_index, group_lse, accumulate=False)
    out = out.to(out_dtype or q.dtype)
    return out, lse.squeeze(-1).transpose(1, 2).contiguous(), auxes


def dilated_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    plan: tuple[RowGroup, ...],
    backend: KernelBackend,
    auxes: list[Any],
    *,
    is_causal: bool,
    scale: float,
    dropout_p: float,
    grad_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact gradients of :func:`dilated_forward` (Note [Exact gradients through the branch mix]).

    Args:
        dout: (B, N, H, D) upstream gradient of ``out``.
        out: (B, N, H, D) merged output; ``lse``: (B, H, N) merged log-sum-exp.

        grad_dtype: dtype of the gradients (default: the inputs' dtypes).

    Returns:
        ``(dq, dk, dv)`` shaped like ``(q, k, v)``.
    """
    acc_dtype = q.dtype if _covers_all_once(plan, q.shape[1]) else _accumulator_dtype(q.dtype)
    if grad_dtype is not None:
        acc_dtype = grad_dtype
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc_dtype, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc_dtype, device=q.device)
    lse_bnh1 = lse.transpose(1, 2).contiguous().unsqueeze(-1)
    dout = dout.contiguous()
    for group, aux in zip(plan, auxes, strict=True):
        rows = _GroupRows(group, k.shape[2], q.device)
        dq_rows, dk_rows, dv_rows = backend.backward(
            rows.q(dout), rows.q(q), rows.kv(k), rows.kv(v), rows.q(out), rows.lse(lse_bnh1), aux,
            scale=scale, is_causal=is_causal, key_mask=rows.key_mask(key_padding_mask),
            dropout_p=dropout_p,
        )  # fmt: skip
        scatter_rows(dq, group, rows.q_index, dq_rows, accumulate=True)
        scatter_rows(dk, group, rows.kv_index, dk_rows, accumulate=True)
        scatter_rows(dv, group, rows.kv_index, dv_rows, accumulate=True)
    if grad_dtype is not None:
        return dq, dk, dv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


_DROPOUT_MESSAGE = no_higher_order_message(
    "{what} with dropout_p > 0",
    "the dropout mask is not replayed differentiably",
    "Pass dropout_p=0 (call module.eval()) for a gradient penalty or other double backward.",
)


class DilatedAttentionFunction(torch.autograd.Function):
    """Autograd wrapper of :func:`dilated_forward` / :func:`dilated_backward`.

    Returns ``(out, lse)``; ``lse`` is not differentiable (it is returned detached).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        plan: tuple[RowGroup, ...],
        backend: KernelBackend,
        is_causal: bool,
        scale: float,
        dropout_p: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse, auxes = dilated_forward(
            q, k, v, key_padding_mask, plan, backend,
            is_causal=is_causal, scale=scale, dropout_p=dropout_p,
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, out, lse, key_padding_mask)
        ctx.plan, ctx.backend, ctx.auxes = plan, backend, auxes
        ctx.options = {"is_causal": is_causal, "scale": scale, "dropout_p": dropout_p}
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, dout: torch.Tensor, _dlse: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, key_padding_mask = ctx.saved_tensors
        if torch.is_grad_enabled() and ctx.options["dropout_p"] == 0:
            # create_graph=True: differentiable gradients (Note [Double backward])
            calls = calls_from_plan(ctx.plan, k.shape[2], q.device, ctx.options["is_causal"])
            dq, dk, dv = differentiable_grads(
                dout, q, k, v, lse, calls, scale=ctx.options["scale"],
                key_padding_mask=key_padding_mask,
            )  # fmt: skip
            return dq, dk, dv, None, None, None, None, None, None
        with torch.no_grad():
            dq, dk, dv = dilated_backward(
                dout, q, k, v, out, lse, key_padding_mask, ctx.plan, ctx.backend, ctx.auxes,
                **ctx.options,
            )  # fmt: skip
        grads = first_order_only((dq, dk, dv), _DROPOUT_MESSAGE.format(what="dilated_attention"))
        return *grads, None, None, None, None, None, None


class AttentionFunction(torch.autograd.Function):
    """Dense attention through one backend call: ``(q, k, v) -> (out, lse)``, lse not
    differentiable.

    Query and key lengths may differ (cross-attention); causal masking is top-left aligned.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        backend: KernelBackend,
        is_causal: bool,
        scale: float,
        dropout_p: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(1)
        options = {"is_causal": is_causal, "scale": scale, "dropout_p": dropout_p}
        res = backend.forward(q, k, v, key_mask=key_mask, **options)
        out = res.out.contiguous()
        lse = res.lse.to(_accumulator_dtype(q.dtype)).contiguous()
        ctx.save_for_backward(q, k, v, out, lse, key_mask)
        ctx.backend, ctx.aux, ctx.options = backend, res.aux, options
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, dout: torch.Tensor, _dlse: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, key_mask = ctx.saved_tensors
        if torch.is_grad_enabled() and ctx.options["dropout_p"] == 0:
            # create_graph=True: differentiable gradients (Note [Double backward])
            call = RowCall.from_positions(
                torch.arange(q.shape[1], device=q.device).view(1, -1),
                torch.arange(k.shape[1], device=q.device).view(1, -1),
                q.shape[2], k.shape[2], ctx.options["is_causal"],
            )  # fmt: skip
            dq, dk, dv = differentiable_grads(
                dout, q, k, v, lse, [call], scale=ctx.options["scale"],
                key_padding_mask=None if key_mask is None else key_mask.squeeze(1),
            )  # fmt: skip
            return dq, dk, dv, None, None, None, None, None
        with torch.no_grad():
            dq, dk, dv = ctx.backend.backward(
                dout.contiguous(), q, k, v, out, lse, ctx.aux, key_mask=key_mask, **ctx.options
            )
        grads = first_order_only((dq, dk, dv), _DROPOUT_MESSAGE.format(what="attention"))
        return *grads, None, None, None, None, None


def empty_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` for a checked call with no query rows (batch 0 or 0 heads).

    SDPA returns empty tensors there; so do we, without launching a kernel (some reject empty
    launches). ``out`` is tied to q, k and v through their sums (of zero elements: free), so
    backward gives all three their empty gradients.

    Args:
        q: (B, Nq, H, D) with B * H == 0.
        k: (B, Nk, Hkv, D).
        v: (B, Nk, Hkv, D).

    Returns:
        out (B, Nq, H, D) in q's dtype; lse (B, H, Nq) float32 (float64 for float64 inputs).
    """
    batch, query_len, heads, _ = q.shape
    link = (q.sum() + k.sum() + v.sum()) * 0
    out = torch.zeros_like(q) + link
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = q.new_full((batch, heads, query_len), float("-inf"), dtype=lse_dtype)
    return out, lse
