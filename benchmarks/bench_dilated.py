"""Dilated attention on one GPU: the library's path vs gather + cuDNN vs the dense-kernel ceiling.

    python benchmarks/bench_dilated.py    # -> benchmarks/results/dilated_<device>.{json,md,png}

For each schedule (LongNet: w = 2048..32768 with r = 1, 2, 4, 8, 16; the paper's r = 1, 2, 4, 6,
12), head dim, sequence length and causal flag (B = 1, H = 16, bf16; ``--kv-heads`` for GQA), in
one run:

- ``auto``: ``dilated_attention(..., backend=None)``, what users get (the chosen backends are
  recorded: ``fwd_backend`` without gradients, ``backend`` with them; on sm90 the fused Triton
  kernels, ``backend="triton"``, or FlashAttention-4 writing into branch slots from the length
  ``slots_thresholds.json`` gives the cell, where it is installed);
- ``triton``: the same call with ``backend="triton"`` (the fused kernels whatever ``auto`` picks;
  not run by default);
- ``gather+cudnn``: the same call with ``backend="sdpa_cudnn"``: every branch's rows gathered into
  dense tensors, cuDNN, merged and scattered back (the fallback path);
- ``flash_attn4``: the same call with ``backend="flash_attn4"``: one FlashAttention-4 call per
  (branch, offset class or diagonal head block) on strided views of q, k, v (no gathers), each
  writing into its branch's slot, the slots merged once (not run by default; needs
  ``flash-attn-4``);
- ``cudnn ceiling``: cuDNN alone on tensors already shaped like every branch's rows
  ``(B * N / w, ceil(w / r), H, D)`` (and a shorter last segment's, where N leaves one; no
  gather, no merge), its times summed over the branches;
- ``fa4 ceiling``: the same with FlashAttention-4 (not run by default).

Effective TFLOP/s = paper FLOPs / time, with paper FLOPs = 4 * D * sum over heads and branches of
(N / r) * (w / r), halved when causal, times 3.5 for forward+backward. Memory = peak allocated,
less what the process held beside the inputs before the first call (PyTorch's cuBLAS workspace, 32
MiB on sm90, which the automatic choice's first probe of a kernel allocates for the process's
life), over the unavoidable bytes (q, k, v, out; with backward also dout, dq, dk, dv). Times are
the median of ``--repeats`` runs with CUDA events (more where those take less than ``--min-ms`` in
all); with ``--rounds R`` every path of a cell is measured R times in turn and the median of those
medians kept, so no path is timed only in the state the one before it left (short calls are bound
by the host: on an H100 the first path timed after a new shape's compile ran 1.35x slower over its
next 60 calls). Writes OUT.json (environment + rows), OUT.md and OUT.png; OUT defaults to
``benchmarks/results/dilated_<device>`` (``h100``, ``h200x2``, ...: ``_timing.host_label``), the
latest record of this benchmark on that device.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import (
    OUT_HELP,
    environment,
    markdown_table,
    record_header,
    record_path,
    time_fwd_and_fwd_bwd,
    write_record,
)

from dilated_attention import attention, dilated_attention
from dilated_attention.backends import KernelInputs
from dilated_attention.backends.registry import choose
from dilated_attention.core.segment import runs_in_slots

SCHEDULES = {
    "longnet": ((2048, 4096, 8192, 16384, 32768), (1, 2, 4, 8, 16)),
    "paper": ((2048, 4096, 8192, 16384, 32768), (1, 2, 4, 6, 12)),
}
GIB = 2**30
PATHS = ("auto", "triton", "flash_attn4", "gather+cudnn", "cudnn ceiling", "fa4 ceiling")
PLOT_STYLES = {"auto": "-", "triton": "-", "flash_attn4": "-.", "gather+cudnn": ":",
               "cudnn ceiling": "--", "fa4 ceiling": "--"}  # fmt: skip


def paper_flops(seq_len: int, heads: int, dim: int, segs: tuple[int, ...], rates: tuple[int, ...],
                causal: bool) -> float:  # fmt: skip
    """4 * D * sum over heads and branches of (N / r) * (w / r), halved when causal (forward)."""
    work = sum((seq_len / r) * (min(w, seq_len) / r) for w, r in zip(segs, rates, strict=True))
    return 4.0 * dim * heads * work / (2.0 if causal else 1.0)


def _ceiling(
    backend: str, seq_len: int, heads: int, dim: int, segs: tuple[int, ...],
    rates: tuple[int, ...], causal: bool, args: argparse.Namespace,
) -> dict[str, float]:  # fmt: skip
    """``backend`` alone on every branch's row shape (its whole segments, and a shorter last one
    where the sequence leaves one; keys with ``args.kv_heads`` heads), times summed (no gather,
    no merge)."""
    total = {"fwd_ms": 0.0, "fwd_bwd_ms": 0.0}
    shapes = []
    for w, r in zip(segs, rates, strict=True):
        w = min(w, seq_len)
        shapes.append((seq_len // w, -(-w // r)))
        if seq_len % w:
            shapes.append((1, -(-(seq_len % w) // r)))
    kv_heads = _kv_heads(args)
    for segments, rows in shapes:
        q, k, v = (
            torch.randn(segments, rows, h, dim, device="cuda", dtype=torch.bfloat16)
            for h in (heads, kv_heads, kv_heads)
        )
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        res = time_fwd_and_fwd_bwd(
            lambda q=q, k=k, v=v: attention(q, k, v, is_causal=causal, backend=backend),
            [q, k, v], functools.partial(torch.randn_like, q), warmup=args.warmup,
            repeats=args.repeats, min_ms=args.min_ms,
        )  # fmt: skip
        total["fwd_ms"] += res["fwd_ms"]
        total["fwd_bwd_ms"] += res["fwd_bwd_ms"]
    return total


def _kv_heads(args: argparse.Namespace) -> int:
    return args.kv_heads or args.heads


def bench_config(
    schedule: str, seq_len: int, dim: int, causal: bool, args: argparse.Namespace
) -> list[dict[str, object]]:
    segs, rates = SCHEDULES[schedule]
    heads = args.heads
    kv_heads = _kv_heads(args)
    base = {"schedule": schedule, "seq_len": seq_len, "head_dim": dim, "heads": heads,
            "kv_heads": kv_heads, "causal": causal}  # fmt: skip
    flops = paper_flops(seq_len, heads, dim, segs, rates, causal)
    q_bytes, kv_bytes = (seq_len * h * dim * 2 for h in (heads, kv_heads))
    # q, k, v, out; with backward also dout, dq, dk, dv.
    unavoidable = {"fwd": 2 * q_bytes + 2 * kv_bytes, "fwd_bwd": 4 * q_bytes + 4 * kv_bytes}
    q, k, v = (
        torch.randn(1, seq_len, h, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for h in (heads, kv_heads, kv_heads)
    )
    slots = runs_in_slots(seq_len, heads, kv_heads, segs, rates)
    # What ``auto`` runs: the forward-only step without gradients, forward+backward with them.
    auto = {
        step: choose(
            KernelInputs.from_tensors(q, k, is_causal=causal, dilated=True, branch_slots=slots,
                                      requires_grad=step == "fwd_bwd")
        ).backend
        for step in ("fwd", "fwd_bwd")
    }  # fmt: skip
    resident = torch.cuda.memory_allocated() - q_bytes - 2 * kv_bytes  # not the call's own

    def library(backend: str | None) -> Callable[[], dict[str, float]]:
        return lambda: time_fwd_and_fwd_bwd(
            lambda: dilated_attention(q, k, v, segs, rates, is_causal=causal, backend=backend),
            [q, k, v], functools.partial(torch.randn_like, q), warmup=args.warmup,
            repeats=args.repeats, min_ms=args.min_ms,
        )  # fmt: skip

    def ceiling(backend: str) -> Callable[[], dict[str, float]]:
        return lambda: _ceiling(backend, seq_len, heads, dim, segs, rates, causal, args)

    paths: dict[str, Callable[[], dict[str, float]]] = {
        "auto": library(None),
        "triton": library("triton"),
        "flash_attn4": library("flash_attn4"),
        "gather+cudnn": library("sdpa_cudnn"),
        "cudnn ceiling": ceiling("sdpa_cudnn"),
        "fa4 ceiling": ceiling("flash_attn4"),
    }
    measured = measure_in_rounds({name: paths[name] for name in args.paths}, args.rounds)
    rows = []
    for name in args.paths:
        row: dict[str, object] = {**base, "path": name}
        if name == "auto":
            row["backend"], row["fwd_backend"] = auto["fwd_bwd"], auto["fwd"]
        res = measured[name]
        if isinstance(res, str):
            row["error"] = res
            rows.append(row)
            print(row, flush=True)
            continue
        for step, work in (("fwd", flops), ("fwd_bwd", 3.5 * flops)):
            row[f"{step}_ms"] = res[f"{step}_ms"]
            row[f"{step}_tflops"] = work / (res[f"{step}_ms"] * 1e-3) / 1e12
            if f"{step}_peak_bytes" in res:
                row[f"{step}_peak_gib"] = res[f"{step}_peak_bytes"] / GIB
                held = res[f"{step}_peak_bytes"] - resident
                row[f"{step}_mem_ratio"] = held / unavoidable[step]
        rows.append(row)
        print(row, flush=True)
    for name, key in (("cudnn ceiling", "vs_ceiling"), ("fa4 ceiling", "vs_fa4_ceiling")):
        top = next((r for r in rows if r["path"] == name and "fwd_ms" in r), None)
        for row in rows:
            if top is not None and "fwd_ms" in row:
                for step in ("fwd", "fwd_bwd"):
                    row[f"{step}_{key}"] = row[f"{step}_tflops"] / top[f"{step}_tflops"]
    return rows


def measure_in_rounds(
    paths: dict[str, Callable[[], dict[str, float]]], rounds: int
) -> dict[str, dict[str, float] | str]:
    """Each path's measurement, taken ``rounds`` times in turn (every path once per round, so
    all see the same state of the machine: clocks, the host's load after a compile), combined
    into the median time and the largest peak per step; ``"out of memory"`` for a path that did
    not fit (not measured again)."""
    taken: dict[str, list[dict[str, float]]] = {name: [] for name in paths}
    failed: dict[str, str] = {}
    for _ in range(rounds):
        for name, measure in paths.items():
            if name in failed:
                continue
            try:
                taken[name].append(measure())
            except torch.OutOfMemoryError:
                failed[name] = "out of memory"
                torch.cuda.empty_cache()
    combined: dict[str, dict[str, float] | str] = dict(failed)
    for name, results in taken.items():
        if name not in failed:
            combined[name] = {
                key: (max if key.endswith("_bytes") else statistics.median)(r[key] for r in results)
                for key in results[0]
            }
    return combined


def _plot(rows: list[dict[str, object]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    keys = sorted({(r["schedule"], r["head_dim"], r["causal"]) for r in rows}, key=str)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, step in zip(axes, ("fwd", "fwd_bwd"), strict=True):
        for schedule, dim, causal in keys:
            for path_name, style in PLOT_STYLES.items():
                pts = sorted(
                    (r["seq_len"], r[f"{step}_tflops"])
                    for r in rows
                    if (r["schedule"], r["head_dim"], r["causal"]) == (schedule, dim, causal)
                    and r["path"] == path_name and f"{step}_tflops" in r
                )  # fmt: skip
                if pts:
                    label = f"{path_name} {schedule} D={dim}{' causal' if causal else ''}"
                    ax.plot(*zip(*pts, strict=True), style, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_title(f"{step.replace('_', '+')}: effective TFLOP/s")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("TFLOP/s (paper FLOPs / time)")
    axes[1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--schedules", nargs="+", choices=list(SCHEDULES), default=list(SCHEDULES))
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[65536, 262144, 1048576])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=None,
                        help="key/value heads (GQA); default: --heads")  # fmt: skip
    parser.add_argument("--paths", nargs="+", default=["auto", "gather+cudnn", "cudnn ceiling"],
                        choices=PATHS)  # fmt: skip
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--min-ms", type=float, default=0.0,
        help="time more runs where --repeats of them take less than this (ms) in all",
    )  # fmt: skip
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="measure every path of a cell this many times in turn; the median is kept",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help=OUT_HELP)
    args = parser.parse_args()
    if args.rounds < 1 or args.min_ms < 0:
        parser.error(f"--rounds must be at least 1 and --min-ms at least 0, got {args.rounds} "
                     f"and {args.min_ms}")  # fmt: skip
    if not torch.cuda.is_available():
        raise SystemExit("bench_dilated.py needs a CUDA device")
    causal_flags = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    rows = []
    for schedule in args.schedules:
        for dim in args.head_dims:
            for causal in causal_flags:
                for seq_len in args.seq_lens:
                    rows += bench_config(schedule, seq_len, dim, causal, args)
    env = environment()
    out = record_path("dilated", args.out)
    cols = ["schedule", "head_dim", "kv_heads", "causal", "seq_len", "path", "fwd_backend",
            "backend", "fwd_ms",
            "fwd_tflops", "fwd_vs_ceiling", "fwd_vs_fa4_ceiling", "fwd_bwd_ms", "fwd_bwd_tflops",
            "fwd_bwd_vs_ceiling", "fwd_bwd_vs_fa4_ceiling", "fwd_mem_ratio", "fwd_bwd_mem_ratio",
            "error"]  # fmt: skip
    write_record(out.with_suffix(".json"), env, rows, columns=cols)
    table = record_header(env) + markdown_table(rows, cols)
    out.with_suffix(".md").write_text(table + "\n")
    _plot(rows, out.with_suffix(".png"))
    print(table)


if __name__ == "__main__":
    main()
