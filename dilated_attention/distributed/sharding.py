"""Sequence sharding across ranks: contiguous and zigzag layouts, and global token positions.

Note [Sequence layouts]
    ``contiguous``: rank ``r`` of ``W`` holds tokens ``[r*n, (r+1)*n)`` with ``n = N / W``.
    ``zigzag``: the sequence is cut into ``2W`` chunks of ``N / 2W`` and rank ``r`` holds chunks
    ``r`` and ``2W-1-r`` (in that order). Under a causal mask every rank then has the same work:
    an early chunk, which sees little, paired with a late one, which sees much.

    N = 8, W = 2:   contiguous  rank 0: 0 1 2 3   rank 1: 4 5 6 7
                    zigzag      rank 0: 0 1 6 7   rank 1: 2 3 4 5
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._comm import group_rank_and_size

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: object) -> str:
    """Return ``layout`` if it names a layout, else raise ``ValueError``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return str(layout)


def chunks_of(rank: int, world_size: int, layout: str) -> list[int]:
    """Global chunk indices a rank holds, in local order (chunks have equal length)."""
    if layout == "contiguous":
        return [rank]
    return [rank, 2 * world_size - 1 - rank]


def chunks_per_rank(layout: str) -> int:
    """How many chunks each rank holds."""
    return 1 if layout == "contiguous" else 2


def local_positions(
    local_len: int,
    *,
    rank: int,
    world_size: int,
    layout: str = "contiguous",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Global positions (int64, ``(local_len,)``) of the tokens a rank holds."""
    parts = chunks_per_rank(layout)
    chunk = local_len // parts
    return torch.cat(
        [
            torch.arange(c * chunk, (c + 1) * chunk, device=device)
            for c in chunks_of(rank, world_size, layout)
        ]
    )


def _check_divisible(seq_len: int, world_size: int, layout: str, name: str) -> None:
    parts = world_size * chunks_per_rank(layout)
    if seq_len % parts != 0:
        fix = (
            "pad the sequence" if layout == "contiguous" else "pad the sequence, or use contiguous"
        )
        raise ValueError(
            f"{name} ({seq_len}) must be divisible by {parts} (world size {world_size}"
            f"{' x 2 for the zigzag layout' if layout == 'zigzag' else ''}); {fix}"
        )


def shard_sequence(
    x: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    layout: str = "contiguous",
    seq_dim: int = 1,
) -> torch.Tensor:
    """This rank's shard of a full sequence (every rank passes the same ``x``).

    Args:
        x: a tensor whose dim ``seq_dim`` is the sequence (length N).
        layout: ``"contiguous"`` or ``"zigzag"`` (Note [Sequence layouts]).

    Returns:
        The local shard, contiguous, with ``N / W`` tokens along ``seq_dim``.
    """
    layout = check_layout(layout)
    rank, size = group_rank_and_size(group)
    seq_len = x.shape[seq_dim]
    _check_divisible(seq_len, size, layout, f"x.shape[{seq_dim}] (seq_len)")
    pieces = x.chunk(size * chunks_per_rank(layout), dim=seq_dim)
    return torch.cat([pieces[c] for c in chunks_of(rank, size, layout)], dim=seq_dim).contiguous()


def unshard_sequence(
    x_local: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    layout: str = "contiguous",
    seq_dim: int = 1,
) -> torch.Tensor:
    """The full sequence from every rank's shard (an all-gather; the inverse of
    :func:`shard_sequence`). Not differentiable."""
    layout = check_layout(layout)
    _, size = group_rank_and_size(group)
    if size == 1:
        return x_local
    local = x_local.contiguous()
    gathered = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(gathered, local, group=group)
    parts = chunks_per_rank(layout)
    chunks: dict[int, torch.Tensor] = {}
    for r, shard in enumerate(gathered):
        for c, piece in zip(
            chunks_of(r, size, layout), shard.chunk(parts, dim=seq_dim), strict=True
        ):
            chunks[c] = piece
    return torch.cat([chunks[c] for c in sorted(chunks)], dim=seq_dim)


def sequence_positions(
    local_len: int,
    *,
    group: dist.ProcessGroup | None = None,
    layout: str = "contiguous",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Global positions of this rank's ``local_len`` tokens (for rotary embeddings and masks)."""
    layout = check_layout(layout)
    rank, size = group_rank_and_size(group)
    _check_divisible(local_len * size, size, layout, "local_len * world_size")
    return local_positions(local_len, rank=rank, world_size=size, layout=layout, device=device)
