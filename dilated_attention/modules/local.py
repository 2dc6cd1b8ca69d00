"""Local (sliding-window) attention as a layer: :class:`LocalAttention` over (B, N, H, D)
tensors, the library's :class:`MultiheadAttention` around it, and the factory's kind
``"local"`` (Mistral's and Gemma's sliding layers, gpt-oss's windowed ones).

Shape legend: B batch, N seq_len, E embed_dim, H heads, Hkv key/value heads, D head dim = E // H.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import _validation as V
from ..backends.registry import check_backend_name
from ..core.decoding.caches import Cache
from ..core.decoding.window_cache import StaticWindowKVCache, WindowKVCache, check_layer_window
from ..functional import attention
from .multihead import LAYER_ARGUMENTS, MultiheadAttention
from .scores import learnable_sinks, score_repr

__all__ = ["LocalAttention", "build_local", "build_local_multihead"]


def _window(window: object, window_size: object) -> tuple[int, int]:
    """A local layer's ``(left, right)`` from exactly one of ``window`` (``W`` tokens:
    ``(W - 1, 0)``) and ``window_size``."""
    if (window is None) == (window_size is None):
        raise ValueError(
            f"give a local layer exactly one of window (W tokens, a sliding window: "
            f"window_size=(W - 1, 0)) and window_size=(left, right), got window={window!r}, "
            f"window_size={window_size!r}; e.g. LocalAttention(128)"
        )
    if window is not None:
        return (V.check_positive_int("window", window) - 1, 0)
    return check_layer_window(window_size)


class LocalAttention(nn.Module):
    """Local windowed attention over (B, N, H, D) tensors: each position sees the keys of its
    window, ``p - left .. p + right`` (causal calls: ``p - left .. p``); see
    :func:`~dilated_attention.attention` with ``window_size``.

    Args:
        window: ``W``, a sliding window of ``W`` tokens (``window_size=(W - 1, 0)``, Hugging
            Face's ``sliding_window``); or give ``window_size``.
        window_size: ``(left, right)`` with ``left >= 0`` (``right`` may be ``-1``: unbounded).
        scale: softmax scale; ``None`` means ``D ** -0.5``.
        dropout: attention-probability dropout, applied in training mode only.
        backend: kernel name, or ``None`` / ``"auto"`` to choose per call.
        softcap: soft-capped scores ``c * tanh(s / c)``, or None.
        sinks: learnable attention sinks (a parameter of one logit per query head, initialised
            to 0) for this many query heads, or None (Note [Local windows, soft-capping and
            sinks] in ``core/sinks.py``).

    Raises:
        ValueError / TypeError: both or neither of ``window`` and ``window_size``, an
            unbounded left side, a bad scale, dropout, backend name, soft-cap or sink count.
    """

    #: Its forward takes ``cache=`` (a window cache) and ``cu_seqlens=`` (packed documents).
    decodes_with_cache = True
    takes_documents = True

    def __init__(
        self,
        window: int | None = None,
        *,
        window_size: tuple[int, int] | None = None,
        scale: float | None = None,
        dropout: float = 0.0,
        backend: str | None = None,
        softcap: float | None = None,
        sinks: int | None = None,
    ) -> None:
        super().__init__()
        self.window_size = _window(window, window_size)
        self.scale = V.check_scale(scale)
        self.dropout = V.check_dropout("dropout", dropout)
        self.backend = check_backend_name(backend)  # "auto" -> None
        self.softcap = V.check_softcap(softcap)
        self.sinks = learnable_sinks(sinks)

    def new_cache(
        self, *, static: bool = False, max_length: int | None = None
    ) -> WindowKVCache | StaticWindowKVCache:
        """An empty decoding cache of this layer: a :class:`~dilated_attention.WindowKVCache`
        (``static``: a :class:`~dilated_attention.StaticWindowKVCache`), holding its window."""
        kind = StaticWindowKVCache if static else WindowKVCache
        return kind(self.window_size, max_length=max_length)

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
        cache: this layer's window cache for decoding (:meth:`new_cache`; ``is_causal=True``,
        the new tokens' query, key and value); cu_seqlens: packed documents, as in
        :func:`~dilated_attention.attention`.

        Returns:
            (B, N, H, D).
        """
        out = attention(
            query, key, value, is_causal=is_causal, scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0,
            key_padding_mask=key_padding_mask, backend=self.backend,
            cu_seqlens=cu_seqlens,  # type: ignore[arg-type]
            window_size=self.window_size, softcap=self.softcap, sinks=self.sinks, cache=cache,
        )  # fmt: skip
        assert isinstance(out, torch.Tensor)  # return_lse=False: for the type checker
        return out

    def extra_repr(self) -> str:
        return (
            f"window_size={self.window_size}, dropout={self.dropout}, backend={self.backend!r}"
            + score_repr(None, self.softcap, self.sinks)
        )


def _local_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The factory's arguments for kind ``"local"``, without the dilated schedule it never
    takes (the generic ``create_*`` functions pass ``segment_lengths=None``)."""
    for name in ("segment_lengths", "dilation_rates"):
        if kwargs.pop(name, None) is not None:
            raise ValueError(
                f"kind 'local' takes a window, not {name}; pass window=W (a sliding window of "
                f"W tokens) or window_size=(left, right), e.g. "
                f"create_multihead_dilated_attention('local', embed_dim=512, num_heads=8, "
                f"window=128)"
            )
    return kwargs


def build_local(**kwargs: Any) -> nn.Module:
    """Factory constructor of kind ``"local"``: a :class:`LocalAttention`."""
    return LocalAttention(**_local_kwargs(kwargs))


def build_local_multihead(**kwargs: Any) -> nn.Module:
    """Factory constructor of kind ``"local"``: the library's :class:`MultiheadAttention` around
    a :class:`LocalAttention` (``sinks=True``: one learnable sink per query head)."""
    kwargs = _local_kwargs(kwargs)
    layer = {name: value for name, value in kwargs.items() if name in LAYER_ARGUMENTS}
    inner = {name: value for name, value in kwargs.items() if name not in LAYER_ARGUMENTS}
    sinks = V.check_bool("sinks", inner.pop("sinks", False))
    num_heads = layer.get("num_heads")
    V.check_heads(layer.get("embed_dim"), num_heads, layer.get("num_kv_heads"))
    inner["sinks"] = num_heads if sinks else None
    return MultiheadAttention(attention=LocalAttention(**inner), **layer)
