"""The benchmarks' timing harness (``benchmarks/_timing.py``): what is alive while it measures,
what the host's time counts, and how ``bench_dilated.py`` takes its paths and its command line."""

from __future__ import annotations

import collections
import shlex
import sys
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import _timing
from _timing import time_captured_fwd_and_fwd_bwd, time_cuda, time_fwd_and_fwd_bwd, timed_call


def test_upstream_gradient_exists_only_for_forward_and_backward() -> None:
    """The forward's measurement runs before the upstream gradient is made, so its peak memory
    holds what a forward needs and not ``dout``; forward+backward uses the one ``dout`` made,
    and differentiates into the leaves."""
    x = torch.randn(4, 3, requires_grad=True)
    events: list[str] = []

    def forward() -> torch.Tensor:
        events.append("grad" if torch.is_grad_enabled() else "no_grad")
        return x * 2.0

    def make_dout() -> torch.Tensor:
        events.append("dout")
        return torch.ones(4, 3)

    result = time_fwd_and_fwd_bwd(forward, [x], make_dout, warmup=1, repeats=2,
                                  device=torch.device("cpu"))  # fmt: skip
    assert events == ["no_grad"] * 3 + ["dout"] + ["grad"] * 3
    assert set(result) == {"fwd_ms", "fwd_host_ms", "fwd_bwd_ms", "fwd_bwd_host_ms"}
    assert x.grad is None


