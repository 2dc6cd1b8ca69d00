"""Sweep the Triton kernels' tile sizes on the dilated workload (tables:
``triton_kernels/tiles.py``).

    python benchmarks/tune_triton.py   # -> benchmarks/results/tune_triton_<device>.{json,md}

For each head dim, each kernel (``forward``, ``dkdv``, ``dq``) is timed with every candidate tile
configuration while the other two keep their current setting (a candidate applies to every
variant of its kernel: both row loads of the forward, the causal and strided dK/dV tiles): the
forward through a no-grad ``dilated_attention`` call, the backward kernels through
forward+backward (LongNet schedule
w = 2048..32768, r = 1..16, B = 1, H = 16, bf16, non-causal). Configurations that do not compile
(shared memory, registers) are recorded as errors. Writes OUT.json and OUT.md; OUT defaults to
``benchmarks/results/tune_triton_<device>`` (``h100``, ``h200x2``, ...: ``_timing.host_label``).
"""

from __future__ import annotations

import argparse
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
    time_cuda,
    write_record,
)

from dilated_attention import dilated_attention
from dilated_attention.backends import triton as triton_backend
from dilated_attention.backends.triton_kernels.tiles import TileConfig

SEGMENTS, RATES = (2048, 4096, 8192, 16384, 32768), (1, 2, 4, 8, 16)


def candidates(kernel: str) -> list[tuple[int, int, int, int]]:
    """(block_m, block_n, num_warps, num_stages) to try: the configurations that compile for sm90
    without heavy register spills (checked offline with ptxas -v), a few each way from there."""
    return {
        "forward": [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 4, 3),
                    (64, 32, 4, 3), (128, 32, 8, 3), (128, 128, 8, 3), (64, 128, 4, 2)],
        "dkdv": [(32, 64, 4, 3), (64, 64, 4, 2), (32, 128, 8, 2), (64, 128, 8, 2),
                 (32, 32, 4, 3), (64, 64, 8, 3), (16, 64, 4, 3), (32, 64, 8, 3),
                 (64, 64, 4, 3), (64, 32, 4, 2), (128, 64, 8, 2)],
        "dq": [(64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 3), (128, 32, 8, 3),
               (64, 64, 8, 2), (128, 128, 8, 2), (32, 64, 4, 3), (64, 128, 8, 2),
               (128, 64, 8, 2), (128, 64, 4, 3), (64, 64, 4, 2)],
    }[kernel]  # fmt: skip


def _runs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor
) -> tuple[Callable[[], None], Callable[[], None]]:
    """A no-grad forward and a forward+backward of the workload through the Triton backend."""

    def fwd() -> None:
        with torch.no_grad():
            dilated_attention(q, k, v, SEGMENTS, RATES, backend="triton")

    def fwd_bwd() -> None:
        out = dilated_attention(q, k, v, SEGMENTS, RATES, backend="triton")
        torch.autograd.grad(out, (q, k, v), dout)

    return fwd, fwd_bwd


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--seq-len", type=int, default=131072)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--kernels", nargs="+", default=["forward", "dkdv", "dq"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help=OUT_HELP)
    args = parser.parse_args()
    default_tiles = triton_backend._tiles
    rows = []
    for dim in args.head_dims:
        shape = (1, args.seq_len, 16, dim)
        q, k, v = (
            torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(3)
        )
        dout = torch.randn_like(q)
        fwd, fwd_bwd = _runs(q, k, v, dout)
        for kernel in args.kernels:
            for cand in candidates(kernel):
                # The candidate also replaces the kernel's variants (``forward_descriptors``,
                # ``dkdv_causal``, ...), so it is what runs whichever variant this call takes.
                trial = {
                    key: TileConfig(*cand) if key.split("_")[0] == kernel else tile
                    for key, tile in default_tiles(q).items()
                }
                triton_backend._tiles = lambda _x, trial=trial: trial
                row: dict[str, object] = {"head_dim": dim, "kernel": kernel,
                                          "config": "x".join(map(str, cand))}  # fmt: skip
                try:
                    run = fwd if kernel == "forward" else fwd_bwd
                    row["ms"] = time_cuda(run, warmup=1, repeats=args.repeats)["median_ms"]
                except Exception as exc:  # a configuration that cannot compile is a finding
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
                finally:
                    triton_backend._tiles = default_tiles
                rows.append(row)
                print(row, flush=True)
    best = []
    for dim in args.head_dims:
        for kernel in args.kernels:
            timed = [
                r for r in rows if r["head_dim"] == dim and r["kernel"] == kernel and "ms" in r
            ]
            if timed:
                best.append({**min(timed, key=lambda r: r["ms"]), "best": True})
    env = environment()
    out = record_path("tune_triton", args.out)
    columns = ["head_dim", "kernel", "config", "ms", "best", "error"]
    write_record(out.with_suffix(".json"), env, rows + best, columns=columns)
    table = markdown_table(best + rows, columns)
    out.with_suffix(".md").write_text(record_header(env) + table + "\n")
    print(table)


if __name__ == "__main__":
    main()
