"""Dilated attention on one GPU: the library's paths vs dense attention vs the dense-kernel ceiling.

    python benchmarks/bench_dilated.py    # -> benchmarks/results/dilated_<device>.{json,md,png}

For each schedule (``longnet``: w = 2048..32768 with r = 1, 2, 4, 8, 16; ``paper``: the paper's
r = 1, 2, 4, 6, 12; ``longnet_n``: ``longnet_schedule(N)`` at each length N, segments doubling
from 2048 until one covers N, not run by default), head dim, sequence length, causal flag and
key/value head count (B = 1, H = 16, bf16; ``--kv-heads 16 4`` runs both in one record), in one
run:

- ``auto``: ``dilated_attention(..., backend=None)``, what users get (the chosen backends are
  recorded: ``fwd_backend`` without gradients, ``backend`` with them; on sm90 the fused Triton
  kernels, ``backend="triton"``, or FlashAttention-4 writing into branch slots from the length
  ``slots_thresholds.json`` gives the cell, where it is installed);
- ``auto captured``: the same call captured once in a CUDA graph and timed by replaying it (the
  forward captured under ``no_grad``; the forward and ``out.backward(dout)`` as one graph; not
  run by default);
- ``triton``: the same call with ``backend="triton"`` (the fused kernels whatever ``auto`` picks;
  not run by default);
- ``gather+cudnn``: the same call with ``backend="sdpa_cudnn"``: every branch's rows gathered into
  dense tensors, cuDNN, merged and scattered back (the fallback path);
- ``flash_attn4``: the same call with ``backend="flash_attn4"``: one FlashAttention-4 call per
  (branch, offset class or diagonal head block) on strided views of q, k, v (no gathers), each
  writing into its branch's slot, the slots merged once (not run by default; needs
  ``flash-attn-4``);
- ``dense cudnn``: dense attention over the whole sequence at the same N, PyTorch's SDPA forced to
  cuDNN (``sdpa_kernel(SDPBackend.CUDNN_ATTENTION)``, ``enable_gqa=True`` where the key/value
  heads are fewer) on transposed views: what the dilated call is measured against (not run by
  default);
- ``dense attention``: the library's dense ``attention(q, k, v, is_causal=...)`` at the same N,
  its automatic choice (recorded like ``auto``'s; not run by default);
- ``dense fa4``: the same with ``backend="flash_attn4"``, whose whole calls replay from CUDA
  graphs once they repeat (Note [A whole call's launches from a CUDA graph]), and ``dense fa4
  launched``: that call with ``DILATED_ATTENTION_CUDA_GRAPHS=0`` while it is measured, every
  call launched as usual (neither run by default; need ``flash-attn-4``);
- ``cudnn ceiling``: cuDNN alone on tensors already shaped like every branch's rows
  ``(B * N / w, ceil(w / r), H, D)`` (and a shorter last segment's, where N leaves one; no
  gather, no merge), its times summed over the branches;
- ``fa4 ceiling``: the same with FlashAttention-4 (not run by default).

Every row carries ``flop_ratio``: the dense call's (query, key) pairs over the schedule's (each
branch's pairs counted, causal or not as the row; :func:`schedule_pairs`), the speedup the sparsity
promises; and ``fwd_host_ms`` / ``fwd_bwd_host_ms``: the median wall time of the Python call, the
synchronisation after it not counted (``_timing.timed_call``; for ``auto captured`` the replay's),
and ``fwd_host_steady_ms`` / ``fwd_bwd_host_steady_ms``: the same for calls issued back to back, as
a training loop issues them (``_timing.steady_calls``: on the lent machines a call right after the
host waited for the device takes 2-4x longer on the host), with ``fwd_steady_ms`` /
``fwd_bwd_steady_ms`` the device time one of those calls adds to the loop (CUDA events around
rounds of them; ``fwd_ms`` times each call alone, after a synchronisation, its host time after the
wait included where it passes the device's). Where ``dense cudnn`` was measured, every row of the
cell has ``fwd_speedup`` / ``fwd_bwd_speedup``: dense cuDNN's time over the row's, and
``fwd_steady_speedup`` / ``fwd_bwd_steady_speedup`` the same for the back-to-back times. A path
that fails records its error in its row (``error``) and the run goes on. A path whose measurement
made calls that launched as usual because their CUDA graph had failed to capture or had been dropped
past the graphs' limit (Note [A call's launches from a CUDA graph]) says how many in
``uncaptured_calls``.

Effective TFLOP/s = paper FLOPs / time, with paper FLOPs = 4 * D * sum over heads and branches of
(N / r) * (w / r), halved when causal, times 3.5 for forward+backward (the dense paths too: their
rate is the dilated call's work over their time). Memory = peak allocated, less what the process
held beside the inputs before the first call (PyTorch's cuBLAS workspace, 32 MiB on sm90, which
the automatic choice's first probe of a kernel allocates for the process's life), over the
unavoidable bytes (q, k, v, out; with backward also dout, dq, dk, dv). Times are the median of
``--repeats`` runs with CUDA events (more where those take less than ``--min-ms`` in all); with
``--rounds R`` every path of a cell is measured R times in turn and the median of those medians
kept, so no path is timed only in the state the one before it left (short calls are bound by the
host: on an H100 the first path timed after a new shape's compile ran 1.35x slower over its next
60 calls). Writes OUT.json (environment + rows), OUT.md and OUT.png; OUT defaults to
``benchmarks/results/dilated_<device>`` (``h100``, ``h200x2``, ...: ``_timing.host_label``), the
latest record of this benchmark on that device.

The short lengths, where the host's time decides (the record ``dilated_short_h100``: one such
run per head dim, ``--head-dims 64`` and ``--head-dims 128``, their rows joined):

    python benchmarks/bench_dilated.py --schedules longnet_n \\
        --seq-lens 4096 8192 16384 32768 65536 --head-dims 64 128 --kv-heads 16 4 \\
        --causal both --paths auto 'auto captured' 'dense cudnn' 'dense attention' \\
        --warmup 3 --min-ms 50 --rounds 2 --out benchmarks/results/dilated_short_h100
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import os
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import (
    OUT_HELP,
    environment,
    error_text,
    markdown_table,
    record_header,
    record_path,
    recover,
    step_columns,
    time_captured_fwd_and_fwd_bwd,
    time_fwd_and_fwd_bwd,
    write_record,
)

from dilated_attention import attention, dilated_attention, longnet_schedule
from dilated_attention.backends import KernelInputs
from dilated_attention.backends.registry import choose
from dilated_attention.core.execution import graphs
from dilated_attention.core.geometry.segment import runs_in_slots

Schedule = tuple[tuple[int, ...], tuple[int, ...]]
#: Fixed (segments, rates), or None for ``longnet_schedule(N)`` at each length N.
SCHEDULES: dict[str, Schedule | None] = {
    "longnet": ((2048, 4096, 8192, 16384, 32768), (1, 2, 4, 8, 16)),
    "paper": ((2048, 4096, 8192, 16384, 32768), (1, 2, 4, 6, 12)),
    "longnet_n": None,
}
DEFAULT_SCHEDULES = ["longnet", "paper"]
GIB = 2**30
PATHS = ("auto", "auto captured", "triton", "flash_attn4", "gather+cudnn", "dense cudnn",
         "dense attention", "dense fa4", "dense fa4 launched", "cudnn ceiling",
         "fa4 ceiling")  # fmt: skip
PLOT_STYLES = {"auto": "-", "auto captured": "-", "triton": "-", "flash_attn4": "-.",
               "gather+cudnn": ":", "dense cudnn": "--", "dense attention": ":",
               "dense fa4": "-.", "dense fa4 launched": ":", "cudnn ceiling": "--",
               "fa4 ceiling": "--"}  # fmt: skip


def schedule_at(name: str, seq_len: int) -> Schedule:
    """The (segments, rates) of schedule ``name`` at length ``seq_len``."""
    fixed = SCHEDULES[name]
    if fixed is not None:
        return fixed
    segments, rates = longnet_schedule(seq_len)
    return tuple(segments), tuple(rates)


def schedule_pairs(seq_len: int, heads: int, segs: tuple[int, ...], rates: tuple[int, ...],
                   causal: bool) -> int:  # fmt: skip
    """(query, key) pairs the schedule's branches visit, summed over heads and branches (a pair
    that two branches share counted in each: the work each does). Branch ``(w, r)`` cuts the
    sequence into segments of ``w`` (the last may be shorter); in each, head ``j`` takes the
    ``m`` rows ``j mod r, j mod r + r, ...``: ``m * m`` pairs, ``m * (m + 1) / 2`` when causal."""

    def pairs(length: int, offset: int, rate: int) -> int:
        m = max(0, -(-(length - offset) // rate))
        return m * (m + 1) // 2 if causal else m * m

    total = 0
    for w, r in zip(segs, rates, strict=True):
        whole, last = divmod(seq_len, w)
        for head in range(heads):
            total += whole * pairs(w, head % r, r) + (pairs(last, head % r, r) if last else 0)
    return total


def flop_ratio(seq_len: int, heads: int, segs: tuple[int, ...], rates: tuple[int, ...],
               causal: bool) -> float:  # fmt: skip
    """Dense attention's (query, key) pairs over the schedule's (:func:`schedule_pairs`), the
    same causal flag: ``N * N`` per head, ``N * (N + 1) / 2`` when causal."""
    dense = seq_len * (seq_len + 1) // 2 if causal else seq_len * seq_len
    return heads * dense / schedule_pairs(seq_len, heads, segs, rates, causal)


def paper_flops(seq_len: int, heads: int, dim: int, segs: tuple[int, ...], rates: tuple[int, ...],
                causal: bool) -> float:  # fmt: skip
    """4 * D * sum over heads and branches of (N / r) * (w / r), halved when causal (forward)."""
    work = sum((seq_len / r) * (min(w, seq_len) / r) for w, r in zip(segs, rates, strict=True))
    return 4.0 * dim * heads * work / (2.0 if causal else 1.0)


def dense_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """PyTorch's SDPA on the whole sequence, (B, N, H, D) in and out through (B, H, N, D) views;
    call it inside ``sdpa_kernel(SDPBackend.CUDNN_ATTENTION)`` (:func:`_dense_cudnn_measure`
    enters it once around the measurement, so the call's host time is SDPA's own)."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
        enable_gqa=k.shape[2] != q.shape[2],
    )  # fmt: skip
    return out.transpose(1, 2)


