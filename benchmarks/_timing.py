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
    "error_text",
    "git_commit",
    "host_label",
    "markdown_table",
    "package_versions",
    "record_header",
    "record_path",
    "recover",
    "steady_calls",
    "step_columns",
    "time_captured_fwd_and_fwd_bwd",
    "time_cuda",
    "time_fwd_and_fwd_bwd",
    "timed_call",
    "write_record",
]

#: Distributions whose versions every record names ("not installed" where absent).
PACKAGES = ("triton", "flash-attn", "flash-attn-3", "flash-attn-4", "xformers")
#: ``--out`` help of the benchmark scripts.
OUT_HELP = "path without suffix (default: benchmarks/results/<benchmark>_<device>)"
#: Longest error message a row keeps (:func:`error_text`).
ERROR_CHARS = 300
#: Most calls :func:`steady_calls` makes for :func:`time_cuda` (each call's work queues behind
#: the others' on the device; the host never waits for them), in STEADY_ROUNDS rounds.
STEADY_CALLS = 30
#: Rounds of back-to-back calls :func:`steady_calls` times, each between two CUDA events; its
#: device time is the median round's.
STEADY_ROUNDS = 3
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


def timed_call(fn: Callable[[], object], *, cuda: bool = True) -> tuple[float, float]:
    """One run of ``fn``: ``(ms, host_ms)``.

    On CUDA ``ms`` is the time between two CUDA events recorded around the call, and
    ``host_ms`` the wall time (``time.perf_counter``) of the Python call alone: what the host
    spends issuing the work, the ``torch.cuda.synchronize()`` that follows it not counted. A call
    that waits for the device itself (a synchronisation inside it) has that wait in its host
    time. Elsewhere (``cuda=False``) the call runs on the host, and both are its wall time.
    """
    if not cuda:
        begin = time.perf_counter()
        fn()
        elapsed = (time.perf_counter() - begin) * 1e3
        return elapsed, elapsed
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    start.record()
    begin = time.perf_counter()
    fn()
    host_ms = (time.perf_counter() - begin) * 1e3
    stop.record()
    torch.cuda.synchronize()  # not in host_ms
    return start.elapsed_time(stop), host_ms


