"""A layer of branches recomputed in its backward a group of heads at a time: its peak memory
near the bytes no exact layer can do without, for one more forward's time.

Note [Branches recomputed by heads]
    With gradients, a layer of branches keeps for its backward what each branch's kernel saves
    (its output; NSA's compressed branch also its classes' queries stacked as heads) and what
    the gates' gradient needs (each branch's output): an NSA layer's forward+backward peaked at
    2.0-2.4 times the bytes of q, k, v, out, dout, dq, dk and dv on an H200 (16K-1M tokens, H =
    16, Hkv = 4; ``benchmarks/results/selected_nsa_h200.md``). Given the blocks each key/value
    head's queries chose, an attention's heads are independent. So :func:`recomputed_by_heads`
    runs the layer without gradients (its streaming sum: one branch output beside the sum,
    Note [Gated branches] in ``branches.py``), keeps its inputs, the choice and its output
    (which the caller holds anyway; it links a double backward's error to the graph), and in the
    backward runs the layer again on one group of heads at a time, with gradients, taking that
    group's gradients before the next group runs. What the branches keep then lives for one
    group only: a :data:`CHUNK_SHARE`-th of the heads, with at least
    :data:`CHUNK_FLOOR_BYTES` of query (smaller groups leave the GPU idle between their short
    calls), at the price of one more forward of every branch.

    A group is whole key/value heads with their query heads, or part of one key/value head's
    query heads (a divisor of the GQA group): its query heads see only its key/value heads.
    Where a key/value head's query heads fall in several groups, the later groups' key and
    value gradients are added into the first's in their dtype (each sum in float32, rounded
    once: in 16 bits one rounding more per group than a kernel's own GQA sum, with no float32
    sum the size of a key/value head held across groups). Nothing a group makes outlives its
    gradients, so what lives besides the layer's inputs and gradients is one group's.

    The forward runs the branches in the order the no-gradient path does and the backward's
    recompute in the training order (Note [Branches joined as they come]): the gradients are
    those of a forward equal to the returned one to rounding.

Shape legend: B batch, Nq query rows, Nk key rows, H query heads, Hkv key/value heads, D head
dim, G gates per head; a choice (B, Hkv or 1, ...) per key/value head.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..core.higher_order import first_order_only

__all__ = ["CHUNK_FLOOR_BYTES", "CHUNK_SHARE", "head_groups", "recomputed_by_heads"]

#: A group of heads recomputed at once holds at most this share of the query's heads ...
CHUNK_SHARE = 16
#: ... unless that is less than this many bytes of query.
CHUNK_FLOOR_BYTES = 16 * 2**20

#: The layer on (query, key, value, gates or None, choice) -> out (B, Nq, H, D), for any
#: heads of the query and the key/value heads they see.
LayerCall = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor
]


def head_groups(heads: int, kv_heads: int, head_bytes: int) -> list[tuple[int, int]]:
    """The query heads recomputed together (Note [Branches recomputed by heads]).

    Args:
        heads: query heads H; kv_heads: key/value heads Hkv, dividing H.
        head_bytes: the bytes of one query head (B * Nq * D elements).

    Returns:
        Ranges ``(h0, h1)`` covering ``0 .. H - 1`` in order, each the query heads of whole
        key/value heads or a divisor of one key/value head's; none for H = 0.
    """
    if heads == 0:
        return []
    group = heads // kv_heads
    budget = max(heads * head_bytes // CHUNK_SHARE, CHUNK_FLOOR_BYTES)
    size = max(1, min(heads, budget // max(head_bytes, 1)))
    if size >= group:
        size -= size % group
    else:
        size = max(d for d in range(1, size + 1) if group % d == 0)
    return [(h, min(h + size, heads)) for h in range(0, heads, size)]


def recomputed_by_heads(
    call: LayerCall,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    gates: torch.Tensor | None,
    choice: torch.Tensor,
    message: str,
) -> torch.Tensor:
    """``call(query, key, value, gates, choice)``, whose backward recomputes it a group of
    heads at a time (Note [Branches recomputed by heads]); first-order gradients only.

    Args:
        call: the layer (:data:`LayerCall`), with gradients wherever its inputs record them.
        query: (B, Nq, H, D); key, value: (B, Nk, Hkv, D); gates: (B, Nq, H, G) or None.
        choice: (B, Hkv or 1, ...) what the layer's queries chose per key/value head (block
            indices), no gradient.
        message: the error a double backward raises (Note [Double backward] in
            ``core/higher_order.py``).

    Returns:
        (B, Nq, H, D).
    """
    return _Recomputed.apply(call, choice, message, query, key, value, gates)  # type: ignore[no-any-return]


class _Recomputed(torch.autograd.Function):
    """:func:`recomputed_by_heads`: the forward without gradients, the backward by groups."""

    @staticmethod
    def forward(
        ctx: Any, call: LayerCall, choice: torch.Tensor, message: str, query: torch.Tensor,
        key: torch.Tensor, value: torch.Tensor, gates: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        with torch.no_grad():
            out = call(query, key, value, gates, choice)
        ctx.call, ctx.choice, ctx.message = call, choice, message
        ctx.save_for_backward(query, key, value, gates, out)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, gates, out = ctx.saved_tensors
        needs = ctx.needs_input_grad[3:]
        inputs = (q, k, v, gates)
        grads = [x.new_empty(x.shape) if x is not None and need else None
                 for x, need in zip(inputs, needs, strict=True)]  # fmt: skip
        heads, kv_heads = q.shape[2], k.shape[2]
        for span in head_groups(heads, kv_heads, q[:, :, :1].nbytes):
            _group_gradients(ctx, inputs, needs, dout, span, heads // kv_heads, grads)
        grads = list(first_order_only(grads, ctx.message, (out, dout)))
        return None, None, None, *grads


def _group_gradients(
    ctx: Any,
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None],
    needs: tuple[bool, ...],
    dout: torch.Tensor,
    span: tuple[int, int],
    group: int,
    grads: list[torch.Tensor | None],
) -> None:
    """The layer recomputed on query heads ``span`` (and the key/value heads they see), its
    gradients written into ``grads`` (dq, dk, dv, dgates): a key/value head's copied from its
    first group of query heads and added from the later ones. Nothing it makes outlives it."""
    h0, h1 = span
    j0, j1 = h0 // group, -(-h1 // group)
    spans = ((h0, h1), (j0, j1), (j0, j1), (h0, h1))
    leaves = [None if x is None else _leaf(x, a, b, need)
              for x, (a, b), need in zip(inputs, spans, needs, strict=True)]  # fmt: skip
    choice = ctx.choice if ctx.choice.shape[1] == 1 else ctx.choice[:, j0:j1]
    with torch.enable_grad():
        part = ctx.call(leaves[0], leaves[1], leaves[2], leaves[3], choice)
    wanted = [i for i, x in enumerate(leaves) if x is not None and x.requires_grad]
    got = torch.autograd.grad(part, [leaves[i] for i in wanted], dout[:, :, h0:h1])
    del part, leaves
    for i, g in zip(wanted, got, strict=True):
        a, b = spans[i]
        target = grads[i][:, :, a:b]  # type: ignore[index]
        if i in (1, 2) and h0 % group:  # a later part of one key/value head's query heads
            target.add_(g)
        else:
            target.copy_(g)


def _leaf(x: torch.Tensor, start: int, stop: int, need: bool) -> torch.Tensor:
    """Heads ``[start, stop)`` of ``x`` (B, N, heads, ...) as a new leaf, recording a gradient
    where ``need``."""
    return x[:, :, start:stop].detach().contiguous().requires_grad_(need)
