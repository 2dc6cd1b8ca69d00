"""LongNet decoder-only language model (Ding et al. 2023) on this package's attention.

Shape legend: B batch, N seq_len (this rank's shard under ring attention), E embed_dim, H heads,
Hkv key/value heads, D head dim, V vocab_size.

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

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import _validation as V
from ..backends.registry import check_backend_name
from ..core.kv_cache import DilatedKVCache, check_caches
from ..factory import create_multihead_dilated_attention

__all__ = ["PRESETS", "LongNetAttention", "LongNetBlock", "LongNetConfig", "LongNetLM"]


def _positive_int(name: str, value: object) -> int:
    return V.check_positive_int(name, value)


def _positive_float(name: str, value: object, fix: str) -> float:
    """A finite number > 0; a wrong type is a ValueError too, as for every config field."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(
            f"{name} must be a finite number > 0, got {name}={value!r} ({type(value).__name__})"
        )
    return V.check_positive_float(name, value, fix=fix)


def _next_token(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """(B, 1) token ids from (B, V) float logits: the argmax at temperature 0, else a sample
    from softmax(logits / temperature) restricted to the ``top_k`` most likely tokens."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)


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


class LongNetAttention(nn.Module):
    """Causal self-attention with rotary positions: a factory-built multihead layer.

    See Note [Rotary inside a factory-built attention layer].

    Args:
        config: the model configuration.
        gamma_init: MAGNETO gain on the value and output projections.

    Raises:
        TypeError: the factory kind's layer cannot apply rotary positions (no ``use_rotary``).
    """

    def __init__(self, config: LongNetConfig, *, gamma_init: float = 1.0) -> None:
        super().__init__()
        mha = create_multihead_dilated_attention(
            kind=config.kind, embed_dim=config.embed_dim, num_heads=config.num_heads,
            segment_lengths=list(config.segment_lengths),
            dilation_rates=list(config.dilation_rates), num_kv_heads=config.num_kv_heads,
            dropout=config.dropout, layer_norm=True, layer_norm_eps=config.layer_norm_eps,
            gamma_init=gamma_init, backend=config.backend or "auto",
        )  # fmt: skip
        if not callable(getattr(mha, "use_rotary", None)):
            raise TypeError(
                f"kind {config.kind!r} built {type(mha).__name__}, which has no use_rotary(); "
                f"LongNetLM needs a multihead layer that applies rotary positions between its "
                f"projections and attention (subclass the library's multihead layers)"
            )
        self.mha = mha.use_rotary(config.rotary_base)
        self.num_heads, self.num_kv_heads = config.num_heads, int(self.mha.num_kv_heads)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cache: DilatedKVCache | None = None
    ) -> torch.Tensor:
        """x (B, N, E), positions (N,) global int positions -> (B, N, E); ``cache``: this
        layer's decoding cache (x then holds the new tokens)."""
        if cache is None:
            return self.mha(x, is_causal=True, positions=positions)[0]
        return self.mha(x, is_causal=True, cache=cache)[0]  # positions: the cache's next ones


class LongNetBlock(nn.Module):
    """One MAGNETO sub-LN decoder block (see Note [Block structure]).

    Args:
        config: the model configuration.
        gamma_init: MAGNETO gain.
    """

    def __init__(self, config: LongNetConfig, *, gamma_init: float = 1.0) -> None:
        super().__init__()
        E, eps = config.embed_dim, config.layer_norm_eps
        self.attn_norm = nn.LayerNorm(E, eps=eps)
        self.attn = LongNetAttention(config, gamma_init=gamma_init)
        self.ffn_norm = nn.LayerNorm(E, eps=eps)
        self.fc1 = nn.Linear(E, config.ffn_dim)
        self.ffn_sub_norm = nn.LayerNorm(config.ffn_dim, eps=eps)
        self.fc2 = nn.Linear(config.ffn_dim, E)
        self.dropout = nn.Dropout(config.dropout)
        for fc in (self.fc1, self.fc2):
            nn.init.xavier_normal_(fc.weight, gain=gamma_init)
            nn.init.zeros_(fc.bias)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cache: DilatedKVCache | None = None
    ) -> torch.Tensor:
        """x (B, N, E), positions (N,) -> (B, N, E); ``cache``: the attention's decoding cache."""
        x = x + self.dropout(self.attn(self.attn_norm(x), positions, cache))
        h = self.dropout(F.gelu(self.fc1(self.ffn_norm(x))))
        return x + self.dropout(self.fc2(self.ffn_sub_norm(h)))


