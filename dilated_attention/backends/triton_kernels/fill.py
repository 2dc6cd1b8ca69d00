"""Setting the rows of flagged blocks to one value in one launch (Note [Filling flagged
blocks]). Imported on first use, because it needs the ``triton`` package.

Note [Filling flagged blocks]
    A run-time mask may leave a query block with no key (its output rows are 0, its ``lse``
    ``-inf``) or a key block that no query reads (its ``dk``, ``dv`` are 0), and which ones is
    known on the device only. ``x.masked_fill_(rows, 0)`` with a broadcast token mask reads and
    writes all of ``x``: 0.43 ms for a 64K-token output, an eighth of the attention it
    follows. Here one program per (batch row, head, block) reads its block's flag and, only
    where it is set, writes the block's rows: the cost is the launch and the flagged rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch
from .tiles import next_power_of_2

_ROWS = 32


@triton.jit
def _fill_blocks_kernel(
    x, flags, value,
    length, heads, group, blocks, block_size, dim,
    s_xb, s_xn, s_xh, s_xd,
    s_fb, s_fh, s_fm,
    ROWS: tl.constexpr,
    DIM: tl.constexpr,
):  # fmt: skip
    """Program ``bh * blocks + m``: block ``m`` of batch row and head ``bh``."""
    program = tl.program_id(0).to(tl.int64)
    bh, m = program // blocks, program % blocks
    b, h = bh // heads, bh % heads
    flag = tl.load(flags + b * s_fb + (h // group) * s_fh + m * s_fm)
    if flag != 0:
        col = tl.arange(0, DIM)
        end = tl.minimum((m + 1) * block_size, length)
        base = x + b * s_xb + h * s_xh
        for start in range(m * block_size, end, ROWS):
            row = start + tl.arange(0, ROWS)
            where = (row < end)[:, None] & (col < dim)[None, :]
            filled = tl.full((ROWS, DIM), value, x.dtype.element_ty)
            tl.store(base + row[:, None] * s_xn + col[None, :] * s_xd, filled, mask=where)


def fill_blocks(x: torch.Tensor, flags: torch.Tensor, block_size: int, value: float) -> None:
    """Set, in place, the rows of every flagged block of ``x`` to ``value`` (Note [Filling
    flagged blocks]).

    Args:
        x: (B, N, H, D) on the GPU, any strides.
        flags: (Bf, Hf, ceil(N / block_size)) bool, Bf in {1, B}, H a multiple of Hf.
    """
    batch, length, heads, dim = x.shape
    blocks = flags.shape[-1]
    if x.numel() == 0 or blocks == 0:
        return
    s_fb, s_fh, s_fm = flags.stride()
    s_fb, s_fh = (0 if flags.shape[0] == 1 else s_fb), (0 if flags.shape[1] == 1 else s_fh)
    args = (x, flags.view(torch.uint8), value, length, heads, heads // flags.shape[1], blocks,
            block_size, dim, *x.stride(), s_fb, s_fh, s_fm)  # fmt: skip
    options = {"ROWS": _ROWS, "DIM": next_power_of_2(dim), "num_warps": 4}
    launch(_fill_blocks_kernel, (batch * heads * blocks,), args, options)
