"""FlashAttention-4's forward tile lists from block indices in one launch (Note [Narrow lists in
one launch]). Imported on first use, because it needs the ``triton`` package.

Note [Narrow lists in one launch]
    Block indices ``(Bm, Hm, Mq, K)`` give narrow forward lists (Note [Narrow lists of block
    indices] in ``block_sparse/lists.py``), but with torch operations they take some fifty
    small launches (range checks, gathers, two sorts to drop repeats, the tiles, a sort per
    list): about 3.6 ms of host time a call, more than FA4's forward at 64K tokens. Here one
    program takes one query block's ``K`` indices: it drops those outside ``[0, Mk)``, after
    the causal diagonal or in another document, and the repeats (an index equal to an earlier
    kept one), ranks the rest by an all-pairs comparison (``K`` is small), and writes its
    ``r`` query tiles' lists at those ranks: block ``j`` of rank ``p`` gives tiles
    ``j r + t`` at ``p r + t``. Causal (queries and keys of one length), the own block is the
    largest kept index, so its tiles ``t < s`` go last and its tile ``s`` is the partial one.
    Without causality only the last key block may hold fewer than ``r`` tiles, and its tiles
    come last: the lists stay dense and increasing. The program also marks the key blocks it
    keeps (``read``) and whether it keeps none (``empty``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from .launch import launch
from .tiles import next_power_of_2


@triton.jit
def _kept(row, s_ik, same, s_sr, s_sc, i, key_blocks, CAUSAL: tl.constexpr,
          DOCUMENTS: tl.constexpr, K: tl.constexpr, KP: tl.constexpr):  # fmt: skip
    """Query block ``i``'s ``K`` indices at ``row`` (``KP`` wide, past ``K`` none): ``(j,
    valid)``, ``j`` the index where ``valid`` (in ``[0, key_blocks)``, not after a causal
    diagonal, in the query block's document) and -1 elsewhere; repeats stay valid."""
    e = tl.arange(0, KP)
    j = tl.load(row + e * s_ik, mask=e < K, other=-1).to(tl.int64)
    valid = (j >= 0) & (j < key_blocks)
    if CAUSAL:
        valid = valid & (j <= i)
    if DOCUMENTS:
        ours = tl.load(same + i * s_sr + j * s_sc, mask=valid, other=0)
        valid = valid & (ours != 0)
    return tl.where(valid, j, -1), valid


@triton.jit
def _index_mask_kernel(
    indices, same, mask, key_blocks, mask_heads, query_blocks,
    s_ib, s_ih, s_ir, s_ik,
    s_sb, s_sr, s_sc,
    s_mb, s_mh, s_mr,
    CAUSAL: tl.constexpr,
    DOCUMENTS: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
):  # fmt: skip
    """Program ``bh * query_blocks + i``: the kept key blocks of query block ``i`` of batch
    row and mask head ``bh`` set in its row of ``mask`` (zeroed before)."""
    program = tl.program_id(0).to(tl.int64)
    bh, i = program // query_blocks, program % query_blocks
    b, h = bh // mask_heads, bh % mask_heads
    j, valid = _kept(indices + b * s_ib + h * s_ih + i * s_ir, s_ik, same + b * s_sb, s_sr, s_sc,
                     i, key_blocks, CAUSAL, DOCUMENTS, K, KP)  # fmt: skip
    tl.store(mask + b * s_mb + h * s_mh + i * s_mr + j, tl.full((KP,), 1, tl.int8), mask=valid)


@triton.jit
def _index_lists_kernel(
    indices, same, partial_count, partial_index, full_count, full_index, read, empty,
    width, key_blocks, row_tiles, key_tiles, repeat, heads, group, query_blocks,
    s_ib, s_ih, s_ir, s_ik,
    s_sb, s_sr, s_sc,
    s_rb, s_rh,
    CAUSAL: tl.constexpr,
    DOCUMENTS: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
):  # fmt: skip
    """Program ``bh * query_blocks + i``: query block ``i`` of batch row and list head ``bh``
    (Note [Narrow lists in one launch])."""
    program = tl.program_id(0).to(tl.int64)
    bh, i = program // query_blocks, program % query_blocks
    b, h = bh // heads, bh % heads
    e = tl.arange(0, KP)
    j, valid = _kept(indices + b * s_ib + (h // group) * s_ih + i * s_ir, s_ik, same + b * s_sb,
                     s_sr, s_sc, i, key_blocks, CAUSAL, DOCUMENTS, K, KP)  # fmt: skip
    earlier = (j[:, None] == j[None, :]) & (e[None, :] < e[:, None]) & valid[None, :]
    valid = valid & (tl.max(earlier.to(tl.int32), axis=1) == 0)
    rank = tl.sum(((j[None, :] < j[:, None]) & valid[None, :]).to(tl.int32), axis=1)
    own = valid & (j == i) if CAUSAL else valid & (j < 0)  # causal: the diagonal; else none
    tl.store(read + b * s_rb + (h // group) * s_rh + j, tl.full((KP,), 1, tl.int8), mask=valid)
    tl.store(empty + program, (tl.sum(valid.to(tl.int32), axis=0) == 0).to(tl.int8))
    others = valid & ~own
    n_others = tl.sum(others.to(tl.int32), axis=0)
    has_own = tl.sum(own.to(tl.int32), axis=0)
    for s in range(repeat):
        row = i * repeat + s
        if row < row_tiles:
            out = full_index + (bh * row_tiles + row) * width
            count = has_own * s
            for t in range(repeat):
                tile = j * repeat + t
                listed = others & (tile < key_tiles)
                tl.store(out + rank * repeat + t, tile.to(tl.int32), mask=listed)
                count += tl.sum(listed.to(tl.int32), axis=0)
            for t in range(s):  # the own block's tiles before the diagonal
                tl.store(out + n_others * repeat + t, (i * repeat + t).to(tl.int32),
                         mask=has_own > 0)  # fmt: skip
            tl.store(full_count + bh * row_tiles + row, count)
            tl.store(partial_count + bh * row_tiles + row, has_own)
            tl.store(partial_index + bh * row_tiles + row, row.to(tl.int32))


class PlannedIndexLists(NamedTuple):
    """The buffers of :func:`planned_index_lists` and ``launch``, which fills them in place and
    allocates nothing (so that a CUDA graph of the call can take it: Note [A call's launches
    from a CUDA graph] in ``core/execution/graphs.py``)."""

    lists: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    empty: torch.Tensor
    read: torch.Tensor
    launch: Callable[[], None]


def planned_index_lists(
    indices: torch.Tensor,
    *,
    repeat: int,
    key_blocks: int,
    row_tiles: int,
    key_tiles: int,
    is_causal: bool,
    heads: int,
    same: torch.Tensor | None = None,
) -> PlannedIndexLists:
    """The forward tile lists of block indices (Note [Narrow lists in one launch]): their
    buffers, allocated now, and the launch that fills them (the caller runs it, inside its own
    launches).

    Args:
        indices: (Bm, Hm, Mq, K) int block indices on the GPU, any strides; ``heads`` (1 or
            H, the lists' heads) a multiple of Hm.
        repeat: tiles a block side; key_blocks: Mk; row_tiles / key_tiles: Tq / Tk.
        is_causal: queries and keys of one length, the diagonal blocks the own ones.
        same: (B, 1, Mq, Mk) bool, whether two blocks lie in one document, or None.

    Returns:
        :class:`PlannedIndexLists`: ``lists`` ``(partial_count, partial_index, full_count,
        full_index)`` (Bl, heads, Tq[, 1 or W]) int32 with ``W = min(K r, Tk)``, Bl = B with
        ``same`` else Bm; ``empty`` (Bl, heads, Mq) bool, the query blocks that keep nothing;
        ``read`` (Bl, Hm, Mk) bool, the key blocks some row keeps; ``launch``.
    """
    batch, mask_heads, query_blocks, k = indices.shape
    batch = batch if same is None else same.shape[0]
    width = min(k * repeat, key_tiles)
    device = indices.device
    lists = tuple(torch.empty(batch, heads, row_tiles, *last, dtype=torch.int32, device=device)
                  for last in ((), (1,), (), (width,)))  # fmt: skip
    read = torch.empty(batch, mask_heads, key_blocks, dtype=torch.bool, device=device)
    empty = torch.empty(batch, heads, query_blocks, dtype=torch.bool, device=device)
    if empty.numel() == 0 or k == 0:

        def nothing_kept() -> None:
            for x in (*lists, read):
                x.zero_()
            empty.fill_(True)

        return PlannedIndexLists(lists, empty, read, nothing_kept)  # type: ignore[arg-type]
    same_bytes, strides, options = _index_operands(indices, same, empty, is_causal)
    args = (indices, same_bytes, *lists, read.view(torch.int8), empty.view(torch.int8), width,
            key_blocks, row_tiles, key_tiles, repeat, heads, heads // mask_heads, query_blocks,
            *strides, read.stride(0), read.stride(1))  # fmt: skip

    def fill() -> None:  # every count and flag is written; a list's tail and `read` are not
        lists[3].zero_()
        read.zero_()
        launch(_index_lists_kernel, (batch * heads * query_blocks,), args, options)

    return PlannedIndexLists(lists, empty, read, fill)  # type: ignore[arg-type]


def index_mask(
    indices: torch.Tensor, *, key_blocks: int, is_causal: bool, same: torch.Tensor | None = None
) -> torch.Tensor:
    """The kept blocks of block indices as a bool mask, in one launch after a zero fill.

    Args:
        indices: (Bm, Hm, Mq, K) int block indices on the GPU, any strides.
        key_blocks: Mk; is_causal: queries and keys of one length (a key block after the
            query block is not kept).
        same: (B, 1, Mq, Mk) bool, whether two blocks lie in one document, or None.

    Returns:
        (Bl, Hm, Mq, Mk) bool, Bl = B with ``same`` else Bm: ``kept_blocks`` of the indices.
    """
    batch, mask_heads, query_blocks, k = indices.shape
    batch = batch if same is None else same.shape[0]
    mask = torch.zeros(batch, mask_heads, query_blocks, key_blocks, dtype=torch.bool,
                       device=indices.device)  # fmt: skip
    if mask.numel() == 0 or k == 0:
        return mask
    same_bytes, strides, options = _index_operands(indices, same, mask, is_causal)
    args = (indices, same_bytes, mask.view(torch.int8), key_blocks, mask_heads, query_blocks,
            *strides, *mask.stride()[:3])  # fmt: skip
    launch(_index_mask_kernel, (batch * mask_heads * query_blocks,), args, options)
    return mask


def _index_operands(
    indices: torch.Tensor, same: torch.Tensor | None, spare: torch.Tensor, is_causal: bool
) -> tuple[torch.Tensor, tuple[int, ...], dict[str, Any]]:
    """What both kernels take of the indices (Bm, Hm, Mq, K) and the documents ``same``:
    ``same`` as bytes (``spare``'s where there are none: never read), the indices' four
    strides (0 over a batch or head of one) and ``same``'s three, and the launch options."""
    s_ib, s_ih, s_ir, s_ik = indices.stride()
    s_ib, s_ih = (0 if indices.shape[0] == 1 else s_ib), (0 if indices.shape[1] == 1 else s_ih)
    s_sb, _, s_sr, s_sc = same.stride() if same is not None else (0, 0, 0, 0)
    same_bytes = (same if same is not None else spare).view(torch.uint8)
    k = indices.shape[-1]
    options = {"CAUSAL": is_causal, "DOCUMENTS": same is not None, "K": k,
               "KP": next_power_of_2(k), "num_warps": 1 if k <= 32 else 4}  # fmt: skip
    return same_bytes, (s_ib, s_ih, s_ir, s_ik, s_sb, s_sr, s_sc), options
