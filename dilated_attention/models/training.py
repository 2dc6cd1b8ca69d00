"""What training and measuring a byte-level :class:`LongNetLM` on real text takes: the corpus,
random windows of it, the learning-rate schedule, and bits per byte (overall and by position).

The demo (``python -m dilated_attention demo``), the training example and the quality benchmark
(``benchmarks/bench_quality.py``) share these, so their numbers are measured the same way.

Shape legend: B windows, N bytes per window (N + 1 with the last window's target).

Note [The corpus]
    The text is the Python source of the installed ``torch`` package, which every install has
    (LongNet itself was trained on source code). Files are split into training and held-out sets
    by a hash of their path, so the split is the same on every machine with the same torch.
"""

from __future__ import annotations

import hashlib
import math
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "DEFAULT_CORPUS_BYTES",
    "MIN_CORPUS_BYTES",
    "bits_per_byte",
    "bits_per_position",
    "load_corpus",
    "next_token_scores",
    "reference_bits_per_byte",
    "sample_windows",
    "warmup_cosine",
]

#: The most :func:`load_corpus` reads unless asked for more (24 MiB).
DEFAULT_CORPUS_BYTES = 24 << 20
#: The least ``max_bytes`` :func:`load_corpus` takes (``--corpus-bytes``): every tenth file is
#: held out, and a smaller read may hold out none.
MIN_CORPUS_BYTES = 1 << 20


def load_corpus(max_bytes: int = DEFAULT_CORPUS_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """Training and held-out bytes (uint8 tensors) from the installed torch's ``.py`` files
    (Note [The corpus]).

    Every tenth file by path hash is held out; files are read in sorted order until ``max_bytes``.

    Raises:
        ValueError: ``max_bytes`` is below :data:`MIN_CORPUS_BYTES`, or reads too few files to
            hold one out.
    """
    if max_bytes < MIN_CORPUS_BYTES:
        raise ValueError(
            f"max_bytes (--corpus-bytes) must be >= {MIN_CORPUS_BYTES} (1 MiB: every tenth file "
            f"is held out, and a smaller read may hold out none), got {max_bytes}"
        )
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
        if total >= max_bytes:
            raise ValueError(
                f"max_bytes={max_bytes} reads too few files to hold some out (every tenth file "
                f"is held out); raise it (--corpus-bytes), e.g. to 2000000"
            )
        raise RuntimeError(f"found too little Python source under {root} to train on")

    def as_tensor(parts: list[bytes]) -> torch.Tensor:
        return torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)

    return as_tensor(train), as_tensor(held_out)


def sample_windows(
    data: torch.Tensor, batch: int, length: int, generator: torch.Generator
) -> torch.Tensor:
    """(batch, length + 1) int64 windows of ``data`` (N,) at random offsets drawn from
    ``generator``."""
    starts = torch.randint(0, data.numel() - length - 1, (batch,), generator=generator)
    return torch.stack([data[s : s + length + 1] for s in starts.tolist()]).long()


def reference_bits_per_byte(data: torch.Tensor) -> dict[str, float]:
    """Bits per byte of two simple models of ``data``, the scale for a trained model's.

    Args:
        data: (N,) uint8 bytes, N >= 1.

    Returns:
        ``"unigram"``: the entropy of the byte histogram (a model that knows which bytes are
        common and nothing else); ``"gzip"``: the size zlib compresses ``data`` to at level 9
        (gzip -9's DEFLATE), in bits per byte. Random bytes give 8 (gzip slightly more).
    """
    counts = torch.bincount(data.long(), minlength=256).double()
    p = counts[counts > 0] / data.numel()
    unigram = float(-(p * p.log2()).sum())
    gzip = 8 * len(zlib.compress(data.numpy().tobytes(), 9)) / data.numel()
    return {"unigram": unigram, "gzip": gzip}


@torch.no_grad()
def next_token_scores(
    model: nn.Module, windows: torch.Tensor, device: torch.device, *, batch: int = 8
) -> tuple[torch.Tensor, torch.Tensor]:
    """How the model scores the true next token at every position of every window.

    Args:
        model: maps (B, N) token ids to (B, N, V) logits (a :class:`LongNetLM`); put in eval
            mode for the measurement and back in training mode after it.
        windows: (W, N + 1) token ids; position ``i`` of a window predicts its token ``i + 1``
            from tokens ``0..i``.
        device: where the model runs.
        batch: windows per forward call.

    Returns:
        ``(correct, bits)`` on the CPU: (W, N) bool, whether the model's most likely next token
        is the true one, and (W, N) float64, the bits it spends on the true one.
    """
    model.eval()
    correct, bits = [], []
    try:
        for chunk in windows.split(batch):
            chunk = chunk.to(device)
            logits = model(chunk[:, :-1]).float()
            correct.append((logits.argmax(-1) == chunk[:, 1:]).cpu())
            nats = F.cross_entropy(logits.transpose(1, 2), chunk[:, 1:], reduction="none")
            bits.append(nats.double().cpu() / math.log(2))
    finally:
        model.train()
    return torch.cat(correct), torch.cat(bits)


def bits_per_position(
    model: nn.Module, windows: torch.Tensor, device: torch.device, *, batch: int = 8
) -> torch.Tensor:
    """Next-byte cross-entropy in bits at each position, averaged over the windows: (N,)
    float64 on the CPU (arguments as :func:`next_token_scores`)."""
    return next_token_scores(model, windows, device, batch=batch)[1].mean(0)


def bits_per_byte(model: nn.Module, windows: torch.Tensor, device: torch.device) -> float:
    """Mean next-byte cross-entropy on fixed windows (W, N + 1), in bits: the mean of
    :func:`bits_per_position`."""
    return float(bits_per_position(model, windows, device).mean())


_WARMUP_FRACTION = 0.05


def warmup_cosine(progress: float, peak: float) -> float:
    """The learning rate at ``progress`` (the fraction of training done, in [0, 1]): a linear
    warm-up over the first 5% to ``peak``, then a cosine decay to zero."""
    if progress < _WARMUP_FRACTION:
        return peak * max(progress, 1e-3) / _WARMUP_FRACTION
    decay = (progress - _WARMUP_FRACTION) / (1 - _WARMUP_FRACTION)
    return peak * 0.5 * (1 + math.cos(math.pi * min(decay, 1.0)))
