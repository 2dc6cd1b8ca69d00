"""Configuration of the LongNet language model: :class:`LongNetConfig` (frozen, validated on
construction) and the named :data:`PRESETS`.

Note [Hybrid stacks]
    The open long-context models mix local and global layers: Gemma 3 has five sliding-
    window layers per global one, gpt-oss alternates windows of 128 tokens with full
    layers, Mistral slides a window on every layer. Here a global layer is the dilated
    schedule (``segment_lengths``, ``dilation_rates``) and a local layer a sliding window
    (``local_window``), placed by ``global_every``; ``softcap`` and ``sinks`` apply to
    every layer. Decoding gives each layer its own kind of cache (``new_caches``): a local
    layer's holds only its window. Local layers run in one process: a hybrid stack needs a
    local ``kind`` (``"auto"`` in one process, ``"dilated"``) until they have a ring form
    (the ring layers take ``softcap`` and ``sinks``).

    The global layers may instead select their blocks from the content: ``kind="moba"``
    (MoBA-style, :class:`~dilated_attention.modules.BlockSelectedAttention`) or ``kind="nsa"``
    (NSA-style, :class:`~dilated_attention.modules.CompressedSelectedWindowAttention`), with
    their sizes in ``sparse`` (a :class:`~dilated_attention.config.BlockSelectedConfig` or
    :class:`~dilated_attention.config.CompressedSelectedWindowConfig`; None: the defaults).
    Every layer is such a layer without ``local_window``, or every ``global_every``-th between
    windowed ones with it. They run in one process and decode without caches (``generate``
    runs the whole prefix per token); they take no soft-cap, sinks or attention dropout. The
    dilated schedule is then unused.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from .. import _validation as V
from ..backends.registry import check_backend_name
from ..config import BlockSelectedConfig, CompressedSelectedWindowConfig
from ..factory import KIND_ALIASES

#: The kinds whose options ``LongNetConfig.sparse`` holds, and their configs.
SPARSE_KINDS: dict[str, type[BlockSelectedConfig] | type[CompressedSelectedWindowConfig]] = {
    "moba": BlockSelectedConfig,
    "nsa": CompressedSelectedWindowConfig,
}

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
        kind: factory kind of the global layers: ``"auto"``, ``"dilated"``, ``"ring"``,
            ``"moba"``, ``"nsa"`` (Note [Hybrid stacks]), ...
        local_window: ``W``: a hybrid stack (Note [Hybrid stacks]) whose local layers attend
            within a sliding window of ``W`` tokens (factory kind ``"local"``, ``window_size=
            (W - 1, 0)``); ``None``: every layer global (dilated).
        global_every: with ``local_window``, every ``k``-th layer (layers ``k - 1``,
            ``2k - 1``, ...) is global, the others local (Gemma 3: ``k = 6``, gpt-oss:
            ``k = 2``); ``None``: every layer local.
        softcap: soft-capped attention scores ``c * tanh(s / c)`` in every layer (Gemma 2), or
            None.
        sinks: a learnable attention sink per head in every layer (gpt-oss).
        sparse: with ``kind="moba"``, a :class:`~dilated_attention.config.BlockSelectedConfig`;
            with ``kind="nsa"``, a :class:`~dilated_attention.config.
            CompressedSelectedWindowConfig` (or its fields as a dict, as a checkpoint stores
            it); None: that config's defaults. None with any other kind.

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
    local_window: int | None = None
    global_every: int | None = None
    softcap: float | None = None
    sinks: bool = False
    sparse: BlockSelectedConfig | CompressedSelectedWindowConfig | None = None

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
        self._check_hybrid()
        self._check_sparse()

    def _check_hybrid(self) -> None:
        """``local_window``, ``global_every``, ``softcap`` and ``sinks`` (Note [Hybrid
        stacks]), checked and normalised."""
        for name in ("local_window", "global_every"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _positive_int(name, getattr(self, name)))
        if self.global_every is not None and self.local_window is None:
            raise ValueError(
                f"global_every={self.global_every} places global layers among local ones, but "
                f"local_window is None (no local layers); pass local_window=W (the local "
                f"layers' sliding window), or drop global_every for an all-dilated stack"
            )
        if self.global_every is not None and self.global_every > self.num_layers:
            raise ValueError(
                f"global_every={self.global_every} is more than num_layers={self.num_layers}, "
                f"so no layer would be global; pass global_every <= num_layers, or drop it for "
                f"an all-local stack"
            )
        try:
            object.__setattr__(self, "softcap", V.check_softcap(self.softcap))
        except TypeError as exc:
            raise ValueError(str(exc)) from None
        _bool("sinks", self.sinks)
        if self.local_window is not None and KIND_ALIASES.get(self.kind, self.kind) == "ring":
            raise ValueError(
                f"kind={self.kind!r} with local_window={self.local_window}: the local layers "
                f"have no ring form yet (they run in one process); pass kind='dilated' (or "
                f"'auto' in one process), or drop local_window for a ring model"
            )

    def _check_sparse(self) -> None:
        """``sparse``, checked against ``kind`` and made a config (Note [Hybrid stacks])."""
        kind = KIND_ALIASES.get(self.kind, self.kind)
        wanted = SPARSE_KINDS.get(kind)
        if wanted is None:
            if self.sparse is not None:
                raise ValueError(
                    f"sparse={self.sparse!r} sizes layers of kind 'moba' or 'nsa', but "
                    f"kind={self.kind!r}; pass kind='moba' (a BlockSelectedConfig) or kind='nsa' "
                    f"(a CompressedSelectedWindowConfig), or sparse=None"
                )
            return
        sparse = self.sparse
        if isinstance(sparse, dict):  # as a checkpoint stores it (dataclasses.asdict)
            sparse = wanted(**sparse)
        if sparse is None:
            sparse = wanted()
        if not isinstance(sparse, wanted):
            raise ValueError(
                f"kind={self.kind!r} takes sparse=dilated_attention.config.{wanted.__name__}"
                f"(...) or None, got {type(sparse).__name__}"
            )
        object.__setattr__(self, "sparse", sparse)
        given = {"softcap": self.softcap is not None, "sinks": self.sinks,
                 "dropout": self.dropout > 0}  # fmt: skip
        refused = [name for name, on in given.items() if on]
        if refused:
            raise ValueError(
                f"kind={self.kind!r} layers take no soft-cap, sinks or attention dropout, got "
                f"{', '.join(f'{n}={getattr(self, n)!r}' for n in refused)}; leave them out "
                f"(softcap=None, sinks=False, dropout=0.0)"
            )

    def is_global(self, layer: int) -> bool:
        """Whether block ``layer`` (0-based) is a global (dilated) layer: every layer without
        ``local_window``, else every ``global_every``-th (Note [Hybrid stacks])."""
        if self.local_window is None:
            return True
        return self.global_every is not None and (layer + 1) % self.global_every == 0

    @property
    def local_window_size(self) -> tuple[int, int] | None:
        """The local layers' ``window_size``, ``(local_window - 1, 0)``, or None."""
        return None if self.local_window is None else (self.local_window - 1, 0)

    @property
    def head_dim(self) -> int:
        """D = embed_dim // num_heads."""
        return self.embed_dim // self.num_heads

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> LongNetConfig:
        """A named configuration (see :data:`PRESETS`), with fields overridden by keyword.

        Args:
            name: ``"tiny"`` (byte-level, trains on a laptop CPU in minutes), ``"tiny_hybrid"``
                (``"tiny"`` as a hybrid stack: six layers, every third global, the others a
                sliding window of 64 tokens, learnable sinks) or ``"base"`` (the paper's 768
                hidden, 12 heads, 12 layers, FFN 3072, w = 2048..32768, r = 1, 2, 4, 6, 12;
                vocab 100277 = cl100k unless overridden).
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
    "tiny_hybrid": LongNetConfig(
        vocab_size=256, embed_dim=128, num_heads=4, num_layers=6,
        segment_lengths=(64, 128, 256), dilation_rates=(1, 2, 4), ffn_dim=512,
        local_window=64, global_every=3, sinks=True,
    ),
    "base": LongNetConfig(
        vocab_size=100277, embed_dim=768, num_heads=12, num_layers=12,
        segment_lengths=(2048, 4096, 8192, 16384, 32768), dilation_rates=(1, 2, 4, 6, 12),
        ffn_dim=3072,
    ),
}  # fmt: skip
