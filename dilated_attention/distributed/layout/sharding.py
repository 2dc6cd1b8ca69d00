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

import operator
import zlib

import torch
import torch.distributed as dist
from einops import rearrange

from ..comm.collectives import group_rank_and_size
from ..context import ContextParallel, check_same_everywhere, mesh_positions

LAYOUTS = ("contiguous", "zigzag")
#: dtype codes for the agreement of :func:`unshard_sequence` (any other dtype: its own code).
_DTYPES = (
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
    torch.complex128, torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
)  # fmt: skip
_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "meta")
_UNEQUAL_SHARDS = (
    "every rank must hold a shard of the same length (the ring functions need equal shards); "
    "shard the full sequence with dilated_attention.shard_sequence, padding it to a multiple of "
    "the world size (x 2 for the zigzag layout) first"
)


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


def _check_seq_dim(x: object, seq_dim: object, name: str) -> int:
    """``seq_dim`` as a non-negative dim of the tensor ``x``, else ``TypeError``/``ValueError``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, int):
        raise TypeError(f"seq_dim must be an int, got {seq_dim!r}")
    if not -x.dim() <= seq_dim < x.dim():
        raise ValueError(
            f"seq_dim ({seq_dim}) is not a dim of {name} with shape {tuple(x.shape)}; pass the "
            f"dim that holds the sequence"
        )
    return seq_dim % x.dim()


def _code(value: object, known: tuple[object, ...]) -> int:
    """``value``'s index in ``known``, else a code of its own past the end."""
    return known.index(value) if value in known else len(known) + zlib.crc32(repr(value).encode())


def shard_sequence(
    x: torch.Tensor,
    *,
    group: dist.ProcessGroup | ContextParallel | None = None,
    layout: str = "contiguous",
    seq_dim: int = 1,
) -> torch.Tensor:
    """This rank's shard of a full sequence (every rank passes the same ``x``).

    No communication: each rank slices its own copy, so the checks below see the same shape
    and options on every rank and raise on all of them together. A rank that passes another
    ``x`` gets shards of another length; the ring functions then raise on every rank.

    Args:
        x: a tensor whose dim ``seq_dim`` is the sequence (length N).
        group: the process group (default: the world), or a :class:`ContextParallel` (its
            ranks' shares: Note [Context parallel groups]).
        layout: ``"contiguous"`` or ``"zigzag"`` (Note [Sequence layouts]).
        seq_dim: the dim of ``x`` that holds the sequence.

    Returns:
        The local shard, contiguous, with ``N / W`` tokens along ``seq_dim``.

    Raises:
        ValueError: an unknown layout, a ``seq_dim`` outside ``x``, N not divisible by W (2W for
            zigzag), or a ``group`` this process is not in.
    """
    layout = check_layout(layout)
    if isinstance(group, ContextParallel):
        (rank, head_rank), (size, heads) = group.ranks(), group.sizes()
    else:
        (rank, size), head_rank, heads = group_rank_and_size(group), 0, 1
    seq_dim = _check_seq_dim(x, seq_dim, "x")
    seq_len = x.shape[seq_dim]
    _check_divisible(seq_len, size * heads, layout, f"x.shape[{seq_dim}] (seq_len)")
    pieces = x.chunk(size * chunks_per_rank(layout) * heads, dim=seq_dim)
    mine = [pieces[c * heads + head_rank] for c in chunks_of(rank, size, layout)]
    return torch.cat(mine, dim=seq_dim).contiguous()


