"""Run-time block masks in the tests: their token mask by plain loops over blocks (no library
code), and the float64 oracle of a call with one."""

from __future__ import annotations

import math

import torch

from .oracle import masked_attention

F64 = torch.float64


def kept_columns(mask: torch.Tensor, b: int, h: int, i: int, key_blocks: int) -> list[int]:
    """The key blocks query block ``i`` of batch row ``b`` and mask head ``h`` attends: a bool
    mask's True columns, or the listed indices in ``[0, key_blocks)`` (each once)."""
    row = mask[b, h, i].tolist()
    if mask.dtype == torch.bool:
        return [j for j, keep in enumerate(row) if keep]
    return sorted({j for j in row if 0 <= j < key_blocks})


def document_of(cu_seqlens: list[int] | None, row: int, seq_len: int, position: int) -> int:
    """The index of the document holding ``position`` of batch row ``row`` (0 if unpacked)."""
    if cu_seqlens is None:
        return 0
    flat = row * seq_len + position
    return max(d for d, start in enumerate(cu_seqlens[:-1]) if start <= flat)


def runtime_token_mask(
    mask: torch.Tensor,
    block_size: int,
    *,
    batch: int,
    heads: int,
    query_len: int,
    key_len: int,
    is_causal: bool,
    cu_seqlens: list[int] | None = None,
) -> torch.Tensor:
    """(B, H, Nq, Nk) int64 0/1 as the docstring of ``block_sparse_attention`` states it: query
    row ``r`` of head ``h`` attends key ``t`` when the mask (its batch row, or row 0 of a batch
    of 1; mask head ``h // (H // Hm)``) keeps ``(r // bs, t // bs)``, and, causal,
    ``t <= Nk - Nq + r``; with ``cu_seqlens``, only within the row's document."""
    bs = block_size
    mq, mk = math.ceil(query_len / bs), math.ceil(key_len / bs)
    out = torch.zeros(batch, heads, query_len, key_len, dtype=torch.int64)
    for b in range(batch):
        for h in range(heads):
            mb, mh = (b if mask.shape[0] > 1 else 0), h // (heads // mask.shape[1])
            for i in range(mq):
                for j in kept_columns(mask, mb, mh, i, mk):
                    out[b, h, i * bs : (i + 1) * bs, j * bs : (j + 1) * bs] = 1
    if is_causal:
        rows, keys = torch.arange(query_len).view(-1, 1), torch.arange(key_len).view(1, -1)
        out = out * (keys <= key_len - query_len + rows)
    if cu_seqlens is not None:
        for b in range(batch):
            docs = [document_of(cu_seqlens, b, query_len, p) for p in range(query_len)]
            same = torch.tensor(docs).view(-1, 1) == torch.tensor(docs).view(1, -1)
            out[b] = out[b] * same
    return out


def runtime_oracle(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    tokens: torch.Tensor,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """float64 ``(out, lse, grads)`` of the dense masked softmax under ``tokens`` (B, H, Nq,
    Nk): grads of q, k, v (and of ``sinks`` when given)."""
    leaves = [t.detach().to(F64).requires_grad_() for t in (q, k, v)]
    if sinks is not None:
        leaves.append(sinks.detach().to(F64).requires_grad_())
    out, lse = masked_attention(
        *leaves[:3], tokens, scale=scale, softcap=softcap,
        sinks=leaves[3] if sinks is not None else None,
    )  # fmt: skip
    grads = torch.autograd.grad(out, leaves, dout.to(F64))
    return out.detach(), lse.detach(), grads
