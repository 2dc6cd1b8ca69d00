"""Compiling a shape family ahead (``backends/triton_kernels/compile.py``): recorded launches keep
no tensor alive, distinct specializations compile once, forked children compile into the cache
and the parent always compiles everything itself as well (so a failed, hung or disabled child
costs time, never a kernel). Fake kernels stand in for Triton's: no GPU or Triton needed."""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dilated_attention.backends.triton_kernels import compile as tc

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


class FakeKernel:
    """Records every ``warmup`` as (pid, args) in a file, so the parent sees what children did;
    ``behaviour`` in a child: ``"ok"``, ``"raise"`` or ``"hang"``."""

    def __init__(self, log: Path, behaviour: str = "ok") -> None:
        self.log, self.behaviour, self.parent = log, behaviour, os.getpid()

    def warmup(self, *args: Any, grid: tuple[int, ...], **kwargs: Any) -> Any:
        in_child = os.getpid() != self.parent
        if in_child and self.behaviour == "raise":
            raise RuntimeError("compile failed")
        if in_child and self.behaviour == "hang":
            time.sleep(60)
        with self.log.open("a") as f:
            f.write(f"{os.getpid()} {args[1]} {kwargs['BLOCK']}\n")
        return SimpleNamespace(src="src", metadata="meta")

    def calls(self) -> list[tuple[bool, str]]:
        """(in a child, "arg block") per warmup so far."""
        if not self.log.exists():
            return []
        rows = [line.split(" ", 1) for line in self.log.read_text().splitlines()]
        return [(int(pid) != self.parent, rest) for pid, rest in rows]


