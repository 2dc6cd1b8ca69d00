"""``nn.Module`` wrappers: :class:`DilatedAttention`, :class:`MultiheadDilatedAttention`,
:class:`BlockSparseAttention` and :class:`BlockSparseMultiheadAttention`.

Shape legend: B batch, N seq_len, E embed_dim, H heads, Hkv key/value heads, D head dim = E // H.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import nn

from . import _validation as V
from .backends.registry import get_backend
from .block_sparse import block_sparse_attention, check_block_size
from .config import DilatedConfig, MultiheadDilatedConfig
from .functional import dilated_attention
from .patterns import Pattern, check_pattern

__all__ = [
    "BlockSparseAttention",
    "BlockSparseMultiheadAttention",
    "DilatedAttention",
    "MultiheadDilatedAttention",
]


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


class _MultiheadProjections(nn.Module):
    """Batch-first multihead layer around an inner (B, N, H, D) attention module.

    Projections q/k/v, ``self.attention`` (set by the subclass), MAGNETO's sub-LayerNorm
    (``layer_norm=True``), then the output projection. Initialisation follows MAGNETO:
    Xavier-normal weights, with gain ``gamma_init`` on the value and output projections; zero
    biases. Subclasses name what the layer is in ``_what`` (used in error messages).
    """

    _what = "attention"
    attention: nn.Module

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None,
        bias: bool,
        layer_norm: bool,
        layer_norm_eps: float,
        gamma_init: float,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        self.num_kv_heads = V.check_heads(embed_dim, num_heads, num_kv_heads)
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.gamma_init = gamma_init
        factory = {"device": device, "dtype": dtype}
        kv_dim = self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.norm = nn.LayerNorm(embed_dim, eps=layer_norm_eps, **factory) if layer_norm else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.reset_parameters()

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

    def _check_key_padding_mask(self, mask: object, query: torch.Tensor) -> None:
        """Check the (B, N) key padding mask before any projection is computed."""
        V.check_key_padding_mask(mask, query.shape[0], query.shape[1], query.device)

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
                f"need_weights=True is not supported: {self._what} never materialises the "
                "(N x N) weights; call with need_weights=False"
            )
        query = self._check_input("query", query)
        key = query if key is None else self._check_input("key", key)
        value = key if value is None else self._check_input("value", value)
        if key.shape[:2] != query.shape[:2] or value.shape[:2] != query.shape[:2]:
            raise ValueError(
                f"key and value must have the batch size and seq_len of query ({self._what} "
                f"works within one sequence), got query.shape={tuple(query.shape)}, "
                f"key.shape={tuple(key.shape)}, value.shape={tuple(value.shape)}"
            )
        self._check_key_padding_mask(key_padding_mask, query)
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


class MultiheadDilatedAttention(_MultiheadProjections):
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

    _what = "dilated attention"

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
        config = MultiheadDilatedConfig(
            embed_dim=embed_dim, num_heads=num_heads, segment_lengths=segment_lengths,
            dilation_rates=dilation_rates, num_kv_heads=num_kv_heads, dropout=dropout, bias=bias,
            layer_norm=layer_norm, layer_norm_eps=layer_norm_eps, gamma_init=gamma_init,
            backend=backend,
        )  # fmt: skip
        super().__init__(
            embed_dim, num_heads, num_kv_heads=num_kv_heads, bias=bias, layer_norm=layer_norm,
            layer_norm_eps=layer_norm_eps, gamma_init=gamma_init, device=device, dtype=dtype,
        )  # fmt: skip
        self.config = config
        self.attention = DilatedAttention(
            segment_lengths, dilation_rates, dropout=dropout, backend=backend
        )

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


def _no_key_padding_mask(key_padding_mask: torch.Tensor | None) -> None:
    if key_padding_mask is not None:
        raise ValueError(
            "key_padding_mask is not supported by block-sparse attention; pass None (leave the "
            "padded key blocks out of the pattern, e.g. pattern & patterns.Custom(mask))"
        )


class BlockSparseAttention(nn.Module):
    """Block-sparse attention over (B, N, H, D) tensors; see :func:`block_sparse_attention`.

    Args:
        pattern: a :mod:`dilated_attention.patterns` pattern.
        block_size: tokens per block (the last block may be shorter).
        scale: softmax scale; ``None`` means ``D ** -0.5``.
        backend: ``None`` (FlexAttention on CUDA where it runs, else the registry's choice),
            ``"flex"``, or a kernel name for the fallback.

    Raises:
        TypeError: ``pattern`` is not a Pattern.
        ValueError: ``block_size < 1``, an unknown backend.
    """

    def __init__(
        self,
        pattern: Pattern,
        *,
        block_size: int = 128,
        scale: float | None = None,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        self.pattern = check_pattern(pattern)
        self.block_size = check_block_size(block_size)
        self.scale = V.check_scale(scale)
        if backend is not None:
            get_backend(backend)
        self.backend = backend

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        is_causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Args: query (B, Nq, H, D); key, value (B, Nk, Hkv, D); ``key_padding_mask`` must be
        None (it exists for the multihead layer's call signature).

        Returns:
            (B, Nq, H, D).
        """
        _no_key_padding_mask(key_padding_mask)
        out = block_sparse_attention(
            query, key, value, self.pattern, block_size=self.block_size, is_causal=is_causal,
            scale=self.scale, backend=self.backend,
        )  # fmt: skip
        assert isinstance(out, torch.Tensor)  # return_lse=False: for the type checker
        return out

    def extra_repr(self) -> str:
        return f"pattern={self.pattern!r}, block_size={self.block_size}, backend={self.backend!r}"


class BlockSparseMultiheadAttention(_MultiheadProjections):
    """Batch-first multihead block-sparse attention (the layer of
    :class:`MultiheadDilatedAttention` with :class:`BlockSparseAttention` inside).

    Args:
        embed_dim: E.
        num_heads: H; E must be divisible by H.
        pattern: a :mod:`dilated_attention.patterns` pattern.
        block_size: tokens per block.
        num_kv_heads: Hkv for grouped-query attention (``None`` = H).
        bias: biases on the projections.
        layer_norm: MAGNETO sub-LayerNorm before the output projection.
        layer_norm_eps: its epsilon.
        gamma_init: MAGNETO gain on the value and output projections.
        scale: softmax scale (``None``: head_dim ** -0.5).
        backend: as in :class:`BlockSparseAttention`.
        device, dtype: factory kwargs for the parameters.

    ``forward(query, key=None, value=None, *, is_causal=False, key_padding_mask=None,
    need_weights=False) -> (out, None)`` with (B, N, E) tensors; ``key_padding_mask`` must be
    None.
    """

    _what = "block-sparse attention"

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        pattern: Pattern,
        *,
        block_size: int = 128,
        num_kv_heads: int | None = None,
        bias: bool = True,
        layer_norm: bool = True,
        layer_norm_eps: float = 1e-5,
        gamma_init: float = 1.0,
        scale: float | None = None,
        backend: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        attention = BlockSparseAttention(
            pattern, block_size=block_size, scale=scale, backend=backend
        )
        super().__init__(
            embed_dim, num_heads, num_kv_heads=num_kv_heads, bias=bias, layer_norm=layer_norm,
            layer_norm_eps=layer_norm_eps, gamma_init=gamma_init, device=device, dtype=dtype,
        )  # fmt: skip
        self.attention = attention
        self.pattern, self.block_size = attention.pattern, attention.block_size


def _block_sparse_kind(cls: type[nn.Module], kind: str, kwargs: dict[str, object]) -> nn.Module:
    """Build a block-sparse module for the factory's generic ``create_*`` functions."""
    for name in ("segment_lengths", "dilation_rates"):
        if kwargs.pop(name, None) is not None:
            raise ValueError(
                f"kind {kind!r} takes a block-sparse pattern, not {name}; pass "
                f"pattern=dilated_attention.patterns.LocalWindow(1) (or any pattern), e.g. "
                f"create_block_sparse_attention(pattern, block_size=128)"
            )
    if kwargs.get("pattern") is None:
        raise ValueError(
            f"kind {kind!r} needs pattern=... (a dilated_attention.patterns.Pattern, e.g. "
            f"patterns.LocalWindow(1)); build it with create_block_sparse_attention(pattern, "
            f"block_size=128)"
        )
    return cls(**kwargs)


def build_block_sparse(**kwargs: object) -> nn.Module:
    """Factory constructor of kind ``"block_sparse"`` (:class:`BlockSparseAttention`)."""
    return _block_sparse_kind(BlockSparseAttention, "block_sparse", kwargs)


def build_block_sparse_multihead(**kwargs: object) -> nn.Module:
    """Factory constructor of kind ``"block_sparse"`` (:class:`BlockSparseMultiheadAttention`)."""
    return _block_sparse_kind(BlockSparseMultiheadAttention, "block_sparse", kwargs)


#: Read by the factory when kind="block_sparse" is first requested (``factory._PROVIDERS``).
FACTORY_KINDS = {"block_sparse": (build_block_sparse, build_block_sparse_multihead)}
