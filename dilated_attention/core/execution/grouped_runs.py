"""A position-grouped plan run one batch element and position group at a time, each group's
results merged (and its gradients summed) in float32 scratch or slots of the group's size
(Note [Position-grouped plans] in ``grouped.py``, which cuts the plans).

Shape legend: B batch, N seq_len, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from ..geometry.calls import GradInputs, KernelArgs
from ..geometry.plan import Plan, PositionGroup
from ..geometry.slots import ExtraSlotGradients, SlotBuffers
from .call_runs import (
    accumulator_dtype,
    new_accumulators,
    row_lse_later,
    run_backward,
    run_forward,
)
from .slot_runs import (
    LaunchRunner,
    fill_grad_slots,
    fill_slots,
    grad_slots,
    own_slots,
    rows_of,
    run_through,
    slot_backward,
    slot_forward,
)

#: ``extra(dq, dk, dv, start, end, rows)``: adds more gradients (float32) into the float32
#: ``dq`` (B', end - start, H, D), ``dk`` and ``dv`` (B', end - start, Hkv, D) of batch rows
#: ``rows`` and positions [start, end), before they are rounded (ring dilated attention's
#: spanning branches: Note [Spanning results stay compact] in
#: ``distributed/rings/ring_dilated.py``).
ExtraGradients = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int, slice], None]


def _pieces(
    batch: int, groups: Sequence[PositionGroup]
) -> Iterator[tuple[tuple[slice, slice], PositionGroup]]:
    """``((batch rows, positions), group)`` for every batch element and position group, in the
    order both passes run them (the backward consumes the forward's ``aux`` values in order)."""
    for i in range(batch):
        for group in groups:
            yield (slice(i, i + 1), slice(group.start, group.end)), group


def grouped_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    plan: Plan,
    kernel: KernelArgs,
    *,
    out_dtype: torch.dtype | None,
    runner: LaunchRunner | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[Any] | None]:
    """``plan_forward`` (``executor.py``) one batch element and position group at a time, each
    merged in float32 scratch (or slots) of its own size and rounded once into ``out`` (Note
    [Position-grouped plans]); the slots that span groups are filled first, whole. ``out`` and
    ``lse`` are allocated first and the groups run through ``runner`` (Note [A slotted call's
    launches from a CUDA graph] in ``executor.py``: the groups' slots and scratch are allocated
    and freed inside, which a graph's pool keeps; the ``aux`` values are then None)."""
    batch, seq_len, heads, _ = q.shape
    out = torch.empty(q.shape, dtype=out_dtype or q.dtype, device=q.device)
    lse = torch.empty(batch, heads, seq_len, dtype=accumulator_dtype(q.dtype), device=q.device)
    auxes: list[Any] = []

    def launches() -> None:
        slots, spanning = plan.slots, None
        if plan.spanning:
            spanning = SlotBuffers(slots, q, seq_len, with_lse=True, held=own_slots(slots, True))
            fill_slots(q, k, v, key_padding_mask, plan.spanning, spanning, kernel, auxes=auxes)
        for (rows, positions), group in _pieces(batch, plan.groups):
            piece_q = q[rows, positions]
            mask = rows_of(key_padding_mask, (rows, positions))
            if slots:
                parts = None if spanning is None else spanning.views(rows, group.start, group.end)
                slot_forward(
                    piece_q, k[rows, positions], v[rows, positions], mask, group.calls, slots,
                    kernel, out=out[rows, positions], lse=lse[rows, :, positions], auxes=auxes,
                    spanning=parts,
                )  # fmt: skip
                continue
            piece_out, piece_lse = new_accumulators(piece_q)
            run_forward(
                piece_q, k[rows, positions], v[rows, positions], mask, group.calls,
                kernel.backend, scale=kernel.scale, out=piece_out, lse=piece_lse, auxes=auxes,
                dropout_p=kernel.dropout_p,
            )  # fmt: skip
            out[rows, positions] = piece_out
            lse[rows, :, positions] = piece_lse.squeeze(-1).transpose(1, 2)

    run_through(runner, (q, k, v, key_padding_mask, out, lse), launches)
    return out, lse, (auxes if runner is None else None)


def grouped_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    plan: Plan,
    kernel: KernelArgs,
    auxes: Iterable[Any],
    *,
    extra: ExtraGradients | ExtraSlotGradients | None = None,
    runner: LaunchRunner | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``plan_backward`` (``executor.py``) of :func:`grouped_forward`: each group's gradients
    summed in float32 scratch (or slots) of its own size, then written once; the gradient slots
    that span groups are filled first, whole. With ``extra`` gradients in slots, each group's
    sums read their views too; with an ``extra`` callback, a group's slots are summed into
    float32 scratch of the group's size, where it adds its gradients before the one rounding.
    The gradients are allocated first and the groups run through ``runner`` (only without
    ``extra``), as in :func:`grouped_forward`."""
    assert runner is None or extra is None
    acc = accumulator_dtype(q.dtype)
    grads = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v)]
    lse_rows, fill_rows = row_lse_later(lse)
    saved = GradInputs(dout, q, k, v, out, lse_rows, key_padding_mask)
    in_slots = extra if isinstance(extra, ExtraSlotGradients) else None
    add = None if in_slots is not None else extra

    def launches() -> None:
        fill_rows()
        slots, spanning, aux = plan.slots, None, iter(auxes)
        if plan.spanning:
            spanning = grad_slots(slots, q, k, v, own_slots(slots, True))
            fill_grad_slots(saved, plan.spanning, spanning, kernel, aux)
        for (rows, positions), group in _pieces(q.shape[0], plan.groups):
            piece = saved.part((rows, positions))
            dests = [grad[rows, positions] for grad in grads]
            if slots:
                parts = None if spanning is None else [g.views(rows, group.start, group.end)
                                                       for g in spanning]  # fmt: skip
                more = (
                    None
                    if in_slots is None
                    else functools.partial(in_slots.views, rows, group.start, group.end)
                )
                into = dests if add is None else [torch.empty_like(d, dtype=acc) for d in dests]
                slot_backward(piece, group.calls, slots, kernel, aux, grads=into,
                              spanning=parts, extra=more)  # fmt: skip
            else:
                assert in_slots is None  # the ring gives extra slots to slotted plans only
                into = [torch.zeros_like(d, dtype=acc) for d in dests]
                run_backward(piece, group.calls, kernel, aux, dq=into[0], dk=into[1], dv=into[2])
            if add is not None:
                add(*into, group.start, group.end, rows)
            for dest, part in zip(dests, into, strict=True):
                if part is not dest:
                    dest.copy_(part)

    tensors = (dout, q, k, v, out, saved.lse_rows, key_padding_mask, *grads, lse)
    run_through(runner, tensors, launches)
    dq, dk, dv = grads
    return dq, dk, dv
