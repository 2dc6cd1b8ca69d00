"""A plan: the kernel calls of one attention call, and how the executor runs them (Note [One
executor] in ``executor.py``)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .calls import Call, WholeCall
from .slots import Slot


@dataclass(frozen=True)
class PositionGroup:
    """The calls of a plan cut to positions ``[start, end)``, in the coordinates of
    ``x[:, start:end]`` (Note [Position-grouped plans] in ``grouped.py``)."""

    start: int
    end: int
    calls: tuple[Call, ...]


@dataclass(frozen=True)
class Plan:
    """The kernel calls of one attention call.

    Attributes:
        calls: in the order they run (the backward replays them in the same order).
        groups: when not empty, the same calls cut into position groups, which the executor
            runs one batch element and group at a time with float32 scratch of the group's size
            (Note [Position-grouped plans]); ``calls`` still describes the whole plan.
        grouped_forward: the forward runs the groups too (a call without gradients); else it
            runs ``calls`` and only the backward runs the groups.
        slots: when not empty, each call writes into the slot ``call.slot`` of its branch and
            the slots merge once (Note [Branch slots merged once] in ``slots.py``); else every
            result merges into float32 accumulators as it comes.
        spanning: with ``groups``, the calls of the slots whose segments span groups: they run
            whole, once, before the groups, which read their parts of those slots.
        whole: a single :class:`WholeCall`: its kernel's results and gradients are the plan's,
            with no accumulators or merge.
        one_call: a single call that reads every query row as it is (``reads_all_queries``): its
            kernel's results are the plan's forward (its gradients may still need scattering).
    """

    calls: tuple[Call, ...]
    groups: tuple[PositionGroup, ...] = ()
    grouped_forward: bool = False
    slots: tuple[Slot, ...] = ()
    spanning: tuple[Call, ...] = ()

    # Read on every run of the plan (a dense request's plan is made once): derived once.
    @functools.cached_property
    def whole(self) -> bool:
        return len(self.calls) == 1 and isinstance(self.calls[0], WholeCall)

    @functools.cached_property
    def one_call(self) -> bool:
        return len(self.calls) == 1 and getattr(self.calls[0], "reads_all_queries", False)

    @classmethod
    def dense(cls, is_causal: bool) -> Plan:
        return cls((WholeCall(is_causal),))
