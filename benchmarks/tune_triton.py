"""Sweep the Triton kernels' tile sizes on the dilated workload (tables:
``triton_kernels/tiles.py``).

    python benchmarks/tune_triton.py   # -> benchmarks/results/tune_triton_<device>.{json,md}
    python benchmarks/tune_triton.py --seq-lens 4096 16384 65536 262144 --schedule longnet \
        --causal --head-dims 128 --kernels forward dkdv --steady \
        --out benchmarks/results/tune_triton_causal_h200

For each head dim, length and key/value head count, each kernel (``forward``, ``dkdv``, ``dq``)
is timed with every candidate tile configuration while the other two keep their current setting
(a candidate applies to every variant of its kernel: both row loads of the forward and its
causal descriptor tiles, the causal and strided dK/dV tiles): the forward through a no-grad
``dilated_attention`` call, the backward kernels through forward+backward (B = 1, H = 16, bf16).
The schedule is ``fixed`` (w = 2048..32768, r = 1..16; the default) or ``longnet``
(``longnet_schedule(N)``); ``--causal`` makes every call causal. Times are medians of calls
timed one at a time, or with ``--steady`` of calls issued back to back (``_timing.steady_calls``,
the median of three rounds: the time a call adds to a training loop, which decides at short
lengths). Configurations that do not compile (shared memory, registers) are recorded as
errors. Writes OUT.json and OUT.md; OUT defaults to ``benchmarks/results/tune_triton_<device>``
(``h100``, ``h200x2``, ...: ``_timing.host_label``).
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import (
    OUT_HELP,
    STEADY_ROUNDS,
    environment,
    markdown_table,
    record_header,
    record_path,
    steady_calls,
    time_cuda,
    write_record,
)

from dilated_attention import dilated_attention, longnet_schedule
from dilated_attention.backends import triton as triton_backend
from dilated_attention.backends.triton_kernels.launch import clear_bound
from dilated_attention.backends.triton_kernels.tiles import TileConfig
from dilated_attention.core.execution import graphs

SEGMENTS, RATES = (2048, 4096, 8192, 16384, 32768), (1, 2, 4, 8, 16)
#: With ``--steady``, the least time of one round of calls issued back to back.
STEADY_ROUND_MS = 10.0


def candidates(kernel: str) -> list[tuple[int, int, int, int]]:
    """(block_m, block_n, num_warps, num_stages) to try: the configurations that compile for sm90
    without heavy register spills (checked offline with ptxas -v), a few each way from there."""
    return {
        "forward": [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 4, 3),
                    (64, 32, 4, 3), (128, 32, 8, 3), (128, 128, 8, 3), (64, 128, 4, 2),
                    (64, 128, 4, 3)],
        "dkdv": [(32, 64, 4, 3), (64, 64, 4, 2), (32, 128, 8, 2), (64, 128, 8, 2),
                 (32, 32, 4, 3), (64, 64, 8, 3), (16, 64, 4, 3), (32, 64, 8, 3),
                 (64, 64, 4, 3), (64, 32, 4, 2), (128, 64, 8, 2)],
        "dq": [(64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 3), (128, 32, 8, 3),
               (64, 64, 8, 2), (128, 128, 8, 2), (32, 64, 4, 3), (64, 128, 8, 2),
               (128, 64, 8, 2), (128, 64, 4, 3), (64, 64, 4, 2)],
    }[kernel]  # fmt: skip


def _runs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
    schedule: tuple[tuple[int, ...], tuple[int, ...]], causal: bool,
) -> tuple[Callable[[], None], Callable[[], None]]:  # fmt: skip
    """A no-grad forward and a forward+backward of the workload through the Triton backend."""
    segments, rates = schedule

    def call() -> torch.Tensor:
        return dilated_attention(q, k, v, segments, rates, is_causal=causal, backend="triton")

    def fwd() -> None:
        with torch.no_grad():
            call()

    def fwd_bwd() -> None:
        torch.autograd.grad(call(), (q, k, v), dout)

    return fwd, fwd_bwd


def _time(run: Callable[[], None], args: argparse.Namespace) -> float:
    """The median ms of ``run``: timed one at a time, or with ``--steady`` back to back, in
    rounds of at least :data:`STEADY_ROUND_MS` each (a round of one short call would time the
    device waiting for the host's first launch)."""
    if not args.steady:
        return time_cuda(run, warmup=1, repeats=args.repeats)["median_ms"]
    first = time_cuda(run, warmup=1, repeats=1)["median_ms"]  # compiles and binds first
    per_round = max(1, math.ceil(STEADY_ROUND_MS / max(first, 1e-3)))
    calls = max(args.repeats, per_round * STEADY_ROUNDS)
    rounds = sorted(steady_calls(run, calls=calls)["ms"] for _ in range(3))
    return rounds[1]


def _use_tiles(tiles: object) -> None:
    """Make every launch take ``tiles`` (a table entry, or the default lookup): bound launches
    and replayed graphs keep the tiles they were made with, so both are dropped."""
    triton_backend._tiles = tiles
    graphs.clear()
    clear_bound()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[131072])
    parser.add_argument("--schedule", choices=("fixed", "longnet"), default="fixed")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--kv-heads", type=int, nargs="+", default=[16])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--kernels", nargs="+", default=["forward", "dkdv", "dq"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steady", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help=OUT_HELP)
    args = parser.parse_args()
    default_tiles = triton_backend._tiles
    rows = []
    for dim, seq_len, kv_heads in itertools.product(args.head_dims, args.seq_lens, args.kv_heads):
        schedule = (SEGMENTS, RATES) if args.schedule == "fixed" else longnet_schedule(seq_len)
        q = torch.randn(1, seq_len, 16, dim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, seq_len, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))  # fmt: skip
        for x in (q, k, v):
            x.requires_grad_(True)
        dout = torch.randn_like(q)
        fwd, fwd_bwd = _runs(q, k, v, dout, schedule, args.causal)
        cell = {"head_dim": dim, "seq_len": seq_len, "kv_heads": kv_heads, "causal": args.causal}
        for kernel in args.kernels:
            for cand in [None, *candidates(kernel)]:
                # The candidate also replaces the kernel's variants (``forward_descriptors``,
                # ``dkdv_causal``, ...), so it is what runs whichever variant this call takes.
                trial = {
                    key: TileConfig(*cand) if cand and key.split("_")[0] == kernel else tile
                    for key, tile in default_tiles(q).items()
                }
                _use_tiles(lambda _x, trial=trial: trial)
                config = "table" if cand is None else "x".join(map(str, cand))
                row: dict[str, object] = {**cell, "kernel": kernel, "config": config}
                try:
                    row["ms"] = _time(fwd if kernel == "forward" else fwd_bwd, args)
                except Exception as exc:  # a configuration that cannot compile is a finding
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
                finally:
                    _use_tiles(default_tiles)
                rows.append(row)
                print(row, flush=True)
    best = []
    for dim, seq_len, kv_heads in itertools.product(args.head_dims, args.seq_lens, args.kv_heads):
        for kernel in args.kernels:
            timed = [r for r in rows if "ms" in r and r["config"] != "table" and (
                r["head_dim"], r["seq_len"], r["kv_heads"], r["kernel"]) == (
                dim, seq_len, kv_heads, kernel)]  # fmt: skip
            if timed:
                best.append({**min(timed, key=lambda r: r["ms"]), "best": True})
    env = environment()
    out = record_path("tune_triton", args.out)
    columns = ["head_dim", "seq_len", "kv_heads", "causal", "kernel", "config", "ms", "best",
               "error"]  # fmt: skip
    write_record(out.with_suffix(".json"), env, rows + best, columns=columns)
    table = markdown_table(best + rows, columns)
    out.with_suffix(".md").write_text(record_header(env) + table + "\n")
    print(table)


if __name__ == "__main__":
    main()
