"""Dilated attention as modules: :class:`DilatedAttention` over (B, N, H, D) tensors, and
:class:`MultiheadDilatedAttention`, the multihead layer around it (a drop-in for
``nn.MultiheadAttention``).

Shape legend: B batch, N seq_len, E embed_dim, H heads, Hkv key/value heads, D head dim = E // H.
"""

from __future__ import annotations

import torch
from torch import nn

from ..backends.registry import check_backend_name
from ..config import DilatedConfig, MultiheadDilatedConfig
from ..core.decoding.caches import Cache
from ..core.geometry.schedule_state import DilatedScheduleState
from ..functional import dilated_attention
from .multihead import MultiheadAttention
from .scores import learnable_sinks, score_repr

__all__ = ["DilatedAttention", "MultiheadDilatedAttention"]


class DilatedAttention(DilatedScheduleState, nn.Module):
    """Dilated attention over (B, N, H, D) tensors; see :func:`dilated_attention`.

    Args:
        segment_lengths: w per branch.
        dilation_rates: r per branch.
        scale: softmax scale; ``None`` means ``D ** -0.5``.
        dropout: attention-probability dropout, applied in training mode only.
        backend: kernel name, or ``None`` / ``"auto"`` to choose per call.
        window_size: ``(left, right)``: a local window as one more branch (Note [A local window
            as a branch] in ``resolve/windows.py``), or None.
        softcap: soft-capped scores ``c * tanh(s / c)``, or None.
        sinks: learnable attention sinks (a parameter of one logit per query head, initialised
            to 0) for this many query heads, or None (Note [Local windows, soft-capping and
            sinks] in ``core/sinks.py``).

    Raises:
        ValueError / TypeError: a bad schedule, scale, dropout, backend name, window, soft-cap
            or sink count.
    """

    #: Its forward takes ``cache=`` (decoding); a subclass whose forward does not says False.
    decodes_with_cache = True
    #: Its forward takes ``cu_seqlens=`` (packed documents); a subclass whose does not says False.
    takes_documents = True

    def __init__(
        self,
        segment_lengths: list[int] | tuple[int, ...],
        dilation_rates: list[int] | tuple[int, ...],
        *,
        scale: float | None = None,
        dropout: float = 0.0,
        backend: str | None = None,
        window_size: tuple[int, int] | None = None,
        softcap: float | None = None,
        sinks: int | None = None,
    ) -> None:
        super().__init__()
        backend = check_backend_name(backend)  # "auto" -> None
        self.config = DilatedConfig(
            segment_lengths=segment_lengths, dilation_rates=dilation_rates, scale=scale,
            dropout=dropout, backend=backend, window_size=window_size, softcap=softcap,
            sinks=sinks,
        )  # fmt: skip
        self.segment_lengths = self.config.segment_lengths
        self.dilation_rates = self.config.dilation_rates
        self.scale, self.dropout, self.backend = self.config.scale, self.config.dropout, backend
        self.window_size, self.softcap = self.config.window_size, self.config.softcap
        self.sinks = learnable_sinks(self.config.sinks)

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
        cache: Cache | None = None,
        cu_seqlens: torch.Tensor | list[int] | tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """Args: query (B, N, H, D); key, value (B, N, Hkv, D); key_padding_mask (B, N) bool;
        cache: a :class:`~dilated_attention.DilatedKVCache` for decoding (``is_causal=True``,
        the new tokens' query, key and value); cu_seqlens: packed documents, as in
        :func:`dilated_attention`.

        Returns:
            (B, N, H, D).
        """
        out = dilated_attention(
            query, key, value, self.segment_lengths, self.dilation_rates,
            is_causal=is_causal, scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0,
            key_padding_mask=key_padding_mask, backend=self.backend, cache=cache,
            cu_seqlens=cu_seqlens, window_size=self.window_size, softcap=self.softcap,
            sinks=self.sinks,
        )  # fmt: skip
        assert isinstance(out, torch.Tensor)  # return_lse=False: for the type checker
        return out

    def extra_repr(self) -> str:
        return (
            f"segment_lengths={list(self.segment_lengths)}, "
            f"dilation_rates={list(self.dilation_rates)}, dropout={self.dropout}, "
            f"backend={self.backend!r}" + score_repr(self.window_size, self.softcap, self.sinks)
        )


