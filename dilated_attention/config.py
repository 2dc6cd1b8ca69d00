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
