"""Ring dilated attention: exact LongNet dilated attention over a sequence sharded across ranks.

Note [Local and spanning branches]
    A branch whose segments each lie inside one chunk of one rank (the chunk length is a multiple
    of ``w``) is computed locally by the single-process engine and sends nothing. Any other branch
    spans ranks: every rank takes its own dilated rows of K and V for that branch (1/r of them,
    LongNet Sec. 3.1) and sends them, padded to a common count that every rank computes from the
    geometry alone, to each rank holding positions of a segment it holds positions of (its
    peers; every rank when one segment covers the sequence, one or two when segments cover a
    few ranks each). Each rank attends its dilated query rows to the received rows of their
    segments. Causal masking splits that into the keys before the query run (full) and the run's
    own keys (causal). Only the kv heads a query head reads are sent: one (kv head, offset) pair
    per group of query heads, and with a key padding mask one byte per sent row beside it. The
    backward sends each peer the dK/dV of that peer's rows straight back, and the owner sums
    them.

Note [Spanning results stay compact]
    Spanning branches touch few (row, head) cells of a rank: 1/r of them. Their results are kept
    in float32 for those cells only (``core/cells.py``) and join the local branches' float32
    running values (the fused engine's scratch, through its ``extra`` callback; the gather
    engine's float32 output) before the one rounding into the inputs' dtype. Backward likewise:
    spanning gradients, compact, are added into the local branches' float32 scratch. So the
    branches mix exactly as in ``dilated_attention``, with float32 accumulation, and no
    full-size float32 output or gradients exist. The spanning work (exchanges, small kernels,
    many small host-side ops) runs when the fused engine first asks for it, after it has queued
    a head group's kernels, so the host prepares it while the GPU computes. The forward keeps the
    gathered rows for the backward (a few rows per segment): the backward sends only gradients.

Shape legend: B batch, n local tokens, H query heads, Hkv key/value heads (G = H / Hkv), D head dim,
W ranks, R gathered rows per rank for one branch.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from .. import _validation as V
from ..backends.base import Backend
from ..backends.registry import DILATED, Selection
from ..compiled import eager_only
from ..core.autograd import Backward, FirstOrderOnly, Forward, Grads, Inputs, run_attention
from ..core.cells import Cells, add_cells, merge_cells
from ..core.engine import (
    Plan,
    accumulator_dtype,
    empty_attention,
    plan_backward,
    plan_forward,
    row_lse,
    run_backward,
    run_forward,
)
from ..core.fused import fused_backward, fused_forward
from ..core.hidden import hide_masked_keys
from ..core.higher_order import RowCall, ring_message
from ..core.merge import merge_partial
from ..core.segment import (
    RowGroup,
    branch_plan,
    effective_branches,
    not_slotted_reason,
    plan_branches,
)
from ._comm import exchange, wait_all
from .ring import RingSetup, prepare_ring
from .sharding import local_positions


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
class _CompactCall:
    """A spanning branch's call as the executor's ``Call`` (``core/engine.py``): query-side
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


