"""The resolve step's rule for a ring shard's local branches beside spanning branches: a kernel
that writes into branch slots holds a float32 output of the whole shard there, so the automatic
choice puts one first only while it fits a share of the device's memory (``priorities.json``,
the sm90 ``dilated_slots`` rule's ``max_float32_share_beside_spanning``). The device is faked:
an sm90 GPU of 80 GB."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

import dilated_attention.resolve.resolver as resolver
from dilated_attention.backends import get_backend
from dilated_attention.backends.base import KernelInputs
from dilated_attention.backends.registry import Selection
from dilated_attention.core.geometry.schedule import Schedule
from dilated_attention.resolve import Request, resolve

WORLD = 2


@pytest.fixture
def told(monkeypatch: pytest.MonkeyPatch) -> list[KernelInputs]:
    """What the resolve step tells the dilated registry, on a faked 80 GB sm90 device; the
    registry's own choice (which needs the device) is not the point and is ``math``."""
    props = types.SimpleNamespace(total_memory=80 * 10**9, major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    seen: list[KernelInputs] = []

    class Registry:
        def __init__(self, operation: str) -> None:
            pass

        def select(self, inputs: KernelInputs, backend: str | None = None) -> Selection:
            seen.append(inputs)
            return Selection(get_backend("math"), runs_plan=False)

    monkeypatch.setattr(resolver, "registry_for", Registry)
    return seen


def _shard_request(batch: int, local_len: int, kv_heads: int, head_dim: int, requires_grad: bool,
                   backend: str | None = None, whole: bool = False) -> Request:  # fmt: skip
    """One rank's shard of 16 query heads over ``WORLD`` ranks: w = 2048 local (``whole``: two
    branches of one segment each, the whole shard, r = 1 and 2), the longest segment (the whole
    sequence) spanning the ranks."""
    schedule = Schedule((2048, WORLD * local_len), (1, 16))
    if whole:
        schedule = Schedule((local_len, local_len, WORLD * local_len), (1, 2, 16))
    q = torch.empty(batch, local_len, 16, head_dim, device="meta", dtype=torch.bfloat16)
    kv = torch.empty(batch, local_len, kv_heads, head_dim, device="meta", dtype=torch.bfloat16)
    request = Request.of("dilated", q, kv, kv, schedule=schedule, shard=(WORLD, local_len),
                         backend=backend)  # fmt: skip
    return dataclasses.replace(request, device=torch.device("cuda", 0), requires_grad=requires_grad)


@pytest.mark.parametrize(
    ("batch", "local_len", "kv_heads", "requires_grad", "gib"),
    [
        (1, 262144, 16, True, None),  # out: 2 GiB, FlashAttention-4 measured faster
        (1, 1048576, 16, True, None),  # out 8 GiB; dq, dk, dv (24 GiB) per position group
        (1, 1048576, 16, False, None),  # forward only: out, 8 GiB
        (1, 1048576, 4, True, None),  # GQA: the same out
        (2, 1048576, 4, True, None),  # two rows: 16 GiB
        (3, 1048576, 4, True, "24.0"),  # three: over a quarter of 75 GiB
        (1, 4194304, 16, False, "32.0"),
    ],
)
def test_slots_first_only_where_the_float32_results_fit(
    batch: int, local_len: int, kv_heads: int, requires_grad: bool, gib: str | None,
    told: list[KernelInputs],
) -> None:  # fmt: skip
    """The registry hears that the local branches run in slots (its FlashAttention-4 rule's
    condition) only while the shard's float32 ``out`` takes at most a quarter of the device
    (the gradients are summed per position group); else ``describe()``'s notes say why."""
    split = Schedule((2048, WORLD * local_len), (1, 16)).at(WORLD * local_len, 16, kv_heads)
    assert split.sharded(WORLD, local_len).spanning
    strategy = resolve(_shard_request(batch, local_len, kv_heads, 128, requires_grad))
    assert [inputs.branch_slots for inputs in told] == [gib is None]
    notes = "\n".join(strategy.notes)
    assert ("branch slots not put first" in notes) is (gib is not None)
    if gib is not None:
        assert f"float32 results ({gib} GiB), over 25% of the device's 75 GiB" in notes


@pytest.mark.parametrize(("head_dim", "backend"), [(128, "flash_attn4"), (256, None)])
def test_no_note_where_nothing_would_be_put_first(
    head_dim: int, backend: str | None, told: list[KernelInputs]
) -> None:
    """A kernel named by the caller, or a head dim past the rule's: the automatic choice would
    not put slots first anyway, so the inputs keep their slots and no note is added."""
    strategy = resolve(_shard_request(1, 1048576, 16, head_dim, True, backend=backend))
    assert [inputs.branch_slots for inputs in told] == [True]
    assert not any("branch slots not put first" in note for note in strategy.notes)


def test_a_shard_without_spanning_branches_keeps_its_slots(told: list[KernelInputs]) -> None:
    """One rank: every branch local, nothing merges into float32 results of the shard."""
    schedule = Schedule((2048, 1048576), (1, 16))
    q = torch.empty(1, 1048576, 16, 128, device="meta", dtype=torch.bfloat16)
    request = Request.of("dilated", q, q, q, schedule=schedule, shard=(1, 1048576))
    request = dataclasses.replace(request, device=torch.device("cuda", 0), requires_grad=True)
    strategy = resolve(request)
    assert [inputs.branch_slots for inputs in told] == [True]
    assert not any("branch slots not put first" in note for note in strategy.notes)


def test_gradients_of_the_whole_shard_count_where_the_plan_cannot_be_cut(
    told: list[KernelInputs],
) -> None:
    """Local branches whose one segment is the whole shard leave no position group to cut the
    backward into: their float32 dq, dk, dv of the whole shard (24 GiB at 1M tokens) count."""
    request = _shard_request(1, 1048576, 16, 128, True, whole=True)
    notes = "\n".join(resolve(request).notes)
    assert [inputs.branch_slots for inputs in told] == [False]
    assert "float32 results (24.0 GiB), over 25% of the device's 75 GiB" in notes
    told.clear()
    resolve(_shard_request(1, 1048576, 16, 128, False, whole=True))
    assert [inputs.branch_slots for inputs in told] == [True]  # forward only: out, 8 GiB
