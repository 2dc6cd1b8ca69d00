"""A fused call's plan is made once per (shapes, options) and kept (Note [A fused call planned
once] in ``core/execution/fused.py``): a second call makes none and launches exactly what the
first did; what the plan depends on (the shapes, the options, the module's group limits) makes
another plan; and a call with ``extra`` gets no graph key."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dilated_attention.core.execution import fused

BRANCHES = ((32, 1), (64, 2), (128, 4))


class _Recording:
    """A fused backend that records every launch (direction, span, heads, merge flags) and
    the key each call's launches run under."""

    def __init__(self) -> None:
        self.launches: list[tuple[Any, ...]] = []
        self.keys: list[Any] = []
        self.scratch: list[int] = []

    def run_launches(self, key: Any, tensors: Any, launches: Any, keep: object = None) -> None:
        self.keys.append(key)
        self.scratch.append(0 if tensors[-1] is None else tensors[-1].numel())
        launches()

    def forward_branch(self, q: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        span = args[5]
        self.launches.append(("fwd", span, q.shape[2], kwargs["merge"], kwargs["head0"]))

    def row_delta(self, *args: Any) -> None:
        self.launches.append(("delta", args[2], args[3]))

    def backward_branch(self, *args: Any, **kwargs: Any) -> None:
        span = args[10]
        self.launches.append(("bwd", span, args[1].shape[2], kwargs["part"], kwargs["accumulate"]))


def _call(backend: _Recording, n: int = 256, batch: int = 1, **options: Any) -> None:
    """One fused forward and backward of (batch, n, 8, 16) queries with 4 key/value heads."""
    q = torch.randn(batch, n, 8, 16)
    k, v = torch.randn(batch, n, 4, 16), torch.randn(batch, n, 4, 16)
    opts = {"is_causal": True, "scale": 0.25} | options
    out, lse = fused.fused_forward(q, k, v, None, BRANCHES, backend, **opts)  # type: ignore[arg-type]
    fused.fused_backward(out, q, k, v, out, lse, None, BRANCHES, backend, **opts)  # type: ignore[arg-type]


def test_a_second_call_makes_no_plan_and_launches_the_same() -> None:
    fused._plan.cache_clear()
    first, second = _Recording(), _Recording()
    _call(first)
    made = fused._plan.cache_info().misses
    _call(second)
    assert fused._plan.cache_info().misses == made
    assert made == 2  # one forward plan, one backward plan
    assert second.launches == first.launches and second.keys == first.keys
    assert len(first.launches) > len(BRANCHES) * 2  # every branch forward and backward ran


def test_another_length_makes_another_plan() -> None:
    """The graph key leaves the shapes to the tensors' addresses; the plan holds them."""
    short, longer = _Recording(), _Recording()
    _call(short)
    _call(longer, n=320)
    assert {launch[1].end for launch in short.launches if launch[0] != "delta"} == {256}
    assert {launch[1].end for launch in longer.launches if launch[0] != "delta"} == {320}


def test_another_batch_makes_another_scratch() -> None:
    """The scratch holds every batch row of a group: two rows, twice the cells."""
    one, two = _Recording(), _Recording()
    _call(one)
    _call(two, batch=2)
    assert min(one.scratch) > 0 and two.scratch == [2 * cells for cells in one.scratch]


def test_packed_documents_are_planned_per_call() -> None:
    """A batch's documents change every step: their plans are made afresh, not kept."""
    kept = fused._plan.cache_info().currsize
    packed, again = _Recording(), _Recording()
    _call(packed, documents=(0, 100, 256))
    _call(again, documents=(0, 100, 256))
    assert fused._plan.cache_info().currsize == kept
    assert {launch[1].start for launch in packed.launches if launch[0] == "fwd"} == {0}
    assert again.launches == packed.launches


@pytest.mark.parametrize(
    "change",
    [{"is_causal": False}, {"scale": 0.5}, {"softcap": 30.0}, {"first_head": 2}],
    ids=["causal", "scale", "softcap", "first-head"],
)
def test_each_option_makes_another_key(change: dict[str, Any]) -> None:
    base, changed = _Recording(), _Recording()
    _call(base)
    _call(changed, **change)
    assert changed.keys[0] != base.keys[0] and changed.keys[1] != base.keys[1]


def test_changed_group_limits_make_another_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """The module's limits are read on every call: a plan made under other limits is not
    taken (tests and tuning change them)."""
    whole = _Recording()
    _call(whole, n=512)
    monkeypatch.setattr(fused, "MIN_GROUP_POSITIONS", 128)
    monkeypatch.setattr(fused, "GROUPS_PER_SEQUENCE", 4)
    grouped = _Recording()
    _call(grouped, n=512)
    starts = {launch[1].start for launch in grouped.launches if launch[0] == "fwd"}
    assert starts == {0, 128, 256, 384}
    assert {launch[1].start for launch in whole.launches if launch[0] == "fwd"} == {0}
    assert grouped.keys[0] != whole.keys[0]


def test_a_call_with_extra_results_gets_no_graph_key() -> None:
    backend = _Recording()
    q = torch.randn(1, 128, 8, 16)
    k = v = torch.randn(1, 128, 4, 16)
    fused.fused_forward(
        q, k, v, None, BRANCHES, backend, is_causal=True, scale=0.25,  # type: ignore[arg-type]
        extra=lambda *args: None,
    )  # fmt: skip
    fused.fused_forward(q, k, v, None, BRANCHES, backend, is_causal=True, scale=0.25)  # type: ignore[arg-type]
    assert backend.keys[0] is None and backend.keys[1] is not None
