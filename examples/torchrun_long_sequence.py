"""Train the LongNet language model with the sequence split across ranks (ring attention).

    torchrun --standalone --nproc_per_node=2 examples/torchrun_long_sequence.py --device cpu
    torchrun --standalone --nproc_per_node=2 examples/torchrun_long_sequence.py \\
        --device cpu --dtype float64 --steps 3                     # exact first-step check
    torchrun --standalone --nproc_per_node=8 examples/torchrun_long_sequence.py \\
        --seq-len 262144 --steps 20                                # NCCL, GPUs, bf16

Every rank builds the same model (same seed, ``kind="ring"``) and draws the same batch of byte
windows from the demo corpus (same generator seed); each rank keeps its contiguous shard of the
tokens and targets (``shard_sequence``) and runs the model on it. Rotary positions follow the
rank's global positions automatically. The loss is the mean over all tokens of all ranks:
``all_reduce(sum of per-rank loss sums) / total tokens``.

At the first step rank 0 also runs an identical single-process model (``kind="dilated"``, same
``state_dict``) on the whole sequence and checks that its loss and gradients equal the ring
model's (exactly up to rounding in float64 on CPU; with a bf16 tolerance on GPUs). Then it trains
a few AdamW steps, printing the loss and tokens/s.

Gradients: parameters are replicated, and each rank back-propagates its share
``local_loss_sum / total_tokens`` of the global mean (ring attention's backward returns the key
and value gradients to the ranks that own them), so the full gradient is the SUM over ranks of the
per-rank gradients: one ``all_reduce(SUM)`` per parameter. (With DDP, which averages, back-propagate
``world_size * local_loss_sum / total_tokens`` instead.)

By default the preset's segment lengths are extended LongNet-style (doubling the segment and the
rate) until one segment covers the whole sequence, so some branches span ranks: with the tiny
preset and ``--seq-len 512`` the schedule is w = 64, 128, 256, 512, r = 1, 2, 4, 8, and with two
ranks (256 tokens each) the 512 branch is computed across ranks.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dilated_attention import shard_sequence
from dilated_attention.demo import MIN_CORPUS_BYTES, HelpFormatter, load_corpus, sample_windows
from dilated_attention.models import LongNetConfig, LongNetLM

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default=None,
        help="default: cuda (NCCL) when available, else cpu (gloo)",
    )  # fmt: skip
    parser.add_argument(
        "--dtype", choices=sorted(_DTYPES), default=None, help="default bfloat16 GPU, float32 CPU"
    )
    parser.add_argument("--preset", default="tiny", help="LongNetConfig preset (tiny, base)")
    for flag in ("--num-layers", "--embed-dim", "--num-heads"):
        parser.add_argument(flag, type=int, default=None, help="default: the preset's")
    parser.add_argument("--seq-len", type=int, default=512, help="global tokens per sequence")
    parser.add_argument("--batch", type=int, default=2, help="sequences per step")
    parser.add_argument("--steps", type=int, default=5, help="training steps")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate (AdamW)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    parser.add_argument(
        "--extend-schedule",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="double segment and rate until one segment covers --seq-len",
    )
    parser.add_argument(
        "--corpus-bytes", type=int, default=4 << 20,
        help=f"read at most this many bytes of source; at least {MIN_CORPUS_BYTES} (1 MiB), "
        "since every tenth file is held out",
    )  # fmt: skip
    parser.add_argument(
        "--check-tolerance",
        type=float,
        default=None,
        help="relative tolerance of the first-step check (default 1e-9 float64, 1e-4 float32, "
        "2e-2 bfloat16)",
    )
    parser.add_argument(
        "--timeout", type=float, default=300.0,
        help="seconds a rank waits in a collective for the others before failing",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.timeout <= 0:
        parser.error(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.corpus_bytes < MIN_CORPUS_BYTES:
        parser.error(
            f"--corpus-bytes must be >= {MIN_CORPUS_BYTES} (1 MiB), got {args.corpus_bytes}"
        )
    return args


def build_config(args: argparse.Namespace, kind: str) -> LongNetConfig:
    overrides = {
        name: getattr(args, name)
        for name in ("num_layers", "embed_dim", "num_heads")
        if getattr(args, name) is not None
    }
    config = LongNetConfig.from_preset(args.preset, kind=kind, **overrides)
    segs, rates = list(config.segment_lengths), list(config.dilation_rates)
    if args.extend_schedule:
        while segs[-1] < args.seq_len:
            segs.append(segs[-1] * 2)
            rates.append(rates[-1] * 2)
    return LongNetConfig.from_preset(
        args.preset, kind=kind, segment_lengths=tuple(segs), dilation_rates=tuple(rates),
        **overrides,
    )  # fmt: skip


def _token_losses_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of the next-token cross-entropies, in float32 at least (float64 stays float64)."""
    logits = logits if logits.dtype == torch.float64 else logits.float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")


