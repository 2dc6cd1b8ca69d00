"""The kernels' lists of a run-time block mask, made on the GPU in one pass (Note [Lists of a
run-time mask in one pass]). Imported on first use, because it needs the ``triton`` package.

Note [Lists of a run-time mask in one pass]
    Block-sparse kernels walk, per row (a query block or tile forward, a key block or tile
    backward), the columns it keeps in increasing order: a count and an index list. Made with
    torch operations from a (Bm, Hm, R, C) bool mask that is a cumulative sum over 64-bit
    integers and a scatter, each as large as the mask eight times over, and for the kernels'
    128 x 128 tiles first the tile masks themselves: 22 ms on an H100 at 262,144 tokens with
    16 heads, for a kernel that runs in 10 (``benchmarks/results/selected_h100.json``). Here
    one program takes ``BLOCK_R`` rows, walks their columns ``BLOCK_S`` at a time, reads each
    kept bit once, and writes each kept column once, at its rank in the row (a cumulative sum
    within the chunk plus the count so far).

    The mask is read through its strides: a transposed view gives the backward's lists (per
    key block, its query blocks) without a copy, and a mask of ``Hm`` heads serves the ``H``
    query heads of its groups (head ``h`` reads ``h // (H // Hm)``; stride 0 where ``Hm`` is 1).
    Rows and columns may be tiles ``repeat`` times finer than the mask's blocks (a block of
    ``repeat * 128`` positions holds ``repeat`` tiles a side), and a causal call keeps only the
    tiles strictly before the diagonal (``causal=1``: column < row, forward) or after it
    (``causal=2``: column > row, backward): the "full" tiles, every pair of which is allowed
    when queries and keys have one length (Note [Kernel tiles of a block mask] in
    ``block_sparse/tiles.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch
from .tiles import cdiv

_BLOCK_R = 32
_BLOCK_S = 128


@triton.jit
def _compact_kernel(
    kept, count, index,
    rows, cols, width, repeat, heads, group,
    s_b, s_h, s_r, s_c,
    CAUSAL: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
):  # fmt: skip
    """Program ``bh * cdiv(rows, BLOCK_R) + i``: rows ``[i * BLOCK_R, (i + 1) * BLOCK_R)`` of
    batch row and output head ``bh``."""
    chunks = tl.cdiv(rows, BLOCK_R)
    bh = tl.program_id(0).to(tl.int64) // chunks
    chunk = tl.program_id(0) % chunks
    b, h = bh // heads, bh % heads
    row = chunk * BLOCK_R + tl.arange(0, BLOCK_R)
    live = row < rows
    base = kept + b * s_b + (h // group) * s_h + (row // repeat).to(tl.int64)[:, None] * s_r
    out = index + (bh * rows + row).to(tl.int64)[:, None] * width
    total = tl.zeros((BLOCK_R,), dtype=tl.int32)
    end = cols
    if CAUSAL == 1:  # columns before the row: no further than this program's last row
        end = tl.minimum(cols, (chunk + 1) * BLOCK_R)
    for start in range(0, end, BLOCK_S):
        col = start + tl.arange(0, BLOCK_S)
        inside = live[:, None] & (col < cols)[None, :]
        if CAUSAL == 1:
            inside = inside & (col[None, :] < row[:, None])
        if CAUSAL == 2:
            inside = inside & (col[None, :] > row[:, None])
        bits = tl.load(base + (col // repeat).to(tl.int64)[None, :] * s_c, mask=inside, other=0)
        keep = (bits != 0) & inside
        rank = tl.cumsum(keep.to(tl.int32), axis=1) - 1 + total[:, None]
        tl.store(out + rank, col[None, :], mask=keep)
        total += tl.sum(keep.to(tl.int32), axis=1)
    tl.store(count + bh * rows + row, total, mask=live)


def compact(
    kept: torch.Tensor,
    *,
    heads: int,
    repeat: int = 1,
    causal: int = 0,
    rows: int | None = None,
    cols: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's kept columns in increasing order (Note [Lists of a run-time mask in one
    pass]).

    Args:
        kept: (Bm, Hm, Rb, Cb) bool on the GPU, any strides (a transposed view gives the
            other direction's lists); ``heads`` a multiple of Hm.
        repeat: rows and columns per mask block (tiles of a block ``repeat`` tiles wide).
        causal: 0 every kept column; 1 only columns before the row; 2 only columns after it.
        rows, cols: the rows and columns that exist, at most ``Rb * repeat`` and
            ``Cb * repeat`` (their default; fewer where the last block holds fewer tiles).

    Returns:
        ``count`` (Bm, heads, R) int32 and ``index`` (Bm, heads, R, C) int32: row ``r``'s
        columns in ``index[..., r, :count[..., r]]``, the entries after them 0.
    """
    batch, mask_heads, block_rows, block_cols = kept.shape
    rows = block_rows * repeat if rows is None else rows
    cols = block_cols * repeat if cols is None else cols
    count = torch.empty(batch, heads, rows, dtype=torch.int32, device=kept.device)
    index = torch.zeros(batch, heads, rows, cols, dtype=torch.int32, device=kept.device)
    if count.numel() == 0 or cols == 0:
        return count.zero_(), index
    s_b, s_h, s_r, s_c = kept.stride()
    if batch == 1:
        s_b = 0
    if mask_heads == 1:
        s_h = 0
    grid = (cdiv(rows, _BLOCK_R) * batch * heads,)
    args = (kept.view(torch.uint8), count, index, rows, cols, cols, repeat, heads,
            heads // mask_heads, s_b, s_h, s_r, s_c)  # fmt: skip
    options = {"CAUSAL": causal, "BLOCK_R": _BLOCK_R, "BLOCK_S": _BLOCK_S, "num_warps": 4}
    launch(_compact_kernel, grid, args, options)
    return count, index
