"""Extreme-length memory test: the longest sequence one dilated attention call fits in memory.

    python benchmarks/bench_extreme.py --out benchmarks/results/extreme_h100        # GPU, bf16
    python benchmarks/bench_extreme.py --max-memory-gib 2 --out /tmp/extreme_cpu    # CPU, fp32

For forward only (``no_grad``) and for forward+backward, the sequence length doubles from
``--start-len`` until a run does not fit, then ``--bisect`` halving steps (in multiples of the
first segment) narrow the gap. Every run is ``dilated_attention(q, k, v)`` on (1, N, H, D) inputs
with the LongNet schedule (``longnet_schedule(N, first_segment)``: segments double from
``--first-segment`` until one covers N, rates 1, 2, 4, ...); the measured peak includes q, k, v,
the output and, with backward, their gradients.

"Does not fit":
- CUDA: ``torch.OutOfMemoryError`` (or the peak of ``torch.cuda.max_memory_allocated`` above
  ``--max-memory-gib`` when given); the peak is ``max_memory_allocated``.
- CPU: there is no out-of-memory exception to rely on, so ``--max-memory-gib`` (default 2) is the
  budget. The peak is the process's resident-set high-water mark during the run minus the resident
  set before it (Linux ``VmHWM``, reset before each run through ``/proc/self/clear_refs``; elsewhere
  ``getrusage``, which cannot be reset and is only an upper bound). A length whose memory,
  extrapolated linearly from the last run that fitted, would exceed the budget is not run at all.
- Either: ``--max-seq-len`` caps the search.

Writes ``OUT.json`` (``write_record``: per mode the largest length that fits, its peak memory and
bytes per token, what stopped the search, and every attempt) and ``OUT.png`` (peak memory against
length, when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import environment, markdown_table, write_record

from dilated_attention import dilated_attention, longnet_schedule

GIB = 2**30
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


def run_once(
    seq_len: int,
    mode: str,
    *,
    heads: int,
    head_dim: int,
    first_segment: int,
    causal: bool,
    device: torch.device,
    dtype: torch.dtype,
) -> int | None:
    """Peak bytes of one ``dilated_attention`` call (and backward), or None on CUDA OOM."""
    segments, rates = longnet_schedule(seq_len, first_segment)
    gc.collect()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        _reset_cpu_peak()
        base = _cpu_current_bytes()
    backward = mode == "forward+backward"
    try:
        shape = (1, seq_len, heads, head_dim)
        q, k, v = (torch.randn(shape, device=device, dtype=dtype) for _ in range(3))
        if backward:
            for t in (q, k, v):
                t.requires_grad_()
            out = dilated_attention(q, k, v, segments, rates, is_causal=causal)
            out.backward(torch.ones_like(out))
        else:
            with torch.no_grad():
                out = dilated_attention(q, k, v, segments, rates, is_causal=causal)
        if cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - base
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
    log: bool = True,
    **run_kwargs: Any,
) -> dict[str, Any]:
    """Double the length until it does not fit, then bisect; the summary row of one mode."""
    first_segment = run_kwargs["first_segment"]
    attempts: list[dict[str, Any]] = []
    best: dict[str, Any] | None = None
    stopped_by = "max_seq_len"

    def attempt(seq_len: int) -> tuple[bool, str]:
        nonlocal best
        if best is not None and budget_bytes is not None and run_kwargs["device"].type == "cpu":
            predicted = best["peak_bytes"] / best["seq_len"] * seq_len
            if predicted > budget_bytes:
                attempts.append(
                    {"seq_len": seq_len, "fits": False, "predicted_gib": predicted / GIB}
                )
                if log:
                    print(f"  {mode:>16} N={seq_len:>10,}: skipped, predicted "
                          f"{predicted / GIB:.2f} GiB > budget", flush=True)  # fmt: skip
                return False, "memory budget (predicted)"
        start = time.perf_counter()
        peak = run_once(seq_len, mode, **run_kwargs)
        seconds = time.perf_counter() - start
        fits = peak is not None and (budget_bytes is None or peak <= budget_bytes)
        row: dict[str, Any] = {"seq_len": seq_len, "fits": fits, "seconds": seconds}
        if peak is not None:
            row.update(peak_gib=peak / GIB, bytes_per_token=peak / seq_len)
        attempts.append(row)
        if log:
            what = "out of memory" if peak is None else f"{peak / GIB:.3f} GiB"
            print(f"  {mode:>16} N={seq_len:>10,}: {what}, {seconds:.2f} s"
                  f"{'' if fits else ' -> does not fit'}", flush=True)  # fmt: skip
        if fits:
            best = {"seq_len": seq_len, "peak_bytes": peak}
            return True, ""
        return False, "out of memory" if peak is None else "memory budget"

    # Warm-up (lazy initialisation, kernel loading) so it is not counted in the first attempt.
    run_once(min(start_len, max_seq_len, first_segment), mode, **run_kwargs)
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
    summary: dict[str, Any] = {"mode": mode, "stopped_by": stopped_by, "attempts": attempts}
    if best is None:
        summary.update(max_seq_len=0, peak_gib=None, bytes_per_token=None)
    else:
        summary.update(
            max_seq_len=best["seq_len"],
            peak_gib=best["peak_bytes"] / GIB,
            bytes_per_token=best["peak_bytes"] / best["seq_len"],
        )
    return summary


def plot(rows: list[dict[str, Any]], path: Path, budget_gib: float | None, title: str) -> bool:
    """Peak memory against sequence length per mode; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for row in rows:
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
    plt.close(fig)
    return True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument(
        "--dtype", choices=sorted(_DTYPES), default=None, help="default bfloat16 GPU, float32 CPU"
    )
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--first-segment", type=int, default=None, help="default 2048 GPU, 512 CPU")
    parser.add_argument("--start-len", type=int, default=None, help="default 4 x first segment")
    parser.add_argument(
        "--max-seq-len", type=int, default=None, help="cap (default 2**31 GPU, 2**17 CPU)"
    )
    parser.add_argument(
        "--max-memory-gib",
        type=float,
        default=None,
        help="memory budget (default 2 on CPU; on GPU none: run until out of memory)",
    )
    parser.add_argument("--bisect", type=int, default=2, help="bisection steps after doubling")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument(
        "--out", type=Path, default=None, help="write OUT.json and OUT.png (path without suffix)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the test; returns ``{"environment": ..., "results": [one row per mode]}``."""
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available")
    cuda = device.type == "cuda"
    dtype = _DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    first_segment = args.first_segment or (2048 if cuda else 512)
    start_len = args.start_len or 4 * first_segment
    max_seq_len = args.max_seq_len or (1 << 31 if cuda else 1 << 17)
    budget_gib = args.max_memory_gib if args.max_memory_gib is not None else (None if cuda else 2.0)
    budget = None if budget_gib is None else budget_gib * GIB
    config = {
        "heads": args.heads, "head_dim": args.head_dim, "dtype": str(dtype).removeprefix("torch."),
        "first_segment": first_segment, "causal": args.causal, "start_len": start_len,
        "max_seq_len_cap": max_seq_len, "max_memory_gib": budget_gib, "bisect": args.bisect,
        "memory_measure": "cuda.max_memory_allocated" if cuda else "process RSS high-water mark",
    }  # fmt: skip
    print(f"extreme-length test on {device}: {config}", flush=True)
    rows = []
    for mode in args.modes:
        row = search(
            mode, start_len=start_len, max_seq_len=max_seq_len, budget_bytes=budget,
            bisect=args.bisect, heads=args.heads, head_dim=args.head_dim,
            first_segment=first_segment, causal=args.causal, device=device, dtype=dtype,
        )  # fmt: skip
        rows.append(row)
    env = environment()
    env["config"] = config
    print(
        markdown_table(rows, ["mode", "max_seq_len", "peak_gib", "bytes_per_token", "stopped_by"])
    )
    if args.out is not None:
        json_path = args.out.with_name(args.out.name + ".json")
        write_record(json_path, env, rows)
        print(f"wrote {json_path}")
        if not args.no_plot:
            png = args.out.with_name(args.out.name + ".png")
            title = f"{env['device']}, H={args.heads} D={args.head_dim} {config['dtype']}"
            if plot(rows, png, budget_gib, title):
                print(f"wrote {png}")
            else:
                print("matplotlib is not installed: no plot")
    return {"environment": env, "results": rows}


if __name__ == "__main__":
    main()
