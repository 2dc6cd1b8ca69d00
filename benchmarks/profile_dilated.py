"""Where the time of one dilated call goes: torch.profiler's CUDA kernel table (CUDA).

    python benchmarks/profile_dilated.py --backend flash_attn4     # one 1M forward+backward
    python benchmarks/profile_dilated.py --decode --context 131072  # one decoded token
    python benchmarks/profile_dilated.py --decode --host            # the host's share of it
    python benchmarks/profile_dilated.py --decode --static          # the static step, captured

The first profiles one forward+backward of ``dilated_attention`` (LongNet schedule, B = 1,
H = 16, bf16) after two warm-up calls; the second one token through a filled ``DilatedKVCache``
(no gradients), or with ``--static`` one step of a ``StaticDilatedKVCache``, eager and replayed
from a CUDA graph. Prints the kernels sorted by CUDA time: which part is the attention kernels
and which is the executor's merging, copying and accumulating around them. With ``--host`` it
instead prints the host time of a step (a token, or a forward+backward: its Python, launches
included, not waiting for the GPU) beside its latency, and cProfile's functions by own time over
100 tokens or 5 forward+backward calls.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import captured

from dilated_attention import DilatedKVCache, StaticDilatedKVCache, dilated_attention

SEGMENTS, RATES = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16]
#: Decoded tokens: 3 warm-up, 1 profiled, and with ``--host`` 2 x 100 more.
TOKENS = 204


def _host_profile(step: Callable[[int], None], rows: int, count: int) -> None:
    """Host milliseconds per step (the call returns before the GPU is done) and latency (the
    call and the GPU's work), medians over ``count`` steps; then cProfile over ``count`` more."""
    host, latency = [], []
    for i in range(4, 4 + count):
        begin = time.perf_counter()
        step(i)
        host.append(time.perf_counter() - begin)
        torch.cuda.synchronize()
        latency.append(time.perf_counter() - begin)
    print(f"host {statistics.median(host) * 1e3:.3f} ms per step, latency "
          f"{statistics.median(latency) * 1e3:.3f} ms (medians of {count})")  # fmt: skip
    profiler = cProfile.Profile()
    profiler.enable()
    for i in range(4 + count, 4 + 2 * count):
        step(i)
    torch.cuda.synchronize()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(rows)


def _profile_static_step(context: int, rows: int, steps: int = 20) -> None:
    """``steps`` tokens of one row through a filled ``StaticDilatedKVCache``, the positions
    just before ``context`` (a multiple of every segment length: the costliest positions, where
    every branch reads nearly its whole segment): eager, then replayed from one CUDA graph; the
    kernel tables of each."""
    cache = StaticDilatedKVCache(SEGMENTS, RATES)
    token = [torch.randn(1, 1, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in "qkv"]
    cache.allocate(token[1])
    for buffer in (cache.key, cache.value):
        buffer.normal_()
    cache.lengths.fill_(max(0, context - 4 * steps))  # warm-up, capture and the steps below it

    def step() -> None:
        dilated_attention(*token, SEGMENTS, RATES, is_causal=True, cache=cache)

    with torch.no_grad():
        for _ in range(3):
            step()
        graph = captured(step)
        for name, run in (("eager", step), ("captured", graph.replay)):
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    run()
                torch.cuda.synchronize()
            print(f"== {name}: {steps} steps before {context} tokens")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows,
                                            max_name_column_width=70))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--backend", default=None, help="default: the automatic choice")
    parser.add_argument("--seq-len", type=int, default=1 << 20)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--decode", action="store_true", help="profile one decoded token")
    parser.add_argument("--context", type=int, default=131072, help="tokens before it")
    parser.add_argument("--rows", type=int, default=20, help="table rows")
    parser.add_argument("--host", action="store_true", help="host time and cProfile")
    parser.add_argument("--static", action="store_true", help="the static cache's step")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_dilated.py needs a CUDA device")
    if args.decode and args.static:
        _profile_static_step(args.context, args.rows)
        return
    shape = (1, args.context if args.decode else args.seq_len, 16, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if args.decode:
        cache = DilatedKVCache(SEGMENTS, RATES)
        cache.append(k[:, :-TOKENS], v[:, :-TOKENS])
        tokens = [x[:, -TOKENS:] for x in (q, k, v)]

        def step(i: int) -> None:
            with torch.no_grad():
                piece = [x[:, i : i + 1] for x in tokens]
                dilated_attention(*piece, SEGMENTS, RATES, is_causal=True, cache=cache,
                                  backend=args.backend)  # fmt: skip

    else:
        for x in (q, k, v):
            x.requires_grad_()

        def step(i: int) -> None:
            out = dilated_attention(q, k, v, SEGMENTS, RATES, is_causal=args.causal,
                                    backend=args.backend)  # fmt: skip
            out.backward(torch.ones_like(out))

    for i in range(3):
        step(i)
    torch.cuda.synchronize()
    if args.host:  # a step is a token (100 of them) or a forward+backward (5)
        _host_profile(step, args.rows, 100 if args.decode else 5)
        return
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(3)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows,
                                    max_name_column_width=70))  # fmt: skip


if __name__ == "__main__":
    main()