def test_steady_calls_are_issued_back_to_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """``steady_calls`` (Note [Host time after a wait]): two untimed calls, then ``calls`` timed
    ones in rounds between CUDA events, none separated by a synchronisation (one after the
    last); the median of the timed calls' own wall times and the median over the rounds of the
    device time per call, in ms. Timed on two clocks each call advances, the host's by its
    wall time and the device's (which the events read) by twice that plus 1 ms, so a device
    time taken from the host's clock, or a host time from the device's, fails."""
    now = [0.0]
    device_now = [0.0]
    events: list[str] = []

    class Event:
        def __init__(self, enable_timing: bool) -> None:
            assert enable_timing
            self.at = None

        def record(self) -> None:
            events.append("event")
            self.at = device_now[0]

        def elapsed_time(self, stop: Event) -> float:
            return (stop.at - self.at) * 1e3

    monkeypatch.setattr(_timing, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(_timing.torch.cuda, "synchronize", lambda: events.append("sync"))
    monkeypatch.setattr(_timing.torch.cuda, "Event", Event)
    durations = iter([0.5, 0.5, 0.001, 0.004, 0.002, 0.003, 0.012, 0.006, 0.004, 0.004, 0.004])

    def call() -> None:
        events.append("call")
        seconds = next(durations)
        now[0] += seconds
        device_now[0] += 2 * seconds + 0.001

    loop = _timing.steady_calls(call, calls=10)  # 3 rounds of 3 calls
    assert loop["host_ms"] == pytest.approx(4.0)
    assert loop["ms"] == pytest.approx(9.0)  # device rounds of 17, 45 and 27 ms
    round_events = ["event"] + ["call"] * 3 + ["event"]
    assert events == ["call"] * 2 + round_events * 3 + ["sync"]


def test_short_calls_are_timed_until_min_ms_is_filled(monkeypatch: pytest.MonkeyPatch) -> None:
    """``min_ms`` adds runs where ``repeats`` would measure less than it, as many as the first
    timed run says fill it; longer calls keep ``repeats``. Timed on a clock each call advances,
    so the counts are exact."""
    now = [0.0]
    monkeypatch.setattr(_timing, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    calls = {"short": 0, "long": 0}

    def call(kind: str, seconds: float) -> None:
        calls[kind] += 1
        now[0] += seconds

    cpu = torch.device("cpu")
    short = time_cuda(lambda: call("short", 0.002), warmup=0, repeats=3, device=cpu, min_ms=40.0)
    time_cuda(lambda: call("long", 0.02), warmup=0, repeats=3, device=cpu, min_ms=40.0)
    assert calls == {"short": 20, "long": 3}  # 40 / 2 runs; 3 runs of 20 already fill 40 ms
    assert short["median_ms"] == pytest.approx(2.0)


def test_rounds_take_every_path_in_turn_and_keep_medians() -> None:
    """``bench_dilated.measure_in_rounds``: path after path within a round, median times, the
    largest peak, and a path that ran out of memory is not measured again."""
    import bench_dilated

    order: list[str] = []
    counts = {"a": 0, "b": 0}

    def path(name: str) -> dict[str, float]:
        order.append(name)
        counts[name] += 1
        if name == "b" and counts["b"] == 2:
            raise torch.OutOfMemoryError("test")
        return {"fwd_ms": float(counts[name] % 3), "fwd_peak_bytes": float(counts[name])}

    measured = bench_dilated.measure_in_rounds({n: lambda n=n: path(n) for n in "ab"}, rounds=3)
    assert order == ["a", "b", "a", "b", "a"]
    assert measured == {"a": {"fwd_ms": 1.0, "fwd_peak_bytes": 3.0}, "b": "out of memory"}


def test_rounds_count_a_paths_calls_without_their_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench_dilated.measure_in_rounds``: calls that launched as usual while a path was
    measured because their graph had failed to capture or had been dropped are that path's
    ``uncaptured_calls``, summed over the rounds (a capture or a drop another path's calls
    cause is not); a path without such calls has no such entry."""
    import bench_dilated

    from dilated_attention.core.execution import graphs

    monkeypatch.setattr(graphs, "_EVENTS", collections.Counter())

    def path(name: str) -> dict[str, float]:
        if name == "lossy":
            graphs._EVENTS.update(uncaptured=3)
        else:  # its captures push out the other path's graphs
            graphs._EVENTS.update(failed=1, dropped=2, captured=5)
        return {"fwd_ms": 1.0}

    measured = bench_dilated.measure_in_rounds({n: lambda n=n: path(n) for n in ("a", "lossy")},
                                               rounds=2)  # fmt: skip
    assert measured == {"a": {"fwd_ms": 1.0}, "lossy": {"fwd_ms": 1.0, "uncaptured_calls": 6}}


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--min-ms", "-1"]])
def test_bench_dilated_refuses_bad_rounds_and_min_ms(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused by argparse before any work (or the CUDA check), naming both arguments."""
    import bench_dilated

    monkeypatch.setattr(sys, "argv", ["bench_dilated.py", *argv])
    with pytest.raises(SystemExit) as exit_info:
        bench_dilated.main()
    assert exit_info.value.code == 2
    assert "--rounds must be at least 1 and --min-ms at least 0" in capsys.readouterr().err


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """A ``time.perf_counter`` for ``_timing`` that only the test moves (seconds)."""
    now = [0.0]
    monkeypatch.setattr(_timing, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    return now


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch, clock: list[float]) -> list[str]:
    """CUDA's timing calls on the CPU: every event pair measures 7 ms of device time, and
    ``synchronize`` waits 5 ms on ``clock`` for the device; returns the calls' log."""
    log: list[str] = []

    class Event:
        def __init__(self, enable_timing: bool) -> None:
            assert enable_timing

        def record(self) -> None:
            log.append("record")

        def elapsed_time(self, other: object) -> float:
            return 7.0

    def synchronize() -> None:
        log.append("synchronize")
        clock[0] += 0.005

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    for name in ("empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 0)
    return log


def test_host_time_on_the_cpu_is_the_wall_time(clock: list[float]) -> None:
    """Off CUDA the call runs on the host: its time and its host time are both its wall time
    (``perf_counter``), and ``time_cuda`` reports the median of each."""
    steps = iter([0.002, 0.004, 0.003])

    def call() -> None:
        clock[0] += next(steps)

    assert timed_call(lambda: clock.__setitem__(0, clock[0] + 0.0025), cuda=False) == (
        pytest.approx(2.5), pytest.approx(2.5))  # fmt: skip
    timing = time_cuda(call, warmup=0, repeats=3, device=torch.device("cpu"))
    assert timing["median_ms"] == pytest.approx(3.0)
    assert timing["host_ms"] == pytest.approx(3.0)


def test_step_columns_name_what_the_step_timings_return() -> None:
    """``step_columns`` (the entries a benchmark copies into its rows): a CPU timing's times are
    among them, and on CUDA the steady ones are too."""
    x = torch.randn(4, 4, requires_grad=True)
    times = time_fwd_and_fwd_bwd(lambda: x * 2, [x], lambda: torch.ones(4, 4), warmup=0,
                                 repeats=1, device=torch.device("cpu"))  # fmt: skip
    for step in ("fwd", "fwd_bwd"):
        columns = _timing.step_columns(step)
        assert {f"{step}_ms", f"{step}_host_ms"} == {c for c in times if c in columns}
        assert {f"{step}_host_steady_ms", f"{step}_steady_ms"} < set(columns)


def test_host_time_on_cuda_leaves_out_the_synchronisation(
    clock: list[float], fake_cuda: list[str]
) -> None:
    """On CUDA the device time comes from the events, and the host time is the Python call
    alone: 1 ms here, not the 5 ms ``synchronize`` waits after it; the events are recorded
    before and after the call and the synchronisation comes last."""

    def call() -> None:
        fake_cuda.append("call")
        clock[0] += 0.001

    assert timed_call(call) == (7.0, pytest.approx(1.0))
    assert fake_cuda == ["record", "call", "record", "synchronize"]
    timing = time_cuda(call, warmup=1, repeats=3)
    assert timing["median_ms"] == 7.0 and timing["host_ms"] == pytest.approx(1.0)
    y = torch.ones(2, requires_grad=True)

    def forward() -> torch.Tensor:
        clock[0] += 0.001
        return y * 2

    result = time_fwd_and_fwd_bwd(forward, [y], lambda: torch.ones(2), warmup=0, repeats=2)
    assert result["fwd_ms"] == result["fwd_bwd_ms"] == 7.0
    assert result["fwd_host_ms"] == result["fwd_bwd_host_ms"] == pytest.approx(1.0)


def test_captured_steps_write_fresh_gradients(
    monkeypatch: pytest.MonkeyPatch, fake_cuda: list[str]
) -> None:
    """``time_captured_fwd_and_fwd_bwd``: the forward captured without gradients, forward and
    backward captured as one step that sets the leaves' gradients to None first (the capture's
    warm-up left them set: a captured backward would otherwise accumulate into them), both timed
    by replaying the graph, and no gradient left holding the graph's memory afterwards."""
    x = torch.randn(3, requires_grad=True)
    seen: list[tuple[bool, torch.Tensor | None]] = []
    replays: list[str] = []

    def forward() -> torch.Tensor:
        seen.append((torch.is_grad_enabled(), x.grad))
        return x * 2.0

    def captured(step):  # run on a side stream, then captured: two runs of the step
        step()
        step()
        return types.SimpleNamespace(replay=lambda: replays.append("replay"))

    monkeypatch.setattr(_timing, "captured", captured)
    result = time_captured_fwd_and_fwd_bwd(forward, [x], lambda: torch.ones(3), warmup=1,
                                           repeats=2)  # fmt: skip
    assert [grad for grad, _ in seen] == [False, False, True, True]
    assert all(g is None for _, g in seen)  # the second backward starts from no gradient
    # per step: 1 warm-up, 2 timed, then the steady calls' 2 untimed replays and 3 rounds of one
    assert len(replays) == 2 * (1 + 2 + 2 + 3)
    assert x.grad is None
    assert result == {"fwd_ms": 7.0, "fwd_host_ms": pytest.approx(0.0),
                      "fwd_host_steady_ms": pytest.approx(0.0), "fwd_steady_ms": 7.0,
                      "fwd_peak_bytes": 0, "fwd_bwd_ms": 7.0,
                      "fwd_bwd_host_ms": pytest.approx(0.0),
                      "fwd_bwd_host_steady_ms": pytest.approx(0.0), "fwd_bwd_steady_ms": 7.0,
                      "fwd_bwd_peak_bytes": 0}  # fmt: skip


def test_a_failing_path_records_its_error_and_the_others_go_on() -> None:
    """``bench_dilated.measure_in_rounds``: a path that raises (no kernel, a capture that
    fails) is recorded as its exception's type and first line, at most 300 characters, is not
    measured again, and the paths after it are measured in every round."""
    import bench_dilated

    calls: list[str] = []

    def path(name: str) -> dict[str, float]:
        calls.append(name)
        if name == "broken":
            raise RuntimeError("No available kernel.\nAborting.")
        if name == "long":
            raise ValueError("x" * 400)
        return {"fwd_ms": 1.0}

    names = ("a", "broken", "long", "c")
    measured = bench_dilated.measure_in_rounds({n: lambda n=n: path(n) for n in names}, rounds=2)
    assert calls == ["a", "broken", "long", "c", "a", "c"]
    assert measured["broken"] == "RuntimeError: No available kernel."
    assert measured["long"] == ("ValueError: " + "x" * 400)[:300]
    assert measured["a"] == measured["c"] == {"fwd_ms": 1.0}


def _documented_command(doc: str, start: str) -> list[str]:
    """The arguments of the command in ``doc`` that begins with ``start`` (continued over lines
    ending in a backslash), without ``python`` and the script."""
    lines = doc[doc.index(start) :].splitlines()
    end = next(i for i, line in enumerate(lines) if not line.rstrip().endswith("\\"))
    return shlex.split(" ".join(line.rstrip().rstrip("\\") for line in lines[: end + 1]))[2:]


def test_bench_dilated_accepts_the_documented_short_record_command() -> None:
    """The module docstring's command for the short-length record parses (no CUDA needed):
    the per-length LongNet schedule, 4K-64K, both kv head counts in one run, the four paths."""
    import bench_dilated

    argv = _documented_command(bench_dilated.__doc__, "python benchmarks/bench_dilated.py --sch")
    args = bench_dilated.parse_args(argv)
    assert args.schedules == ["longnet_n"]
    assert args.seq_lens == [4096, 8192, 16384, 32768, 65536]
    assert args.head_dims == [64, 128] and args.kv_heads == [16, 4]
    assert args.paths == ["auto", "auto captured", "dense cudnn", "dense attention"]
    assert args.out == Path("benchmarks/results/dilated_short_h100") and args.rounds == 2
    assert args.causal == "both" and args.min_ms == 50
    defaults = bench_dilated.parse_args([])
    assert defaults.seq_lens == [65536, 262144, 1048576]
    assert defaults.schedules == ["longnet", "paper"] and defaults.kv_heads == [16]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_bench_dilated_parses_then_needs_cuda() -> None:
    import bench_dilated

    argv = _documented_command(bench_dilated.__doc__, "python benchmarks/bench_dilated.py --sch")
    with pytest.raises(SystemExit, match=r"bench_dilated\.py needs a CUDA device"):
        bench_dilated.main(argv)


def test_bench_dilated_refuses_kv_heads_that_do_not_divide_heads(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import bench_dilated

    with pytest.raises(SystemExit) as exit_info:
        bench_dilated.parse_args(["--kv-heads", "16", "5"])
    assert exit_info.value.code == 2
    assert "--kv-heads must divide --heads (16), got [16, 5]" in capsys.readouterr().err
