"""Frozen, validated configurations accepted by the modules (``from_config``) and the factory.

Each ``__post_init__`` runs the same checks as the functional API, so a bad config fails where it is
written, with the argument named.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from . import _validation as V


def longnet_schedule(seq_len: int, first_segment: int = 2048) -> tuple[list[int], list[int]]:
    """LongNet's geometric schedule (Eq. 11-12): segments ``first, 2*first, ...`` until one segment
    covers ``seq_len``, with rates ``1, 2, 4, ...``.

    >>> longnet_schedule(16384)
    ([2048, 4096, 8192, 16384], [1, 2, 4, 8])

    Raises:
        ValueError: ``seq_len`` or ``first_segment`` is not a positive int.
    """
    seq_len = V.check_positive_int("seq_len", seq_len)
    segment = min(V.check_positive_int("first_segment", first_segment), seq_len)
    segments, rates = [segment], [1]
    while segments[-1] < seq_len:
        segments.append(segments[-1] * 2)
        rates.append(rates[-1] * 2)
    return segments, rates


def _check_backend(backend: object) -> None:
    # The type only: names are the registry's (backends.registry.check_backend_name), below us.
    if backend is not None and not isinstance(backend, str):
        raise TypeError(
            f"backend must be a backend name (see dilated_attention.list_backends()), 'auto' or "
            f"None (automatic choice), got {backend!r} ({type(backend).__name__})"
        )


def _check_scores(config: Any, *, sinks_flag: bool = False) -> None:
    """Check and normalise a config's ``window_size``, ``softcap`` and ``sinks`` fields (Note
    [Local windows, soft-capping and sinks] in ``core/sinks.py``): ``sinks`` a head count or
    None, or with ``sinks_flag`` a bool (the multihead layer makes one per head)."""
    object.__setattr__(config, "window_size", V.check_window_size(config.window_size))
    object.__setattr__(config, "softcap", V.check_softcap(config.softcap))
    if sinks_flag:
        V.check_bool("sinks", config.sinks)
    elif config.sinks is not None:
        object.__setattr__(config, "sinks", V.check_positive_int("sinks", config.sinks))


@dataclass(frozen=True, kw_only=True)
class DilatedConfig:
    """Dilated attention over (B, N, H, D) tensors: see ``DilatedAttention``.

    Args:
        segment_lengths: w per branch.
        dilation_rates: r per branch.
        scale: softmax scale (``None``: head_dim ** -0.5).
        dropout: attention-probability dropout in training mode.
        backend: kernel name, or ``None`` for the automatic choice.
        window_size, softcap: a local window as one more branch, soft-capped scores (Note
            [Local windows, soft-capping and sinks] in ``core/sinks.py``).
        sinks: learnable attention sinks for this many query heads, or None.
    """

    segment_lengths: tuple[int, ...]
    dilation_rates: tuple[int, ...]
    scale: float | None = None
    dropout: float = 0.0
    backend: str | None = None
    window_size: tuple[int, int] | None = None
    softcap: float | None = None
    sinks: int | None = None

    def __post_init__(self) -> None:
        segs, rates = V.check_branches(self.segment_lengths, self.dilation_rates)
        object.__setattr__(self, "segment_lengths", segs)
        object.__setattr__(self, "dilation_rates", rates)
        object.__setattr__(self, "scale", V.check_scale(self.scale))
        object.__setattr__(self, "dropout", V.check_dropout("dropout", self.dropout))
        _check_backend(self.backend)
        _check_scores(self)

    def kwargs(self) -> dict[str, Any]:
        """The fields as keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, kw_only=True)
