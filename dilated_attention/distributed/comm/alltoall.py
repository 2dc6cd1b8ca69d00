"""The head all-to-all: a rank's positions of every head <-> every position of its heads.

Note [Head all-to-all]
    ``W`` ranks of a head group each hold ``n`` positions of all ``H`` heads of a sequence. One
    all-to-all gives rank ``a`` every position the group holds of the heads ``a H / W .. (a + 1)
    H / W - 1``: it sends its positions of rank ``a'``'s heads to ``a'`` and receives rank
    ``a'``'s positions of its own. The inverse sends them back. Both move ``(W - 1) / W`` of
    the tensor per rank and compute nothing; each is the other's backward.

    The group's positions are laid out so that what a rank receives is one shard of an outer
    sequence layout (Note [Sequence layouts] in ``sharding.py``): the outer shard is cut into
    ``parts`` chunks (1, or 2 under the zigzag layout) and rank ``a`` holds the ``a``-th
    ``1 / W`` of each chunk (:func:`~dilated_attention.distributed.mesh.mesh_positions`). The
    received pieces interleave back into those chunks, in position order, with no copy beyond
    the exchange itself. Without an outer ring (one outer shard) the group's ranks hold
    consecutive ``N / W`` positions: the contiguous layout.

    gloo has no all-to-all, and a head group is any set of ranks: the exchange is one batch of
    point-to-point sends and receives between the group's global ranks (``_comm.exchange``).

Shape legend: B batch, n positions a rank holds, W ranks of the head group, Hx heads of the
tensor (query or key/value heads), D head dim, E the last dim of any tensor exchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from einops import rearrange

from .collectives import exchange, wait_all

__all__ = ["HeadExchange", "to_heads", "to_sequence"]


@dataclass(frozen=True)
class HeadExchange:
    """Where this rank sits in a head all-to-all (Note [Head all-to-all]).

    Attributes:
        rank: this rank's index in the head group.
        global_ranks: the group's global ranks, in group order.
        parts: chunks of the outer shard a rank's positions cut into (1 or 2).
    """

    rank: int
    global_ranks: tuple[int, ...]
    parts: int = 1

    @property
    def size(self) -> int:
        return len(self.global_ranks)


def _swap(pieces: list[torch.Tensor], ex: HeadExchange) -> torch.Tensor:
    """Send ``pieces[a]`` (all of one shape) to rank ``a``: what each rank sent here, stacked
    in rank order, received in place into one buffer (W, *piece shape); this rank's own piece
    is copied in, the others are packed once for their sends."""
    got = pieces[0].new_empty((ex.size, *pieces[0].shape))
    got[ex.rank].copy_(pieces[ex.rank])
    others = [a for a in range(ex.size) if a != ex.rank]
    wait_all(
        exchange(
            [(pieces[a].contiguous(), ex.global_ranks[a]) for a in others],
            [(got[a], ex.global_ranks[a]) for a in others],
        )
    )
    return got


def to_heads(x: torch.Tensor, ex: HeadExchange) -> torch.Tensor:
    """(B, n, Hx, E) -> (B, W * n, Hx / W, E): every position of the group for this rank's
    heads, in the outer shard's order (Note [Head all-to-all]). ``Hx`` divisible by ``W``.
    With B = 1 and one chunk per shard the result is the receive buffer itself (a view)."""
    got = _swap(list(x.chunk(ex.size, dim=2)), ex)  # (W, B, n, Hx / W, E)
    return rearrange(got, "a b (p c) h e -> b (p a c) h e", p=ex.parts)


def to_sequence(y: torch.Tensor, ex: HeadExchange) -> torch.Tensor:
    """(B, W * n, Hx / W, E) -> (B, n, Hx, E): the inverse of :func:`to_heads`."""
    pieces = rearrange(y, "b (p a c) h e -> a b (p c) h e", p=ex.parts, a=ex.size)
    return rearrange(_swap(list(pieces), ex), "a b n h e -> b n (a h) e")


def _exchange(
    x: torch.Tensor, ranks: list[int], rank: int, parts: int, heads: bool
) -> torch.Tensor:
    """:func:`to_heads` (``heads``) or :func:`to_sequence` of ``x`` in the exchange of
    ``rank`` among ``ranks`` (global ranks) with ``parts`` chunks per shard."""
    ex = HeadExchange(rank, tuple(ranks), parts)
    return (to_heads if heads else to_sequence)(x, ex)


def _exchange_shape(
    x: torch.Tensor, ranks: list[int], rank: int, parts: int, heads: bool
) -> torch.Tensor:
    batch, rows, num_heads, dim = x.shape
    size = len(ranks)
    if heads:
        return x.new_empty(batch, rows * size, num_heads // size, dim)
    return x.new_empty(batch, rows // size, num_heads * size, dim)


_OPERATOR = torch.library.custom_op(
    "dilated_attention::head_exchange", _exchange, mutates_args=(),
    schema="(Tensor x, int[] ranks, int rank, int parts, bool heads) -> Tensor",
)  # fmt: skip
_OPERATOR.register_fake(_exchange_shape)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.options = inputs[1:]


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """The opposite exchange: itself differentiable, so gradients of gradients pass too."""
    ranks, rank, parts, heads = ctx.options
    return _OPERATOR(grad.contiguous(), ranks, rank, parts, not heads), None, None, None, None


_OPERATOR.register_autograd(_backward, setup_context=_setup)


def heads_of(x: torch.Tensor, ex: HeadExchange) -> torch.Tensor:
    """:func:`to_heads`, differentiable (its backward is :func:`to_sequence`)."""
    return _OPERATOR(x.contiguous(), list(ex.global_ranks), ex.rank, ex.parts, True)


def sequence_of(y: torch.Tensor, ex: HeadExchange) -> torch.Tensor:
    """:func:`to_sequence`, differentiable (its backward is :func:`to_heads`)."""
    return _OPERATOR(y.contiguous(), list(ex.global_ranks), ex.rank, ex.parts, False)
