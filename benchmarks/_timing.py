"""Shared benchmark helpers: CUDA-event timing (median of repeats), run records, table output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch


def time_cuda(fn: Callable[[], object], *, warmup: int = 3, repeats: int = 10) -> dict[str, float]:
    """Run ``fn`` ``warmup`` times, then time ``repeats`` runs with CUDA events (ms).

    Returns:
        ``{"median_ms", "p10_ms", "p90_ms"}``.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    times.sort()
    return {
        "median_ms": statistics.median(times),
        "p10_ms": times[max(0, len(times) // 10)],
        "p90_ms": times[min(len(times) - 1, (9 * len(times)) // 10)],
    }


def time_fwd_and_fwd_bwd(
    forward: Callable[[], torch.Tensor],
    leaves: list[torch.Tensor],
    dout: torch.Tensor,
    *,
    warmup: int,
    repeats: int,
) -> dict[str, float]:
    """Median times of a no-grad forward and of forward+backward, with each one's peak memory.

    Args:
        forward: runs the computation and returns its output.
        leaves: the tensors whose gradients the backward computes.
        dout: the upstream gradient of the output.

    Returns:
        ``{"fwd_ms", "fwd_peak_bytes", "fwd_bwd_ms", "fwd_bwd_peak_bytes"}``.
    """

    def fwd() -> None:
        with torch.no_grad():
            forward()

    def fwd_bwd() -> None:
        torch.autograd.grad(forward(), leaves, dout)

    result = {}
    for step, run in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        result[f"{step}_ms"] = time_cuda(run, warmup=warmup, repeats=repeats)["median_ms"]
        result[f"{step}_peak_bytes"] = torch.cuda.max_memory_allocated()
    return result


def git_commit() -> str:
    """The checkout's commit (with ``-dirty`` when it has uncommitted changes), or ``unknown``."""
    if os.environ.get("DILATED_ATTENTION_COMMIT"):  # a copy of the tree without .git
        return os.environ["DILATED_ATTENTION_COMMIT"]
    try:
        sha = subprocess.check_output(
            ["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL
        ).strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], check=False).returncode != 0
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment() -> dict[str, Any]:
    """Device, software versions and commit for a benchmark record."""
    env: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "commit": git_commit(),
    }
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        env["device"] = torch.cuda.get_device_name()
        env["capability"] = f"sm{major}{minor}"
        env["cudnn"] = torch.backends.cudnn.version()
    else:
        env["device"] = platform.processor() or "cpu"
    return env


def write_record(path: Path, env: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Write ``{"environment": env, "results": rows}`` as JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"environment": env, "results": rows}, indent=1) + "\n")


def markdown_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A Markdown table of ``rows`` restricted to ``columns`` (floats to 3 significant digits)."""

    def cell(value: object) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)
