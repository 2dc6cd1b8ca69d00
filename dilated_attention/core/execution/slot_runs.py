"""A slotted plan's calls run into branch slots, merged (and their gradients summed) once.

Note [Branch slots merged once] in ``slots.py`` says why and holds the slot buffers; this module
runs the calls into them: :func:`slot_forward` and :func:`slot_backward` for a whole plan or one
position group (``grouped_runs.py``), :func:`fill_slots` and :func:`fill_grad_slots` for the
slots' calls alone.

Shape legend: B batch, N seq_len, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch

from ..contract import KernelOutput
from ..geometry.calls import Call, GradInputs, KernelArgs, call_backward, call_forward
from ..geometry.key_slots import KeySlots
from ..geometry.slots import Slot, SlotBuffers, SlotCall, SlotView, merge_slots

#: Runs a call's launches (kernel calls and in-place ops on the tensors it is given, which name
#: everything the launches read or write): now, or replayed from a CUDA graph
#: (``KernelBackend.run_launches``, bound to the call's key).
LaunchRunner = Callable[[Sequence[torch.Tensor | None], Callable[[], None]], None]


def run_through(runner: LaunchRunner | None, tensors: Sequence[torch.Tensor | None],
                launches: Callable[[], None]) -> None:  # fmt: skip
    """``launches`` through ``runner`` (told of ``tensors``), or run now without one."""
    if runner is None:
        launches()
    else:
        runner(tensors, launches)


def first_then(
    first: Callable[[], None], reads: Sequence[torch.Tensor], runner: LaunchRunner
) -> LaunchRunner:
    """A runner that runs ``first`` (in-place ops that also read ``reads``) before each call's
    launches, both through ``runner`` as one closure (a replayed graph's)."""

    def run(tensors: Sequence[torch.Tensor | None], launches: Callable[[], None]) -> None:
        def both() -> None:
            first()
            launches()

        run_through(runner, (*tensors, *reads), both)

    return run


def _fill(dest: torch.Tensor, result: torch.Tensor) -> None:
    """Copy a kernel's ``result`` into ``dest``, unless the kernel wrote it there."""
    same = result.data_ptr() == dest.data_ptr() and result.stride() == dest.stride()
    if not same:
        dest.copy_(result)


def batch_rows(call: Call, batch: int, seq_len: int) -> tuple[slice, ...]:
    """The batch rows a slot call runs on at once: all, or one batch element at a time where
    its rows are views only within one (a run of whole segments before a shorter last one,
    ``StridedCall.whole_batch``)."""
    if batch == 1 or cast(SlotCall, call).whole_batch(seq_len):
        return (slice(None),)
    return tuple(slice(b, b + 1) for b in range(batch))


def rows_of(x: torch.Tensor | None, rows: slice | tuple[slice, slice]) -> torch.Tensor | None:
    """``x[rows]``, or None for None (an optional key padding mask)."""
    return None if x is None else x[rows]


def fill_slots(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    calls: Sequence[Call],
    buffers: SlotBuffers,
    kernel: KernelArgs,
    *,
    auxes: list[Any],
) -> None:
    """Run ``calls``, each writing its out and lse into its slot of ``buffers`` (Note [Branch
    slots merged once] in ``slots.py``).

    Args:
        q, k, v: (B, N, H, D), the positions the calls and ``buffers`` address.
        calls: calls with ``slot``, ``slot_rows`` and ``slot_lse`` (``StridedCall``).
        auxes: each call's kernel ``aux`` is appended, in call order (and batch order, for a
            call run one batch element at a time).
    """
    for call in calls:
        slotted = cast(SlotCall, call)
        for rows in batch_rows(call, *q.shape[:2]):
            into = KernelOutput(
                slotted.slot_rows(buffers.out(slotted.slot)[rows]),
                slotted.slot_lse(buffers.lse(slotted.slot)[rows]),
            )
            res = call_forward(call, q[rows], k[rows], v[rows], rows_of(key_padding_mask, rows),
                               kernel, into=into)  # fmt: skip
            auxes.append(res.aux)
            _fill(into.out, res.out)
            _fill(into.lse, res.lse)


def fill_grad_slots(
    saved: GradInputs,
    calls: Sequence[Call],
    grads: Sequence[SlotBuffers | KeySlots],
    kernel: KernelArgs,
    auxes: Iterator[Any],
) -> None:
    """The backward of :func:`fill_slots`: each call's dq, dk, dv rows written into its slots of
    ``grads`` (three buffers, for q, k and v: :func:`grad_slots`).

    Args:
        saved: the forward's inputs and merged results, and the output's gradient.
        auxes: the forward's ``aux`` values, consumed in the order :func:`fill_slots` made them.
    """
    for call in calls:
        slotted = cast(SlotCall, call)
        for rows in batch_rows(call, *saved.q.shape[:2]):
            into = tuple(g.call_rows(slotted, rows) for g in grads)
            results = call_backward(call, saved.part(rows), next(auxes), kernel, into=into)
            for dest, result in zip(into, results, strict=True):
                _fill(dest, result)


def grad_slots(
    slots: Sequence[Slot],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    held: Sequence[int] | None,
    grads: Sequence[torch.Tensor | None] = (None, None, None),
) -> list[SlotBuffers | KeySlots]:
    """The gradient slots of a slotted plan's backward over the positions of q, k, v (B, N',
    H or Hkv, D): query slots for dq, and for dk and dv the query slots' layout without GQA,
    else key slots by position (Note [Key slots of GQA plans] in ``key_slots.py``); a rate-1 query
    slot is the gradient of ``grads`` it sums into, where given (Note [A rate-1 slot is its
    destination])."""
    dq = SlotBuffers(slots, q, q.shape[1], with_lse=False, held=held, dest=grads[0])
    if k.shape[2] == q.shape[2]:
        return [dq, *(SlotBuffers(slots, x, x.shape[1], with_lse=False, held=held, dest=grad)
                      for x, grad in zip((k, v), grads[1:], strict=True))]  # fmt: skip
    group_size = q.shape[2] // k.shape[2]
    return [dq, *(KeySlots(slots, x, group_size, held=held, dest=grad)
                  for x, grad in zip((k, v), grads[1:], strict=True))]  # fmt: skip


def own_slots(slots: Sequence[Slot], spanning: bool = False) -> list[int]:
    """The indices of the slots that span position groups (``spanning``) or do not."""
    return [i for i, slot in enumerate(slots) if slot.spanning == spanning]


def slot_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    calls: Sequence[Call],
    slots: Sequence[Slot],
    kernel: KernelArgs,
    *,
    out: torch.Tensor,
    lse: torch.Tensor,
    auxes: list[Any],
    spanning: Sequence[SlotView] | None = None,
    extra: Callable[[], Sequence[SlotView]] | None = None,
    runner: LaunchRunner | None = None,
) -> None:
    """Run ``calls`` into slots of their own over q's positions, then merge them once into
    ``out`` (B, N, H, D) and ``lse`` (B, H, N) (Note [Branch slots merged once] in
    ``slots.py``); with ``spanning`` (a position group's part of the slots that span groups),
    only the other slots are the calls' own, and those views join the merge; so do the views
    ``extra`` returns (called once the calls are queued). The slots are allocated first, then
    the calls and the merge run through ``runner`` (Note [A slotted call's launches from a CUDA
    graph]; only without ``spanning`` and ``extra``, whose tensors the runner is not told of)."""
    assert runner is None or (spanning is None and extra is None)
    held = None if spanning is None else own_slots(slots)
    buffers = SlotBuffers(slots, q, q.shape[1], with_lse=True, held=held, dest=out)

    def launches() -> None:
        fill_slots(q, k, v, key_padding_mask, calls, buffers, kernel, auxes=auxes)
        more = () if extra is None else extra()
        merge_slots([*buffers.views(), *(spanning or ()), *more], out, lse)

    tensors = (q, k, v, key_padding_mask, out, lse, *buffers.tensors)
    run_through(runner, tensors, launches)


