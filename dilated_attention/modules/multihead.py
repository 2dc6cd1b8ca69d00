"""The one multihead layer, :class:`MultiheadAttention`: projections q/k/v, optional rotary
positions, an inner (B, N, H, D) attention module, MAGNETO's sub-LayerNorm and the output
projection, with ``nn.MultiheadAttention``'s call.

Shape legend: B batch, N seq_len, E embed_dim, H heads, Hkv key/value heads, D head dim = E // H.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange
from torch import nn

from .. import _validation as V
from ..core.decoding.caches import Cache, check_cache_type
from ..core.decoding.static_cache import StaticKVCache
from ..core.geometry.documents import check_cu_seqlens, document_positions, flatten
from ..rotary import RotaryEmbedding
from .torch_compat import NO_PACKED_PROJECTION, bool_key_padding_mask, is_causal_mask

__all__ = ["LAYER_ARGUMENTS", "MultiheadAttention"]


@dataclass(frozen=True, eq=False)
class LayerInputs:
    """One call of :class:`MultiheadAttention`, checked: what its projections, rotary positions
    and inner module read.

    Attributes:
        query, key, value: (B, N, E), batch first whatever the layer's ``batch_first``.
        is_causal: causal attention (also when the call gave the causal ``attn_mask``).
        key_padding_mask: (B, N) bool, True = ignore that key; None = no padding.
        positions: (N,) integer positions for rotary, or (B * N,) over the flattened batch
            with packed documents; None without rotary.
        cache: the layer's decoding cache, or None.
        documents: packed documents' offsets (Note [Packed documents] in
            ``core/geometry/documents.py``), or None.
        block_mask: a run-time block mask for a block-sparse inner module, or None.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    is_causal: bool
    key_padding_mask: torch.Tensor | None
    positions: torch.Tensor | None
    cache: Cache | None
    documents: tuple[int, ...] | None = None
    block_mask: torch.Tensor | None = None


