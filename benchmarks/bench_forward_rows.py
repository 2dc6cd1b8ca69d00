"""How the Triton forward reads its rows: pointer loads vs tensor descriptors, against cuDNN.

    python benchmarks/bench_forward_rows.py --tiles  # -> benchmarks/results/tma_forward_<device>.*

One dilated branch ``(w, r)`` over N positions, launched alone (``forward_branch``, no merge),
B = 1, H = 16, bf16, with the rows read (a) through per-thread pointers with the pointer tiles,
(b) through tensor descriptors with the descriptor tiles (Note [Rows through tensor descriptors]
in ``dilated_attention/backends/triton_kernels/launchers.py``), and (c) the dense cuDNN kernel on
the same per-branch shape (N / w segments of w / r rows each), the ceiling. Median of CUDA-event
timings; TFLOP/s count 4 * D * H * (N / r) * (w / r), halved when causal. With ``--tiles``, also
every candidate descriptor tile (the sweep behind ``forward_descriptors`` in
``triton_kernels/tiles.py``) as extra rows. The descriptor row takes the table's tiles for the
call (``forward_descriptors_causal`` when causal). Writes OUT.json and OUT.md; OUT defaults to
``benchmarks/results/tma_forward_<device>`` (``h100``, ``h200x2``, ...: ``_timing.host_label``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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

from dilated_attention.backends import triton as triton_backend
from dilated_attention.backends.triton_kernels.tiles import TileConfig, descriptor_forward_config

HEADS = 16
#: (head_dim, seq_len, segment, rate, causal): whole-sequence segments and LongNet-sized ones.
CASES = [
    (128, 65536, 65536, 1, False), (128, 65536, 65536, 1, True),
    (128, 1 << 20, 2048, 1, False), (128, 1 << 20, 2048, 1, True),
    (128, 1 << 20, 4096, 2, False), (128, 1 << 20, 16384, 8, False),
    (128, 1 << 20, 16384, 8, True), (128, 1 << 20, 32768, 16, True),
    (64, 65536, 65536, 1, False), (64, 1 << 20, 2048, 1, True),
    (64, 1 << 20, 16384, 8, False), (64, 1 << 20, 32768, 16, True),
]  # fmt: skip


#: Descriptor tiles (block_m, block_n, num_warps, num_stages) tried by ``--tiles``.
TILES = {
    128: [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4), (64, 128, 4, 3), (128, 128, 4, 2)],
    64: [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 4)],
}


def bench_case(
    dim: int, seq: int, segment: int, rate: int, causal: bool, repeats: int, tiles: bool
) -> list[dict]:
    kernels = triton_backend._kernels()
    q, k, v = (
        torch.randn(1, seq, HEADS, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3)
    )
    configs = triton_backend._tiles(q)
    out = torch.empty_like(q)
    lse = torch.empty(1, HEADS, seq, device="cuda")
    branch = kernels.Branch(0, segment, segment, seq, seq, rate)
    flops = 4.0 * dim * HEADS * (seq / rate) * (segment / rate) / (2.0 if causal else 1.0)
    row: dict[str, object] = {
        "head_dim": dim, "seq_len": seq, "segment": segment, "rate": rate, "causal": causal,
    }  # fmt: skip

    def launch(policy: str, tile: object = None) -> None:
        kernels.DESCRIPTOR_POLICY = policy
        try:
            kernels.forward_branch(
                q, k, v, out, lse, None, branch, out_row0=0, scale=dim**-0.5,
                is_causal=causal, merge=False, config=configs["forward"],
                descriptor_config=tile or descriptor_forward_config(configs, is_causal=causal),
            )  # fmt: skip
        finally:
            kernels.DESCRIPTOR_POLICY = "auto"

    shape = (seq // segment, HEADS, segment // rate, dim)
    qc, kc, vc = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def cudnn() -> None:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(qc, kc, vc, is_causal=causal)

    timed = {
        "pointers": lambda: launch("never"),
        "descriptors": lambda: launch("always"),
        "cudnn": cudnn,
    }
    for name, fn in timed.items():
        ms = time_cuda(fn, warmup=2, repeats=repeats)["median_ms"]
        row[f"{name}_ms"] = ms
        row[f"{name}_tflops"] = flops / ms / 1e9
    for name in ("pointers", "descriptors"):
        row[f"{name}_vs_cudnn"] = row["cudnn_ms"] / row[f"{name}_ms"]  # type: ignore[operator]
    row["descriptors_speedup"] = row["pointers_ms"] / row["descriptors_ms"]  # type: ignore[operator]
    rows = [row]
    for tile in TILES.get(dim, []) if tiles else []:
        config = TileConfig(*tile)
        swept = {k: row[k] for k in ("head_dim", "seq_len", "segment", "rate", "causal")}
        swept["tile"] = "x".join(map(str, tile))
        try:
            ms = time_cuda(lambda c=config: launch("always", c), warmup=2, repeats=repeats)
            swept["descriptors_vs_cudnn"] = row["cudnn_ms"] / ms["median_ms"]  # type: ignore[operator]
        except Exception as exc:  # a tile that cannot compile is a finding
            swept["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
        rows.append(swept)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--tiles", action="store_true", help="also sweep the descriptor tiles")
    parser.add_argument("--out", type=Path, default=None, help=OUT_HELP)
    args = parser.parse_args()
    rows = []
    for case in CASES:
        rows.extend(bench_case(*case, repeats=args.repeats, tiles=args.tiles))
        print(*rows[-1:], flush=True)
    env = environment()
    out = record_path("tma_forward", args.out)
    columns = [
        "head_dim", "seq_len", "segment", "rate", "causal", "cudnn_tflops", "pointers_tflops",
        "descriptors_tflops", "pointers_vs_cudnn", "descriptors_vs_cudnn", "descriptors_speedup",
    ]  # fmt: skip
    # The record's table (summarize_results.py) holds the sweep rows too: their tile and errors.
    record_columns = [*columns[:5], "tile", *columns[5:], "error"]
    write_record(out.with_suffix(".json"), env, rows, columns=record_columns)
    table = markdown_table([r for r in rows if "tile" not in r], columns)
    text = record_header(env) + table + "\n"
    swept = [r for r in rows if "tile" in r]
    if swept:
        shape = ["head_dim", "seq_len", "segment", "rate", "causal"]
        text += "\n## Tile sweep\n\n" + markdown_table(
            swept, [*shape, "tile", "descriptors_vs_cudnn", "error"]
        )
        text += "\n"
    out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