def steady_calls(fn: Callable[[], object], *, calls: int) -> dict[str, float]:
    """Calls of ``fn`` issued back to back on CUDA, with no synchronisation between them: each
    call meets a device busy with the earlier ones' work and a host that has not waited, as
    every call of a training loop but its first does. Two untimed calls, then
    :data:`STEADY_ROUNDS` rounds of ``max(1, calls // STEADY_ROUNDS)`` calls, each round between
    two CUDA events (about ``calls`` timed calls; three where ``calls`` is below three).

    Returns:
        ``{"host_ms": the median wall time of one call, "ms": the median over the rounds of
        the device time per call}``: the time a call adds to a loop that issues it over and
        over, its host time hidden behind the device's work wherever the device is the slower.

    Note [Host time after a wait]
        :func:`timed_call` synchronizes after every call, so each timed call starts on a host
        that has just waited for the device. On the lent H100 machines a call made after the
        host waited several milliseconds (in ``torch.cuda.synchronize()``, or asleep) spends
        2-4x the host time of the same call made while the host was busy: a dilated forward at
        4K took 118 us after a short wait and 470-560 us after a 15 ms one, also with 2 ms of
        Python spinning in between, while a plain Python loop took the same time either way
        (``findings_h100.json``, "Host time after the host waited"). So ``host_ms`` grows with
        the length of the device's work before it (dense cuDNN's own forward: 56 us at 4K, 292
        us at 64K), and the steady time is the host cost a loop pays once it runs. The events
        of :func:`timed_call` count that host time too (the device idles until the first launch
        arrives), so a call whose host time passes its device time is timed slower there than a
        loop runs it: the steady ``ms`` is the loop's.
    """
    for _ in range(2):  # the host busy, the device queued
        fn()
    per_round = max(1, calls // STEADY_ROUNDS)
    host: list[float] = []
    rounds = []
    for _ in range(STEADY_ROUNDS):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(per_round):
            begin = time.perf_counter()
            fn()
            host.append(time.perf_counter() - begin)
        stop.record()
        rounds.append((start, stop))
    torch.cuda.synchronize()
    device_ms = [start.elapsed_time(stop) / per_round for start, stop in rounds]
    return {"host_ms": statistics.median(host) * 1e3, "ms": statistics.median(device_ms)}


def time_cuda(
    fn: Callable[[], object],
    *,
    warmup: int = 3,
    repeats: int = 10,
    device: torch.device | None = None,
    min_ms: float = 0.0,
    steady: bool = False,
) -> dict[str, float]:
    """Run ``fn`` ``warmup`` times, then time ``repeats`` runs (ms) with :func:`timed_call`:
    CUDA events and the host's share of each run, or ``time.perf_counter`` alone when ``device``
    is given and is not a CUDA device. With ``min_ms``, more runs where ``repeats`` of them
    would take less than ``min_ms`` in all (short calls, whose times move most from run to run),
    as many as the first timed run says fill it. With ``steady`` (CUDA), also the host and
    device times of calls issued back to back (:func:`steady_calls`, about as many as were
    timed, at most :data:`STEADY_CALLS`).

    Returns:
        ``{"median_ms", "p10_ms", "p90_ms", "host_ms"}``, ``host_ms`` the median host time;
        with ``steady``, ``"steady_host_ms"`` and ``"steady_ms"`` too.
    """
    cuda = device is None or device.type == "cuda"
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times: list[float] = []
    host: list[float] = []
    while len(times) < repeats:
        ms, host_ms = timed_call(fn, cuda=cuda)
        times.append(ms)
        host.append(host_ms)
        if len(times) == 1 and times[0] > 0:
            repeats = max(repeats, math.ceil(min_ms / times[0]))
    times.sort()
    result = {
        "median_ms": statistics.median(times),
        "p10_ms": times[max(0, len(times) // 10)],
        "p90_ms": times[min(len(times) - 1, (9 * len(times)) // 10)],
        "host_ms": statistics.median(host),
    }
    if steady and cuda:
        loop = steady_calls(fn, calls=min(len(times), STEADY_CALLS))
        result["steady_host_ms"] = loop["host_ms"]
        result["steady_ms"] = loop["ms"]
    return result


#: A step's entries (``{step}_<entry>``) and the :func:`time_cuda` keys they are read from.
_STEP_ENTRIES = (
    ("ms", "median_ms"), ("host_ms", "host_ms"), ("host_steady_ms", "steady_host_ms"),
    ("steady_ms", "steady_ms"),
)  # fmt: skip


def step_columns(step: str) -> tuple[str, ...]:
    """The time entries of ``step`` (``"fwd"`` or ``"fwd_bwd"``) that
    :func:`time_fwd_and_fwd_bwd` and :func:`time_captured_fwd_and_fwd_bwd` return (the steady
    ones on CUDA only)."""
    return tuple(f"{step}_{entry}" for entry, _ in _STEP_ENTRIES)


def _step_times(step: str, timing: dict[str, float]) -> dict[str, float]:
    """``step``'s entries of a :func:`time_cuda` result (the steady ones where it has them)."""
    return {f"{step}_{entry}": timing[key] for entry, key in _STEP_ENTRIES if key in timing}


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
    """Median times of a no-grad forward and of forward+backward, with each one's host time and
    peak memory (``warmup``, ``repeats`` and ``min_ms`` as in :func:`time_cuda`).

    Args:
        forward: runs the computation and returns its output.
        leaves: the tensors whose gradients the backward computes.
        make_dout: makes the upstream gradient of the output; called after the forward's
            measurement, so the forward's peak holds only what a forward needs.
        device: where it runs (default CUDA); elsewhere timed with ``perf_counter`` and without
            the peak memory entries.

    Returns:
        ``{"fwd_ms", "fwd_host_ms", "fwd_peak_bytes"}`` and the same for ``fwd_bwd``: the
        host times are medians of the host's share of each run (:func:`timed_call`); on CUDA
        also ``{step}_host_steady_ms`` and ``{step}_steady_ms``, the host and device time of
        one of the calls issued back to back (:func:`steady_calls`).
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
        timing = time_cuda(run, warmup=warmup, repeats=repeats, device=device, min_ms=min_ms,
                           steady=cuda)  # fmt: skip
        result.update(_step_times(step, timing))
        if cuda:
            result[f"{step}_peak_bytes"] = torch.cuda.max_memory_allocated()
    return result


def time_captured_fwd_and_fwd_bwd(
    forward: Callable[[], torch.Tensor],
    leaves: list[torch.Tensor],
    make_dout: Callable[[], torch.Tensor],
    *,
    warmup: int,
    repeats: int,
    min_ms: float = 0.0,
) -> dict[str, float]:
    """:func:`time_fwd_and_fwd_bwd`'s measurements (CUDA only) of ``forward`` captured once in a
    CUDA graph (:func:`captured`) and timed by replaying it: the forward captured under
    ``no_grad``; the forward and ``out.backward(dout)`` captured as one graph, the leaves'
    gradients set to None before each run of it, so that the captured backward allocates them
    from the graph's pool and every replay writes them afresh (none accumulates). Times and host
    times are those of ``graph.replay()``; peaks include the graph's pool.

    Returns:
        ``{"fwd_ms", "fwd_host_ms", "fwd_host_steady_ms", "fwd_steady_ms", "fwd_peak_bytes"}``
        and the same for ``fwd_bwd``.
    """
    result = {}
    for step in ("fwd", "fwd_bwd"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        if step == "fwd":
            with torch.no_grad():
                graph = captured(forward)
        else:
            dout = make_dout()

            def forward_backward(dout: torch.Tensor = dout) -> None:
                for leaf in leaves:
                    leaf.grad = None
                forward().backward(dout)

            graph = captured(forward_backward)
        timing = time_cuda(graph.replay, warmup=warmup, repeats=repeats, min_ms=min_ms,
                           steady=True)  # fmt: skip
        result.update(_step_times(step, timing))
        result[f"{step}_peak_bytes"] = torch.cuda.max_memory_allocated()
        for leaf in leaves:  # they hold the graph's pool
            leaf.grad = None
        del graph
    return result


def error_text(exc: BaseException) -> str:
    """A failed measurement as its row records it: ``"out of memory"``, or the exception's type
    and the first line of its message, at most :data:`ERROR_CHARS` characters."""
    if isinstance(exc, torch.OutOfMemoryError):
        return "out of memory"
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:ERROR_CHARS]


def recover() -> None:
    """After a failed measurement: let the device finish what was queued and drop the cached
    blocks the failed call left, so the next measurement starts as the others do (nothing to do
    where CUDA was never used)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    try:
        torch.cuda.synchronize()
    except Exception:  # a sticky device error: the next measurement's own call reports it
        return
    torch.cuda.empty_cache()


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
