"""Ring dilated attention's plans: which branches a rank runs alone and, for each branch whose
rows cross ranks, which rows every rank sends and which kernel calls this rank makes on them
(Note [Local and spanning branches] and Note [Spanning results stay compact] in
``ring_dilated.py``).

Shape legend: B batch, n local tokens, H query heads, Hkv key/value heads (G = H / Hkv), D head dim,
W ranks, R gathered rows per rank for one branch.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch

from ...backends.base import Backend
from ...core.geometry.cells import Cells
from ...core.geometry.plan import Plan
from ...core.geometry.schedule import ShardedBranches
from ...core.geometry.segment import RowGroup, branch_plan
from ...core.higher_order import RowCall, ring_message
from ...core.merge import merge_partial
from ..rings.template import RingSetup
from .sharding import local_positions

__all__ = [
    "CompactCall",
    "DilatedRingPlan",
    "SpanPlan",
    "local_plan",
    "merge_compact",
    "plan_ring_dilated",
    "span_peers",
    "span_rows",
    "span_segments",
]


@dataclass(frozen=True)
class _Call:
    """One kernel call of a spanning branch: P runs of local query rows, each against its own
    gathered key rows, side by side as P kv heads (Hp query heads each)."""

    rows: torch.Tensor  # (c, P * Hp) local query rows
    heads: torch.Tensor  # (P * Hp,) their heads
    cells: torch.Tensor  # (c * P * Hp,) row * H + head: the rows of x (B, n, H, E) as (B, n * H, E)
    keys: torch.Tensor  # flat indices into the gathered (W * R) rows (ck, P)
    causal: bool

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """The call's rows of x (B, n, H, E), contiguous: (B, c, P * Hp, E)."""
        rows = x.flatten(1, 2).index_select(1, self.cells)
        return rows.view(x.shape[0], *self.rows.shape, x.shape[-1])

    def key_mask(self, gathered_mask: torch.Tensor | None) -> torch.Tensor | None:
        """The call's kernel key mask (B, P * Hp, ck) from the gathered (B, W * R) mask, or None:
        query head ``p * Hp + j`` reads the keys of run ``p``."""
        if gathered_mask is None:
            return None
        per_run = gathered_mask[:, self.keys].transpose(1, 2)  # (B, P, ck)
        return per_run.repeat_interleave(self.heads.numel() // self.keys.shape[1], dim=1)


@dataclass(frozen=True)
class CompactCall:
    """A spanning branch's call as the executor's ``Call`` (``core/geometry/calls.py``): query-side
    rows read from (B, n, H, E) tensors and written to compact (B, M, E) ones at ``cells``
    (Note [Spanning results stay compact]); key/value rows read from and added to the gathered
    (B, W * R, D) rows."""

    call: _Call
    cells: torch.Tensor  # (c * P * Hp,) the call's positions among the compact cells

    @property
    def causal(self) -> bool:
        return self.call.causal

    def q_rows(self, x: torch.Tensor) -> torch.Tensor:
        return self.call.take(x)

    def kv_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, self.call.keys]  # (B, ck, P, D)

    def key_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        return self.call.key_mask(mask)

    def put_q(self, dest: torch.Tensor, rows: torch.Tensor, *, accumulate: bool) -> None:
        flat = rows.flatten(1, 2).to(dest.dtype)
        if accumulate:
            dest.index_add_(1, self.cells, flat)
        else:
            dest.index_copy_(1, self.cells, flat)

    def put_kv(self, dest: torch.Tensor, rows: torch.Tensor, *, accumulate: bool) -> None:
        # the same key row can serve two runs: index_add_ sums
        dest.index_add_(1, self.call.keys.reshape(-1), rows.flatten(1, 2).to(dest.dtype))

    def row_call(self, q: torch.Tensor, k: torch.Tensor) -> RowCall:
        raise RuntimeError(ring_message("ring_dilated_attention", "dilated_attention()"))


def merge_compact(
    call: CompactCall,
    out: torch.Tensor,
    lse: torch.Tensor,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
) -> None:
    """The executor's merge into the compact accumulators out (B, M, D) and lse (B, M)."""
    new_out, new_lse = merge_partial(
        out.index_select(1, call.cells), lse.index_select(1, call.cells),
        part_out.flatten(1, 2), part_lse.transpose(1, 2).flatten(1, 2),
    )  # fmt: skip
    out.index_copy_(1, call.cells, new_out)
    lse.index_copy_(1, call.cells, new_lse)


@dataclass(frozen=True)
class _Pair:
    """A (kv head, offset) pair: its rows in every rank's send buffer."""

    kv_head: int
    offset: int
    start: int  # first row of this pair in the send buffer
    local_rows: tuple[torch.Tensor, ...]  # per rank: local indices of the pair's rows


