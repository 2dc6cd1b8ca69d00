"""Configuration of the LongNet language model: :class:`LongNetConfig` (frozen, validated on
construction) and the named :data:`PRESETS`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from .. import _validation as V
from ..backends.registry import check_backend_name

__all__ = ["PRESETS", "LongNetConfig"]


def _positive_int(name: str, value: object) -> int:
    return V.check_positive_int(name, value)


def _positive_float(name: str, value: object, fix: str) -> float:
    """A finite number > 0; a wrong type is a ValueError too, as for every config field."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(
            f"{name} must be a finite number > 0, got {name}={value!r} ({type(value).__name__})"
        )
    return V.check_positive_float(name, value, fix=fix)


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {name}={value!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class LongNetConfig:
    """Configuration of :class:`LongNetLM`; validated on construction.

    Args:
        vocab_size: V, number of token ids.
        embed_dim: E, hidden size.
        num_heads: H; ``embed_dim // num_heads`` (head dim) must be even for rotary positions.
        num_layers: number of blocks.
        segment_lengths: w per dilated-attention branch.
        dilation_rates: r per branch.
        ffn_dim: FFN hidden size.
        dropout: residual, FFN and attention-probability dropout (training only; must be 0 for
            ring attention).
        num_kv_heads: Hkv for grouped-query attention (``None`` = H).
        max_seq_len: longest (global) sequence accepted, or ``None`` for no limit.
        rotary_base: RoPE frequency base.
        layer_norm_eps: epsilon of every LayerNorm.
        tie_embeddings: share the LM head weight with the token embedding.
        activation_checkpointing: recompute each block in the backward pass (training only).
        backend: attention kernel name, or ``None`` / ``"auto"`` for the automatic choice.
        kind: factory kind: ``"auto"``, ``"dilated"``, ``"ring"``, ...

    Raises:
        ValueError: a field is invalid; the message names it.
    """

    vocab_size: int
    embed_dim: int
    num_heads: int
    num_layers: int
    segment_lengths: tuple[int, ...]
    dilation_rates: tuple[int, ...]
    ffn_dim: int
    dropout: float = 0.0
    num_kv_heads: int | None = None
    max_seq_len: int | None = None
    rotary_base: float = 10000.0
    layer_norm_eps: float = 1e-5
    tie_embeddings: bool = True
    activation_checkpointing: bool = False
    backend: str | None = None
    kind: str = "auto"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "embed_dim", "num_heads", "num_layers", "ffn_dim"):
            object.__setattr__(self, name, _positive_int(name, getattr(self, name)))
        kv = V.check_heads(self.embed_dim, self.num_heads, self.num_kv_heads)
        if self.num_kv_heads is not None:
            object.__setattr__(self, "num_kv_heads", kv)
        head_dim = self.embed_dim // self.num_heads
        if head_dim % 2:
            raise ValueError(
                f"embed_dim // num_heads (head_dim) must be even for rotary positions, got "
                f"embed_dim={self.embed_dim}, num_heads={self.num_heads} (head_dim={head_dim})"
            )
        segs, rates = V.check_branches(self.segment_lengths, self.dilation_rates)
        object.__setattr__(self, "segment_lengths", segs)
        object.__setattr__(self, "dilation_rates", rates)
        object.__setattr__(self, "dropout", V.check_dropout("dropout", self.dropout))
        if self.max_seq_len is not None:
            object.__setattr__(self, "max_seq_len", _positive_int("max_seq_len", self.max_seq_len))
        base = _positive_float("rotary_base", self.rotary_base, "RoPE uses 10000.0 (the default)")
        object.__setattr__(self, "rotary_base", base)
        eps = _positive_float("layer_norm_eps", self.layer_norm_eps, V.EPS_FIX)
        object.__setattr__(self, "layer_norm_eps", eps)
        _bool("tie_embeddings", self.tie_embeddings)
        _bool("activation_checkpointing", self.activation_checkpointing)
        if self.backend is not None and not isinstance(self.backend, str):
            raise ValueError(
                f"backend must be a backend name, 'auto' or None, got backend={self.backend!r} "
                f"({type(self.backend).__name__}); see dilated_attention.list_backends()"
            )
        check_backend_name(self.backend)  # ValueError naming the registered backends
        if not isinstance(self.kind, str):
            raise ValueError(f"kind must be a factory kind name, got kind={self.kind!r}")

    @property
    def head_dim(self) -> int:
        """D = embed_dim // num_heads."""
        return self.embed_dim // self.num_heads

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> LongNetConfig:
        """A named configuration (see :data:`PRESETS`), with fields overridden by keyword.

        Args:
            name: ``"tiny"`` (byte-level, trains on a laptop CPU in minutes) or ``"base"`` (the
                paper's 768 hidden, 12 heads, 12 layers, FFN 3072, w = 2048..32768,
                r = 1, 2, 4, 6, 12; vocab 100277 = cl100k unless overridden).
            **overrides: any field, e.g. ``num_layers=2`` or ``vocab_size=50257``.

        Raises:
            ValueError: unknown preset name or field, or an invalid value.
        """
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; presets: {sorted(PRESETS)}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown LongNetConfig fields {unknown}; fields: {sorted(known)}")
        return replace(PRESETS[name], **overrides)


#: Named configurations for :meth:`LongNetConfig.from_preset`.
PRESETS: dict[str, LongNetConfig] = {
    "tiny": LongNetConfig(
        vocab_size=256, embed_dim=128, num_heads=4, num_layers=4,
        segment_lengths=(64, 128, 256), dilation_rates=(1, 2, 4), ffn_dim=512,
    ),
    "base": LongNetConfig(
        vocab_size=100277, embed_dim=768, num_heads=12, num_layers=12,
        segment_lengths=(2048, 4096, 8192, 16384, 32768), dilation_rates=(1, 2, 4, 6, 12),
        ffn_dim=3072,
    ),
}  # fmt: skip