def unshard_sequence(
    x_local: torch.Tensor,
    *,
    group: dist.ProcessGroup | ContextParallel | None = None,
    layout: str = "contiguous",
    seq_dim: int = 1,
) -> torch.Tensor:
    """The full sequence from every rank's shard (an all-gather; the inverse of
    :func:`shard_sequence`). Not differentiable.

    Before the all-gather every rank checks its own arguments and the ranks agree on them (like
    the ring functions): a shard rejected on one rank, or shards of another shape, dtype, device
    type, ``seq_dim`` or ``layout`` on some rank, raise on every rank instead of aborting or
    hanging the all-gather. Under a :class:`ContextParallel` the head group agrees first and
    carries its error into the ring group's agreement (Note [One answer on every rank of a
    mesh] in ``context.py``), so every rank of the mesh raises.

    Args:
        x_local: this rank's shard, ``n`` tokens along ``seq_dim`` (``n`` even for zigzag).
        group: the process group (default: the world), or a :class:`ContextParallel`.
        layout: the layout the shards were made with (Note [Sequence layouts]).
        seq_dim: the dim of ``x_local`` that holds the sequence (the same dim on every rank).

    Returns:
        The full sequence, ``W * n`` tokens along ``seq_dim``, in global order.

    Raises:
        TypeError / ValueError: on every rank, before the all-gather, when some rank's arguments
            are malformed or the ranks' shards or options differ. The rank whose arguments were
            rejected raises its own error; the others a ``ValueError`` naming it.
    """
    layout, dim = _agree_on_shards(x_local, group, layout, seq_dim)
    if not isinstance(group, ContextParallel):
        return _gather(x_local, group, layout, dim)
    shard = x_local
    if group.heads is not None:  # the head group's shares of each ring chunk, joined
        joined = _gather(x_local, group.heads, "contiguous", dim)
        _, heads = group.sizes()
        moved = joined.movedim(dim, 0)
        moved = rearrange(moved, "(a p c) ... -> (p a c) ...", a=heads, p=chunks_per_rank(layout))
        shard = moved.movedim(0, dim)
    if group.ring is None:
        return shard
    return _gather(shard, group.ring, layout, dim)


def _agree_on_shards(
    x_local: object, group: dist.ProcessGroup | ContextParallel | None, layout: object,
    seq_dim: object,
) -> tuple[str, int]:  # fmt: skip
    """:func:`unshard_sequence`'s arguments checked and agreed on by every rank of ``group``
    (the shards' shapes included); the checked layout and ``seq_dim``."""
    names = ("x_local.dim()", "seq_dim", "local seq_len (x_local.shape[seq_dim])", "dtype",
             "device type", "layout")  # fmt: skip
    fields, error, dim = [0] * len(names), None, 0
    try:
        layout = check_layout(layout)
        dim = _check_seq_dim(x_local, seq_dim, "x_local")
        assert isinstance(x_local, torch.Tensor)  # _check_seq_dim raised otherwise
        n = x_local.shape[dim]
        if n % chunks_per_rank(layout):
            raise ValueError(
                f"x_local's local seq_len ({n}) must be even for layout='zigzag' (two chunks per "
                f"rank); shard a sequence divisible by 2 x world size with shard_sequence"
            )
        fields = [x_local.dim(), dim, n, _code(x_local.dtype, _DTYPES),
                  _code(x_local.device.type, _DEVICE_TYPES), LAYOUTS.index(layout)]  # fmt: skip
    except Exception as exc:  # a rejection on one rank must reach the others: no hang
        error = exc
    check_same_everywhere(
        fields, names, group, error, what="unshard_sequence arguments",
        labels={"dtype": [str(t) for t in _DTYPES], "device type": _DEVICE_TYPES,
                "layout": LAYOUTS},
        fixes={names[2]: _UNEQUAL_SHARDS},
    )  # fmt: skip
    assert isinstance(x_local, torch.Tensor)
    # The number of dims agrees: now the whole shape (all-gather needs equal sizes everywhere).
    shape_names = [f"x_local.shape[{d}]" for d in range(x_local.dim())]
    check_same_everywhere(
        list(x_local.shape), shape_names, group, what="unshard_sequence arguments"
    )
    return str(layout), dim


