"""Attention dropout: exact gradients with the regenerated mask, seeding, and backend choice."""

from __future__ import annotations

import pytest
import torch

from dilated_attention import attention, backend_reasons, dilated_attention


def _seeded_dilated(seed: int, causal: bool):
    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(seed)
        return dilated_attention(
            q, k, v, [8, 16], [1, 3], is_causal=causal, dropout_p=0.4, backend="math"
        )

    return fn


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
def test_dropout_gradients_are_exact(causal: bool) -> None:
    """gradcheck in float64: with the seed fixed the dropped-out function is deterministic, so its
    numerical Jacobian must match the backward, which regenerates the same mask."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 19, 3, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(1, 19, 3, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(1, 19, 3, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(_seeded_dilated(11, causal), (q, k, v))


def test_dropout_is_seeded_and_random() -> None:
    q = torch.randn(2, 32, 4, 8)
    torch.manual_seed(1)
    a = dilated_attention(q, q, q, [8, 32], [1, 2], dropout_p=0.5)
    b = dilated_attention(q, q, q, [8, 32], [1, 2], dropout_p=0.5)
    torch.manual_seed(1)
    c = dilated_attention(q, q, q, [8, 32], [1, 2], dropout_p=0.5)
    assert not torch.equal(a, b)
    assert torch.equal(a, c)


def test_dropout_is_unbiased() -> None:
    """Inverted dropout keeps the expectation: the mean of many draws nears the plain output."""
    q = torch.randn(1, 16, 2, 4, dtype=torch.float64)
    plain = attention(q, q, q)
    draws = torch.stack([attention(q, q, q, dropout_p=0.3, backend="math") for _ in range(4000)])
    assert (draws.mean(0) - plain).abs().max() < 0.05
    assert (draws.std(0)).max() > 0.01  # it really drops


def test_cpu_kernel_without_dropout_is_passed_over() -> None:
    q = torch.randn(1, 16, 2, 8)
    reasons = backend_reasons(q, q, q, dropout_p=0.1)
    assert reasons["cpu_flash"] == ["no dropout"]
    assert reasons["math"] == []
    with pytest.raises(ValueError, match="cpu_flash"):
        dilated_attention(q, q, q, [16], [1], dropout_p=0.1, backend="cpu_flash")
