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
    per group of query heads. The backward sends each peer the dK/dV of that peer's rows
    straight back, and the owner sums them. Everything merges into one float32 (out, lse) per
    row, so the branches mix exactly as in ``dilated_attention``.

Shape legend: B batch, n local tokens, H query heads, Hkv key/value heads (G = H / Hkv), D head dim,
W ranks, R gathered rows per rank for one branch.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .. import _validation as V
from ..backends.base import Backend
from ..core.engine import dilated_backward, dilated_forward
from ..core.fused import fused_backward, fused_forward
from ..core.merge import merge_partial
from ..core.segment import RowGroup, plan_branches
from ._comm import exchange, wait_all
from .ring import RingSetup, prepare_ring
from .sharding import local_positions


@dataclass(frozen=True)
class _Call:
    """One kernel call of a spanning branch: P runs of local query rows, each against its own
    gathered key rows, side by side as P kv heads (Hp query heads each)."""

    index: tuple[slice, torch.Tensor, torch.Tensor]  # x[index]: (B, n, H, E) -> (B, c, P*Hp, E)
    keys: torch.Tensor  # flat indices into the gathered (W * R) rows (ck, P)
    causal: bool


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
        _stack_calls(calls),
        torch.cat(slots),
        torch.cat(my_rows),
        torch.cat(heads_of),
        peers,
    )


def _stack_calls(calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]]) -> tuple:
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
        index = (slice(None), q_rows.repeat_interleave(per_run, dim=1), heads.view(1, -1))
        keys = torch.stack([c[2] for c in group], dim=1)  # (ck, P)
        stacked.append(_Call(index, keys, causal))
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


def _gather(k: torch.Tensor, v: torch.Tensor, plan: SpanPlan, setup: RingSetup) -> torch.Tensor:
    """(2, B, W * R, D) from k, v (B, n, Hkv, D): the send buffers (rows of every pair, zero-padded
    to the common width R) of this rank and its peers, side by side in rank order; zeros for other
    ranks, whose rows no kernel call of this rank reads (they share no segment with it)."""
    batch, _, _, dim = k.shape
    buf = k.new_zeros(2, batch, plan.rows_per_rank, dim)
    buf[0, :, plan.slots] = k[:, plan.send_rows, plan.send_heads]
    buf[1, :, plan.slots] = v[:, plan.send_rows, plan.send_heads]
    parts = [buf if j == setup.rank else torch.zeros_like(buf) for j in range(setup.world_size)]
    ranks = setup.global_ranks
    wait_all(
        exchange([(buf, ranks[j]) for j in plan.peers], [(parts[j], ranks[j]) for j in plan.peers])
    )
    return torch.cat(parts, dim=2)


def span_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    plan: SpanPlan,
    setup: RingSetup,
    backend: Backend,
) -> list[Any]:
    """Merge one spanning branch into the float32 accumulators out (B,n,H,D), lse (B,n,H);
    returns each kernel call's ``aux`` for the backward."""
    gathered = _gather(k, v, plan, setup)
    auxes = []
    for call in plan.calls:
        keys = gathered[:, :, call.keys]  # (2, B, ck, P, D)
        index = call.index
        res = backend.forward(q[index], keys[0], keys[1], scale=setup.scale, is_causal=call.causal)
        auxes.append(res.aux)
        new_out, new_lse = merge_partial(out[index], lse[index], res.out, res.lse.transpose(1, 2))
        out[index] = new_out
        lse[index] = new_lse
    return auxes


def span_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse_bnh: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    plan: SpanPlan,
    setup: RingSetup,
    backend: Backend,
    auxes: list[Any],
) -> None:
    """Add one spanning branch's gradients into dq (B,n,H,D) and dk, dv (B,n,Hkv,D), float32."""
    gathered = _gather(k, v, plan, setup)
    dgathered = torch.zeros(gathered.shape, dtype=dk.dtype, device=dk.device)
    for call, aux in zip(plan.calls, auxes, strict=True):
        keys = gathered[:, :, call.keys]  # (2, B, ck, P, D)
        index = call.index
        dq_c, dk_c, dv_c = backend.backward(
            dout[index], q[index], keys[0], keys[1], out[index], lse_bnh[index].transpose(1, 2),
            aux, scale=setup.scale, is_causal=call.causal,
        )  # fmt: skip
        dq[index] += dq_c
        flat = call.keys.reshape(-1)  # the same key row can serve two runs: index_add_ sums them
        dgathered[0].index_add_(1, flat, dk_c.flatten(1, 2).to(dk.dtype))
        dgathered[1].index_add_(1, flat, dv_c.flatten(1, 2).to(dv.dtype))
    parts = dgathered.chunk(setup.world_size, dim=2)  # only this rank's and its peers' hold rows
    mine = parts[setup.rank].contiguous()
    received = [torch.empty_like(mine) for _ in plan.peers]
    ranks = setup.global_ranks
    send = [(parts[j].contiguous(), ranks[j]) for j in plan.peers]  # alive until the wait
    recv = [(buf, ranks[j]) for buf, j in zip(received, plan.peers, strict=True)]
    wait_all(exchange(send, recv))
    for part in received:
        mine += part
    rows = (slice(None), plan.send_rows, plan.send_heads)  # no (row, head) twice
    dk[rows] += mine[0][:, plan.slots]
    dv[rows] += mine[1][:, plan.slots]


