"""The affinities of block means as one Triton product of their bfloat16 parts (Note [The
parts' product in Triton]). Imported on first use, because it needs the ``triton`` package.

Note [The parts' product in Triton]
    Below ``affinity_tiles.MIN_COLUMNS`` key blocks (by slots a row; from 64 slots always) the
    choice stores the affinities, a batched product of the query means' parts by the key means'
    parts with float32 accumulation and output (Note [Affinities on tensor cores] in
    ``sparse/selection.py``), and its top-k kernel reads them. cuBLAS's ``bmm`` makes it as fast
    (11 us at 64K tokens, 16 heads over 4 key/value heads, blocks of 128, on an H100), but a
    choice replays its launches from a CUDA graph (Note [A choice's launches in one graph] in
    ``sparse/device_choice.py``), and a graph that captures a cuBLAS call keeps a cuBLAS
    workspace of its own in its memory pool (PyTorch clears the workspaces when a capture
    begins, so the capture allocates one): 32 MiB on an H100 for every layer's graph. This
    kernel is the plain tiled product: a program makes a ``BLOCK_ROWS`` x ``BLOCK_COLS`` tile of
    one head's affinities, ``BLOCK_K`` of the ``3 D`` parts at a time on the tensor cores (in
    float32 products under Triton's interpreter, whose product takes bfloat16 for integers; the
    parts' products are exact in float32 either way), and stores it; the sum runs over the parts
    in a different order than cuBLAS's, so a near tie may rank the other way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...triton import interpreting
from ..launch import launch_recorded, run_site, site_key
from ..tiles import cdiv

#: A program's tile of affinities, the parts' columns a step, its warps and pipeline stages.
_BLOCK_ROWS = 128
_BLOCK_COLS = 64
_BLOCK_K = 64
_WARPS = 4
_STAGES = 3


@triton.jit
def _product_kernel(
    left, right, out,
    rows, group_rows, cols, depth,
    s_lh, s_lg, s_lr, s_rh, s_rc, s_oh, s_or,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WIDEN: tl.constexpr,
):  # fmt: skip
    """Program (row tile, column tile, head): ``out[h, rows, cols] = left[h, rows] @
    right[h, cols].T`` in float32 (contiguous parts within a row); row ``r`` of ``left`` is row
    ``r % group_rows`` of its group ``r // group_rows``."""
    head = tl.program_id(2).to(tl.int64)
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    col = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    part = tl.arange(0, BLOCK_K)
    at = row // group_rows * s_lg + row % group_rows * s_lr
    left += head * s_lh + at[:, None] + part[None, :]
    right += head * s_rh + col[:, None] * s_rc + part[None, :]
    acc = tl.zeros((BLOCK_ROWS, BLOCK_COLS), tl.float32)
    for start in range(0, depth, BLOCK_K):
        inside = part[None, :] < depth - start
        a = tl.load(left + start, mask=(row < rows)[:, None] & inside, other=0.0)
        b = tl.load(right + start, mask=(col < cols)[:, None] & inside, other=0.0)
        if WIDEN:
            acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc,
                         input_precision="ieee")  # fmt: skip
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    where = (row < rows)[:, None] & (col < cols)[None, :]
    tl.store(out + head * s_oh + row[:, None] * s_or + col[None, :], acc, mask=where)


def parts_product(left: torch.Tensor, right: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = left @ right.transpose(-1, -2)`` in float32 (Note [The parts' product in
    Triton]).

    Args:
        left: (N, G, R, K) bfloat16 parts, contiguous within a row (any other strides): the
            product's rows are its G R rows, group by group.
        right: (N, C, K) bfloat16 parts, contiguous within a row.
        out: (N, G R, C) float32, contiguous within a row: written in place.

    Returns:
        ``out``.
    """
    if out.numel() == 0:
        return out
    roles = (left, right, out)  # a known layout replays its launch (Note [Bound launches])
    site = site_key("parts_product", roles)
    run_site(site, roles, lambda: _launch(left, right, out))
    return out


def _launch(left: torch.Tensor, right: torch.Tensor, out: torch.Tensor) -> None:
    """The launch of :func:`parts_product`."""
    heads, groups, group_rows, depth = left.shape
    rows, cols = groups * group_rows, right.shape[1]
    args = (left, right, out, rows, group_rows, cols, depth, *left.stride()[:3],
            *right.stride()[:2], *out.stride()[:2])  # fmt: skip
    options = {"BLOCK_ROWS": _BLOCK_ROWS, "BLOCK_COLS": _BLOCK_COLS, "BLOCK_K": _BLOCK_K,
               "WIDEN": interpreting(), "num_warps": _WARPS, "num_stages": _STAGES}  # fmt: skip
    grid = (cdiv(rows, _BLOCK_ROWS), cdiv(cols, _BLOCK_COLS), heads)
    launch_recorded(_product_kernel, grid, args, options)
