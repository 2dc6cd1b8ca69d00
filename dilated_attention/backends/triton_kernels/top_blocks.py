"""MoBA's choice of key blocks on the GPU in one pass over the affinities (Note [Top blocks in
registers]). Imported on first use, because it needs the ``triton`` package.

Note [Top blocks in registers]
    ``select_blocks`` keeps, per query block, its own blocks and the ``topk`` candidates of
    highest affinity (Note [MoBA's gate for a block of queries] in ``sparse/selection.py``).
    With torch operations that is a NaN clean-up, a masked fill and ``topk`` over the whole
    (B, H, Mq, Mk) float32 affinity, then a scatter: 2 ms of a 3.3 ms selection on an H100 at
    262,144 tokens, 24 of 36 ms at 1M. Here one program holds a row of affinities in
    registers (``Mk`` up to :data:`MAX_COLUMNS`), reads only its candidates, and takes the
    maximum ``topk`` times, the lowest column among equal ones each time; it writes the row's
    bool mask once. A NaN affinity ranks below every number and above the non-candidates, as
    the torch path ranks it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch
from .tiles import next_power_of_2

#: The widest row a program holds (key blocks): 32 float32 per thread at 16 warps.
MAX_COLUMNS = 16384


@triton.jit
def _top_blocks_kernel(
    affinity, candidates, own, chosen,
    cols, heads, rows, topk,
    s_ab, s_ah, s_ar,
    s_cb, s_ch, s_cr,
    s_ob, s_oh, s_or,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Program ``bh * rows + r``: row ``r`` of batch row and head ``bh``."""
    program = tl.program_id(0).to(tl.int64)
    bh, r = program // rows, program % rows
    b, h = bh // heads, bh % heads
    col = tl.arange(0, BLOCK)
    inside = col < cols
    allowed = tl.load(candidates + b * s_cb + h * s_ch + r * s_cr + col, mask=inside, other=0)
    allowed = allowed != 0
    score = tl.load(affinity + b * s_ab + h * s_ah + r * s_ar + col, mask=allowed, other=0.0)
    score = tl.where(score != score, -3.4028234663852886e38, score)  # NaN: the lowest number
    score = tl.where(allowed, score, float("-inf"))
    keep = tl.load(own + b * s_ob + h * s_oh + r * s_or + col, mask=inside, other=0) != 0
    for _ in range(topk):
        top = tl.max(score, axis=0)
        first = tl.min(tl.where(score == top, col, BLOCK), axis=0)
        pick = col == tl.where(top > float("-inf"), first, BLOCK)  # none once all are taken
        keep = keep | pick
        score = tl.where(pick, float("-inf"), score)
    tl.store(chosen + program * cols + col, keep.to(tl.int8), mask=inside)


def _columns_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself where its columns are contiguous (a broadcast keeps its stride 0 rows),
    else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def top_blocks(
    affinity: torch.Tensor, candidates: torch.Tensor, own: torch.Tensor, topk: int
) -> torch.Tensor:
    """Each row's own blocks and its ``min(topk, candidates)`` candidates of highest affinity.

    Args:
        affinity: (B, Hs, Mq, Mk) float32, Mk <= :data:`MAX_COLUMNS`.
        candidates, own: bool broadcastable to it.

    Returns:
        (B, Hs, Mq, Mk) bool.
    """
    batch, heads, rows, cols = affinity.shape
    chosen = torch.empty(affinity.shape, dtype=torch.bool, device=affinity.device)
    if chosen.numel() == 0:
        return chosen
    shape = tuple(affinity.shape)
    affinity, candidates, own = (_columns_contiguous(x.expand(shape))
                                 for x in (affinity, candidates, own))  # fmt: skip
    block = next_power_of_2(cols)
    args = (affinity, candidates.view(torch.uint8), own.view(torch.uint8),
            chosen.view(torch.int8), cols, heads, rows, topk, *affinity.stride()[:3],
            *candidates.stride()[:3], *own.stride()[:3])  # fmt: skip
    warps = max(1, min(16, block // 256))
    launch(_top_blocks_kernel, (batch * heads * rows,), args, {"BLOCK": block, "num_warps": warps})
    return chosen
