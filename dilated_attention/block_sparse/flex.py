"""Block-sparse attention through compiled FlexAttention on a block mask.

Note [FlexAttention block masks]
    On CUDA, compiled FlexAttention runs the pattern as a ``BlockMask`` of the 128 x 128 tiles of
    Note [Kernel tiles of a block mask] (``tiles.py``; ``BlockMask.from_kv_blocks``). Its partial
    tiles evaluate ``mask_mod``: ``allowed[q // block_size, kv // block_size]`` and, when causal,
    ``q >= kv``, so any block size is exact. ``seq_lengths`` carries the ragged ends. Gradients
    are FlexAttention's own autograd.

    A run-time mask (Note [Run-time block masks] in ``runtime.py``) becomes a ``BlockMask`` per
    call, on the device, per batch row and query head (FlexAttention takes 1 or H heads); its
    ``mask_mod`` reads the kept blocks of the row and head. Its tensors are inputs of the
    compiled graph and its ``mask_mod`` a closure of one code object over a tensor and plain
    values, which Dynamo guards on by code, metadata and value: a new mask of the same shape
    runs the same compiled kernel.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..patterns import Pattern
from .lists import runtime_tile_lists
from .plan import causal_block_mask, num_blocks
from .runtime import per_query_head, token_rows
from .tiles import KERNEL_TILE, kernel_tiles, tile_lists


@torch.compiler.disable
@functools.lru_cache(maxsize=32)
def flex_block_mask(
    pattern: Pattern,
    block_size: int,
    query_len: int,
    key_len: int,
    is_causal: bool,
    device: torch.device,
) -> tuple[Any, torch.Tensor]:
    """A FlexAttention ``BlockMask`` for the pattern, and the (Nq,) bool "row sees no key".

    Built once per (pattern, shape) and cached: reusing the same ``BlockMask`` (and ``mask_mod``)
    keeps the compiled kernel's guards stable.
    """
    from torch.nn.attention.flex_attention import BlockMask

    nq, nk = num_blocks(query_len, block_size), num_blocks(key_len, block_size)
    mask = causal_block_mask(pattern.block_mask(nq, nk), is_causal)
    full, partial = kernel_tiles(
        mask, block_size=block_size, query_len=query_len, key_len=key_len, is_causal=is_causal
    )
    kv_num, kv_idx = tile_lists(partial)
    full_num, full_idx = tile_lists(full)
    # Padded by one tile so that any index the kernel may form stays in bounds.
    pad_q = num_blocks(query_len + KERNEL_TILE, block_size)
    pad_k = num_blocks(key_len + KERNEL_TILE, block_size)
    lookup = torch.zeros(pad_q, pad_k, dtype=torch.bool)
    lookup[:nq, :nk] = mask
    lookup = lookup.to(device)

    if is_causal:

        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return lookup[q_idx // block_size, kv_idx // block_size] & (q_idx >= kv_idx)

    else:

        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return lookup[q_idx // block_size, kv_idx // block_size]

    block_mask = BlockMask.from_kv_blocks(
        kv_num.to(device), kv_idx.to(device), full_num.to(device), full_idx.to(device),
        BLOCK_SIZE=KERNEL_TILE, mask_mod=mask_mod, seq_lengths=(query_len, key_len),
    )  # fmt: skip
    empty = ~mask.any(dim=1)
    empty_rows = empty.repeat_interleave(block_size)[:query_len].to(device)
    return block_mask, empty_rows


def runtime_flex_block_mask(
    kept: torch.Tensor,
    block_size: int,
    query_len: int,
    key_len: int,
    is_causal: bool,
    num_heads: int,
) -> tuple[Any, torch.Tensor]:
    """A FlexAttention ``BlockMask`` of a run-time mask's kept blocks (Bm, Hm, Mq, Mk) bool,
    causal applied, made on their device (Note [FlexAttention block masks]), and the
    (Bm, 1 or H, Nq) bool "row sees no key"."""
    from torch.nn.attention.flex_attention import BlockMask

    forward = runtime_tile_lists(
        kept, block_size=block_size, query_len=query_len, key_len=key_len,
        is_causal=is_causal, num_heads=num_heads,
    )  # fmt: skip
    # FlexAttention reads a list's width as the key tiles' count: the partial lists in full.
    key_tiles = forward.full_index.shape[-1]
    partial_index = torch.nn.functional.pad(
        forward.partial_index, (0, key_tiles - forward.partial_index.shape[-1])
    )
    kept = per_query_head(kept, num_heads)
    batch, heads, rows, cols = kept.shape
    # Padded by one tile so that any index the kernel may form stays in bounds.
    pad_q = num_blocks(query_len + KERNEL_TILE, block_size)
    pad_k = num_blocks(key_len + KERNEL_TILE, block_size)
    lookup = kept.new_zeros(batch, heads, pad_q, pad_k)
    lookup[..., :rows, :cols] = kept
    mask_mod = _kept_blocks_mod(lookup, block_size, is_causal, batch > 1, heads > 1)
    block_mask = BlockMask.from_kv_blocks(
        forward.partial_count, partial_index, forward.full_count, forward.full_index,
        BLOCK_SIZE=KERNEL_TILE, mask_mod=mask_mod, seq_lengths=(query_len, key_len),
    )  # fmt: skip
    return block_mask, token_rows(~kept.any(-1), block_size, query_len)


def _kept_blocks_mod(
    lookup: torch.Tensor, block_size: int, is_causal: bool, per_row: bool, per_head: bool
) -> Any:
    """The ``mask_mod`` of a run-time mask: ``lookup`` (Bm, Hm, blocks, blocks) of its batch
    row and head (index 0 of a size-1 dimension), and causality."""

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        keep = lookup[b if per_row else 0, h if per_head else 0, q_idx // block_size,
                      kv_idx // block_size]  # fmt: skip
        return keep & (q_idx >= kv_idx) if is_causal else keep

    return mask_mod


#: FlexAttention kernel options per (compute capability, head dim) for bf16/fp16 block-sparse
#: calls; anything not listed keeps Inductor's defaults. Measured with
#: ``benchmarks/tune_flex_block_sparse.py`` on an H100 80GB (record
#: ``benchmarks/results/tune_flex_block_sparse_h100.json``; torch 2.11, Triton 3.6; N = 65536,
#: H = 16, D = 128, bf16, random 10% block mask, block 128; median of CUDA-event timings,
#: forward / forward+backward): defaults 8.85 / 31.89 ms, max-autotune 8.76 / 31.89 ms (it picks
#: the configs below), USE_TMA 9.14 / 32.67 ms, dense cuDNN 55.4 / 214.6 ms. max-autotune's own
#: ranking put every other forward tile (128x128 two or one stage, 64x128, 64x64, 128x64 with 4
#: warps) at 85% or less of this one and every other backward config at 88% or less; 128x128 with
#: three stages needs more shared memory than an H100 has. The best measured configs are pinned,
#: so that a change of Inductor's heuristics cannot slow this path silently; they equal torch
#: 2.11's sm90 defaults, so on that torch they change no kernel.
_FLEX_KERNEL_OPTIONS: dict[tuple[tuple[int, int], int], dict[str, Any]] = {
    ((9, 0), 128): {
        "fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 8, "fwd_num_stages": 3,
        "bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
        "bwd_num_warps": 8, "bwd_num_stages": 3,
    },
}  # fmt: skip


@torch.compiler.disable
def flex_kernel_options(
    device: torch.device, head_dim: int, dtype: torch.dtype
) -> dict[str, Any] | None:
    """The ``kernel_options`` block-sparse FlexAttention uses here, or None for the defaults
    (a fresh dict per call: FlexAttention may add keys)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    options = _FLEX_KERNEL_OPTIONS.get((torch.cuda.get_device_capability(device), head_dim))
    return dict(options) if options is not None else None


def _flex_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocks: Pattern | torch.Tensor,
    *,
    block_size: int,
    is_causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention through compiled FlexAttention; (B, N, H, D) in and out.
    ``blocks``: the pattern, or a run-time mask's kept blocks (Bm, Hm, Mq, Mk) bool, causal
    applied."""
    from ..backends.flex import compiled_flex_attention

    shape = (block_size, q.shape[1], k.shape[1], is_causal)
    if isinstance(blocks, torch.Tensor):
        block_mask, empty_rows = runtime_flex_block_mask(blocks, *shape, q.shape[2])
    else:
        block_mask, empty_rows = flex_block_mask(blocks, *shape, q.device)
    out, lse = compiled_flex_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask,
        scale=scale, kernel_options=flex_kernel_options(q.device, q.shape[-1], q.dtype),
        static_shapes=True,
    )  # fmt: skip
    lse = torch.where(empty_rows, float("-inf"), lse.detach().float())
    return out.transpose(1, 2), lse
