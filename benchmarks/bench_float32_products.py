"""float32 products in the Triton kernels: "tf32x3" against "ieee" (Note [float32 products] in
``dilated_attention/backends/triton_kernels/launchers.py``).

For each product precision, in one process: the error of a float32 forward+backward against the
float64 math backend (N = 4,096), its time (N = 16,384, median of 10, CUDA events) and each
kernel's compile time (Triton's compilation listener; each compiled alone at first launch).

    python benchmarks/bench_float32_products.py  # -> benchmarks/results/float32_products_<device>
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

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

import dilated_attention as da
from dilated_attention.backends import get_backend
from dilated_attention.backends.triton_kernels import launchers as kernels

SEGMENTS, RATES, HEADS, DIM = [512, 1024, 2048, 4096], [1, 2, 4, 8], 8, 64
PRECISIONS = ("tf32x3", "ieee")


def _call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str) -> torch.Tensor:
    return da.dilated_attention(q, k, v, SEGMENTS, RATES, is_causal=True, backend=backend)


def _errors(seq_len: int) -> dict[str, float]:
    """Relative Frobenius errors of out, dq, dk, dv against float64 (math backend)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (1, seq_len, HEADS, DIM)
    q, k, v, dout = (torch.randn(shape, device="cuda", generator=gen) for _ in range(4))
    results = {}
    for name, dtype, backend in (("ref", torch.float64, "math"), ("ours", torch.float32, "triton")):
        leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
        out = _call(*leaves, backend)
        grads = torch.autograd.grad(out, leaves, dout.to(dtype))
        results[name] = [out.double(), *(g.double() for g in grads)]
    return {
        f"{label} rel err": float((ours - ref).norm() / ref.norm())
        for label, ours, ref in zip(
            ("out", "dq", "dk", "dv"), results["ours"], results["ref"], strict=True
        )
    }


def _time(seq_len: int) -> float:
    shape = (1, seq_len, HEADS, DIM)
    q, k, v = (torch.randn(shape, device="cuda", requires_grad=True) for _ in range(3))
    dout = torch.randn(shape, device="cuda")
    return time_cuda(lambda: torch.autograd.grad(_call(q, k, v, "triton"), [q, k, v], dout))[
        "median_ms"
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help=OUT_HELP)
    args = parser.parse_args()
    from triton import knobs

    knobs.cache.dir = tempfile.mkdtemp(prefix="triton-cache-")  # every kernel compiles here

    # Each kernel compiles alone when first launched (no family compiled ahead in parallel), so
    # the listener's times are one compile's.
    get_backend("triton").begin_compile = lambda family: None

    compiles: list[dict[str, Any]] = []

    def listener(src: Any, metadata: Any, metadata_group: Any, times: Any, cache_hit: bool) -> None:
        total = times.ir_initialization + sum(us for _, us in times.lowering_stages)
        compiles.append({"kernel": src.fn.__name__, "seconds": total / 1e6, "hit": cache_hit})

    knobs.compilation.listener = listener
    default = kernels.dot_precision
    rows = []
    for precision in PRECISIONS:
        kernels.dot_precision = lambda x, p=precision: p if x.dtype == torch.float32 else default(x)
        compiles.clear()
        row: dict[str, Any] = {"precision": precision, **_errors(4096)}
        built = [c for c in compiles if not c["hit"]]
        row["kernels compiled"] = len(built)
        row["slowest compile s"] = round(max((c["seconds"] for c in built), default=0.0), 2)
        row["fwd+bwd ms (N=16384)"] = round(_time(16384), 3)
        rows.append(row)
        print(row, flush=True)
    kernels.dot_precision = default
    notes = (
        f"float32, B = 1, H = {HEADS}, D = {DIM}, causal, segments {SEGMENTS}, rates {RATES}. "
        "Errors: relative Frobenius norm against the float64 math backend at N = 4,096. Time: "
        "forward+backward at N = 16,384, median of 10 (CUDA events). Compile: Triton's listener "
        "(front end + every lowering stage) per kernel, each compiled alone into an empty cache; "
        "the slowest."
    )
    path, env = record_path("float32_products", args.out), environment()
    write_record(path.with_suffix(".json"), env, rows, notes=notes)
    table = markdown_table(rows, list(rows[0]))
    path.with_suffix(".md").write_text(record_header(env) + notes + "\n\n" + table + "\n")
    print(table)


if __name__ == "__main__":
    main()
