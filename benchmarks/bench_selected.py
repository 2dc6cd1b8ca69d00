"""Content-selected sparse attention on one GPU: MoBA- and NSA-style calls vs dense cuDNN.

    python benchmarks/bench_selected.py    # -> benchmarks/results/selected_<device>.{json,md}

For each length N (B = 1, H = 16, 4 key/value heads, D = 128, bf16, causal), in one run:

- ``dense cudnn``: PyTorch's SDPA forced to cuDNN on the whole sequence (``enable_gqa``);
- ``selection``: ``select_blocks`` alone (MoBA's gate, ``--block-size`` blocks, ``--topk``
  blocks per query block beside its own), the share of the MoBA call it takes: an eager call
  on an idle GPU (``selection_share``: the host's checks and allocations before its first
  launch included), and the GPU's own time, the same call replayed from a CUDA graph
  (``selection_gpu_share``: what it costs where the host runs ahead of the GPU, as in a
  model's forward), and of calls issued back to back, both the selection's and MoBA's
  (``selection_steady_share``: the share a training loop sees, ``_timing.steady_calls``);
- ``moba``: ``moba_attention`` (the selection, then ``block_sparse_attention`` on its run-time
  block indices, the automatic kernel choice); ``moba, given blocks``: ``block_sparse_attention``
  on block indices selected once (the attention alone); ``moba, given mask``: the same blocks as
  a bool mask (its lists as wide as the key blocks);
- ``nsa``: ``nsa_attention`` with gates (compressed keys of ``32`` pooled every ``16``, the same
  selected blocks, a 512-token window); ``nsa, recomputed``: the same with ``recompute=True``
  (the backward runs the branches again a group of heads at a time);
- ``all blocks``: ``block_sparse_attention`` on a mask that keeps every causal block pair: the
  kernel the run-time masks take, run dense;
- ``moba captured``, ``nsa captured``: ``moba`` and ``nsa`` captured once in a CUDA graph (the
  forward without gradients, and the forward with the backward, as one graph each) and timed
  by replaying it (``_timing.time_captured_fwd_and_fwd_bwd``): the GPU's own time, where a
  model captures its step or its host runs ahead; peaks include the graph's pool.

Above ``--dense-up-to`` (default 262,144) the two dense rows are not run (dense cuDNN takes
30 s a step at 1M); that length's rates use the dense rows of the longest length measured,
their time scaled by the ratio of the lengths' dense pairs (``dense_from`` names it).

Every row carries ``keys_per_query`` (the selected keys a query block attends: (topk + 1) *
block size), ``pair_ratio`` (dense causal pairs over the pairs the mask keeps, counted on the
mask), and, for the MoBA rows, ``visited_rate`` = dense cuDNN's time / the row's time / the
pair ratio: the kernel's rate on the pairs it visits relative to dense cuDNN's rate on all of
its pairs (1.0 = as fast per pair as dense), and ``kernel_rate`` the same relative to the
``all blocks`` row (the same kernel's dense rate). Times are medians of CUDA-event timings
(``_timing.time_fwd_and_fwd_bwd``: no-grad forward, and forward+backward), peak memory over the
unavoidable bytes (q, k, v, out; with backward dout and the three gradients). A path's peak
leaves out what the harness holds for the other paths (the mask and block indices given to
the ``given`` rows, NSA's gates): the bytes allocated before its measurement, less its own
inputs.
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
    captured,
    environment,
    error_text,
    record_header,
    record_path,
    recover,
    time_captured_fwd_and_fwd_bwd,
    time_cuda,
    time_fwd_and_fwd_bwd,
    write_record,
)

from dilated_attention import block_sparse_attention
from dilated_attention.sparse import moba_attention, nsa_attention, select_blocks

COLUMNS = [
    "seq_len", "path", "keys_per_query", "pair_ratio", "fwd_ms", "fwd_bwd_ms", "fwd_speedup",
    "fwd_bwd_speedup", "visited_rate_fwd", "visited_rate_fwd_bwd", "kernel_rate_fwd",
    "kernel_rate_fwd_bwd", "fwd_mem_ratio", "fwd_bwd_mem_ratio", "fwd_steady_ms",
    "fwd_bwd_steady_ms", "selection_share", "selection_gpu_share", "selection_steady_share",
    "dense_from",
]  # fmt: skip

#: A path's times: one call at a time after a synchronisation, and calls issued back to back.
STEP_TIMES = ("fwd_ms", "fwd_bwd_ms", "fwd_steady_ms", "fwd_bwd_steady_ms")
#: The paths ``--paths`` may name (every one by default).
PATHS = ("dense cudnn", "moba", "moba, given blocks", "moba, given mask", "nsa",
         "nsa, recomputed", "all blocks", "moba captured", "nsa captured")  # fmt: skip
#: The paths timed by replaying a CUDA graph of the path named without " captured".
CAPTURED = ("moba captured", "nsa captured")
#: The rows that time dense attention, skipped above ``--dense-up-to``.
DENSE = ("dense cudnn", "all blocks")


def _held_for_others(inputs: list[torch.Tensor]) -> int:
    """Bytes allocated now besides the path's ``inputs``: what the harness holds for its other
    paths, left out of this path's peak."""
    return torch.cuda.memory_allocated() - sum(t.nbytes for t in inputs)


