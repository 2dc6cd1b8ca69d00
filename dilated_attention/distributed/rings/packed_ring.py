"""Packed documents over a row sharded across ranks: ring attention on packed batches.

Note [Packed documents across ranks]
    A packed row (Note [Packed documents] in ``core/geometry/documents.py``) is sharded like any
    sequence: rank ``r`` holds positions ``[r * n, (r + 1) * n)`` of the one row, whatever the
    documents' lengths, so a document may lie inside one shard or span several. Attention within
    each document is a plan of position calls over the whole row: for dense attention one call per
    document (causal or not), for block-sparse attention each document's kept blocks counted
    from its own first token (``block_sparse/plan.document_calls``). Each rank keeps, for every
    other rank, the part of that plan with its queries and that rank's keys
    (:func:`restricted_calls`: a causal call becomes a full call on the keys before the query
    run and a causal call on the run's own keys), and the exchange of Note [Block-sparse
    exchange] (``block_sparse_ring.py``) moves exactly those keys, and their gradients back. So
    a pair of ranks that shares no document sends nothing, a document inside one shard never
    leaves it, and no document length has to divide anything (no padding to ``2 W``). Documents
    are not moved between ranks to balance them: a shard of long causal documents computes more
    pairs than one of short documents, which :func:`ring_load` reports (pairs per rank, max over
    mean) for a packing before it runs.

Shape legend: B batch (1: one packed row), n local tokens, H query heads, Hkv key/value heads,
D head dim, W ranks.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ...block_sparse.plan import SparseCall, call_positions, check_block_size, document_calls
from ...core.geometry.documents import check_offsets, document_groups, document_positions
from ...core.geometry.schedule import Schedule
from ...core.higher_order import ring_message
from ...patterns import Pattern, check_pattern
from ..comm.agreement import PreparedRing
from ..comm.collectives import group_rank_and_size
from ..comm.exchange import ExchangeStep, SparseSteps, exchange_steps
from ..context import ContextParallel, no_documents
from .template import RingRunner, StepKernel

__all__ = ["RingLoad", "packed_runner", "restricted_calls", "ring_load", "shard_offsets",
           "shard_positions"]  # fmt: skip


def _dense_calls(documents: tuple[int, ...], is_causal: bool) -> tuple[SparseCall, ...]:
    """Dense attention within each document: one piece per document, pieces of one length
    stacked into one call (CPU, global positions)."""
    by_length: dict[int, list[torch.Tensor]] = {}
    for start, end in itertools.pairwise(documents):
        by_length.setdefault(end - start, []).append(torch.arange(start, end))
    return tuple(
        SparseCall(torch.stack(rows), torch.stack(rows), is_causal) for rows in by_length.values()
    )


@dataclass(frozen=True)
class HeadCall:
    """A :class:`~dilated_attention.block_sparse.plan.SparseCall` on some heads: query heads
    ``heads`` (Hc,), query head ``heads[i]`` reading key/value head ``kv_heads[i]`` (so the
    kernel sees Hc key/value heads too, repeated under grouped-query attention). The dilated
    rows of one offset class (Note [Packed documents across ranks]).

    Attributes:
        q_index, kv_index: (G, Lq), (G, Lk) int64 positions, as in ``SparseCall``.
        causal: top-left causal within each piece.
        heads, kv_heads: (Hc,) int64.
    """

    q_index: torch.Tensor
    kv_index: torch.Tensor
    causal: bool
    heads: torch.Tensor
    kv_heads: torch.Tensor

    def to(self, device: torch.device) -> HeadCall:
        return HeadCall(*(x.to(device) for x in (self.q_index, self.kv_index)), self.causal,
                        *(x.to(device) for x in (self.heads, self.kv_heads)))  # fmt: skip

    def q_rows(self, x: torch.Tensor) -> torch.Tensor:
        return _sparse(self).q_rows(x.index_select(2, self.heads))

    def kv_rows(self, x: torch.Tensor) -> torch.Tensor:
        return _sparse(self).kv_rows(x.index_select(2, self.kv_heads))

    def key_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        return _sparse(self).key_mask(mask)

    def put_q(self, dest: torch.Tensor, rows: torch.Tensor, *, accumulate: bool) -> None:
        _put_heads(dest, self.q_index, self.heads, rows, accumulate)

    def put_kv(self, dest: torch.Tensor, rows: torch.Tensor, *, accumulate: bool) -> None:
        if not accumulate:  # repeated key/value heads: only sums are well defined
            raise ValueError("HeadCall.put_kv adds gradients; it cannot overwrite rows")
        _put_heads(dest, self.kv_index, self.kv_heads, rows, accumulate)

    def row_call(self, q: torch.Tensor, k: torch.Tensor) -> Any:
        raise NotImplementedError("ring calls have first-order gradients only")


def _sparse(call: HeadCall) -> SparseCall:
    return SparseCall(call.q_index, call.kv_index, call.causal)


def _put_heads(
    dest: torch.Tensor, index: torch.Tensor, heads: torch.Tensor, rows: torch.Tensor,
    accumulate: bool,
) -> None:  # fmt: skip
    """Write (or add) (B * G, L, Hc, E) rows into ``dest`` (B, N, Hd, E) at positions ``index``
    (G, L) and heads ``heads`` (Hc,), through one (position, head) index."""
    batch, _, dest_heads, width = dest.shape
    flat_index = (index.reshape(-1, 1) * dest_heads + heads.view(1, -1)).flatten()
    flat = rows.reshape(batch, -1, width).to(dest.dtype)
    target = dest.view(batch, -1, width)
    if accumulate:
        target.index_add_(1, flat_index, flat)
    else:
        target.index_copy_(1, flat_index, flat)


def _dilated_calls(
    documents: tuple[int, ...], heads: tuple[int, int], schedule: Schedule, is_causal: bool
) -> tuple[HeadCall, ...]:
    """Packed dilated attention as position calls (CPU, global positions): every document's row
    groups (Note [Packed documents] in ``core/geometry/documents.py``), one call per offset
    class."""
    num_heads, kv_heads = heads
    group = num_heads // kv_heads
    calls = []
    for g in document_groups(documents, num_heads, schedule.segment_lengths,
                             schedule.dilation_rates):  # fmt: skip
        starts = g.start + g.segment_len * torch.arange(g.num_segments).view(-1, 1)
        for offset in sorted(set(g.offsets)):
            cls = [h for h, o in zip(g.heads, g.offsets, strict=True) if o == offset]
            rows = starts + offset + g.rate * torch.arange(g.rows).view(1, -1)
            calls.append(HeadCall(rows, rows, is_causal, torch.tensor(cls),
                                  torch.tensor([h // group for h in cls])))  # fmt: skip
    return tuple(calls)


#: A call of a packed row's plan: every head (``SparseCall``) or some (``HeadCall``).
PositionCall = SparseCall | HeadCall


@functools.lru_cache(maxsize=16)
def _global_calls(
    documents: tuple[int, ...],
    is_causal: bool,
    pattern: Pattern | None,
    block_size: int,
    dilated: tuple[Schedule, int, int] | None = None,
) -> tuple[PositionCall, ...]:
    """The packed row's plan of position calls (Note [Packed documents across ranks]):
    dilated (``(schedule, H, Hkv)``), block-sparse (``pattern``) or dense."""
    if dilated is not None:
        schedule, num_heads, kv_heads = dilated
        return _dilated_calls(documents, (num_heads, kv_heads), schedule, is_causal)
    if pattern is None:
        return _dense_calls(documents, is_causal)
    return document_calls(pattern, block_size, documents, is_causal, torch.device("cpu"))


def restricted_calls(
    calls: Sequence[SparseCall], queries: tuple[int, int], keys: tuple[int, int]
) -> list[SparseCall]:
    """The part of ``calls`` (global positions) with query positions in ``queries`` and key
    positions in ``keys`` (``[lo, hi)`` each), indexed from each range's ``lo``.

    A causal piece (its query and key positions runs from one start, top-left causal) keeps
    the keys before its first query as a full piece and the keys from there to its last query
    as a causal piece; keys after its last query are never seen.
    """
    return [part for call in calls for part in _restricted(call, queries, keys)]


def _restricted(call: PositionCall, queries: tuple[int, int], keys: tuple[int, int]) -> list:
    """:func:`restricted_calls` of one call: its pieces cut to the ranges, those of one shape
    stacked into one call of the same kind (same heads)."""
    (q_lo, q_hi), (k_lo, k_hi) = queries, keys
    q_min, q_max = int(call.q_index.min()), int(call.q_index.max())
    k_min, k_max = int(call.kv_index.min()), int(call.kv_index.max())
    if q_max < q_lo or q_min >= q_hi or k_max < k_lo or k_min >= k_hi:
        return []  # no piece reads these ranges
    if q_lo <= q_min and q_max < q_hi and k_lo <= k_min and k_max < k_hi:
        # Every piece whole (causal ones then lie in one shard, as they were).
        return [replace(call, q_index=call.q_index - q_lo, kv_index=call.kv_index - k_lo)]
    groups: dict[tuple[bool, int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def add(causal: bool, q_rows: torch.Tensor, k_rows: torch.Tensor) -> None:
        if q_rows.numel() and k_rows.numel():
            qs, ks = groups.setdefault((causal, q_rows.numel(), k_rows.numel()), ([], []))
            qs.append(q_rows - q_lo)
            ks.append(k_rows - k_lo)

    for q_pos, k_pos in zip(call.q_index, call.kv_index, strict=True):
        q_in = q_pos[(q_pos >= q_lo) & (q_pos < q_hi)]
        k_in = k_pos[(k_pos >= k_lo) & (k_pos < k_hi)]
        if not (q_in.numel() and k_in.numel()):
            continue
        if not call.causal:
            add(False, q_in, k_in)
            continue
        # Queries and keys are one run of positions (dilated: one arithmetic progression):
        # keys before the first query are all seen, the run's own keys causally.
        add(False, q_in, k_in[k_in < q_in[0]])
        add(True, q_in, k_in[(k_in >= q_in[0]) & (k_in <= q_in[-1])])
    return [
        replace(call, q_index=torch.stack(qs), kv_index=torch.stack(ks), causal=causal)
        for (causal, _, _), (qs, ks) in groups.items()
    ]


def _needs(
    calls: tuple[PositionCall, ...], n: int, dst: int, src: int
) -> tuple[torch.Tensor, list[PositionCall]]:
    """``block_sparse_ring.Needs`` of a packed plan: the global positions of ``src``'s shard
    that ``dst`` reads, and its calls on them."""
    part = restricted_calls(calls, (dst * n, (dst + 1) * n), (src * n, (src + 1) * n))
    return call_positions(part) + src * n, part


@functools.lru_cache(maxsize=16)
def _steps(
    plan: tuple[tuple[int, ...], bool, Pattern | None, int, tuple[Schedule, int, int] | None],
    world_rank: tuple[int, int],
    device: torch.device,
) -> tuple[ExchangeStep, ...]:
    """This rank's steps over a packed row's plan (``_global_calls``'s arguments; pure: the
    same on every call)."""
    world_size, rank = world_rank
    documents = plan[0]
    calls = _global_calls(*plan)
    n = documents[-1] // world_size
    needs = functools.partial(_needs, calls, n)
    return exchange_steps(needs, n, world_size, rank, device)


def _pairs(call: PositionCall, num_heads: int) -> float:
    """Query-key pairs one call computes per head of the layer (top-left causal pieces: row
    ``i`` sees ``i + 1`` keys)."""
    pieces, rows_q = call.q_index.shape
    rows_k = call.kv_index.shape[1]
    seen = min(rows_q, rows_k)
    causal = seen * (seen + 1) // 2 + (rows_q - seen) * rows_k
    pairs = causal if call.causal else rows_q * rows_k
    share = len(call.heads) / num_heads if isinstance(call, HeadCall) else 1.0
    return pieces * pairs * share


@dataclass(frozen=True)
class RingLoad:
    """The work of a packed ring per rank (Note [Packed documents across ranks]).

    Attributes:
        pairs: query-key pairs each rank computes per head of the layer, by rank.
        max_over_mean: the busiest rank's pairs over the mean (1.0: perfectly even).
    """

    pairs: tuple[float, ...]
    max_over_mean: float


def ring_load(
    cu_seqlens: object,
    world_size: int,
    *,
    is_causal: bool = False,
    pattern: Pattern | None = None,
    block_size: int = 128,
    schedule: tuple[Sequence[int], Sequence[int]] | None = None,
    num_heads: int = 1,
) -> RingLoad:
    """The pairs each of ``world_size`` ranks computes for a packed row of documents
    ``cu_seqlens`` (its length a multiple of ``world_size``) in ``ring_attention``, with
    ``pattern`` in ``block_sparse_ring_attention``, with ``schedule`` (segment lengths,
    dilation rates) in ``ring_dilated_attention`` of ``num_heads`` heads; before anything runs.

    Raises:
        ValueError / TypeError: malformed offsets or schedule, or a row length ``world_size``
            does not divide.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    documents = check_offsets(cu_seqlens, 1, _row_length(cu_seqlens), torch.device("cpu"))
    _check_divides(documents[-1], world_size)
    if pattern is not None:
        pattern, block_size = check_pattern(pattern), check_block_size(block_size)
    dilated = None if schedule is None else (Schedule(*schedule), num_heads, num_heads)
    calls = _global_calls(documents, is_causal, pattern, block_size, dilated)
    n = documents[-1] // world_size
    pairs = tuple(_rank_pairs(calls, n, dst, world_size, num_heads) for dst in range(world_size))
    mean = sum(pairs) / world_size
    return RingLoad(pairs, max(pairs) / mean if mean else 1.0)


