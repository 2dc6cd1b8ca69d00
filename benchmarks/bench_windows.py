"""Local windows and sinks: what a windowed layer costs against the dense kernel at the same shape.

One run on CUDA (bf16, B = 1, causal). Two families of cells:

- ``window``: H = 16, D = 128, a sliding window of ``--window`` tokens (``window_size=(W - 1,
  0)``) at each of ``--seq-lens``;
- ``gpt-oss``: a gpt-oss-shaped layer, H = 64 query and 8 key/value heads of D = 64, a window of
  128 tokens and learned sinks, at each of ``--oss-seq-lens``.

Paths, each timed forward and forward+backward (median of ``--repeats`` CUDA-event runs):

- ``auto``: ``attention(q, k, v, is_causal=True, window_size=..., sinks=...)``, the automatic
  kernel choice (its kernel is recorded);
- ``triton``: the same on our Triton kernels (``backend="triton"``), where they take windows;
- ``fa4 kernel``: FlashAttention-4's own windowed call (``_flash_attn_fwd`` /
  ``_flash_attn_bwd`` with ``window_size_left`` and, for gpt-oss, ``learnable_sink``), no
  library code around it: the ceiling of any path that runs it;
- ``dense fa4`` and ``dense cudnn``: causal attention over the whole sequence on
  FlashAttention-4 and on cuDNN (SDPA), up to ``--dense-max`` tokens (beyond it the dense
  kernels' time is out of reach; their TFLOP/s rate is flat in N there).

TFLOP/s count the multiply-adds of the pairs each path visits: a causal window of ``W`` visits
``sum_p min(p + 1, W)`` pairs, the dense causal call ``N (N + 1) / 2``; forward+backward =
3.5x forward (FlashAttention's convention). ``ratio_vs_dense`` divides a windowed path's rate by
dense FlashAttention-4's at the same N, or at the longest N measured dense.

    python benchmarks/bench_windows.py  # -> benchmarks/results/windows_<device>.{json,md}
"""

from __future__ import annotations

import argparse
import functools
import sys
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
    time_fwd_and_fwd_bwd,
    write_record,
)

from dilated_attention import attention, explain

FWD_BWD_FACTOR = 3.5


def window_pairs(n: int, window: int | None) -> int:
    """Causal (query, key) pairs a window of ``window`` tokens visits over ``n`` positions."""
    if window is None or window >= n:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


def _fa4_call(q, k, v, window: int | None, sinks: torch.Tensor | None):
    """FlashAttention-4's own forward (and backward through its autograd function)."""
    from flash_attn.cute.interface import flash_attn_func

    extra: dict[str, Any] = {} if window is None else {"window_size": (window - 1, 0)}
    if sinks is not None:
        extra["learnable_sink"] = sinks
    out = flash_attn_func(q, k, v, causal=True, **extra)
    return out[0] if isinstance(out, tuple) else out


def _paths(window: int | None, sinks: torch.Tensor | None, dense: bool) -> dict[str, Any]:
    """Each path as ``fn(q, k, v) -> out``."""
    size = None if window is None else (window - 1, 0)
    paths: dict[str, Any] = {
        "auto": functools.partial(attention, is_causal=True, window_size=size, sinks=sinks),
        "triton": functools.partial(
            attention, is_causal=True, window_size=size, sinks=sinks, backend="triton"
        ),
        "fa4 kernel": functools.partial(_fa4_call, window=window, sinks=sinks),
    }
    if dense:
        paths["dense fa4"] = functools.partial(attention, is_causal=True, backend="flash_attn4")
        paths["dense cudnn"] = functools.partial(attention, is_causal=True, backend="sdpa_cudnn")
    return paths


