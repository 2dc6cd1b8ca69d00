"""Position-grouped plans on the CPU (Note [Position-grouped plans] in
``core/geometry/grouped.py``)."""

from __future__ import annotations

import pytest

import dilated_attention.core.execution.fused as fused
import dilated_attention.core.geometry.grouped as grouped


def cut_small(monkeypatch: pytest.MonkeyPatch | None) -> None:
    """Cut plans on the CPU too, into groups as small as the segments allow, whatever the
    scratch, forward and backward. Without ``monkeypatch`` (a spawned process of its own) the
    settings stay for the process."""
    set_ = setattr if monkeypatch is None else monkeypatch.setattr
    set_(grouped, "GROUPED_DEVICES", frozenset({"cpu", "cuda"}))
    set_(fused, "MIN_GROUP_POSITIONS", 1)
    set_(grouped, "MIN_SLOT_GROUP_POSITIONS", 1)
    set_(fused, "GROUPS_PER_SEQUENCE", 1000)
    set_(fused, "SCRATCH_SHARE", 1000)