@dataclass(frozen=True)
class DilatedRingPlan:
    """Local branches (``(segment, rate)`` pairs and their engine plan) and spanning branches
    (one :class:`SpanPlan` each)."""

    local_branches: tuple[tuple[int, int], ...]
    local: tuple[RowGroup, ...]
    spans: tuple[SpanPlan, ...]


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
    local_segs, local_rates, spans = [], [], []
    for seg, rate in zip(segment_lengths, dilation_rates, strict=True):
        if setup.chunk_len % min(seg, seq_len) == 0:
            local_segs.append(seg)
            local_rates.append(rate)
        else:
            spans.append(plan_span(setup, n, heads, kv_heads, seg, rate, device))
    local = plan_branches(n, heads, tuple(local_segs), tuple(local_rates)) if local_segs else ()
    return DilatedRingPlan(tuple(zip(local_segs, local_rates, strict=True)), local, tuple(spans))


class RingDilatedFunction(torch.autograd.Function):
    """Autograd wrapper of ring dilated attention; returns (out, lse), lse not differentiable."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: DilatedRingPlan,
        setup: RingSetup,
        backend: Backend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # float32 running (out, lse) only where spanning branches merge into it afterwards; else
        # the engines' own choice (float32 inside, the inputs' dtype out)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        local_dtype = acc if plan.spans else None
        batch, n, heads, dim = q.shape
        auxes: list[Any] = []
        if plan.local and backend.fuses_dilated_branches:
            out, lse_bhn = fused_forward(
                q, k, v, None, plan.local_branches, backend, is_causal=setup.is_causal,
                scale=setup.scale, out_dtype=local_dtype,
            )  # fmt: skip
            lse = lse_bhn.transpose(1, 2).contiguous()
        elif plan.local:
            out, lse_bhn, auxes = dilated_forward(
                q, k, v, None, plan.local, backend, is_causal=setup.is_causal, scale=setup.scale,
                dropout_p=0.0, out_dtype=local_dtype,
            )  # fmt: skip
            lse = lse_bhn.transpose(1, 2).contiguous()
        else:
            out = torch.zeros(batch, n, heads, dim, dtype=acc, device=q.device)
            lse = torch.full((batch, n, heads), float("-inf"), dtype=acc, device=q.device)
        span_auxes = [span_forward(q, k, v, out, lse, span, setup, backend) for span in plan.spans]
        out = out.to(q.dtype)
        lse_out = lse.transpose(1, 2).contiguous()
        ctx.save_for_backward(q, k, v, out, lse_out)
        ctx.plan, ctx.setup, ctx.backend = plan, setup, backend
        ctx.auxes, ctx.span_auxes = auxes, span_auxes
        ctx.mark_non_differentiable(lse_out)
        return out, lse_out

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, dout: torch.Tensor, _dlse: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        plan: DilatedRingPlan = ctx.plan
        setup: RingSetup = ctx.setup
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        local_dtype = acc if plan.spans else None  # as in the forward
        dout = dout.contiguous()
        if plan.local and ctx.backend.fuses_dilated_branches:
            dq, dk, dv = fused_backward(
                dout, q, k, v, out, lse, None, plan.local_branches, ctx.backend,
                is_causal=setup.is_causal, scale=setup.scale, grad_dtype=local_dtype,
            )  # fmt: skip
        elif plan.local:
            dq, dk, dv = dilated_backward(
                dout, q, k, v, out, lse, None, plan.local, ctx.backend, ctx.auxes,
                is_causal=setup.is_causal, scale=setup.scale, dropout_p=0.0,
                grad_dtype=local_dtype,
            )  # fmt: skip
        else:
            dq = torch.zeros(q.shape, dtype=acc, device=q.device)
            dk = torch.zeros(k.shape, dtype=acc, device=q.device)
            dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        if plan.spans:
            lse_bnh = lse.transpose(1, 2).contiguous()
            for span, auxes in zip(plan.spans, ctx.span_auxes, strict=True):
                span_backward(
                    dout, q, k, v, out, lse_bnh, dq, dk, dv, span, setup, ctx.backend, auxes
                )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact dilated attention over a sequence sharded across ``group``: this rank's shard of
    ``dilated_attention`` on the gathered sequence (Note [Local and spanning branches]).

    Args:
        query: (B, n, H, D) this rank's shard; key, value: (B, n, Hkv, D).
        segment_lengths, dilation_rates: the branches, over global positions.
        group, is_causal, scale, layout, backend, return_lse: as in ``ring_attention``.

    Returns:
        ``out`` (B, n, H, D), or ``(out, lse)`` with ``lse`` (B, H, n); exact gradients for the
        local q, k, v.

    Raises:
        ValueError: on every rank, before other communication, for malformed or mismatched inputs.
    """
    q, k, v, setup, kernel = prepare_ring(
        query, key, value, group=group, is_causal=is_causal, scale=scale, layout=layout,
        backend=backend, comm="allgather", dilated=True,
        check_schedule=lambda: V.check_branches(segment_lengths, dilation_rates),
    )  # fmt: skip
    segs, rates = V.check_branches(segment_lengths, dilation_rates)
    plan = plan_ring_dilated(setup, q, k, segs, rates)
    out, lse = RingDilatedFunction.apply(q, k, v, plan, setup, kernel)
    return (out, lse) if return_lse else out
