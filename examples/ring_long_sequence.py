"""Forward and backward of a ring multihead dilated attention layer, the sequence split over ranks.

    torchrun --nproc_per_node=2 examples/ring_long_sequence.py --device cpu       # gloo, anywhere
    torchrun --nproc_per_node=4 examples/ring_long_sequence.py --seq-len 1048576  # NCCL, GPUs

Each rank holds ``seq_len / world_size`` tokens; the LongNet schedule runs its short segments
locally and exchanges only the dilated rows (1/r of K/V) of the segments that span ranks. Prints
tokens/s and peak memory per rank.
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from dilated_attention import (
    RingMultiheadDilatedAttention,
    explain,
    longnet_schedule,
    shard_sequence,
)
from dilated_attention.demo import HelpFormatter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default=None,
        help="default: cuda (NCCL) when available, else cpu (gloo)",
    )  # fmt: skip
    parser.add_argument(
        "--seq-len", type=int, default=None, help="global tokens (default 16K CPU, 1M GPU)"
    )
    parser.add_argument("--heads", type=int, default=16, help="attention heads")
    parser.add_argument("--head-dim", type=int, default=64, help="dimension of each head")
    parser.add_argument(
        "--first-segment", type=int, default=2048,
        help="first segment length; segments double (rates 1, 2, 4, ...) until one covers "
        "--seq-len (LongNet schedule)",
    )  # fmt: skip
    parser.add_argument(
        "--steps", type=int, default=3, help="timed steps after one warm-up step (median shown)"
    )
    parser.add_argument(
        "--causal", action=argparse.BooleanOptionalAction, default=True, help="causal attention"
    )
    parser.add_argument(
        "--timeout", type=float, default=300.0,
        help="seconds a rank waits in a collective for the others before failing",
    )  # fmt: skip
    args = parser.parse_args()
    if args.timeout <= 0:
        parser.error(f"--timeout must be > 0 seconds, got {args.timeout}")
    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    backend = "nccl" if device_type == "cuda" else "gloo"
    # A rank that dies or raises (out of memory, a bad shape) leaves the others blocked in their
    # next collective for the backend's default timeout (30 minutes for gloo, 10 for NCCL): the
    # timeout bounds that hang. Keep it above the slowest step, which includes the first call's
    # kernel compilation.
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device, dtype = torch.device("cuda"), torch.bfloat16
    else:
        device, dtype = torch.device("cpu"), torch.float32
    seq_len = args.seq_len or (1 << 20 if device_type == "cuda" else 1 << 14)
    segments, rates = longnet_schedule(seq_len, args.first_segment)
    embed = args.heads * args.head_dim
    torch.manual_seed(0)
    layer = RingMultiheadDilatedAttention(
        embed, args.heads, segments, rates, device=device, dtype=dtype
    )
    full = torch.randn(1, seq_len, embed, generator=torch.Generator().manual_seed(1))
    x = shard_sequence(full).to(device=device, dtype=dtype).requires_grad_()
    del full
    if rank == 0:
        choice = explain(device=device, dtype=dtype, head_dim=args.head_dim, is_causal=args.causal)
        print(
            f"world {world} ({backend}), {seq_len:,} tokens ({seq_len // world:,} per rank), "
            f"H={args.heads} D={args.head_dim} {str(dtype).removeprefix('torch.')}, "
            f"segments {segments}, rates {rates}, kernel {choice.backend}",
            flush=True,
        )
    times = []
    for _ in range(args.steps + 1):  # the first step warms up
        if device_type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        dist.barrier()
        start = time.perf_counter()
        out, _ = layer(x, is_causal=args.causal)
        out.float().square().mean().backward()
        if device_type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    step = sorted(times[1:])[len(times[1:]) // 2]
    if device_type == "cuda":
        peak = f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"
    else:
        rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        peak = f"peak process memory {rss_kib / 2**20:.2f} GiB"
    line = f"rank {rank}: fwd+bwd {step * 1e3:.1f} ms, {seq_len / step:,.0f} tokens/s total, {peak}"
    lines: list[str | None] = [None] * world
    dist.all_gather_object(lines, line)
    if rank == 0:
        print("\n".join(str(s) for s in lines), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
