"""Block means as the bfloat16 parts of the affinities' product, in one launch (Note [Parts in
one launch]). Imported on first use, because it needs the ``triton`` package.

Note [Parts in one launch]
    The affinities are one bfloat16 product of float32 block means split into parts (Note
    [Affinities on tensor cores] in ``sparse/selection.py``). In torch operations each operand
    takes a copy into head-major order, a sum over a group's heads (one choice per key/value
    head), a cast, a difference, a second cast and a concatenation: six launches per operand,
    which at 64K tokens cost more host time than the GPU spends on the whole choice. Here one
    program per (batch row, output head, ``ROWS`` blocks) reads its rows of the means, sums the
    group's heads in float32, splits the sum into ``hi = bf16(x)`` and ``lo = bf16(x - hi)``
    and writes the three parts in the product's order: the same values (the sum's order over
    the group's heads aside) in one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch import launch
from ..tiles import cdiv, next_power_of_2

_ROWS = 16


@triton.jit
def _bfloat16_nearest(x):
    """float32 ``x`` rounded to the nearest bfloat16, ties to even, as torch rounds (the
    interpreter's cast truncates), NaN kept; returned in float32, so the cast that follows
    is exact."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def _mean_parts_kernel(
    x, out,
    blocks, heads_out, group, dim,
    s_xb, s_xm, s_xh, s_xd,
    s_ob, s_oh, s_om,
    LOW_AT: tl.constexpr,
    ROWS: tl.constexpr,
    DIM: tl.constexpr,
):  # fmt: skip
    """Program (``b * heads_out + h``, row tile): rows of output head ``h``, the sum of input
    heads ``h * group .. h * group + group - 1``; parts laid ``[hi, hi, lo]`` (``LOW_AT`` 2)
    or ``[hi, lo, hi]`` (``LOW_AT`` 1)."""
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // heads_out, bh % heads_out
    row = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    col = tl.arange(0, DIM)
    where = (row < blocks)[:, None] & (col < dim)[None, :]
    offsets = row[:, None] * s_xm + col[None, :] * s_xd
    base = x + b * s_xb + h * group * s_xh
    total = tl.zeros((ROWS, DIM), tl.float32)
    for i in range(group):
        total += tl.load(base + i * s_xh + offsets, mask=where, other=0.0).to(tl.float32)
    high = _bfloat16_nearest(total)
    low = _bfloat16_nearest(total - high).to(tl.bfloat16)
    high = high.to(tl.bfloat16)
    target = out + b * s_ob + h * s_oh + row[:, None] * s_om + col[None, :]
    for part in tl.static_range(3):
        value = low if part == LOW_AT else high
        tl.store(target + part * dim, value, mask=where)


def mean_parts(x: torch.Tensor, group: int, low_at: int) -> torch.Tensor:
    """Block means as bfloat16 parts (Note [Parts in one launch]).

    Args:
        x: (B, M, H, D) float32 block means, any strides.
        group: input heads summed into each output head (1: none summed).
        low_at: where the low part lies among the three: 2 for ``[hi, hi, lo]``, 1 for
            ``[hi, lo, hi]``.

    Returns:
        (B, H / group, M, 3 D) bfloat16, contiguous.
    """
    batch, blocks, heads, dim = x.shape
    heads_out = heads // group
    out = torch.empty(batch, heads_out, blocks, 3 * dim, dtype=torch.bfloat16, device=x.device)
    if out.numel() == 0:
        return out
    args = (x, out, blocks, heads_out, group, dim, *x.stride(), *out.stride()[:3])
    options = {"LOW_AT": low_at, "ROWS": _ROWS, "DIM": next_power_of_2(dim), "num_warps": 4}
    launch(_mean_parts_kernel, (batch * heads_out, cdiv(blocks, _ROWS)), args, options)
    return out