def _merge_compact(
    call: _CompactCall,
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
) -> SpanPlan:
    """The rows each rank sends and the kernel calls this rank makes for a spanning branch."""
    world = setup.world_size
    seq_len = local_len * world
    seg = min(segment, seq_len)
    group = num_heads // num_kv_heads
    positions = [
        local_positions(local_len, rank=j, world_size=world, layout=setup.layout, device=device)
        for j in range(world)
    ]
    rel = [p % seg for p in positions]  # position inside its segment
    pairs: list[_Pair] = []
    start = 0
    offsets = sorted({h % rate for h in range(num_heads)})
    for offset in offsets:
        rows = tuple(torch.nonzero(rj % rate == offset).flatten() for rj in rel)
        width = max(int(r.numel()) for r in rows)
        for kv_head in sorted({h // group for h in range(num_heads) if h % rate == offset}):
            pairs.append(_Pair(kv_head, offset, start, rows))
            start += width
    total = start
    calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]] = []
    me = setup.rank
    for pair in pairs:
        heads = torch.tensor(
            [h for h in range(num_heads) if h % rate == pair.offset and h // group == pair.kv_head],
            device=device,
        )
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
    segments = [set((p // seg).tolist()) for p in positions]
    peers = tuple(j for j in range(world) if j != me and segments[j] & segments[me])
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


#: A spanning branch's gathered rows: K/V (2, B, W * R, D) and their key padding mask (B, W * R)
#: bool, or None without a mask.
Gathered = tuple[torch.Tensor, torch.Tensor | None]


def _gather(
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    plan: SpanPlan,
    setup: RingSetup,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(2, B, W * R, D) from k, v (B, n, Hkv, D): the send buffers (rows of every pair, zero-padded
    to the common width R) of this rank and its peers, side by side in rank order; zeros for other
    ranks, whose rows no kernel call of this rank reads (they share no segment with it). With a
    (B, n) key padding mask, also the mask of those rows (B, W * R), sent as bytes beside them."""
    batch, _, _, dim = k.shape
    buf = k.new_zeros(2, batch, plan.rows_per_rank, dim)
    buf[0, :, plan.slots] = k[:, plan.send_rows, plan.send_heads]
    buf[1, :, plan.slots] = v[:, plan.send_rows, plan.send_heads]
    mine = [buf]
    if key_padding_mask is not None:  # gloo sends no bool tensors
        mask = torch.zeros(batch, plan.rows_per_rank, dtype=torch.uint8, device=k.device)
        mask[:, plan.slots] = key_padding_mask[:, plan.send_rows].to(torch.uint8)
        mine.append(mask)
    parts = [
        mine if j == setup.rank else [torch.zeros_like(t) for t in mine]
        for j in range(setup.world_size)
    ]
    ranks = setup.global_ranks
    send = [(t, ranks[j]) for j in plan.peers for t in mine]
    recv = [(t, ranks[j]) for j in plan.peers for t in parts[j]]
    wait_all(exchange(send, recv))
    rows = torch.cat([p[0] for p in parts], dim=2)
    if key_padding_mask is None:
        return rows, None
    return rows, torch.cat([p[1] for p in parts], dim=1).bool()


def span_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    plan: DilatedRingPlan,
    setup: RingSetup,
    backend: Backend,
    acc: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, list[Gathered], list[list[Any]]]:
    """Every spanning branch, merged per cell (Note [Spanning results stay compact]).

    Returns:
        ``out`` (B, M, D) and ``lse`` (B, M) in ``acc`` over ``plan.q_cells`` (``-inf`` where no
        key), each branch's gathered rows (:func:`_gather`) and each kernel call's ``aux``.
    """
    batch, _, _, dim = q.shape
    cells = plan.q_cells.rows.numel()
    out = torch.zeros(batch, cells, dim, dtype=acc, device=q.device)
    lse = torch.full((batch, cells), float("-inf"), dtype=acc, device=q.device)
    kept, auxes = [], []
    for span, positions in zip(plan.spans, plan.call_cells, strict=True):
        gathered, gathered_mask = _gather(k, v, key_padding_mask, span, setup)
        kept.append((gathered, gathered_mask))
        auxes.append([])
        calls = [_CompactCall(c, pos) for c, pos in zip(span.calls, positions, strict=True)]
        run_forward(
            q, gathered[0], gathered[1], gathered_mask, calls, backend, scale=setup.scale,
            out=out, lse=lse, auxes=auxes[-1], merge=_merge_compact,
        )  # fmt: skip
    return out, lse, kept, auxes


def span_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    plan: DilatedRingPlan,
    setup: RingSetup,
    backend: Backend,
    gathered: list[Gathered],
    auxes: list[list[Any]],
    acc: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every spanning branch's gradients, compact: ``dq`` (B, M, D) over ``plan.q_cells`` and
    ``dkv`` (2, B, K, D) over ``plan.kv_cells``, in ``acc``; each rank's share of dK/dV is sent
    straight back to it (Note [Local and spanning branches]).

    Args:
        dout, out: (B, n, H, D); lse: (B, H, n) merged.
    """
    batch, _, _, dim = q.shape
    dq = torch.zeros(batch, plan.q_cells.rows.numel(), dim, dtype=acc, device=q.device)
    dkv = torch.zeros(2, batch, plan.kv_cells.rows.numel(), dim, dtype=acc, device=q.device)
    ranks = setup.global_ranks
    spans = zip(plan.spans, plan.call_cells, plan.send_cells, gathered, auxes, strict=True)
    lse_rows = row_lse(lse)
    for span, positions, sent, (rows_kv, rows_mask), span_auxes in spans:
        dgathered = torch.zeros(rows_kv.shape, dtype=acc, device=q.device)
        calls = [_CompactCall(c, pos) for c, pos in zip(span.calls, positions, strict=True)]
        run_backward(
            dout, q, rows_kv[0], rows_kv[1], out, lse_rows, rows_mask, calls, backend,
            iter(span_auxes), scale=setup.scale, dq=dq, dk=dgathered[0], dv=dgathered[1],
        )  # fmt: skip
        parts = dgathered.chunk(setup.world_size, dim=2)  # only mine and my peers' hold rows
        mine = parts[setup.rank].contiguous()
        received = [torch.empty_like(mine) for _ in span.peers]
        send = [(parts[j].contiguous(), ranks[j]) for j in span.peers]  # alive until the wait
        recv = [(buf, ranks[j]) for buf, j in zip(received, span.peers, strict=True)]
        wait_all(exchange(send, recv))
        for part in received:
            mine += part
        dkv.index_add_(2, sent, mine[:, :, span.slots])
    return dq, dkv


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


def plan_ring_dilated(
    setup: RingSetup,
    q: torch.Tensor,
    k: torch.Tensor,
    segment_lengths: tuple[int, ...],
    dilation_rates: tuple[int, ...],
) -> DilatedRingPlan:
    """Split the branches into local and spanning (Note [Local and spanning branches]).

    Plans depend on the geometry alone and are cached: building one takes host-device syncs.
    """
    _, n, heads, _ = q.shape
    return _plan(setup, n, heads, k.shape[2], segment_lengths, dilation_rates, q.device)


@functools.lru_cache(maxsize=32)
def _plan(
    setup: RingSetup,
    n: int,
    heads: int,
    kv_heads: int,
    segment_lengths: tuple[int, ...],
    dilation_rates: tuple[int, ...],
    device: torch.device,
) -> DilatedRingPlan:
    seq_len = n * setup.world_size
    branches, spanning = _split_branches(segment_lengths, dilation_rates, seq_len, setup.chunk_len)
    spans = [plan_span(setup, n, heads, kv_heads, seg, rate, device) for seg, rate in spanning]
    local = _branch_groups(n, heads, branches)
    if not spans:
        return DilatedRingPlan(branches, local, ())
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
        branches, local, tuple(spans), q_cells, kv_cells, call_cells, tuple(send_cells)
    )


def _split_branches(
    segment_lengths: tuple[int, ...], dilation_rates: tuple[int, ...], seq_len: int,
    chunk_len: int,
) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:  # fmt: skip
    """The (effective) branches ``(segment, rate)`` over a sequence of ``seq_len`` positions,
    split into the local ones, whose segments fit in a rank's chunks of ``chunk_len``, and the
    spanning ones (Note [Local and spanning branches]), each in schedule order."""
    branches = tuple(zip(segment_lengths, dilation_rates, strict=True))
    local = tuple(b for b in branches if chunk_len % min(b[0], seq_len) == 0)
    return local, tuple(b for b in branches if b not in local)


def _branch_groups(
    n: int, heads: int, branches: tuple[tuple[int, int], ...]
) -> tuple[RowGroup, ...]:
    """The row groups of ``branches`` ``(segment, rate)`` over a rank's ``n`` positions
    (``plan_branches``), none for no branch."""
    if not branches:
        return ()
    segs, rates = tuple(b[0] for b in branches), tuple(b[1] for b in branches)
    return plan_branches(n, heads, segs, rates)


def _local_branches_in_slots(
    schedule: object, q: torch.Tensor, k: torch.Tensor, world_size: int, chunk_len: int
) -> bool:
    """Whether this rank's local branches of ``schedule`` (checked ``(segments, rates)``) write
    into branch slots on a kernel that writes into given buffers (``not_slotted_reason``), as
    the dilated registry's choice of FlashAttention-4 asks (``KernelInputs.branch_slots``)."""
    n, heads = q.shape[1], q.shape[2]
    segs, rates = effective_branches(world_size * n, heads, *schedule)  # type: ignore[misc]
    local, _ = _split_branches(segs, rates, world_size * n, chunk_len)
    groups = _branch_groups(n, heads, local)
    return bool(groups) and not_slotted_reason(groups, n, k.shape[2]) is None


def _split(items: list, sizes: list[int]) -> list[list]:
    """``items`` cut into consecutive pieces of ``sizes``."""
    bounds = list(itertools.accumulate(sizes, initial=0))
    return [items[a:b] for a, b in itertools.pairwise(bounds)]


def _local_plan(
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


@dataclass(frozen=True)
class RingDilatedRunner(FirstOrderOnly):
    """Ring dilated attention as a :class:`~dilated_attention.core.autograd.Runner`: the local
    branches on this rank's rows, the spanning ones through the peer exchange, merged.

    ``kernel``: the dilated registry's choice; when it is the plan kernel (the fused branches,
    ``kernel.runs_plan``) it runs the local branches, and its backend the spanning branches'
    calls.
    """

    plan: DilatedRingPlan
    setup: RingSetup
    kernel: Selection
    first_order_message: ClassVar[str] = ring_message(
        "ring_dilated_attention", "dilated_attention()"
    )

    def forward(self, x: Inputs) -> Forward:
        q, k, v, key_padding_mask = x
        plan, setup, kernel = self.plan, self.setup, self.kernel
        backend = kernel.backend
        acc = accumulator_dtype(q.dtype)
        batch, n, heads, dim = q.shape
        auxes: list[Any] = []
        merge: Any = None
        # Run when the engine first asks for them (Note [Spanning results stay compact])
        spans = functools.cache(
            functools.partial(span_forward, q, k, v, key_padding_mask, plan, setup, backend, acc)
        )
        if plan.spans:

            def merge(out: torch.Tensor, lse: torch.Tensor, *block: int) -> None:
                cell_out, cell_lse, _, _ = spans()
                merge_cells(plan.q_cells, cell_out, cell_lse, out, lse, *block)

        if plan.local and kernel.runs_plan:
            out, lse = fused_forward(
                q, k, v, key_padding_mask, plan.local_branches, backend,
                is_causal=setup.is_causal, scale=setup.scale, extra=merge,
            )  # fmt: skip
        else:
            if plan.local:
                # float32 output where the spanning results merge in, else the engine's own
                local = _local_plan(plan.local, q, k, setup, backend)
                out, lse, auxes = plan_forward(
                    q, k, v, key_padding_mask, local, backend, scale=setup.scale,
                    out_dtype=acc if merge else None,
                )  # fmt: skip
            else:
                out = torch.zeros(batch, n, heads, dim, dtype=acc, device=q.device)
                lse = torch.full((batch, heads, n), float("-inf"), dtype=acc, device=q.device)
            if merge is not None:
                merge(out, lse, 0, n, 0, heads)
            out = out.to(q.dtype)
        gathered, span_auxes = spans()[2:] if plan.spans else ([], [])
        masks = [g[1] for g in gathered]  # bool, never differentiated
        saved = (k, v, key_padding_mask, *(g[0] for g in gathered))
        return Forward(out, lse, saved=saved, state=(auxes, span_auxes, masks))

    def backward(self, b: Backward) -> Grads:
        dout, q, out, lse, saved, state = b
        k, v, key_padding_mask, *gathered_rows = saved
        auxes, span_auxes, masks = state
        gathered = list(zip(gathered_rows, masks, strict=True))
        plan, setup, backend = self.plan, self.setup, self.kernel.backend
        acc = accumulator_dtype(q.dtype)
        heads, group = q.shape[2], q.shape[2] // k.shape[2]
        dout = dout.contiguous()
        add: Any = None
        # Run when the engine first asks for them (Note [Spanning results stay compact])
        spans = functools.cache(
            functools.partial(
                span_backward, dout, q, out, lse, plan, setup, backend, gathered, span_auxes,
                acc,
            )
        )  # fmt: skip
        if plan.spans:

            def add(
                dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, start: int, end: int,
                h0: int, h1: int,
            ) -> None:  # fmt: skip
                cell_dq, cell_dkv = spans()
                add_cells(plan.q_cells, cell_dq, dq, start, end, h0, h1)
                for grad, cell_grad in zip((dk, dv), cell_dkv, strict=True):
                    add_cells(plan.kv_cells, cell_grad, grad, start, end, h0 // group,
                              h1 // group)  # fmt: skip

        if plan.local and self.kernel.runs_plan:
            return fused_backward(
                dout, q, k, v, out, lse, key_padding_mask, plan.local_branches, backend,
                is_causal=setup.is_causal, scale=setup.scale, extra=add,
            )  # fmt: skip
        if plan.local:
            local = _local_plan(plan.local, q, k, setup, backend)
            dq, dk, dv = plan_backward(
                dout, q, k, v, out, lse, key_padding_mask, local, backend, auxes,
                scale=setup.scale, grad_dtype=acc if add else None,
            )  # fmt: skip
        else:
            dq, dk, dv = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (q, k, v))
        if add is not None:
            add(dq, dk, dv, 0, q.shape[1], 0, heads)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@eager_only("ring_dilated_attention")  # torch.compile runs it eagerly; torch.func raises
def ring_dilated_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segment_lengths: list[int] | tuple[int, ...],
    dilation_rates: list[int] | tuple[int, ...],
    *,
    group: dist.ProcessGroup | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    layout: str = "contiguous",
    backend: str | None = None,
    return_lse: bool = False,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact dilated attention over a sequence sharded across ``group``: this rank's shard of
    ``dilated_attention`` on the gathered sequence (Note [Local and spanning branches]).

    Args:
        query: (B, n, H, D) this rank's shard; key, value: (B, n, Hkv, D).
        segment_lengths, dilation_rates: the branches, over global positions.
        group, is_causal, scale, layout, backend, return_lse, key_padding_mask: as in
            ``ring_attention`` (the mask is this rank's (B, n) shard).

    Returns:
        ``out`` (B, n, H, D), or ``(out, lse)`` with ``lse`` (B, H, n); exact gradients for the
        local q, k, v. A batch of 0 (or 0 heads) gives empty tensors, as in one process.

    Raises:
        ValueError: on every rank, before other communication, for malformed or mismatched inputs
            or grad modes (as in ``ring_attention``, which also says what the timeout is for).
    """
    q, k, v, setup, kernel = prepare_ring(
        query, key, value, group=group, is_causal=is_causal, scale=scale, layout=layout,
        backend=backend, comm="allgather", operation=DILATED,
        check_schedule=lambda: V.check_branches(segment_lengths, dilation_rates),
        key_padding_mask=key_padding_mask, branch_slots=_local_branches_in_slots,
    )  # fmt: skip
    if q.numel() == 0:  # batch 0 or 0 heads, agreed on every rank: as in one process
        out, lse = empty_attention(q, k, v)
        return (out, lse) if return_lse else out
    segs, rates = V.check_branches(segment_lengths, dilation_rates)
    global_len = setup.world_size * q.shape[1]
    segs, rates = effective_branches(global_len, q.shape[2], segs, rates)
    plan = plan_ring_dilated(setup, q, k, segs, rates)
    mask = None if key_padding_mask is None else key_padding_mask.contiguous()
    k, v = hide_masked_keys(k, v, mask)  # Note [Hidden keys cannot poison rows]
    out, lse = run_attention(q, k, v, mask, RingDilatedRunner(plan, setup, kernel))
    return (out, lse) if return_lse else out
