"""Block-sparse attention vs dense cuDNN vs plain compiled FlexAttention, in one run (CUDA).

    python benchmarks/bench_block_sparse.py  # -> benchmarks/results/block_sparse_<device>.*

For each sequence length and density (random block masks, block 128, H = 16, D = 128, bf16):
``block_sparse_attention`` with the mask (``Custom``) as it chooses and with ``backend="triton"``,
``"flash_attn4"`` (FlashAttention-4's block sparsity, where installed) and ``"flex"``, PyTorch's
compiled ``flex_attention`` with a ``BlockMask`` built from the same mask (``create_block_mask``,
no library code), and dense cuDNN SDPA on the same shape (timed before and after the sparse rows
of each length; speed-ups use the faster of the two); forward and forward+backward median times
(CUDA events), peak memory, speed-up over dense, and forward+backward time over the density times
the dense time (``fwd_bwd_vs_proportional``, 1.0 is proportional). ``<device>`` is ``h100``,
``h200x2``, ... (``_timing.host_label``). On an H100 at 65,536 tokens plain compiled
FlexAttention ran 5.1x / 2.2x / 1.1x faster than dense cuDNN forward at 10% / 25% / 50% density
(``benchmarks/results/block_sparse_h100.json``), and at 262,144 tokens 0.64x forward at 100%
(``block_sparse_long_h100.json``).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

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

from dilated_attention import attention, block_sparse_attention
from dilated_attention.patterns import Custom


def random_block_mask(blocks: int, density: float, seed: int = 0) -> torch.Tensor:
    """(blocks, blocks) bool with about ``density`` of the pairs kept."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(blocks, blocks, generator=gen) < density


def _plain_flex(mask: torch.Tensor, seq_len: int, block: int):
    """Compiled FlexAttention on the same block mask, built only from PyTorch's public API."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    dev_mask = mask.cuda()

    def mask_mod(b, h, q_idx, kv_idx):
        return dev_mask[q_idx // block, kv_idx // block]

    # _compile=True: the eager builder evaluates mask_mod on all N x N pairs at once (512 GiB at
    # N = 65536).
    block_mask = create_block_mask(
        mask_mod, None, None, seq_len, seq_len, device="cuda", _compile=True
    )
    compiled = torch.compile(flex_attention)
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)


def _measure(fn, leaves: list[torch.Tensor], args: argparse.Namespace) -> dict[str, float]:
    res = time_fwd_and_fwd_bwd(
        lambda: fn(*leaves), leaves, functools.partial(torch.randn_like, leaves[0]),
        warmup=args.warmup, repeats=args.repeats,
    )  # fmt: skip
    row = {}
    for step in ("fwd", "fwd_bwd"):
        row[f"{step}_ms"] = res[f"{step}_ms"]
        row[f"{step}_peak_gib"] = res[f"{step}_peak_bytes"] / 2**30
    return row


def _dense_row(
    leaves: list[torch.Tensor], seq_len: int, when: str, args: argparse.Namespace
) -> dict[str, object]:
    """Dense cuDNN at this length, timed ``before`` or ``after`` the sparse rows."""
    print(f"[{time.strftime('%H:%M:%S')}] timing dense cuDNN at {seq_len} ({when})", flush=True)
    dense = _measure(lambda q, k, v: attention(q, k, v, backend="sdpa_cudnn"), leaves, args)
    row = {"impl": f"dense cuDNN ({when})", "seq_len": seq_len, "density": 1.0, **dense}
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[16384, 65536, 262144])
    parser.add_argument("--densities", type=float, nargs="+", default=[0.1, 0.25, 0.5, 1.0])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help=OUT_HELP)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_block_sparse.py needs a CUDA device")
    rows = []
    for seq_len in args.seq_lens:
        shape = (1, seq_len, args.heads, args.head_dim)
        leaves = [
            torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(3)
        ]
        dense_rows = [_dense_row(leaves, seq_len, "before", args)]
        sparse_rows = []
        blocks = -(-seq_len // args.block_size)
        bhnd = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in leaves]
        for density in args.densities:
            mask = random_block_mask(blocks, density)
            pattern = Custom(mask)
            impls = {
                "ours": (
                    lambda q, k, v, p=pattern: block_sparse_attention(
                        q, k, v, p, block_size=args.block_size
                    ),
                    leaves,
                ),
                "ours, backend='triton'": (
                    lambda q, k, v, p=pattern: block_sparse_attention(
                        q, k, v, p, block_size=args.block_size, backend="triton"
                    ),
                    leaves,
                ),
                "ours, backend='flash_attn4'": (
                    lambda q, k, v, p=pattern: block_sparse_attention(
                        q, k, v, p, block_size=args.block_size, backend="flash_attn4"
                    ),
                    leaves,
                ),
                "ours, backend='flex'": (
                    lambda q, k, v, p=pattern: block_sparse_attention(
                        q, k, v, p, block_size=args.block_size, backend="flex"
                    ),
                    leaves,
                ),
                "plain compiled flex": (_plain_flex(mask, seq_len, args.block_size), bhnd),
            }
            for name, (fn, inputs) in impls.items():
                row = {"impl": name, "seq_len": seq_len, "density": float(mask.float().mean())}
                # A first call compiles (minutes at worst): say what runs, so a cut-off run shows
                # where it stopped.
                print(f"[{time.strftime('%H:%M:%S')}] timing {row}", flush=True)
                try:
                    row.update(_measure(fn, inputs, args))
                except torch.OutOfMemoryError:
                    row["error"] = "out of memory"
                except ValueError as exc:  # a named kernel that cannot run here (no FA4)
                    row["error"] = str(exc).splitlines()[0][:200]
                sparse_rows.append(row)
                print(row, flush=True)
                torch.cuda.empty_cache()
        dense_rows.append(_dense_row(leaves, seq_len, "after", args))
        # Speed-ups against the faster of the two dense timings, so a GPU that slowed down during
        # the sweep (clocks, heat) cannot make the sparse rows look faster than they are.
        for row in sparse_rows:
            for step in ("fwd", "fwd_bwd"):
                if f"{step}_ms" in row:
                    dense_ms = min(d[f"{step}_ms"] for d in dense_rows)
                    row[f"{step}_speedup_vs_dense"] = dense_ms / row[f"{step}_ms"]
                    # Time over the dense time scaled by the kept fraction (1.0: proportional).
                    proportional_ms = row["density"] * dense_ms
                    row[f"{step}_vs_proportional"] = row[f"{step}_ms"] / proportional_ms
        rows += dense_rows + sparse_rows
    env = environment()
    out = record_path("block_sparse", args.out)
    cols = ["impl", "seq_len", "density", "fwd_ms", "fwd_bwd_ms", "fwd_speedup_vs_dense",
            "fwd_bwd_speedup_vs_dense", "fwd_bwd_vs_proportional", "fwd_bwd_peak_gib",
            "error"]  # fmt: skip
    write_record(out.with_suffix(".json"), env, rows, columns=cols)
    table = record_header(env) + markdown_table(rows, cols)
    out.with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
