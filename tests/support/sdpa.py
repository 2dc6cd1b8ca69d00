"""PyTorch's ``F.scaled_dot_product_attention`` in the library's (B, N, H, D) layout: the second
reference (beside the oracle) that dense results are compared with."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def sdpa_bnhd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    is_causal: bool,
    scale: float | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """SDPA on (B, Nq, H, D) q and (B, Nk, Hkv, D) k, v (GQA via ``enable_gqa``); ``mask``: a
    (B, Nk) key padding mask, True = ignore.

    With a mask the top-left causal mask is folded into ``attn_mask``: torch >= 2.14 refuses
    ``attn_mask`` together with ``is_causal=True``.
    """
    attn_mask = None
    if mask is not None:
        attn_mask = ~mask[:, None, None, :]
        if is_causal:
            n_q, n_k = q.shape[1], k.shape[1]
            attn_mask = attn_mask & torch.ones(n_q, n_k, dtype=torch.bool).tril()
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=attn_mask,
        is_causal=is_causal and mask is None,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)
