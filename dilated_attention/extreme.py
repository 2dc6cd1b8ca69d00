"""How long a sequence fits? The longest sequence one dilated attention call can run in memory.

What it measures: for forward only (under ``torch.no_grad``) and for forward+backward, the largest
sequence length N for which one ``dilated_attention(q, k, v, segments, rates)`` call on (1, N, H, D)
inputs with the LongNet schedule (``longnet_schedule(N, first_segment)``: segments double from
``first_segment`` until one covers N, rates 1, 2, 4, ...) runs within the memory available, its
peak memory and the memory per token. The measured peak includes q, k, v, the output and, with
backward, their gradients.

The search doubles N from ``start_len`` until a run does not fit, then ``bisect`` halving steps (in
multiples of the first segment) narrow the gap between the last length that fitted and the first
that did not.

"Does not fit":

- CUDA: ``torch.OutOfMemoryError`` (or a peak ``torch.cuda.max_memory_allocated`` above
  ``max_memory_gib`` when given); the peak is ``max_memory_allocated``.
- CPU: there is no out-of-memory exception to rely on, so ``max_memory_gib`` (default 2) is the
  budget. The peak is the process's resident-set high-water mark during the run minus the resident
  set before it (Linux ``VmHWM``, reset before each run through ``/proc/self/clear_refs``; elsewhere
  ``getrusage``, which cannot be reset and is only an upper bound). A length whose memory,
  extrapolated linearly from the last run that fitted, would exceed the budget is not run at all.
- Either: ``max_seq_len`` caps the search.

Used by ``examples/extreme_length.py`` (a newcomer's command line) and
``benchmarks/bench_extreme.py`` (the benchmark records)::

    from dilated_attention.extreme import find_max_seq_len
    record = find_max_seq_len(device="cpu", heads=2, head_dim=16, max_memory_gib=1)
    record["results"][0]["max_seq_len"]     # the longest forward-only length that fitted
"""

from __future__ import annotations

import argparse
import gc
import resource
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from . import _validation as V
from .config import longnet_schedule
from .core.devices import resolve_device
from .functional import dilated_attention

__all__ = [
    "GIB",
    "MODES",
    "add_search_arguments",
    "find_max_seq_len",
    "measure_peak_memory",
    "plot_peak_memory",
    "search",
    "search_from_arguments",
]

