"""A ring function's call under a head all-to-all (DeepSpeed-Ulysses), alone or around a ring.

Note [Calls under a head all-to-all]
    With a head group (Note [Context parallel groups] in ``context.py``) a ring function first
    exchanges heads for positions (Note [Head all-to-all] in ``alltoall.py``): each rank then
    holds the ring shard of its head group for ``H / Wh`` heads, the layer heads
    ``a H / Wh ..``. It runs the operation on them (over the ring group, or in one process
    where there is no ring) and exchanges the output back; the gradients take the same road
    in reverse. A dilated call keeps each head's offset from its layer head (Note [Heads from a
    later layer head] in ``core/geometry/schedule.py``), alone and under the ring, whose local and
    spanning branches take the slice's first layer head too.

    Key/value heads split with the query heads: rank ``a`` needs the key/value heads of its
    query heads. Where ``Hkv`` does not divide by ``Wh`` every key/value head is repeated
    ``f = Wh / gcd(Hkv, Wh)`` times first (GQA with fewer key/value heads than ranks; their
    gradients sum back through the repeat), which ``plan_context_parallel``'s description of
    the split says.

    Attention sinks are per query head: each rank takes the sinks of the heads it holds
    (:func:`heads_sinks`), so its sinks' gradient is that of its heads' rows, and the ranks'
    gradients sum to the one-process gradient (as the ring's own shares do).

    Every rank of the head group first agrees on the call's shapes and options (one small
    all-gather), so that a mismatch raises on every rank instead of hanging the exchange; an
    error there is carried into the ring group's agreement (the ranks of other head groups wait
    there), and the head group compares everything the ring's agreement does (Note [One answer
    on every rank of a mesh] in ``context.py``).

Shape legend: B batch, n a rank's positions, H query heads, Hkv key/value heads, D head dim,
Wh ranks of the head group.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ... import _validation as V
from ...core.execution.executor import empty_attention
from ..comm.agreement import reject_ring_call
from ..comm.alltoall import HeadExchange, heads_of, sequence_of, to_heads, to_sequence
from ..comm.collectives import backward_follows
from ..context import ContextParallel, agree_on_heads
from ..layout.sharding import check_layout, chunks_per_rank

__all__ = ["head_parallel", "heads_sinks", "score_options", "split_call"]

#: The operation on this rank's heads: ``(q, k, v, key_padding_mask, first_head) -> (out,
#: lse)``, q (B, N', H', D), k and v (B, N', Hkv', D), the mask (B, N') or None.
Operation = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, int],
    tuple[torch.Tensor, torch.Tensor],
]


def head_parallel(
    run: Operation,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    cp: ContextParallel,
    layout: object,
    what: str,
    options: Callable[[], object] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``run`` on this rank's heads of the head group's positions (Note [Calls under a head
    all-to-all]): q (B, n, H, D), k and v (B, n, Hkv, D), key_padding_mask (B, n) or None ->
    ``(out, lse)``, out (B, n, H, D) differentiable, lse (B, H, n); ``layout``: the ring's
    layout (checked in the agreement); ``options()``: checks the call's options and schedule
    and describes them for the ranks' agreement."""

    def agreed() -> object:
        return check_layout(layout), None if options is None else options()

    try:
        split = agree_on_heads(q, k, v, key_padding_mask, cp, what, agreed)
    except Exception as exc:  # the ring's ranks in other head groups must hear of it: no hang
        if cp.ring is None:
            raise
        reject_ring_call(exc, cp.ring)
    ex = cp.head_exchange(chunks_per_rank(str(layout)))
    if q.numel() == 0:  # a batch of 0 or 0 heads on every rank: as in one process
        return empty_attention(q, k, v)
    if ex.size == 1:  # a head group of one rank exchanges nothing
        out, lse = run(q, k, v, key_padding_mask, 0)
        return out, lse.detach()  # as the exchanged lse below
    if split.kv_repeats > 1:
        k, v = (x.repeat_interleave(split.kv_repeats, dim=2) for x in (k, v))
    qh, kh, vh = (heads_of(x, ex) for x in (q, k, v))
    mask = None if key_padding_mask is None else _mask_of(key_padding_mask, ex)
    out, lse = run(qh, kh, vh, mask, ex.rank * split.heads)
    lse_rows = to_sequence(lse.detach().transpose(1, 2).unsqueeze(-1).contiguous(), ex)
    return sequence_of(out, ex), lse_rows.squeeze(-1).transpose(1, 2)


def _mask_of(mask: torch.Tensor, ex: HeadExchange) -> torch.Tensor:
    """(B, n) bool -> (B, Wh * n): the head group's positions of the mask, for every rank."""
    rows = mask.to(torch.uint8)[:, :, None, None].expand(-1, -1, ex.size, 1)
    return to_heads(rows, ex)[:, :, 0, 0].bool()


def heads_sinks(
    sinks: torch.Tensor | None, first: int, q: torch.Tensor
) -> torch.Tensor | None:
    """The sinks (H,) of the query heads ``q`` (B, N', H', D) holds from layer head ``first``
    on (Note [Calls under a head all-to-all]): (H',), or None without sinks."""
    return None if sinks is None else sinks[first : first + q.shape[2]]


def score_options(
    window_size: object, softcap: object, sinks: object, query: object
) -> tuple[object, ...]:
    """A call's local window, soft-cap and sinks checked as one process checks them (``query``
    (B, n, H, D), already checked), for the head group's agreement: the window, the cap, and
    whether sinks are given and a backward runs through them."""
    checked = V.check_sinks(sinks, query)  # type: ignore[arg-type]
    given = None if checked is None else ("sinks", backward_follows(checked))
    return V.check_window_size(window_size), V.check_softcap(softcap), given


#: The operation over a ring group: ``(ring group, q, k, v, key_padding_mask, first_head) ->
#: (out, lse)``.
RingCall = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def split_call(
    cp: ContextParallel,
    layout: object,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    *,
    local: Operation,
    ring: RingCall,
    what: str,
    options: Callable[[], object] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A ring function's call under ``cp`` (Note [Context parallel groups]): ``ring`` over the
    ring group, ``local`` without one, under the head all-to-all where there is a head group.
    q (B, n, H, D), k and v (B, n, Hkv, D), key_padding_mask (B, n) or None -> ``(out, lse)``
    (B, n, H, D) and (B, H, n); ``layout``: the ring's layout (``"contiguous"`` or
    ``"zigzag"``, checked on every rank together); ``options``: as in :func:`head_parallel`."""

    def run(
        qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, mask: torch.Tensor | None, first: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if cp.ring is None:
            return local(qh, kh, vh, mask, first)
        return ring(cp.ring, qh, kh, vh, mask, first)

    if cp.heads is None:
        return run(q, k, v, key_padding_mask, 0)
    return head_parallel(run, q, k, v, key_padding_mask, cp, layout, what, options)
