"""Sweep FlashAttention-4's sm90 forward tiles on dilated branch rows (CUDA, ``flash-attn-4``).

    python benchmarks/tune_fa4_forward.py   # -> results/tune_fa4_forward_<device>.{json,md}

Every branch of LongNet's schedule gives the kernel sequences of w / r = 2048 rows (a segment's
rows of one offset), many of them: far shorter than the sequences FA4's tile heuristic
(``_tile_size_fwd_sm90``) was tuned on. For each head dim and causality this times
``flash_attn.cute.interface._flash_attn_fwd`` (``return_lse=True``, as the library calls it) on
(segments, rows, heads, D) bf16 tensors under each candidate ``(tile_m, tile_n, mma_pv_is_rs,
intra_wg_overlap)``, and cuDNN SDPA on the same tensors in the same run; each candidate's output
is compared with the default configuration's (``max_abs_diff``). Configurations that do not
compile are recorded as errors. ``--budget-s`` stops the sweep in time to write what it has.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

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

#: (tile_m, tile_n, mma_pv_is_rs, intra_wg_overlap) per head dim; ``None`` is FA4's own choice.
CANDIDATES: dict[int, list[tuple[int, int, bool, bool] | None]] = {
    64: [None, (128, 128, True, True), (192, 128, False, True), (128, 192, True, True),
         (192, 192, True, True), (128, 256, True, True), (128, 128, False, True),
         (192, 128, True, False)],
    128: [None, (128, 128, False, True), (128, 176, True, True), (128, 192, True, True),
          (128, 160, True, True), (128, 96, True, True), (128, 64, True, True),
          (128, 128, True, False)],
}  # fmt: skip


def _cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """cuDNN SDPA on (B, N, H, D) tensors, through (B, H, N, D) views."""
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
        ).transpose(1, 2)


def _fa4(
    interface: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
    config: dict[str, Any],
) -> torch.Tensor:  # fmt: skip
    """FA4's forward as the library calls it (with the lse), under ``config``'s overrides."""
    return interface._flash_attn_fwd(q, k, v, causal=causal, return_lse=True, **config)[0]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=2048, help="rows per sequence (w / r)")
    parser.add_argument("--segments", type=int, default=512, help="sequences (batch)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=480.0)
    parser.add_argument("--out", type=Path, default=None, help=OUT_HELP)
    args = parser.parse_args()
    from flash_attn.cute import interface

    began = time.monotonic()
    causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    rows: list[dict[str, object]] = []
    for dim in args.head_dims:
        shape = (args.segments, args.rows, args.heads, dim)
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for causal in causals:
            flops = 4.0 * args.segments * args.heads * args.rows**2 * dim / (2 if causal else 1)
            base = {"rows": args.rows, "segments": args.segments, "heads": args.heads,
                    "head_dim": dim, "causal": causal}  # fmt: skip
            cudnn = functools.partial(_cudnn, q, k, v, causal)
            ms = time_cuda(cudnn, warmup=2, repeats=args.repeats)
            rows.append({**base, "config": "cuDNN", "ms": ms["median_ms"],
                         "tflops": flops / ms["median_ms"] / 1e9})  # fmt: skip
            print(rows[-1], flush=True)
            reference = None
            for cand in CANDIDATES[dim]:
                if time.monotonic() - began > args.budget_s:
                    break
                extra: dict[str, Any] = {}
                if cand is not None:
                    extra = {"tile_mn": cand[:2], "mma_pv_is_rs": cand[2],
                             "intra_wg_overlap": cand[3]}  # fmt: skip
                name = "default" if cand is None else "{}x{} rs={} ol={}".format(*cand)
                row: dict[str, object] = {**base, "config": name}
                run = functools.partial(_fa4, interface, q, k, v, causal, extra)
                try:
                    out = run()
                    if reference is None:
                        reference = out
                    row["max_abs_diff"] = (out.float() - reference.float()).abs().max().item()
                    ms = time_cuda(run, warmup=2, repeats=args.repeats)
                    row["ms"] = ms["median_ms"]
                    row["tflops"] = flops / ms["median_ms"] / 1e9
                except Exception as exc:  # a configuration that cannot compile is a finding
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
                rows.append(row)
                print(row, flush=True)
    for row in rows:
        cudnn = next(
            r["ms"] for r in rows
            if r["config"] == "cuDNN" and r["head_dim"] == row["head_dim"]
            and r["causal"] == row["causal"]
        )  # fmt: skip
        if "ms" in row:
            row["vs_cudnn"] = cudnn / row["ms"]
    env = environment()
    out = record_path("tune_fa4_forward", args.out)
    columns = ["rows", "segments", "heads", "head_dim", "causal", "config", "ms", "tflops",
               "vs_cudnn", "max_abs_diff", "error"]  # fmt: skip
    write_record(out.with_suffix(".json"), env, rows, columns=columns)
    table = markdown_table(rows, columns)
    out.with_suffix(".md").write_text(record_header(env) + table + "\n")
    print(table)


if __name__ == "__main__":
    main()
