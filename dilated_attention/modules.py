"""``nn.Module`` wrappers: :class:`DilatedAttention` and :class:`MultiheadDilatedAttention`.

Shape legend: B batch, N seq_len, E embed_dim, H heads, Hkv key/value heads, D head dim = E // H.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import nn

from . import _validation as V
from .backends.registry import get_backend
from .config import DilatedConfig, MultiheadDilatedConfig
from .functional import dilated_attention

__all__ = ["DilatedAttention", "MultiheadDilatedAttention"]


class DilatedAttention(nn.Module):
    """Dilated attention over (B, N, H, D) tensors; see :func:`dilated_attention`.

    Args:
        segment_lengths: w per branch.
        dilation_rates: r per branch.
        scale: softmax scale; ``None`` means ``D ** -0.5``.
        dropout: attention-probability dropout, applied in training mode only.
        backend: kernel name, or ``None`` to choose per call.
    """

    def __init__(
        self,
        segment_lengths: list[int] | tuple[int, ...],
        dilation_rates: list[int] | tuple[int, ...],
        *,
        scale: float | None = None,
        dropout: float = 0.0,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        self.config = DilatedConfig(
            segment_lengths=segment_lengths, dilation_rates=dilation_rates, scale=scale,
            dropout=dropout, backend=backend,
        )  # fmt: skip
        if backend is not None:
            get_backend(backend)
        self.segment_lengths = self.config.segment_lengths
        self.dilation_rates = self.config.dilation_rates
        self.scale, self.dropout, self.backend = scale, self.config.dropout, backend

    @classmethod
    def from_config(cls, config: DilatedConfig) -> DilatedAttention:
        """Build from a :class:`~dilated_attention.config.DilatedConfig`."""
        return cls(**config.kwargs())

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        is_causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Args: query (B, N, H, D); key, value (B, N, Hkv, D); key_padding_mask (B, N) bool.

        Returns:
            (B, N, H, D).
        """
        out = dilated_attention(
            query, key, value, self.segment_lengths, self.dilation_rates,
            is_causal=is_causal, scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0,
            key_padding_mask=key_padding_mask, backend=self.backend,
        )  # fmt: skip
        assert isinstance(out, torch.Tensor)  # return_lse=False: for the type checker
        return out

    def extra_repr(self) -> str:
        return (
            f"segment_lengths={list(self.segment_lengths)}, "
            f"dilation_rates={list(self.dilation_rates)}, dropout={self.dropout}, "
            f"backend={self.backend!r}"
        )


class MultiheadDilatedAttention(nn.Module):
    """Batch-first multihead dilated attention, a drop-in for ``nn.MultiheadAttention``.

    Projections q/k/v, dilated attention, MAGNETO's sub-LayerNorm (``layer_norm=True``), then the
    output projection. Initialisation follows MAGNETO: Xavier-normal weights, with gain
    ``gamma_init`` on the value and output projections; zero biases.

    Args:
        embed_dim: E.
        num_heads: H; E must be divisible by H.
        segment_lengths: w per branch.
        dilation_rates: r per branch.
        num_kv_heads: Hkv for grouped-query attention (``None`` = H).
        dropout: attention-probability dropout (training mode only).
        bias: biases on the projections.
        layer_norm: MAGNETO sub-LayerNorm before the output projection.
        layer_norm_eps: its epsilon.
        gamma_init: MAGNETO gain on the value and output projections.
        backend: kernel name, or ``None`` to choose per call.
        device, dtype: factory kwargs for the parameters.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        segment_lengths: list[int] | tuple[int, ...],
        dilation_rates: list[int] | tuple[int, ...],
        *,
        num_kv_heads: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        layer_norm: bool = True,
        layer_norm_eps: float = 1e-5,
        gamma_init: float = 1.0,
        backend: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config = MultiheadDilatedConfig(
            embed_dim=embed_dim, num_heads=num_heads, segment_lengths=segment_lengths,
            dilation_rates=dilation_rates, num_kv_heads=num_kv_heads, dropout=dropout, bias=bias,
            layer_norm=layer_norm, layer_norm_eps=layer_norm_eps, gamma_init=gamma_init,
            backend=backend,
        )  # fmt: skip
        self.num_kv_heads = V.check_heads(embed_dim, num_heads, num_kv_heads)
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.gamma_init = gamma_init
        self.attention = DilatedAttention(
            segment_lengths, dilation_rates, dropout=dropout, backend=backend
        )
        factory = {"device": device, "dtype": dtype}
        kv_dim = self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.norm = nn.LayerNorm(embed_dim, eps=layer_norm_eps, **factory) if layer_norm else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.reset_parameters()

    @classmethod
    def from_config(
        cls,
        config: MultiheadDilatedConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> MultiheadDilatedAttention:
        """Build from a :class:`~dilated_attention.config.MultiheadDilatedConfig`."""
        return cls(**config.kwargs(), device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        """MAGNETO initialisation (Xavier normal; gain ``gamma_init`` on v and out)."""
        nn.init.xavier_normal_(self.q_proj.weight)
        nn.init.xavier_normal_(self.k_proj.weight)
        nn.init.xavier_normal_(self.v_proj.weight, gain=self.gamma_init)
        nn.init.xavier_normal_(self.out_proj.weight, gain=self.gamma_init)
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            if proj.bias is not None:
                nn.init.zeros_(proj.bias)
        if self.norm is not None:
            self.norm.reset_parameters()

    def _check_input(self, name: str, x: object) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a tensor (batch, seq_len, embed_dim), got {type(x)}")
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(
                f"{name} must have shape (batch, seq_len, embed_dim={self.embed_dim}) "
                f"(batch first), got {name}.shape={tuple(x.shape)}"
            )
        return x

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        *,
        is_causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, None]:
        """Args: query (B, N, E); key, value (B, N, E) or None (self-attention: key = value =
        query); key_padding_mask (B, N) bool, ``True`` = ignore.

        Returns:
            ``(out, None)`` with ``out`` (B, N, E); attention weights are never materialised.
        """
        if need_weights:
            raise ValueError(
                "need_weights=True is not supported: dilated attention never materialises the "
                "(N x N) weights; call with need_weights=False"
            )
        query = self._check_input("query", query)
        key = query if key is None else self._check_input("key", key)
        value = key if value is None else self._check_input("value", value)
        if key.shape[:2] != query.shape[:2] or value.shape[:2] != query.shape[:2]:
            raise ValueError(
                f"key and value must have the batch size and seq_len of query (dilated attention "
                f"segments one sequence), got query.shape={tuple(query.shape)}, "
                f"key.shape={tuple(key.shape)}, value.shape={tuple(value.shape)}"
            )
        V.check_key_padding_mask(key_padding_mask, query.shape[0], query.shape[1], query.device)
        q = rearrange(self.q_proj(query), "b n (h d) -> b n h d", h=self.num_heads)
        k = rearrange(self.k_proj(key), "b n (h d) -> b n h d", h=self.num_kv_heads)
        v = rearrange(self.v_proj(value), "b n (h d) -> b n h d", h=self.num_kv_heads)
        x = self.attention(q, k, v, is_causal=is_causal, key_padding_mask=key_padding_mask)
        x = rearrange(x, "b n h d -> b n (h d)")
        if self.norm is not None:
            x = self.norm(x)
        return self.out_proj(x), None

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
        )
