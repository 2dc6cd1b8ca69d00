"""Readable eager attention with log-sum-exp, in plain PyTorch: the last-resort kernel.

It runs on any device and dtype (float64 included) and computes in float32 or wider. Query rows are
processed in chunks so the score tile stays bounded: memory grows with ``chunk x Nk``, never
``Nq x Nk``.

Shape legend: B batch, Nq query rows, Nk key rows, H query heads, Hkv key/value heads (G = H // Hkv
query heads share one), D head dim. ``key_mask`` is (B, Hm, Nk) bool with Hm in {1, H}; ``True``
marks a key to ignore. Causal masking is top-left aligned: query ``i`` sees keys ``j <= i``.

Note [Backward with external statistics]
    With P = exp(S - lse) (S the scaled, masked scores) and O the output the caller holds:
    dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO * O)), dQ = scale dS K, dK = scale dS^T Q.
    When ``lse`` and ``O`` are the *merged* statistics of several partial attentions (dilated
    branches, ring steps), P is this part's share of the merged softmax and the result is the exact
    gradient of the merged output with respect to this part's inputs (FlashAttention-2, Alg. 2).
"""

from __future__ import annotations

import torch

from .contract import Window
from .hidden import contract_keys, contract_queries, poisoned

_SCORE_ELEMENTS_PER_CHUNK = 1 << 24


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _row_chunks(q: torch.Tensor, num_keys: int) -> list[tuple[int, int]]:
    batch, rows, heads, _ = q.shape
    per_row = max(1, batch * heads * num_keys)
    size = max(1, _SCORE_ELEMENTS_PER_CHUNK // per_row)
    return [(start, min(rows, start + size)) for start in range(0, rows, size)]


def _bias(
    key_mask: torch.Tensor | None,
    is_causal: bool,
    rows: tuple[int, int],
    num_keys: int,
    num_kv_heads: int,
    device: torch.device,
    window: Window | None = None,
    shift: int = 0,
) -> torch.Tensor | None:
    """Boolean 'ignore' mask broadcastable to scores of shape (B, Hkv, G, rows, Nk)."""
    ignore = None
    if key_mask is not None:
        b, hm, nk = key_mask.shape
        heads = num_kv_heads if hm > 1 else 1
        ignore = key_mask.view(b, heads, hm // heads, 1, nk)
    if is_causal:
        q_pos = torch.arange(rows[0], rows[1], device=device).view(-1, 1)
        future = torch.arange(num_keys, device=device).view(1, -1) > q_pos
        ignore = future if ignore is None else ignore | future
    if window is not None:
        q_rows = torch.arange(rows[0], rows[1], device=device).view(-1, 1)
        key_rows = torch.arange(num_keys, device=device).view(1, -1)
        outside = window.hides(q_rows, key_rows, shift)
        ignore = outside if ignore is None else ignore | outside
    return ignore


def _scores(
    qc: torch.Tensor, kc: torch.Tensor, scale: float, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scaled scores (B, Hkv, G, rows, Nk) of (B, rows, Hkv, G, D) queries against (B, Nk,
    Hkv, D) keys, soft-capped when asked (Note [Scores a kernel call transforms] in
    ``contract.py``), and ``tanh(s / c)`` for the backward (None without a cap)."""
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qc, kc) * scale
    if softcap is None:
        return scores, None
    capped = torch.tanh(scores / softcap)
    return capped * softcap, capped


def _dropout_scale(
    shape: torch.Size,
    p: float,
    generator: torch.Generator | None,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Inverted-dropout factors: 0 for dropped entries, 1 / (1 - p) for kept ones."""
    keep = torch.rand(shape, generator=generator, device=device) >= p
    return keep.to(dtype) / (1.0 - p)


def _generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def reference_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    is_causal: bool = False,
    key_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    softcap: float | None = None,
    window: Window | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with its log-sum-exp.

    Args:
        q: (B, Nq, H, D).
        k: (B, Nk, Hkv, D).
        v: (B, Nk, Hkv, D).
        scale: softmax scale.
        is_causal: top-left aligned causal mask.
        key_mask: (B, Hm, Nk) bool, ``True`` = ignore the key.
        dropout_p: dropout on the attention probabilities (the LSE is that of the undropped
        softmax).
        dropout_seed: seed of the dropout mask; the backward regenerates the mask from it.
        softcap: every scaled score ``s`` becomes ``softcap * tanh(s / softcap)``, or None.
        window: the key rows each query row sees (``contract.Window``), or None.

    Returns:
        ``out`` (B, Nq, H, D) in ``q.dtype`` and ``lse`` (B, H, Nq) in float32 (float64 for float64
        inputs); rows with no visible key give 0 and ``-inf``.
    """
    batch, num_q, heads, dim = q.shape
    num_k, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    cdt = _compute_dtype(q.dtype)
    kc, vc = k.to(cdt), v.to(cdt)
    out = torch.empty(batch, num_q, heads, dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, heads, num_q, dtype=cdt, device=q.device)
    gen = _generator(dropout_seed, q.device) if dropout_p > 0 else None
    for start, stop in _row_chunks(q, num_k):
        qc = q[:, start:stop].to(cdt).view(batch, stop - start, kv_heads, group, dim)
        scores, _ = _scores(qc, kc, scale, softcap)
        ignore = _bias(
            key_mask, is_causal, (start, stop), num_k, kv_heads, q.device, window, num_k - num_q
        )
        if ignore is not None:
            scores = scores.masked_fill(ignore, float("-inf"))
        # Normalized by the sum itself, not by exp(lse): the lse is rounded to the float's
        # spacing at |lse|, which would scale every row by up to 1 + 2**-24 |lse| and leave the
        # output off its convex hull and the backward's delta = rowsum(dout * out) inconsistent
        # with P (at logits 1e4: out off by 3e-4, dq by 9e-3, where torch's kernel gets 1e-4).
        row_max = scores.amax(dim=-1, keepdim=True)  # NaN stays NaN; inf - inf gives NaN
        row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
        weights = torch.exp(scores - row_max)
        total = weights.sum(dim=-1, keepdim=True)
        row_lse = (row_max + torch.log(total)).squeeze(-1)  # log(0) = -inf: no visible key
        probs = weights / torch.where(total == 0, torch.ones_like(total), total)
        if dropout_p > 0:
            probs = probs * _dropout_scale(probs.shape, dropout_p, gen, cdt, q.device)
        o = torch.einsum("bhgqk,bkhd->bqhgd", probs, vc)
        if ignore is not None and poisoned(o):  # Note [Hidden keys cannot poison rows]
            o = contract_keys(probs.masked_fill(ignore, 0), vc, ignore)
        out[:, start:stop] = o.reshape(batch, stop - start, heads, dim).to(q.dtype)
        lse[:, :, start:stop] = row_lse.reshape(batch, heads, stop - start)
    return out, lse


def reference_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    is_causal: bool = False,
    key_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    softcap: float | None = None,
    window: Window | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of attention given the (possibly merged) ``out`` and ``lse``.

    See Note [Backward with external statistics]. Arguments as in :func:`reference_forward`, plus
    ``dout`` and ``out`` (B, Nq, H, D) and ``lse`` (B, H, Nq); rows with ``lse = -inf`` get no
    gradient.

    Returns:
        ``(dq, dk, dv)`` shaped and typed like ``(q, k, v)``.
    """
    batch, num_q, heads, dim = q.shape
    num_k, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    cdt = _compute_dtype(q.dtype)
    kc, vc = k.to(cdt), v.to(cdt)
    dq = torch.empty(batch, num_q, heads, dim, dtype=cdt, device=q.device)
    dk = torch.zeros(batch, num_k, kv_heads, dim, dtype=cdt, device=q.device)
    dv = torch.zeros_like(dk)
    gen = _generator(dropout_seed, q.device) if dropout_p > 0 else None
    for start, stop in _row_chunks(q, num_k):
        rows = stop - start
        qc = q[:, start:stop].to(cdt).view(batch, rows, kv_heads, group, dim)
        doc = dout[:, start:stop].to(cdt).view(batch, rows, kv_heads, group, dim)
        oc = out[:, start:stop].to(cdt).view(batch, rows, kv_heads, group, dim)
        row_lse = lse[:, :, start:stop].to(cdt).reshape(batch, kv_heads, group, rows, 1)
        scores, capped = _scores(qc, kc, scale, softcap)
        ignore = _bias(
            key_mask, is_causal, (start, stop), num_k, kv_heads, q.device, window, num_k - num_q
        )
        if ignore is not None:
            scores = scores.masked_fill(ignore, float("-inf"))
        # Rows with lse = -inf see no key: exp(-inf - 0) = 0 keeps them out of every gradient.
        probs = torch.exp(scores - torch.where(torch.isinf(row_lse), 0.0, row_lse))
        dp = torch.einsum("bqhgd,bkhd->bhgqk", doc, vc)
        if dropout_p > 0:
            keep = _dropout_scale(probs.shape, dropout_p, gen, cdt, q.device)
            probs_kept = probs * keep
            dp = dp * keep
        else:
            probs_kept = probs
        delta = (doc * oc).sum(-1).permute(0, 2, 3, 1).unsqueeze(-1)
        ds = probs * (dp - delta) * scale
        if capped is not None:  # d(c tanh(s / c)) / ds = 1 - tanh(s / c) ** 2
            ds = ds * (1 - capped.square())
        dv_part = torch.einsum("bhgqk,bqhgd->bkhd", probs_kept, doc)
        dq_rows = torch.einsum("bhgqk,bkhd->bqhgd", ds, kc)
        dk_part = torch.einsum("bhgqk,bqhgd->bkhd", ds, qc)
        if ignore is not None and poisoned(dq_rows, dk_part, dv_part):  # Note [Hidden keys ...]
            dv_part = contract_queries(probs_kept.masked_fill(ignore, 0), doc, ignore)
            ds = ds.masked_fill(ignore, 0)
            dq_rows = contract_keys(ds, kc, ignore)
            dk_part = contract_queries(ds, qc, ignore)
        dq[:, start:stop] = dq_rows.reshape(batch, rows, heads, dim)
        dk += dk_part
        dv += dv_part
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
