"""Block-sparse attention as modules: :class:`BlockSparseAttention` over (B, N, H, D) tensors,
:class:`BlockSparseMultiheadAttention` (the multihead layer around it), and the factory's
constructors of kind ``"block_sparse"``.

Shape legend: B batch, N seq_len, E embed_dim, H heads, Hkv key/value heads, D head dim = E // H.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import _validation as V
from ..backends.registry import check_backend_name
from ..block_sparse.plan import check_block_size
from ..core.geometry.schedule_state import BlockSparseScheduleState
from ..functional import block_sparse_attention
from ..patterns import Pattern, check_pattern
from .multihead import MultiheadAttention
from .scores import learnable_sinks, score_repr

__all__ = [
    "FACTORY_KINDS",
    "BlockSparseAttention",
    "BlockSparseMultiheadAttention",
    "build_block_sparse_kind",
]


class BlockSparseAttention(BlockSparseScheduleState, nn.Module):
    """Block-sparse attention over (B, N, H, D) tensors; see :func:`block_sparse_attention`.

    A call may pass a run-time block mask (``forward(..., block_mask=mask)``): the blocks of
    that call, in place of the pattern (Note [Run-time block masks] in
    ``block_sparse/runtime.py``).

    Args:
        pattern: a :mod:`dilated_attention.patterns` pattern, the blocks of calls without a
            run-time mask.
        block_size: tokens per block (the last block may be shorter).
        scale: softmax scale; ``None`` means ``D ** -0.5``.
        backend: ``None`` or ``"auto"`` (FlexAttention on CUDA where it runs, else the
            registry's choice), ``"flex"``, or a kernel name for the fallback.
        softcap: soft-capped scores ``c * tanh(s / c)``, or None.
        sinks: learnable attention sinks for this many query heads, or None (Note [Local
            windows, soft-capping and sinks] in ``core/sinks.py``).

    Raises:
        TypeError: ``pattern`` is not a Pattern.
        ValueError: ``block_size < 1``, an unknown backend, a bad soft-cap or sink count.
    """

    #: Its calls take a run-time block mask (the multihead layer passes ``block_mask`` on).
    takes_block_mask = True

    def __init__(
        self,
        pattern: Pattern,
        *,
        block_size: int = 128,
        scale: float | None = None,
        backend: str | None = None,
        softcap: float | None = None,
        sinks: int | None = None,
    ) -> None:
        super().__init__()
        self.pattern = check_pattern(pattern)
        self.block_size = check_block_size(block_size)
        self.scale = V.check_scale(scale)
        self.backend = check_backend_name(backend)
        self.softcap = V.check_softcap(softcap)
        self.sinks = learnable_sinks(sinks)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        is_causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
        block_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Args: query (B, Nq, H, D); key, value (B, Nk, Hkv, D); ``key_padding_mask`` must be
        None (it exists for the multihead layer's call signature); ``block_mask``: this call's
        run-time block mask in place of the pattern, bool (B or 1, H, Hkv or 1, Mq, Mk) or int
        block indices (B or 1, H, Hkv or 1, Mq, K) on the inputs' device, or None (the
        pattern).

        Returns:
            (B, Nq, H, D).
        """
        V.check_no_key_padding_mask(key_padding_mask)
        blocks = self.pattern if block_mask is None else block_mask
        out = block_sparse_attention(
            query, key, value, blocks, block_size=self.block_size, is_causal=is_causal,
            scale=self.scale, backend=self.backend, softcap=self.softcap, sinks=self.sinks,
        )  # fmt: skip
        assert isinstance(out, torch.Tensor)  # return_lse=False: for the type checker
        return out

    def extra_repr(self) -> str:
        return (
            f"pattern={self.pattern!r}, block_size={self.block_size}, backend={self.backend!r}"
            + score_repr(None, self.softcap, self.sinks)
        )


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
        softcap: as in :class:`BlockSparseAttention`.
        sinks: learnable attention sinks, one logit per query head (``attention.sinks``).

    ``forward(query, key=None, value=None, key_padding_mask=None, need_weights=False,
    attn_mask=None, average_attn_weights=True, is_causal=False, *, block_mask=None) -> (out,
    None)`` with (B, N, E) tensors, as :meth:`MultiheadDilatedAttention.forward`;
    ``key_padding_mask`` must be None; ``block_mask``: a run-time block mask for this call, as
    in :class:`BlockSparseAttention`.
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
        softcap: float | None = None,
        sinks: bool = False,
    ) -> None:
        attention = BlockSparseAttention(
            pattern, block_size=block_size, scale=scale, backend=backend, softcap=softcap,
            sinks=num_heads if V.check_bool("sinks", sinks) else None,
        )  # fmt: skip
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
