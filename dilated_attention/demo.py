"""The main job: train a tiny LongNet as a byte-level language model on real text.

The text is the Python source of the installed ``torch`` package, which every install has (LongNet
itself was trained on source code). Files are split into training and held-out sets by a hash of
their path, so the split is the same on every machine with the same torch. The demo reports
held-out bits per byte before and after training, the kernel chosen, and a generated sample.

    python -m dilated_attention demo                 # about two minutes on a 2-core CPU
    python -m dilated_attention demo --steps 20      # a quick check
"""

from __future__ import annotations

import argparse
import hashlib
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .factory import explain
from .models import LongNetConfig, LongNetLM

_MAX_CORPUS_BYTES = 24 << 20


def load_corpus(max_bytes: int = _MAX_CORPUS_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """Training and held-out bytes (uint8 tensors) from the installed torch's ``.py`` files.

    Every tenth file by path hash is held out; files are read in sorted order until ``max_bytes``.
    """
    root = Path(torch.__file__).resolve().parent
    train, held_out, total = [], [], 0
    for path in sorted(root.rglob("*.py")):
        data = path.read_bytes()
        if not data:
            continue
        digest = hashlib.sha1(str(path.relative_to(root)).encode()).digest()
        (held_out if digest[0] % 10 == 0 else train).append(data + b"\n\n")
        total += len(data)
        if total >= max_bytes:
            break
    if not train or not held_out:
        raise RuntimeError(f"found too little Python source under {root} to train on")

    def as_tensor(parts: list[bytes]) -> torch.Tensor:
        return torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)

    return as_tensor(train), as_tensor(held_out)


def sample_windows(
    data: torch.Tensor, batch: int, length: int, generator: torch.Generator
) -> torch.Tensor:
    """(batch, length + 1) int64 windows at random offsets."""
    starts = torch.randint(0, data.numel() - length - 1, (batch,), generator=generator)
    return torch.stack([data[s : s + length + 1] for s in starts.tolist()]).long()


@torch.no_grad()
def bits_per_byte(model: LongNetLM, windows: torch.Tensor, device: torch.device) -> float:
    """Mean next-byte cross-entropy on fixed windows, in bits."""
    model.eval()
    total, count = 0.0, 0
    for chunk in windows.split(8):
        chunk = chunk.to(device)
        logits = model(chunk[:, :-1])
        targets = chunk[:, 1:].flatten()
        total += float(F.cross_entropy(logits.float().flatten(0, 1), targets, reduction="sum"))
        count += chunk[:, 1:].numel()
    model.train()
    return total / count / math.log(2)


def _lr(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * 0.5 * (1 + math.cos(math.pi * progress))


def run(argv: list[str] | None = None) -> dict[str, float]:
    """Train and report; returns the measured figures (also printed)."""
    parser = argparse.ArgumentParser(
        prog="python -m dilated_attention demo", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=700)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--eval-windows", type=int, default=32)
    parser.add_argument("--sample-bytes", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", default="tiny")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(args.seed)
    train, held_out = load_corpus()
    config = LongNetConfig.from_preset(args.preset)
    model = LongNetLM(config).to(device)
    eval_windows = sample_windows(held_out, args.eval_windows, args.seq_len, gen)
    head_dim = config.embed_dim // config.num_heads
    choice = explain(
        device=device, dtype=torch.float32, head_dim=head_dim, num_heads=config.num_heads,
        seq_len=min(config.segment_lengths[0], args.seq_len), is_causal=True,
    )  # fmt: skip
    print(
        f"LongNet '{args.preset}': {model.num_parameters() / 1e6:.2f}M parameters, "
        f"{config.num_layers} layers, segments {list(config.segment_lengths)}, rates "
        f"{list(config.dilation_rates)}; kernel {choice.backend} on {device}"
    )
    print(
        f"data: Python source of torch {torch.__version__}: {train.numel() / 1e6:.1f} MB train, "
        f"{held_out.numel() / 1e6:.1f} MB held out"
    )
    before = bits_per_byte(model, eval_windows, device)
    print(f"held-out bits per byte before training: {before:.3f}")

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = max(1, args.steps // 20)
    start = time.perf_counter()
    bar = tqdm(range(args.steps), desc="training", unit="step")
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, args.steps, args.lr, warmup)
        batch = sample_windows(train, args.batch_size, args.seq_len, gen).to(device)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        elapsed = time.perf_counter() - start
        bar.set_postfix(
            loss=f"{loss.item():.3f}",
            tok_s=f"{(step + 1) * args.batch_size * args.seq_len / elapsed:,.0f}",
        )
    seconds = time.perf_counter() - start
    after = bits_per_byte(model, eval_windows, device)
    print(f"held-out bits per byte after {args.steps} steps: {after:.3f} (before {before:.3f})")
    print(f"training time {seconds:.1f} s")

    prompt = held_out[: args.seq_len // 2].long().unsqueeze(0).to(device)
    sample = model.generate(
        prompt, args.sample_bytes, temperature=0.8, top_k=20,
        generator=torch.Generator(device=device).manual_seed(args.seed),
    )  # fmt: skip
    text = bytes(sample[0, prompt.shape[1] :].tolist()).decode("utf-8", errors="replace")
    print("sample (after the held-out prompt):\n" + text)
    return {"bits_per_byte_before": before, "bits_per_byte_after": after, "seconds": seconds}
