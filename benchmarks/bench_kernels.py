"""Dense attention kernels side by side: every backend available here on the same shapes.

Shapes: B * N = 65536 tokens, H = 16, D in {64, 128}, causal and not, bf16; forward and
forward+backward through ``dilated_attention.attention(..., backend=name)``, i.e. what users get.
TFLOP/s count 4*B*H*N^2*D for a forward (half when causal) and 3.5x that for forward+backward.
Each row also records the automatic choice, so the record shows whether ``auto`` picked the
fastest kernel. Writes a JSON record, a Markdown table and a PNG plot. ``--padding F`` passes a key
padding mask that ignores the last fraction F of every sequence's keys (padded batches): only
kernels that take masks run, and TFLOP/s still count the whole N x N.

    python benchmarks/bench_kernels.py                 # -> benchmarks/results/kernels_<device>.*
    python benchmarks/bench_kernels.py --padding 0.125  # -> kernels_masked_<device>.*

With ``--padding`` and ``flash_attn4`` among the backends, the row ``flash_attn4 seqused_k`` times
FlashAttention-4 given the same padding as each sequence's used key length (``seqused_k`` of
``flash_attn.cute.flash_attn_varlen_func``), which skips the padded keys instead of masking them
(Note [FlashAttention-4 key padding]); not causal calls, where it aligns causality to the last
used key.

(``<device>``: ``h100``, ``h200x2``, ...; ``_timing.host_label``.)
"""

from __future__ import annotations

import argparse
import importlib
import sys
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

from dilated_attention import attention, backend_reasons, explain


def _flops(batch: int, heads: int, seq: int, dim: int, causal: bool) -> float:
    return 4.0 * batch * heads * seq * seq * dim / (2.0 if causal else 1.0)


def padding_mask(batch: int, seq: int, fraction: float) -> torch.Tensor | None:
    """(B, N) bool mask ignoring the last ``fraction`` of every sequence's keys; None for 0."""
    if fraction <= 0:
        return None
    mask = torch.zeros(batch, seq, dtype=torch.bool, device="cuda")
    mask[:, seq - int(seq * fraction) :] = True
    return mask


#: The pseudo-backend timing FlashAttention-4 with the padding as used key lengths.
FA4_USED_KEYS = "flash_attn4 seqused_k"


def _used_keys_call(mask: torch.Tensor, causal: bool) -> object:
    """FlashAttention-4 over each sequence's unmasked key prefix (``mask`` pads a suffix)."""
    if causal:
        raise ValueError("seqused_k aligns causality to the last used key: not the mask's")
    varlen = importlib.import_module("flash_attn.cute").flash_attn_varlen_func
    used = (~mask).sum(dim=1, dtype=torch.int32)
    return lambda q, k, v: varlen(q, k, v, seqused_k=used)[0]


def bench_case(
    name: str, batch: int, seq: int, heads: int, dim: int, causal: bool, args: argparse.Namespace
) -> dict[str, object]:
    """Time one backend at one shape; OOM and errors are recorded, not fatal."""
    dtype = getattr(torch, args.dtype)
    row: dict[str, object] = {
        "backend": name, "batch": batch, "seq_len": seq, "heads": heads, "head_dim": dim,
        "causal": causal, "dtype": args.dtype, "padding": args.padding,
    }  # fmt: skip
    try:
        q, k, v = (
            torch.randn(batch, seq, heads, dim, device="cuda", dtype=dtype, requires_grad=True)
            for _ in range(3)
        )
        dout = torch.randn_like(q)
        mask = padding_mask(batch, seq, args.padding)
        if name == FA4_USED_KEYS:
            call = _used_keys_call(mask, causal)
        else:
            why = backend_reasons(q, k, v, is_causal=causal, key_padding_mask=mask)[name]
            if why:
                row["error"] = "; ".join(why)
                return row

            def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return attention(q, k, v, is_causal=causal, backend=name, key_padding_mask=mask)

        flops = _flops(batch, heads, seq, dim, causal)

        def fwd() -> None:
            with torch.no_grad():
                call(q, k, v)

        def fwd_bwd() -> None:
            torch.autograd.grad(call(q, k, v), (q, k, v), dout)

        for step, fn, work in (("fwd", fwd, flops), ("fwd_bwd", fwd_bwd, 3.5 * flops)):
            t = time_cuda(fn, warmup=args.warmup, repeats=args.repeats)
            row[f"{step}_ms"] = t["median_ms"]
            row[f"{step}_tflops"] = work / (t["median_ms"] * 1e-3) / 1e12
    except torch.OutOfMemoryError:
        row["error"] = "out of memory"
    except Exception as exc:  # a broken kernel is a result too
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    finally:
        torch.cuda.empty_cache()
    return row


