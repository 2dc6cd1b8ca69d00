"""Run-time block masks: the block pairs of a call chosen at run time, per batch row and head, as
a tensor on the inputs' device (content-selected sparsity: MoBA, NSA), checked on its metadata
and turned into the kept block pairs on the device.

Note [Run-time block masks]
    In place of a pattern, ``block_sparse_attention`` takes a tensor on the inputs' device: bool
    ``(Bm, Hm, Mq, Mk)``, ``True`` = the block pair attends, or int block indices
    ``(Bm, Hm, Mq, K)``, row ``i`` listing the key blocks query block ``i`` attends, with
    ``Bm`` in {1, B}, ``Hm`` in {1, Hkv, H}, ``Mq = ceil(Nq / bs)``, ``Mk = ceil(Nk / bs)``
    (``bs`` the block size). Row ``i`` covers query rows ``[i * bs, (i + 1) * bs)``, column
    ``j`` key positions ``[j * bs, (j + 1) * bs)``, the last of each shorter. A dimension of
    size 1 serves every batch row or head; query head ``h`` reads mask head
    ``h // (H // Hm)``, so a key/value-head mask serves every query head of its group. Query
    row ``r`` attends key ``t`` when the mask keeps ``(r // bs, t // bs)`` and, causal,
    ``t <= Nk - Nq + r``: end-aligned at the token, as ``attention`` and ``select_blocks``
    (which makes such masks). A pattern's rows are the blocks of the query's *positions*
    instead (Note [End-aligned causal blocks] in ``resolve/resolver.py``): the two agree
    whenever ``Nq == Nk``.

    Int indices: an entry outside ``[0, Mk)`` (``-1``, the documented "none", or any other)
    keeps nothing, and an index listed twice counts once: the indices are scattered into the
    bool form on the device (:func:`kept_blocks`). Neither is checked: a check reads the values
    on the host, a synchronisation per call, so an index out of range is the caller's to
    avoid (it is dropped, never read out of bounds).

    Packed documents (``cu_seqlens``): every document must start at a multiple of ``bs``
    within its row (:func:`check_documents_aligned`, on the host as the offsets are), so that
    the blocks counted from a row's start count from each of its documents' first token; the
    pairs of two documents are dropped (:func:`same_document`), and each row runs whole.

    No host synchronisation: the checks read shapes, dtypes and devices; every shape the
    kernels' inputs take follows from them and the block size; the kept pairs and each
    kernel's lists are torch operations on the mask's device (a scatter, comparisons, a
    cumulative sum: :func:`compact_rows`). So a list is as wide as its static bound: ``Mk``
    entries per query block of a bool mask (the longest row is not known without reading the
    mask), and ``Mq`` per key block for the backward; ``(Bm, Hm, Mq, Mk)`` int32 per direction
    where the kernels walk lists (FlashAttention-4, our Triton kernels, FlexAttention's
    ``BlockMask``). The fallback on a dense kernel reads the mask row by row instead (Note
    [Run-time masks on a dense kernel] in ``rows.py``).

    Gradients never reach the mask (a bool or int tensor), and they are first order only:
    the kernels' differentiable recompute (Note [Double backward]) plans a pattern's pairs on
    the host. A call passes the mask where the key padding mask of a dense call travels, as
    its one mask tensor (Note [The call's mask tensor] in ``resolve/request.py``).

Shape legend: B batch, Nq query rows, Nk key rows, H query heads, Hkv key/value heads, bs block
size, Mq = ceil(Nq / bs), Mk = ceil(Nk / bs), Bm in {1, B}, Hm in {1, Hkv, H}, K indices per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.higher_order import no_higher_order_message
from .plan import num_blocks

__all__ = [
    "CHOSEN_BLOCKS_FIX",
    "FIRST_ORDER_MESSAGE",
    "BlockIndices",
    "MaskLayout",
    "check_block_mask",
    "check_documents_aligned",
    "kept_blocks",
    "kept_indices",
    "listed_blocks",
    "per_query_head",
    "same_document",
    "token_rows",
]  # fmt: skip

#: The integer dtypes of block indices.
INDEX_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)

#: The double-backward fix of a function whose blocks the model chooses at run time
#: (``moba_attention``, ``nsa_attention``): no pattern can stand in for its choice.
CHOSEN_BLOCKS_FIX = (
    "For a gradient penalty or other double backward, leave the attention out of the penalty "
    "(detach its output), or use block_sparse_attention with a pattern or attention(), which "
    "support it."
)
FIRST_ORDER_MESSAGE = no_higher_order_message(
    "block_sparse_attention with a run-time block mask",
    "its gradients are computed without a graph",
    "For a gradient penalty or other double backward, pass a pattern (patterns.Custom holds "
    "one (Mq, Mk) mask shared by every row and head).",
)


@dataclass(frozen=True)
class MaskLayout:
    """A run-time block mask as a request records it: plain values, no tensor.

    Attributes:
        indices: int block indices (else bool).
        batch: Bm, 1 or B.
        heads: Hm, 1, Hkv or H.
        width: Mk (bool), or K indices per row.
    """

    indices: bool
    batch: int
    heads: int
    width: int

    def describe(self) -> str:
        kind = "int block indices" if self.indices else "bool"
        width = "K" if self.indices else "Mk"
        return f"run-time block mask, {kind} ({self.batch}, {self.heads}, Mq, {width}={self.width})"


def check_block_mask(
    mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor, block_size: int
) -> MaskLayout:
    """The layout of a run-time block mask given as ``pattern``, from its metadata alone (Note
    [Run-time block masks]).

    Args:
        mask: bool (Bm, Hm, Mq, Mk) or int (Bm, Hm, Mq, K).
        q: (B, Nq, H, D); k: (B, Nk, Hkv, D), checked.

    Raises:
        TypeError: another dtype.
        ValueError: another rank, device or size.
    """
    indices = mask.dtype in INDEX_DTYPES
    if mask.dtype != torch.bool and not indices:
        raise TypeError(
            f"pattern given as a tensor is a run-time block mask: bool (True = the block pair "
            f"attends) or int block indices (-1 = none), got dtype {mask.dtype}; pass "
            f"mask.bool() for a 0/1 mask or mask.long() for block indices"
        )
    batch, nq, heads, _ = q.shape
    nk, kv_heads = k.shape[1], k.shape[2]
    mq, mk = num_blocks(nq, block_size), num_blocks(nk, block_size)
    last = "K" if indices else f"Mk={mk}"
    form = (
        f"(batch {batch} or 1, heads {heads}, {kv_heads} or 1, Mq={mq}, {last}) for "
        f"query.shape={tuple(q.shape)}, key.shape={tuple(k.shape)}, block_size={block_size} "
        f"(Mq = ceil(Nq / block_size), Mk = ceil(Nk / block_size))"
    )
    kind = "block indices" if indices else "bool block mask"
    if mask.dim() != 4:
        raise ValueError(
            f"pattern (a run-time {kind}) must be 4-D {form}, got pattern.shape="
            f"{tuple(mask.shape)}; add size-1 dims for a mask shared by every batch row or "
            f"head, e.g. mask.view(1, 1, {mq}, -1), or pass a (Mq, Mk) bool mask fixed for "
            f"every call as patterns.Custom(mask)"
        )
    if mask.device != q.device:
        raise ValueError(
            f"pattern (a run-time {kind}) must be on the inputs' device {q.device}, got "
            f"pattern.device={mask.device}; make it there (select_blocks does) or move it with "
            f".to(query.device)"
        )
    b, h, m, w = mask.shape
    problem = _size_problem(b, h, m, w, (batch, heads, kv_heads, mq, None if indices else mk))
    if problem is not None:
        raise ValueError(
            f"pattern (a run-time {kind}) must have shape {form}, got pattern.shape="
            f"{tuple(mask.shape)}: {problem}"
        )
    return MaskLayout(indices, b, h, w)


def _size_problem(
    b: int, h: int, m: int, w: int, expected: tuple[int, int, int, int, int | None]
) -> str | None:
    """Which of a mask's dims ``(b, h, m, w)`` is wrong for ``(B, H, Hkv, Mq, Mk or None)``
    (None: any width, block indices), with its fix; None if none is."""
    batch, heads, kv_heads, mq, mk = expected
    if b not in (1, batch):
        return f"dim 0 is {b}, expected the batch size {batch} or 1 (shared by every row)"
    if h not in (1, kv_heads, heads):
        return (
            f"dim 1 is {h}, expected {heads} (one mask per query head), {kv_heads} (one per "
            f"key/value head, shared by its group of query heads) or 1 (shared by every head)"
        )
    if m != mq:
        return f"dim 2 is {m}, expected Mq={mq} query blocks; check block_size"
    if mk is not None and w != mk:
        return f"dim 3 is {w}, expected Mk={mk} key blocks; check block_size"
    return None


def check_documents_aligned(
    documents: tuple[int, ...], seq_len: int, block_size: int, function: str
) -> None:
    """Every document starts at a multiple of ``block_size`` within its row, so that no block
    holds positions of two documents (a row's last block may be shorter).

    Args:
        documents: the checked offsets over the ``B * seq_len`` positions.
        function: the public call, for the message.

    Raises:
        ValueError: a document starts inside a block.
    """
    bad = [offset for offset in documents if offset % seq_len % block_size]
    if bad:
        row, start = divmod(bad[0], seq_len)
        raise ValueError(
            f"{function} with cu_seqlens needs every document to start at a multiple of "
            f"block_size={block_size} within its row (blocks never cross a document), got a "
            f"document starting at position {start} of row {row} (offset {bad[0]} in "
            f"cu_seqlens); pad each document to a multiple of block_size, or use a block_size "
            f"that divides every document's start"
        )


def same_document(
    documents: tuple[int, ...], batch: int, seq_len: int, block_size: int, device: torch.device
) -> torch.Tensor:
    """(B, 1, M, M) bool: whether query block ``i`` and key block ``j`` of a row lie in one
    document (their first positions do; documents start at blocks,
    :func:`check_documents_aligned`). The offsets reach the device by a non-blocking copy from
    pinned memory (a copy from pageable memory may wait for the stream)."""
    m = num_blocks(seq_len, block_size)
    offsets = torch.tensor(documents, dtype=torch.int64)
    if device.type == "cuda":
        offsets = offsets.pin_memory()
    offsets = offsets.to(device, non_blocking=True)
    starts = (torch.arange(batch, device=device)[:, None] * seq_len
              + torch.arange(m, device=device)[None, :] * block_size)  # fmt: skip
    document = torch.searchsorted(offsets, starts, right=True)  # (B, M)
    return (document[:, :, None] == document[:, None, :])[:, None]


def kept_blocks(
    mask: torch.Tensor,
    *,
    block_size: int,
    query_len: int,
    key_len: int,
    is_causal: bool,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """The block pairs a call computes (Note [Run-time block masks]): the mask's, as bool, less
    the pairs a causal call never reaches and, with ``documents``, the pairs of two documents.

    Args:
        mask: a checked bool (Bm, Hm, Mq, Mk) mask or int (Bm, Hm, Mq, K) indices.
        documents: (B, 1, Mq, Mk) bool from :func:`same_document`, or None.

    Returns:
        (Bm, Hm, Mq, Mk) bool (B rows with ``documents``) on the mask's device; the mask itself
        where nothing changes it.
    """
    mk = num_blocks(key_len, block_size)
    kept = mask if mask.dtype == torch.bool else listed_blocks(mask, mk)
    for pairs in _visible_pairs(block_size, query_len, key_len, is_causal, documents,
                                mask.device):  # fmt: skip
        kept = kept & pairs
    return kept


def _visible_pairs(
    block_size: int,
    query_len: int,
    key_len: int,
    is_causal: bool,
    documents: torch.Tensor | None,
    device: torch.device,
) -> list[torch.Tensor]:
    """The block pairs a call may keep, as the masks every kept pair lies in: the causal pairs
    (Mq, Mk) when causal, the pairs of one document (B, 1, Mq, Mk) with ``documents``."""
    visible = [_causal_pairs(query_len, key_len, block_size, device)] if is_causal else []
    return visible if documents is None else [*visible, documents]


@dataclass(frozen=True)
class BlockIndices:
    """A call's int block indices with what makes them kept blocks, for kernels whose lists
    are made from the indices themselves (Note [Narrow lists of block indices] in
    ``lists.py``).

    Attributes:
        indices: checked (Bm, Hm, Mq, K) int block indices.
        documents: (B, 1, Mq, Mk) bool from :func:`same_document`, or None.
    """

    indices: torch.Tensor
    block_size: int
    query_len: int
    key_len: int
    is_causal: bool
    documents: torch.Tensor | None = None

    def as_mask(self) -> torch.Tensor:
        """(Bm or B, Hm, Mq, Mk) bool: :func:`kept_blocks` of the indices."""
        return kept_blocks(self.indices, block_size=self.block_size, query_len=self.query_len,
                           key_len=self.key_len, is_causal=self.is_causal,
                           documents=self.documents)  # fmt: skip


def kept_indices(blocks: BlockIndices) -> torch.Tensor:
    """:func:`kept_blocks` of int block indices, kept as indices: the entries outside
    ``[0, Mk)``, after a causal row or in another document dropped, each block once, every row
    increasing (sorted on the device: rows of ``K`` entries).

    Returns:
        (Bm or B, Hm, Mq, K) int64: each row's kept key blocks increasing, then ``Mk`` (none).
    """
    mk = num_blocks(blocks.key_len, blocks.block_size)
    index = blocks.indices.long()
    valid = (index >= 0) & (index < mk)
    if blocks.documents is not None:  # a row per batch row
        batch = blocks.documents.shape[0]
        index, valid = (x.expand(batch, *x.shape[1:]) for x in (index, valid))
    for pairs in _visible_pairs(blocks.block_size, blocks.query_len, blocks.key_len,
                                blocks.is_causal, blocks.documents, index.device):  # fmt: skip
        pairs = pairs.expand(*index.shape[:-1], mk)
        valid = valid & pairs.gather(-1, index.clamp(0, mk - 1))
    index = index.masked_fill(~valid, mk).sort(-1).values
    repeated = index[..., 1:] == index[..., :-1]
    index = torch.cat([index[..., :1], index[..., 1:].masked_fill(repeated, mk)], -1)
    return index.sort(-1).values


def listed_blocks(indices: torch.Tensor, mk: int) -> torch.Tensor:
    """(..., K) block indices -> (..., Mk) bool: the indices in ``[0, Mk)`` set, each once;
    any other entry (``-1``) lands in a spare column, dropped."""
    index = indices.long()
    index = index.masked_fill((index < 0) | (index >= mk), mk)
    kept = torch.zeros(*index.shape[:-1], mk + 1, dtype=torch.bool, device=index.device)
    return kept.scatter_(-1, index, True)[..., :mk]


def _causal_pairs(nq: int, nk: int, block_size: int, device: torch.device) -> torch.Tensor:
    """(Mq, Mk) bool: key block ``j`` holds a key at or before the last position of query
    block ``i`` (its rows end-aligned: row ``r`` at position ``Nk - Nq + r``)."""
    rows = torch.arange(num_blocks(nq, block_size), device=device)
    last = (nk - nq) + torch.clamp((rows + 1) * block_size, max=nq) - 1
    first_key = torch.arange(num_blocks(nk, block_size), device=device) * block_size
    return first_key[None, :] <= last[:, None]


def per_query_head(kept: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``kept`` (Bm, Hm, ...) with 1 or ``num_heads`` heads: a mask of Hkv key/value heads
    repeated for each query head of its group (kernels that take per-query-head lists)."""
    heads = kept.shape[1]
    if heads in (1, num_heads):
        return kept
    return kept.repeat_interleave(num_heads // heads, dim=1)


def token_rows(blocks: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """(..., M) per block -> (..., length) per token (the last block shorter)."""
    return blocks.repeat_interleave(block_size, dim=-1)[..., :length]
