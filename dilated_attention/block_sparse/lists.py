"""The kernels' lists of a run-time block mask, made on its device: each row's kept columns
(:func:`compact_rows`), and FlashAttention-4's and FlexAttention's 128 x 128 tile lists
(:func:`runtime_tile_lists`). On the GPU one Triton pass makes each (Note [Lists of a run-time
mask in one pass] in ``backends/triton_kernels/compact.py``); elsewhere torch operations do.

Note [Narrow lists of block indices]
    From a bool mask each forward list is as wide as the key tiles, ``Tk`` int32 per query tile
    and head: at 1M tokens and 16 heads 4 GiB, whatever the mask keeps. Int block indices
    ``(Bm, Hm, Mq, K)`` bound every row by ``K`` blocks, so where tiles lie inside blocks
    (``r = bs / 128`` tiles a side) the forward lists are ``K r`` wide and made from the indices
    alone (:func:`index_tile_lists`): block ``j`` of query tile ``(i, s)`` (tile ``s`` of block
    ``i``) gives key tiles ``j r + t``, full off the diagonal; causal, its own block ``i`` gives
    the tiles ``t < s`` full and ``t = s`` partial, each list in increasing order: one Triton
    launch on the GPU (Note [Narrow lists in one launch] in
    ``backends/triton_kernels/index_lists.py``), a few sorts of ``K r`` entries per row
    elsewhere (:func:`~.runtime.kept_indices`). The backward's lists (per key tile, its query tiles)
    have no such bound, any number of query blocks may keep a key block, so they are made from the
    bool form when a backward runs.

Shape legend: Bm batch rows of the mask (1 or B), Hm its heads, H query heads, Mq / Mk query /
key blocks, Tq / Tk query / key tiles, K indices per row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..backends.triton import kernel_module
from .plan import num_blocks
from .runtime import BlockIndices, kept_indices, listed_blocks, per_query_head
from .tiles import KERNEL_TILE, kernel_tiles

__all__ = ["NarrowLists", "TileLists", "compact_rows", "index_tile_lists", "kept_mask",
           "planned_narrow_lists", "runtime_tile_lists", "tiles_aligned"]  # fmt: skip


class TileLists(NamedTuple):
    """One direction's tile lists, int32 on the mask's device: per row tile the tiles that need
    the mask (``partial``) and those that do not (``full``), each a count (Bm, H, R) and an
    index list (Bm, H, R, W) (Note [Kernel tiles of a block mask] in ``tiles.py``)."""

    partial_count: torch.Tensor
    partial_index: torch.Tensor
    full_count: torch.Tensor
    full_index: torch.Tensor


def _on_gpu(x: torch.Tensor) -> Any:
    """The one-pass Triton compaction where it takes ``x`` (4-D, on the GPU), else None."""
    module = kernel_module("compact") if x.is_cuda and x.dim() == 4 else None
    return None if module is None else module.compact


def compact_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's kept columns in increasing order, as the kernels' lists: no host read, no
    sort (one Triton pass on the GPU; a cumulative sum and a scatter elsewhere).

    Args:
        rows: (..., R, C) bool, any strides.

    Returns:
        ``count`` (..., R) int32 and ``index`` (..., R, C) int32, contiguous: row ``r``'s
        columns in ``index[..., r, :count[..., r]]`` (the entries after them are 0).
    """
    kernel = _on_gpu(rows)
    if kernel is not None:
        return kernel(rows, heads=rows.shape[1])  # type: ignore[no-any-return]
    cols = rows.shape[-1]
    count = rows.sum(-1, dtype=torch.int32)
    slot = torch.where(rows, rows.cumsum(-1) - 1, cols)  # an unkept column: the spare slot
    index = torch.zeros(*rows.shape[:-1], cols + 1, dtype=torch.int32, device=rows.device)
    column = torch.arange(cols, dtype=torch.int32, device=rows.device).expand(rows.shape)
    index.scatter_(-1, slot, column)
    return count, index[..., :cols].contiguous()


def _heads(kept: torch.Tensor, num_heads: int) -> int:
    return 1 if kept.shape[1] == 1 else num_heads


def tiles_aligned(block_size: int, query_len: int, key_len: int, is_causal: bool) -> bool:
    """Whether the kernels' 128 x 128 tiles lie inside blocks, the diagonal tiles on the
    diagonal blocks (causal: queries and keys of one length)."""
    return block_size % KERNEL_TILE == 0 and (not is_causal or query_len == key_len)