def _rank_pairs(
    calls: tuple[PositionCall, ...], n: int, dst: int, world_size: int, num_heads: int
) -> float:
    """The pairs rank ``dst`` computes against every rank's keys, per head."""
    return sum(
        _pairs(c, num_heads) for src in range(world_size) for c in _needs(calls, n, dst, src)[1]
    )


def shard_offsets(cu_seqlens: object, shard: torch.Tensor, group: Any = None) -> tuple[int, ...]:
    """The checked offsets of packed documents over the whole sharded row of which ``shard``
    (1, n, ...) is this rank's contiguous part.

    Raises:
        ValueError / TypeError: more than one row, or malformed offsets.
    """
    if isinstance(group, ContextParallel):
        no_documents(cu_seqlens)
    if shard.shape[0] != 1:
        raise ValueError(
            f"cu_seqlens in a ring layer takes one packed row: a shard of shape (1, n, ...), got "
            f"{tuple(shard.shape)}; pack the batch's documents into one row"
        )
    world = group_rank_and_size(group)[1]
    return check_offsets(cu_seqlens, 1, world * shard.shape[1], shard.device)


def shard_positions(
    documents: tuple[int, ...], shard: torch.Tensor, group: Any = None
) -> torch.Tensor:
    """The positions of ``shard``'s (1, n, ...) tokens within their documents, (n,) int64:
    the rotary positions of a ring layer's packed row (offsets from :func:`shard_offsets`)."""
    rank, n = group_rank_and_size(group)[0], shard.shape[1]
    return document_positions(documents, shard.device, (rank * n, (rank + 1) * n))


