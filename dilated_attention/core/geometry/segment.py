"""Branch geometry: which rows each dilated branch covers, and moving those rows in and out.

Note [Row groups]
    Branch ``(w, r)`` cuts the sequence into segments of length ``w`` (the last may be shorter) and,
    in each segment starting at ``t0``, gives head ``j`` the rows ``t0 + s + r*m`` with ``s = j mod
    r`` (LongNet Sec. 2.3). When ``r`` does not divide the segment, heads with different offsets get
    different row counts (``w = 10, r = 3``: offsets 0/1/2 get 4/3/3 rows). A :class:`RowGroup` is
    one kernel call's worth of rows: one run of equal-length segments and the heads that have the
    same row count there. A branch yields at most two segment runs (full segments, then the shorter
    last one) and at most two row counts per run, so at most four kernel calls whatever ``r``.

    Rows are moved with one ``index_select`` per tensor, over each segment viewed as
    ``(segment_len * heads)`` rows of ``head_dim``: the index has ``rows * len(heads)`` entries and
    is shared by every segment, so it stays tiny at any sequence length. Branches with ``r = 1`` are
    plain reshapes (views when the layout allows), with no index at all.

Shape legend: B batch, N seq_len, H query heads, Hkv key/value heads, D head dim, n segments in a
group, L segment length, c rows per segment, Hc heads in the group.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ... import _validation as V
from ..higher_order import RowCall
from .calls import put_view
from .key_slots import query_layout
from .plan import Plan
from .slots import Slot
from .strided import DiagonalCall, StridedCall, kv_head_slice


@dataclass(frozen=True)
class RowGroup:
    """Rows of ``num_segments`` consecutive segments of ``segment_len`` starting at ``start``.

    Head ``heads[i]`` covers, in every segment, the ``rows`` positions ``offsets[i] + rate * m``;
    ``branch`` is the index of the group's branch in the schedule.
    """

    start: int
    num_segments: int
    segment_len: int
    rate: int
    heads: tuple[int, ...]
    offsets: tuple[int, ...]
    rows: int
    num_heads: int
    branch: int = 0

    @property
    def stop(self) -> int:
        """One past the last position the group's segments span."""
        return self.start + self.num_segments * self.segment_len

    @property
    def is_dense(self) -> bool:
        """Every position of every segment for every head: a reshape, no index."""
        return self.rows == self.segment_len and len(self.heads) == self.num_heads

    def index(self, head_ids: Sequence[int], heads_in_x: int, device: torch.device) -> torch.Tensor:
        """Flat row index into one segment viewed as (segment_len * heads_in_x) rows.

        Args:
            head_ids: for each head of the group, the head of the tensor to read (query heads for q,
                kv heads for k and v).
            heads_in_x: the head count of that tensor.

        Returns:
            int64 (c * Hc,) in (row, head) order.
        """
        m = torch.arange(self.rows, device=device).view(-1, 1)
        offsets = torch.tensor(self.offsets, device=device).view(1, -1)
        heads = torch.tensor(head_ids, device=device).view(1, -1)
        return ((offsets + self.rate * m) * heads_in_x + heads).flatten()


