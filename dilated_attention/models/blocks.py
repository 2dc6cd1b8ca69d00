"""The LongNet decoder block: :class:`LongNetAttention` (causal self-attention with rotary
positions) and :class:`LongNetBlock` (one MAGNETO sub-LN block around it).

Shape legend: B batch, N seq_len (this rank's shard under ring attention), E embed_dim.

Note [Rotary inside a factory-built attention layer]
    Attention comes from :func:`dilated_attention.create_multihead_dilated_attention`, so the
    same model is local (``kind="dilated"``) or ring-sharded (``kind="ring"``, or ``"auto"``
    under ``torchrun``). Rotary positions belong between the layer's projections and its inner
    (B, N, H, D) attention module; the layer applies them itself once asked
    (``use_rotary``), at the positions its forward is given. :class:`LongNetAttention` keeps the
    layer as ``self.mha`` (parameters ``mha.q_proj``, ``mha.k_proj``, ``mha.v_proj``,
    ``mha.norm``, ``mha.out_proj``; rotary adds none) and calls it with the tokens' global
    positions. Any kind whose multihead layer has ``use_rotary`` and takes ``positions`` works.

Note [Block structure]
    MAGNETO (Wang et al. 2022) sub-LN blocks, pre-LN at the block input and a second LayerNorm
    inside each sublayer before its output projection::

        x = x + drop(attn_out_proj(subLN(attention(rotary(qkv_proj(LN(x)))))))
        x = x + drop(fc2(subLN(gelu(fc1(LN(x))))))

    then a final LayerNorm and the LM head (tied to the token embedding by default).
    Initialisation follows MAGNETO: Xavier normal, gain ``sqrt(log(2 * num_layers))`` on the value,
    attention output and both FFN projections.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..core.decoding.caches import Cache
from ..factory import create_multihead_dilated_attention
from .config import LongNetConfig

__all__ = ["LongNetAttention", "LongNetBlock"]


class LongNetAttention(nn.Module):
    """Causal self-attention with rotary positions: a factory-built multihead layer, global
    (the dilated schedule, ``config.kind``) or local (a sliding window, kind ``"local"``; Note
    [Hybrid stacks] in ``config.py``).

    See Note [Rotary inside a factory-built attention layer].

    Args:
        config: the model configuration.
        gamma_init: MAGNETO gain on the value and output projections.
        is_global: a global layer; else a local one (``config.local_window``).

    Raises:
        TypeError: the factory kind's layer cannot apply rotary positions (no ``use_rotary``).
    """

    def __init__(
        self, config: LongNetConfig, *, gamma_init: float = 1.0, is_global: bool = True
    ) -> None:
        super().__init__()
        common: dict[str, Any] = dict(
            embed_dim=config.embed_dim, num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads, dropout=config.dropout, layer_norm=True,
            layer_norm_eps=config.layer_norm_eps, gamma_init=gamma_init,
            backend=config.backend or "auto",
        )  # fmt: skip
        # Soft-capping and sinks are passed only when asked: kinds without them (the ring
        # layers, a registered kind) keep their constructors.
        common.update({"softcap": config.softcap} if config.softcap is not None else {})
        common.update({"sinks": True} if config.sinks else {})
        if is_global and config.sparse is not None:  # kind "moba" or "nsa"
            mha = create_multihead_dilated_attention(
                kind=config.kind, config=config.sparse, **common
            )
        elif is_global:
            mha = create_multihead_dilated_attention(
                kind=config.kind, segment_lengths=list(config.segment_lengths),
                dilation_rates=list(config.dilation_rates), **common,
            )  # fmt: skip
        else:
            mha = create_multihead_dilated_attention(
                kind="local", window_size=config.local_window_size, **common
            )
        if not callable(getattr(mha, "use_rotary", None)):
            raise TypeError(
                f"kind {config.kind!r} built {type(mha).__name__}, which has no use_rotary(); "
                f"LongNetLM needs a multihead layer that applies rotary positions between its "
                f"projections and attention (subclass the library's multihead layers)"
            )
        self.mha = mha.use_rotary(config.rotary_base)
        self.num_heads, self.num_kv_heads = config.num_heads, int(self.mha.num_kv_heads)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None,
        cache: Cache | None = None,
        documents: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """x (B, N, E), positions (N,) global int positions (None with packed ``documents``:
        the layer's own, 0 at each document's start) -> (B, N, E); ``cache``: this layer's
        decoding cache (x then holds the new tokens, or with ``documents`` a packed prompt)."""
        if documents is not None:
            return self.mha(
                x, is_causal=True, positions=positions, cu_seqlens=documents, cache=cache
            )[0]
        if cache is None:
            return self.mha(x, is_causal=True, positions=positions)[0]
        return self.mha(x, is_causal=True, cache=cache)[0]  # positions: the cache's next ones


class LongNetBlock(nn.Module):
    """One MAGNETO sub-LN decoder block (see Note [Block structure]).

    Args:
        config: the model configuration.
        gamma_init: MAGNETO gain.
        is_global: a global (dilated) attention layer; else a local one.
    """

    def __init__(
        self, config: LongNetConfig, *, gamma_init: float = 1.0, is_global: bool = True
    ) -> None:
        super().__init__()
        E, eps = config.embed_dim, config.layer_norm_eps
        self.attn_norm = nn.LayerNorm(E, eps=eps)
        self.attn = LongNetAttention(config, gamma_init=gamma_init, is_global=is_global)
        self.ffn_norm = nn.LayerNorm(E, eps=eps)
        self.fc1 = nn.Linear(E, config.ffn_dim)
        self.ffn_sub_norm = nn.LayerNorm(config.ffn_dim, eps=eps)
        self.fc2 = nn.Linear(config.ffn_dim, E)
        self.dropout = nn.Dropout(config.dropout)
        for fc in (self.fc1, self.fc2):
            nn.init.xavier_normal_(fc.weight, gain=gamma_init)
            nn.init.zeros_(fc.bias)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None,
        cache: Cache | None = None,
        documents: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """x (B, N, E), positions (N,) (None with packed ``documents``) -> (B, N, E);
        ``cache``: the attention's decoding cache."""
        x = x + self.dropout(self.attn(self.attn_norm(x), positions, cache, documents))
        h = self.dropout(F.gelu(self.fc1(self.ffn_norm(x))))
        return x + self.dropout(self.fc2(self.ffn_sub_norm(h)))