@pytest.fixture
def fake_driver(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> SimpleNamespace:
    driver = SimpleNamespace(
        get_current_device=lambda: 0,
        get_current_stream=lambda device=None: 0,
        get_current_target=lambda: "sm90",
        launcher_cls=lambda src, metadata: None,
    )
    monkeypatch.setattr(tc, "_active_driver", lambda: driver)
    monkeypatch.delenv(tc.ENV_VAR, raising=False)
    # One marker per set of launches, in the test's own directory.
    monkeypatch.setattr(
        tc, "_marker", lambda launches: str(tmp_path / "markers" / str(len(launches)))
    )
    return driver


def _launches(kernel: FakeKernel, values: list[int]) -> list[tc.Launch]:
    x = torch.zeros(8)
    return [tc.Launch.record(kernel, (1,), (x, value), {"BLOCK": 64}) for value in values]


def test_a_recorded_launch_keeps_dtype_and_alignment_not_the_tensor() -> None:
    x = torch.zeros(64, dtype=torch.bfloat16)
    aligned, shifted = tc.Launch.record(None, (1,), (x, x[1:], 3, None), {}).args[:2]
    assert aligned == tc.PointerArg(torch.bfloat16, True) and aligned.data_ptr() % 16 == 0
    assert shifted == tc.PointerArg(torch.bfloat16, False) and shifted.data_ptr() % 16 != 0
    y = torch.zeros(1 << 20)
    ref = weakref.ref(y)
    launch = tc.Launch.record(None, (1,), (y,), {})
    del y
    gc.collect()
    assert ref() is None and launch.args == (tc.PointerArg(torch.float32, True),)


def test_a_descriptor_keeps_its_block_shape_with_a_stand_in_base() -> None:
    @dataclass
    class Descriptor:  # the fields of Triton's TensorDescriptor that matter here
        base: Any
        shape: list[int]
        strides: list[int]
        block_shape: list[int]

    x = torch.zeros(4, 64, dtype=torch.float16)
    (desc,) = tc.Launch.record(None, (1,), (Descriptor(x, [4, 64], [64, 1], [2, 64]),), {}).args
    assert desc == Descriptor(tc.PointerArg(torch.float16, True), [4, 64], [64, 1], [2, 64])


def test_integers_differ_only_by_their_specialization_class() -> None:
    kernel = object()
    keys = {tc.Launch.record(kernel, (1,), (n,), {}).specialization() for n in (3, 5, 7)}
    assert len(keys) == 1
    classes = {tc.Launch.record(kernel, (1,), (n,), {}).specialization() for n in (1, 3, 32)}
    assert len(classes) == 3


def test_children_compile_every_distinct_launch_and_the_parent_loads_each(
    tmp_path: Path, fake_driver: SimpleNamespace
) -> None:
    kernel = FakeKernel(tmp_path / "log")
    tc.compile_launches(_launches(kernel, [1, 3, 5, 32, 48]), workers=4)
    calls = kernel.calls()
    distinct = {"1 64", "3 64", "32 64"}  # 3 and 5 are one specialization, 32 and 48 too
    assert {rest for child, rest in calls if child} == distinct
    assert sorted(rest for child, rest in calls if not child) == sorted(distinct)


@pytest.mark.parametrize("behaviour", ["raise", "hang"])
def test_a_failed_or_hung_child_costs_time_not_kernels(
    tmp_path: Path, fake_driver: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, behaviour: str
) -> None:
    monkeypatch.setattr(tc, "CHILD_TIMEOUT_S", 1.0)
    kernel = FakeKernel(tmp_path / "log", behaviour)
    started = time.monotonic()
    tc.compile_launches(_launches(kernel, [1, 3]), workers=2)
    assert time.monotonic() - started < 30
    calls = kernel.calls()
    assert not any(child for child, _ in calls)
    assert sorted(rest for _, rest in calls) == ["1 64", "3 64"]


def test_the_environment_variable_keeps_compiles_in_this_process(
    tmp_path: Path, fake_driver: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(tc.ENV_VAR, "0")
    kernel = FakeKernel(tmp_path / "log")
    tc.compile_launches(_launches(kernel, [1, 3]), workers=2)
    assert kernel.calls() == [(False, "1 64"), (False, "3 64")]


def test_a_set_compiled_once_forks_nothing_in_a_later_process(
    tmp_path: Path, fake_driver: SimpleNamespace
) -> None:
    kernel = FakeKernel(tmp_path / "log")
    tc.compile_launches(_launches(kernel, [1, 3]), workers=2)
    assert sum(child for child, _ in kernel.calls()) == 2
    (tmp_path / "log").unlink()
    tc.compile_launches(_launches(kernel, [1, 3]), workers=2)  # its marker exists now
    assert kernel.calls() == [(False, "1 64"), (False, "3 64")]


def test_a_family_another_process_is_compiling_is_waited_for_then_loaded(
    tmp_path: Path, fake_driver: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Processes of one machine wanting one family: while one holds the family's lock the
    other waits, then finds the marker and forks nothing (it only loads)."""
    fcntl = pytest.importorskip("fcntl")
    kernel = FakeKernel(tmp_path / "log")
    launches = _launches(kernel, [1, 3])
    marker = tc._marker(launches)
    os.makedirs(os.path.dirname(marker))
    holder = os.open(marker + ".lock", os.O_CREAT | os.O_RDWR)  # "another process" compiling
    fcntl.flock(holder, fcntl.LOCK_EX)
    waiter = threading.Thread(target=tc.compile_launches, args=(launches,), kwargs={"workers": 2})
    waiter.start()
    time.sleep(0.5)
    assert waiter.is_alive() and kernel.calls() == []  # waiting, nothing compiled
    open(marker, "w").close()  # the other process is done
    os.close(holder)
    waiter.join(timeout=30)
    assert not waiter.is_alive()
    assert kernel.calls() == [(False, "1 64"), (False, "3 64")]  # loaded here, no child


def test_a_lock_held_too_long_is_not_waited_for_forever(
    tmp_path: Path, fake_driver: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    fcntl = pytest.importorskip("fcntl")
    monkeypatch.setattr(tc, "LOCK_TIMEOUT_S", 0.3)
    kernel = FakeKernel(tmp_path / "log")
    launches = _launches(kernel, [1, 3])
    marker = tc._marker(launches)
    os.makedirs(os.path.dirname(marker))
    holder = os.open(marker + ".lock", os.O_CREAT | os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        tc.compile_launches(launches, workers=2)
    finally:
        os.close(holder)
    assert sorted(rest for child, rest in kernel.calls() if child) == ["1 64", "3 64"]


def test_a_file_system_without_locks_is_not_waited_on(
    tmp_path: Path, fake_driver: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    fcntl = pytest.importorskip("fcntl")

    def unsupported(*args: Any) -> None:
        raise OSError(37, "No locks available")

    monkeypatch.setattr(fcntl, "flock", unsupported)
    monkeypatch.setattr(tc, "LOCK_TIMEOUT_S", 15.0)  # a wait for the lock would take this long
    kernel = FakeKernel(tmp_path / "log")
    started = time.monotonic()
    tc.compile_launches(_launches(kernel, [1, 3]), workers=2)
    assert time.monotonic() - started < 10
    assert sorted(rest for child, rest in kernel.calls() if child) == ["1 64", "3 64"]


@pytest.mark.parametrize(
    ("env", "local", "cores", "expected"),
    [(None, None, 16, 16), (None, "4", 16, 4), (None, "32", 16, 1), (None, None, 64, 16),
     ("3", "4", 16, 3), ("0", None, 16, 0)],
)  # fmt: skip
def test_compile_processes_are_this_process_share_of_its_cores(
    monkeypatch: pytest.MonkeyPatch, env: str | None, local: str | None, cores: int, expected: int
) -> None:
    for name, value in ((tc.ENV_VAR, env), ("LOCAL_WORLD_SIZE", local)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    assert tc.compile_processes() == expected


def test_a_malformed_process_count_names_the_variable(
    tmp_path: Path, fake_driver: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Raised where a compile would fork, not where the kernels are already compiled."""
    kernel = FakeKernel(tmp_path / "log")
    tc.compile_launches(_launches(kernel, [1, 3]), workers=2)  # compiled: its marker exists
    monkeypatch.setenv(tc.ENV_VAR, "many")
    tc.compile_launches(_launches(kernel, [1, 3]), workers=2)
    with pytest.raises(ValueError, match=rf"{tc.ENV_VAR} must be a whole number.*'many'"):
        tc.compile_launches(_launches(kernel, [1, 5, 32]), workers=2)


@pytest.mark.parametrize("zero", ["0", "00", " 0"])
def test_zero_processes_keep_compiles_here_whatever_its_spelling(
    tmp_path: Path, fake_driver: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, zero: str
) -> None:
    monkeypatch.setenv(tc.ENV_VAR, zero)
    kernel = FakeKernel(tmp_path / "log")
    tc.compile_launches(_launches(kernel, [1, 3]), workers=2)
    assert kernel.calls() == [(False, "1 64"), (False, "3 64")]


def test_children_are_forked_in_the_reverse_of_recording_order(
    tmp_path: Path, fake_driver: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    forked: list[list[tc.Launch]] = []

    def children(launches: list[tc.Launch], workers: int) -> Any:
        forked.append(launches)
        return iter(())

    monkeypatch.setattr(tc, "_compile_in_children", children)
    kernel = FakeKernel(tmp_path / "log")
    launches = _launches(kernel, [1, 3, 32])
    tc.compile_launches(launches, workers=4)
    assert forked == [launches[::-1]]
    assert kernel.calls() == [(False, "1 64"), (False, "3 64"), (False, "32 64")]


def test_prepare_compiler_fills_triton_state_side_by_side_and_never_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    barrier = threading.Barrier(3, timeout=10)
    met: dict[str, int] = {}

    def meet(name: str) -> None:
        barrier.wait()  # broken (and raising) unless all three run at the same time
        met[name] = threading.get_ident()
        raise RuntimeError(f"{name} failed")

    monkeypatch.setattr(tc, "_triton_key", lambda: meet("key"))
    monkeypatch.setattr(tc, "_backend_hash", lambda capability: meet(f"hash {capability}"))
    driver = SimpleNamespace(get_current_target=lambda: meet("driver"))
    monkeypatch.setattr(tc, "_active_driver", lambda: driver)
    tc.prepare_compiler((9, 0))
    assert set(met) == {"key", "hash (9, 0)", "driver"}
    assert met["driver"] == threading.get_ident() != met["key"]