@dataclass(frozen=True)
class SpanPlan:
    """How one spanning branch moves and computes rows on this rank."""

    pairs: tuple[_Pair, ...]  # the same on every rank
    rows_per_rank: int  # R, the same on every rank
    calls: tuple[_Call, ...]
    slots: torch.Tensor  # (S,) the filled rows of this rank's send buffer (R rows, zero-padded)
    send_rows: torch.Tensor  # (S,) the local row behind each filled slot
    send_heads: torch.Tensor  # (S,) and its kv head
    peers: tuple[int, ...]  # group ranks sharing a segment with this one (both ways), not itself


def plan_span(
    setup: RingSetup,
    local_len: int,
    num_heads: int,
    num_kv_heads: int,
    segment: int,
    rate: int,
    device: torch.device,
    first_head: int = 0,
) -> SpanPlan:
    """The rows each rank sends and the kernel calls this rank makes for a spanning branch;
    head ``h`` has offset ``(first_head + h) mod rate`` (Note [Heads from a later layer
    head])."""
    world = setup.world_size
    seg = min(segment, local_len * world)
    group = num_heads // num_kv_heads
    pairs, total, positions = span_rows(
        world, setup.layout, local_len, num_heads, num_kv_heads, segment, rate, device,
        first_head,
    )  # fmt: skip
    calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]] = []
    me = setup.rank
    for pair in pairs:
        heads = torch.tensor(
            [h for h in range(num_heads)
             if (first_head + h) % rate == pair.offset and h // group == pair.kv_head],
            device=device,
        )  # fmt: skip
        # Every rank's rows of this pair, as flat indices into the gathered (W * R) rows.
        flat = torch.cat(
            [j * total + pair.start + torch.arange(r.numel(), device=device)
             for j, r in enumerate(pair.local_rows)]
        )  # fmt: skip
        pos = torch.cat([positions[j][r] for j, r in enumerate(pair.local_rows)])
        order = torch.argsort(pos)
        flat, pos = flat[order], pos[order]
        mine = pair.local_rows[me]
        my_pos = positions[me][mine]
        for run in _runs(my_pos, rate, seg):
            q_rows = mine[run]
            first, last = int(my_pos[run[0]]), int(my_pos[run[-1]])
            in_seg = (pos // seg) == first // seg
            if not setup.is_causal:
                calls.append((q_rows, heads, flat[in_seg], False))
                continue
            before = in_seg & (pos < first)
            if bool(before.any()):
                calls.append((q_rows, heads, flat[before], False))
            own = in_seg & (pos >= first) & (pos <= last)
            calls.append((q_rows, heads, flat[own], True))
    peers = span_peers(span_segments(positions, seg), me)
    my_rows = [pair.local_rows[me] for pair in pairs]
    slots = [
        pair.start + torch.arange(r.numel(), device=device)
        for pair, r in zip(pairs, my_rows, strict=True)
    ]
    heads_of = [torch.full_like(r, pair.kv_head) for pair, r in zip(pairs, my_rows, strict=True)]
    return SpanPlan(
        tuple(pairs),
        total,
        _stack_calls(calls, num_heads, local_len),
        torch.cat(slots),
        torch.cat(my_rows),
        torch.cat(heads_of),
        peers,
    )


def span_rows(
    world: int,
    layout: str,
    local_len: int,
    num_heads: int,
    num_kv_heads: int,
    segment: int,
    rate: int,
    device: torch.device,
    first_head: int = 0,
) -> tuple[list[_Pair], int, list[torch.Tensor]]:
    """A spanning branch's (key/value head, offset) pairs with their rows on every rank, the
    rows ``R`` each rank sends (every pair padded to its widest rank), and every rank's global
    positions; head ``h`` has offset ``(first_head + h) mod rate``."""
    seg = min(segment, local_len * world)
    group = num_heads // num_kv_heads
    positions = [
        local_positions(local_len, rank=j, world_size=world, layout=layout, device=device)
        for j in range(world)
    ]
    rel = [p % seg for p in positions]  # position inside its segment
    pairs: list[_Pair] = []
    start = 0
    offset_of = [(first_head + h) % rate for h in range(num_heads)]
    for offset in sorted(set(offset_of)):
        rows = tuple(torch.nonzero(rj % rate == offset).flatten() for rj in rel)
        width = max(int(r.numel()) for r in rows)
        for kv_head in sorted({h // group for h in range(num_heads) if offset_of[h] == offset}):
            pairs.append(_Pair(kv_head, offset, start, rows))
            start += width
    return pairs, start, positions


def span_segments(positions: list[torch.Tensor], segment: int) -> list[set[int]]:
    """Every rank's segments of length ``segment`` (``positions``: every rank's positions)."""
    return [set((p // segment).tolist()) for p in positions]


def span_peers(segments: list[set[int]], rank: int) -> tuple[int, ...]:
    """The ranks sharing a segment with ``rank`` (``segments``: :func:`span_segments`), not
    itself."""
    return tuple(j for j in range(len(segments)) if j != rank and segments[j] & segments[rank])


def _stack_calls(
    calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]], num_heads: int, n: int
) -> tuple:
    """One kernel call per shape: runs with equal row, head and key counts go side by side as
    heads (usually every (kv head, offset) pair of a branch at once; a kernel launch and its
    indexing cost far more host time than the small per-run attention)."""
    groups: dict[tuple[int, int, int, bool], list] = {}
    for q_rows, heads, keys, causal in calls:
        shape = (q_rows.numel(), heads.numel(), keys.numel(), causal)
        groups.setdefault(shape, []).append((q_rows, heads, keys))
    stacked = []
    for (_, per_run, _, causal), group in groups.items():
        q_rows = torch.stack([c[0] for c in group], dim=1)  # (c, P)
        heads = torch.cat([c[1] for c in group])  # (P * Hp,), run-major
        rows = q_rows.repeat_interleave(per_run, dim=1)  # (c, P * Hp)
        cells = (rows * num_heads + heads).flatten()
        keys = torch.stack([c[2] for c in group], dim=1)  # (ck, P)
        stacked.append(_Call(rows, heads, cells, keys, causal))
    return tuple(stacked)


def _runs(pos: torch.Tensor, rate: int, segment: int) -> list[torch.Tensor]:
    """Indices of maximal runs of positions that step by ``rate`` inside one segment: rows no other
    rank's row of the same offset falls between."""
    if pos.numel() == 0:
        return []
    step = pos[1:] - pos[:-1]
    new_segment = pos[1:] // segment != pos[:-1] // segment
    breaks = torch.nonzero((step != rate) | new_segment).flatten() + 1
    bounds = [0, *breaks.tolist(), pos.numel()]
    return [torch.arange(a, b, device=pos.device) for a, b in itertools.pairwise(bounds)]


@dataclass(frozen=True)
class DilatedRingPlan:
    """Local branches (``(segment, rate)`` pairs and their engine plan), spanning branches (one
    :class:`SpanPlan` each) and the cells these touch (Note [Spanning results stay compact])."""

    local_branches: tuple[tuple[int, int], ...]
    local: tuple[RowGroup, ...]
    spans: tuple[SpanPlan, ...]
    q_cells: Cells | None = None
    kv_cells: Cells | None = None
    call_cells: tuple[tuple[torch.Tensor, ...], ...] = ()  # per span, per call: (c * P * Hp,)
    send_cells: tuple[torch.Tensor, ...] = ()  # per span: (S,) its sent rows among kv_cells
    first_head: int = 0  # the layer head that head 0 is (Note [Heads from a later layer head])
    span_rates: tuple[int, ...] = ()  # per span: its branch's rate


@functools.lru_cache(maxsize=32)
def plan_ring_dilated(
    setup: RingSetup, split: ShardedBranches, device: torch.device
) -> DilatedRingPlan:
    """The plan of the branches ``split`` into local and spanning ones (Note [Local and
    spanning branches]; ``ScheduleLayout.sharded``) on this rank.

    Plans depend on the geometry alone and are cached: building one takes host-device syncs.
    """
    n, heads, kv_heads = split.local_len, split.num_heads, split.num_kv_heads
    spans = [
        plan_span(setup, n, heads, kv_heads, w, r, device, split.first_head)
        for w, r in split.spanning
    ]
    if not spans:
        return DilatedRingPlan(split.local, split.groups, (), first_head=split.first_head)
    calls = [call for span in spans for call in span.calls]
    q_cells, pieces = Cells.of(
        [c.rows for c in calls], [c.heads.expand_as(c.rows) for c in calls], heads, device
    )
    per_span = [len(span.calls) for span in spans]
    call_cells = tuple(tuple(g) for g in _split(pieces, per_span))
    kv_cells, send_cells = Cells.of(
        [s.send_rows for s in spans], [s.send_heads for s in spans], kv_heads, device
    )
    return DilatedRingPlan(
        split.local, split.groups, tuple(spans), q_cells, kv_cells, call_cells,
        tuple(send_cells), split.first_head, tuple(r for _, r in split.spanning),
    )  # fmt: skip


def _split(items: list, sizes: list[int]) -> list[list]:
    """``items`` cut into consecutive pieces of ``sizes``."""
    bounds = list(itertools.accumulate(sizes, initial=0))
    return [items[a:b] for a, b in itertools.pairwise(bounds)]


def local_plan(
    groups: tuple[RowGroup, ...],
    q: torch.Tensor,
    k: torch.Tensor,
    setup: RingSetup,
    backend: Backend,
) -> Plan:
    """The executor's plan of the local branches on ``backend``: strided views where it reads
    them, branch slots where it also writes into given buffers (``branch_plan``)."""
    return branch_plan(
        groups, q.shape[1], k.shape[2], q.device, setup.is_causal, backend.reads_strided_rows,
        backend.writes_into,
    )  # fmt: skip
