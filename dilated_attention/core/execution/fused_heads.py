"""The fused engine's launches over one position group and head range (Note [Fused branch
engine] in ``fused.py``): every branch forward into float32 running values, or every branch's
gradients, the dK/dV and dQ launches as two chains side by side (Note [Two chains side by
side] in ``streams.py``), and the views of the scratch they write.

Shape legend: B batch, N seq_len, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from ..contract import BackwardPart, BranchSpan, FusedBackend
from .streams import side_by_side

if TYPE_CHECKING:
    from .fused import BackwardExtra, ForwardExtra, FusedPlan


def head_slice(x: torch.Tensor, dim: int, lo: int, hi: int) -> torch.Tensor:
    """Heads [lo, hi) of ``x`` along ``dim``: ``x`` itself when that is all of them (a slice
    per tensor and launch costs host time where chunks are host-bound)."""
    return x if lo == 0 and hi == x.shape[dim] else x.narrow(dim, lo, hi - lo)


def cells_view(buffer: torch.Tensor, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
    """``shape`` cells of the flat ``buffer`` from ``offset``, as a contiguous tensor."""
    return buffer.narrow(0, offset, math.prod(shape)).view(shape)


def accumulators(scratch: torch.Tensor, q_cells: int, kv_cells: int, q_shape: tuple[int, ...],
                  kv_shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """One head range's float32 dq (``q_shape``), dk and dv (``kv_shape``) rows: views of
    ``scratch``, laid out dq's ``q_cells``, then dk's and dv's ``kv_cells`` each."""
    return (cells_view(scratch, 0, q_shape), cells_view(scratch, q_cells, kv_shape),
            cells_view(scratch, q_cells + kv_cells, kv_shape))  # fmt: skip


def of_heads(tensors: tuple[torch.Tensor, ...], h0: int, h1: int, kv: slice) -> tuple:
    """``(dout, q, k, v, lse, delta)`` of query heads [h0, h1) and their key/value heads ``kv``
    (heads on dim 2 of the (B, N, H, D) tensors, dim 1 of the (B, H, N) statistics)."""
    dout, q, k, v, lse, delta = tensors
    kv0, kv1 = kv.start, kv.stop
    return (head_slice(dout, 2, h0, h1), head_slice(q, 2, h0, h1), head_slice(k, 2, kv0, kv1),
            head_slice(v, 2, kv0, kv1), head_slice(lse, 1, h0, h1),
            head_slice(delta, 1, h0, h1))  # fmt: skip


def forward_heads(
    backend: FusedBackend, plan: FusedPlan, io: tuple[torch.Tensor | None, ...],
    scratch: torch.Tensor, group: tuple[int, int, tuple[BranchSpan, ...]],
    heads: tuple[int, int], first_head: int, extra: ForwardExtra | None, options: dict[str, Any],
) -> None:  # fmt: skip
    """Every branch of one position group and head range (Note [Fused branch engine]): merged
    into float32 running values (``scratch``'s first cells as (B, end - start, h1 - h0, D)), the
    finished rows into ``out``.

    Args:
        io: ``(q, k, v, out, lse, key_mask)`` as :func:`fused_forward` holds them.
        group: ``(start, end, spans)``; heads: ``(h0, h1)``.
    """
    q, k, v, out, lse, key_mask = io
    start, end, group_spans = group
    h0, h1 = heads
    kv0, kv1 = h0 // plan.kv_group, h1 // plan.kv_group
    first, covers_all = options["q_row0"], plan.covers_all
    acc = cells_view(scratch, 0, (q.shape[0], end - start, h1 - h0, q.shape[3]))  # type: ignore[union-attr]
    if not covers_all:
        acc.zero_()
    qkv = (head_slice(q, 2, h0, h1), head_slice(k, 2, kv0, kv1), head_slice(v, 2, kv0, kv1))  # type: ignore[arg-type]
    lse_heads = head_slice(lse, 1, h0, h1)  # type: ignore[arg-type]
    for i, span in enumerate(group_spans):
        if covers_all and i == len(plan.branches) - 1:  # finished rows go to the output
            if extra is not None:
                extra(acc, lse, start, end, h0, h1)  # type: ignore[arg-type]
            backend.forward_branch(
                *qkv, head_slice(out, 2, h0, h1), lse_heads, key_mask, span, out_row0=first,  # type: ignore[arg-type]
                merge=True, head0=first_head + h0, merge_from=acc, merge_row0=start, **options,
            )  # fmt: skip
        else:
            backend.forward_branch(
                *qkv, acc, lse_heads, key_mask, span, out_row0=start,
                merge=i > 0 or not covers_all, head0=first_head + h0, **options,
            )  # fmt: skip
    if not covers_all:
        if extra is not None:
            extra(acc, lse, start, end, h0, h1)  # type: ignore[arg-type]
        out[:, start - first : end - first, h0:h1].copy_(acc)  # type: ignore[index]


