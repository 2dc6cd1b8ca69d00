"""Ring attention per-GPU throughput under torchrun, beside PyTorch context parallel in one run.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --nproc_per_node=2 benchmarks/bench_ring.py   # -> results/ring_<device>.{json,md}

Dense: the whole sequence (N tokens) split over W GPUs; ``ring_attention`` (zigzag when causal;
P2P ring and all-gather communication) and PyTorch's ``context_parallel`` (cuDNN/flash SDPA, its
own head-tail balancing) time forward and forward+backward; per-GPU TFLOP/s = 4*B*H*N^2*D
(halved when causal, x3.5 with backward) / W / time.
Dilated (weak scaling): W GPUs hold W x N tokens with the LongNet schedule up to a segment as long
as the whole sequence; per-GPU effective TFLOP/s counts every head in every branch. Before timing,
each path is checked against a single-GPU result on a small sequence. Run once per world size:
every run is folded into one record, ``benchmarks/results/ring_<device>.json`` (with
``--skip-dense``: ``ring_dilated_<device>.json``; ``<device>`` names the host, ``h200x4`` for 4
H200s: ``_timing.host_label``), one entry in its ``runs`` per world size and process group. Runs
at the commit of the record accumulate (a world size run again replaces its rows); a run at
another commit starts the record afresh. The record's Markdown file is the scaling table, also
printed by

    python benchmarks/bench_ring.py --summarize benchmarks/results/ring_h200x4.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _records import fold_run
from _records import scaling_table as _scaling_table
from _timing import OUT_HELP, environment, record_path, time_fwd_and_fwd_bwd

from dilated_attention import (
    attention,
    dilated_attention,
    longnet_schedule,
    ring_attention,
    ring_dilated_attention,
    shard_sequence,
)
from dilated_attention.backends import KernelInputs
from dilated_attention.backends.registry import choose
from dilated_attention.distributed import ContextParallel


def dilated_flops(
    seq_len: int, heads: int, dim: int, segs: list[int], rates: list[int], causal: bool
) -> float:
    """4*D*sum over heads and branches of (N/r)*(w/r), halved when causal: every head takes part
    in every branch."""
    total = sum(
        4.0 * dim * heads * (seq_len / r) * (min(w, seq_len) / r)
        for w, r in zip(segs, rates, strict=True)
    )
    return total / (2 if causal else 1)


def _randn(shape: tuple[int, ...], seed: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)


def check(
    device: torch.device, world: int, dilated_backends: list[str | None], splits: list[str]
) -> None:
    """Ring results equal single-GPU results (bf16 tolerances) on a small sequence, without and
    with a key padding mask (random keys, and the sequence's last eighth as padding); ring
    dilated attention on each of ``dilated_backends`` (None: the automatic choice) and each of
    ``splits`` of the world (``_split_group``)."""
    seq_len, heads, dim = 2048 * world, 8, 64
    q, k, v, dout = (_randn((1, seq_len, heads, dim), s, device) for s in range(4))
    gen = torch.Generator(device=device).manual_seed(7)
    padding = torch.rand(1, seq_len, generator=gen, device=device) < 0.2
    padding[:, seq_len - seq_len // 8 :] = True
    for causal, mask in itertools.product((False, True), (None, padding)):
        layout = "zigzag" if causal else "contiguous"
        shard = functools.partial(shard_sequence, layout=layout)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = attention(*leaves, is_causal=causal, key_padding_mask=mask)
        grads = torch.autograd.grad(ref, leaves, dout)
        local = [shard(t).requires_grad_() for t in (q, k, v)]
        local_mask = None if mask is None else shard(mask)
        out = ring_attention(*local, is_causal=causal, layout=layout, key_padding_mask=local_mask)
        lgrads = torch.autograd.grad(out, local, shard(dout))
        torch.testing.assert_close(out, shard(ref), atol=2e-2, rtol=2e-2)
        for a, b in zip(lgrads, grads, strict=True):
            torch.testing.assert_close(a, shard(b), atol=5e-2, rtol=5e-2)
        segs, rates = longnet_schedule(seq_len, 512)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = dilated_attention(*leaves, segs, rates, is_causal=causal, key_padding_mask=mask)
        grads = torch.autograd.grad(ref, leaves, dout)
        for backend, split in itertools.product(dilated_backends, splits):
            cp = _split_group(split)
            shard = functools.partial(shard_sequence, group=cp)
            local = [shard(t).requires_grad_() for t in (q, k, v)]
            local_mask = None if mask is None else shard(mask)
            out = ring_dilated_attention(
                *local, segs, rates, is_causal=causal, key_padding_mask=local_mask,
                backend=backend, group=cp,
            )  # fmt: skip
            lgrads = torch.autograd.grad(out, local, shard(dout))
            torch.testing.assert_close(out, shard(ref), atol=2e-2, rtol=2e-2)
            for a, b in zip(lgrads, grads, strict=True):
                torch.testing.assert_close(a, shard(b), atol=5e-2, rtol=5e-2)


def _split_group(split: str) -> ContextParallel:
    """The world as the ring (``ring``) or as the head all-to-all (``heads``: DeepSpeed-Ulysses,
    every rank then runs the whole sequence on ``H / W`` heads)."""
    world = dist.group.WORLD
    return ContextParallel(ring=world) if split == "ring" else ContextParallel(heads=world)


def _measure(
    row: dict,
    forward: Callable[[], torch.Tensor],
    leaves: list[torch.Tensor],
    flops: float,
    world: int,
    args: argparse.Namespace,
) -> dict:
    """Fill ``row`` with forward and forward+backward times, per-GPU TFLOP/s and the
    forward+backward peak memory; an implementation that cannot run records its error (that is a
    result too)."""
    try:
        make_dout = functools.partial(torch.randn_like, leaves[0])
        res = time_fwd_and_fwd_bwd(
            forward, leaves, make_dout, warmup=args.warmup, repeats=args.repeats
        )
        for step, work in (("fwd", flops), ("fwd_bwd", 3.5 * flops)):
            row[f"{step}_ms"] = res[f"{step}_ms"]
            row[f"{step}_tflops_per_gpu"] = work / world / (res[f"{step}_ms"] * 1e-3) / 1e12
        row["peak_gib"] = res["fwd_bwd_peak_bytes"] / 2**30
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    return row


def bench_dense(args: argparse.Namespace, device: torch.device, world: int) -> list[dict]:
    rows = []
    mesh = _device_mesh(world)
    for seq_len in args.seq_lens:
        for causal in (False, True):
            flops = 4.0 * args.heads * seq_len * seq_len * args.head_dim / (2 if causal else 1)
            q, k, v = (_randn((1, seq_len, args.heads, args.head_dim), s, device) for s in range(3))
            layout = "zigzag" if causal and world > 1 else "contiguous"
            local = [shard_sequence(t, layout=layout).requires_grad_() for t in (q, k, v)]
            # The kernel of the ring's steps (its off-diagonal, non-causal calls).
            step = choose(KernelInputs.from_tensors(local[0], local[1], is_causal=False))
            base = {"kind": "dense", "world": world, "seq_len": seq_len, "causal": causal,
                    "heads": args.heads, "head_dim": args.head_dim,
                    "kernel": step.backend}  # fmt: skip
            for comm in ("ring", "allgather"):
                forward = functools.partial(
                    ring_attention, *local, is_causal=causal, layout=layout, comm=comm
                )
                row = {**base, "impl": f"ours ({comm})"}
                rows.append(_measure(row, forward, local, flops, world, args))
            if mesh is not None:
                with _torch_cp(mesh, q, k, v, causal) as (forward, bufs):
                    row = {**base, "impl": "torch context_parallel"}
                    rows.append(_measure(row, forward, bufs, flops, world, args))
            del q, k, v, local
            torch.cuda.empty_cache()
    return rows


def _device_mesh(world: int) -> object | None:
    """A 1-D CUDA mesh for PyTorch's context parallel, or ``None`` where this torch lacks it."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel  # noqa: F401
    except ImportError:
        return None
    return init_device_mesh("cuda", (world,))


@contextlib.contextmanager
def _torch_cp(mesh: object, q, k, v, causal: bool) -> Iterator[tuple]:
    """PyTorch context parallel over the same tensors (B, H, N, D): yields its forward and leaves,
    to be timed inside its context (it shards the buffers in place on entry, under no_grad, so they
    get ``requires_grad`` inside, as PyTorch's own tests do). Its head-tail load balancing
    refuses non-causal attention, so it is on for causal only."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options

    _cp_options.enable_load_balance = causal
    bufs = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
    with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2],
                          no_restore_buffers=set(bufs)):  # fmt: skip
        for b in bufs:
            b.requires_grad_()
        yield functools.partial(F.scaled_dot_product_attention, *bufs, is_causal=causal), bufs


def bench_dilated(args: argparse.Namespace, device: torch.device, world: int) -> list[dict]:
    rows = []
    for per_gpu in args.dilated_tokens:
        seq_len = per_gpu * world
        segs, rates = longnet_schedule(seq_len)
        for causal in (False, True):
            flops = dilated_flops(seq_len, args.heads, args.head_dim, segs, rates, causal)
            for split in args.splits:
                cp = _split_group(split)
                shape = (1, seq_len, args.heads, args.head_dim)
                local = [shard_sequence(_randn(shape, s, device), group=cp).requires_grad_()
                         for s in range(3)]  # fmt: skip
                torch.cuda.empty_cache()  # each rank keeps its shards only
                for backend in _dilated_backends(args):
                    forward = functools.partial(
                        ring_dilated_attention, *local, segs, rates, is_causal=causal,
                        backend=backend, group=cp,
                    )  # fmt: skip
                    impl = "ours (ring dilated)" if backend is None else f"ours ({backend})"
                    impl = impl if split == "ring" else impl.replace(")", ", head all-to-all)")
                    row = {"kind": "dilated", "impl": impl, "world": world, "seq_len": seq_len,
                           "causal": causal, "heads": args.heads, "head_dim": args.head_dim,
                           "kernel": backend or "auto", "split": split}  # fmt: skip
                    rows.append(_measure(row, forward, local, flops, world, args))
                del local
            torch.cuda.empty_cache()
    return rows


def _dilated_backends(args: argparse.Namespace) -> list[str | None]:
    """``--dilated-backends`` with ``auto`` as None (the automatic choice)."""
    return [None if name == "auto" else name for name in args.dilated_backends]


def scaling_table(records: list[Path]) -> str:
    """Per-GPU efficiency from ring records (all their runs): each row's per-GPU TFLOP/s over the
    same implementation's at world 1, dense and dilated (``_records.scaling_table``)."""
    rows = [row for path in records for row in json.loads(path.read_text())["results"]]
    return _scaling_table(rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[131072, 262144])
    parser.add_argument("--dilated-tokens", type=int, nargs="+", default=[262144],
                        help="tokens per GPU for the dilated weak-scaling runs")  # fmt: skip
    parser.add_argument("--dilated-backends", nargs="+", default=["auto"],
                        help="ring dilated attention's backends (auto: automatic)")  # fmt: skip
    parser.add_argument("--splits", nargs="+", default=["ring"], choices=["ring", "heads"],
                        help="how the dilated runs split the world: the ring, or the head "
                             "all-to-all")  # fmt: skip
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-dense", action="store_true")
    parser.add_argument("--check-only", action="store_true",
                        help="run the checks against single-GPU results, time nothing")  # fmt: skip
    parser.add_argument(
        "--process-group-backend", default="nccl", choices=["nccl", "cpu:gloo,cuda:nccl"],
        help="with a CPU backend the per-call agreement check runs on the CPU (docs/ring.md)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help=OUT_HELP)
    parser.add_argument(
        "--summarize", type=Path, nargs="+", metavar="RECORD",
        help="print the scaling table of these JSON records (no GPU needed) and exit",
    )  # fmt: skip
    args = parser.parse_args()
    if args.summarize:
        print(scaling_table(args.summarize))
        return
    dist.init_process_group(args.process_group_backend, timeout=timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda")
    check(device, world, _dilated_backends(args), args.splits)
    if rank == 0:
        print(f"world {world}: ring results match single-GPU results", flush=True)
    if args.check_only:
        dist.destroy_process_group()
        return
    rows = [] if args.skip_dense else bench_dense(args, device, world)
    rows += bench_dilated(args, device, world)
    if rank == 0:
        env = {**environment(), "world_size": world, "process_group": args.process_group_backend}
        out = record_path("ring_dilated" if args.skip_dense else "ring", args.out)
        path = out.with_suffix(".json")
        record = fold_run(json.loads(path.read_text()) if path.exists() else None, env, rows)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1) + "\n")
        table = _scaling_table(record["results"])
        path.with_suffix(".md").write_text(table + "\n")
        print(table, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
