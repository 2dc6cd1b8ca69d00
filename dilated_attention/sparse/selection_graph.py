"""``select_blocks``' choice on the GPU as buffers and launches, replayed from a CUDA graph once
the same call ran before.

Note [The selection from a CUDA graph]
    Up to 1,023 key blocks (64K tokens in blocks of 64, 128K in blocks of 128) the choice is
    four launches: the query and key means' parts (Note [Block means in the parts' launch] in
    ``triton_kernels/selection/mean_parts.py``), their product and the top blocks, each a few
    tens of microseconds of GPU work, so the host's launches decide its time (0.29 ms at 64K
    tokens against ~0.15 ms of kernels). Here the parts and the product are allocated with the
    result first, and the four launches go through :func:`~dilated_attention.core.execution.\
graphs.run_launches` (Note [A call's launches from a CUDA graph]): a call that ran before at
    the same addresses replays them as one graph launch. The results are the launches' own.
    Longer calls (the choice a tile at a time) and packed documents launch as they are.

Shape legend: B batch, H query heads, Hkv key/value heads, Hs the heads chosen for (H or Hkv),
Mq / Mk query / key blocks, D head dim.
"""

from __future__ import annotations

from typing import Any

import torch

from ..backends.triton import graphable_launches, kernel_module
from ..core.execution import graphs

__all__ = ["choose_in_graph"]


def choose_in_graph(
    q: torch.Tensor,
    k: torch.Tensor,
    rows: Any,
    topk: int,
    per: str,
    own_width: int | None,
    block_size: int,
    chosen: torch.Tensor,
    top_blocks: Any,
) -> bool:
    """Write the choice into ``chosen`` through a CUDA graph where one applies (Note [The
    selection from a CUDA graph]); False (nothing done) where not.

    Args:
        q: (B, Nq, H, D) and k (B, Nk, Hkv, D) rows on the GPU.
        rows: the candidates by position (``selection.CandidateRanges``).
        topk, per, own_width, block_size: as ``selection.chosen_blocks`` takes them.
        chosen: (B, Hs, Mq, width) bool or int32, the result's buffer.
        top_blocks: the ``selection.top_blocks`` kernel module.
    """
    parts = kernel_module("selection.mean_parts")
    tiles = kernel_module("selection.affinity_tiles")
    batch, hs, mq = chosen.shape[:3]
    mk = -(-k.shape[1] // block_size)
    kv_heads = k.shape[2]
    if parts is None or (tiles is not None and tiles.takes(mk, topk)):
        return False
    if not graphable_launches(q):
        return False
    summed = q.shape[2] // kv_heads if per == "kv_head" else 1
    device = q.device
    left = torch.empty(parts.parts_shape(q, summed, block_size), dtype=torch.bfloat16,
                       device=device)  # fmt: skip
    right = torch.empty(parts.parts_shape(k, 1, block_size), dtype=torch.bfloat16, device=device)
    affinity = torch.empty(batch * kv_heads, hs // kv_heads * mq, mk, dtype=torch.float32,
                           device=device)  # fmt: skip

    def launches() -> None:
        parts.mean_parts(q, summed, 2, block_size, out=left)
        parts.mean_parts(k, 1, 1, block_size, out=right)
        torch.bmm(
            left.view(batch * kv_heads, -1, left.shape[-1]),
            right.flatten(0, 1).transpose(-1, -2), out_dtype=torch.float32, out=affinity,
        )  # fmt: skip
        top_blocks.top_blocks(
            affinity.view(batch, hs, mq, mk), rows.kernel_rows(0, top_blocks.RowRanges), None,
            topk, out=chosen, own_width=own_width,
        )  # fmt: skip

    key = ("select_blocks", rows, topk, per, own_width, block_size)
    graphs.run_launches(key, (q, k, chosen, left, right, affinity), launches)
    return True