class NarrowLists(NamedTuple):
    """The forward of block indices: its tile lists (Bl, 1 or H, Tq[, W]), the query blocks
    that keep nothing ``empty`` (Bl, Hl, Mq) bool, and the key blocks some row keeps ``read``
    (Bl, Hm, Mk) bool; Bl = B with packed documents, else Bm."""

    lists: TileLists
    empty: torch.Tensor
    read: torch.Tensor


def planned_narrow_lists(
    blocks: BlockIndices, num_heads: int
) -> tuple[NarrowLists, Callable[[], None] | None]:
    """The forward lists of block indices where :func:`tiles_aligned` (Note [Narrow lists of
    block indices]), and the launch that fills them in place: on the GPU buffers filled by one
    Triton launch (Note [Narrow lists in one launch] in ``backends/triton_kernels/index_lists.py``)
    that the caller runs, inside its own launches; elsewhere made now by torch operations, and
    ``None``."""
    indices, size = blocks.indices, blocks.block_size
    heads = _heads(indices, num_heads)
    module = kernel_module("index_lists") if indices.is_cuda else None
    if module is not None:
        planned = module.planned_index_lists(
            indices, repeat=size // KERNEL_TILE, key_blocks=num_blocks(blocks.key_len, size),
            row_tiles=num_blocks(blocks.query_len, KERNEL_TILE),
            key_tiles=num_blocks(blocks.key_len, KERNEL_TILE), is_causal=blocks.is_causal,
            heads=heads, same=blocks.documents,
        )  # fmt: skip
        return NarrowLists(TileLists(*planned.lists), planned.empty, planned.read), planned.launch
    index, mk = kept_indices(blocks), num_blocks(blocks.key_len, size)
    lists = index_tile_lists(index, mk, block_size=size, query_len=blocks.query_len,
                             key_len=blocks.key_len, is_causal=blocks.is_causal,
                             num_heads=num_heads)  # fmt: skip
    read = listed_blocks(index.flatten(-2), mk)  # every row's blocks, as one list per head
    return NarrowLists(lists, per_query_head((index < mk).sum(-1) == 0, heads), read), None


def kept_mask(blocks: BlockIndices) -> torch.Tensor:
    """``blocks.as_mask()`` (Bm or B, Hm, Mq, Mk) bool: on the GPU in one launch after a zero
    fill where causal queries and keys have one length (the kernel's diagonal), else torch
    operations (some fifteen launches)."""
    aligned = not blocks.is_causal or blocks.query_len == blocks.key_len
    module = kernel_module("index_lists") if blocks.indices.is_cuda and aligned else None
    if module is None:
        return blocks.as_mask()
    return module.index_mask(  # type: ignore[no-any-return]
        blocks.indices, key_blocks=num_blocks(blocks.key_len, blocks.block_size),
        is_causal=blocks.is_causal, same=blocks.documents,
    )  # fmt: skip


def index_tile_lists(
    index: torch.Tensor,
    key_blocks: int,
    *,
    block_size: int,
    query_len: int,
    key_len: int,
    is_causal: bool,
    num_heads: int,
) -> TileLists:
    """The forward tile lists of kept block indices (Note [Narrow lists of block indices]),
    where :func:`tiles_aligned`: per query tile, ``min(K r, Tk)`` wide.

    Args:
        index: (Bm, Hm, Mq, K) from :func:`~.runtime.kept_indices`, causal applied;
            ``key_blocks`` (Mk) where a row's list ends.

    Returns:
        :class:`TileLists` (Bm, 1 or H, Tq[, W]).
    """
    repeat = block_size // KERNEL_TILE
    rows = num_blocks(query_len, KERNEL_TILE)
    cols = num_blocks(key_len, KERNEL_TILE)
    device = index.device
    step = torch.arange(repeat, device=device)
    tile = index[..., None] * repeat + step  # (Bm, Hm, Mq, K, r): key tiles of each block
    live = (index < key_blocks)[..., None] & (tile < cols)  # a short last block has fewer tiles
    row_block = torch.arange(index.shape[2], device=device).view(-1, 1, 1)
    own = (index[..., None] == row_block).unsqueeze(3)  # (Bm, Hm, Mq, 1, K, 1)
    live = live.unsqueeze(3)  # (Bm, Hm, Mq, 1, K, r): rows of query tiles s at dim 3
    s, t = step.view(-1, 1, 1), step.view(1, 1, -1)
    full = live & (~own | (t < s)) if is_causal else live.expand(-1, -1, -1, repeat, -1, -1)
    full = full.flatten(-2).flatten(2, 3)[:, :, :rows]  # (Bm, Hm, Tq, K r)
    tiles = tile.flatten(-2).repeat_interleave(repeat, 2)[:, :, :rows]
    listed = tiles.masked_fill(~full, cols).sort(-1).values[..., :cols]  # each tile once
    full_count = full.sum(-1, dtype=torch.int32)
    full_index = listed.masked_fill(listed == cols, 0).to(torch.int32)
    diagonal = torch.arange(rows, dtype=torch.int32, device=device)
    partial_index = diagonal.view(1, 1, rows, 1).expand(*full_count.shape, 1)
    if is_causal:
        partial_count = own.squeeze(3).any(-1).any(-1).repeat_interleave(repeat, -1)[..., :rows]
    else:
        partial_count = torch.zeros_like(full_count, dtype=torch.bool)
    heads = _heads(index, num_heads)
    lists = (partial_count.to(torch.int32), partial_index, full_count, full_index)
    return TileLists(*(per_query_head(x, heads).contiguous() for x in lists))