class MultiheadDilatedConfig:
    """A multihead dilated attention layer: see ``MultiheadDilatedAttention``.

    Args mirror ``MultiheadDilatedAttention.__init__`` (without device/dtype).
    """

    embed_dim: int
    num_heads: int
    segment_lengths: tuple[int, ...]
    dilation_rates: tuple[int, ...]
    num_kv_heads: int | None = None
    dropout: float = 0.0
    bias: bool = True
    layer_norm: bool = True
    layer_norm_eps: float = 1e-5
    gamma_init: float = 1.0
    backend: str | None = None
    window_size: tuple[int, int] | None = None
    softcap: float | None = None
    sinks: bool = False

    def __post_init__(self) -> None:
        V.check_heads(self.embed_dim, self.num_heads, self.num_kv_heads)
        segs, rates = V.check_branches(self.segment_lengths, self.dilation_rates)
        object.__setattr__(self, "segment_lengths", segs)
        object.__setattr__(self, "dilation_rates", rates)
        object.__setattr__(self, "dropout", V.check_dropout("dropout", self.dropout))
        V.check_bool("bias", self.bias)
        V.check_bool("layer_norm", self.layer_norm)
        eps = V.check_positive_float("layer_norm_eps", self.layer_norm_eps, fix=V.EPS_FIX)
        object.__setattr__(self, "layer_norm_eps", eps)
        gamma = V.check_positive_float("gamma_init", self.gamma_init, fix=V.GAMMA_FIX)
        object.__setattr__(self, "gamma_init", gamma)
        _check_backend(self.backend)
        _check_scores(self, sinks_flag=True)

    def kwargs(self) -> dict[str, Any]:
        """The fields as keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


#: The values of ``combine`` for NSA-style attention: gates (``o = sum_c g_c o_c``) or the exact
#: log-sum-exp merge (one softmax over the branches' keys).
COMBINE = ("gates", "lse")


def _check_topk(topk: object) -> int:
    """``topk`` as an int >= 0 (key blocks chosen per query block besides its own; 0 is
    checked against ``is_causal`` where a call gives it)."""
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 0:
        raise ValueError(
            f"topk must be an int >= 0 (key blocks chosen per query block besides its own), got "
            f"topk={topk!r} ({type(topk).__name__}); e.g. topk=3"
        )
    return topk


@dataclass(frozen=True, kw_only=True)
class BlockSelectedConfig:
    """MoBA-style attention (factory kind ``"moba"``): see ``BlockSelectedAttention``.

    Args:
        block_size: positions per block (MoBA's ``moba_chunk_size``; 512 in its experiments).
        topk: key blocks chosen per query block besides its own (MoBA's ``moba_topk`` minus
            1: its experiments' top-3 counts the own block).
        scale: softmax scale (``None``: head_dim ** -0.5).
        backend: kernel name, or ``None`` for the automatic choice.
    """

    block_size: int = 512
    topk: int = 2
    scale: float | None = None
    backend: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_size", V.check_positive_int("block_size", self.block_size))
        object.__setattr__(self, "topk", _check_topk(self.topk))
        object.__setattr__(self, "scale", V.check_scale(self.scale))
        _check_backend(self.backend)

    def kwargs(self) -> dict[str, Any]:
        """The fields as keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, kw_only=True)
class CompressedSelectedWindowConfig:
    """NSA-style attention (factory kind ``"nsa"``): see ``CompressedSelectedWindowAttention``.
    The defaults are the paper's (DeepSeek, arXiv 2502.11089, section 4.1).

    Args:
        compress_block: positions per compressed window (NSA's ``l``).
        compress_stride: positions between the windows' starts (NSA's ``d``), at most
            ``compress_block``.
        select_block: positions per selected block (NSA's ``l'``).
        topk: selected blocks per query block besides its own (NSA's ``n = 16`` counts the
            blocks it always keeps).
        window: the sliding window's length (NSA's ``w``).
        combine: ``"gates"`` (NSA's gated sum, the multihead layer's gate projection) or
            ``"lse"`` (the branches merged into one softmax).
        scale: softmax scale (``None``: head_dim ** -0.5).
        backend: kernel name, or ``None`` for the automatic choice.
        recompute: the backward runs the branches again a group of heads at a time instead
            of keeping their outputs (less memory, one more forward's time).
    """

    compress_block: int = 32
    compress_stride: int = 16
    select_block: int = 64
    topk: int = 15
    window: int = 512
    combine: str = "gates"
    scale: float | None = None
    backend: str | None = None
    recompute: bool = False

    def __post_init__(self) -> None:
        V.check_bool("recompute", self.recompute)
        for name in ("compress_block", "compress_stride", "select_block", "window"):
            object.__setattr__(self, name, V.check_positive_int(name, getattr(self, name)))
        if self.compress_stride > self.compress_block:
            raise ValueError(
                f"compress_stride must be at most compress_block (every position in a window), "
                f"got compress_stride={self.compress_stride}, compress_block="
                f"{self.compress_block}; e.g. NSA's compress_block=32, compress_stride=16"
            )
        object.__setattr__(self, "topk", _check_topk(self.topk))
        if self.combine not in COMBINE:
            raise ValueError(f"combine must be one of {COMBINE}, got combine={self.combine!r}")
        object.__setattr__(self, "scale", V.check_scale(self.scale))
        _check_backend(self.backend)

    def kwargs(self) -> dict[str, Any]:
        """The fields as keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