def _ceiling(
    backend: str, seq_len: int, heads: int, kv_heads: int, dim: int, segs: tuple[int, ...],
    rates: tuple[int, ...], causal: bool, args: argparse.Namespace,
) -> dict[str, float]:  # fmt: skip
    """``backend`` alone on every branch's row shape (its whole segments, and a shorter last one
    where the sequence leaves one; keys with ``kv_heads`` heads), times summed (no gather, no
    merge)."""
    total = {"fwd_ms": 0.0, "fwd_bwd_ms": 0.0, "fwd_host_ms": 0.0, "fwd_bwd_host_ms": 0.0}
    shapes = []
    for w, r in zip(segs, rates, strict=True):
        w = min(w, seq_len)
        shapes.append((seq_len // w, -(-w // r)))
        if seq_len % w:
            shapes.append((1, -(-(seq_len % w) // r)))
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
        for key in total:
            total[key] += res[key]
    return total


def _choices(q: torch.Tensor, k: torch.Tensor, causal: bool, *, dilated: bool = False,
             slots: bool = False) -> dict[str, str]:  # fmt: skip
    """The kernels the automatic choice runs: ``fwd_backend`` without gradients, ``backend`` with
    them (the dilated registry's where ``dilated``, else the dense one's)."""
    names = {}
    for key, grad in (("fwd_backend", False), ("backend", True)):
        try:
            inputs = KernelInputs.from_tensors(q, k, is_causal=causal, dilated=dilated,
                                               branch_slots=slots, requires_grad=grad)  # fmt: skip
            names[key] = choose(inputs).backend
        except Exception as exc:  # recorded, not fatal: the path's own call shows the failure
            names[key] = f"unknown ({type(exc).__name__})"
    return names


def _measures(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segs: tuple[int, ...],
    rates: tuple[int, ...], causal: bool, args: argparse.Namespace,
) -> dict[str, Callable[[], dict[str, float]]]:  # fmt: skip
    """Every path of a cell as a function that measures it once."""
    seq_len, heads, dim, kv_heads = q.shape[1], q.shape[2], q.shape[3], k.shape[2]
    timing = {"warmup": args.warmup, "repeats": args.repeats, "min_ms": args.min_ms}
    dout = functools.partial(torch.randn_like, q)

    def library(backend: str | None) -> Callable[[], dict[str, float]]:
        return lambda: time_fwd_and_fwd_bwd(
            lambda: dilated_attention(q, k, v, segs, rates, is_causal=causal, backend=backend),
            [q, k, v], dout, **timing,
        )  # fmt: skip

    def auto_captured() -> dict[str, float]:
        return time_captured_fwd_and_fwd_bwd(
            lambda: dilated_attention(q, k, v, segs, rates, is_causal=causal, backend=None),
            [q, k, v], dout, **timing,
        )  # fmt: skip

    def cudnn_whole() -> dict[str, float]:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return time_fwd_and_fwd_bwd(lambda: dense_cudnn(q, k, v, causal), [q, k, v], dout,
                                        **timing)  # fmt: skip

    def dense_library(backend: str | None = None, replayed: bool = True) -> dict[str, float]:
        with graphs_allowed(replayed):
            return time_fwd_and_fwd_bwd(
                lambda: attention(q, k, v, is_causal=causal, backend=backend), [q, k, v], dout,
                **timing,
            )  # fmt: skip

    def ceiling(backend: str) -> Callable[[], dict[str, float]]:
        return lambda: _ceiling(backend, seq_len, heads, kv_heads, dim, segs, rates, causal, args)

    return {
        "auto": library(None),
        "auto captured": auto_captured,
        "triton": library("triton"),
        "flash_attn4": library("flash_attn4"),
        "gather+cudnn": library("sdpa_cudnn"),
        "dense cudnn": cudnn_whole,
        "dense attention": dense_library,
        "dense fa4": functools.partial(dense_library, "flash_attn4"),
        "dense fa4 launched": functools.partial(dense_library, "flash_attn4", False),
        "cudnn ceiling": ceiling("sdpa_cudnn"),
        "fa4 ceiling": ceiling("flash_attn4"),
    }


@contextlib.contextmanager
def graphs_allowed(allowed: bool) -> Iterator[None]:
    """The library's CUDA graphs as they are (``allowed``), or turned off for the block
    (``DILATED_ATTENTION_CUDA_GRAPHS=0``: every call launches as usual)."""
    before = os.environ.get(graphs.ENV_VAR)
    if not allowed:
        os.environ[graphs.ENV_VAR] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(graphs.ENV_VAR, None)
        else:
            os.environ[graphs.ENV_VAR] = before


def cell_base(schedule: str, seq_len: int, dim: int, causal: bool, heads: int,
              kv_heads: int) -> dict[str, Any]:  # fmt: skip
    """What every row of a cell carries: its key, its schedule and the schedule's FLOP ratio."""
    segs, rates = schedule_at(schedule, seq_len)
    return {"schedule": schedule, "seq_len": seq_len, "head_dim": dim, "heads": heads,
            "kv_heads": kv_heads, "causal": causal, "segments": list(segs), "rates": list(rates),
            "flop_ratio": flop_ratio(seq_len, heads, segs, rates, causal)}  # fmt: skip


def bench_config(
    schedule: str, seq_len: int, dim: int, causal: bool, kv_heads: int, args: argparse.Namespace
) -> list[dict[str, object]]:
    """Every path of ``args.paths`` on one cell, one row each."""
    segs, rates = schedule_at(schedule, seq_len)
    heads = args.heads
    base = cell_base(schedule, seq_len, dim, causal, heads, kv_heads)
    flops = paper_flops(seq_len, heads, dim, segs, rates, causal)
    q_bytes, kv_bytes = (seq_len * h * dim * 2 for h in (heads, kv_heads))
    # q, k, v, out; with backward also dout, dq, dk, dv.
    unavoidable = {"fwd": 2 * q_bytes + 2 * kv_bytes, "fwd_bwd": 4 * q_bytes + 4 * kv_bytes}
    q, k, v = (
        torch.randn(1, seq_len, h, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for h in (heads, kv_heads, kv_heads)
    )
    slots = runs_in_slots(seq_len, heads, kv_heads, segs, rates)
    # What the automatic paths run: the forward-only step without gradients, forward+backward
    # with them.
    chosen = {"dilated": _choices(q, k, causal, dilated=True, slots=slots),
              "dense": _choices(q, k, causal)}  # fmt: skip
    resident = torch.cuda.memory_allocated() - q_bytes - 2 * kv_bytes  # not the call's own
    paths = _measures(q, k, v, segs, rates, causal, args)
    measured = measure_in_rounds({name: paths[name] for name in args.paths}, args.rounds)
    rows = []
    for name in args.paths:
        row: dict[str, object] = {**base, "path": name}
        if name in ("auto", "auto captured"):
            row.update(chosen["dilated"])
        elif name == "dense attention":
            row.update(chosen["dense"])
        res = measured[name]
        if isinstance(res, str):
            row["error"] = res
            rows.append(_shown(row))
            continue
        for step, work in (("fwd", flops), ("fwd_bwd", 3.5 * flops)):
            row.update({column: res[column] for column in step_columns(step) if column in res})
            row[f"{step}_tflops"] = work / (res[f"{step}_ms"] * 1e-3) / 1e12
            if f"{step}_peak_bytes" in res:
                row[f"{step}_peak_gib"] = res[f"{step}_peak_bytes"] / GIB
                held = res[f"{step}_peak_bytes"] - resident
                row[f"{step}_mem_ratio"] = held / unavoidable[step]
        if "uncaptured_calls" in res:
            row["uncaptured_calls"] = res["uncaptured_calls"]
        rows.append(_shown(row))
    relative_columns(rows)
    return rows


def relative_columns(rows: list[dict[str, Any]]) -> None:
    """Each measured row's ratios to the cell's references, where those were measured:
    ``fwd_speedup`` / ``fwd_bwd_speedup`` = ``dense cudnn``'s time over the row's, and
    ``*_steady_speedup`` the same for the calls issued back to back;
    ``*_vs_ceiling`` / ``*_vs_fa4_ceiling`` = the row's TFLOP/s over the ceiling's."""
    dense = next((r for r in rows if r["path"] == "dense cudnn" and "fwd_ms" in r), None)
    ceilings = {key: next((r for r in rows if r["path"] == name and "fwd_ms" in r), None)
                for name, key in (("cudnn ceiling", "vs_ceiling"),
                                  ("fa4 ceiling", "vs_fa4_ceiling"))}  # fmt: skip
    for row in rows:
        if "fwd_ms" not in row:
            continue
        for step in ("fwd", "fwd_bwd"):
            for kind in ("", "_steady"):  # one call at a time, back to back
                timed = f"{step}{kind}_ms"
                if dense is not None and timed in row and timed in dense:
                    row[f"{step}{kind}_speedup"] = dense[timed] / row[timed]
            for key, top in ceilings.items():
                if top is not None:
                    row[f"{step}_{key}"] = row[f"{step}_tflops"] / top[f"{step}_tflops"]


def _shown(row: dict[str, Any]) -> dict[str, Any]:
    """``row``, printed as it comes (a run cut short still shows what it measured)."""
    print(row, flush=True)
    return row


def measure_in_rounds(
    paths: dict[str, Callable[[], dict[str, float]]], rounds: int
) -> dict[str, dict[str, float] | str]:
    """Each path's measurement, taken ``rounds`` times in turn (every path once per round, so
    all see the same state of the machine: clocks, the host's load after a compile), combined
    into the median time and the largest peak per step; for a path that failed, its error
    (:func:`error_text`: ``"out of memory"`` where it did not fit), and it is not measured
    again."""
    taken: dict[str, list[dict[str, float]]] = {name: [] for name in paths}
    failed: dict[str, str] = {}
    uncaptured = dict.fromkeys(paths, 0)  # calls whose graph failed or was dropped
    for _ in range(rounds):
        for name, measure in paths.items():
            if name in failed:
                continue
            before = graphs.events()
            try:
                taken[name].append(measure())
            except Exception as exc:  # recorded in the path's row; the other paths go on
                failed[name] = error_text(exc)
            uncaptured[name] += graphs.events()["uncaptured"] - before["uncaptured"]
            if name in failed:  # out of the handler: its traceback no longer holds the tensors
                recover()
    combined: dict[str, dict[str, float] | str] = dict(failed)
    for name, results in taken.items():
        if name not in failed:
            combined[name] = {
                key: (max if key.endswith("_bytes") else statistics.median)(r[key] for r in results)
                for key in results[0]
            }
            if uncaptured[name]:
                combined[name]["uncaptured_calls"] = uncaptured[name]  # type: ignore[index]
    return combined


def _plot(rows: list[dict[str, object]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    cell = ("schedule", "head_dim", "causal", "heads", "kv_heads")
    keys = sorted({tuple(r[c] for c in cell) for r in rows}, key=str)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, step in zip(axes, ("fwd", "fwd_bwd"), strict=True):
        for key in keys:
            schedule, dim, causal, heads, kv_heads = key
            for path_name, style in PLOT_STYLES.items():
                pts = sorted(
                    (r["seq_len"], r[f"{step}_tflops"])
                    for r in rows
                    if tuple(r[c] for c in cell) == key and r["path"] == path_name
                    and f"{step}_tflops" in r
                )  # fmt: skip
                if pts:
                    label = (f"{path_name} {schedule} D={dim}{' causal' if causal else ''}"
                             f"{f' kv={kv_heads}' if kv_heads != heads else ''}")  # fmt: skip
                    ax.plot(*zip(*pts, strict=True), style, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_title(f"{step.replace('_', '+')}: effective TFLOP/s")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("TFLOP/s (paper FLOPs / time)")
    axes[1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``sys.argv`` when ``argv`` is None), checked: exits with a message
    naming the argument on a value it cannot run, before any work."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--schedules", nargs="+", choices=list(SCHEDULES),
                        default=DEFAULT_SCHEDULES)  # fmt: skip
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[65536, 262144, 1048576])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, nargs="+", default=None,
                        help="key/value head counts (GQA), each a cell of its own; "
                             "default: --heads")  # fmt: skip
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
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.min_ms < 0:
        parser.error(f"--rounds must be at least 1 and --min-ms at least 0, got {args.rounds} "
                     f"and {args.min_ms}")  # fmt: skip
    args.kv_heads = args.kv_heads or [args.heads]
    if any(h < 1 or args.heads % h for h in args.kv_heads):
        parser.error(f"--kv-heads must divide --heads ({args.heads}), got {args.kv_heads}: "
                     f"pass divisors of {args.heads}, such as 16 4 for 16 heads")  # fmt: skip
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_dilated.py needs a CUDA device")
    causal_flags = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    rows = []
    cells = itertools.product(args.schedules, args.kv_heads, args.head_dims, causal_flags,
                              args.seq_lens)  # fmt: skip
    for schedule, kv_heads, dim, causal, seq_len in cells:
        error = None
        try:
            rows += bench_config(schedule, seq_len, dim, causal, kv_heads, args)
        except Exception as exc:  # the cell itself failed (its inputs, its kernel choice)
            error = error_text(exc)
        if error is not None:  # every path of the cell says so, and the run goes on
            recover()
            base = cell_base(schedule, seq_len, dim, causal, args.heads, kv_heads)
            rows += [_shown({**base, "path": name, "error": error}) for name in args.paths]
    env = environment()
    out = record_path("dilated", args.out)
    cols = ["schedule", "head_dim", "kv_heads", "causal", "seq_len", "flop_ratio", "path",
            "fwd_backend", "backend", "fwd_ms", "fwd_host_ms", "fwd_host_steady_ms",
            "fwd_steady_ms", "fwd_speedup", "fwd_steady_speedup", "fwd_tflops", "fwd_vs_ceiling",
            "fwd_vs_fa4_ceiling", "fwd_bwd_ms", "fwd_bwd_host_ms", "fwd_bwd_host_steady_ms",
            "fwd_bwd_steady_ms", "fwd_bwd_speedup", "fwd_bwd_steady_speedup", "fwd_bwd_tflops",
            "fwd_bwd_vs_ceiling", "fwd_bwd_vs_fa4_ceiling", "fwd_mem_ratio", "fwd_bwd_mem_ratio",
            "uncaptured_calls", "error"]  # fmt: skip
    cols = [c for c in cols if any(c in r for r in rows)]  # those no path run gives: left out
    write_record(out.with_suffix(".json"), env, rows, columns=cols)
    table = record_header(env) + markdown_table(rows, cols)
    out.with_suffix(".md").write_text(table + "\n")
    _plot(rows, out.with_suffix(".png"))
    print(table)


if __name__ == "__main__":
    main()
