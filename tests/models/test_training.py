"""The shared training helpers (``models/training.py``): bits per byte by position."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dilated_attention.models.training import bits_per_byte, bits_per_position, warmup_cosine


class _Counter(nn.Module):
    """Logits over 256 bytes for windows that count up (each byte the one before plus 1):
    uniform at positions before ``seen``; from ``seen`` on, probability ``p`` on the next
    count, the rest shared evenly."""

    def __init__(self, seen: int, p: float) -> None:
        super().__init__()
        self.seen, self.p = seen, p

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*tokens.shape, 256, dtype=torch.float64)
        nxt = (tokens[:, self.seen :, None] + 1) % 256
        logits[:, self.seen :].scatter_(2, nxt, math.log(self.p * 255 / (1 - self.p)))
        return logits


def test_bits_per_position_measures_each_position_over_the_windows() -> None:
    """A model uniform over bytes costs 8 bits; one that puts p on the right byte costs
    -log2(p); positions are kept apart, windows averaged, and ``bits_per_byte`` is their mean.
    The model goes back to training mode after the measurement."""
    starts = torch.randint(0, 256, (5, 1), generator=torch.Generator().manual_seed(0))
    windows = (starts + torch.arange(13)) % 256
    model = _Counter(seen=4, p=0.5)
    bits = bits_per_position(model, windows, torch.device("cpu"), batch=2)
    assert bits.shape == (12,) and bits.dtype == torch.float64
    assert torch.allclose(bits[:4], torch.full((4,), 8.0, dtype=torch.float64))
    assert torch.allclose(bits[4:], torch.full((8,), 1.0, dtype=torch.float64))
    assert model.training
    assert bits_per_byte(model, windows, torch.device("cpu")) == pytest.approx(
        (4 * 8.0 + 8 * 1.0) / 12, rel=1e-5
    )  # the logits are scored in float32


def test_warmup_cosine() -> None:
    assert warmup_cosine(0.0, 1.0) > 0  # the first step learns
    assert warmup_cosine(0.05, 1.0) == pytest.approx(1.0)
    assert warmup_cosine(1.0, 1.0) == pytest.approx(0.0)
