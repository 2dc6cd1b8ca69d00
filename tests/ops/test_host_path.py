"""What a dense call derives from its metadata is derived once and kept: its runner (Note
[Resolved once per request]).
"""

from __future__ import annotations

import torch

from dilated_attention.resolve import Request, resolve

B, N, H, HKV, D = 2, 9, 4, 2, 8


def _qkv(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = ((B, N, H, D), (B, N, HKV, D), (B, N, HKV, D))
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]


def test_a_dense_strategy_makes_its_runner_once() -> None:
    """The dense strategy's runner depends on the request alone: every call of the request
    runs the same runner object (plan once, run many)."""
    q, k, v = _qkv()
    strategy = resolve(Request.of("dense", q, k, v, is_causal=True))
    first, _ = strategy.prepare(q, k, v, None)  # type: ignore[misc]
    again, _ = strategy.prepare(*_qkv(seed=1), None)  # type: ignore[misc]
    assert again is first
