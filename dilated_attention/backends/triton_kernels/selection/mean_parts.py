"""Block means as the bfloat16 parts of the affinities' product, in one launch per operand,
made from the rows themselves (Note [Parts in one launch], Note [Block means in the parts'
launch]). Imported on first use, because it needs the ``triton`` package.

Note [Parts in one launch]
    The affinities are one bfloat16 product of float32 block means split into parts (Note
    [Affinities on tensor cores] in ``sparse/selection.py``). In torch operations each operand
    takes a copy into head-major order, a sum over a group's heads (one choice per key/value
    head), a cast, a difference, a second cast and a concatenation: six launches per operand,
    which at 64K tokens cost more host time than the GPU spends on the whole choice. Here one
    program per (``BLOCKS`` blocks, batch row, output head) makes its blocks' means, sums the
    group's heads in float32, splits the sum into ``hi = bf16(x)`` and ``lo = bf16(x - hi)``
    and writes the three parts in the product's order: the same values (the sum's order over
    the group's heads aside) in one launch.

Note [Block means in the parts' launch]
    The means themselves were more torch launches per operand (a float32 mean over the whole
    blocks; where the last block is short, its mean and a concatenation) and a float32 (B, M,
    H, D) copy written and read back: at 1M tokens 1.8 of a choice's 4.6 ms on an H100, and at
    64K the choice, five launches, was bound by the host. So the kernel takes the rows (B, N,
    H, D), in any float dtype and strides, and the block size, and makes the means on the way
    to the parts: a program takes ``HEADS`` output heads of its blocks and, for each of the
    group's heads, reads its rows ``CHUNK`` at a time as (BLOCKS, CHUNK, HEADS x DIM) tiles,
    adds them up in float32 and divides each block's sum by its real rows (the last block may
    be shorter; nothing is padded); the heads' means are summed as before. The means are
    never stored: the operand is read once, only its parts are written, one launch from
    input to parts.

    A row of a tile spans ``_ROW_COLUMNS`` elements (8 heads of 128: 2 KiB of a bfloat16
    row with one key/value head a group, as a row of the input lays them): a program reading
    one head (256-byte pieces of rows 4 KiB apart) ran the operands at 1.6-2.0 TB/s on an
    H100 where torch's mean over whole rows ran at 2.7; 8 heads a program run them at 2.8
    (1.93 ms at 1M tokens, 16 query and 4 key/value heads of 128, against 2.0 for the torch
    mean alone). A tile holds ``_TILE`` elements and at most ``_MOST_BLOCKS`` blocks, in 4
    warps: at 8 heads of 128, 8 rows a chunk (64 float32 sums a thread), a block of 128 in
    16 chunks. More blocks take more registers than their rows do (64 blocks of one row, 254
    registers by ptxas for sm_90; 16, 78). A program's chunks stop at its blocks' most rows
    (a query shorter than a block reads one chunk). The grid is 1-D with the head tiles
    fastest, then the batch rows, then the block tiles; it holds 2^31 programs (a 2-D grid's
    second dimension holds 65,535: 8M tokens in blocks of 128). Offsets are int64 to a
    program's first row and head and int32 within its tile, int64 there too only where a
    tile spans 2^31 elements (``WIDE``: a view into a larger tensor). Block means already
    made (a ring rank gathers every rank's key means) are blocks of one row: the same kernel
    with ``block_size=1``, which divides by 1 and adds the heads in the same order, gives the
    parts of those means bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch import launch_recorded, run_site, site_key
from ..tiles import cdiv, next_power_of_2

#: Elements of a program's tile of rows, (BLOCKS x CHUNK) x (HEADS x DIM), its most blocks,
#: the elements of a row it spans, and its warps (Note [Block means in the parts' launch]).
_TILE = 8192
_MOST_BLOCKS = 16
_ROW_COLUMNS = 1024
_WARPS = 4


@triton.jit
def _bfloat16_nearest(x):
    """float32 ``x`` rounded to the nearest bfloat16, ties to even, as torch rounds (the
    interpreter's cast truncates), NaN kept; returned in float32, so the cast that follows
    is exact."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def _head_means(
    x, first, count, span, col_at, col_ok, s_xn,
    BLOCKS: tl.constexpr, CHUNK: tl.constexpr, COLS: tl.constexpr, WIDE: tl.constexpr,
):  # fmt: skip
    """The mean over each block's real rows of the columns ``col_at`` (COLS,) offsets of a
    row (``col_ok`` the real ones), (BLOCKS, COLS) float32: block ``i`` is rows ``first[i] ..
    first[i] + count[i] - 1`` from ``x`` (the tile's first row; count <= 0: none, a block
    past the end), ``count`` at most ``span``. Offsets from ``x`` are int32 unless ``WIDE``
    (Note [Block means in the parts' launch])."""
    within = tl.arange(0, CHUNK)
    if WIDE:
        first, col_at = first.to(tl.int64), col_at.to(tl.int64)
    total = tl.zeros((BLOCKS, CHUNK, COLS), tl.float32)
    for start in range(0, span, CHUNK):
        row = start + within
        where = (row[None, :] < count[:, None])[:, :, None] & col_ok[None, None, :]
        at = (first[:, None] + row[None, :])[:, :, None] * s_xn + col_at[None, None, :]
        total += tl.load(x + at, mask=where, other=0.0).to(tl.float32)
    return tl.sum(total, axis=1) / tl.maximum(count, 1).to(tl.float32)[:, None]


