"""What a dense call derives from its metadata is derived once and kept: its request (Note [One
request per description] in ``resolve/request.py``) and its runner (Note [Resolved once per
request]).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from dilated_attention.resolve import Request, resolve

B, N, H, HKV, D = 2, 9, 4, 2, 8


def _qkv(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = ((B, N, H, D), (B, N, HKV, D), (B, N, HKV, D))
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]


def test_an_equal_description_is_the_same_request() -> None:
    """Describing the same call again gives the request already made, not an equal copy; a
    description that differs (a flag, grad mode, a dtype) gives its own. Packed documents are
    described anew each time (their offsets change from call to call)."""
    q, k, v = (x.requires_grad_() for x in _qkv())
    first = Request.of("dense", q, k, v, is_causal=True)
    again = Request.of("dense", *(x.detach().clone().requires_grad_() for x in (q, k, v)),
                       is_causal=True)  # fmt: skip
    assert again is first
    with torch.no_grad():
        inference = Request.of("dense", q, k, v, is_causal=True)
    assert inference == replace(first, requires_grad=False)
    assert Request.of("dense", q, k, v, is_causal=False) != first
    doubles = [x.double() for x in (q, k, v)]
    assert Request.of("dense", *doubles, is_causal=True).dtype == torch.float64
    packed = [Request.of("dense", q, k, v, documents=(0, 4, 18)) for _ in range(2)]
    assert packed[0] == packed[1] and packed[0] is not packed[1]


def test_a_dense_strategy_makes_its_runner_once() -> None:
    """The dense strategy's runner depends on the request alone: every call of the request
    runs the same runner object (plan once, run many)."""
    q, k, v = _qkv()
    strategy = resolve(Request.of("dense", q, k, v, is_causal=True))
    first, _ = strategy.prepare(q, k, v, None)  # type: ignore[misc]
    again, _ = strategy.prepare(*_qkv(seed=1), None)  # type: ignore[misc]
    assert again is first
