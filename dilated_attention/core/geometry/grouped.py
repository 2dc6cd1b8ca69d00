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
    its whole scratch is more than one group of the fused engine may hold (MIN_SCRATCH_HEADS
    heads of MIN_GROUP_POSITIONS rows): the bound is a share of q, not of the GPU's memory, so
    the peak stays near the tensors every implementation holds at every length.

    Every cut call is a kernel launch with its host work (FlashAttention-4's Python interface
    costs about half a millisecond a call), so the cuts follow the memory: a call that will be
    differentiated runs its forward whole, whose 2x-output scratch stays below what the backward
    needs anyway (q, k, v, out, dout and three gradients), and only the backward in small groups
    (the fused engine's: 6 float32 units of scratch over 16 groups, 1.05x in all at 1M tokens); a
    call without gradients runs the forward in groups whose scratch is what the fused engine's
    forward may hold (1/SCRATCH_SHARE of q, k, v and out: float32 accumulators of a quarter of
    the positions, or a slotted plan's slots in :func:`forward_slot_groups` groups).
    A grouped backward after a whole forward needs the calls' kernel ``aux`` values to be None
    (they are for kernels without dropout); otherwise the backward runs whole too.

    A slotted plan (Note [Branch slots merged once] in ``slots.py``) is cut the same way, with
    slots of the group's size in place of the float32 scratch, but it need not wait for a group
    that no segment crosses: a schedule whose longest segment covers the sequence (LongNet's, at
    any length) has none. Its groups are as long as the shortest segments that reach the target
    length (:func:`slot_group_length`; the last group may be shorter). A backward's target is
    set by its gradient slots' memory (:func:`backward_slot_groups`): as many groups as make
    them take what the fused engine's float32 scratch takes in its 16, so LongNet's schedule,
    whose rate-1 slots are the gradients themselves (Note [A rate-1 slot is its destination] in
    ``slots.py``), runs 8 groups of 10 calls where 16 were needed before. Groups are longer
    still where a group's calls times the groups would exceed :data:`MAX_GROUPED_CALLS`
    (FlashAttention-4's host time per call); a branch with longer segments (each a multiple of the
    group, its rate dividing it) *spans* groups: its calls run once over the whole sequence,
    into a slot of the whole sequence, before the groups, and each group's merge (or sum) reads
    that slot's rows of its positions beside its own. Those branches have the largest rates, so
    their slots are small (LongNet at 4M tokens in groups of 256K: rates of 256 and more, under
    1% of q).

Shape legend: B batch, N seq_len, H query heads, D head dim.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import torch

from ..execution import fused
from .calls import Call
from .key_slots import query_layout
from .plan import Plan, PositionGroup
from .slots import Slot

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
    plan: Plan,
    like: torch.Tensor,
    segment_lengths: tuple[int, ...],
    needs_grad: bool,
    kv_heads: int | None = None,
) -> Plan:
    """``plan`` with its calls cut into position groups where that bounds the scratch to a share
    of q (Note [Position-grouped plans]), else ``plan`` itself.

    Args:
        plan: a dilated plan over ``like``'s positions.
        like: q, (B, N, H, D).
        segment_lengths: the branches' (effective) segment lengths.
        needs_grad: the call will be differentiated: the backward runs small groups and the
            forward the whole plan; else the forward runs the fewest groups whose scratch fits.
        kv_heads: Hkv, the key/value heads (default H): a slotted plan's key gradient slots.
    """
    if like.device.type not in GROUPED_DEVICES or plan.whole or plan.one_call:
        return plan
    if not all(hasattr(call, "within") for call in plan.calls):
        return plan
    batch, seq_len, heads, _ = like.shape
    if seq_len * heads <= fused.MIN_GROUP_POSITIONS * fused.MIN_SCRATCH_HEADS:
        return plan  # the scratch of the whole plan is as small as one group's may be
    group_size = heads // (kv_heads or heads)
    if plan.slots:
        return _slot_groups(plan, seq_len, batch, needs_grad, group_size)
    # Without gradients: float32 accumulators of the fused engine's forward share of the
    # positions; with them: the fused engine's groups (1/GROUPS_PER_SEQUENCE of the sequence).
    share = fused.scratch_fraction(group_size, False)
    longest = None if needs_grad else max(1, int(seq_len * share))
    groups = tuple(fused.position_groups(seq_len, segment_lengths, longest))
    if len(groups) == 1 and batch == 1:
        return plan
    return replace(plan, groups=_cut(plan.calls, groups), grouped_forward=not needs_grad)


def slot_group_length(slots: tuple[Slot, ...], seq_len: int, target: int) -> int | None:
    """The shortest group length ``G`` of at least ``target`` positions that cuts a slotted plan
    (Note [Position-grouped plans]): every segment length at most ``G`` divides it, every longer
    one is a multiple of it (whose slot then spans groups) with its rate dividing ``G``; or None
    where no such ``G`` below ``seq_len`` exists. The last group may be shorter (it ends with
    the sequence, as the segments' shorter last runs do)."""
    lengths = sorted({slot.segment_len for slot in slots})
    candidates = sorted({length << k for length in lengths for k in range(64)
                         if length << k < seq_len})  # fmt: skip
    for size in candidates:
        if size < target:
            continue
        if all(size % s.segment_len == 0 if s.segment_len <= size
               else s.segment_len % size == 0 and size % s.rate == 0 for s in slots):  # fmt: skip
            return size
    return None


#: The most kernel calls a slotted plan's grouped pass makes per batch element (its groups
#: times the calls of its first group; each batch element runs the groups on its own, with the
#: same work per call, so the host's share of the time does not depend on the batch):
#: FlashAttention-4's Python interface costs about half a millisecond a call, so beyond
#: this the host, not the GPU, sets the pace. On an H100 at 1M tokens (bf16, H = 16): LongNet's
#: schedule made 16 groups x 10 calls, whose causal D = 64 step took 99 ms of host time for 96 ms
#: of kernels (106 ms in all); in 8 groups (:func:`backward_slot_groups`) 51 ms and 94 ms
#: (``profile_dilated.py --host``). With 4 key/value heads a group makes 15 calls; its key
#: gradient slots, a key/value head's rows per branch when all were by position, needed 16
#: groups to stay within the fused engine's scratch: 240 calls (8 groups with the slots of
#: rates that are multiples of the group in the query layout, Note [Key slots of GQA plans] in
#: ``key_slots.py``).
MAX_GROUPED_CALLS = 240

#: A slotted plan's group holds at least this many positions: fewer than the fused engine's
#: (``fused.MIN_GROUP_POSITIONS``), whose launches cover a group's rows of every branch at once,
#: since its calls fill a GPU by themselves (a rate-1 call over 8K positions of 16 heads is
#: 1,024 tiles of 128 rows) and a GQA backward at 256K tokens takes 8 groups.
MIN_SLOT_GROUP_POSITIONS = 8192


def slot_share(slots: tuple[Slot, ...]) -> float:
    """A slotted plan's query slots in units of q (a unit being q's size in its own dtype): a
    slot of rate ``r`` takes ``1 / r``, a rate-1 slot none (Note [A rate-1 slot is its
    destination] in ``slots.py``)."""
    return sum(1 / s.rate for s in slots) - (1 if any(s.rate == 1 for s in slots) else 0)


def _power_of_two_at_least(ratio: float) -> int:
    return 1 << max(0, math.ceil(math.log2(ratio))) if ratio > 1 else 1


def forward_slot_groups(slots: tuple[Slot, ...], group_size: int) -> int:
    """How many position groups a slotted plan's forward without gradients needs for its slots
    to take at most 1/SCRATCH_SHARE of the bytes every implementation holds (q, k, v and out:
    2 + 2 / ``group_size`` units of q, Note [Fused branch engine] in ``fused.py``): the next
    power of two. LongNet's schedule: 2 groups, 4 with 4 query heads per key/value head."""
    unavoidable = 2 + 2 / group_size
    return _power_of_two_at_least(slot_share(slots) * fused.SCRATCH_SHARE / unavoidable)


def gradient_slot_share(slots: tuple[Slot, ...], group_size: int) -> float:
    """A slotted plan's gradient slots (dq's, dk's and dv's) in units of q: query slots as in
    :func:`slot_share`, a GQA key slot ``1 / group_size`` by position (none for a rate-1 slot,
    the gradient itself) and ``1 / r`` in the query layout (Note [Key slots of GQA plans] in
    ``key_slots.py``)."""
    query = slot_share(slots)
    key = query if group_size == 1 else sum(
        1 / s.rate if query_layout(s.rate, group_size) else 1 / group_size for s in slots
    ) - (1 / group_size if any(s.rate == 1 for s in slots) else 0)  # the rate-1 slot is dk
    return query + 2 * key


def backward_slot_groups(slots: tuple[Slot, ...], group_size: int) -> int:
    """How many position groups a slotted plan's backward needs for its gradient slots
    (:func:`gradient_slot_share`) to take at most what the fused engine's float32 dq, dk and dv
    take in ``GROUPS_PER_SEQUENCE`` groups (6 / GROUPS_PER_SEQUENCE units of q): the next power
    of two (Note [Position-grouped plans])."""
    share = gradient_slot_share(slots, group_size)
    return _power_of_two_at_least(share * fused.GROUPS_PER_SEQUENCE / 6)


def _slot_groups(
    plan: Plan, seq_len: int, batch: int, needs_grad: bool, group_size: int
) -> Plan:  # fmt: skip
    """``plan`` (slotted) cut into groups of :func:`slot_group_length`, as many as
    :func:`backward_slot_groups` (with gradients) or :func:`forward_slot_groups` (without),
    fewer (longer) where a group's calls times the groups would exceed
    :data:`MAX_GROUPED_CALLS`; the calls of slots whose segments are longer than a group run
    whole (``Plan.spanning``)."""
    if needs_grad:
        groups = backward_slot_groups(plan.slots, group_size)
    else:
        groups = forward_slot_groups(plan.slots, group_size)
    target = max(MIN_SLOT_GROUP_POSITIONS, -(-seq_len // groups))
    size = slot_group_length(plan.slots, seq_len, target)
    while size is not None:  # longer groups while there are too many calls (and they exist)
        calls = sum(c.within(0, size) is not None for c in _grouped_calls(plan, size))  # type: ignore[attr-defined]
        groups = max(1, MAX_GROUPED_CALLS // max(1, calls))
        if -(-seq_len // size) <= groups:
            break
        longer = slot_group_length(plan.slots, seq_len, -(-seq_len // groups))
        if longer is None or longer <= size:
            break
        size = longer
    if size is None:
        if batch == 1:
            return plan
        size = seq_len  # one group per batch element
    slots = tuple(replace(s, spanning=s.segment_len > size) for s in plan.slots)
    spanning = tuple(c for c in plan.calls if slots[c.slot].spanning)  # type: ignore[attr-defined]
    grouped = _grouped_calls(plan, size)
    groups = tuple((start, min(start + size, seq_len)) for start in range(0, seq_len, size))
    return replace(
        plan, slots=slots, groups=_cut(grouped, groups), grouped_forward=not needs_grad,
        spanning=spanning,
    )  # fmt: skip


def _grouped_calls(plan: Plan, size: int) -> tuple[Call, ...]:
    """The calls of a slotted plan that run in groups of ``size`` positions (their slots' segments
    fit in a group; the others span groups)."""
    return tuple(c for c in plan.calls if plan.slots[c.slot].segment_len <= size)  # type: ignore[attr-defined]
