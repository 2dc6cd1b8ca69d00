"""Block-sparse test helpers: the token mask of a pattern by loops (no library code), the float64
oracle with gradients, and the check of a kernel's result against it."""

from __future__ import annotations

import torch

from dilated_attention import patterns as P

from .oracle import masked_attention
from .tolerances import LOW_PRECISION, assert_close_to_oracle

F64 = torch.float64


def token_mask(
    pattern: P.Pattern, block_size: int, query_len: int, key_len: int, is_causal: bool
) -> torch.Tensor:
    """(Nq, Nk) int64 0/1: block mask expanded to tokens (loops, no library code), AND causal."""
    nq, nk = -(-query_len // block_size), -(-key_len // block_size)
    blocks = pattern.block_mask(nq, nk)
    mask = torch.zeros(query_len, key_len, dtype=torch.int64)
    for p in range(query_len):
        for t in range(key_len):
            if blocks[p // block_size, t // block_size] and (not is_causal or t <= p):
                mask[p, t] = 1
    return mask


def oracle_with_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """float64 ``(out, lse, (dq, dk, dv))`` of the dense masked oracle under the token ``mask``
    (Nq, Nk) 0/1, shared by every head."""
    leaves = [t.detach().to(F64).requires_grad_() for t in (q, k, v)]
    heads = q.shape[2]
    out, lse = masked_attention(*leaves, mask.expand(heads, -1, -1), scale=scale)
    grads = torch.autograd.grad(out, leaves, dout.to(F64))
    return out.detach(), lse.detach(), grads


def check_kernel_result(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    mask: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grads: list[torch.Tensor],
) -> None:
    """A kernel's ``out``, ``lse`` and gradients (on the CPU) against the float64 oracle of the
    same inputs (``q``, ``k``, ``v``, ``dout`` in the kernel's dtype, 4 query heads) under the
    token ``mask``; bf16/fp16 error within 2x a naive same-dtype reference
    (tests/support/tolerances.py). Rows that see no key give zeros and ``lse = -inf``."""
    dtype = q.dtype
    ref_out, ref_lse, ref_grads = oracle_with_grads(q, k, v, dout, mask)
    low_out = low_lse = None
    low_grads: list[torch.Tensor | None] = [None, None, None]
    if dtype in LOW_PRECISION:
        low = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        low_out, low_lse = masked_attention(*low, mask.expand(4, -1, -1), compute_dtype=dtype)
        low_grads = list(torch.autograd.grad(low_out, low, dout))
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close_to_oracle(out, ref_out, low_out, name="out", dtype=dtype)
    assert_close_to_oracle(lse, ref_lse, low_lse, name="lse", dtype=dtype)
    for name, g, rg, lg in zip("qkv", grads, ref_grads, low_grads, strict=True):
        assert_close_to_oracle(g, rg, lg, name=f"d{name}", dtype=dtype, grad=True)
    empty = mask.sum(1) == 0
    if bool(empty.any()):
        assert torch.equal(out[:, empty], torch.zeros_like(out[:, empty]))
        assert bool(torch.isneginf(lse[:, :, empty]).all())