def slot_backward(
    saved: GradInputs,
    calls: Sequence[Call],
    slots: Sequence[Slot],
    kernel: KernelArgs,
    auxes: Iterator[Any],
    *,
    grads: Sequence[torch.Tensor],
    spanning: Sequence[Sequence[Any]] | None = None,
    extra: Callable[[], Sequence[Sequence[Any]]] | None = None,
    runner: LaunchRunner | None = None,
) -> None:
    """The backward of :func:`slot_forward`: each call's gradients written into slots of three
    gradient buffers (:func:`grad_slots`), each summed (with the ``spanning`` views of that
    gradient's slots, and those ``extra`` returns once the calls are queued) once into
    ``grads`` (dq, dk, dv, (B, N, H or Hkv, D)); the buffers are allocated first, then the
    calls and the sums run through ``runner``, as in :func:`slot_forward`."""
    assert runner is None or (spanning is None and extra is None)
    held = None if spanning is None else own_slots(slots)
    buffers = grad_slots(slots, saved.q, saved.k, saved.v, held, grads)

    def launches() -> None:
        fill_grad_slots(saved, calls, buffers, kernel, auxes)
        more = ((), (), ()) if extra is None else extra()
        for own, views, added, grad in zip(buffers, spanning or ((), (), ()), more, grads,
                                           strict=True):  # fmt: skip
            own.sum_into(grad, [*views, *added])

    slot_tensors = [t for own in buffers for t in own.tensors]
    tensors = (saved.dout, saved.q, saved.k, saved.v, saved.out, saved.lse_rows,
               saved.key_padding_mask, *grads, *slot_tensors)  # fmt: skip
    run_through(runner, tensors, launches)
