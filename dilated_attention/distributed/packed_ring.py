"""Packed documents over a row sharded across ranks: ring attention on packed batches.

Note [Packed documents across ranks]
    A packed row (Note [Packed documents] in ``core/documents.py``) is sharded like any sequence:
    rank ``r`` holds positions ``[r * n, (r + 1) * n)`` of the one row, whatever the documents'
    lengths, so a document may lie inside one shard or span several. Attention within each
    document is a plan of position calls over the whole row: for dense attention one call per
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..block_sparse.plan import SparseCall, call_positions, check_block_size, document_calls
from ..core.autograd import run_attention
from ..core.documents import check_offsets
from ..core.executor import empty_attention
from ..core.higher_order import ring_message
from ..patterns import Pattern, check_pattern
from ._comm import group_rank_and_size
from .agreement import RingArgs, RingOperation, prepare_ring
from .exchange import ExchangeStep, SparseSteps, exchange_steps
from .template import RingRunner, StepKernel

__all__ = ["RingLoad", "packed_ring", "restricted_calls", "ring_load"]


def _dense_calls(documents: tuple[int, ...], is_causal: bool) -> tuple[SparseCall, ...]:
    """Dense attention within each document: one piece per document, pieces of one length
    stacked into one call (CPU, global positions)."""
    by_length: dict[int, list[torch.Tensor]] = {}
    for start, end in itertools.pairwise(documents):
        by_length.setdefault(end - start, []).append(torch.arange(start, end))
    return tuple(
        SparseCall(torch.stack(rows), torch.stack(rows), is_causal) for rows in by_length.values()
    )


@functools.lru_cache(maxsize=16)
def _global_calls(
    documents: tuple[int, ...], is_causal: bool, pattern: Pattern | None, block_size: int
) -> tuple[SparseCall, ...]:
    """The packed row's plan of position calls (Note [Packed documents across ranks])."""
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
    (q_lo, q_hi), (k_lo, k_hi) = queries, keys
    groups: dict[tuple[bool, int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def add(causal: bool, q_rows: torch.Tensor, k_rows: torch.Tensor) -> None:
        if q_rows.numel() and k_rows.numel():
            qs, ks = groups.setdefault((causal, q_rows.numel(), k_rows.numel()), ([], []))
            qs.append(q_rows - q_lo)
            ks.append(k_rows - k_lo)

    for call in calls:
        for q_pos, k_pos in zip(call.q_index, call.kv_index, strict=True):
            q_in = q_pos[(q_pos >= q_lo) & (q_pos < q_hi)]
            k_in = k_pos[(k_pos >= k_lo) & (k_pos < k_hi)]
            if not (q_in.numel() and k_in.numel()):
                continue
            if not call.causal:
                add(False, q_in, k_in)
                continue
            add(False, q_in, k_in[k_in < q_in[0]])
            add(True, q_in, k_in[(k_in >= q_in[0]) & (k_in <= q_in[-1])])
    return [
        SparseCall(torch.stack(qs), torch.stack(ks), causal)
        for (causal, _, _), (qs, ks) in groups.items()
    ]


def _needs(
    calls: tuple[SparseCall, ...], n: int, dst: int, src: int
) -> tuple[torch.Tensor, list[SparseCall]]:
    """``block_sparse_ring.Needs`` of a packed plan: the global positions of ``src``'s shard
    that ``dst`` reads, and its calls on them."""
    part = restricted_calls(calls, (dst * n, (dst + 1) * n), (src * n, (src + 1) * n))
    return call_positions(part) + src * n, part


@functools.lru_cache(maxsize=16)
def _steps(
    documents: tuple[int, ...],
    is_causal: bool,
    pattern: Pattern | None,
    block_size: int,
    world_rank: tuple[int, int],
    device: torch.device,
) -> tuple[ExchangeStep, ...]:
    """This rank's steps over a packed row's plan (pure: the same on every call)."""
    world_size, rank = world_rank
    calls = _global_calls(documents, is_causal, pattern, block_size)
    n = documents[-1] // world_size
    needs = functools.partial(_needs, calls, n)
    return exchange_steps(needs, n, world_size, rank, device)


def _pairs(call: SparseCall) -> int:
    """Query-key pairs one call computes (top-left causal pieces: row ``i`` sees ``i + 1``)."""
    pieces, rows_q = call.q_index.shape
    rows_k = call.kv_index.shape[1]
    if not call.causal:
        return pieces * rows_q * rows_k
    seen = min(rows_q, rows_k)
    return pieces * (seen * (seen + 1) // 2 + (rows_q - seen) * rows_k)


@dataclass(frozen=True)
class RingLoad:
    """The work of a packed ring per rank (Note [Packed documents across ranks]).

    Attributes:
        pairs: query-key pairs each rank computes, by rank.
        max_over_mean: the busiest rank's pairs over the mean (1.0: perfectly even).
    """

    pairs: tuple[int, ...]
    max_over_mean: float


def ring_load(
    cu_seqlens: object,
    world_size: int,
    *,
    is_causal: bool = False,
    pattern: Pattern | None = None,
    block_size: int = 128,
) -> RingLoad:
    """The pairs each of ``world_size`` ranks computes for a packed row of documents
    ``cu_seqlens`` (its length a multiple of ``world_size``) in ``ring_attention`` (or, with
    ``pattern``, ``block_sparse_ring_attention``), before anything runs.

    Raises:
        ValueError / TypeError: malformed offsets, or a row length ``world_size`` does not
            divide.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    documents = check_offsets(cu_seqlens, 1, _row_length(cu_seqlens), torch.device("cpu"))
    _check_divides(documents[-1], world_size)
    if pattern is not None:
        pattern, block_size = check_pattern(pattern), check_block_size(block_size)
    calls = _global_calls(documents, is_causal, pattern, block_size)
    n = documents[-1] // world_size
    pairs = tuple(
        sum(_pairs(c) for src in range(world_size) for c in _needs(calls, n, dst, src)[1])
        for dst in range(world_size)
    )
    mean = sum(pairs) / world_size
    return RingLoad(pairs, max(pairs) / mean if mean else 1.0)


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
            f"a packed row of {total} positions cannot be sharded over {world_size} ranks: "
            f"shards are equal (shard_sequence); pad the row's last document to a multiple of "
            f"{world_size} positions"
        )


def packed_ring(
    call: RingArgs,
    cu_seqlens: object,
    *,
    pattern: Pattern | None = None,
    block_size: int = 128,
    describe: Callable[[], str] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of ``ring_attention`` (or, with ``pattern``, ``block_sparse_ring_attention``)
    on one packed row: this rank's shard (B = 1, n positions) of the documents ``cu_seqlens``
    over the whole row of ``W * n`` (Note [Packed documents across ranks]).

    ``describe`` checks the caller's own arguments inside the agreement and returns their
    text (the pattern), compared across ranks with the offsets.
    """
    checked: dict[str, tuple[int, ...]] = {}

    def check_schedule() -> str:
        q = call.query
        if call.key_padding_mask is not None or call.layout != "contiguous" or call.comm != "ring":
            raise ValueError(
                "cu_seqlens in a ring takes contiguous shards (layout='contiguous', "
                "comm='ring') and no key_padding_mask: packed documents need no padding"
            )
        if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[0] != 1:
            shape = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
            raise ValueError(
                f"cu_seqlens in a ring takes one packed row: query of shape (1, n, H, D), got "
                f"{shape}; pack the batch's documents into one row"
            )
        world = group_rank_and_size(call.group)[1]
        documents = check_offsets(cu_seqlens, 1, q.shape[1] * world, q.device)
        checked["documents"] = documents
        extra = "" if describe is None else f" {describe()}"
        return f"cu_seqlens={list(documents)}{extra}"

    ring = prepare_ring(call, RingOperation(check_schedule=check_schedule,
                                            schedule_name="cu_seqlens"))  # fmt: skip
    q, k, v, setup = ring.q, ring.k, ring.v, ring.setup
    if ring.empty:
        return empty_attention(q, k, v)
    steps = _steps(
        checked["documents"], bool(call.is_causal), pattern, block_size,
        (setup.world_size, setup.rank), q.device,
    )  # fmt: skip
    what = "ring_attention" if pattern is None else "block_sparse_ring_attention"
    message = ring_message(what, "attention()" if pattern is None else "block_sparse_attention()")
    runner = RingRunner(SparseSteps(steps, setup), StepKernel(ring.kernel.backend, setup.scale),
                        message)  # fmt: skip
    return run_attention(q, k, v, None, runner)

