"""Train LongNetLM on a 2-D mesh: data parallel (FSDP2) x context parallel (the sequence split
over ranks by a ring or a head all-to-all), and check the losses against one process.

    torchrun --standalone --nproc_per_node=4 examples/context_parallel_fsdp.py --device cpu
    torchrun --standalone --nproc_per_node=4 examples/context_parallel_fsdp.py --device cpu \\
        --split heads                                  # head all-to-all instead of a ring
    torchrun --standalone --nproc_per_node=8 examples/context_parallel_fsdp.py \\
        --dp 2 --cp 4 --seq-len 65536 --dtype bfloat16 # NCCL, GPUs

The mesh is ``(dp, cp)``. The model is built as for one process, made context parallel over the
mesh's ``cp`` dimension (``context_parallel(model, ContextParallel.from_mesh(...))``), then
sharded with FSDP2 (``fully_shard``) over all ranks, as torchtitan shards over data x context
ranks: each parameter's gradient is then averaged over every rank. Data parallel rank ``d``
trains on rows ``d * batch .. (d + 1) * batch - 1`` of each step's batch; within its ``cp``
group each rank holds its shard of the sequence (``shard_sequence(x, group=cp)``) and
back-propagates ``cp * (its token losses' sum) / (tokens of its rows)``, so the average over all
ranks is the mean loss over the data parallel ranks. The printed loss is the mean over every
token of the step (``all_reduce`` of the ranks' sums).

Every rank also trains an identical single-process model on the whole batch with the same
optimizer, and the script prints both losses per step and the largest difference (float64 on
CPU: equal up to rounding).
"""

from __future__ import annotations

import argparse
import copy
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dilated_attention.demo import HelpFormatter
from dilated_attention.distributed import ContextParallel, context_parallel, shard_sequence
from dilated_attention.models import LongNetConfig, LongNetLM

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default=None,
        help="default: cuda (NCCL) when available, else cpu (gloo)",
    )  # fmt: skip
    parser.add_argument(
        "--dtype", choices=sorted(_DTYPES), default="float64",
        help="parameters and activations (float64: the losses equal one process's to rounding)",
    )  # fmt: skip
    parser.add_argument("--dp", type=int, default=2, help="data parallel ranks")
    parser.add_argument("--cp", type=int, default=2, help="context parallel ranks")
    parser.add_argument(
        "--split", choices=["ring", "heads"], default="ring",
        help="how the cp ranks split attention: a ring over the sequence, or a head all-to-all",
    )  # fmt: skip
    parser.add_argument(
        "--seq-len", type=int, default=64, help="tokens per sequence (split over the cp ranks)"
    )
    parser.add_argument("--batch", type=int, default=2, help="rows per data parallel rank")
    parser.add_argument("--steps", type=int, default=3, help="training steps")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate (AdamW)")
    return parser.parse_args(argv)


def mesh_mismatch(dp: int, cp: int, world_size: int) -> str | None:
    """Why a ``dp`` x ``cp`` mesh does not fit ``world_size`` processes, with a pair that does
    (the same ``cp`` where it divides the world), or None when it fits."""
    if dp * cp == world_size:
        return None
    if world_size % cp == 0:
        fit = (world_size // cp, cp)
    elif world_size % dp == 0:
        fit = (dp, world_size // dp)
    else:
        fit = (1, world_size)
    return (
        f"--dp {dp} x --cp {cp} = {dp * cp} ranks, but the world has {world_size} processes; "
        f"use --dp {fit[0]} --cp {fit[1]}, or start {dp * cp} processes "
        f"(torchrun --nproc_per_node={dp * cp})"
    )


def _model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> LongNetLM:
    config = LongNetConfig(
        vocab_size=64, embed_dim=64, num_heads=4, num_layers=2, segment_lengths=(8, 16, 64),
        dilation_rates=(1, 2, 4), ffn_dim=128, kind="dilated",
    )  # fmt: skip
    torch.manual_seed(0)
    return LongNetLM(config).to(device=device, dtype=dtype)


def _batch(step: int, args: argparse.Namespace, device: torch.device) -> torch.Tensor:
    """Every data parallel rank's rows of step ``step``: (dp * batch, seq_len + 1) tokens."""
    gen = torch.Generator().manual_seed(step)
    rows = args.dp * args.batch
    return torch.randint(0, 64, (rows, args.seq_len + 1), generator=gen).to(device)


def _rows(logits: torch.Tensor) -> torch.Tensor:
    """(B, N, V) logits as (B * N, V), in float32 at least."""
    return logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=timedelta(seconds=120))  # fmt: skip
    mismatch = mesh_mismatch(args.dp, args.cp, dist.get_world_size())
    if mismatch:
        dist.destroy_process_group()
        raise SystemExit(mismatch)  # on every rank: each has the same world size
    mesh = init_device_mesh(device.type, (args.dp, args.cp), mesh_dim_names=("dp", "cp"))
    cp = ContextParallel.from_mesh(mesh, **{args.split: "cp"})
    dtype = _DTYPES[args.dtype]
    reference = _model(args, device, dtype)
    model = context_parallel(copy.deepcopy(reference), cp)
    everyone = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=everyone)
    fully_shard(model, mesh=everyone)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=args.lr)
    data_rank = mesh.get_local_rank("dp")
    worst = 0.0
    for step in range(args.steps):
        tokens = _batch(step, args, device)
        # One process: the mean loss over every row and token.
        reference_loss = F.cross_entropy(_rows(reference(tokens[:, :-1])), tokens[:, 1:].flatten())
        reference_optimizer.zero_grad()
        reference_loss.backward()
        reference_optimizer.step()
        single = reference_loss.detach().item()
        # This rank: its data parallel rows, its shard of their sequence.
        rows = tokens[data_rank * args.batch : (data_rank + 1) * args.batch]
        inputs, targets = (shard_sequence(x, group=cp) for x in (rows[:, :-1], rows[:, 1:]))
        logits = model(inputs)
        token_losses = F.cross_entropy(_rows(logits), targets.flatten(), reduction="sum")
        (args.cp * token_losses / rows[:, 1:].numel()).backward()
        optimizer.step()
        optimizer.zero_grad()
        total = token_losses.detach().clone()
        dist.all_reduce(total)
        loss = total.item() / tokens[:, 1:].numel()
        worst = max(worst, abs(loss - single))
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss:.12f} single_process_loss {single:.12f}")
    if dist.get_rank() == 0:
        print(f"mesh dp={args.dp} x cp={args.cp} ({cp}): max |loss - single process| {worst:.3e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