def sharded_loss(
    model: LongNetLM, inputs: torch.Tensor, targets: torch.Tensor, total_tokens: int
) -> tuple[torch.Tensor, float]:
    """This rank's share of the global mean loss (differentiable) and the global mean (float)."""
    logits = model(inputs)  # (B, N / W, V): this shard's logits
    local_sum = _token_losses_sum(logits, targets)
    global_sum = local_sum.detach().clone()
    dist.all_reduce(global_sum)
    return local_sum / total_tokens, float(global_sum) / total_tokens


def all_reduce_gradients(model: LongNetLM) -> None:
    """Sum the replicated parameters' gradients over ranks (see the module docstring)."""
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)


def check_against_single_process(
    model: LongNetLM,
    config: LongNetConfig,
    batch: torch.Tensor,
    ring_loss: float,
    tol: float,
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """Rank 0: the single-process loss and gradients on the full sequence equal the ring ones."""
    local = LongNetLM(config).to(device=device, dtype=dtype)
    local.load_state_dict(model.state_dict())
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = local(inputs)
    loss = _token_losses_sum(logits, targets) / targets.numel()
    loss.backward()
    local_loss = loss.item()
    grads = dict(local.named_parameters())
    worst = 0.0
    for name, param in model.named_parameters():
        ref = grads[name].grad
        scale = float(ref.abs().max()) + 1e-30
        worst = max(worst, float((param.grad - ref).abs().max()) / scale)
    rel = abs(ring_loss - local_loss) / abs(local_loss)
    print(
        f"first-step check: ring_loss={ring_loss!r} single_process_loss={local_loss!r} "
        f"rel_diff={rel:.3e} max_rel_grad_diff={worst:.3e} (tolerance {tol:g})",
        flush=True,
    )
    grad_tol = tol if dtype == torch.float64 else 10 * tol
    if not (rel <= tol and worst <= grad_tol):
        raise AssertionError(
            f"ring and single-process results differ: loss rel diff {rel:.3e}, "
            f"grad rel diff {worst:.3e}, tolerance {tol:g}"
        )
    print("first-step check: OK (ring loss == single-process loss)", flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    backend = "nccl" if device_type == "cuda" else "gloo"
    # A rank that dies or raises (out of memory, a bad shape) leaves the others blocked in their
    # next collective for the backend's default timeout (30 minutes for gloo, 10 for NCCL): the
    # timeout bounds that hang. Keep it above the slowest step: the first includes kernel
    # compilation and, on rank 0, the single-process check while the other ranks wait.
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
    try:
        run(args, device_type, backend)
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace, device_type: str, backend: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dtype = _DTYPES[args.dtype] if args.dtype else (
        torch.bfloat16 if device_type == "cuda" else torch.float32
    )  # fmt: skip
    tol = args.check_tolerance or {torch.float64: 1e-9, torch.float32: 1e-4}.get(dtype, 2e-2)
    if args.seq_len % world:
        raise SystemExit(f"--seq-len {args.seq_len} must be divisible by the world size {world}")

    config = build_config(args, kind="ring")
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = LongNetLM(config).to(device=device, dtype=dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    train, _ = load_corpus(args.corpus_bytes)
    generator = torch.Generator().manual_seed(args.seed)  # the same batches on every rank
    total_tokens = args.batch * args.seq_len
    if rank == 0:
        print(
            f"world {world} ({backend}), {args.batch} x {args.seq_len:,} tokens "
            f"({args.seq_len // world:,} per rank), preset {args.preset!r}, "
            f"{model.num_parameters():,} parameters, {str(dtype).removeprefix('torch.')}, "
            f"segments {list(config.segment_lengths)}, rates {list(config.dilation_rates)}",
            flush=True,
        )
    for step in range(args.steps):
        batch = sample_windows(train, args.batch, args.seq_len, generator)  # (B, N + 1)
        inputs = shard_sequence(batch[:, :-1]).to(device)
        targets = shard_sequence(batch[:, 1:]).to(device)
        if device_type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        share, loss = sharded_loss(model, inputs, targets, total_tokens)
        share.backward()
        all_reduce_gradients(model)
        if step == 0:
            if rank == 0:
                local_config = build_config(args, kind="dilated")
                check_against_single_process(
                    model, local_config, batch.to(device), loss, tol, device, dtype
                )
            dist.barrier()
        optimizer.step()
        if device_type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if rank == 0:
            print(
                f"step {step}: loss {loss:.4f} ({total_tokens / elapsed:,.0f} tokens/s"
                f"{', incl. the check' if step == 0 else ''})",
                flush=True,
            )


if __name__ == "__main__":
    main()
