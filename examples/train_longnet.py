"""Train a LongNet language model: a real training loop around ``LongNetLM``.

The data is the demo's byte-level corpus (the Python source of the installed ``torch`` package,
with held-out files for evaluation; see ``dilated_attention.demo``).

    python examples/train_longnet.py                   # CPU: 3.6-6 min on 2 shared cores
    python examples/train_longnet.py --steps 2000 --batch-size 32 --seq-len 1024 --compile
    python examples/train_longnet.py --stop-after 60                   # stop half-way...
    python examples/train_longnet.py --resume                          # ...and continue

Everything it writes goes to ``--output-dir`` (default ``outputs/train_longnet/``, created on
demand): ``checkpoint.pt`` (``--checkpoint`` to change, ``--no-checkpoint`` for none) and
``loss_curve.png``. The checkpoint is the package's checksummed format
(``dilated_attention.models.save_checkpoint``): ``--resume`` refuses a corrupted, truncated or
foreign file with a clear error instead of training on damaged weights, and ``python -m
dilated_attention generate --checkpoint outputs/train_longnet/checkpoint.pt --prompt "def "``
samples from it.

What it shows: AdamW; linear warmup then cosine decay (``LambdaLR``); gradient clipping; bf16
autocast on CUDA (none on CPU); activation checkpointing (``--activation-checkpointing``);
``torch.compile`` (``--compile``); checkpoints (model, optimizer, scheduler, step, config, the data
generator's RNG state and the loss history) saved at every evaluation and at the end;
``--resume`` continues from the saved step and reproduces the losses of an uninterrupted run;
periodic held-out bits per byte; a progress bar with loss and tokens/s; a loss-curve PNG
(``--plot``; needs matplotlib, from the ``dev`` extra).

Interrupting a run (Ctrl-C, a job time limit) and resuming it with the same ``--steps`` gives the
same losses as never stopping. ``--stop-after N`` stops (with a checkpoint) after step N as if the
run were interrupted there; the learning-rate schedule still spans ``--steps``.

Machine-readable lines on stdout: ``step S loss L``, ``eval step S bpb B``, and, with ``--log
PATH``, one JSON object per line (``{"step": S, "loss": L}`` / ``{"step": S, "eval_bpb": B}``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from dilated_attention import LongNetConfig, LongNetLM
from dilated_attention.demo import (
    MIN_CORPUS_BYTES,
    HelpFormatter,
    bits_per_byte,
    load_corpus,
    sample_windows,
)
from dilated_attention.models import CheckpointError, load_checkpoint, save_checkpoint


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--preset", default="tiny", help="LongNetConfig preset (tiny, base)")
    p.add_argument(
        "--steps", type=int, default=120,
        help="total optimizer steps (the learning-rate schedule spans them)",
    )  # fmt: skip
    p.add_argument(
        "--stop-after", type=int, default=None,
        help="stop after this step, as if interrupted (default: run all --steps)",
    )  # fmt: skip
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256, help="bytes per training sequence")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    p.add_argument("--warmup", type=int, default=10, help="linear warmup steps")
    p.add_argument("--grad-clip", type=float, default=1.0, help="max grad norm (0: off)")
    p.add_argument("--eval-every", type=int, default=40, help="steps between evaluations")
    p.add_argument("--eval-windows", type=int, default=16, help="held-out windows per eval")
    p.add_argument(
        "--corpus-bytes", type=int, default=24 << 20,
        help=f"read at most this many bytes of source; at least {MIN_CORPUS_BYTES} (1 MiB), "
        "since every tenth file is held out",
    )  # fmt: skip
    p.add_argument(
        "--output-dir", type=Path, default=Path("outputs/train_longnet"),
        help="where the checkpoint and the plot go",
    )  # fmt: skip
    p.add_argument(
        "--checkpoint", type=Path, default=None,
        help="checkpoint file to write (default: OUTPUT_DIR/checkpoint.pt)",
    )  # fmt: skip
    p.add_argument("--no-checkpoint", action="store_true", help="write no checkpoint")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument(
        "--activation-checkpointing", action="store_true",
        help="recompute each block in the backward pass (less memory, more time)",
    )  # fmt: skip
    p.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu, cuda or cuda:N (CUDA when available)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    p.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="loss-curve PNG (default: OUTPUT_DIR/loss_curve.png)",
    )
    p.add_argument("--no-plot", action="store_true", help="write no loss-curve PNG")
    p.add_argument(
        "--log", type=Path, default=None, help="JSON-lines log of losses (default: none)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.resume and args.no_checkpoint:
        p.error("--resume needs a checkpoint: drop --no-checkpoint")
    if args.checkpoint is None and not args.no_checkpoint:
        args.checkpoint = args.output_dir / "checkpoint.pt"
    if args.no_checkpoint:
        args.checkpoint = None
    if args.plot is None:
        args.plot = args.output_dir / "loss_curve.png"
    if args.steps < 1 or args.batch_size < 1 or args.seq_len < 1 or args.eval_every < 1:
        p.error("--steps, --batch-size, --seq-len and --eval-every must be >= 1")
    if args.corpus_bytes < MIN_CORPUS_BYTES:
        p.error(f"--corpus-bytes must be >= {MIN_CORPUS_BYTES} (1 MiB), got {args.corpus_bytes}")
    return args


def lr_factor(step: int, *, warmup: int, total: int) -> float:
    """Multiplier of the peak LR for optimizer step ``step`` (0-based): linear warmup, cosine."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def plot_losses(path: Path, losses: list[float], evals: list[tuple[int, float]]) -> None:
    """Write the loss curve (and held-out bits per byte) to ``path``; skip without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): skipping the plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(losses) + 1), [x / math.log(2) for x in losses], label="train")
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("bits per byte")
    ax.set_title("LongNet training")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"loss curve written to {path}")


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)

    state = None
    # Recompute each block in the backward pass instead of keeping its activations.
    recompute = {"activation_checkpointing": args.activation_checkpointing}
    if args.resume:
        if not args.checkpoint.exists():
            raise SystemExit(
                f"--resume: no checkpoint at {args.checkpoint}; run without --resume first "
                f"(or give --checkpoint PATH / --output-dir DIR of the run to continue)"
            )
        try:
            # Checked (SHA-256) before use: a damaged file stops here, not mid-training.
            ckpt = load_checkpoint(args.checkpoint, overrides=recompute)
        except CheckpointError as exc:
            raise SystemExit(f"--resume: {exc}") from None
        state, config, model = ckpt.extra, ckpt.config, ckpt.model.to(device)
        lacking = sorted({"optimizer", "scheduler", "step", "total_steps"} - set(state))
        if lacking:
            raise SystemExit(
                f"--resume: {args.checkpoint} holds a model but not a train_longnet.py run "
                f"(it lacks {lacking}); start a new run without --resume"
            )
        print(f"resuming from {args.checkpoint} at step {state['step']}")
        if state["total_steps"] != args.steps:
            print(
                f"note: the checkpoint's run had --steps {state['total_steps']}; the schedule "
                f"now spans {args.steps}, so the losses will differ from that run's"
            )
    else:
        config = dataclasses.replace(LongNetConfig.from_preset(args.preset), **recompute)
        model = LongNetLM(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, warmup=args.warmup, total=args.steps)
    )
    data_gen = torch.Generator().manual_seed(args.seed)
    losses: list[float] = []
    evals: list[tuple[int, float]] = []
    step = 0
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        data_gen.set_state(state["data_rng"])
        torch.set_rng_state(state["torch_rng"])
        step, losses = state["step"], list(state["losses"])
        evals = [(int(s), float(b)) for s, b in state["evals"]]
    # Compile after loading: the checkpoint holds the plain module's state_dict.
    forward = torch.compile(model) if args.compile else model

    train, held_out = load_corpus(args.corpus_bytes)
    # Evaluation windows come from their own generator: the same windows in every run.
    eval_windows = sample_windows(
        held_out, args.eval_windows, args.seq_len, torch.Generator().manual_seed(args.seed + 1)
    )
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda"
        else contextlib.nullcontext()
    )
    print(
        f"LongNet '{args.preset}': {model.num_parameters() / 1e6:.2f}M parameters on {device}; "
        f"{train.numel() / 1e6:.1f} MB train, {held_out.numel() / 1e6:.1f} MB held out"
    )
    log = args.log.open("a" if args.resume else "w") if args.log else None

    def emit(line: str, record: dict[str, float]) -> None:
        tqdm.write(line)
        if log is not None:
            log.write(json.dumps(record) + "\n")
            log.flush()

    def evaluate() -> float:
        with autocast:
            bpb = bits_per_byte(forward, eval_windows, device)
        evals.append((step, bpb))
        emit(f"eval step {step} bpb {bpb:.6f}", {"step": step, "eval_bpb": bpb})
        return bpb

    def save() -> None:
        if args.checkpoint is None:
            return
        # Written to a temporary file and renamed: never a half-written checkpoint.
        save_checkpoint(
            args.checkpoint, model, optimizer=optimizer.state_dict(),
            scheduler=scheduler.state_dict(), step=step, total_steps=args.steps,
            data_rng=data_gen.get_state(), torch_rng=torch.get_rng_state(), losses=losses,
            evals=evals,
        )  # fmt: skip

    if step == 0:
        evaluate()
    last = args.steps if args.stop_after is None else min(args.steps, args.stop_after)
    tokens_per_step = args.batch_size * args.seq_len
    bar = tqdm(range(step, last), initial=step, total=last, unit="step", disable=args.no_progress)
    start, done = time.perf_counter(), 0
    model.train()
    for step_index in bar:
        batch = sample_windows(train, args.batch_size, args.seq_len, data_gen).to(device)
        with autocast:
            logits = forward(batch[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        scheduler.step()
        step, done = step_index + 1, done + 1
        losses.append(loss.item())
        emit(f"step {step} loss {losses[-1]:.6f}", {"step": step, "loss": losses[-1]})
        bar.set_postfix(
            loss=f"{losses[-1]:.3f}",
            tok_s=f"{done * tokens_per_step / (time.perf_counter() - start):,.0f}",
        )
        if step % args.eval_every == 0 or step == last:
            if not evals or evals[-1][0] != step:
                evaluate()
            save()
    bar.close()
    if done == 0:
        save()
    if log is not None:
        log.close()
    if args.checkpoint is not None:
        print(f"checkpoint at step {step} written to {args.checkpoint}")
    final = {"step": step, "loss": losses[-1] if losses else float("nan"), "bpb": evals[-1][1]}
    print(f"final step {step} loss {final['loss']:.6f} eval_bpb {final['bpb']:.6f}")
    if not args.no_plot:
        plot_losses(args.plot, losses, evals)
    return final


if __name__ == "__main__":
    main()