class MultiheadDilatedAttention(MultiheadAttention):
    """Multihead dilated attention, a drop-in for ``nn.MultiheadAttention``.

    Projections q/k/v, dilated attention, MAGNETO's sub-LayerNorm (``layer_norm=True``), then the
    output projection. Initialisation follows MAGNETO: Xavier-normal weights, with gain
    ``gamma_init`` on the value and output projections; zero biases.

    It takes ``nn.MultiheadAttention``'s call, ``forward(query, key=None, value=None,
    key_padding_mask=None, need_weights=False, attn_mask=None, average_attn_weights=True,
    is_causal=False) -> (out, None)`` (see :meth:`forward`), and has the attributes torch's
    Transformer layers read (``batch_first``, ``embed_dim``, ``num_heads``,
    ``_qkv_same_embed_dim``, ``in_proj_weight``, ``in_proj_bias``, ``out_proj``), so it can be
    the ``self_attn`` of ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer`` (and
    their ``multihead_attn`` when memory and target have one length). What differs:

    * ``need_weights`` defaults to False, and True raises: the weights are never materialised.
    * ``attn_mask`` may only be the causal mask (it then means ``is_causal=True``).
    * q/k/v are separate ``nn.Linear`` modules, not a packed ``in_proj_weight`` (to copy a stock
      layer's weights, split its ``in_proj_weight`` into three (E, E) blocks); torch's fused
      inference paths, which would compute dense attention, are never taken.
    * With one branch covering the sequence (``segment_lengths=[N]``, ``dilation_rates=[1]``),
      ``layer_norm=False`` and a stock layer's weights, it computes exactly what
      ``nn.MultiheadAttention`` does (up to floating-point rounding), dropout aside.

    Args:
        embed_dim: E.
        num_heads: H; E must be divisible by H.
        segment_lengths: w per branch.
        dilation_rates: r per branch.
        num_kv_heads: Hkv for grouped-query attention (``None`` = H).
        dropout: attention-probability dropout (training mode only).
        bias: biases on the projections.
        layer_norm: MAGNETO sub-LayerNorm before the output projection.
        layer_norm_eps: its epsilon (finite, > 0).
        gamma_init: MAGNETO gain on the value and output projections (finite, > 0).
        backend: kernel name, or ``None`` / ``"auto"`` to choose per call.
        batch_first: True (default): inputs and output are (B, N, E). False: (N, B, E), as
            ``nn.MultiheadAttention``'s default; use it to replace the ``self_attn`` of a stock
            layer built with ``batch_first=False`` (the layer passes seq-first tensors then, which
            a batch-first module would silently misread).
        device, dtype: factory kwargs for the parameters.
        window_size, softcap: as in :class:`DilatedAttention`.
        sinks: learnable attention sinks, one logit per query head (``attention.sinks``).

    Raises:
        ValueError: bad sizes, schedule, dropout, ``layer_norm_eps``, ``gamma_init`` or backend.
        TypeError: ``batch_first``, ``bias`` or ``layer_norm`` is not a bool.
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
        batch_first: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        window_size: tuple[int, int] | None = None,
        softcap: float | None = None,
        sinks: bool = False,
    ) -> None:
        config = MultiheadDilatedConfig(
            embed_dim=embed_dim, num_heads=num_heads, segment_lengths=segment_lengths,
            dilation_rates=dilation_rates, num_kv_heads=num_kv_heads, dropout=dropout, bias=bias,
            layer_norm=layer_norm, layer_norm_eps=layer_norm_eps, gamma_init=gamma_init,
            backend=check_backend_name(backend),  # "auto" -> None
            window_size=window_size, softcap=softcap, sinks=sinks,
        )  # fmt: skip
        attention = DilatedAttention(
            config.segment_lengths, config.dilation_rates, dropout=config.dropout,
            backend=config.backend, window_size=config.window_size, softcap=config.softcap,
            sinks=num_heads if config.sinks else None,
        )  # fmt: skip
        self._init_layer(config, attention, batch_first=batch_first, device=device, dtype=dtype)

    def _init_layer(
        self,
        config: MultiheadDilatedConfig,
        attention: nn.Module,
        *,
        batch_first: bool,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
    ) -> None:
        """The layer of ``config`` around ``attention``, an inner module built from the same
        schedule (here :class:`DilatedAttention`; the ring layer's own)."""
        MultiheadAttention.__init__(
            self, config.embed_dim, config.num_heads, attention, num_kv_heads=config.num_kv_heads,
            bias=config.bias, layer_norm=config.layer_norm, layer_norm_eps=config.layer_norm_eps,
            gamma_init=config.gamma_init, device=device, dtype=dtype, batch_first=batch_first,
        )  # fmt: skip
        self.config = config
        self.dropout = config.dropout  # as nn.MultiheadAttention.dropout

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
