"""LongNet decoder-only language model (Ding et al. 2023) on this package's attention:
:class:`LongNetLM` (its configuration in :mod:`.config`, its blocks in :mod:`.blocks`, its
sampling in :mod:`.generation`).

Shape legend: B batch, N seq_len (this rank's shard under ring attention), E embed_dim, V
vocab_size.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import _validation as V
from ..core.decoding.caches import Cache, check_caches
from ..core.decoding.kv_cache import DilatedKVCache
from ..core.decoding.static_cache import StaticDilatedKVCache
from ..core.decoding.window_cache import StaticWindowKVCache, WindowKVCache
from ..core.geometry.documents import check_cu_seqlens, document_positions
from .blocks import LongNetBlock
from .config import LongNetConfig
from .generation import GenerationMixin

__all__ = ["LongNetLM"]


class LongNetLM(GenerationMixin, nn.Module):
    """Decoder-only LongNet language model: causal dilated attention, rotary positions, MAGNETO
    sub-LN blocks.

    The attention layers come from :func:`dilated_attention.create_multihead_dilated_attention`
    with ``config.kind``: ``"auto"`` is local attention in one process and ring attention when a
    process group of several ranks is initialised, where each rank passes its shard of the
    sequence (from :func:`dilated_attention.shard_sequence`) and gets that shard's logits.

    Args:
        config: a :class:`LongNetConfig`.

    Example::

        cfg = LongNetConfig.from_preset("tiny")
        model = LongNetLM(cfg)
        logits = model(tokens)                       # (B, N, 256)
        sample = model.generate(tokens[:, :16], 64)  # (B, 80)
    """

    def __init__(self, config: LongNetConfig) -> None:
        super().__init__()
        if not isinstance(config, LongNetConfig):
            raise TypeError(f"config must be a LongNetConfig, got {type(config).__name__}")
        self.config = config
        gamma = math.sqrt(math.log(2 * config.num_layers)) if config.num_layers > 1 else 1.0
        self.embed = nn.Embedding(config.vocab_size, config.embed_dim)
        nn.init.normal_(self.embed.weight, std=config.embed_dim**-0.5)
        self.dropout = nn.Dropout(config.dropout)
        _refuse_ring_options(config)
        self.blocks = nn.ModuleList(
            LongNetBlock(config, gamma_init=gamma, is_global=config.is_global(i))
            for i in range(config.num_layers)
        )
        self.final_norm = nn.LayerNorm(config.embed_dim, eps=config.layer_norm_eps)
        self.lm_head = nn.Linear(config.embed_dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        # What each layer's decoding cache holds (``LayerCache.layer``), for check_caches.
        self._cache_layers = tuple(cache.layer for cache in self.new_caches())

    def num_parameters(self, *, trainable_only: bool = False) -> int:
        """Number of parameters, counting a tied weight once."""
        params = {id(p): p for p in self.parameters()}.values()
        return sum(p.numel() for p in params if p.requires_grad or not trainable_only)

    def _ring(self) -> Any | None:
        """The first ring attention module of the layers, or ``None`` for local attention."""
        for block in self.blocks:
            inner = block.attn.mha.attention
            if hasattr(inner, "layout"):
                return inner
        return None

    def _default_positions(self, seq_len: int, device: torch.device) -> torch.Tensor:
        ring = self._ring()
        if ring is not None:  # this rank's global positions; the shards' lengths agreed next
            from ..distributed.layout.sharding import rank_positions

            return rank_positions(
                seq_len, group=getattr(ring, "group", None), layout=ring.layout, device=device
            )
        return torch.arange(seq_len, device=device)

    def _packed(
        self,
        cu_seqlens: object,
        tokens: torch.Tensor,
        caches: list[Cache] | None,
        positions: object,
    ) -> tuple[tuple[int, ...], torch.Tensor]:
        """Checked offsets of a packed batch (over the whole sharded row under ring attention)
        and the tokens' positions within their documents; with ``caches`` a packed prompt."""
        if positions is not None:
            raise ValueError(
                "positions and cu_seqlens cannot be combined: with packed documents each "
                "document's positions start at 0 (computed); pass positions=None"
            )
        ring = self._ring()
        if ring is not None:  # a sharded packed row (Note [Packed documents across ranks])
            from ..distributed.rings.packed_ring import shard_offsets, shard_positions

            group = getattr(ring, "group", None)
            documents = shard_offsets(cu_seqlens, tokens, group)
            return documents, shard_positions(documents, tokens, group)
        if caches is not None:  # a packed prompt (Note [A packed prompt])
            check_caches(caches, self._cache_layers, tokens, None)
        documents = check_cu_seqlens(cu_seqlens, tokens, tokens, caches)
        return documents, document_positions(documents, tokens.device)

    def _inputs_on_all_ranks(
        self, tokens: object, positions: object, caches: object, cu_seqlens: object
    ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, ...] | None]:
        """:meth:`_inputs`; under ring attention every rank then learns whether any rank's
        inputs were rejected, and the ranks compare their shards' lengths and packed documents
        (one small all-gather per group), so a rejection or a mismatch raises on every rank
        instead of leaving the others waiting in the first layer's ring call. Nothing before it
        communicates (the positions of a shard are computed, not agreed on:
        ``rank_positions``)."""
        ring = self._ring()
        if ring is None:
            return self._inputs(tokens, positions, caches, cu_seqlens)
        local = [i for i in range(len(self.blocks)) if not self.config.is_global(i)]
        if local:  # the same on every rank (one model): every rank raises, none waits
            raise ValueError(
                f"this model's global layers run over ranks ({type(ring).__name__}) but its "
                f"local window layers {local[:8]} do not (they have no ring layer yet) and "
                f"would take each rank's shard as a whole sequence; run the hybrid model in "
                f"one process"
            )
        from ..distributed.context import DOCUMENTS, DOCUMENTS_FIX, check_same_everywhere

        names = ("local seq_len", DOCUMENTS)
        error: Exception | None = None
        fields, shown = [0, 0], None
        try:
            inputs = self._inputs(tokens, positions, caches, cu_seqlens)
            documents = None if inputs[2] is None else list(inputs[2])
            shown = [inputs[0].shape[1], documents]
            fields = [inputs[0].shape[1], zlib.crc32(repr(documents).encode())]
        except Exception as exc:  # a rejection on one rank must reach the others: no hang
            error = exc
        check_same_everywhere(
            fields, names, getattr(ring, "group", None), error, what="LongNetLM inputs",
            shown=shown, fixes={DOCUMENTS: DOCUMENTS_FIX},
        )  # fmt: skip
        return inputs

    def _inputs(
        self, tokens: object, positions: object, caches: object, cu_seqlens: object
    ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, ...] | None]:
        """:meth:`forward`'s checked ``tokens`` (B, N), the tokens' positions ((N,), (B * N,)
        with packed documents, or None for a static step: the caches check theirs) and the
        packed documents' offsets (or None)."""
        tokens = self._check_tokens(tokens)
        N, documents = tokens.shape[1], None
        if cu_seqlens is not None:
            documents, positions = self._packed(cu_seqlens, tokens, caches, positions)
        elif caches is not None:  # one cache per layer, before any work: Note [One cache per layer]
            positions = check_caches(caches, self._cache_layers, tokens, positions)
        elif positions is None:
            positions = self._default_positions(N, tokens.device)
        else:
            if not isinstance(positions, torch.Tensor) or positions.shape != (N,):
                got = tuple(positions.shape) if isinstance(positions, torch.Tensor) else positions
                raise ValueError(f"positions must be a ({N},) int tensor, got {got}")
            positions = positions.to(tokens.device)
        if positions is not None:  # else a static step: the caches check their positions
            self._check_positions_fit(positions)
        return tokens, positions, documents  # type: ignore[return-value]

    def _check_tokens(self, tokens: object) -> torch.Tensor:
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
            shape = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens)
            raise ValueError(f"tokens must be a (batch, seq_len) LongTensor, got {shape}")
        if tokens.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
            raise ValueError(f"tokens must be integer token ids, got dtype {tokens.dtype}")
        N, cap = tokens.shape[1], self.config.max_seq_len
        if N == 0:
            raise ValueError(
                f"tokens must hold at least one token per sequence, got tokens.shape="
                f"{tuple(tokens.shape)} (seq_len 0); skip the call for empty sequences"
            )
        if cap is not None and cap < N:
            raise ValueError(
                f"sequence length {N} is longer than max_seq_len={cap}; truncate or split the "
                f"tokens, or raise max_seq_len in the config"
            )
        if tokens.numel() == 0:  # a batch of 0 sequences: nothing to range-check
            return tokens
        if V.values_unreadable():
            # A compiled graph cannot branch on values: the same check, asserted when it runs.
            in_range = ((tokens >= 0) & (tokens < self.config.vocab_size)).all()
            torch._assert_async(
                in_range, f"token ids must be in [0, vocab_size={self.config.vocab_size})"
            )
            return tokens
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= self.config.vocab_size:
            raise ValueError(
                f"token ids must be in [0, vocab_size={self.config.vocab_size}), got ids in "
                f"[{lo}, {hi}]"
            )
        return tokens

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        caches: list[Cache] | None = None,
        cu_seqlens: torch.Tensor | list[int] | tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """Next-token logits.

        Args:
            tokens: (B, N) token ids in ``[0, vocab_size)``.
            positions: (N,) int global positions of the tokens; default ``0..N-1``, or this
                rank's global positions under ring attention.
            caches: one :class:`~dilated_attention.DilatedKVCache` per layer
                (:meth:`new_caches`), for decoding: ``tokens`` are then the next tokens after
                those the caches hold, at the caches' next positions (the default). With
                ``new_caches(static=True)``, a call of one token per row is a step with static
                shapes (``torch.compile``, CUDA graphs), each row at its own position.
            cu_seqlens: a packed batch: documents back to back in the rows, as in
                :func:`~dilated_attention.dilated_attention`; each document's logits are those
                it gets alone (its positions start at 0; ``positions`` must be None). With
                empty ``caches``, a packed prompt: the caches then hold each row's last
                document, which the next tokens continue.

        Returns:
            (B, N, V) logits; row ``i`` predicts token ``i + 1`` and sees tokens ``<= i`` only.
            A batch of 0 sequences gives (0, N, V).

        Raises:
            ValueError: token ids out of range, N (or a position) beyond ``max_seq_len``, bad
                ``positions``; ``caches`` not distinct caches of this model at one length.
        """
        tokens, positions, documents = self._inputs_on_all_ranks(
            tokens, positions, caches, cu_seqlens
        )
        if documents is not None:  # Note [Packed positions are the layers' own]
            positions = None
        x = self.dropout(self.embed(tokens.long()))
        use_ckpt = self.config.activation_checkpointing and self.training
        for i, block in enumerate(self.blocks):
            cache = None if caches is None else caches[i]
            if use_ckpt and cache is None:
                x = checkpoint(block, x, positions, None, documents, use_reentrant=False)
            else:
                x = block(x, positions, cache, documents)
        return self.lm_head(self.final_norm(x))

    # Note [Packed positions are the layers' own]
    #     With packed documents every layer computes its rotary positions itself from the
    #     offsets (0 at each document's first token, over the flattened batch, or over this
    #     rank's shard of the row under ring attention), as it does for any caller of the layer;
    #     the model's own copy of them only checks ``max_seq_len``. Handing the layers the
    #     (B * N,) positions would be the (N,) positions of a row at B = 1 only, and a static
    #     cache takes no positions at all.

    def _check_positions_fit(self, positions: torch.Tensor) -> None:
        """Refuse ``positions`` (N,) at or past ``max_seq_len`` (a device assertion when traced,
        see :meth:`_check_tokens`)."""
        cap = self.config.max_seq_len
        if cap is None or positions.numel() == 0:  # none: a packed batch of 0 sequences
            return
        if V.values_unreadable():
            torch._assert_async(
                (positions < cap).all(), f"positions reach beyond max_seq_len={cap}"
            )
        elif int(positions.max()) >= cap:
            raise ValueError(
                f"positions reach {int(positions.max())}, beyond max_seq_len={cap} (the global "
                f"sequence is longer than the configured maximum)"
            )

    def new_caches(self, *, static: bool = False) -> list[Cache]:
        """Empty decoding caches, one per layer and of its kind, for ``forward(tokens,
        caches=...)``: a :class:`~dilated_attention.DilatedKVCache` for a global layer, a
        :class:`~dilated_attention.WindowKVCache` (holding only the window) for a local one
        (Note [Hybrid stacks] in ``config.py``); ``static``: their static forms
        (:class:`~dilated_attention.StaticDilatedKVCache`,
        :class:`~dilated_attention.StaticWindowKVCache`: fixed buffers, a decode step with
        static shapes)."""
        config, most = self.config, self.config.max_seq_len
        caches: list[Cache] = []
        for i in range(len(self.blocks)):
            if config.is_global(i):
                kind = StaticDilatedKVCache if static else DilatedKVCache
                caches.append(
                    kind(config.segment_lengths, config.dilation_rates, max_length=most)
                )
            else:
                assert config.local_window_size is not None  # a local layer has one
                window = StaticWindowKVCache if static else WindowKVCache
                caches.append(window(config.local_window_size, max_length=most))
        return caches


def _refuse_ring_options(config: LongNetConfig) -> None:
    """Raise ``ValueError`` for local layers where ``kind="auto"`` picks ring attention (a
    process group of several ranks): they have no ring form yet (Note [Hybrid stacks] in
    ``config.py``)."""
    dist = torch.distributed
    if config.local_window is None or config.kind != "auto":
        return
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            f"kind='auto' picks ring attention in this process group of "
            f"{dist.get_world_size()} ranks, but local_window={config.local_window}'s local "
            f"layers have no ring form yet; pass kind='dilated' to run every layer in each "
            f"process, or drop local_window"
        )
