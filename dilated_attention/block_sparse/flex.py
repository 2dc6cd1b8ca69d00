"""Block-sparse attention through compiled FlexAttention on a block mask.

Note [FlexAttention block masks]
    On CUDA, compiled FlexAttention runs the pattern as a ``BlockMask`` of 128 x 128 tiles
    (``BlockMask.from_kv_blocks``). A tile whose every token pair is allowed is "full" (no
    per-element mask); a tile with some allowed pairs is "partial" and evaluates ``mask_mod``:
    ``allowed[q // block_size, kv // block_size]`` and, when causal, ``q >= kv``. Tiles of a
    ``block_size`` that is a multiple of 128 are all full except causal diagonal ones; other
    block sizes are exact too, with partial tiles where blocks straddle tiles. ``seq_lengths``
    carries the ragged ends. Gradients are FlexAttention's own autograd.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..patterns import Pattern
from .plan import causal_block_mask, num_blocks

#: FlexAttention's tile (its default sparse block size, which its kernels' tiles divide).
FLEX_TILE = 128


def _tile_block_ranges(length: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """First and last block index (inclusive) touched by each FLEX_TILE tile of ``length``."""
    starts = torch.arange(num_blocks(length, FLEX_TILE)) * FLEX_TILE
    ends = torch.clamp(starts + FLEX_TILE, max=length) - 1
    return starts // block_size, ends // block_size


def flex_tiles(
    mask: torch.Tensor, *, block_size: int, query_len: int, key_len: int, is_causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Classify FlexAttention tiles from a block mask (causal already applied).

    Returns:
        ``(full, partial)``: bool (query tiles, key tiles); ``full`` tiles have every token pair
        allowed, ``partial`` ones some but not all.
    """
    qa, qb = _tile_block_ranges(query_len, block_size)
    ka, kb = _tile_block_ranges(key_len, block_size)
    # 2-D prefix sums: allowed block pairs in each tile's block rectangle.
    sums = torch.zeros(mask.shape[0] + 1, mask.shape[1] + 1, dtype=torch.int64)
    sums[1:, 1:] = mask.to(torch.int64).cumsum(0).cumsum(1)
    qa, qb1, ka, kb1 = qa.view(-1, 1), (qb + 1).view(-1, 1), ka.view(1, -1), (kb + 1).view(1, -1)
    count = sums[qb1, kb1] - sums[qa, kb1] - sums[qb1, ka] + sums[qa, ka]
    every = count == (qb1 - qa) * (kb1 - ka)
    some = count > 0
    if is_causal:
        q_first = torch.arange(every.shape[0]).view(-1, 1) * FLEX_TILE
        q_last = torch.clamp(q_first + FLEX_TILE, max=query_len) - 1
        k_first = torch.arange(every.shape[1]).view(1, -1) * FLEX_TILE
        k_last = torch.clamp(k_first + FLEX_TILE, max=key_len) - 1
        every = every & (k_last <= q_first)  # every key precedes every query
        some = some & (k_first <= q_last)  # some key precedes some query
    return every, some & ~every


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(num, indices)`` in FlexAttention's layout (1, 1, Q) and (1, 1, Q, K), int32."""
    num = tiles.sum(-1).to(torch.int32)
    indices = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num.view(1, 1, -1), indices.view(1, 1, *indices.shape)


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
    full, partial = flex_tiles(
        mask, block_size=block_size, query_len=query_len, key_len=key_len, is_causal=is_causal
    )
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    # Padded by one tile so that any index the kernel may form stays in bounds.
    pad_q = num_blocks(query_len + FLEX_TILE, block_size)
    pad_k = num_blocks(key_len + FLEX_TILE, block_size)
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
        BLOCK_SIZE=FLEX_TILE, mask_mod=mask_mod, seq_lengths=(query_len, key_len),
    )  # fmt: skip
    empty = ~mask.any(dim=1)
    empty_rows = empty.repeat_interleave(block_size)[:query_len].to(device)
    return block_mask, empty_rows


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
    pattern: Pattern,
    *,
    block_size: int,
    is_causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention through compiled FlexAttention; (B, N, H, D) in and out."""
    from ..backends.flex import compiled_flex_attention

    block_mask, empty_rows = flex_block_mask(
        pattern, block_size, q.shape[1], k.shape[1], is_causal, q.device
    )
    out, lse = compiled_flex_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask,
        scale=scale, kernel_options=flex_kernel_options(q.device, q.shape[-1], q.dtype),
        static_shapes=True,
    )  # fmt: skip
    lse = torch.where(empty_rows, float("-inf"), lse.detach().float())
    return out.transpose(1, 2), lse
