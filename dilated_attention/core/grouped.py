"""Dilated plans run one position group at a time, so their float32 scratch stays small.

Note [Position-grouped plans]
    The executor merges every call's result into float32 accumulators shaped like the output,
    and its backward adds the calls' gradients into float32 dq, dk, dv: on top of the eight
    tensors that cannot be avoided (q, k, v, out and their gradients) that is 2x the output and
    2x the gradients, 2.0x in all (FlashAttention-4 on strided views at 1M tokens). A dilated
    plan's calls never read across a segment boundary, so the sequence can be cut where no
    segment of any branch crosses (``position_groups``, Note [Fused branch engine] in
    ``fused.py``) and each group finished before the next: every call cut to the group
    (``within``), the group's results merged in float32 scratch of the group's size and rounded
    once into the output; backward, the group's gradients summed in float32 scratch, then
    written. No row's arithmetic changes: a row meets the same calls in the same order. Each batch
    element runs on its own, so the calls' rows stay views (a slice of positions with its batch
    and segment dimensions merged would be a copy). The plan is cut only on a GPU, and only where
    the whole float32 scratch would not fit in 1/DEVICE_SCRATCH_FRACTION of its memory
    (``scratch_allowance``): below that the extra launches cost more than the memory is worth.

    Every cut call is a kernel launch with its host work (FlashAttention-4's Python interface
    costs about half a millisecond a call), so the cuts follow the memory: a call that will be
    differentiated runs its forward whole, whose 2x-output scratch stays below what the backward
    needs anyway (q, k, v, out, dout and three gradients), and only the backward in small groups
    (the fused engine's: 6 float32 units of scratch over 16 groups, 1.05x in all at 1M tokens); a
    call without gradients runs the forward in the fewest groups whose scratch fits the allowance.
    A grouped backward after a whole forward needs the calls' kernel ``aux`` values to be None
    (they are for kernels without dropout); otherwise the backward runs whole too.

Shape legend: B batch, N seq_len, H query heads, D head dim.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch

from . import fused
from .engine import Call, Plan, PositionGroup

#: Devices whose plans are cut (tests add "cpu" to run the grouped executor there).
GROUPED_DEVICES = frozenset({"cuda"})


@functools.lru_cache(maxsize=64)
def _cut(calls: tuple[Call, ...], groups: tuple[tuple[int, int], ...]) -> tuple[PositionGroup, ...]:
    pieces = []
    for start, end in groups:
        cut = (call.within(start, end) for call in calls)  # type: ignore[attr-defined]
        pieces.append(PositionGroup(start, end, tuple(c for c in cut if c is not None)))
    return tuple(pieces)


def grouped_plan(
    plan: Plan, like: torch.Tensor, segment_lengths: tuple[int, ...], needs_grad: bool
) -> Plan:
    """``plan`` with its calls cut into position groups where that bounds the float32 scratch
    (Note [Position-grouped plans]), else ``plan`` itself.

    Args:
        plan: a dilated plan over ``like``'s positions.
        like: q, (B, N, H, D).
        segment_lengths: the branches' (effective) segment lengths.
        needs_grad: the call will be differentiated: the backward runs small groups and the
            forward the whole plan; else the forward runs the fewest groups whose scratch fits.
    """
    if like.device.type not in GROUPED_DEVICES or plan.whole or plan.one_call:
        return plan
    if not all(hasattr(call, "within") for call in plan.calls):
        return plan
    batch, seq_len, heads, _ = like.shape
    allowance = fused.scratch_allowance(like)
    if seq_len * heads <= allowance:
        return plan
    # Without gradients: groups as long as the scratch allows (fewer launches); with them: the
    # fused engine's groups (at most 1/GROUPS_PER_SEQUENCE of the sequence) for the backward.
    longest = None if needs_grad else max(1, allowance // heads)
    groups = tuple(fused.position_groups(seq_len, segment_lengths, longest))
    if len(groups) == 1 and batch == 1:
        return plan
    return replace(plan, groups=_cut(plan.calls, groups), grouped_forward=not needs_grad)