def _cell(family: str, n: int, heads: int, kv_heads: int, dim: int, window: int,
          with_sinks: bool, args: argparse.Namespace) -> list[dict[str, Any]]:  # fmt: skip
    """Every path of one cell, timed."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = {"device": "cuda", "dtype": torch.bfloat16, "generator": gen}
    q = torch.randn(1, n, heads, dim, **shape).requires_grad_()
    k = torch.randn(1, n, kv_heads, dim, **shape).requires_grad_()
    v = torch.randn(1, n, kv_heads, dim, **shape).requires_grad_()
    sinks = torch.zeros(heads, device="cuda", requires_grad=True) if with_sinks else None
    rows = []
    for name, fn in _paths(window, sinks, n <= args.dense_max).items():
        dense = name.startswith("dense")  # no window, no sinks
        leaves = [q, k, v] + ([sinks] if sinks is not None and not dense else [])
        pairs = window_pairs(n, None if dense else window)
        row: dict[str, Any] = {"family": family, "seq_len": n, "heads": heads,
                               "kv_heads": kv_heads, "head_dim": dim, "window": window,
                               "sinks": with_sinks, "path": name, "pairs": pairs}  # fmt: skip
        try:
            timing = time_fwd_and_fwd_bwd(
                functools.partial(fn, q, k, v), leaves, lambda: torch.randn_like(q),
                warmup=args.warmup, repeats=args.repeats,
            )  # fmt: skip
        except (ValueError, RuntimeError, ImportError) as exc:  # a path that cannot run
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            torch.cuda.empty_cache()
            rows.append(row)
            continue
        flops = 4 * pairs * heads * dim
        row.update(timing)
        row["fwd_tflops"] = flops / timing["fwd_ms"] / 1e9
        row["fwd_bwd_tflops"] = FWD_BWD_FACTOR * flops / timing["fwd_bwd_ms"] / 1e9
        if name == "auto":
            choice = explain(device="cuda", dtype=torch.bfloat16, head_dim=dim, num_heads=heads,
                             num_kv_heads=kv_heads, seq_len=n, is_causal=True,
                             window_size=(window - 1, 0), sinks=with_sinks)  # fmt: skip
            row["kernel"] = choice.backend
        rows.append(row)
    return rows


def _ratios(rows: list[dict[str, Any]]) -> None:
    """``ratio_vs_dense_*``: each windowed row's rate over dense FA4's at its N (or the longest
    N measured dense) in the same family."""
    for row in rows:
        dense = [r for r in rows if r["family"] == row["family"] and r["path"] == "dense fa4"
                 and "error" not in r and r["seq_len"] <= row["seq_len"]]  # fmt: skip
        if row["path"].startswith("dense") or "error" in row or not dense:
            continue
        ref = max(dense, key=lambda r: r["seq_len"])
        row["dense_reference_len"] = ref["seq_len"]
        for step in ("fwd", "fwd_bwd"):
            row[f"ratio_vs_dense_{step}"] = row[f"{step}_tflops"] / ref[f"{step}_tflops"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[65536, 262144, 1048576],
                        help="lengths of the window cells")  # fmt: skip
    parser.add_argument("--window", type=int, default=4096, help="window of the window cells")
    parser.add_argument("--oss-seq-lens", type=int, nargs="+",
                        default=[8192, 32768, 131072], help="lengths of the gpt-oss cells")
    parser.add_argument("--dense-max", type=int, default=262144,
                        help="longest length the dense paths run at")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs per path")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per path (median)")
    parser.add_argument("--out", type=Path, default=None, help=OUT_HELP)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("bench_windows needs a CUDA device")
    rows = []
    for n in args.seq_lens:
        rows += _cell("window", n, 16, 16, 128, args.window, False, args)
    for n in args.oss_seq_lens:
        rows += _cell("gpt-oss", n, 64, 8, 64, 128, True, args)
    _ratios(rows)
    env = environment()
    path = record_path("windows", args.out)
    columns = ["family", "seq_len", "path", "kernel", "fwd_ms", "fwd_bwd_ms", "fwd_tflops",
               "fwd_bwd_tflops", "ratio_vs_dense_fwd", "ratio_vs_dense_fwd_bwd",
               "fwd_bwd_peak_bytes", "error"]  # fmt: skip
    write_record(path.with_suffix(".json"), env, rows, columns=columns)
    table = record_header(env) + markdown_table(rows, columns)
    path.with_suffix(".md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
