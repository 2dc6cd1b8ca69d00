"""Block-sparse test helpers: the token mask of a pattern by indexing (no library code), the
float64 oracle with gradients, and the check of a kernel's result against it."""

from __future__ import annotations

import pytest
import torch

from dilated_attention import block_sparse_attention
from dilated_attention import patterns as P
from dilated_attention.backends.registry import Selection
from dilated_attention.resolve import BLOCK_SPARSE, Request, resolve

from .oracle import masked_attention
from .tolerances import LOW_PRECISION, assert_close_to_oracle

F64 = torch.float64


def chosen_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    is_causal: bool,
    block_size: int,
    needs_grad: bool,
    backend: str | None = None,
) -> Selection:
    """The kernel the resolve step takes for a block-sparse call on q (B, Nq, H, D) and
    k (B, Nk, Hkv, D), whatever the pattern (the registry's answer for the call's shape)."""
    request = Request.of(
        BLOCK_SPARSE, q, k, k, is_causal=is_causal, block_size=block_size,
        requires_grad=needs_grad, backend=backend,
    )  # fmt: skip
    kernel = resolve(request).kernel
    assert kernel is not None
    return kernel


def token_mask(
    pattern: P.Pattern,
    block_size: int,
    query_len: int,
    key_len: int,
    is_causal: bool,
    *,
    query_start: int | None = None,
) -> torch.Tensor:
    """(Nq, Nk) int64 0/1: block mask expanded to tokens (no library code), AND causal.

    Query row ``i`` is position ``p = query_start + i``, in block ``p // block_size``, and with
    ``is_causal`` sees ``t <= p``. ``query_start`` defaults to the library's convention: causal
    queries are end-aligned (``Nk - Nq``: the last positions of the key sequence), others start
    at 0; the pattern is asked for the block mask of positions ``[0, query_start + Nq)``.
    ``query_start=0`` describes a kernel's top-left causal mask (the block-sparse plan kernels'
    own contract). A causal query longer than the key is refused by the library, and here
    unless ``query_start`` is given.
    """
    if query_start is None:
        if is_causal and query_len > key_len:
            raise ValueError("a causal query cannot be longer than the key")
        query_start = key_len - query_len if is_causal else 0
    start = query_start
    nq, nk = -(-(start + query_len) // block_size), -(-key_len // block_size)
    blocks = pattern.block_mask(nq, nk)
    # Indexing, not a loop per token pair: the loop took 13 us a pair, 14 s at 1024 x 1024.
    p = torch.arange(start, start + query_len).view(-1, 1)  # each query row's position
    t = torch.arange(key_len).view(1, -1)
    mask = blocks[p // block_size, t // block_size]  # (Nq, Nk): block of row p, block of key t
    if is_causal:
        mask = mask & (t <= p)
    return mask.to(torch.int64)


def assert_end_aligned_refused(
    query_len: int,
    key_len: int,
    pattern: P.Pattern,
    block_size: int,
    backend: str,
    device: torch.device | str,
) -> None:
    """A block-sparse plan kernel named for a causal call with ``Nq != Nk`` raises ``ValueError``
    before any work: its causal mask is top-left aligned, and a causal query is the last
    positions of the key sequence (shorter) or refused (longer); Note [End-aligned causal
    blocks] in ``block_sparse/api.py``."""
    q = torch.zeros(1, query_len, 2, 64, device=device, dtype=torch.bfloat16)
    k = torch.zeros(1, key_len, 2, 64, device=device, dtype=torch.bfloat16)
    match = "shorter than the key" if query_len < key_len else "cannot be longer than the key"
    with pytest.raises(ValueError, match=match):
        block_sparse_attention(
            q, k, k, pattern, block_size=block_size, is_causal=True, backend=backend
        )


def oracle_with_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """float64 ``(out, lse, (dq, dk, dv))`` of the dense masked oracle under the token ``mask``
    (Nq, Nk) 0/1, shared by every head, or (B, H, Nq, Nk) (a run-time mask's)."""
    leaves = [t.detach().to(F64).requires_grad_() for t in (q, k, v)]
    out, lse = masked_attention(*leaves, _per_head(mask, q.shape[2]), scale=scale)
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
    token ``mask`` (Nq, Nk), or (B, H, Nq, Nk); bf16/fp16 error within 2x a naive same-dtype
    reference (tests/support/tolerances.py). Rows that see no key give zeros and
    ``lse = -inf``."""
    dtype = q.dtype
    ref_out, ref_lse, ref_grads = oracle_with_grads(q, k, v, dout, mask)
    low_out = low_lse = None
    low_grads: list[torch.Tensor | None] = [None, None, None]
    if dtype in LOW_PRECISION:
        low = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        low_out, low_lse = masked_attention(*low, _per_head(mask, 4), compute_dtype=dtype)
        low_grads = list(torch.autograd.grad(low_out, low, dout))
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close_to_oracle(out, ref_out, low_out, name="out", dtype=dtype)
    assert_close_to_oracle(lse, ref_lse, low_lse, name="lse", dtype=dtype)
    for name, g, rg, lg in zip("qkv", grads, ref_grads, low_grads, strict=True):
        assert_close_to_oracle(g, rg, lg, name=f"d{name}", dtype=dtype, grad=True)
    empty = (_per_head(mask, q.shape[2]).sum(-1) == 0).expand(*lse.shape)  # (B, H, Nq)
    if bool(empty.any()):
        rows = out.transpose(1, 2)[empty]
        assert torch.equal(rows, torch.zeros_like(rows))
        assert bool(torch.isneginf(lse[empty]).all())


def _per_head(mask: torch.Tensor, heads: int) -> torch.Tensor:
    """A token mask (Nq, Nk) shared by every head as (H, Nq, Nk); (B, H, Nq, Nk) as it is."""
    return mask if mask.dim() == 4 else mask.expand(heads, -1, -1)
