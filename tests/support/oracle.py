"""Dense float64 reference for dilated and plain attention.

This module shares no code with ``dilated_attention``: it never imports it. It builds an explicit
integer multiplicity matrix ``M[b, j, p, t]`` (how many branches let query ``p`` of head ``j``
see key ``t``) with plain Python loops, then runs one masked softmax where every key is weighted
by its multiplicity. That is the "one softmax over the multiset union of the branches' keys"
reading of LongNet Eq. 10, which equals mixing the branch outputs by their softmax denominators.

Everything is computed in float64 unless ``compute_dtype`` asks for a low-precision replica (used
only as the "same-dtype reference" that measures how much error a naive kernel makes).
Gradients come from autograd through these functions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "branch_positions",
    "dilated_multiplicity",
    "masked_attention",
    "oracle_attention",
    "oracle_dilated_attention",
]


def branch_positions(
    seq_len: int, segment_length: int, dilation_rate: int, head: int
) -> list[list[int]]:
    """Position sets of one branch for one head: one list per segment (possibly empty)."""
    offset = head % dilation_rate
    sets: list[list[int]] = []
    for t0 in range(0, seq_len, segment_length):
        length = min(segment_length, seq_len - t0)
        sets.append([t0 + i for i in range(offset, length, dilation_rate)])
    return sets


def dilated_multiplicity(
    seq_len: int,
    num_heads: int,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    *,
    is_causal: bool = False,
) -> Tensor:
    """Integer ``M[j, p, t]``: in how many branches head ``j``'s query ``p`` sees key ``t``."""
    if len(segment_lengths) != len(dilation_rates):
        raise ValueError("segment_lengths and dilation_rates must have the same length")
    M = torch.zeros(num_heads, seq_len, seq_len, dtype=torch.int64)
    for w, r in zip(segment_lengths, dilation_rates, strict=True):
        for j in range(num_heads):
            for positions in branch_positions(seq_len, w, r, j):
                idx = torch.tensor(positions, dtype=torch.int64)
                # every (query, key) pair inside this branch's position set, once
                M[j, idx[:, None], idx[None, :]] += 1
    if is_causal:
        M = torch.tril(M)  # key t visible to query p only when t <= p
    return M