@triton.jit
def _mean_parts_kernel(
    x, out,
    length, block_size, span, blocks, pairs, head_tiles, heads_out, group, dim,
    s_xb, s_xn, s_xh, s_xd,
    s_ob, s_oh, s_om,
    LOW_AT: tl.constexpr,
    BLOCKS: tl.constexpr,
    CHUNK: tl.constexpr,
    HEADS: tl.constexpr,
    DIM: tl.constexpr,
    WIDE: tl.constexpr,
):  # fmt: skip
    """Program ``tile * pairs + b * head_tiles + t``: blocks ``tile * BLOCKS ..`` of output
    heads ``t * HEADS ..``, each the sum of the means of its input heads ``h * group .. h *
    group + group - 1`` (``span``: a block's most rows, ``min(block_size, length)``); parts
    laid ``[hi, hi, lo]`` (``LOW_AT`` 2) or ``[hi, lo, hi]`` (``LOW_AT`` 1)."""
    program = tl.program_id(0).to(tl.int64)
    tile, bt = program // pairs, program % pairs
    b, first_head = bt // head_tiles, bt % head_tiles * HEADS
    block = tile * BLOCKS + tl.arange(0, BLOCKS)
    first = tl.arange(0, BLOCKS) * block_size  # from the tile's first row
    count = tl.minimum(length - block * block_size, block_size).to(tl.int32)
    col = tl.arange(0, HEADS * DIM)  # (head in the tile, head dim)
    head, d = col // DIM, col % DIM
    col_ok = (d < dim) & (first_head + head < heads_out)
    col_at = head * group * s_xh + d * s_xd
    base = x + b * s_xb + first_head * group * s_xh + tile * BLOCKS * block_size * s_xn
    total = tl.zeros((BLOCKS, HEADS * DIM), tl.float32)
    for i in range(group):
        total += _head_means(base + i * s_xh, first, count, span, col_at, col_ok, s_xn,
                             BLOCKS, CHUNK, HEADS * DIM, WIDE)  # fmt: skip
    high = _bfloat16_nearest(total)
    low = _bfloat16_nearest(total - high).to(tl.bfloat16)
    high = high.to(tl.bfloat16)
    where = (block < blocks)[:, None] & col_ok[None, :]
    target = (out + b * s_ob + first_head * s_oh + block[:, None] * s_om
              + (head * s_oh + d)[None, :])  # fmt: skip
    for part in tl.static_range(3):
        value = low if part == LOW_AT else high
        tl.store(target + part * dim, value, mask=where)


def empty_parts(x: torch.Tensor, group: int, block_size: int = 1) -> torch.Tensor:
    """The uninitialised result of :func:`mean_parts` of ``x`` (B, N, H, D): (B, H / group,
    ceil(N / bs), 3 D) bfloat16, contiguous."""
    batch, length, heads, dim = x.shape
    return torch.empty(batch, heads // group, cdiv(length, block_size), 3 * dim,
                       dtype=torch.bfloat16, device=x.device)  # fmt: skip


def mean_parts(
    x: torch.Tensor,
    group: int,
    low_at: int,
    block_size: int = 1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Block means as bfloat16 parts, from the rows in one launch (Note [Parts in one launch],
    Note [Block means in the parts' launch]).

    Args:
        x: (B, N, H, D) rows in bfloat16, float16 or float32, any strides; with
            ``block_size=1`` these may be block means already made, (B, M, H, D) float32.
        group: input heads whose means are summed into each output head (1: none summed).
        low_at: where the low part lies among the three: 2 for ``[hi, hi, lo]``, 1 for
            ``[hi, lo, hi]``.
        block_size: rows per block ``bs``; the last block may be shorter (its mean is over
            its real rows).
        out: where to write, :func:`empty_parts` of the same arguments; None for a new tensor.

    Returns:
        (B, H / group, ceil(N / bs), 3 D) bfloat16, contiguous: ``out`` or a new tensor.
    """
    if out is None:
        out = empty_parts(x, group, block_size)
    if out.numel() == 0:
        return out
    roles = (x, out)  # a known layout replays its launch (Note [Bound launches] in launch.py)
    site = site_key("mean_parts", roles, group, low_at, block_size)
    run_site(site, roles, lambda: _launch(x, out, group, low_at, block_size))
    return out


def _launch(x: torch.Tensor, out: torch.Tensor, group: int, low_at: int, block_size: int) -> None:
    """The launch of :func:`mean_parts` into ``out``."""
    batch, length, _, dim = x.shape
    heads_out, blocks = out.shape[1], out.shape[2]
    width = next_power_of_2(dim)
    per_program = min(next_power_of_2(heads_out), max(1, _ROW_COLUMNS // width))
    cols = per_program * width
    chunk = min(next_power_of_2(block_size), max(1, _TILE // cols))
    per_tile = min(_MOST_BLOCKS, max(1, _TILE // (cols * chunk)))
    head_tiles = cdiv(heads_out, per_program)
    pairs = batch * head_tiles
    args = (x, out, length, block_size, min(block_size, length), blocks, pairs, head_tiles,
            heads_out, group, dim, *x.stride(), *out.stride()[:3])  # fmt: skip
    # A tile's offsets from its first row and first head: its rows, heads and head dim.
    reach = (
        per_tile * block_size * abs(x.stride(1))
        + (per_program * group - 1) * abs(x.stride(2))
        + (dim - 1) * abs(x.stride(3))
    )
    options = {"LOW_AT": low_at, "BLOCKS": per_tile, "CHUNK": chunk, "HEADS": per_program,
               "DIM": width, "WIDE": reach >= 2**31, "num_warps": _WARPS}  # fmt: skip
    launch_recorded(_mean_parts_kernel, (cdiv(blocks, per_tile) * pairs,), args, options)
