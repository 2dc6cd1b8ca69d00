"""Keys a row cannot see: masked and future keys must not change any output or gradient.

Note [Hidden keys cannot poison rows]
    A kernel multiplies the probabilities by the values (``P @ V``), and in backward the score
    gradients by keys and queries (``dS @ K``, ``dS^T @ Q``), over whole tiles of rows and keys.
    A key hidden from a row has probability 0 there, and ``0 * NaN`` is NaN, ``0 * inf`` too: a
    NaN or infinite value at position ``t`` turned every row of its call NaN, the rows before
    ``t`` of a causal call and every row of a call whose padding mask hides ``t`` (torch's SDPA
    does the same). An additive ``-inf`` mask on a NaN score stays NaN as well. Two fixes, each
    exact:

    * Keys hidden by ``key_padding_mask`` are hidden from every row: their keys and values are
      zeroed where the public functions hand them to the engine (:func:`hide_masked_keys` in
      ``attention``, ``dilated_attention`` and the ring functions, before any kernel, on every
      device and path). No row reads them, so no output changes, and their gradients are zero
      either way (``masked_fill``'s backward gives zero there). ``dilated_attention`` zeroes a
      call's new keys before its cache takes them: the cache holds them zeroed, and a decoded
      token copies no more than itself (zeroing in ``run_attention`` would copy the whole
      cache per token and layer).
    * Keys hidden by causality are hidden from some rows only. A CPU call with a mask (causal
      or by key) whose output or gradients come out with a NaN or inf (:func:`poisoned`: one
      pass over the results, which are exact when finite; on CUDA that check would cost a host
      synchronization per call, so there the fast path stands) is rerun on the exact path of
      the plain-PyTorch kernel (``reference.py``): probabilities and score gradients exactly 0
      on hidden pairs, and each non-finite input element multiplied only on the pairs that see
      it (:func:`contract_keys`, :func:`contract_queries`). A visible NaN still propagates, with
      a plain product's semantics. Every CPU backend reruns such calls there
      (``backends/base.py``); finite calls, the common case, pay one ``aminmax`` per result.

    CUDA kernels (torch's, cuDNN, FlashAttention, xFormers, FlexAttention, our Triton kernels)
    keep ``0 * NaN`` for the hidden keys of the tiles they compute, and so does the double
    backward's differentiable recompute on any device (``higher_order.py``): a NaN value at
    ``t`` reaches earlier rows of its own causal call, as many as the kernel's tile holds
    (measured on an H100: all of them with torch's flash kernel and the math kernel, those of
    t's 128-row tile with cuDNN, FlexAttention and our Triton kernels, those of its 64-row tile
    with the memory-efficient kernel), and the gradients of the keys those rows see;
    block-sparse calls on FlexAttention also the other rows of the 128-row tiles they compute
    with t's; a run-time block mask on a dense kernel (``block_sparse/rows.py``, whose calls
    hide the unkept blocks by key mask, an additive ``-inf`` on a NaN score staying NaN) every
    row of t's heads; decoding one token without gradients on CUDA, one call with a per-head key
    mask (``decode.py``), later tokens of t's head while the cache holds t. README "Known limits"
    says so and ``tests/ops/test_hidden_keys.py`` pins those bounds.

Shape legend: B batch, Q query rows of a chunk, K key rows, Hkv key/value heads, G query heads
per key/value head, D head dim. ``pairs`` is (B, Hkv, G, Q, K); ``ignore`` broadcasts to it
(``True`` = the row cannot see the key).
"""

from __future__ import annotations

import math

import torch

__all__ = ["contract_keys", "contract_queries", "hide_masked_keys", "poisoned"]

#: Elements of one correction term (a (B, Hkv, G, Q, n, D) product over ``n`` non-finite rows).
_TERM_ELEMENTS = 1 << 22


