"""Shared benchmark helpers: CUDA-event timing (median of repeats), run records, table output.

Records go to ``benchmarks/results/<benchmark>_<device>.json`` by default (``record_path``), with
the environment of ``environment()``: device and its short label, torch, CUDA, cuDNN and package
versions, commit, date and the command line. ``benchmarks/summarize_results.py`` turns every
record into ``benchmarks/results/README.md``; ``_records.py`` says what a record must carry.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from _records import RESULTS_DIR, device_label, markdown_table

__all__ = [
    "OUT_HELP",
    "captured",
    "command_line",
    "environment",
    "git_commit",
    "host_label",
    "markdown_table",
    "package_versions",
    "record_header",
    "record_path",
    "time_cuda",
    "time_fwd_and_fwd_bwd",
    "write_record",
]

#: Distributions whose versions every record names ("not installed" where absent).
PACKAGES = ("triton", "flash-attn", "flash-attn-3", "flash-attn-4", "xformers")
#: ``--out`` help of the benchmark scripts.
OUT_HELP = "path without suffix (default: benchmarks/results/<benchmark>_<device>)"
#: Environment variables that change what a benchmark measures; recorded in the command line.
_COMMAND_ENV = (
    "CUDA_VISIBLE_DEVICES", "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
    "NVSHMEM_DISABLE_NVLS", "TRITON_INTERPRET",
)  # fmt: skip


def captured(step: Callable[[], Any]) -> torch.cuda.CUDAGraph:
    """``step`` recorded in a CUDA graph (``graph.replay()`` runs it): run once on a side stream
    first (kernels chosen and compiled, memory settled), then captured. Inside ``no_grad``
    where the step allocates no autograd state."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def time_cuda(
    fn: Callable[[], object],
    *,
    warmup: int = 3,
    repeats: int = 10,
    device: torch.device | None = None,
    min_ms: float = 0.0,
) -> dict[str, float]:
    """Run ``fn`` ``warmup`` times, then time ``repeats`` runs (ms): with CUDA events, or with
    ``time.perf_counter`` when ``device`` is given and is not a CUDA device. With ``min_ms``,
    more runs where ``repeats`` of them would take less than ``min_ms`` in all (short calls,
    whose times move most from run to run), as many as the first timed run says fill it.

    Returns:
        ``{"median_ms", "p10_ms", "p90_ms"}``.
    """
    cuda = device is None or device.type == "cuda"
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times: list[float] = []
    while len(times) < repeats:
        if not cuda:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
        else:
            start = torch.cuda.Event(enable_timing=True)
            stop = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop))
        if len(times) == 1 and times[0] > 0:
            repeats = max(repeats, math.ceil(min_ms / times[0]))
    times.sort()
    return {
        "median_ms": statistics.median(times),
        "p10_ms": times[max(0, len(times) // 10)],
        "p90_ms": times[min(len(times) - 1, (9 * len(times)) // 10)],
    }


def time_fwd_and_fwd_bwd(
    forward: Callable[[], torch.Tensor],
    leaves: list[torch.Tensor],
    make_dout: Callable[[], torch.Tensor],
    *,
    warmup: int,
    repeats: int,
    device: torch.device | None = None,
    min_ms: float = 0.0,
) -> dict[str, float]:
    """Median times of a no-grad forward and of forward+backward, with each one's peak memory
    (``warmup``, ``repeats`` and ``min_ms`` as in :func:`time_cuda`).

    Args:
        forward: runs the computation and returns its output.
        leaves: the tensors whose gradients the backward computes.
        make_dout: makes the upstream gradient of the output; called after the forward's
            measurement, so the forward's peak holds only what a forward needs.
        device: where it runs (default CUDA); elsewhere timed with ``perf_counter`` and without
            the peak memory entries.

    Returns:
        ``{"fwd_ms", "fwd_peak_bytes", "fwd_bwd_ms", "fwd_bwd_peak_bytes"}``.
    """

    def fwd() -> None:
        with torch.no_grad():
            forward()

    def fwd_bwd(dout: torch.Tensor) -> None:
        torch.autograd.grad(forward(), leaves, dout)

    cuda = device is None or device.type == "cuda"
    result = {}
    for step in ("fwd", "fwd_bwd"):
        run = fwd if step == "fwd" else functools.partial(fwd_bwd, make_dout())
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        timing = time_cuda(run, warmup=warmup, repeats=repeats, device=device, min_ms=min_ms)
        result[f"{step}_ms"] = timing["median_ms"]
        if cuda:
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


def host_label() -> str:
    """The device part of record names: ``h100`` on a host with one H100, ``h200x4`` on a host
    with four H200s (the GPUs this process sees, so ``CUDA_VISIBLE_DEVICES=0`` on a 4-GPU host
    gives ``h200``), ``cpu`` without CUDA; ``DILATED_ATTENTION_DEVICE_LABEL`` overrides it. Used
    to name records only, never to choose kernels."""
    if os.environ.get("DILATED_ATTENTION_DEVICE_LABEL"):
        return os.environ["DILATED_ATTENTION_DEVICE_LABEL"]
    if not torch.cuda.is_available():
        return "cpu"
    return device_label(torch.cuda.get_device_name(), torch.cuda.device_count())


def record_path(benchmark: str, out: Path | None = None) -> Path:
    """``out``, or ``benchmarks/results/<benchmark>_<host_label()>`` (no suffix: the scripts add
    ``.json``, ``.md`` and ``.png``)."""
    return out if out is not None else RESULTS_DIR / f"{benchmark}_{host_label()}"


def package_versions() -> dict[str, str]:
    """Installed versions of ``PACKAGES`` (``"not installed"`` where absent)."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name.replace("-", "_")] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name.replace("-", "_")] = "not installed"
    if versions["triton"] == "not installed":
        try:  # some torch builds ship Triton under another distribution name
            import triton

            versions["triton"] = triton.__version__
        except Exception:  # not importable here: "not installed" stands
            pass
    return versions


def command_line() -> str:
    """How this process was started, as a shell line: the variables of ``_COMMAND_ENV`` that are
    set, ``torchrun --nproc_per_node=W`` under torchrun, then the script (relative to the
    repository when inside it) and its arguments."""
    argv = list(sys.argv)
    if argv and Path(argv[0]).is_file():
        script = Path(argv[0]).resolve()
        try:
            argv[0] = str(script.relative_to(RESULTS_DIR.parent.parent))
        except ValueError:
            argv[0] = str(script)
    env = [f"{k}={os.environ[k]}" for k in _COMMAND_ENV if k in os.environ]
    launcher = ["python"]
    if "LOCAL_WORLD_SIZE" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ:
        launcher = ["torchrun", f"--nproc_per_node={os.environ['LOCAL_WORLD_SIZE']}"]
    return shlex.join([*env, *launcher, *argv])


def environment() -> dict[str, Any]:
    """Device, software versions, commit, date and command line for a benchmark record."""
    env: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "packages": package_versions(),
        "commit": git_commit(),
        "command": command_line(),
        "device_label": host_label(),
    }
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        env["device"] = torch.cuda.get_device_name()
        env["device_count"] = torch.cuda.device_count()
        env["capability"] = f"sm{major}{minor}"
        env["cudnn"] = torch.backends.cudnn.version()
    else:
        env["device"] = platform.processor() or "cpu"
    return env


def record_header(env: dict[str, Any]) -> str:
    """The first lines of a record's Markdown table: device, versions, commit, date, command."""
    command = env["command"] if isinstance(env["command"], str) else "; ".join(env["command"])
    return (
        f"{env['device']} ({env.get('device_label', 'unknown')}), torch {env['torch']}, "
        f"triton {env.get('packages', {}).get('triton', 'unknown')}, commit {env['commit']}, "
        f"{env['date']}\n\n`{command}`\n\n"
    )


def write_record(
    path: Path,
    env: dict[str, Any],
    rows: list[dict[str, Any]],
    *,
    columns: list[str] | None = None,
    notes: str | None = None,
) -> None:
    """Write ``{"environment": env, "columns": ..., "notes": ..., "results": rows}`` as JSON;
    ``columns`` (the main table's, for ``summarize_results.py``) and ``notes`` only when given."""
    record: dict[str, Any] = {"environment": env}
    if columns is not None:
        record["columns"] = columns
    if notes is not None:
        record["notes"] = notes
    record["results"] = rows
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
