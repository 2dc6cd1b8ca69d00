"""MoBA-style attention over a sequence sharded across the ranks of a process group: the selection
of :func:`~dilated_attention.sparse.select_blocks` made on every rank for its own query blocks,
then block-sparse ring attention on that run-time mask.

Note [MoBA's selection over the ring]
    MoBA's gate (Note [MoBA's gate for a block of queries] in ``sparse/selection.py``) scores a
    query block against every key block's mean key. A rank holds its own key blocks only, so the
    ranks first gather every key block's mean: one small all-gather of ``(B, n / bs, Hkv, D)``
    per rank, ``1 / bs`` of a key shard, sent to each other rank in ``W - 1`` steps around the
    ring (``ring_all_gather``). Each rank then chooses its own query blocks' rows with the
    one-process rule (:func:`~dilated_attention.sparse.selection.chosen_blocks`, the rows of the
    whole sequence's candidates), and runs :func:`block_sparse_ring_attention` on those rows
    (Note [Run-time masks over the ring] in ``masked_ring.py``). The choice gets no gradient, as
    in one process. Before the all-gather the ranks agree on the call's shapes and options (a
    gather of unequal tensors would abort), so a bad call raises on every rank.

Shape legend: B batch, n local tokens, H query heads, Hkv key/value heads, D head dim, W ranks,
bs block size.
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ... import _validation as V
from ...modules import BlockSelectedAttention
from ...sparse.selection import CandidateRanges, block_means, check_selection, chosen_blocks
from ..comm import collectives as _comm
from ..context import ContextParallel
from ..modules import RingModule
from .block_sparse_ring import block_sparse_ring_attention

__all__ = ["BlockSelectedRingAttention", "moba_ring_attention", "selected_rows",
           "selection_group"]  # fmt: skip

_FIELDS = ("local seq_len", "batch", "key/value heads", "head_dim", "bytes per element",
           "block_size", "topk", "is_causal")  # fmt: skip


def _agreed(
    query: object, key: object, value: object, block_size: object, topk: object,
    is_causal: object, group: dist.ProcessGroup | None,
) -> tuple[int, int]:  # fmt: skip
    """This rank's checks, then the agreement of every rank (before the all-gather):
    ``(block_size, topk)``.

    Raises:
        TypeError / ValueError: this rank's own error; ``ValueError`` naming the rank on the
            others, or on every rank where the fields differ.
    """
    refuse_context_parallel(group, "moba_ring_attention")
    error: Exception | None = None
    fields = [0] * len(_FIELDS)
    size = count = 0
    try:
        q, k, _ = V.check_qkv(query, key, value, same_length=True)
        size, count = check_selection(block_size, topk, is_causal, "head")
        if q.shape[1] % size:
            raise ValueError(
                f"moba_ring_attention needs every shard to be whole blocks: the local seq_len "
                f"({q.shape[1]}) must be a multiple of block_size={size}; pad the sequence or "
                f"use a block_size that divides {q.shape[1]}"
            )
        fields = [q.shape[1], q.shape[0], k.shape[2], q.shape[3], q.element_size(), size,
                  count, int(bool(is_causal))]  # fmt: skip
    except Exception as exc:  # any rejection on one rank must reach the others: no hang
        error = exc
    _comm.check_same_on_all_ranks(fields, _FIELDS, group, error, what="moba_ring_attention inputs")
    return size, count


def refuse_context_parallel(group: object, function: str) -> None:
    """A selection over the ring takes a process group: a :class:`ContextParallel` raises at
    once, on every rank that passed one.

    Raises:
        ValueError: ``group`` is a ``ContextParallel``.
    """
    if isinstance(group, ContextParallel):
        raise ValueError(
            f"{function} takes a process group, not a ContextParallel (it selects blocks and "
            f"pools keys over a ring, with no head all-to-all): pass group=cp.ring"
        )


def selection_group(
    group: ContextParallel | dist.ProcessGroup | None, what: str
) -> dist.ProcessGroup | None:
    """The process group a layer that selects blocks (MoBA- or NSA-style) runs over, given
    the group a model is made context parallel over: ``group`` itself, or a
    ``ContextParallel``'s ring.

    Raises:
        ValueError: a ``ContextParallel`` with a head all-to-all, or without a ring
            (``what``: the layer or call, for the message).
    """
    if not isinstance(group, ContextParallel):
        return group
    if group.heads is not None or group.ring is None:
        raise ValueError(
            f"{what} selects blocks from the content over a ring of ranks, with no head "
            f"all-to-all: pass a process group or ContextParallel(ring=...) alone, got {group}"
        )
    return group.ring


def reject_call(error: Exception, group: dist.ProcessGroup | None) -> NoReturn:
    """Take part in :func:`moba_ring_attention`'s agreement with this rank's ``error``, then
    raise it: the peers already waiting there raise too."""
    _comm.raise_on_all_ranks(error, _FIELDS, group, what="moba_ring_attention inputs")


def moba_ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    block_size: int,
    topk: int,
    is_causal: bool = True,
    group: dist.ProcessGroup | None = None,
    scale: float | None = None,
    backend: str | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`~dilated_attention.sparse.moba_attention` over a sequence sharded across
    ``group``: this rank's shard of the one-process result, with exact gradients for the local
    q, k, v (Note [MoBA's selection over the ring]).

    Args:
        query: (B, n, H, D) this rank's contiguous shard (``shard_sequence(x)``, N = W * n).
        key: (B, n, Hkv, D), H % Hkv == 0 (GQA).
        value: (B, n, Hkv, D).
        block_size: positions per block; ``n`` must be a multiple of it.
        topk: key blocks chosen per query block besides its own, as in ``moba_attention``.
        is_causal: causal over global positions.
        group: the process group (default: the world).
        scale: softmax scale; ``None`` means ``D ** -0.5``.
        backend: the per-step kernel, as in :func:`block_sparse_ring_attention`.
        softcap: the attention's scores soft-capped, as in ``moba_attention`` (the choice is
            made on the plain affinities).
        sinks: (H,) logits, alike on every rank, as in ``moba_attention``; a rank's gradient
            is its rows' share (the shares sum to the one-process gradient).

    Returns:
        (B, n, H, D) in the input dtype.

    Raises:
        TypeError / ValueError: on every rank, before any other communication: malformed
            tensors or selection options (as ``moba_attention``), shards that are not whole
            blocks, or shapes and options that differ between ranks; the attention's options
            (``scale``, ``backend``, ``softcap``, ``sinks``) in the ring call's agreement,
            after the means' exchange (whose shapes do not depend on them).
    """
    size, count = _agreed(query, key, value, block_size, topk, is_causal, group)
    mask = selected_rows(query, key, size, count, bool(is_causal), "head", group)
    out = block_sparse_ring_attention(
        query, key, value, mask, block_size=size, group=group, is_causal=bool(is_causal),
        scale=scale, backend=backend, softcap=softcap, sinks=sinks,
    )  # fmt: skip
    assert isinstance(out, torch.Tensor)  # return_lse=False: for the type checker
    return out