def plot(rows: list[dict[str, object]], path: Path) -> None:
    """Bar chart of fwd+bwd TFLOP/s per backend, one group per shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(r["seq_len"], r["head_dim"], r["causal"]) for r in rows}, key=str)
    names = sorted({str(r["backend"]) for r in rows})
    fig, ax = plt.subplots(figsize=(max(8, len(shapes) * 1.4), 4.5))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        values = []
        for shape in shapes:
            match = [
                r for r in rows
                if (r["seq_len"], r["head_dim"], r["causal"]) == shape and r["backend"] == name
            ]  # fmt: skip
            values.append(float(match[0].get("fwd_bwd_tflops", 0.0)) if match else 0.0)
        ax.bar([j + i * width for j in range(len(shapes))], values, width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
    ax.set_xticklabels([f"N={s}\nD={d}{' causal' if c else ''}" for s, d, c in shapes], fontsize=8)
    ax.set_ylabel("fwd+bwd TFLOP/s")
    ax.legend(fontsize=8)
    ax.set_title("Dense attention kernels (B*N = 65536, H = 16)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--tokens", type=int, default=65536, help="batch * seq_len")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--backends", nargs="+", default=None, help="default: every CUDA backend")
    parser.add_argument("--skip", nargs="+", default=["math"], help="backends left out")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--padding", type=float, default=0.0,
                        help="fraction of keys masked at the end of each sequence")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help=OUT_HELP)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels.py needs a CUDA device")

    probe = torch.empty(1, 8, 1, 64, device="cuda", dtype=getattr(torch, args.dtype))
    names = args.backends or [
        n for n, why in backend_reasons(probe, probe, probe).items()
        if n not in args.skip and not any("runs on" in w for w in why)
    ]  # fmt: skip
    if args.padding > 0 and "flash_attn4" in names:
        names.append(FA4_USED_KEYS)
    rows = []
    for dim in args.head_dims:
        for causal in (False, True):
            for seq in args.seq_lens:
                batch = max(1, args.tokens // seq)
                auto = explain(
                    device="cuda", dtype=getattr(torch, args.dtype), head_dim=dim,
                    num_heads=args.heads, seq_len=seq, is_causal=causal,
                    key_padding_mask=args.padding > 0,
                ).backend  # fmt: skip
                shape_rows = [
                    bench_case(n, batch, seq, args.heads, dim, causal, args) for n in names
                ]
                best = max((float(r.get("fwd_bwd_tflops", 0.0)) for r in shape_rows), default=0.0)
                best_fwd = max((float(r.get("fwd_tflops", 0.0)) for r in shape_rows), default=0.0)
                for r in shape_rows:
                    r["auto_choice"] = auto
                    if "fwd_bwd_tflops" in r and best > 0:
                        r["fwd_bwd_ratio_to_best"] = float(r["fwd_bwd_tflops"]) / best
                        r["fwd_ratio_to_best"] = float(r["fwd_tflops"]) / best_fwd
                    print(r, flush=True)
                rows += shape_rows
    env = environment()
    out = record_path("kernels_masked" if args.padding > 0 else "kernels", args.out)
    columns = [
        "backend", "seq_len", "head_dim", "causal", "fwd_tflops", "fwd_bwd_tflops",
        "fwd_bwd_ratio_to_best", "auto_choice", "error",
    ]  # fmt: skip
    write_record(out.with_suffix(".json"), env, rows, columns=columns)
    table = record_header(env) + markdown_table(rows, columns)
    out.with_suffix(".md").write_text(table + "\n")
    plot([r for r in rows if "fwd_bwd_tflops" in r], out.with_suffix(".png"))
    print(table)


if __name__ == "__main__":
    main()