GIB = 2**30
#: What is measured: ``"forward"`` (no autograd) and ``"forward+backward"``.
MODES = ("forward", "forward+backward")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_cpu_peak() -> bool:
    """Reset the resident-set high-water mark (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _proc_status_kib("VmHWM") is not None
    except OSError:
        return False


def _cpu_peak_bytes() -> int:
    hwm = _proc_status_kib("VmHWM")
    if hwm is not None:
        return hwm * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _cpu_current_bytes() -> int:
    rss = _proc_status_kib("VmRSS")
    return rss * 1024 if rss is not None else _cpu_peak_bytes()


def _print(line: str) -> None:
    print(line, flush=True)


def _check_mode(mode: object) -> str:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got mode={mode!r}")
    return str(mode)


def measure_peak_memory(
    seq_len: int,
    mode: str = "forward",
    *,
    heads: int = 16,
    head_dim: int = 64,
    first_segment: int = 2048,
    is_causal: bool = True,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> int | None:
    """Peak memory of one ``dilated_attention`` call (and its backward) on random inputs.

    Args:
        seq_len: N; the inputs are (1, N, heads, head_dim).
        mode: ``"forward"`` (under ``torch.no_grad``) or ``"forward+backward"``.
        heads: H.
        head_dim: D.
        first_segment: the LongNet schedule's first segment length.
        is_causal: causal attention.
        device: default CUDA when available, else CPU.
        dtype: default bfloat16 on CUDA, float32 on CPU.

    Returns:
        Peak bytes above what was allocated before the call (see the module docstring for how
        each device measures it), or ``None`` when CUDA ran out of memory.

    Raises:
        ValueError: a non-positive size, an unknown ``mode``, or a device not available here.
    """
    for name, value in (("seq_len", seq_len), ("heads", heads), ("head_dim", head_dim)):
        V.check_positive_int(name, value)
    mode = _check_mode(mode)
    dev = resolve_device(device)
    cuda = dev.type == "cuda"
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    segments, rates = longnet_schedule(seq_len, first_segment)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    else:
        _reset_cpu_peak()
        base = _cpu_current_bytes()
    backward = mode == "forward+backward"
    q = k = v = out = None
    try:
        shape = (1, seq_len, heads, head_dim)
        q, k, v = (torch.randn(shape, device=dev, dtype=dtype) for _ in range(3))
        if backward:
            for t in (q, k, v):
                t.requires_grad_()
            out = dilated_attention(q, k, v, segments, rates, is_causal=is_causal)
            out.backward(torch.ones_like(out))
        else:
            with torch.no_grad():
                out = dilated_attention(q, k, v, segments, rates, is_causal=is_causal)
        if cuda:
            torch.cuda.synchronize(dev)
            return torch.cuda.max_memory_allocated(dev) - base
        return max(0, _cpu_peak_bytes() - base)
    except torch.OutOfMemoryError:
        return None
    finally:
        q = k = v = out = None  # free before the next run
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def search(
    mode: str,
    *,
    start_len: int,
    max_seq_len: int,
    budget_bytes: float | None,
    bisect: int,
    heads: int,
    head_dim: int,
    first_segment: int,
    is_causal: bool,
    device: torch.device,
    dtype: torch.dtype,
    log: Callable[[str], None] | None = _print,
) -> dict[str, Any]:
    """Double the length until it does not fit, then bisect: the summary of one mode.

    Args:
        mode: one of :data:`MODES`.
        start_len: the first length tried.
        max_seq_len: no length above this is tried.
        budget_bytes: a peak above this does not fit (``None``: only out-of-memory stops; on CPU
            give a budget).
        bisect: halving steps after the doubling stopped.
        heads, head_dim, first_segment, is_causal, device, dtype: as in
            :func:`measure_peak_memory`.
        log: called with one line per attempt (default: print; ``None``: silent).

    Returns:
        ``{"mode", "max_seq_len" (0 when not even ``start_len`` fits), "peak_gib",
        "bytes_per_token", "stopped_by" ("max_seq_len", "out of memory", "memory budget" or
        "memory budget (predicted)"), "attempts": [{"seq_len", "fits", "seconds", "peak_gib",
        "bytes_per_token"} or {"seq_len", "fits", "predicted_gib"} per length]}``.
    """
    run_kwargs: dict[str, Any] = {
        "heads": heads, "head_dim": head_dim, "first_segment": first_segment,
        "is_causal": is_causal, "device": device, "dtype": dtype,
    }  # fmt: skip
    attempts: list[dict[str, Any]] = []
    best: dict[str, Any] | None = None
    stopped_by = "max_seq_len"

    def say(line: str) -> None:
        if log is not None:
            log(line)

    def attempt(seq_len: int) -> tuple[bool, str]:
        nonlocal best
        if best is not None and budget_bytes is not None and device.type == "cpu":
            predicted = best["peak_bytes"] / best["seq_len"] * seq_len
            if predicted > budget_bytes:
                attempts.append(
                    {"seq_len": seq_len, "fits": False, "predicted_gib": predicted / GIB}
                )
                say(f"  {mode:>16} N={seq_len:>10,}: skipped, predicted "
                    f"{predicted / GIB:.2f} GiB > budget")  # fmt: skip
                return False, "memory budget (predicted)"
        start = time.perf_counter()
        peak = measure_peak_memory(seq_len, mode, **run_kwargs)
        seconds = time.perf_counter() - start
        fits = peak is not None and (budget_bytes is None or peak <= budget_bytes)
        row: dict[str, Any] = {"seq_len": seq_len, "fits": fits, "seconds": seconds}
        if peak is not None:
            row.update(peak_gib=peak / GIB, bytes_per_token=peak / seq_len)
        attempts.append(row)
        what = "out of memory" if peak is None else f"{peak / GIB:.3f} GiB"
        say(f"  {mode:>16} N={seq_len:>10,}: {what}, {seconds:.2f} s"
            f"{'' if fits else ' -> does not fit'}")  # fmt: skip
        if fits:
            best = {"seq_len": seq_len, "peak_bytes": peak}
            return True, ""
        return False, "out of memory" if peak is None else "memory budget"

    # Warm-up (lazy initialisation, kernel loading) so it is not counted in the first attempt.
    measure_peak_memory(min(start_len, max_seq_len, first_segment), mode, **run_kwargs)
    seq_len, failed_at = start_len, None
    while seq_len <= max_seq_len:
        ok, why = attempt(seq_len)
        if not ok:
            failed_at, stopped_by = seq_len, why
            break
        seq_len *= 2
    if failed_at is not None and best is not None:
        lo, hi = best["seq_len"], failed_at
        for _ in range(bisect):
            mid = (lo + hi) // 2 // first_segment * first_segment
            if mid <= lo:
                break
            ok, _ = attempt(mid)
            lo, hi = (mid, hi) if ok else (lo, mid)
    return _summary(mode, stopped_by, attempts, best)


def _summary(
    mode: str, stopped_by: str, attempts: list[dict[str, Any]], best: dict[str, Any] | None
) -> dict[str, Any]:
    """:func:`search`'s result from its attempts and the longest length that fit (``best``:
    ``{"seq_len", "peak_bytes"}``, None when none did)."""
    summary: dict[str, Any] = {"mode": mode, "stopped_by": stopped_by, "attempts": attempts}
    if best is None:
        return {**summary, "max_seq_len": 0, "peak_gib": None, "bytes_per_token": None}
    return {
        **summary, "max_seq_len": best["seq_len"], "peak_gib": best["peak_bytes"] / GIB,
        "bytes_per_token": best["peak_bytes"] / best["seq_len"],
    }  # fmt: skip


def find_max_seq_len(
    *,
    modes: Sequence[str] = MODES,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    heads: int = 16,
    head_dim: int = 64,
    first_segment: int | None = None,
    start_len: int | None = None,
    max_seq_len: int | None = None,
    max_memory_gib: float | None = None,
    bisect: int = 2,
    is_causal: bool = True,
    log: Callable[[str], None] | None = _print,
) -> dict[str, Any]:
    """The longest sequence that fits, per mode (see the module docstring for what is measured).

    Args:
        modes: which of :data:`MODES` to search.
        device: default CUDA when available, else CPU.
        dtype: default bfloat16 on CUDA, float32 on CPU.
        heads: H.
        head_dim: D.
        first_segment: the LongNet schedule's first segment (default 2048 on CUDA, 512 on CPU).
        start_len: the first length tried (default 4 x ``first_segment``).
        max_seq_len: cap of the search (default 2**31 on CUDA, 2**17 on CPU).
        max_memory_gib: memory budget (default 2 on CPU; on CUDA none: until out of memory).
        bisect: halving steps after the doubling stopped.
        is_causal: causal attention.
        log: called with each progress line (default: print; ``None``: silent).

    Returns:
        ``{"config": the settings used, "results": [one :func:`search` summary per mode]}``.

    Raises:
        ValueError: an unknown mode, a non-positive size or budget, or a device not available
            here.
    """
    dev = resolve_device(device)
    cuda = dev.type == "cuda"
    modes = [_check_mode(m) for m in modes]
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or None, got dtype={dtype!r}")
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    if first_segment is None:
        first_segment = 2048 if cuda else 512
    first_segment = V.check_positive_int("first_segment", first_segment)
    start_len = V.check_positive_int(
        "start_len", 4 * first_segment if start_len is None else start_len
    )
    if max_seq_len is None:
        max_seq_len = 1 << 31 if cuda else 1 << 17
    max_seq_len = V.check_positive_int("max_seq_len", max_seq_len)
    for name, value in (("heads", heads), ("head_dim", head_dim)):
        V.check_positive_int(name, value)
    if isinstance(bisect, bool) or not isinstance(bisect, int) or bisect < 0:
        raise ValueError(f"bisect must be an int >= 0, got bisect={bisect!r}")
    budget_gib = max_memory_gib if max_memory_gib is not None else (None if cuda else 2.0)
    if budget_gib is not None and not budget_gib > 0:
        raise ValueError(f"max_memory_gib must be > 0 (GiB), got max_memory_gib={budget_gib!r}")
    config = {
        "device": str(dev), "heads": heads, "head_dim": head_dim,
        "dtype": str(dtype).removeprefix("torch."), "first_segment": first_segment,
        "causal": is_causal, "start_len": start_len, "max_seq_len_cap": max_seq_len,
        "max_memory_gib": budget_gib, "bisect": bisect,
        "memory_measure": "cuda.max_memory_allocated" if cuda else "process RSS high-water mark",
    }  # fmt: skip
    if log is not None:
        log(f"extreme-length test on {dev}: {config}")
    budget = None if budget_gib is None else budget_gib * GIB
    results = []
    for mode in modes:
        row = search(
            mode, start_len=start_len, max_seq_len=max_seq_len, budget_bytes=budget,
            bisect=bisect, heads=heads, head_dim=head_dim, first_segment=first_segment,
            is_causal=is_causal, device=dev, dtype=dtype, log=log,
        )  # fmt: skip
        results.append(row)
    return {"config": config, "results": results}


def add_search_arguments(parser: argparse.ArgumentParser) -> None:
    """The command-line flags of :func:`find_max_seq_len` (``examples/extreme_length.py`` and
    ``benchmarks/bench_extreme.py``); :func:`search_from_arguments` runs them."""
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default=None, help="default: CUDA if any"
    )
    parser.add_argument(
        "--dtype", choices=sorted(_DTYPES), default=None, help="default bfloat16 GPU, float32 CPU"
    )
    parser.add_argument("--heads", type=int, default=16, help="attention heads")
    parser.add_argument("--head-dim", type=int, default=64, help="dimension of each head")
    parser.add_argument("--first-segment", type=int, default=None, help="default 2048 GPU, 512 CPU")
    parser.add_argument("--start-len", type=int, default=None, help="default 4 x first segment")
    parser.add_argument(
        "--max-seq-len", type=int, default=None, help="cap (default 2**31 GPU, 2**17 CPU)"
    )
    parser.add_argument(
        "--max-memory-gib", type=float, default=None,
        help="memory budget (default 2 on CPU; on GPU none: run until out of memory)",
    )  # fmt: skip
    parser.add_argument("--bisect", type=int, default=2, help="bisection steps after doubling")
    parser.add_argument(
        "--modes", nargs="+", choices=MODES, default=list(MODES), help="what to run at each length"
    )
    parser.add_argument(
        "--causal", action=argparse.BooleanOptionalAction, default=True, help="causal attention"
    )
    parser.add_argument("--no-plot", action="store_true", help="write no PNG")


def search_from_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`find_max_seq_len` with the flags of :func:`add_search_arguments`.

    Raises:
        SystemExit: ``--device cuda`` where no CUDA device is available.
    """
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda, but no CUDA device is available here; use --device cpu")
    return find_max_seq_len(
        modes=args.modes, device=args.device, dtype=_DTYPES[args.dtype] if args.dtype else None,
        heads=args.heads, head_dim=args.head_dim, first_segment=args.first_segment,
        start_len=args.start_len, max_seq_len=args.max_seq_len,
        max_memory_gib=args.max_memory_gib, bisect=args.bisect, is_causal=args.causal,
    )  # fmt: skip


def plot_peak_memory(
    results: list[dict[str, Any]], path: str | Path, *, budget_gib: float | None, title: str
) -> bool:
    """Peak memory against sequence length per mode, written to ``path`` (PNG).

    Args:
        results: the ``"results"`` of :func:`find_max_seq_len`.
        path: the image file; missing parent directories are created.
        budget_gib: drawn as a dashed line when given.
        title: the plot's title.

    Returns:
        ``False`` (and nothing written) when matplotlib is not installed.
    """
    try:  # a Figure of its own: no pyplot state, and the caller's backend stays as it is
        from matplotlib.figure import Figure
    except ImportError:
        return False
    path = Path(path)
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for row in results:
        fitted = sorted((a["seq_len"], a["peak_gib"]) for a in row["attempts"] if a["fits"])
        if fitted:
            ax.plot(*zip(*fitted, strict=True), marker="o", label=row["mode"])
    if budget_gib is not None:
        ax.axhline(budget_gib, color="grey", linestyle="--", label="memory budget")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("peak memory (GiB)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return True
