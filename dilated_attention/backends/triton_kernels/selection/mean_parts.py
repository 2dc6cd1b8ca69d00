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
    to the parts: for each of the group's heads a program reads its blocks ``CHUNK`` rows at
    a time as (BLOCKS, CHUNK, DIM) tiles, loads along the head dim (a row of one head is
    contiguous), adds them up in float32 and divides each block's sum by its real rows (the
    last block may be shorter; nothing is padded); the heads' means are summed as before. The
    means are never stored: the operand is read once, only its parts are written, one launch
    from input to parts.

    A tile holds ``_TILE`` elements and at most ``_MOST_BLOCKS`` blocks. At head dim 128 that
    is 64 rows (a block of 128 in two chunks, one block a program; blocks of 8, eight blocks
    of one chunk): 64 float32 sums a thread in 4 warps, each chunk of each head one 16 KiB
    load of 256-byte rows, 128 registers a thread by ptxas for sm_90 (4 programs an SM) and
    no spill. More blocks take more registers than their rows do (64 blocks of one row, 254;
    16, 78). A program's chunks stop at its blocks' most rows (a query shorter than a block
    reads one chunk). The grid is 1-D with the output heads fastest, then the batch rows,
    then the block tiles, so that the programs in flight read the heads of the same rows side
    by side; it holds 2^31 programs (a 2-D grid's second dimension holds 65,535: 8M tokens in
    blocks of 128). Offsets are int64: at 1M tokens the query's 16 heads of 128 are 2^31
    elements. Block means already made (a ring rank gathers every rank's key means) are
    blocks of one row: the same kernel with ``block_size=1``, which divides by 1 and adds the
    heads in the same order, gives the parts of those means bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch import launch
from ..tiles import cdiv, next_power_of_2

#: Elements of a program's tile of rows, (BLOCKS x CHUNK) x DIM, and its most blocks (Note
#: [Block means in the parts' launch]).
_TILE = 8192
_MOST_BLOCKS = 16


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
    x, first, count, span, dim, s_xn, s_xd,
    BLOCKS: tl.constexpr, CHUNK: tl.constexpr, DIM: tl.constexpr,
):  # fmt: skip
    """One head's mean over each block's real rows, (BLOCKS, DIM) float32: block ``i`` is
    rows ``first[i] .. first[i] + count[i] - 1`` of ``x`` (count <= 0: none, a block past the
    end), ``count`` at most ``span``."""
    within = tl.arange(0, CHUNK)
    col = tl.arange(0, DIM)
    total = tl.zeros((BLOCKS, CHUNK, DIM), tl.float32)
    for start in range(0, span, CHUNK):
        row = start + within
        where = (row[None, :] < count[:, None])[:, :, None] & (col < dim)[None, None, :]
        at = (first[:, None] + row[None, :])[:, :, None] * s_xn + col[None, None, :] * s_xd
        total += tl.load(x + at, mask=where, other=0.0).to(tl.float32)
    return tl.sum(total, axis=1) / tl.maximum(count, 1).to(tl.float32)[:, None]


@triton.jit
def _mean_parts_kernel(
    x, out,
    length, block_size, span, blocks, pairs, heads_out, group, dim,
    s_xb, s_xn, s_xh, s_xd,
    s_ob, s_oh, s_om,
    LOW_AT: tl.constexpr,
    BLOCKS: tl.constexpr,
    CHUNK: tl.constexpr,
    DIM: tl.constexpr,
):  # fmt: skip
    """Program ``tile * pairs + b * heads_out + h``: blocks ``tile * BLOCKS ..`` of output
    head ``h``, the sum of the means of input heads ``h * group .. h * group + group - 1``
    (``span``: a block's most rows, ``min(block_size, length)``); parts laid ``[hi, hi,
    lo]`` (``LOW_AT`` 2) or ``[hi, lo, hi]`` (``LOW_AT`` 1)."""
    program = tl.program_id(0).to(tl.int64)
    tile, bh = program // pairs, program % pairs
    b, h = bh // heads_out, bh % heads_out
    block = tile * BLOCKS + tl.arange(0, BLOCKS)
    first = block * block_size
    count = tl.minimum(length - first, block_size)
    base = x + b * s_xb + h * group * s_xh
    total = tl.zeros((BLOCKS, DIM), tl.float32)
    for i in range(group):
        total += _head_means(base + i * s_xh, first, count, span, dim, s_xn, s_xd,
                             BLOCKS, CHUNK, DIM)  # fmt: skip
    high = _bfloat16_nearest(total)
    low = _bfloat16_nearest(total - high).to(tl.bfloat16)
    high = high.to(tl.bfloat16)
    col = tl.arange(0, DIM)
    where = (block < blocks)[:, None] & (col < dim)[None, :]
    target = out + b * s_ob + h * s_oh + block[:, None] * s_om + col[None, :]
    for part in tl.static_range(3):
        value = low if part == LOW_AT else high
        tl.store(target + part * dim, value, mask=where)


def mean_parts(x: torch.Tensor, group: int, low_at: int, block_size: int = 1) -> torch.Tensor:
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

    Returns:
        (B, H / group, ceil(N / bs), 3 D) bfloat16, contiguous.
    """
    batch, length, heads, dim = x.shape
    heads_out, blocks = heads // group, cdiv(length, block_size)
    out = torch.empty(batch, heads_out, blocks, 3 * dim, dtype=torch.bfloat16, device=x.device)
    if out.numel() == 0:
        return out
    width = next_power_of_2(dim)
    chunk = min(next_power_of_2(block_size), max(1, _TILE // width))
    per_tile = min(_MOST_BLOCKS, max(1, _TILE // (width * chunk)))
    pairs = batch * heads_out
    args = (x, out, length, block_size, min(block_size, length), blocks, pairs, heads_out,
            group, dim, *x.stride(), *out.stride()[:3])  # fmt: skip
    options = {"LOW_AT": low_at, "BLOCKS": per_tile, "CHUNK": chunk, "DIM": width,
               "num_warps": 4}  # fmt: skip
    launch(_mean_parts_kernel, (cdiv(blocks, per_tile) * pairs,), args, options)
    return out