def _row_length(cu_seqlens: object) -> int:
    """The last offset (the row's length) of unchecked offsets, or 0 where there is none
    (the check then names the problem)."""
    values = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens
    try:
        return int(values[-1])  # type: ignore[index]
    except (TypeError, ValueError, IndexError):
        return 0


def _check_divides(total: int, world_size: int) -> None:
    if total % world_size:
        raise ValueError(
            f"a packed row of {total} position{'s' if total != 1 else ''} cannot be sharded "
            f"over {world_size} ranks: "
            f"shards are equal (shard_sequence); pad the row's last document to a multiple of "
            f"{world_size} positions"
        )


def packed_runner(
    ring: PreparedRing, *, pattern: Pattern | None = None, block_size: int = 128
) -> RingRunner:
    """The runner of ``ring_attention`` (with ``pattern``, ``block_sparse_ring_attention``;
    with a :class:`~dilated_attention.core.geometry.schedule.Schedule` agreed on,
    ``ring_dilated_attention``) on one packed row: an agreed call (``prepare_ring``) on this
    rank's shard (B = 1, n positions) of the documents over the whole row of ``W * n`` (Note
    [Packed documents across ranks]), on the call's per-step kernel and soft-cap.

    The function's own ``RingOperation`` (its schedule checked and compared as without
    documents, its per-step kernel the dense one) made the agreement, which compares the offsets
    besides, so a call with documents on some ranks only names them as what differs.
    """
    q, k, setup = ring.q, ring.k, ring.setup
    assert ring.documents is not None  # checked, as cu_seqlens was given
    schedule = ring.schedule if isinstance(ring.schedule, Schedule) else None
    dilated = None if schedule is None else (schedule, q.shape[2], k.shape[2])
    plan = (ring.documents, setup.is_causal, pattern, block_size, dilated)
    steps = _steps(plan, (setup.world_size, setup.rank), q.device)
    what = "ring_attention" if pattern is None else "block_sparse_ring_attention"
    what = "ring_dilated_attention" if dilated is not None else what
    message = ring_message(what, what.replace("ring_", "") + "()")
    kernel = StepKernel(ring.kernel.backend, setup.scale, softcap=ring.softcap)
    return RingRunner(SparseSteps(steps, setup), kernel, message)