class MultiheadAttention(nn.Module):
    """The multihead layer around an inner (B, N, H, D) attention module, with
    ``nn.MultiheadAttention``'s call: projections q/k/v, optional rotary positions
    (:meth:`use_rotary`), ``attention``, MAGNETO's sub-LayerNorm (``layer_norm=True``), then the
    output projection. Initialisation follows MAGNETO: Xavier-normal weights, with gain
    ``gamma_init`` on the value and output projections; zero biases.

    Every multihead layer of the library is this layer with its inner module built from its
    arguments (:class:`MultiheadDilatedAttention`, :class:`BlockSparseMultiheadAttention`, their
    ring forms); a kind registered with only an inner constructor
    (``register_kind(name, dilated=...)``) gets it from the factory. Subclasses name what the
    layer is in ``_what`` (used in error messages).

    ``batch_first``, ``embed_dim``, ``num_heads``, ``_qkv_same_embed_dim``, ``in_proj_weight``,
    ``in_proj_bias`` and ``out_proj`` are the attributes torch's Transformer layers read from their
    ``self_attn``/``multihead_attn``; see Note [torch fast paths].

    Args:
        embed_dim: E.
        num_heads: H; E must be divisible by H.
        attention: the inner module, called as ``attention(q, k, v, is_causal=...,
            key_padding_mask=...)`` on (B, N, H, D) / (B, N, Hkv, D) tensors, returning
            (B, N, H, D). One that declares ``gates_per_head = C`` (NSA-style branches) also
            gets ``gates=`` (B, N, H, C) from the layer's ``gate_proj`` (Note [Gates from the
            layer input]).
        num_kv_heads, bias, layer_norm, layer_norm_eps, gamma_init, batch_first, device, dtype:
            as in :class:`MultiheadDilatedAttention`.

    Raises:
        TypeError: ``attention`` is not an ``nn.Module``; ``batch_first``, ``bias`` or
            ``layer_norm`` is not a bool.
        ValueError: bad sizes, ``layer_norm_eps`` or ``gamma_init``.
    """

    _what = "attention"
    attention: nn.Module
    rotary: RotaryEmbedding | None
    gate_proj: nn.Linear | None
    # Read by nn.TransformerEncoder(Layer): see Note [torch fast paths].
    _qkv_same_embed_dim = False
    in_proj_weight = NO_PACKED_PROJECTION
    in_proj_bias = NO_PACKED_PROJECTION

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        attention: nn.Module,
        *,
        num_kv_heads: int | None = None,
        bias: bool = True,
        layer_norm: bool = True,
        layer_norm_eps: float = 1e-5,
        gamma_init: float = 1.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        batch_first: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(attention, nn.Module):
            raise TypeError(
                f"attention must be an nn.Module over (batch, seq_len, heads, head_dim) tensors, "
                f"got {attention!r} ({type(attention).__name__}); e.g. "
                f"MultiheadAttention(512, 8, DilatedAttention([2048, 4096], [1, 2]))"
            )
        if not isinstance(batch_first, bool):
            raise TypeError(
                f"batch_first must be a bool (True: (batch, seq_len, embed_dim) inputs; False: "
                f"(seq_len, batch, embed_dim)), got {batch_first!r}"
            )
        self.num_kv_heads = V.check_heads(embed_dim, num_heads, num_kv_heads)
        bias = V.check_bool("bias", bias)
        layer_norm = V.check_bool("layer_norm", layer_norm)
        layer_norm_eps = V.check_positive_float("layer_norm_eps", layer_norm_eps, fix=V.EPS_FIX)
        gamma_init = V.check_positive_float("gamma_init", gamma_init, fix=V.GAMMA_FIX)
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.kdim = self.vdim = embed_dim
        self.head_dim = embed_dim // num_heads
        self.batch_first = batch_first
        self.gamma_init = gamma_init
        factory = {"device": device, "dtype": dtype}
        kv_dim = self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.norm = nn.LayerNorm(embed_dim, eps=layer_norm_eps, **factory) if layer_norm else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        # Note [Gates from the layer input]: per-head gates for an inner module that takes them.
        gates = _gates_per_head(attention)
        self.gate_proj = (
            nn.Linear(embed_dim, num_heads * gates, bias=bias, **factory) if gates else None
        )
        # Rotary positions applied to q and k between the projections and attention
        # (use_rotary); None: none.
        self.rotary = None
        self.reset_parameters()
        self.attention = attention

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
        if self.gate_proj is not None:  # every gate starts at sigmoid(0) = 1/2
            nn.init.zeros_(self.gate_proj.weight)
            if self.gate_proj.bias is not None:
                nn.init.zeros_(self.gate_proj.bias)

    def use_rotary(self, base: float = 10000.0) -> MultiheadAttention:
        """Rotate q and k by their positions (RoPE, :class:`~dilated_attention.rotary.
        RotaryEmbedding` with frequency ``base``) between the projections and attention, at the
        ``positions`` given to :meth:`forward`; returns the layer. Adds no parameters."""
        self.rotary = RotaryEmbedding(self.head_dim, base)
        return self

    def _default_positions(self, n: int, device: torch.device) -> torch.Tensor:
        """The rows' positions when ``forward`` is given none: ``0..N-1`` (a layer over a
        sharded sequence gives its shard's global positions)."""
        return torch.arange(n, device=device)

    def _check_positions(
        self, positions: object, n: int, device: torch.device
    ) -> torch.Tensor | None:
        """The (N,) integer positions of the rows for rotary (:meth:`_default_positions` when
        None); None without rotary."""
        if self.rotary is None:
            if positions is not None:
                raise ValueError(
                    "positions are only used with rotary embeddings, which this layer does not "
                    "apply; call layer.use_rotary() first, or pass positions=None"
                )
            return None
        if positions is None:
            return self._default_positions(n, device)
        if not isinstance(positions, torch.Tensor):
            raise TypeError(f"positions must be a (seq_len,) int tensor or None, got {positions!r}")
        if positions.shape != (n,) or positions.is_floating_point() or positions.is_complex():
            raise ValueError(
                f"positions must be a (seq_len={n},) integer tensor (the rows' global positions),"
                f" got shape {tuple(positions.shape)} and dtype {positions.dtype}"
            )
        if positions.device != device:
            raise ValueError(
                f"positions must be on the inputs' device {device}, got {positions.device}; "
                f"move them with positions.to({str(device)!r})"
            )
        return positions

    def _check_key_padding_mask(self, mask: object, query: torch.Tensor) -> None:
        """Check the (B, N) key padding mask before any projection is computed."""
        V.check_key_padding_mask(mask, query.shape[0], query.shape[1], query.device)

    @property
    def _layout(self) -> str:
        return "(batch, seq_len, embed_dim)" if self.batch_first else "(seq_len, batch, embed_dim)"

    def _check_input(self, name: str, x: object) -> torch.Tensor:
        """Check one (B, N, E) input (N, B, E with ``batch_first=False``); return it batch first."""
        layout = self._layout.replace("embed_dim", f"embed_dim={self.embed_dim}")
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a tensor {layout}, got {type(x)}")
        if x.is_nested:
            raise ValueError(
                f"{name} must be a padded tensor {layout}, got a nested tensor; pad it "
                f"(x.to_padded_tensor(0.0)) and pass key_padding_mask (True = padding)"
            )
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(
                f"{name} must have shape {layout} (batch_first={self.batch_first}), got "
                f"{name}.shape={tuple(x.shape)}"
            )
        return x if self.batch_first else x.transpose(0, 1)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        *,
        positions: torch.Tensor | None = None,
        cache: Cache | None = None,
        cu_seqlens: torch.Tensor | list[int] | tuple[int, ...] | None = None,
        block_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, None]:
        """Attention over ``query``, with ``nn.MultiheadAttention.forward``'s arguments.

        Args:
            query: (B, N, E), or (N, B, E) when built with ``batch_first=False``.
            key: like ``query``, or None for self-attention (``key = query``). It may be another
                tensor (cross-attention) of the same batch size and length as ``query``.
            value: like ``key``, or None (``value = key``).
            key_padding_mask: (B, N), ``True`` (bool) or ``-inf`` (float, as torch's layers pass
                it) = ignore that key; None = no padding.
            need_weights: must be False (the default here; ``nn.MultiheadAttention``'s default
                is True): the attention weights are never materialised.
            attn_mask: None, or the causal mask (L, L) with L = N:
                ``nn.Transformer.generate_square_subsequent_mask(N)`` (float, ``-inf`` above the
                diagonal, 0 elsewhere) or its bool form (``True`` above the diagonal). It means
                ``is_causal=True``; any other mask raises. Checking it costs one O(N^2)
                comparison per call: pass ``is_causal=True`` alone to skip it.
            average_attn_weights: ignored (it only applies to the weights, never returned).
            is_causal: causal attention (``attn_mask`` may be omitted, unlike in torch).
            positions: (N,) integer positions of the rows, for the rotary embeddings of
                :meth:`use_rotary` (default ``0..N-1``; a rank holding a shard of a sequence
                passes its global positions, :func:`dilated_attention.sequence_positions`).
                Only with rotary.
            cache: this layer's decoding cache (a :class:`~dilated_attention.DilatedKVCache`
                or static one for a dilated layer, a :class:`~dilated_attention.WindowKVCache`
                or static one for a local layer), for decoding (``is_causal=True``, ``query``
                the new tokens; with rotary their positions default to the ones after those
                the cache has seen, and ``positions`` given must be those: checked on the
                host). Only with an inner module that takes one (``DilatedAttention``,
                ``LocalAttention``).
            cu_seqlens: packed documents, as in :func:`dilated_attention.dilated_attention`
                (offsets over the batch's rows read one after another); with rotary and no
                ``positions``, each document's positions start at 0. Only with an inner module
                that takes them (``DilatedAttention``, ``LocalAttention``).
            block_mask: this call's run-time block mask (Note [Run-time block masks] in
                ``block_sparse/runtime.py``), over the projected heads. Only with an inner
                module that takes one (``BlockSparseAttention``).

        Returns:
            ``(out, None)``, ``out`` shaped like ``query``.

        Raises:
            ValueError: ``need_weights=True``; a non-causal ``attn_mask``; a bad shape, a key
                length other than the query's, or a bad ``key_padding_mask``.
            TypeError: an argument that is not a tensor.

        Shape legend: B batch, N seq_len, E embed_dim. Causal, N = 4 (x = masked)::

            attn_mask = [[0, x, x, x],
                         [0, 0, x, x],
                         [0, 0, 0, x],
                         [0, 0, 0, 0]]
        """
        del average_attn_weights  # only shapes the weights, which are never returned
        self._refuse_weights(need_weights)
        query, key, value = self._batch_first_inputs(query, key, value)
        documents = self._documents(cu_seqlens, query, cache)
        inputs = LayerInputs(
            query, key, value,
            is_causal=self._is_causal(attn_mask, is_causal, query),
            key_padding_mask=self._checked_key_padding_mask(key_padding_mask, query),
            positions=self._cache_positions(cache, positions, query, documents),
            cache=cache, documents=documents, block_mask=self._block_mask(block_mask),
        )  # fmt: skip
        return self._output(self._attend(inputs)), None

    def _block_mask(self, block_mask: torch.Tensor | None) -> torch.Tensor | None:
        """``block_mask`` where the inner module takes one (checked there), else it raises."""
        if block_mask is not None and not getattr(self.attention, "takes_block_mask", False):
            raise ValueError(
                f"block_mask (a run-time block mask) needs a layer whose inner module takes one "
                f"(BlockSparseAttention), got {type(self.attention).__name__}; call without "
                f"block_mask, or use a block-sparse layer"
            )
        return block_mask

    def _refuse_weights(self, need_weights: bool) -> None:
        """``need_weights=True`` raises: the (N x N) weights are never materialised."""
        if need_weights:
            raise ValueError(
                f"need_weights=True is not supported: {self._what} never materialises the "
                "(N x N) weights; call with need_weights=False (torch's Transformer layers do)"
            )

    def _batch_first_inputs(
        self, query: object, key: object, value: object
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The checked (B, N, E) query, key and value (key defaults to query, value to key), of
        one batch size and length."""
        query = self._check_input("query", query)
        key = query if key is None else self._check_input("key", key)
        value = key if value is None else self._check_input("value", value)
        if key.shape[:2] != query.shape[:2] or value.shape[:2] != query.shape[:2]:
            raise ValueError(
                f"key and value must have the batch size and seq_len of query ({self._what} "
                f"works within one sequence), got query.shape={tuple(query.shape)}, "
                f"key.shape={tuple(key.shape)}, value.shape={tuple(value.shape)} (batch first); "
                f"for cross-attention over a memory of another length use nn.MultiheadAttention"
            )
        return query, key, value

    def _is_causal(self, attn_mask: object, is_causal: bool, query: torch.Tensor) -> bool:
        """``is_causal``, or True for an ``attn_mask`` that is the causal (N, N) mask; any
        other mask raises. ``query``: (B, N, E)."""
        if attn_mask is None:
            return is_causal
        n = query.shape[1]
        mask = V.check_attn_mask(attn_mask, n, query.device)
        if not is_causal_mask(mask):
            hint = " (with is_causal=True as its hint)" if is_causal else ""
            raise ValueError(
                f"attn_mask{hint} is not the causal mask: got a {tuple(mask.shape)} "
                f"{mask.dtype} mask of another pattern, expected "
                f"nn.Transformer.generate_square_subsequent_mask({n}) (-inf above the "
                f"diagonal, 0 elsewhere) or its bool form (True above the diagonal); "
                f"{V.ATTN_MASK_FIX}"
            )
        return True

    def _checked_key_padding_mask(
        self, mask: torch.Tensor | None, query: torch.Tensor
    ) -> torch.Tensor | None:
        """The (B, N) key padding mask as bool (True = ignore), checked before any projection;
        a (N, B) mask, as a seq-first caller may pass, raises with its cause."""
        batch, n = query.shape[:2]
        if isinstance(mask, torch.Tensor) and mask.shape == (n, batch) != (batch, n):
            why = (
                "it is (batch, seq_len) even with batch_first=False, as in nn.MultiheadAttention"
                if not self.batch_first
                else f"query.shape={tuple(query.shape)} looks seq-first (seq_len, batch, "
                f"embed_dim): build this layer with batch_first=False when the stock layer it "
                f"replaces was built so (nn.Transformer*Layer's default)"
            )
            raise ValueError(
                f"key_padding_mask must have shape (batch, seq_len) = {(batch, n)}, got "
                f"{tuple(mask.shape)}; {why}"
            )
        mask = bool_key_padding_mask(mask)
        self._check_key_padding_mask(mask, query)
        return mask

    def _documents(
        self, cu_seqlens: object, query: torch.Tensor, cache: object
    ) -> tuple[int, ...] | None:
        """Packed documents' checked offsets over ``query`` (B, N, E), or None."""
        if cu_seqlens is None:
            return None
        if not getattr(self.attention, "takes_documents", False):
            raise ValueError(
                f"cu_seqlens (packed documents) needs a layer whose inner module takes them "
                f"(DilatedAttention, LocalAttention), got {type(self.attention).__name__}; give "
                f"each document "
                f"its own row"
            )
        if cache is not None:
            return check_cu_seqlens(cu_seqlens, query, query, cache)
        return self._check_documents(cu_seqlens, query)

    def _check_documents(self, cu_seqlens: object, query: torch.Tensor) -> tuple[int, ...]:
        """Packed documents' checked offsets over the batch of ``query`` (B, N, E)."""
        return check_cu_seqlens(cu_seqlens, query, query)

    def _document_positions(
        self, documents: tuple[int, ...], query: torch.Tensor
    ) -> torch.Tensor:
        """Rotary positions of packed rows: (B * N,), 0 at every document's first token."""
        return document_positions(documents, query.device)

    def _cache_positions(
        self,
        cache: object,
        positions: object,
        query: torch.Tensor,
        documents: tuple[int, ...] | None = None,
    ) -> torch.Tensor | None:
        """The rows' checked (N,) positions for rotary (None without rotary), after checking
        ``cache``: with a cache they are the ones after the tokens it holds (Note [One cache per
        layer]); with packed ``documents`` and none given, (B * N,) positions that start at 0 in
        every document. ``query``: (B, N, E)."""
        n, device = query.shape[1], query.device
        check_cache_type(cache)
        if cache is not None and not getattr(self.attention, "decodes_with_cache", False):
            raise ValueError(
                f"cache= needs a layer whose inner module decodes (DilatedAttention, "
                f"LocalAttention), got {type(self.attention).__name__}; decode with a local "
                f"dilated or windowed layer"
            )
        if documents is not None and positions is None and self.rotary is not None:
            return self._document_positions(documents, query)  # a packed prompt's too
        if isinstance(cache, StaticKVCache):
            return self._static_positions(cache, positions, n, device)
        if cache is not None and positions is not None and documents is None:
            cache.check_positions(self._check_positions(positions, n, device))
        elif cache is not None and self.rotary is not None and documents is None:
            positions = torch.arange(cache.length, cache.length + n, device=device)
        return self._check_positions(positions, n, device)

    def _static_positions(
        self, cache: StaticKVCache, positions: object, n: int, device: torch.device
    ) -> torch.Tensor | None:
        """Rotary positions of new tokens with a static cache (None without rotary): one token
        per row at each row's own position, (B,) on the device (no synchronization: Note [A
        decode step with static shapes]); several tokens at the positions after the cache's."""
        if positions is not None:
            raise ValueError(
                f"with a {type(cache).__name__} the new tokens' positions are the cache's (each "
                f"row's next one, kept on the device); pass positions=None"
            )
        if self.rotary is None:
            return None
        if n == 1 and cache.lengths is not None:
            return cache.lengths
        start = cache.length
        return torch.arange(start, start + n, device=device)

    def _attend(self, inputs: LayerInputs) -> torch.Tensor:
        """Projections, rotary positions and the inner module -> (B, N, H, D)."""
        q = rearrange(self.q_proj(inputs.query), "b n (h d) -> b n h d", h=self.num_heads)
        k = rearrange(self.k_proj(inputs.key), "b n (h d) -> b n h d", h=self.num_kv_heads)
        v = rearrange(self.v_proj(inputs.value), "b n (h d) -> b n h d", h=self.num_kv_heads)
        if self.rotary is not None and inputs.positions is not None:
            q, k = (self._rotate(x, inputs.positions) for x in (q, k))
        masks = {"is_causal": inputs.is_causal, "key_padding_mask": inputs.key_padding_mask}
        if inputs.documents is not None:
            masks["cu_seqlens"] = inputs.documents  # with a cache: a packed prompt
        if inputs.block_mask is not None:
            masks["block_mask"] = inputs.block_mask
        if self.gate_proj is not None:
            gates = torch.sigmoid(self.gate_proj(inputs.query))
            gates = rearrange(gates, "b n (h c) -> b n h c", h=self.num_heads)
            masks["gates"] = gates.to(q.dtype)
        if inputs.cache is None:
            return self.attention(q, k, v, **masks)
        return self.attention(q, k, v, **masks, cache=inputs.cache)

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotary at (N,) positions, or at (B * N,) ones over the flattened batch."""
        assert self.rotary is not None
        if positions.shape[0] == x.shape[1]:
            return self.rotary(x, positions)
        return self.rotary(flatten(x), positions).view_as(x)

    def _output(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, H, D) -> sub-LayerNorm and output projection -> (B, N, E), or (N, B, E) when
        built with ``batch_first=False``."""
        x = rearrange(x, "b n h d -> b n (h d)")
        if self.norm is not None:
            x = self.norm(x)
        out = self.out_proj(x)
        return out if self.batch_first else out.transpose(0, 1)

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"batch_first={self.batch_first}"
        )