@torch.no_grad()  # the choice gets no gradient (Note [MoBA's gate for a block of queries])
def selected_rows(
    query: torch.Tensor, key: torch.Tensor, block_size: int, topk: int, is_causal: bool,
    per: str, group: dist.ProcessGroup | None,
) -> torch.Tensor:  # fmt: skip
    """This rank's rows of :func:`~dilated_attention.sparse.select_blocks`' mask over the
    whole sequence (Note [MoBA's selection over the ring]): every key block's mean gathered,
    then the one-process rule on this rank's query blocks. Every rank of ``group`` calls it
    (the arguments checked and agreed).

    Args:
        query: (B, n, H, D) this rank's contiguous shard, ``n`` a multiple of ``block_size``.
        key: (B, n, Hkv, D).
        per: ``"head"`` (MoBA) or ``"kv_head"`` (NSA), as in ``select_blocks``.

    Returns:
        (B, H or Hkv, n / bs, W n / bs) bool, this rank's query blocks' rows.
    """
    rank, world = _comm.group_rank_and_size(group)
    ranks = tuple(_comm.global_rank(group, r) for r in range(world))
    mq = query.shape[1] // block_size
    gathered = _comm.ring_all_gather((block_means(key, block_size),), ranks, rank)
    k_mean = torch.cat([means for (means,) in gathered], dim=1)  # (B, W n / bs, Hkv, D)
    seq_len = query.shape[1] * world
    rows = CandidateRanges(seq_len, seq_len, block_size, is_causal, first_row=rank * mq)
    return chosen_blocks(block_means(query, block_size), k_mean, rows, topk, per)


def _layer_call(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
    cu_seqlens: object = None,
    group: dist.ProcessGroup | None = None,
    **options: Any,
) -> torch.Tensor:
    """:func:`moba_ring_attention` as :class:`BlockSelectedRingAttention` calls it: a key
    padding mask or packed documents on any rank raise on every rank."""
    try:
        V.check_no_key_padding_mask(key_padding_mask)
        if cu_seqlens is not None:
            raise ValueError(
                "a MoBA-style layer over ranks takes no cu_seqlens (packed documents): give "
                "each document its own row, or run the layer in one process"
            )
    except ValueError as exc:
        reject_call(exc, group)
    return moba_ring_attention(query, key, value, group=group, **options)


class BlockSelectedRingAttention(RingModule, BlockSelectedAttention):
    """:class:`~dilated_attention.modules.BlockSelectedAttention` (MoBA-style) over a
    sequence sharded across ``group`` in contiguous shards of whole blocks
    (:func:`moba_ring_attention`); what ``context_parallel`` makes of that layer.

    Args:
        block_size, topk, scale, backend, dropout: as in ``BlockSelectedAttention``.
        group: the process group (default: the world).

    Its forward takes (B, n, ...) local shards, as :class:`~.modules.RingModule`'s;
    ``key_padding_mask`` and ``cu_seqlens`` must be None (on any rank: every rank raises).
    """

    ring_function = staticmethod(_layer_call)
    takes_documents = False
    layout = "contiguous"

    def __init__(
        self,
        block_size: int,
        topk: int,
        *,
        group: dist.ProcessGroup | None = None,
        scale: float | None = None,
        backend: str | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__(block_size, topk, scale=scale, backend=backend, dropout=dropout)
        self._init_ring(group)

    def ring_options(self) -> dict[str, object]:
        return {"block_size": self.block_size, "topk": self.topk, "group": self.group,
                "scale": self.scale, "backend": self.backend}  # fmt: skip

    def reject_call(self, error: Exception) -> NoReturn:
        reject_call(error, self.group)
