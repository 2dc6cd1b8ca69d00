"""A block mask as the 128 x 128 tiles that FlexAttention and FlashAttention-4 walk.

Note [Kernel tiles of a block mask]
    Both kernels take block sparsity as lists of tiles of 128 query rows by 128 key rows. A tile
    whose every token pair is allowed is "full" (no per-element mask); a tile with some allowed
    pairs is "partial" and the kernel evaluates a ``mask_mod`` on it; other tiles are skipped.
    For a query tile the forward walks its key tiles (``tile_lists(tiles)``), the backward, per
    key tile, its query tiles (``tile_lists(tiles.T)``). With a ``block_size`` that is a multiple
    of 128 every tile lies inside one block pair, so the only partial tiles are causal diagonal
    ones; other block sizes give partial tiles where blocks straddle tiles. The last tile of a
    ragged length is shorter: the kernels mask the rows past the sequence end themselves.
"""

from __future__ import annotations

import torch

from .plan import num_blocks

#: Query and key rows per tile (FlexAttention's default sparse block, and the tile FA4's sm90
#: kernels take block sparsity at for head dims up to 128).
KERNEL_TILE = 128


def _tile_block_ranges(
    length: int, block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """First and last block index (inclusive) touched by each KERNEL_TILE tile of ``length``."""
    starts = torch.arange(num_blocks(length, KERNEL_TILE), device=device) * KERNEL_TILE
    ends = torch.clamp(starts + KERNEL_TILE, max=length) - 1
    return starts // block_size, ends // block_size


def kernel_tiles(
    mask: torch.Tensor, *, block_size: int, query_len: int, key_len: int, is_causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Classify the kernels' tiles from a block mask (causal already applied), on its device.

    Args:
        mask: (..., ceil(Nq / block_size), ceil(Nk / block_size)) bool, the kept block pairs
            (a pattern's on the host; a run-time mask's per batch row and head on the device).

    Returns:
        ``(full, partial)``: bool (..., query tiles, key tiles); ``full`` tiles have every
        token pair allowed, ``partial`` ones some but not all.
    """
    device = mask.device
    qa, qb = _tile_block_ranges(query_len, block_size, device)
    ka, kb = _tile_block_ranges(key_len, block_size, device)
    # 2-D prefix sums: allowed block pairs in each tile's block rectangle.
    *batch, rows, cols = mask.shape
    sums = torch.zeros(*batch, rows + 1, cols + 1, dtype=torch.int64, device=device)
    sums[..., 1:, 1:] = mask.to(torch.int64).cumsum(-2).cumsum(-1)
    qa, qb1, ka, kb1 = qa.view(-1, 1), (qb + 1).view(-1, 1), ka.view(1, -1), (kb + 1).view(1, -1)
    count = sums[..., qb1, kb1] - sums[..., qa, kb1] - sums[..., qb1, ka] + sums[..., qa, ka]
    every = count == (qb1 - qa) * (kb1 - ka)
    some = count > 0
    if is_causal:
        q_first = torch.arange(every.shape[-2], device=device).view(-1, 1) * KERNEL_TILE
        q_last = torch.clamp(q_first + KERNEL_TILE, max=query_len) - 1
        k_first = torch.arange(every.shape[-1], device=device).view(1, -1) * KERNEL_TILE
        k_last = torch.clamp(k_first + KERNEL_TILE, max=key_len) - 1
        every = every & (k_last <= q_first)  # every key precedes every query
        some = some & (k_first <= q_last)  # some key precedes some query
    return every, some & ~every


def tile_lists(tiles: torch.Tensor, *, compact: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's kept tiles as ``(count, indices)`` in the kernels' layout, int32.

    Args:
        tiles: (rows, cols) bool.
        compact: keep only as many index columns as the longest row needs (at least one), which
            FlashAttention-4 accepts; FlexAttention wants all ``cols``.

    Returns:
        ``count`` (1, 1, rows) and ``indices`` (1, 1, rows, cols or fewer): row ``r``'s kept
        columns in increasing order in ``indices[0, 0, r, :count[0, 0, r]]``.
    """
    count = tiles.sum(-1).to(torch.int32)
    indices = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    if compact:
        width = max(1, int(count.max()) if count.numel() else 0)
        # Strides (width, 1) even when width is 1: the kernel checks the last stride.
        indices = indices[:, :width].flatten().clone().view(-1, width)
    return count.view(1, 1, -1), indices.reshape(1, 1, *indices.shape)