@functools.lru_cache(maxsize=256)
def plan_branches(
    seq_len: int,
    num_heads: int,
    segment_lengths: tuple[int, ...],
    dilation_rates: tuple[int, ...],
    first_head: int = 0,
) -> tuple[RowGroup, ...]:
    """Every branch's row groups for a sequence (see Note [Row groups]).

    Args:
        seq_len: N.
        num_heads: H (query heads).
        segment_lengths: w per branch; ``w > N`` means one segment of length N.
        dilation_rates: r per branch.
        first_head: the layer head that head 0 is (a call on a slice of the layer's heads, as
            after a head all-to-all): head ``h`` has offset ``(first_head + h) mod r``.

    Returns:
        Row groups in branch order; groups of one branch cover disjoint (position, head) pairs.
    """
    groups: list[RowGroup] = []
    for branch, (seg, rate) in enumerate(zip(segment_lengths, dilation_rates, strict=True)):
        seg = min(seg, seq_len)
        full, rest = divmod(seq_len, seg)
        runs = [(0, full, seg)] if full else []
        if rest:
            runs.append((full * seg, 1, rest))
        for start, count, length in runs:
            by_rows: dict[int, list[int]] = {}
            for head in range(num_heads):
                offset = (first_head + head) % rate
                if offset < length:
                    by_rows.setdefault(-(-(length - offset) // rate), []).append(head)
            for rows, heads in sorted(by_rows.items(), reverse=True):
                groups.append(
                    RowGroup(
                        start=start,
                        num_segments=count,
                        segment_len=length,
                        rate=rate,
                        heads=tuple(heads),
                        offsets=tuple((first_head + h) % rate for h in heads),
                        rows=rows,
                        num_heads=num_heads,
                        branch=branch,
                    )
                )
    return tuple(groups)


def gather_rows(x: torch.Tensor, group: RowGroup, index: torch.Tensor | None) -> torch.Tensor:
    """Read a group's rows.

    Args:
        x: (B, N, Hx, E) with a contiguous (N, Hx, E) inner layout.
        index: from :meth:`RowGroup.index`, or None for a dense group (then Hc = Hx).

    Returns:
        (B * n, c, Hc, E); a view where the layout allows.
    """
    batch, _, heads_x, dim = x.shape
    n, length = group.num_segments, group.segment_len
    block = x[:, group.start : group.stop]
    if index is None:
        return block.reshape(batch * n, length, heads_x, dim)
    picked = block.reshape(batch, n, length * heads_x, dim).index_select(2, index)
    # Sizes spelled out (no -1): a view of zero elements cannot infer one (batch 0).
    return picked.view(batch * n, group.rows, index.numel() // group.rows, dim)


def scatter_rows(
    dest: torch.Tensor,
    group: RowGroup,
    index: torch.Tensor | None,
    rows: torch.Tensor,
    *,
    accumulate: bool,
) -> None:
    """Write (or add) a group's rows into ``dest`` in place; the inverse of :func:`gather_rows`.

    Args:
        dest: (B, N, Hx, E), contiguous.
        rows: (B * n, c, Hc, E).
        accumulate: add into ``dest`` (repeated index entries add up) instead of overwriting.
    """
    batch, _, heads_x, dim = dest.shape
    n, length = group.num_segments, group.segment_len
    block = dest[:, group.start : group.stop].view(batch, n, length * heads_x, dim)
    src = rows.reshape(batch, n, rows.shape[1] * rows.shape[2], dim)
    if index is None:
        put_view(block, src, accumulate)
        return
    src = src.to(dest.dtype)
    if accumulate:
        block.index_add_(2, index, src)
    else:
        block.index_copy_(2, index, src)


class GroupCall:
    """One row group as a kernel call of the executor (``Call`` in ``calls.py``): each query
    head of the group reads its own key/value head (GQA heads repeated, as the gathers do)."""

    def __init__(
        self, group: RowGroup, num_kv_heads: int, device: torch.device, causal: bool
    ) -> None:
        self.group, self.causal = group, causal
        if group.is_dense:
            self.q_index = self.kv_index = self.one_index = None
        else:
            self.q_index, self.kv_index = _head_indices(group, num_kv_heads, device)
            self.one_index = group.index([0] * len(group.heads), 1, device)

    def within(self, start: int, end: int) -> GroupCall | None:
        """The call cut to positions ``[start, end)`` (segment boundaries), in the coordinates
        of ``x[:, start:end]``, or None where it has no row there; it shares the indices, which
        do not depend on where the segments are (Note [Position-grouped plans])."""
        group, length = self.group, self.group.segment_len
        first, stop = max(group.start, start), min(group.stop, end)
        if stop <= first:
            return None
        cut = copy.copy(self)
        cut.group = replace(group, start=first - start, num_segments=(stop - first) // length)
        return cut

    def q_rows(self, x: torch.Tensor) -> torch.Tensor:
        return gather_rows(x, self.group, self.q_index)

    def kv_rows(self, x: torch.Tensor) -> torch.Tensor:
        return gather_rows(x, self.group, self.kv_index)

    def key_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """(B, N) bool -> (B * n, Hc or 1, c)."""
        if mask is None:
            return None
        rows = gather_rows(mask.view(*mask.shape, 1, 1), self.group, self.one_index)
        return rows.squeeze(-1).transpose(1, 2)

    def put_q(self, dest: torch.Tensor, rows: torch.Tensor, *, accumulate: bool) -> None:
        scatter_rows(dest, self.group, self.q_index, rows, accumulate=accumulate)

    def put_kv(self, dest: torch.Tensor, rows: torch.Tensor, *, accumulate: bool) -> None:
        scatter_rows(dest, self.group, self.kv_index, rows, accumulate=accumulate)

    def row_call(self, q: torch.Tensor, k: torch.Tensor) -> RowCall:
        group, device = self.group, q.device
        heads, num_kv_heads = group.num_heads, k.shape[2]
        base = group.start + torch.arange(group.num_segments, device=device) * group.segment_len
        q_rows, kv_rows = _head_indices(group, num_kv_heads, device)
        q_index = (base * heads).view(-1, 1) + q_rows.view(1, -1)
        kv_index = (base * num_kv_heads).view(-1, 1) + kv_rows.view(1, -1)
        return RowCall(q_index, kv_index, len(group.heads), len(group.heads), self.causal)


def _head_indices(
    group: RowGroup, num_kv_heads: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's :meth:`RowGroup.index` into q and into k/v (each query head reads its own
    key/value head)."""
    per_kv = group.num_heads // num_kv_heads
    kv_heads = [h // per_kv for h in group.heads]
    return (
        group.index(group.heads, group.num_heads, device),
        group.index(kv_heads, num_kv_heads, device),
    )


@functools.lru_cache(maxsize=256)
def group_calls(
    groups: tuple[RowGroup, ...], num_kv_heads: int, device: torch.device, causal: bool
) -> tuple[GroupCall, ...]:
    """The executor's calls of :func:`plan_branches` groups (their small indices built once per
    device)."""
    return tuple(GroupCall(group, num_kv_heads, device, causal) for group in groups)


def covers_all_once(groups: tuple[RowGroup, ...], seq_len: int) -> bool:
    """One dense group of one segment over the whole sequence: dense attention."""
    if len(groups) != 1:
        return False
    group = groups[0]
    whole = group.num_segments == 1 and group.start == 0 and group.stop == seq_len
    return group.is_dense and whole


def dilated_plan(
    groups: tuple[RowGroup, ...],
    seq_len: int,
    num_kv_heads: int,
    device: torch.device,
    causal: bool,
    strided: bool = False,
) -> Plan:
    """The executor's plan of row groups over ``seq_len`` positions: dense attention when one
    dense group covers them all, else one call per group; with ``strided`` (a kernel that reads
    strided rows), groups whose rows are strided views become one view call per offset class
    (Note [Strided row calls] in ``strided.py``)."""
    if covers_all_once(groups, seq_len):
        return Plan.dense(causal)
    if not strided:
        return Plan(group_calls(groups, num_kv_heads, device, causal))
    calls: list = []
    for group in groups:  # gather indices are built only for the groups that gather
        views = strided_calls(group, num_kv_heads, causal)
        calls.extend(views or group_calls((group,), num_kv_heads, device, causal))
    return Plan(tuple(calls))


def branch_plan(
    groups: tuple[RowGroup, ...],
    seq_len: int,
    num_kv_heads: int,
    device: torch.device,
    causal: bool,
    strided: bool,
    writes_into: bool,
) -> Plan:
    """The executor's plan of ``groups`` on a kernel that reads strided rows (``strided``) and
    writes into given buffers (``writes_into``): branch slots merged once where it does both and
    the branches allow (:func:`slot_plan`), else :func:`dilated_plan`."""
    slotted = strided and writes_into
    if slotted and not_slotted_reason(groups, seq_len, num_kv_heads) is None:
        return slot_plan(groups, seq_len, num_kv_heads, causal)
    return dilated_plan(groups, seq_len, num_kv_heads, device, causal, strided)


@functools.lru_cache(maxsize=256)
def not_slotted_reason(
    groups: tuple[RowGroup, ...], seq_len: int, num_kv_heads: int
) -> str | None:
    """Why the branches of ``groups`` cannot write into slots merged once (Note [Branch slots
    merged once] in ``slots.py``), or None where they can (:func:`slot_plan`)."""
    if covers_all_once(groups, seq_len):
        return "one dense call: nothing to merge"
    for group in groups:
        reason = None if group.rate == 1 else not_strided_reason(group, num_kv_heads)
        if reason is not None:
            return f"w={group.segment_len} r={group.rate}: {reason}"
    return None


def runs_in_slots(
    seq_len: int,
    num_heads: int,
    num_kv_heads: int,
    segment_lengths: tuple[int, ...],
    dilation_rates: tuple[int, ...],
) -> bool:
    """Whether a schedule's branches over ``seq_len`` positions can write into slots merged once
    (:func:`not_slotted_reason` of its effective branches is None)."""
    segs, rates = effective_branches(seq_len, num_heads, segment_lengths, dilation_rates)
    groups = plan_branches(seq_len, num_heads, segs, rates)
    return not_slotted_reason(groups, seq_len, num_kv_heads) is None


@functools.lru_cache(maxsize=256)
def slot_plan(
    groups: tuple[RowGroup, ...], seq_len: int, num_kv_heads: int, causal: bool
) -> Plan:
    """The plan of ``groups`` (:func:`not_slotted_reason` None) with every branch's calls
    writing into a slot of its own (Note [Branch slots merged once]): the view calls of
    :func:`strided_calls`, and one whole-segment view call for a rate of 1. A branch's slot has
    the segment length of its whole segments (a shorter last one is a run of its own)."""
    lengths: dict[int, int] = {}
    rates: dict[int, int] = {}
    for group in groups:
        lengths[group.branch] = max(lengths.get(group.branch, 0), group.segment_len)
        rates[group.branch] = group.rate
    index = {branch: i for i, branch in enumerate(sorted(lengths))}
    calls: list[StridedCall] = []
    for group in groups:
        views = strided_calls(group, num_kv_heads, causal)
        if views is None:  # rate 1: every head's whole segments
            n, length = group.num_segments, group.segment_len
            views = (StridedCall(group.start, n, length, 1, 0, slice(None), causal),)
        calls.extend(call.in_slot(index[group.branch], lengths[group.branch]) for call in views)
    slots = tuple(Slot(lengths[branch], rates[branch]) for branch in sorted(lengths))
    return Plan(tuple(calls), slots=slots)


def not_strided_reason(group: RowGroup, num_kv_heads: int) -> str | None:
    """Why the group's rows are not strided views of q, k and v (so a kernel that reads strided
    rows still gets them gathered), or None where they are (:func:`strided_calls`)."""
    rate, heads = group.rate, group.num_heads
    if rate == 1:
        return "rate 1: whole segments (views only when every head reads them)"
    if group.offsets != tuple(h % rate for h in group.heads):
        return "the call's heads start at a layer head whose offset is not 0: rows gathered"
    offsets = sorted(set(group.offsets))
    if any(kv_head_slice(s, rate, heads, num_kv_heads) is None for s in offsets):
        return (
            f"GQA: the key/value heads of an offset class ({heads} query heads over "
            f"{num_kv_heads}) are not one strided slice"
        )
    return None


@functools.lru_cache(maxsize=256)
def strided_calls(
    group: RowGroup, num_kv_heads: int, causal: bool
) -> tuple[StridedCall, ...] | None:
    """The group as one :class:`StridedCall` per offset class of its heads, or one
    ``DiagonalCall`` per run of :func:`diagonal_runs` where those are fewer (Note [Diagonal head
    calls] in ``strided.py``), or None where its rows are not strided views
    (:func:`not_strided_reason`)."""
    if not_strided_reason(group, num_kv_heads) is not None:
        return None
    rate, heads = group.rate, group.num_heads
    start, n, length = group.start, group.num_segments, group.segment_len
    group_size = heads // num_kv_heads
    runs = diagonal_runs(group, group_size)
    # Above the rate, a key/value head's query heads repeat offsets: its runs would write the
    # same key rows (Note [Diagonal head calls]); its offset classes sum them in the kernel.
    if group_size <= rate and len(runs) < len(set(group.offsets)):
        return tuple(
            DiagonalCall(start, n, length, rate, first, count, causal, group_size)
            for first, count in runs
        )
    kv_slices = {s: kv_head_slice(s, rate, heads, num_kv_heads) for s in sorted(set(group.offsets))}
    return tuple(
        StridedCall(start, n, length, rate, s, kv, causal)
        for s, kv in kv_slices.items()
        if kv is not None
    )


def diagonal_runs(group: RowGroup, group_size: int = 1) -> tuple[tuple[int, int], ...]:
    """``(first head, head count)`` of each maximal run of the group's heads that are
    consecutive with consecutive offsets and, with GQA (``group_size`` query heads per
    key/value head), share one key/value head: one diagonal call each (Note [Diagonal head
    calls] in ``strided.py``)."""
    runs: list[list[int]] = []
    for head in sorted(group.heads):
        last = runs[-1][0] + runs[-1][1] - 1 if runs else None
        # head - 1 is at the previous offset unless the offsets wrap, and shares head's
        # key/value head unless head starts a group.
        follows = last == head - 1 and head % group.rate != 0
        if follows and (group_size == 1 or head % group_size != 0):
            runs[-1][1] += 1
        else:
            runs.append([head, 1])
    return tuple((first, count) for first, count in runs)


def describe_plan(
    groups: tuple[RowGroup, ...],
    seq_len: int,
    num_kv_heads: int,
    strided: bool,
    writes_into: bool = False,
) -> tuple[str, ...]:
    """One line per row group saying how :func:`branch_plan` runs it on a kernel that reads
    strided rows (``strided``) or not: as views (how many calls, from :func:`strided_calls`) or
    gathered, and why; on one that also writes into given buffers (``writes_into``), whether
    the results go into branch slots merged once (:func:`slot_plan`) or why not."""
    if covers_all_once(groups, seq_len):
        return (f"w={seq_len} r=1: one dense call over all {V.counted(seq_len, 'position')}",)
    merge, slotted = "", False
    if strided and writes_into:
        reason = not_slotted_reason(groups, seq_len, num_kv_heads)
        slotted = reason is None
        merge = (
            "; written into the branch's slot, merged once with the other branches"
            if slotted
            else f"; merged as it comes (no branch slots: {reason})"
        )
    group_size = groups[0].num_heads // num_kv_heads if groups else 1
    lines = []
    for group in groups:
        where = (
            f"w={group.segment_len} r={group.rate}, positions {group.start}..{group.stop - 1} "
            f"({group.num_segments} segment{'s' if group.num_segments > 1 else ''}, heads "
            f"{_heads(group.heads)})"
        )
        views = strided_calls(group, num_kv_heads, False) if strided else None
        if group.is_dense:
            path = "one call on the segments as they are (a reshape, no gather)"
        elif not strided:
            path = "rows gathered into one call: the kernel does not read strided rows"
        elif views is None:
            path = f"rows gathered into one call: {not_strided_reason(group, num_kv_heads)}"
        elif isinstance(views[0], DiagonalCall):
            sizes = sorted({call.num_heads for call in views if isinstance(call, DiagonalCall)})
            heads = f"{len(views)} diagonal call(s) of {'/'.join(map(str, sizes))} heads"
            path = f"{heads} on strided views (no gather)"
        else:
            path = f"{len(views)} offset-class call(s) on strided views (no gather)"
        if slotted and group.num_segments > 1 and group.stop < seq_len:
            path += (
                ", one batch element at a time (whole segments before a shorter last one are "
                "one view only within a batch element)"
            )
        key_slots = ""
        if slotted and group_size > 1:  # Note [Key slots of GQA plans] in key_slots.py
            by_queries = query_layout(group.rate, group_size)
            key_slots = f" (GQA: dk, dv in key slots by {_KEY_LAYOUTS[by_queries]})"
        lines.append(f"{where}: {path}{merge}{key_slots}")
    return tuple(lines)


#: How a GQA plan's key slot of a branch is laid out (Note [Key slots of GQA plans]), by
#: whether its rate is a multiple of the group.
_KEY_LAYOUTS = {False: "position", True: "the query slots' layout"}


def _heads(heads: tuple[int, ...]) -> str:
    """``0-7`` for consecutive heads, else the list."""
    if heads == tuple(range(heads[0], heads[-1] + 1)):
        return f"{heads[0]}-{heads[-1]}" if len(heads) > 1 else str(heads[0])
    return ",".join(map(str, heads))


def effective_branches(
    seq_len: int, num_heads: int, segs: tuple[int, ...], rates: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The schedule with every ``(w, r)`` replaced by the smallest pair of the same geometry.

    Note [Effective branches]
        ``w > N`` is one segment, the same as ``w = N``. A rate ``r >= max(w, H)`` (w now at most
        N) gives head ``j`` the offset ``j`` and one row per segment (``j + r`` lies outside it),
        the same as ``r = max(w, H)``. So the kernels never see a length or rate above
        ``max(N, H)``: huge values (up to the 2**63 - 1 validation allows) cannot overflow the
        int64 index or stride arithmetic of any kernel (seen: w = r = 2**63 - 1 gave a wrong
        result on the fused Triton kernels), and such schedules share compiled kernels.
    """
    eff_segs = tuple(min(w, seq_len) for w in segs)
    eff_rates = tuple(min(r, max(w, num_heads)) for w, r in zip(eff_segs, rates, strict=True))
    return eff_segs, eff_rates