def _unavoidable(q: torch.Tensor, k: torch.Tensor, backward: bool) -> int:
    """Bytes of q, k, v, out (with the backward also dout, dq, dk, dv)."""
    once = 2 * q.nbytes + 2 * k.nbytes
    return 2 * once if backward else once


def measure(
    seq_len: int, args: argparse.Namespace, earlier: list[dict[str, Any]]
) -> list[dict[str, Any]]:
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
    blocks_chosen = select_blocks(q, k, block_size=bs, topk=topk, is_causal=True,
                                  return_indices=True)  # fmt: skip
    blocks = -(-seq_len // bs)
    dense_pairs = blocks * (blocks + 1) / 2 * args.heads
    pair_ratio = dense_pairs / float(mask.sum())
    gates = torch.rand(*shape, args.heads, 3, device=dev, dtype=bf16, requires_grad=True)
    every = torch.ones(1, 1, blocks, blocks, dtype=torch.bool, device=dev)
    nsa = dict(compress_block=32, compress_stride=16, select_block=bs, topk=topk, window=512)

    def dense() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(
                *(x.transpose(1, 2) for x in leaves), is_causal=True, enable_gqa=True
            )
        return out.transpose(1, 2)

    paths = {
        "dense cudnn": (dense, leaves, []),
        "moba": (lambda: moba_attention(q, k, v, block_size=bs, topk=topk), leaves, []),
        "moba, given blocks": (
            lambda: block_sparse_attention(
                q, k, v, blocks_chosen, block_size=bs, is_causal=True
            ),
            leaves, [blocks_chosen],
        ),
        "moba, given mask": (
            lambda: block_sparse_attention(q, k, v, mask, block_size=bs, is_causal=True),
            leaves, [mask],
        ),
        "nsa": (lambda: nsa_attention(q, k, v, gates, **nsa), [*leaves, gates], []),
        "nsa, recomputed": (
            lambda: nsa_attention(q, k, v, gates, recompute=True, **nsa), [*leaves, gates], [],
        ),
        "all blocks": (
            lambda: block_sparse_attention(q, k, v, every, block_size=bs, is_causal=True),
            leaves, [every],
        ),
    }
    for name in CAPTURED:
        paths[name] = paths[name.removesuffix(" captured")]
    if seq_len > args.dense_up_to:
        paths = {name: path for name, path in paths.items() if name not in DENSE}
    if args.paths:
        paths = {name: path for name, path in paths.items() if name in args.paths}
    rows: list[dict[str, Any]] = []
    for name, (fn, inputs, given) in paths.items():
        row: dict[str, Any] = {"seq_len": seq_len, "path": name,
                               "keys_per_query": (topk + 1) * bs, "pair_ratio": pair_ratio}
        try:
            others = _held_for_others([*inputs, *given])
            timer = time_captured_fwd_and_fwd_bwd if name in CAPTURED else time_fwd_and_fwd_bwd
            t = timer(fn, inputs, lambda: torch.randn_like(q), warmup=3, repeats=args.repeats,
                      min_ms=50)  # fmt: skip
            row.update({key: t[key] for key in STEP_TIMES})
            for step, backward in (("fwd", False), ("fwd_bwd", True)):
                peak = t[f"{step}_peak_bytes"] - others
                row[f"{step}_mem_ratio"] = peak / _unavoidable(q, k, backward)
        except Exception as exc:  # a path that fails records why; the run goes on
            row["error"] = error_text(exc)
            recover()
        rows.append(row)
    def selection() -> torch.Tensor:
        return select_blocks(q, k, block_size=bs, topk=topk, is_causal=True, return_indices=True)

    with torch.no_grad():
        eager = time_cuda(selection, warmup=3, repeats=args.repeats, min_ms=20, steady=True)
        graph = captured(selection)
        sel_gpu = time_cuda(graph.replay, warmup=3, repeats=args.repeats, min_ms=20)["median_ms"]
    sel, sel_steady = eager["median_ms"], eager["steady_ms"]
    rows.append({"seq_len": seq_len, "path": "selection", "fwd_ms": sel,
                 "fwd_steady_ms": sel_steady})  # fmt: skip
    rows.append({"seq_len": seq_len, "path": "selection, replayed", "fwd_ms": sel_gpu})
    derive(rows, {"eager": sel, "gpu": sel_gpu, "steady": sel_steady}, earlier)
    return rows


def derive(
    rows: list[dict[str, Any]], selection_ms: dict[str, float], earlier: list[dict[str, Any]]
) -> None:
    """Speedups over dense cuDNN, the MoBA rows' rates on the pairs they visit (speedup / pair
    ratio) against dense cuDNN and against the same kernel run dense (``all blocks``), and the
    selection's share of the MoBA call (``selection_ms``: ``"eager"`` and ``"gpu"`` (replayed)
    over MoBA's ``fwd_ms``, ``"steady"`` over its ``fwd_steady_ms``), in place.
    Where this length ran no dense rows, the longest of ``earlier`` that did serves, scaled by
    the dense pairs."""
    seq_len = rows[0]["seq_len"]
    reference = {r["path"]: r for r in rows if r["path"] in DENSE}
    scale, source = 1.0, None
    if not reference:
        done = [r for r in earlier if r["path"] in DENSE]
        if done:
            source = max(r["seq_len"] for r in done)
            reference = {r["path"]: r for r in done if r["seq_len"] == source}
            scale = _dense_pairs(seq_len) / _dense_pairs(source)
    for row in rows:
        if row["path"] in DENSE or row["path"].startswith("selection"):
            continue
        if source is not None:
            row["dense_from"] = source
        for step in ("fwd", "fwd_bwd"):
            if f"{step}_ms" not in row:
                continue
            for name, column in (("dense cudnn", "visited_rate"), ("all blocks", "kernel_rate")):
                base = reference.get(name, {}).get(f"{step}_ms")
                if base is None:
                    continue
                speedup = base * scale / row[f"{step}_ms"]
                if name == "dense cudnn":
                    row[f"{step}_speedup"] = speedup
                if row["path"].startswith("moba"):
                    row[f"{column}_{step}"] = speedup / row["pair_ratio"]
    moba = next((r for r in rows if r["path"] == "moba"), {})
    if "fwd_ms" in moba:
        moba["selection_share"] = selection_ms["eager"] / moba["fwd_ms"]
        moba["selection_gpu_share"] = selection_ms["gpu"] / moba["fwd_ms"]
    if "fwd_steady_ms" in moba and "steady" in selection_ms:
        moba["selection_steady_share"] = selection_ms["steady"] / moba["fwd_steady_ms"]


def _dense_pairs(seq_len: int) -> float:
    """Causal query-key pairs of one head at ``seq_len``."""
    return seq_len * (seq_len + 1) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[16384, 65536, 262144])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--topk", type=int, default=15, help="blocks beside a query's own")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dense-up-to", type=int, default=262144,
                        help="the longest length whose dense rows run")  # fmt: skip
    parser.add_argument("--paths", nargs="+", default=None, choices=PATHS,
                        help="measure only these paths (the selection always runs)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for seq_len in args.seq_lens:
        new = measure(seq_len, args, rows)
        rows += new
        print(markdown_table(new, COLUMNS), flush=True)
    env = environment()
    out = record_path("selected", args.out)
    write_record(out.with_suffix(".json"), env, rows, columns=COLUMNS)
    out.with_suffix(".md").write_text(record_header(env) + markdown_table(rows, COLUMNS) + "\n")


if __name__ == "__main__":
    main()
