"""Draw the dilated-attention performance plot (docs/performance_h100.png) and print its tables.

    python docs/plot_performance.py

Reads benchmark records written by ``benchmarks/bench_dilated.py`` on one H100:

- ``benchmarks/results/dilated_auto_h100.json`` (16 key/value heads) and
  ``dilated_auto_gqa_h100.json`` (4): the automatic choice (``auto``, with the kernel it ran),
  the fused Triton kernels, FlashAttention-4 writing into branch slots (``backend=
  "flash_attn4"``) and the cuDNN and FA4 ceilings (each kernel alone on tensors already shaped
  like every branch's rows), timed side by side in one run each;
- ``benchmarks/results/dilated_gather_h100.json``: the latest run that also timed the gather +
  cuDNN path (every branch's rows gathered into dense tensors, cuDNN, merged and scattered back).

For the LongNet schedule (w = 2048..32768, r = 1..16, B = 1, H = 16, bf16) at every N measured,
D = 64 and 128, causal and not, it plots effective TFLOP/s (paper FLOPs / time) of the paths
without GQA, forward and forward+backward, with each path's ratio to the cuDNN ceiling of its
own run above its bar. It prints the tables of README.md and docs/performance.md: per shape the
automatic choice against the faster of our two paths and both ceilings, and its peak memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
FUSED_RECORD = RESULTS / "dilated_auto_h100.json"
GQA_RECORD = RESULTS / "dilated_auto_gqa_h100.json"
GATHER_RECORD = RESULTS / "dilated_gather_h100.json"
OUT = Path(__file__).resolve().parent / "performance_h100.png"

PATHS = [  # (record, path in the record, label, colour)
    ("fused", "auto", "automatic choice (this library)", "#d62728"),
    ("fused", "triton", "fused Triton kernels (this library)", "#1f77b4"),
    ("fused", "flash_attn4", "FA4 into branch slots (this library)", "#2ca02c"),
    ("fused", "cudnn ceiling", "cuDNN ceiling (same per-branch shapes)", "#7f7f7f"),
    ("fused", "fa4 ceiling", "FA4 ceiling (same per-branch shapes)", "#bcbd22"),
    ("gather", "gather+cudnn", "gather + cuDNN (its latest run)", "#ff7f0e"),
]
CEILINGS = ("cudnn ceiling", "fa4 ceiling")
MODES = [("fwd", "forward"), ("fwd_bwd", "forward+backward")]


def load(path: Path) -> dict[tuple[int, bool, int, str], dict]:
    """Rows of a bench_dilated.py record keyed by (head_dim, causal, seq_len, path)."""
    record = json.loads(path.read_text())
    return {
        (r["head_dim"], r["causal"], r["seq_len"], r["path"]): r
        for r in record["results"]
        if r.get("schedule") == "longnet"
    }


def shapes(rows: dict) -> list[tuple[int, bool, int]]:
    """(head_dim, causal, seq_len) of every measured shape, in table order."""
    return sorted({key[:3] for key in rows})


def label(head_dim: int, causal: bool, seq_len: int) -> str:
    length = f"{seq_len // 1048576}M" if seq_len >= 1048576 else f"{seq_len // 1024}K"
    return f"D={head_dim}\n{'causal' if causal else 'non-causal'}\nN={length}"


def value(records: dict, source: str, shape: tuple, path: str, field: str) -> float | None:
    row = records[source].get((*shape, path))
    if row is None or row.get("error") or row.get(field) is None:
        return None
    return float(row[field])


def markdown_table(rows: dict) -> str:
    """Per shape: the automatic choice's TFLOP/s and kernel, against the faster of our two paths
    and the cuDNN and FA4 ceilings of the same run, forward and forward+backward, and its peak
    memory over the unavoidable bytes."""
    lines = [
        "| D, causal, N | forward: auto TFLOP/s (kernel), vs faster of ours / cuDNN ceiling / "
        "FA4 ceiling | forward+backward: the same | peak memory, auto: fwd / fwd+bwd |",
        "|---|---|---|---|",
    ]
    records = {"fused": rows}
    for shape in shapes(rows):
        head_dim, causal, seq_len = shape
        length = f"{seq_len // 1048576}M" if seq_len >= 1048576 else f"{seq_len // 1024}K"
        cells = [f"{head_dim}, {'yes' if causal else 'no'}, {length}"]
        auto_row = rows[(*shape, "auto")]
        for mode, _ in MODES:
            kernel = auto_row.get("fwd_backend" if mode == "fwd" else "backend", "?")
            auto = value(records, "fused", shape, "auto", f"{mode}_tflops")
            ours = [value(records, "fused", shape, p, f"{mode}_tflops") for p in
                    ("triton", "flash_attn4", "auto")]  # fmt: skip
            tops = [value(records, "fused", shape, p, f"{mode}_tflops") for p in CEILINGS]
            if auto is None:
                cells.append("out of memory")
                continue
            ratios = [auto / max(t for t in ours if t is not None)]
            ratios += [auto / t for t in tops if t is not None]
            short = "fused" if kernel == "triton" else "FA4"
            cells.append(f"{auto:.0f} ({short}), " + " / ".join(f"{r:.2f}" for r in ratios))
        mems = [value(records, "fused", shape, "auto", f"{m}_mem_ratio") for m, _ in MODES]
        cells.append(" / ".join("-" if m is None else f"{m:.2f}x" for m in mems))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    records = {"fused": load(FUSED_RECORD), "gather": load(GATHER_RECORD)}
    env = json.loads(FUSED_RECORD.read_text())["environment"]
    measured = shapes(records["fused"])
    x = np.arange(len(measured))
    width = 0.14

    fig, axes = plt.subplots(2, 1, figsize=(12, 8.2), sharex=True)
    for ax, (mode, title) in zip(axes, MODES, strict=True):
        for i, (source, path, name, colour) in enumerate(PATHS):
            tflops = [value(records, source, s, path, f"{mode}_tflops") for s in measured]
            ratios = [value(records, source, s, path, f"{mode}_vs_ceiling") for s in measured]
            xs = x + (i - (len(PATHS) - 1) / 2) * width
            heights = [t if t is not None else 0.0 for t in tflops]
            ax.bar(xs, heights, width, label=name, color=colour)
            for xi, t, r in zip(xs, tflops, ratios, strict=True):
                if t is None:
                    ax.text(xi, 8, "out of memory", ha="center", va="bottom", fontsize=8,
                            rotation=90, color="black")  # fmt: skip
                elif path not in CEILINGS and r is not None:
                    ax.text(xi, t + 6, f"{r:.2f}x", ha="center", va="bottom", fontsize=6,
                            rotation=90)  # fmt: skip
        ax.set_title(f"{title}: effective TFLOP/s (numbers: ratio to the cuDNN ceiling)")
        ax.set_ylabel("TFLOP/s (paper FLOPs / time)")
        ax.set_ylim(0, 660)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    axes[0].legend(loc="upper left", fontsize=8, ncol=3)
    axes[1].set_xticks(x)
    axes[1].set_xticklabels([label(*s) for s in measured], fontsize=9)
    fig.suptitle(
        f"LongNet dilated attention on one {env['device']} (B = 1, H = 16, bf16, "
        f"w = 2048..32768, r = 1..16), median of repeats",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(OUT, dpi=120)
    print(f"wrote {OUT.relative_to(ROOT)}\n")
    print("Without GQA (16 key/value heads):\n")
    print(markdown_table(records["fused"]))
    print("\nGQA (4 key/value heads):\n")
    print(markdown_table(load(GQA_RECORD)))


if __name__ == "__main__":
    main()
