"""One dilated schedule, and its geometry over one sequence: computed once, read by every path.

Note [One schedule object]
    A schedule is its branches ``(w, r)``. Over ``N`` positions with ``H`` query and ``Hkv``
    key/value heads it has one geometry: the effective branches (Note [Effective branches]:
    ``w > N`` clipped, huge rates reduced), their row groups (Note [Row groups]), whether the
    branches can write into slots merged once (Note [Branch slots merged once]) and, if not,
    why. :meth:`Schedule.at` computes that :class:`ScheduleLayout` once per
    ``(schedule, N, H, Hkv)`` (cached), and the resolve step, ``explain()``, the plans and the
    ring's split of local and spanning branches all read it, so no two of them can disagree.
    :meth:`ScheduleLayout.sharded` splits the branches of a sequence sharded across ranks into
    the local ones, whose segments each lie inside one rank's chunk, and the spanning ones
    (Note [Local and spanning branches] in ``distributed/rings/ring_dilated.py``), also once.

Note [Heads from a later layer head]
    A call may hold a slice of a layer's heads: after a head all-to-all (Note [Head
    all-to-all] in ``distributed/rings/ulysses.py``) a rank computes the layer's heads ``j0 .. j0 +
    H - 1``, and head ``h`` of the call must keep the layer head's offset ``(j0 + h) mod r``.
    The layout then takes ``first_head = j0``: the effective rates are clipped for the layer's
    ``j0 + H`` heads (a rate at or above them leaves every head its own offset), and the row
    groups carry the shifted offsets, which the gathered calls read (:meth:`RowGroup.index`)
    and our fused kernels take as the launch's first head. Strided views and branch slots lay
    head ``h`` at offset ``h mod r``, so a shifted layout gathers its rows instead
    (``not_strided_reason``). Where ``j0`` is a multiple of every rate nothing moves, and the
    layout is the unshifted one.

Shape legend: N positions, H query heads, Hkv key/value heads.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ... import _validation as V
from .segment import RowGroup, effective_branches, not_slotted_reason, plan_branches

__all__ = ["Schedule", "ScheduleLayout", "ShardedBranches"]


@dataclass(frozen=True)
class ScheduleLayout:
    """A schedule's geometry over ``seq_len`` positions (:meth:`Schedule.at`).

    Attributes:
        seq_len: N.
        num_heads: H.
        num_kv_heads: Hkv.
        segment_lengths: the effective segment lengths (each at most N).
        dilation_rates: the effective rates.
        groups: the row groups of the effective branches.
        not_slotted: why the branches cannot write into slots merged once (None: they can).
        first_head: the layer head that head 0 is, where that moves any head's offset (else 0).
    """

    seq_len: int
    num_heads: int
    num_kv_heads: int
    segment_lengths: tuple[int, ...]
    dilation_rates: tuple[int, ...]
    groups: tuple[RowGroup, ...]
    not_slotted: str | None
    first_head: int = 0

    @property
    def in_slots(self) -> bool:
        """Whether the branches can write into slots merged once."""
        return self.not_slotted is None

    @property
    def branches(self) -> tuple[tuple[int, int], ...]:
        """The effective ``(w, r)`` pairs."""
        return tuple(zip(self.segment_lengths, self.dilation_rates, strict=True))

    def sharded(self, world_size: int, chunk_len: int) -> ShardedBranches:
        """The branches split for this sequence sharded across ``world_size`` ranks in chunks of
        ``chunk_len`` positions (one chunk per rank, or two under the zigzag layout; cached).
        ``seq_len`` is ``world_size`` times a rank's positions, a multiple of ``chunk_len``."""
        return _sharded(self, world_size, chunk_len)