def _gates_per_head(attention: nn.Module) -> int:
    """How many gates per head ``attention`` takes in each call (its ``gates_per_head``; 0:
    none).

    Note [Gates from the layer input]
        NSA weighs its branches by gates computed from the layer's input, ``g = sigmoid(x
        W_g)``, one per branch and head. An inner module that combines branches so says
        ``gates_per_head = C``; this layer then holds ``gate_proj``, a linear map from the
        query input (B, N, E) to ``H * C`` gates, and passes ``gates=sigmoid(gate_proj(x))``
        as (B, N, H, C) in the query's dtype to every call. Its weights start at zero: every
        gate starts at 1/2, and learns from the gradient ``dout . o_c`` of its branch.
    """
    gates = getattr(attention, "gates_per_head", 0)
    if isinstance(gates, bool) or not isinstance(gates, int) or gates < 0:
        raise TypeError(
            f"{type(attention).__name__}.gates_per_head must be an int >= 0 (gates per head "
            f"each call takes), got {gates!r}"
        )
    return gates


#: The multihead layer's own constructor arguments; the factory passes the others to the inner
#: module of a kind registered without a multihead constructor.
LAYER_ARGUMENTS = frozenset(
    {"embed_dim", "num_heads", "num_kv_heads", "bias", "layer_norm", "layer_norm_eps",
     "gamma_init", "batch_first", "device", "dtype"}
)  # fmt: skip
