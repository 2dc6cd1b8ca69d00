"""Small pieces gathered from a prefix of the ranks, differentiable: the backward sums each
piece's gradients home.

Note [A differentiable gather of a prefix of the ranks]
    Each of ``W`` ranks holds one piece of the same shape (a few pooled rows of its shard),
    and rank ``a`` reads the pieces of the first ``needs[a]`` ranks (its own among them where
    ``a < needs[a]``): a causal rank reads nothing after its own shard, and what a rank reads
    is known to every rank from the geometry alone. So rank ``b`` sends its piece to every
    other rank ``a`` with ``needs[a] > b`` and receives the pieces of the ranks before
    ``needs[b]``, in one batch of point-to-point sends and receives between global ranks
    (``_comm.exchange``: gloo has no all-gather of a subset, and a subgroup would need every
    rank to create it). Nothing is computed.

    The backward is the adjoint: every rank sends the gradient of each piece it read home to
    that piece's owner, and an owner adds what comes back to its own piece's gradient. Each
    direction is the other's backward, one custom operator with a flag (as the head all-to-all
    in ``alltoall.py``).

    Every rank must run the backward, also a rank whose result reads none of the gathered
    pieces (a causal rank before the end of the first pooled window): its peers send it the
    gradients of its own piece there. :func:`joined` ties the gathered tensor to the call's
    output, so that its backward runs wherever the output's does (with a zero gradient from
    that side). The backward of the gather then runs after those of the ring calls made after
    it, on every rank alike: the autograd engine runs the ready node made last first, and the
    gather is made before them.

Shape legend: W ranks, S the shape of one piece.
"""

from __future__ import annotations

from typing import Any

import torch

from . import collectives as _comm

__all__ = ["gather_prefix", "joined"]


def _direction(
    x: torch.Tensor, ranks: list[int], rank: int, needs: list[int], gather: bool
) -> torch.Tensor:
    """Gather (``x`` (*S) -> (needs[rank], *S)) or send the gradients home (``x``
    (needs[rank], *S) -> (*S), summed): Note [A differentiable gather of a prefix of the
    ranks]; ``ranks`` the global ranks, ``rank`` this one's index in them."""
    readers = [a for a in range(len(ranks)) if a != rank and needs[a] > rank]
    sources = [b for b in range(needs[rank]) if b != rank]
    if gather:
        out = x.new_empty((needs[rank], *x.shape))
        if rank < needs[rank]:
            out[rank].copy_(x)
        piece = x.contiguous()
        _comm.wait_all(_comm.exchange([(piece, ranks[a]) for a in readers],
                                      [(out[b], ranks[b]) for b in sources]))  # fmt: skip
        return out
    total = x[rank].clone() if rank < needs[rank] else x.new_zeros(x.shape[1:])
    incoming = [x.new_empty(x.shape[1:]) for _ in readers]
    _comm.wait_all(_comm.exchange(
        [(x[b].contiguous(), ranks[b]) for b in sources],
        [(t, ranks[a]) for t, a in zip(incoming, readers, strict=True)],
    ))  # fmt: skip
    for t in incoming:
        total += t
    return total


def _direction_shape(
    x: torch.Tensor, ranks: list[int], rank: int, needs: list[int], gather: bool
) -> torch.Tensor:
    return x.new_empty((needs[rank], *x.shape)) if gather else x.new_empty(x.shape[1:])


_OPERATOR = torch.library.custom_op(
    "dilated_attention::gather_prefix", _direction, mutates_args=(),
    schema="(Tensor x, int[] ranks, int rank, int[] needs, bool gather) -> Tensor",
)  # fmt: skip
_OPERATOR.register_fake(_direction_shape)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.options = inputs[1:]


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """The other direction: itself differentiable."""
    ranks, rank, needs, gather = ctx.options
    return _OPERATOR(grad.contiguous(), ranks, rank, needs, not gather), None, None, None, None


_OPERATOR.register_autograd(_backward, setup_context=_setup)


def gather_prefix(
    piece: torch.Tensor, ranks: tuple[int, ...], rank: int, needs: tuple[int, ...]
) -> torch.Tensor:
    """The pieces of the first ``needs[rank]`` ranks, differentiable (Note [A differentiable
    gather of a prefix of the ranks]). Every rank of ``ranks`` calls it with the same
    ``needs`` and pieces of one shape.

    Args:
        piece: (*S) this rank's piece.
        ranks: the global ranks, in order; ``rank`` this process's index in them.
        needs: per rank, how many leading ranks' pieces it reads.

    Returns:
        (needs[rank], *S): the pieces of ranks ``0 .. needs[rank] - 1``, in order.
    """
    return _OPERATOR(piece.contiguous(), list(ranks), rank, list(needs), True)


class _Joined(torch.autograd.Function):
    """``out`` itself; ``tied`` gets a zero gradient, so that its backward runs."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, tied: torch.Tensor) -> torch.Tensor:
        ctx.tied = (tied.shape, tied.dtype, tied.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape, dtype, device = ctx.tied
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def joined(out: torch.Tensor, tied: torch.Tensor) -> torch.Tensor:
    """``out``, with ``tied`` (a result of :func:`gather_prefix`) in its graph: wherever a
    backward reaches ``out``, it reaches the gather's backward too, which every rank must run
    (Note [A differentiable gather of a prefix of the ranks])."""
    if not (torch.is_grad_enabled() and tied.requires_grad):
        return out
    return _Joined.apply(out, tied)