@dataclass(frozen=True)
class ShardedBranches:
    """A schedule's branches over a sequence sharded across ranks (:meth:`ScheduleLayout.sharded`).

    Attributes:
        world_size: W.
        chunk_len: positions per chunk; a rank holds ``local_len // chunk_len`` chunks.
        local_len: n = N / W, a rank's positions.
        num_heads, num_kv_heads: H, Hkv.
        local: the effective ``(w, r)`` whose segments each lie inside one chunk
            (``chunk_len % min(w, N) == 0``), in schedule order: a rank runs them alone.
        spanning: the other effective branches, in schedule order: their rows cross ranks.
        groups: the local branches' row groups over a rank's n positions.
        not_slotted: why the local branches cannot write into branch slots merged once (None:
            they can).
        first_head: the layer head that head 0 is (Note [Heads from a later layer head]).
    """

    world_size: int
    chunk_len: int
    local_len: int
    num_heads: int
    num_kv_heads: int
    local: tuple[tuple[int, int], ...]
    spanning: tuple[tuple[int, int], ...]
    groups: tuple[RowGroup, ...]
    not_slotted: str | None
    first_head: int = 0

    @property
    def in_slots(self) -> bool:
        """Whether the local branches (at least one) can write into slots merged once."""
        return self.not_slotted is None


@dataclass(frozen=True)
class Schedule:
    """A dilated schedule: ``segment_lengths[i]`` and ``dilation_rates[i]`` per branch.

    Raises:
        ValueError / TypeError: an invalid schedule (the message names the argument).
    """

    segment_lengths: tuple[int, ...]
    dilation_rates: tuple[int, ...]

    def __post_init__(self) -> None:
        segs, rates = V.check_branches(self.segment_lengths, self.dilation_rates)
        object.__setattr__(self, "segment_lengths", segs)
        object.__setattr__(self, "dilation_rates", rates)

    def at(
        self, seq_len: int, num_heads: int, num_kv_heads: int, first_head: int = 0
    ) -> ScheduleLayout:
        """The geometry over ``seq_len`` positions with these head counts (cached);
        ``first_head``: the layer head that head 0 is (Note [Heads from a later layer head])."""
        return _layout(self, seq_len, num_heads, num_kv_heads, first_head)

    def __str__(self) -> str:
        return (
            f"segment_lengths={list(self.segment_lengths)}, "
            f"dilation_rates={list(self.dilation_rates)}"
        )


@functools.lru_cache(maxsize=256)
def _layout(
    schedule: Schedule, seq_len: int, num_heads: int, num_kv_heads: int, first_head: int
) -> ScheduleLayout:
    segs, rates = effective_branches(
        seq_len, first_head + num_heads, schedule.segment_lengths, schedule.dilation_rates
    )
    if all(first_head % r == 0 for r in rates):  # every head keeps its offset h mod r
        first_head = 0
    groups = plan_branches(seq_len, num_heads, segs, rates, first_head)
    return ScheduleLayout(
        seq_len=seq_len,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        segment_lengths=segs,
        dilation_rates=rates,
        groups=groups,
        not_slotted=not_slotted_reason(groups, seq_len, num_kv_heads),
        first_head=first_head,
    )


@functools.lru_cache(maxsize=64)
def _sharded(layout: ScheduleLayout, world_size: int, chunk_len: int) -> ShardedBranches:
    seq_len = layout.seq_len
    local_len = seq_len // world_size
    branches = layout.branches
    local = tuple(b for b in branches if chunk_len % min(b[0], seq_len) == 0)
    spanning = tuple(b for b in branches if b not in local)
    groups: tuple[RowGroup, ...] = ()
    if local:
        segs, rates = tuple(b[0] for b in local), tuple(b[1] for b in local)
        groups = plan_branches(local_len, layout.num_heads, segs, rates, layout.first_head)
    not_slotted = (
        not_slotted_reason(groups, local_len, layout.num_kv_heads) if groups else "no local branch"
    )
    return ShardedBranches(
        world_size=world_size,
        chunk_len=chunk_len,
        local_len=local_len,
        num_heads=layout.num_heads,
        num_kv_heads=layout.num_kv_heads,
        local=local,
        spanning=spanning,
        groups=groups,
        not_slotted=not_slotted,
        first_head=layout.first_head,
    )