def masked_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    multiplicity: Tensor,
    *,
    scale: float | None = None,
    key_padding_mask: Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Softmax attention where key ``t`` of row ``(j, p)`` carries weight ``multiplicity[j, p, t]``.

    ``q`` is ``(B, Nq, H, D)``, ``k``/``v`` are ``(B, Nk, H_kv, D)``; ``multiplicity`` is
    ``(H, Nq, Nk)`` or ``(B, H, Nq, Nk)``. Returns ``out (B, Nq, H, D)`` and ``lse (B, H, Nq)``
    in ``compute_dtype``, with ``lse = log(sum_t M * exp(score))``; rows with no weight give
    ``out = 0`` and ``lse = -inf``. ``softcap``: each scaled score ``s`` becomes
    ``softcap * tanh(s / softcap)``. ``sinks`` (H,): per head one more term ``exp(sinks[j])``
    in every row's denominator (a key of weight 1 and value 0), so ``lse`` includes it and an
    empty row has ``lse = sinks[j]``.
    """
    B, _, H, D = q.shape
    H_kv = k.shape[2]
    if H % H_kv != 0:
        raise ValueError(f"num query heads {H} not a multiple of kv heads {H_kv}")
    if scale is None:
        scale = D**-0.5
    q = q.to(compute_dtype)
    k = k.to(compute_dtype).repeat_interleave(H // H_kv, dim=2)
    v = v.to(compute_dtype).repeat_interleave(H // H_kv, dim=2)
    weight = multiplicity.to(device=q.device)
    if weight.dim() == 3:
        weight = weight.unsqueeze(0).expand(B, -1, -1, -1)
    if key_padding_mask is not None:
        keep = ~key_padding_mask.to(device=q.device, dtype=torch.bool)
        weight = weight * keep[:, None, None, :]
    weight = weight.to(compute_dtype)
    active = weight > 0

    # Non-finite inputs: every product is formed only on the (row, key) pairs that see each
    # other, so a NaN or inf a row cannot see never reaches it (0 * NaN is NaN), in the output
    # and in every gradient (``where`` on both factors: no NaN times a zero gradient either).
    pairwise = not all(bool(torch.isfinite(x).all()) for x in (q, k, v))
    if pairwise:
        scores = (_pairs(q, active, 3) * _pairs(k, active, 2)).sum(-1) * scale
    else:
        scores = torch.einsum("bphd,bthd->bhpt", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    masked_scores = scores.masked_fill(~active, float("-inf"))
    row_max = masked_scores.amax(dim=-1, keepdim=True).detach()
    sink = None
    if sinks is not None:
        sink = sinks.to(compute_dtype).view(1, -1, 1, 1).expand(B, H, scores.shape[2], 1)
        row_max = torch.maximum(row_max, sink.detach())
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    unnormalised = weight * torch.exp(masked_scores - row_max)
    denom = unnormalised.sum(dim=-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink - row_max)
    empty = denom == 0
    probs = unnormalised / torch.where(empty, torch.ones_like(denom), denom)
    if pairwise:
        probs = torch.where(active, probs, torch.zeros_like(probs))
        out = (probs.unsqueeze(-1) * _pairs(v, active, 2)).sum(-2).transpose(1, 2)
    else:
        out = torch.einsum("bhpt,bthd->bphd", probs, v)
    lse = torch.log(torch.where(empty, torch.ones_like(denom), denom)) + row_max
    lse = lse.masked_fill(empty, float("-inf")).squeeze(-1)
    return out, lse


def _pairs(x: Tensor, active: Tensor, dim: int) -> Tensor:
    """``x`` (B, N, H, D) broadcast to (B, H, Nq, Nk, D) along ``dim`` (3: per query row, 2: per
    key), 0 on the pairs ``active`` (B, H, Nq, Nk) leaves out."""
    x = x.transpose(1, 2).unsqueeze(dim)
    return torch.where(active.unsqueeze(-1), x, torch.zeros_like(x))


def oracle_dilated_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    *,
    is_causal: bool = False,
    scale: float | None = None,
    key_padding_mask: Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Exact LongNet dilated attention (all heads in all branches, Eq. 10 mixing), dense, slow;
    ``softcap`` and ``sinks`` as in :func:`masked_attention` (a sink counts once per row)."""
    if q.shape[1] != k.shape[1]:
        raise ValueError("dilated attention is self-attention: q and k need the same seq_len")
    M = dilated_multiplicity(
        q.shape[1], q.shape[2], segment_lengths, dilation_rates, is_causal=is_causal
    )
    return masked_attention(
        q,
        k,
        v,
        M,
        scale=scale,
        key_padding_mask=key_padding_mask,
        compute_dtype=compute_dtype,
        softcap=softcap,
        sinks=sinks,
    )


def oracle_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    key_padding_mask: Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
    window_size: tuple[int, int] | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Plain softmax attention. Causal is end-aligned, the library's convention: the query rows
    are the last ``Nq`` of the ``Nk`` positions, so query ``p`` sees key ``t <= p + Nk - Nq``
    (top-left, ``t <= p``, when ``Nq == Nk``). ``window_size=(left, right)``: query row ``i``,
    at position ``p = i + Nk - Nq``, sees keys ``p - left <= t <= p + right`` (``-1``:
    unbounded), checked pair by pair. ``softcap``, ``sinks``: as in :func:`masked_attention`."""
    Nq, H, Nk = q.shape[1], q.shape[2], k.shape[1]
    M = torch.ones(H, Nq, Nk, dtype=torch.int64)
    if is_causal:
        M = torch.tril(M, diagonal=Nk - Nq)
    if window_size is not None:
        left, right = window_size
        for i in range(Nq):
            p = i + Nk - Nq
            for t in range(Nk):
                if (left >= 0 and t < p - left) or (right >= 0 and t > p + right):
                    M[:, i, t] = 0
    return masked_attention(
        q,
        k,
        v,
        M,
        scale=scale,
        key_padding_mask=key_padding_mask,
        compute_dtype=compute_dtype,
        softcap=softcap,
        sinks=sinks,
    )