def runtime_tile_lists(
    kept: torch.Tensor,
    *,
    block_size: int,
    query_len: int,
    key_len: int,
    is_causal: bool,
    num_heads: int,
    backward: bool = False,
) -> TileLists:
    """The forward (per query tile, its key tiles) or, with ``backward``, the backward (per key
    tile, its query tiles) tile lists of a run-time mask's kept blocks, per batch row and query
    head (1 where the mask has one head).

    When tiles lie inside blocks (``block_size`` a multiple of 128) and, causal, queries and
    keys have one length, the partial tiles are the kept diagonal ones and the full tiles the
    kept ones off it, read from the block mask directly (one pass on the GPU); otherwise the
    tiles are classified from prefix sums (:func:`~.tiles.kernel_tiles`).

    Args:
        kept: (Bm, Hm, Mq, Mk) bool, causal applied; Hm in {1, Hkv, H}.

    Returns:
        :class:`TileLists`, rows of query tiles (forward) or key tiles (backward).
    """
    heads = _heads(kept, num_heads)
    if not tiles_aligned(block_size, query_len, key_len, is_causal):
        full, partial = kernel_tiles(
            per_query_head(kept, num_heads), block_size=block_size, query_len=query_len,
            key_len=key_len, is_causal=is_causal,
        )  # fmt: skip
        if backward:
            full, partial = full.transpose(-1, -2), partial.transpose(-1, -2)
        return TileLists(*compact_rows(partial), *compact_rows(full))
    repeat = block_size // KERNEL_TILE
    rows, cols = num_blocks(query_len, KERNEL_TILE), num_blocks(key_len, KERNEL_TILE)
    causal = 1 if is_causal else 0
    if backward:
        kept, rows, cols, causal = kept.transpose(-1, -2), cols, rows, 2 * causal
    return TileLists(*_diagonal_tiles(kept, heads, repeat, is_causal, rows),
                     *_full_tiles(kept, heads, repeat, causal, rows, cols))  # fmt: skip


def _full_tiles(
    kept: torch.Tensor, heads: int, repeat: int, causal: int, rows: int, cols: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(count (Bm, heads, rows), index (Bm, heads, rows, cols)) of the kept tiles, ``repeat``
    a block side, before (``causal`` 1) or after (2) the diagonal, or all (0)."""
    kernel = _on_gpu(kept)
    if kernel is not None:
        return kernel(  # type: ignore[no-any-return]
            kept, heads=heads, repeat=repeat, causal=causal, rows=rows, cols=cols
        )
    tiles = per_query_head(kept, heads)
    tiles = tiles.repeat_interleave(repeat, -2).repeat_interleave(repeat, -1)[..., :rows, :cols]
    if causal:
        row = torch.arange(rows, device=kept.device)[:, None]
        col = torch.arange(cols, device=kept.device)[None, :]
        tiles = tiles & (col < row if causal == 1 else col > row)
    return compact_rows(tiles)


def _diagonal_tiles(
    kept: torch.Tensor, heads: int, repeat: int, is_causal: bool, tiles: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial tiles of aligned tiles: with ``is_causal`` (queries and keys of one length)
    the kept diagonal tile of each row, none otherwise; (count (Bm, heads, T),
    index (Bm, heads, T, 1)), T = ``tiles`` rows."""
    batch = kept.shape[0]
    index = torch.arange(tiles, dtype=torch.int32, device=kept.device)
    index = index.view(1, 1, tiles, 1).expand(batch, heads, tiles, 1).contiguous()
    if not is_causal:
        return torch.zeros(batch, heads, tiles, dtype=torch.int32, device=kept.device), index
    diagonal = torch.diagonal(kept, dim1=-2, dim2=-1)  # (Bm, Hm, min(Mq, Mk))
    diagonal = per_query_head(diagonal, heads).repeat_interleave(repeat, -1)[..., :tiles]
    return diagonal.to(torch.int32).contiguous(), index
