"""``nn.Module`` wrappers: :class:`DilatedAttention`, :class:`MultiheadDilatedAttention`,
:class:`BlockSparseAttention` and :class:`BlockSparseMultiheadAttention`.

Shape legend: B batch, N seq_len, E embed_dim, H heads, Hkv key/value heads, D head dim = E // H.
"""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange
from torch import nn

from . import _validation as V
from .backends.registry import check_backend_name
from .block_sparse import block_sparse_attention
from .block_sparse.plan import check_block_size
from .config import DilatedConfig, MultiheadDilatedConfig
from .core.kv_cache import DilatedKVCache
from .core.schedule_state import BlockSparseScheduleState, DilatedScheduleState
from .functional import dilated_attention
from .patterns import Pattern, check_pattern
from .rotary import RotaryEmbedding

__all__ = [
    "BlockSparseAttention",
    "BlockSparseMultiheadAttention",
    "DilatedAttention",
    "MultiheadAttention",
    "MultiheadDilatedAttention",
]


class DilatedAttention(DilatedScheduleState, nn.Module):
    """Dilated attention over (B, N, H, D) tensors; see :func:`dilated_attention`.

    Args:
        segment_lengths: w per branch.
        dilation_rates: r per branch.
        scale: softmax scale; ``None`` means ``D ** -0.5``.
        dropout: attention-probability dropout, applied in training mode only.
        backend: kernel name, or ``None`` / ``"auto"`` to choose per call.

    Raises:
        ValueError / TypeError: a bad schedule, scale, dropout or backend name.
    """

    #: Its forward takes ``cache=`` (decoding); a subclass whose forward does not says False.
    decodes_with_cache = True

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
        backend = check_backend_name(backend)  # "auto" -> None
        self.config = DilatedConfig(
            segment_lengths=segment_lengths, dilation_rates=dilation_rates, scale=scale,
            dropout=dropout, backend=backend,
        )  # fmt: skip
        self.segment_lengths = self.config.segment_lengths
        self.dilation_rates = self.config.dilation_rates
        self.scale, self.dropout, self.backend = self.config.scale, self.config.dropout, backend

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
        cache: DilatedKVCache | None = None,
    ) -> torch.Tensor:
        """Args: query (B, N, H, D); key, value (B, N, Hkv, D); key_padding_mask (B, N) bool;
        cache: a :class:`~dilated_attention.DilatedKVCache` for decoding (``is_causal=True``,
        the new tokens' query, key and value).

        Returns:
            (B, N, H, D).
        """
        out = dilated_attention(
            query, key, value, self.segment_lengths, self.dilation_rates,
            is_causal=is_causal, scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0,
            key_padding_mask=key_padding_mask, backend=self.backend, cache=cache,
        )  # fmt: skip
        assert isinstance(out, torch.Tensor)  # return_lse=False: for the type checker
        return out

    def extra_repr(self) -> str:
        return (
            f"segment_lengths={list(self.segment_lengths)}, "
            f"dilation_rates={list(self.dilation_rates)}, dropout={self.dropout}, "
            f"backend={self.backend!r}"
        )


# Note [torch fast paths]
# ~~~~~~~~~~~~~~~~~~~~~~~
# nn.TransformerEncoderLayer (and nn.TransformerEncoder) in eval mode may skip ``self_attn``
# altogether: they call torch's fused kernels (``torch._transformer_encoder_layer_fwd``, or turn
# padded input into nested tensors) with ``self_attn.in_proj_weight`` / ``in_proj_bias``, which
# would silently compute dense attention. They decide from attributes of ``self_attn``
# (``why_not_sparsity_fast_path`` in torch/nn/modules/transformer.py):
#   * ``_qkv_same_embed_dim = False`` (true here: q/k/v are separate ``nn.Linear``s, nothing is
#     packed) stops the layer's fast path, and makes an ``nn.TransformerEncoder`` built around
#     such a layer turn off its nested-tensor path (torch warns that it does).
#   * An encoder built around stock ``nn.MultiheadAttention`` and swapped afterwards keeps its
#     nested-tensor path switched on; it then reads ``in_proj_weight`` and bails out only when
#     some argument "has_torch_function" or requires grad. ``None`` (what
#     ``nn.MultiheadAttention`` holds when nothing is packed) crashes there under grad
#     (``None.requires_grad``) and lets nested tensors through under ``no_grad``. So
#     ``in_proj_weight`` and ``in_proj_bias`` are a placeholder that defines
#     ``__torch_function__``: torch then always takes the ordinary path, which calls this
#     module's forward; any other use of the placeholder raises an error naming q/k/v_proj.