def _gather(
    x_local: torch.Tensor, group: dist.ProcessGroup | None, layout: str, dim: int
) -> torch.Tensor:
    """Every rank's shard of ``group`` (agreed on: :func:`_agree_on_shards`), joined in global
    order along ``dim``."""
    _, size = group_rank_and_size(group)
    if size == 1:
        return x_local
    local = x_local.contiguous()
    gathered = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(gathered, local, group=group)
    parts = chunks_per_rank(layout)
    chunks: dict[int, torch.Tensor] = {}
    for r, shard in enumerate(gathered):
        for c, piece in zip(chunks_of(r, size, layout), shard.chunk(parts, dim=dim), strict=True):
            chunks[c] = piece
    return torch.cat([chunks[c] for c in sorted(chunks)], dim=dim)


def sequence_positions(
    local_len: int,
    *,
    group: dist.ProcessGroup | ContextParallel | None = None,
    layout: str = "contiguous",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Global positions of this rank's ``local_len`` tokens (for rotary embeddings and masks).

    Every rank of ``group`` must call it (it agrees on ``local_len`` and ``layout`` with one
    small all-gather; under a :class:`ContextParallel` one per group, an error of the head
    group's carried into the ring group's): shards of unequal length have no positions here, as
    the ring functions take none, and a rank whose ``local_len`` differs would otherwise get
    positions that overlap its neighbours'.

    Args:
        local_len: this rank's number of tokens ``n`` (the same on every rank; even for zigzag).
        group: the process group (default: the world), or a :class:`ContextParallel`.
        layout: the layout the shards were made with (Note [Sequence layouts]).
        device: where to put the positions.

    Returns:
        int64 ``(local_len,)``: the global positions of this rank's tokens, in local order.

    Raises:
        TypeError / ValueError: on every rank when some rank's arguments are malformed, or the
            ranks' ``local_len`` or ``layout`` differ.
    """
    names = ("local_len", "layout")
    fields, error, positions = [0, 0], None, None
    try:
        layout = check_layout(layout)
        if isinstance(local_len, bool):
            raise TypeError(f"local_len must be an int, got {local_len!r}")
        try:
            local_len = operator.index(local_len)
        except TypeError:
            raise TypeError(f"local_len must be an int, got {local_len!r}") from None
        if local_len < 0:
            raise ValueError(f"local_len must be a non-negative int, got {local_len}")
        positions = rank_positions(local_len, group=group, layout=layout, device=device)
        fields = [local_len, LAYOUTS.index(layout)]
    except Exception as exc:  # a rejection on one rank must reach the others: no hang
        error = exc
    check_same_everywhere(
        fields, names, group, error, what="sequence_positions arguments",
        labels={"layout": LAYOUTS}, fixes={"local_len": _UNEQUAL_SHARDS},
    )  # fmt: skip
    assert positions is not None  # check_same_everywhere raised otherwise
    return positions


def rank_positions(
    local_len: int,
    *,
    group: dist.ProcessGroup | ContextParallel | None = None,
    layout: str = "contiguous",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """:func:`sequence_positions` without its agreement (no communication), for a caller whose
    next collective compares the shards' lengths anyway: a ring layer's rotary positions, whose
    ring call agrees on its shards; ``LongNetLM``, which agrees on its inputs. A collective of
    its own there would meet a peer's other collective (the agreement of a call that peer
    rejected) and abort the process group.

    Raises:
        ValueError: a ``local_len`` that no layout of ``group``'s ranks holds (odd for zigzag).
    """
    layout = check_layout(layout)
    if isinstance(group, ContextParallel):
        (ring, heads) = group.sizes()
        _check_divisible(local_len * ring * heads, ring * heads, layout, "local_len * world_size")
        return mesh_positions(local_len, group, chunks_per_rank(layout), device)
    rank, size = group_rank_and_size(group)
    _check_divisible(local_len * size, size, layout, "local_len * world_size")
    return local_positions(local_len, rank=rank, world_size=size, layout=layout, device=device)