class LongNetLM(nn.Module):
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
        self.blocks = nn.ModuleList(
            LongNetBlock(config, gamma_init=gamma) for _ in range(config.num_layers)
        )
        self.final_norm = nn.LayerNorm(config.embed_dim, eps=config.layer_norm_eps)
        self.lm_head = nn.Linear(config.embed_dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def num_parameters(self, *, trainable_only: bool = False) -> int:
        """Number of parameters, counting a tied weight once."""
        params = {id(p): p for p in self.parameters()}.values()
        return sum(p.numel() for p in params if p.requires_grad or not trainable_only)

    def _ring(self) -> Any | None:
        """The first layer's ring attention module, or ``None`` for local attention."""
        inner = self.blocks[0].attn.mha.attention
        return inner if hasattr(inner, "layout") else None

    def _default_positions(self, seq_len: int, device: torch.device) -> torch.Tensor:
        ring = self._ring()
        if ring is not None:  # ring attention: this rank's global positions
            from ..distributed.sharding import sequence_positions

            return sequence_positions(
                seq_len, group=getattr(ring, "group", None), layout=ring.layout, device=device
            )
        return torch.arange(seq_len, device=device)

    def _check_tokens_on_all_ranks(self, tokens: object) -> torch.Tensor:
        """:meth:`_check_tokens`; under ring attention every rank then learns whether any rank's
        tokens were rejected (one small all-gather), so a rejection raises on every rank instead
        of leaving the others waiting in the first layer's ring call."""
        ring = self._ring()
        if ring is None:
            return self._check_tokens(tokens)
        from ..distributed._comm import check_same_on_all_ranks

        error: Exception | None = None
        try:
            checked = self._check_tokens(tokens)
        except Exception as exc:  # a rejection on one rank must reach the others: no hang
            error = exc
        check_same_on_all_ranks(
            [0], ["(none)"], getattr(ring, "group", None), error, what="LongNetLM tokens"
        )
        return checked

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
        if torch.compiler.is_compiling():
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
        caches: list[DilatedKVCache] | None = None,
    ) -> torch.Tensor:
        """Next-token logits.

        Args:
            tokens: (B, N) token ids in ``[0, vocab_size)``.
            positions: (N,) int global positions of the tokens; default ``0..N-1``, or this
                rank's global positions under ring attention.
            caches: one :class:`~dilated_attention.DilatedKVCache` per layer
                (:meth:`new_caches`), for decoding: ``tokens`` are then the next tokens after
                those the caches hold, at the caches' next positions (the default).

        Returns:
            (B, N, V) logits; row ``i`` predicts token ``i + 1`` and sees tokens ``<= i`` only.
            A batch of 0 sequences gives (0, N, V).

        Raises:
            ValueError: token ids out of range, N (or a position) beyond ``max_seq_len``, bad
                ``positions``; ``caches`` not distinct caches of this model at one length.
        """
        tokens = self._check_tokens_on_all_ranks(tokens)
        N = tokens.shape[1]
        if caches is not None:  # one cache per layer, before any work: Note [One cache per layer]
            schedule = (self.config.segment_lengths, self.config.dilation_rates)
            positions = check_caches(caches, len(self.blocks), schedule, tokens, positions)
        elif positions is None:
            positions = self._default_positions(N, tokens.device)
        else:
            if not isinstance(positions, torch.Tensor) or positions.shape != (N,):
                got = tuple(positions.shape) if isinstance(positions, torch.Tensor) else positions
                raise ValueError(f"positions must be a ({N},) int tensor, got {got}")
            positions = positions.to(tokens.device)
        cap = self.config.max_seq_len
        if cap is not None and torch.compiler.is_compiling():  # see _check_tokens
            torch._assert_async(
                (positions < cap).all(), f"positions reach beyond max_seq_len={cap}"
            )
        elif cap is not None and int(positions.max()) >= cap:
            raise ValueError(
                f"positions reach {int(positions.max())}, beyond max_seq_len={cap} (the global "
                f"sequence is longer than the configured maximum)"
            )
        x = self.dropout(self.embed(tokens.long()))
        use_ckpt = self.config.activation_checkpointing and self.training
        for i, block in enumerate(self.blocks):
            cache = None if caches is None else caches[i]
            if use_ckpt and cache is None:
                x = checkpoint(block, x, positions, use_reentrant=False)
            else:
                x = block(x, positions, cache)
        return self.lm_head(self.final_norm(x))

    def new_caches(self) -> list[DilatedKVCache]:
        """Empty decoding caches, one per layer, for ``forward(tokens, caches=...)``."""
        config = self.config
        schedule, most = (config.segment_lengths, config.dilation_rates), config.max_seq_len
        return [DilatedKVCache(*schedule, max_length=most) for _ in self.blocks]

    @torch.no_grad()
    def generate(
        self,
        prompt: torch.Tensor | Sequence[torch.Tensor],
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        stop_token: int | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        """Sample a continuation, one token at a time: the prompt followed by what
        :meth:`stream` yields.

        Args:
            prompt, max_new_tokens, temperature, top_k, generator, stop_token: as in
                :meth:`stream`.

        Returns:
            For a (B, N0) prompt, (B, N0 + n) token ids: the prompt followed by the
            n <= ``max_new_tokens`` samples (fewer only when every sequence has produced
            ``stop_token``; a sequence that stopped earlier is filled with ``stop_token``). For a
            list of prompts, a list of 1-D tensors: each prompt followed by its samples, up to
            and including its ``stop_token``.

        Raises:
            ValueError, TypeError: as :meth:`stream`.
        """
        steps = list(
            self.stream(
                prompt, max_new_tokens, temperature=temperature, top_k=top_k,
                generator=generator, stop_token=stop_token,
            )
        )  # fmt: skip
        if isinstance(prompt, torch.Tensor):
            return torch.cat([prompt.long(), *steps], dim=1)
        samples = torch.cat(steps, dim=1) if steps else None
        out = []
        for row, tokens in enumerate(prompt):
            sampled = samples[row] if samples is not None else tokens.new_empty(0)
            if stop_token is not None:
                hits = (sampled == stop_token).nonzero()
                sampled = sampled[: int(hits[0]) + 1] if hits.numel() else sampled
            out.append(torch.cat([tokens.long().to(sampled.device), sampled.long()]))
        return out

    def stream(
        self,
        prompt: torch.Tensor | Sequence[torch.Tensor],
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        stop_token: int | None = None,
    ) -> Iterator[torch.Tensor]:
        """Sample a continuation token by token, yielding each step's (B, 1) token ids as soon
        as they are sampled (to print or send them while generation goes on).

        The arguments are checked when this is called, before anything runs. While the iterator
        runs the model is in eval mode; its training mode comes back when the iterator finishes
        or is closed. The prompt runs once into one :class:`~dilated_attention.DilatedKVCache`
        per layer and each new token reads the keys it can see from them (Note [Decoding
        rows]): the same logits as recomputing the whole forward, at a per-token cost set by the
        schedule, not the length. When ``max_seq_len`` is set and the sequence would outgrow it,
        every step instead recomputes the forward over the last ``max_seq_len`` tokens. Local
        attention only (not under ring sharding).

        Prompts of different lengths come as a list of 1-D token id tensors: each is sampled
        exactly as it would be alone (no padding: the rows of each length share one batch and
        one set of caches, and the batches advance together, one step at a time).

        Args:
            prompt: (B, N0) token ids, or a list of B 1-D token id tensors (any lengths >= 1).
            max_new_tokens: the most tokens to sample (>= 0).
            temperature: > 0 samples from softmax(logits / temperature); 0 is greedy.
            top_k: sample among the ``top_k`` most likely tokens only (``None``: all).
            generator: a ``torch.Generator`` for reproducible sampling.
            stop_token: a token id in [0, vocab_size) that ends a sequence: once a sequence
                has produced it, its later steps are ``stop_token`` too, and the iterator ends
                after the step where every sequence has (``None``: run ``max_new_tokens``
                steps).

        Yields:
            (B, 1) token ids (int64), one step at a time.

        Raises:
            ValueError: bad prompt, ``max_new_tokens < 0``, ``temperature`` negative or not
                finite, ``top_k < 1``, ``stop_token`` not a token id.
            TypeError: ``generator`` is not a ``torch.Generator``.
        """
        groups = self._prompt_groups(prompt)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
            raise ValueError(
                f"temperature must be a finite number >= 0, got temperature={temperature!r} "
                f"({type(temperature).__name__})"
            )
        temperature = V.check_positive_float(
            "temperature", temperature, allow_zero=True,
            fix="0 is greedy decoding, 1.0 samples from the model's distribution",
        )  # fmt: skip
        if top_k is not None:
            _positive_int("top_k", top_k)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(
                f"generator must be a torch.Generator or None, got {generator!r} "
                f"({type(generator).__name__}); e.g. torch.Generator().manual_seed(0)"
            )
        vocab = self.config.vocab_size
        if stop_token is not None and (
            isinstance(stop_token, bool)
            or not isinstance(stop_token, int)
            or not 0 <= stop_token < vocab
        ):
            raise ValueError(
                f"stop_token must be a token id in [0, {vocab}) or None, got "
                f"stop_token={stop_token!r}; e.g. the id of your end-of-text token"
            )
        return self._sample(groups, max_new_tokens, temperature, top_k, generator, stop_token)

    def _prompt_groups(self, prompt: object) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(rows, tokens)`` per prompt length: the batch rows (int64 indices) and their
        (b, N0) int64 token ids, after checking every prompt."""
        if isinstance(prompt, torch.Tensor):
            tokens = self._check_tokens(prompt).long()
            return [(torch.arange(tokens.shape[0]), tokens)]
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError(
                f"prompt must be a (batch, seq_len) tensor of token ids or a non-empty list of "
                f"1-D token id tensors (prompts of different lengths), got {type(prompt).__name__}"
            )
        by_length: dict[int, list[int]] = {}
        for row, tokens in enumerate(prompt):
            if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.numel() == 0:
                shape = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens)
                raise ValueError(
                    f"prompt[{row}] must be a non-empty 1-D tensor of token ids, got {shape}; "
                    f"pass prompts of one length as a (batch, seq_len) tensor instead"
                )
            if tokens.device != prompt[0].device:
                raise ValueError(
                    f"prompt[{row}] is on {tokens.device} and prompt[0] on {prompt[0].device}; "
                    f"move every prompt to one device"
                )
            self._check_tokens(tokens.unsqueeze(0))
            by_length.setdefault(tokens.numel(), []).append(row)
        return [
            (torch.tensor(rows), torch.stack([prompt[i] for i in rows]).long())
            for rows in by_length.values()
        ]

    def _sample(
        self,
        groups: list[tuple[torch.Tensor, torch.Tensor]],
        max_new_tokens: int,
        temperature: float,
        top_k: int | None,
        generator: torch.Generator | None,
        stop_token: int | None,
    ) -> Iterator[torch.Tensor]:
        """:meth:`stream`'s loop over checked arguments: ``groups`` of (rows, (b, N0) tokens)
        advance together, each with caches of its own."""
        was_training = self.training
        self.eval()
        try:
            batch = sum(rows.numel() for rows, _ in groups)
            device = groups[0][1].device
            cap = self.config.max_seq_len
            decodes = all(
                getattr(block.attn.mha.attention, "decodes_with_cache", False)
                for block in self.blocks
            )
            # Per group: its rows, the tokens its next forward reads (with caches the new ones
            # only, else all so far) and its caches.
            states = []
            for rows, tokens in groups:
                fits = cap is None or tokens.shape[1] + max_new_tokens <= cap
                caches = self.new_caches() if fits and decodes else None
                states.append([rows.to(device), tokens, caches])
            stopped = torch.zeros(batch, 1, dtype=torch.bool, device=device)
            for _ in range(max_new_tokens):
                step = torch.empty(batch, 1, dtype=torch.long, device=device)
                for state in states:
                    rows, tokens, caches = state
                    with torch.no_grad():
                        if caches is not None:  # the new tokens against the cached keys
                            logits = self(tokens, caches=caches)[:, -1, :].float()
                        else:
                            window = tokens if cap is None else tokens[:, -cap:]
                            logits = self(window)[:, -1, :].float()
                    nxt = _next_token(logits, temperature, top_k, generator).to(device)
                    if stop_token is not None:
                        nxt = nxt.masked_fill(stopped[rows], stop_token)
                    step[rows] = nxt
                    state[1] = nxt if caches is not None else torch.cat([tokens, nxt], dim=1)
                if stop_token is not None:
                    stopped |= step == stop_token
                yield step
                if stop_token is not None and bool(stopped.all()):
                    return
        finally:
            self.train(was_training)
