"""The benchmarks' timing harness (``benchmarks/_timing.py``): what is alive while it measures."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import _timing
from _timing import time_cuda, time_fwd_and_fwd_bwd


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
    assert set(result) == {"fwd_ms", "fwd_bwd_ms"} and x.grad is None


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