def hide_masked_keys(
    k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``k`` and ``v`` (B, Nk, Hkv, D) with the keys ``key_padding_mask`` (B, Nk) hides set to
    0; unchanged without a mask (Note [Hidden keys cannot poison rows])."""
    if key_padding_mask is None:
        return k, v
    hidden = key_padding_mask[:, :, None, None]
    return k.masked_fill(hidden, 0), v.masked_fill(hidden, 0)


def poisoned(*results: torch.Tensor) -> bool:
    """Whether CPU ``results`` (a call's output or gradients, any shapes) hold a NaN or inf, so
    that a hidden key may have reached them: the call then reruns on the exact path. Finite
    results are the exact ones (a hidden product that went wrong is NaN or inf), so the check
    reads results, not inputs: one pass of ``aminmax`` each, no allocation. CUDA results are
    never checked (a host synchronization per call)."""
    for x in results:
        if not x.is_cpu or x.numel() == 0:
            continue
        low, high = torch.aminmax(x.detach())
        if not (math.isfinite(float(low)) and math.isfinite(float(high))):
            return True
    return False


def _nonfinite(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` with its non-finite elements 0, and the indices along ``dim`` of the slices that
    hold any (a host synchronization: CPU only)."""
    finite = torch.isfinite(x)
    bad = (~finite).transpose(0, dim).flatten(1).any(dim=1)
    return x.masked_fill(~finite, 0), bad.nonzero().flatten()


def _chunks(index: torch.Tensor, per_item: int) -> list[torch.Tensor]:
    size = max(1, _TERM_ELEMENTS // max(1, per_item))
    return list(index.split(size))


def contract_keys(pairs: torch.Tensor, x: torch.Tensor, ignore: torch.Tensor) -> torch.Tensor:
    """``einsum("bhgqk,bkhd->bqhgd", pairs, x)`` with no product on a hidden pair.

    Args:
        pairs: (B, Hkv, G, Q, K), exactly 0 where ``ignore``.
        x: (B, K, Hkv, D), per key (values, keys).
        ignore: broadcastable to ``pairs``.

    Returns:
        (B, Q, Hkv, G, D): the finite entries' einsum, plus each non-finite entry times the
        pairs that see it.
    """
    clean, bad = _nonfinite(x, 1)
    out = torch.einsum("bhgqk,bkhd->bqhgd", pairs, clean)
    if bad.numel() == 0:
        return out
    hidden = ignore.expand(pairs.shape)
    for keys in _chunks(bad, pairs[..., :1].numel() * x.shape[-1]):
        part = x[:, keys].masked_fill(torch.isfinite(x[:, keys]), 0)  # (B, n, Hkv, D)
        term = pairs[..., keys].unsqueeze(-1) * part.permute(0, 2, 1, 3)[:, :, None, None]
        term = term.masked_fill(hidden[..., keys].unsqueeze(-1), 0).sum(dim=-2)
        out = out + term.permute(0, 3, 1, 2, 4)
    return out


def contract_queries(pairs: torch.Tensor, x: torch.Tensor, ignore: torch.Tensor) -> torch.Tensor:
    """``einsum("bhgqk,bqhgd->bkhd", pairs, x)`` with no product on a hidden pair.

    Args:
        pairs: (B, Hkv, G, Q, K), exactly 0 where ``ignore``.
        x: (B, Q, Hkv, G, D), per query row (queries, output gradients).
        ignore: broadcastable to ``pairs``.

    Returns:
        (B, K, Hkv, D), as :func:`contract_keys` does over keys.
    """
    clean, bad = _nonfinite(x, 1)
    out = torch.einsum("bhgqk,bqhgd->bkhd", pairs, clean)
    if bad.numel() == 0:
        return out
    hidden = ignore.expand(pairs.shape)
    for rows in _chunks(bad, pairs[..., :1, :].numel() * x.shape[-1]):
        part = x[:, rows].masked_fill(torch.isfinite(x[:, rows]), 0)  # (B, n, Hkv, G, D)
        term = pairs[..., rows, :].unsqueeze(-1) * part.permute(0, 2, 3, 1, 4).unsqueeze(-2)
        term = term.masked_fill(hidden[..., rows, :].unsqueeze(-1), 0).sum(dim=(2, 3))
        out = out + term.permute(0, 2, 1, 3)
    return out
