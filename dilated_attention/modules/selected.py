"""Content-selected sparse attention as layers: :class:`BlockSelectedAttention` (MoBA-style,
the factory's kind ``"moba"``) and :class:`CompressedSelectedWindowAttention` (NSA-style, kind
``"nsa"``) over (B, N, H, D) tensors; their multihead layers are the library's
:class:`MultiheadAttention` around them (which adds NSA's gate projection).

Shape legend: B batch, N seq_len, E embed_dim, H heads, Hkv key/value heads, D head dim = E // H.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import _validation as V
from ..backends.registry import check_backend_name
from ..config import BlockSelectedConfig, CompressedSelectedWindowConfig
from ..sparse import moba_attention, nsa_attention
from ..sparse.nsa import BRANCHES
from .multihead import LAYER_ARGUMENTS, MultiheadAttention

__all__ = [
    "FACTORY_KINDS",
    "BlockSelectedAttention",
    "CompressedSelectedWindowAttention",
]


def _no_dropout(dropout: object, kind: str) -> None:
    """Selected-block layers have no attention-probability dropout: 0 is accepted (a model's
    configuration passes its dropout to every layer), anything else raises."""
    if V.check_dropout("dropout", dropout) != 0.0:
        raise ValueError(
            f"dropout={dropout!r}: {kind} attention has no attention-probability dropout (the "
            f"block-sparse kernels take none); pass dropout=0.0 (a LongNetConfig's dropout "
            f"applies to every layer: set it to 0.0 there)"
        )


class BlockSelectedAttention(nn.Module):
    """MoBA-style attention over (B, N, H, D) tensors: each query block attends its own block
    (causal) and the ``topk`` key blocks MoBA's gate selects from the content, on the
    block-sparse engine (:func:`~dilated_attention.sparse.moba_attention`). Gradients reach
    q, k and v through the attention, not through the choice.

    Args:
        block_size: positions per block (MoBA's ``moba_chunk_size``).
        topk: key blocks chosen per query block besides its own (MoBA's ``moba_topk`` - 1).
        scale: softmax scale; ``None`` means ``D ** -0.5``.
        backend: kernel name (as in :func:`~dilated_attention.block_sparse_attention`), or
            ``None`` / ``"auto"``.
        dropout: must be 0 (no attention-probability dropout here).

    Raises:
        ValueError: a size that is not a positive int, ``topk < 0``, an unknown backend, a
            bad scale or a dropout other than 0.
    """

    #: Its forward takes ``cu_seqlens=`` (packed documents: blocks chosen within each).
    takes_documents = True

    def __init__(
        self,
        block_size: int,
        topk: int,
        *,
        scale: float | None = None,
        backend: str | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        _no_dropout(dropout, "MoBA-style")
        backend = check_backend_name(backend)
        self.config = BlockSelectedConfig(
            block_size=block_size, topk=topk, scale=scale, backend=backend
        )
        self.block_size, self.topk = self.config.block_size, self.config.topk
        self.scale, self.backend = self.config.scale, backend

    @classmethod
    def from_config(cls, config: BlockSelectedConfig) -> BlockSelectedAttention:
        """The module of a :class:`~dilated_attention.config.BlockSelectedConfig`."""
        return cls(**config.kwargs())

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        is_causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | list[int] | tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """Args: query (B, Nq, H, D); key, value (B, Nk, Hkv, D); ``key_padding_mask`` must be
        None (it exists for the multihead layer's call); cu_seqlens: packed documents, each
        starting at a multiple of ``block_size`` within its row.

        Returns:
            (B, Nq, H, D).
        """
        V.check_no_key_padding_mask(key_padding_mask)
        return moba_attention(
            query, key, value, block_size=self.block_size, topk=self.topk,
            is_causal=is_causal, cu_seqlens=cu_seqlens, scale=self.scale,  # type: ignore[arg-type]
            backend=self.backend,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return f"block_size={self.block_size}, topk={self.topk}, backend={self.backend!r}"


class CompressedSelectedWindowAttention(nn.Module):
    """NSA-style attention over (B, N, H, D) tensors: compressed keys, selected blocks and a
    sliding window, each exact on the library's kernels, combined by gates or merged into one
    softmax (:func:`~dilated_attention.sparse.nsa_attention`, Note [NSA's three branches] in
    ``sparse/nsa.py``).

    With ``combine="gates"`` each call takes ``gates=`` (B, N, H, 3), activated: the library's
    :class:`MultiheadAttention` around this module computes them from its input (a linear map
    to ``H * 3`` gates and a sigmoid, its ``gate_proj``), as NSA does.

    Args:
        compress_block, compress_stride, select_block, topk, window, combine: as in
            :func:`~dilated_attention.sparse.nsa_attention` (NSA's ``l``, ``d``, ``l'``,
            ``n``, ``w``); defaults in :class:`~dilated_attention.config.
            CompressedSelectedWindowConfig`.
        scale: softmax scale; ``None`` means ``D ** -0.5``.
        backend: every branch's kernel name, or ``None`` / ``"auto"``.
        recompute: the backward runs the branches again a group of heads at a time instead of
            keeping their outputs, as in :func:`~dilated_attention.sparse.nsa_attention`.
        dropout: must be 0 (no attention-probability dropout here).

    Raises:
        ValueError: a size that is not a positive int, ``compress_stride > compress_block``,
            ``topk < 0``, an unknown ``combine`` or backend, a bad scale or a dropout other
            than 0.
    """

    def __init__(
        self,
        *,
        compress_block: int,
        compress_stride: int,
        select_block: int,
        topk: int,
        window: int,
        combine: str = "gates",
        scale: float | None = None,
        backend: str | None = None,
        recompute: bool = False,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        _no_dropout(dropout, "NSA-style")
        backend = check_backend_name(backend)
        self.config = CompressedSelectedWindowConfig(
            compress_block=compress_block, compress_stride=compress_stride,
            select_block=select_block, topk=topk, window=window, combine=combine, scale=scale,
            backend=backend, recompute=recompute,
        )  # fmt: skip
        #: Gates per head each call takes, which the multihead layer computes (0: none).
        self.gates_per_head = len(BRANCHES) if self.config.combine == "gates" else 0

    @classmethod
    def from_config(
        cls, config: CompressedSelectedWindowConfig
    ) -> CompressedSelectedWindowAttention:
        """The module of a :class:`~dilated_attention.config.CompressedSelectedWindowConfig`."""
        return cls(**config.kwargs())

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        is_causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
        gates: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Args: query (B, Nq, H, D); key, value (B, Nk, Hkv, D); ``key_padding_mask`` must be
        None; gates: (B, Nq, H, 3) activated (compressed, selected, window) with
        ``combine="gates"``, else None.

        Returns:
            (B, Nq, H, D).
        """
        V.check_no_key_padding_mask(key_padding_mask)
        c = self.config
        return nsa_attention(
            query, key, value, gates, compress_block=c.compress_block,
            compress_stride=c.compress_stride, select_block=c.select_block, topk=c.topk,
            window=c.window, is_causal=is_causal, combine=c.combine, scale=c.scale,
            backend=c.backend, recompute=c.recompute,
        )  # fmt: skip

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"compress_block={c.compress_block}, compress_stride={c.compress_stride}, "
            f"select_block={c.select_block}, topk={c.topk}, window={c.window}, "
            f"combine={c.combine!r}, backend={c.backend!r}"
            + (", recompute=True" if c.recompute else "")
        )


def _kind_kwargs(kind: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The factory's arguments for kind ``kind``, without the dilated schedule it never takes
    (the generic ``create_*`` functions pass ``segment_lengths=None``), softcap or sinks."""
    for name in ("segment_lengths", "dilation_rates"):
        if kwargs.pop(name, None) is not None:
            raise ValueError(
                f"kind {kind!r} selects blocks from the content and takes no {name}; pass its "
                f"own sizes, e.g. create_multihead_dilated_attention({kind!r}, embed_dim=512, "
                f"num_heads=8, **{_EXAMPLE[kind]})"
            )
    for name in ("softcap", "sinks"):
        if kwargs.pop(name, None) not in (None, False):
            raise ValueError(
                f"kind {kind!r} takes no {name} (its branches run without soft-capped scores "
                f"or sinks); leave {name} out"
            )
    return kwargs


_EXAMPLE = {
    "moba": "dict(block_size=512, topk=2)",
    "nsa": "dict(compress_block=32, compress_stride=16, select_block=64, topk=15, window=512)",
}


def _builders(cls: type[nn.Module], kind: str) -> tuple[Any, Any]:
    """Factory constructors of ``kind``: the inner module, and the library's multihead layer
    around it."""

    def build(**kwargs: Any) -> nn.Module:
        return cls(**_kind_kwargs(kind, kwargs))

    def build_multihead(**kwargs: Any) -> nn.Module:
        kwargs = _kind_kwargs(kind, kwargs)
        layer = {name: value for name, value in kwargs.items() if name in LAYER_ARGUMENTS}
        inner = {name: value for name, value in kwargs.items() if name not in LAYER_ARGUMENTS}
        V.check_heads(layer.get("embed_dim"), layer.get("num_heads"), layer.get("num_kv_heads"))
        return MultiheadAttention(attention=cls(**inner), **layer)

    return build, build_multihead


#: The factory's kinds of this module (``factory._KINDS``).
FACTORY_KINDS = {
    "moba": _builders(BlockSelectedAttention, "moba"),
    "nsa": _builders(CompressedSelectedWindowAttention, "nsa"),
}
