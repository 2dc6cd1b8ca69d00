"""Content-selected sparse attention on one GPU: MoBA- and NSA-style calls vs dense cuDNN.

    python benchmarks/bench_selected.py    # -> benchmarks/results/selected_<device>.{json,md}

For each length N (B = 1, H = 16, 4 key/value heads, D = 128, bf16, causal), in one run:

- ``dense cudnn``: PyTorch's SDPA forced to cuDNN on the whole sequence (``enable_gqa``);
- ``selection``: ``select_blocks`` alone (MoBA's gate, ``--block-size`` blocks, ``--topk``
  blocks per query block beside its own), the share of the MoBA call it takes;
- ``moba``: ``moba_attention`` (the selection, then ``block_sparse_attention`` on its run-time
  mask, the automatic kernel choice); ``moba, given mask``: ``block_sparse_attention`` on a mask
  selected once (the attention alone);
- ``nsa``: ``nsa_attention`` with gates (compressed keys of ``32`` pooled every ``16``, the same
  selected blocks, a 512-token window).

Every row carries ``keys_per_query`` (the selected keys a query block attends: (topk + 1) *
block size), ``pair_ratio`` (dense causal pairs over the pairs the mask keeps, counted on the
mask), and, for the MoBA rows, ``visited_rate`` = dense cuDNN's time / the row's time x the
pair ratio: the kernel's rate on the pairs it visits relative to dense cuDNN's rate on all of
its pairs (1.0 = as fast per pair as dense). Times are medians of CUDA-event timings
(``_timing.time_fwd_and_fwd_bwd``: no-grad forward, and forward+backward), peak memory over the
unavoidable bytes (q, k, v, out; with backward dout and the three gradients).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _records import markdown_table
from _timing import (
    environment,
    error_text,
    record_header,
    record_path,
    recover,
    time_cuda,
    time_fwd_and_fwd_bwd,
    write_record,
)

from dilated_attention import block_sparse_attention
from dilated_attention.sparse import moba_attention, nsa_attention, select_blocks

COLUMNS = [
    "seq_len", "path", "keys_per_query", "pair_ratio", "fwd_ms", "fwd_bwd_ms", "fwd_speedup",
    "fwd_bwd_speedup", "visited_rate_fwd", "visited_rate_fwd_bwd", "fwd_mem_ratio",
    "fwd_bwd_mem_ratio", "selection_share",
]  # fmt: skip


def _unavoidable(q: torch.Tensor, k: torch.Tensor, backward: bool) -> int:
    """Bytes of q, k, v, out (with the backward also dout, dq, dk, dv)."""
    once = 2 * q.nbytes + 2 * k.nbytes
    return 2 * once if backward else once


def measure(seq_len: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every path at one length (rows of :data:`COLUMNS`)."""
    torch.manual_seed(0)
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    shape = (1, seq_len)
    q = torch.randn(*shape, args.heads, 128, device=dev, dtype=bf16, requires_grad=True)
    k, v = (torch.randn(*shape, args.kv_heads, 128, device=dev, dtype=bf16, requires_grad=True)
            for _ in range(2))  # fmt: skip
    leaves = [q, k, v]
    bs, topk = args.block_size, args.topk
    mask = select_blocks(q, k, block_size=bs, topk=topk, is_causal=True)
    blocks = -(-seq_len // bs)
    dense_pairs = blocks * (blocks + 1) / 2 * args.heads
    pair_ratio = dense_pairs / float(mask.sum())
    gates = torch.rand(*shape, args.heads, 3, device=dev, dtype=bf16, requires_grad=True)

    def dense() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(
                *(x.transpose(1, 2) for x in leaves), is_causal=True, enable_gqa=True
            )
        return out.transpose(1, 2)

    paths = {
        "dense cudnn": (dense, leaves),
        "moba": (lambda: moba_attention(q, k, v, block_size=bs, topk=topk), leaves),
        "moba, given mask": (
            lambda: block_sparse_attention(q, k, v, mask, block_size=bs, is_causal=True), leaves
        ),
        "nsa": (
            lambda: nsa_attention(q, k, v, gates, compress_block=32, compress_stride=16,
                                  select_block=bs, topk=topk, window=512),
            [*leaves, gates],
        ),
    }
    rows: list[dict[str, Any]] = []
    for name, (fn, inputs) in paths.items():
        row: dict[str, Any] = {"seq_len": seq_len, "path": name,
                               "keys_per_query": (topk + 1) * bs, "pair_ratio": pair_ratio}
        try:
            t = time_fwd_and_fwd_bwd(fn, inputs, lambda: torch.randn_like(q), warmup=3,
                                     repeats=args.repeats, min_ms=50)  # fmt: skip
            row.update(fwd_ms=t["fwd_ms"], fwd_bwd_ms=t["fwd_bwd_ms"])
            row["fwd_mem_ratio"] = t["fwd_peak_bytes"] / _unavoidable(q, k, False)
            row["fwd_bwd_mem_ratio"] = t["fwd_bwd_peak_bytes"] / _unavoidable(q, k, True)
        except Exception as exc:  # a path that fails records why; the run goes on
            row["error"] = error_text(exc)
            recover()
        rows.append(row)
    with torch.no_grad():
        sel = time_cuda(lambda: select_blocks(q, k, block_size=bs, topk=topk, is_causal=True),
                        warmup=3, repeats=args.repeats, min_ms=20)["median_ms"]  # fmt: skip
    rows.append({"seq_len": seq_len, "path": "selection", "fwd_ms": sel})
    derive(rows, sel)
    return rows


def derive(rows: list[dict[str, Any]], selection_ms: float) -> None:
    """Speedups over dense cuDNN (the first row), the MoBA rows' rate on the pairs they visit
    (speedup / pair ratio) and the selection's share of the MoBA call, in place."""
    base = rows[0]
    for row in rows[1:]:
        if row["path"] == "selection":
            continue
        for step in ("fwd", "fwd_bwd"):
            if f"{step}_ms" in row and f"{step}_ms" in base:
                row[f"{step}_speedup"] = base[f"{step}_ms"] / row[f"{step}_ms"]
                if row["path"].startswith("moba"):
                    row[f"visited_rate_{step}"] = row[f"{step}_speedup"] / row["pair_ratio"]
    moba = next(r for r in rows if r["path"] == "moba")
    if "fwd_ms" in moba:
        moba["selection_share"] = selection_ms / moba["fwd_ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[16384, 65536, 262144])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--topk", type=int, default=15, help="blocks beside a query's own")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for seq_len in args.seq_lens:
        rows += measure(seq_len, args)
        print(markdown_table(rows[-5:], COLUMNS), flush=True)
    env = environment()
    out = record_path("selected", args.out)
    write_record(out.with_suffix(".json"), env, rows, columns=COLUMNS)
    out.with_suffix(".md").write_text(record_header(env) + markdown_table(rows, COLUMNS) + "\n")


if __name__ == "__main__":
    main()