def backward_heads(
    backend: FusedBackend, plan: FusedPlan, io: tuple[torch.Tensor | None, ...],
    grads: tuple[torch.Tensor, ...], scratch: torch.Tensor,
    group: tuple[int, int, tuple[BranchSpan, ...]], heads: tuple[int, int], first_head: int,
    extra: BackwardExtra | None, options: dict[str, Any],
) -> None:  # fmt: skip
    """Every branch's gradients of one position group and head range into float32
    accumulators (dq, dk, dv rows: :func:`accumulators` of ``scratch``, laid out by
    ``plan.cells``), then cast into ``grads`` (dq, dk, dv) (Note [Fused branch engine]).

    Args:
        io: ``(dout, q, k, v, lse, delta, key_mask)``, ``delta`` the group's rows.
        group: ``(start, end, spans)``; heads: ``(h0, h1)``.
    """
    *inputs, key_mask = io
    start, end, group_spans = group
    h0, h1 = heads
    kv = slice(h0 // plan.kv_group, h1 // plan.kv_group)
    batch, dim = grads[0].shape[0], grads[0].shape[3]  # dq is shaped like q
    q_cells, kv_cells = plan.cells
    accs = accumulators(scratch, q_cells, kv_cells, (batch, end - start, h1 - h0, dim),
                        (batch, end - start, kv.stop - kv.start, dim))  # fmt: skip
    if not plan.covers_all:
        for acc in accs:
            acc.zero_()
    branches_backward(
        backend, of_heads(tuple(inputs), h0, h1, kv), key_mask, accs, group_spans, options,  # type: ignore[arg-type]
        delta_row0=start, grad_row0=start, accumulate=not plan.covers_all, head0=first_head + h0,
    )  # fmt: skip
    if extra is not None:
        extra(*accs, start, end, h0, h1)
    heads_of = (slice(h0, h1), kv, kv)
    for grad, acc, cols in zip(grads, accs, heads_of, strict=True):
        grad[:, start:end, cols].copy_(acc)


def branches_backward(
    backend: FusedBackend,
    inputs: tuple[torch.Tensor, ...],
    key_mask: torch.Tensor | None,
    grads: tuple[torch.Tensor, ...],
    spans: tuple[BranchSpan, ...],
    options: dict[str, Any],
    *,
    delta_row0: int,
    grad_row0: int,
    accumulate: bool,
    head0: int,
) -> None:
    """Every span's backward into ``grads`` (dq, dk, dv), the first written (or with
    ``accumulate`` added) and the rest added: the dK/dV launches as one chain and the dQ
    launches as another, side by side (Note [Two chains side by side] in ``streams.py``).

    Args:
        inputs: ``(dout, q, k, v, lse, delta)`` as ``FusedBackend.backward_branch`` takes them.
    """

    def chain(part: BackwardPart) -> None:
        for i, span in enumerate(spans):
            backend.backward_branch(
                *inputs, key_mask, *grads, span, delta_row0=delta_row0, grad_row0=grad_row0,
                accumulate=i > 0 or accumulate, head0=head0, part=part, **options,
            )  # fmt: skip

    side_by_side(inputs[1].device, lambda: chain("keys"), lambda: chain("queries"))