class _NoPackedProjection:
    """Placeholder for ``nn.MultiheadAttention``'s packed ``in_proj_weight``/``in_proj_bias``.

    See Note [torch fast paths]. Any torch function given it, and any attribute read from it,
    raises an error that points to the separate ``q_proj``, ``k_proj`` and ``v_proj``.
    """

    __slots__ = ()
    _WHY = (
        "this layer has no packed in_proj_weight / in_proj_bias (nn.MultiheadAttention's "
        "(3 * embed_dim, embed_dim) projection): its query/key/value projections are the separate "
        "nn.Linear modules q_proj, k_proj and v_proj; use those"
    )

    @classmethod
    def __torch_function__(
        cls,
        func: object,
        types: object,
        args: object = (),
        kwargs: object = None,
    ) -> object:
        raise TypeError(f"{getattr(func, '__name__', func)} got a placeholder: {cls._WHY}")

    def __getattr__(self, name: str) -> object:
        raise AttributeError(f"in_proj_weight/in_proj_bias has no attribute {name!r}: {self._WHY}")

    def __repr__(self) -> str:
        return "<no packed in_proj: see q_proj, k_proj, v_proj>"


_NO_PACKED_PROJECTION = _NoPackedProjection()


def _is_causal_mask(mask: torch.Tensor) -> bool:
    """Whether a checked (L, L) ``attn_mask`` is exactly the causal mask.

    Bool: ``True`` (masked) exactly above the diagonal. Float: ``-inf`` exactly above the diagonal
    and ``0`` elsewhere (``nn.Transformer.generate_square_subsequent_mask``; also what torch's
    layers turn a bool mask into). One O(L^2) comparison and one host sync.
    """
    n = mask.shape[-1]
    future = torch.ones(n, n, dtype=torch.bool, device=mask.device).triu_(1)
    if mask.dtype == torch.bool:
        return torch.equal(mask, future)
    causal = torch.zeros(n, n, dtype=mask.dtype, device=mask.device)
    return torch.equal(mask, causal.masked_fill_(future, float("-inf")))


