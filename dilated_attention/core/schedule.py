"""One dilated schedule, and its geometry over one sequence: computed once, read by every path.

Note [One schedule object]
    A schedule is its branches ``(w, r)``. Over ``N`` positions with ``H`` query and ``Hkv``
    key/value heads it has one geometry: the effective branches (Note [Effective branches]:
    ``w > N`` clipped, huge rates reduced), their row groups (Note [Row groups]), whether the
    branches can write into slots merged once (Note [Branch slots merged once]) and, if not,
    why. :meth:`Schedule.at` computes that :class:`ScheduleLayout` once per
    ``(schedule, N, H, Hkv)`` (cached), and the resolve step, ``explain()``, the plans and the
    ring's split of local and spanning branches all read it, so no two of them can disagree.

Shape legend: N positions, H query heads, Hkv key/value heads.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .. import _validation as V
from .segment import RowGroup, effective_branches, not_slotted_reason, plan_branches

__all__ = ["Schedule", "ScheduleLayout"]


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
    """

    seq_len: int
    num_heads: int
    num_kv_heads: int
    segment_lengths: tuple[int, ...]
    dilation_rates: tuple[int, ...]
    groups: tuple[RowGroup, ...]
    not_slotted: str | None

    @property
    def in_slots(self) -> bool:
        """Whether the branches can write into slots merged once."""
        return self.not_slotted is None

    @property
    def branches(self) -> tuple[tuple[int, int], ...]:
        """The effective ``(w, r)`` pairs."""
        return tuple(zip(self.segment_lengths, self.dilation_rates, strict=True))


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

    def at(self, seq_len: int, num_heads: int, num_kv_heads: int) -> ScheduleLayout:
        """The geometry over ``seq_len`` positions with these head counts (cached)."""
        return _layout(self, seq_len, num_heads, num_kv_heads)

    def __str__(self) -> str:
        return (
            f"segment_lengths={list(self.segment_lengths)}, "
            f"dilation_rates={list(self.dilation_rates)}"
        )


@functools.lru_cache(maxsize=256)
def _layout(schedule: Schedule, seq_len: int, num_heads: int, num_kv_heads: int) -> ScheduleLayout:
    segs, rates = effective_branches(
        seq_len, num_heads, schedule.segment_lengths, schedule.dilation_rates
    )
    groups = plan_branches(seq_len, num_heads, segs, rates)
    return ScheduleLayout(
        seq_len=seq_len,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        segment_lengths=segs,
        dilation_rates=rates,
        groups=groups,
        not_slotted=not_slotted_reason(groups, seq_len, num_kv_heads),
    )