def _bool_key_padding_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A float ``key_padding_mask`` as torch's layers pass it (``F._canonical_mask``: ``-inf`` =
    ignore, ``0`` = keep) turned into the bool form; anything else is returned unchanged for
    :func:`_validation.check_key_padding_mask` to judge."""
    if not isinstance(mask, torch.Tensor) or not mask.is_floating_point():
        return mask
    ignore = torch.isneginf(mask)
    if not bool((ignore | (mask == 0)).all()):
        raise ValueError(
            "key_padding_mask as a float tensor must hold only 0 (keep) and -inf (ignore that "
            "key), as torch's layers pass it; other additive biases are not supported, got values "
            f"in [{mask.min().item()}, {mask.max().item()}]; pass a bool mask (True = ignore)"
        )
    return ignore


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
            (B, N, H, D).
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
    # Read by nn.TransformerEncoder(Layer): see Note [torch fast paths].
    _qkv_same_embed_dim = False
    in_proj_weight = _NO_PACKED_PROJECTION
    in_proj_bias = _NO_PACKED_PROJECTION

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
        cache: DilatedKVCache | None = None,
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
            cache: a :class:`~dilated_attention.DilatedKVCache` of this layer, for decoding
                (``is_causal=True``, ``query`` the new tokens; with rotary their positions
                default to the ones after those the cache has seen, and ``positions`` given must
                be those: checked on the host). Only with an inner module that takes one
                (``DilatedAttention``).

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
        if need_weights:
            raise ValueError(
                f"need_weights=True is not supported: {self._what} never materialises the "
                "(N x N) weights; call with need_weights=False (torch's Transformer layers do)"
            )
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
        batch, n = query.shape[:2]
        if attn_mask is not None:
            if not _is_causal_mask(V.check_attn_mask(attn_mask, n, query.device)):
                hint = " (with is_causal=True as its hint)" if is_causal else ""
                raise ValueError(
                    f"attn_mask{hint} is not the causal mask: got a {tuple(attn_mask.shape)} "
                    f"{attn_mask.dtype} mask of another pattern, expected "
                    f"nn.Transformer.generate_square_subsequent_mask({n}) (-inf above the "
                    f"diagonal, 0 elsewhere) or its bool form (True above the diagonal); "
                    f"{V.ATTN_MASK_FIX}"
                )
            is_causal = True
        kpm = key_padding_mask
        if isinstance(kpm, torch.Tensor) and kpm.shape == (n, batch) != (batch, n):
            why = (
                "it is (batch, seq_len) even with batch_first=False, as in nn.MultiheadAttention"
                if not self.batch_first
                else f"query.shape={tuple(query.shape)} looks seq-first (seq_len, batch, "
                f"embed_dim): build this layer with batch_first=False when the stock layer it "
                f"replaces was built so (nn.Transformer*Layer's default)"
            )
            raise ValueError(
                f"key_padding_mask must have shape (batch, seq_len) = {(batch, n)}, got "
                f"{tuple(kpm.shape)}; {why}"
            )
        key_padding_mask = _bool_key_padding_mask(key_padding_mask)
        self._check_key_padding_mask(key_padding_mask, query)
        if cache is not None and not isinstance(cache, DilatedKVCache):
            raise TypeError(
                f"cache must be a DilatedKVCache or None, got {type(cache).__name__}; build one "
                f"per layer: DilatedKVCache(segment_lengths, dilation_rates)"
            )
        if cache is not None and positions is not None:  # Note [One cache per layer]
            cache.check_positions(self._check_positions(positions, n, query.device))
        elif cache is not None and self.rotary is not None:  # they follow the cache's tokens
            positions = torch.arange(cache.length, cache.length + n, device=query.device)
        positions = self._check_positions(positions, n, query.device)
        if cache is not None and not getattr(self.attention, "decodes_with_cache", False):
            raise ValueError(
                f"cache= needs a layer whose inner module decodes (DilatedAttention), got "
                f"{type(self.attention).__name__}; decode with a local dilated layer"
            )
        q = rearrange(self.q_proj(query), "b n (h d) -> b n h d", h=self.num_heads)
        k = rearrange(self.k_proj(key), "b n (h d) -> b n h d", h=self.num_kv_heads)
        v = rearrange(self.v_proj(value), "b n (h d) -> b n h d", h=self.num_kv_heads)
        if self.rotary is not None and positions is not None:
            q, k = self.rotary(q, positions), self.rotary(k, positions)
        if cache is None:
            x = self.attention(q, k, v, is_causal=is_causal, key_padding_mask=key_padding_mask)
        else:
            x = self.attention(
                q, k, v, is_causal=is_causal, key_padding_mask=key_padding_mask, cache=cache
            )
        x = rearrange(x, "b n h d -> b n (h d)")
        if self.norm is not None:
            x = self.norm(x)
        out = self.out_proj(x)
        return (out if self.batch_first else out.transpose(0, 1)), None

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"batch_first={self.batch_first}"
        )


#: The multihead layer's own constructor arguments; the factory passes the others to the inner
#: module of a kind registered without a multihead constructor.
LAYER_ARGUMENTS = frozenset(
    {"embed_dim", "num_heads", "num_kv_heads", "bias", "layer_norm", "layer_norm_eps",
     "gamma_init", "batch_first", "device", "dtype"}
)  # fmt: skip


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
    ) -> None:
        config = MultiheadDilatedConfig(
            embed_dim=embed_dim, num_heads=num_heads, segment_lengths=segment_lengths,
            dilation_rates=dilation_rates, num_kv_heads=num_kv_heads, dropout=dropout, bias=bias,
            layer_norm=layer_norm, layer_norm_eps=layer_norm_eps, gamma_init=gamma_init,
            backend=check_backend_name(backend),  # "auto" -> None
        )  # fmt: skip
        attention = DilatedAttention(
            config.segment_lengths, config.dilation_rates, dropout=config.dropout,
            backend=config.backend,
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


class BlockSparseAttention(BlockSparseScheduleState, nn.Module):
    """Block-sparse attention over (B, N, H, D) tensors; see :func:`block_sparse_attention`.

    Args:
        pattern: a :mod:`dilated_attention.patterns` pattern.
        block_size: tokens per block (the last block may be shorter).
        scale: softmax scale; ``None`` means ``D ** -0.5``.
        backend: ``None`` or ``"auto"`` (FlexAttention on CUDA where it runs, else the
            registry's choice), ``"flex"``, or a kernel name for the fallback.

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
        self.backend = check_backend_name(backend)

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
        V.check_no_key_padding_mask(key_padding_mask)
        out = block_sparse_attention(
            query, key, value, self.pattern, block_size=self.block_size, is_causal=is_causal,
            scale=self.scale, backend=self.backend,
        )  # fmt: skip
        assert isinstance(out, torch.Tensor)  # return_lse=False: for the type checker
        return out

    def extra_repr(self) -> str:
        return f"pattern={self.pattern!r}, block_size={self.block_size}, backend={self.backend!r}"


class BlockSparseMultiheadAttention(MultiheadAttention):
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
        layer_norm_eps: its epsilon (finite, > 0).
        gamma_init: MAGNETO gain on the value and output projections.
        scale: softmax scale (``None``: head_dim ** -0.5).
        backend: as in :class:`BlockSparseAttention`.
        device, dtype: factory kwargs for the parameters.

    ``forward(query, key=None, value=None, key_padding_mask=None, need_weights=False,
    attn_mask=None, average_attn_weights=True, is_causal=False) -> (out, None)`` with (B, N, E)
    tensors, as :meth:`MultiheadDilatedAttention.forward`; ``key_padding_mask`` must be None.
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
        self._init_layer(
            embed_dim, num_heads, attention, num_kv_heads=num_kv_heads, bias=bias,
            layer_norm=layer_norm, layer_norm_eps=layer_norm_eps, gamma_init=gamma_init,
            device=device, dtype=dtype,
        )  # fmt: skip

    def _init_layer(
        self, embed_dim: int, num_heads: int, attention: nn.Module, **layer: Any
    ) -> None:
        """:class:`MultiheadAttention`'s constructor around ``attention``, an inner block-sparse
        module (here :class:`BlockSparseAttention`; the ring layer's own), keeping its
        ``pattern`` and ``block_size``."""
        MultiheadAttention.__init__(self, embed_dim, num_heads, attention, **layer)
        self.pattern, self.block_size = attention.pattern, attention.block_size


def build_block_sparse_kind(
    cls: type[nn.Module], kind: str, kwargs: dict[str, object]
) -> nn.Module:
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
    return build_block_sparse_kind(BlockSparseAttention, "block_sparse", kwargs)


def build_block_sparse_multihead(**kwargs: object) -> nn.Module:
    """Factory constructor of kind ``"block_sparse"`` (:class:`BlockSparseMultiheadAttention`)."""
    return build_block_sparse_kind(BlockSparseMultiheadAttention, "block_sparse", kwargs)


#: Read by the factory when kind="block_sparse" is first requested (``factory._PROVIDERS``).
FACTORY_KINDS = {"block_sparse": (build_block_sparse, build_block_sparse_multihead)}
