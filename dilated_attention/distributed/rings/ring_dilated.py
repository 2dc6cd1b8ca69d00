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
    them. The spanning branches are the steps of the one ring template (Note [One ring
    template] in ``template.py``): the rows of the next branch are in flight while one
    computes. The plans are in ``dilated_plan.py``; the split of the branches is the schedule's
    (``ScheduleLayout.sharded``).

Note [Spanning results stay compact]
    Spanning branches touch few (row, head) cells of a rank: 1/r of them. Their results are kept
    in float32 for those cells only (``core/geometry/cells.py``) and join the local branches'
    running values before the one rounding into the inputs' dtype: on the fused engine its float32
    scratch, through its ``extra`` callback; on the executor in slots, as one more slot its
    merge (forward) and its sums (backward) read beside the local branches' own, where the cells
    are exactly the rows of one slot (LongNet's: their smallest rate r, which divides every
    other, the shard starting at a multiple of r in their segments; ``spanning_slots.py``), so
    no float32 output or gradients of the shard exist. Elsewhere they are merged into a float32
    output and added into float32 gradients (so are the gradients of GQA, whose key gradients
    are by position): of one position group where the plan is cut (Note [Position-grouped
    plans] in ``core/geometry/grouped.py``, as on a GPU wherever float32 gradients of the whole
    shard would take much memory), else of the whole shard. So the branches mix exactly as in
    ``dilated_attention``, with float32 accumulation. Where the whole shard's float32 ``out``
    may exist, the resolve step puts kernels writing into slots first only where it fits
    (``resolve/resolver.py``). The spanning work (exchanges, small kernels, many small
    host-side ops) runs when the engine first asks for it, after it has queued the local
    kernels, so the host prepares it while the GPU computes. The forward keeps the gathered
    rows for the backward (a few rows per segment): the backward sends only gradients.

Shape legend: B batch, n local tokens, H query heads, Hkv key/value heads (G = H / Hkv), D head dim,
W ranks, R gathered rows per rank for one branch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ... import _validation as V
from ...backends.registry import Selection, check_backend_name
from ...compiled import eager_only
from ...core.autograd import (
    Backward,
    FirstOrderOnly,
    Forward,
    Grads,
    Inputs,
    Runner,
    run_attention,
)
from ...core.execution.call_runs import accumulator_dtype, row_lse
from ...core.execution.executor import plan_backward, plan_forward
from ...core.execution.fused import fused_backward, fused_forward
from ...core.geometry.calls import KernelArgs
from ...core.geometry.cells import add_cells, merge_cells
from ...core.geometry.grouped import grouped_plan
from ...core.geometry.schedule import Schedule
from ...core.hidden import hide_masked_keys
from ...core.higher_order import ring_message
from ...resolve import DENSE, DILATED, Request, execute
from ..comm.agreement import RingArgs, RingOperation, prepare_ring, refuse_documents
from ..comm.collectives import exchange
from ..context import ContextParallel
from ..layout.dilated_plan import (
    CompactCall,
    DilatedRingPlan,
    SpanPlan,
    local_plan,
    merge_compact,
    plan_ring_dilated,
)
from .halo import UnionRunner, windowed_runner
from .packed_ring import packed_runner
from .spanning_slots import spanning_results, spanning_slots
from .template import (
    KeyBlock,
    RingSetup,
    StepGrads,
    StepKernel,
    Transit,
    ring_backward,
    ring_forward,
)
from .ulysses import heads_sinks, score_options, split_call


def _gather(
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    plan: SpanPlan,
    setup: RingSetup,
) -> Transit[KeyBlock | None]:
    """Start gathering one spanning branch's rows: kv (2, B, W * R, D) from k, v (B, n, Hkv, D),
    the send buffers (rows of every pair, zero-padded to the common width R) of this rank and
    its peers, side by side in rank order; zeros for other ranks, whose rows no kernel call of
    this rank reads (they share no segment with it). With a (B, n) key padding mask, also the
    mask of those rows (B, W * R), sent as bytes beside them."""
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

    def gathered() -> KeyBlock:
        rows = torch.cat([p[0] for p in parts], dim=2)
        if key_padding_mask is None:
            return KeyBlock(rows)
        return KeyBlock(rows, torch.cat([p[1] for p in parts], dim=1))

    return Transit(exchange(send, recv), gathered, tuple(mine))


@dataclass(frozen=True)
class _Spans:
    """One pass over the spanning branches, one step each (Note [Local and spanning
    branches]). Forward: ``local`` (k, v, key padding mask) gives the rows to gather. Backward:
    ``kept`` holds the forward's gathered rows (nothing travels but gradients) and ``dkv``
    (2, B, K, D) accumulates the rows' gradients over ``plan.kv_cells``."""

    plan: DilatedRingPlan
    setup: RingSetup
    local: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
    kept: tuple[KeyBlock, ...] = ()
    dkv: torch.Tensor | None = None

    @property
    def steps(self) -> int:
        return len(self.plan.spans)

    def fetch(self, step: int, held: KeyBlock | None) -> Transit[KeyBlock | None]:
        if self.local is None:
            return Transit.done(self.kept[step])
        k, v, key_padding_mask = self.local
        return _gather(k, v, key_padding_mask, self.plan.spans[step], self.setup)

    def calls(self, step: int) -> list[CompactCall]:
        span, positions = self.plan.spans[step], self.plan.call_cells[step]
        return [CompactCall(c, pos) for c, pos in zip(span.calls, positions, strict=True)]

    def grads(self, step: int, keys: KeyBlock) -> StepGrads:
        assert self.dkv is not None
        return StepGrads(torch.zeros(keys.kv.shape, dtype=self.dkv.dtype, device=keys.kv.device))

    def home(self, step: int, grads: StepGrads | None) -> Transit[None]:
        """Each peer's share of the gathered rows' dK/dV goes straight back to it; the shares
        of this rank's rows come back, are summed with its own and added at its cells."""
        assert grads is not None and grads.dkv is not None and self.dkv is not None
        span, sent, dkv = self.plan.spans[step], self.plan.send_cells[step], self.dkv
        ranks = self.setup.global_ranks
        parts = grads.dkv.chunk(self.setup.world_size, dim=2)  # mine and my peers' hold rows
        mine = parts[self.setup.rank].contiguous()
        received = [torch.empty_like(mine) for _ in span.peers]
        send = [(parts[j].contiguous(), ranks[j]) for j in span.peers]  # alive until the wait
        recv = [(buf, ranks[j]) for buf, j in zip(received, span.peers, strict=True)]

        def arrive() -> None:
            for part in received:
                mine.add_(part)
            dkv.index_add_(2, sent, mine[:, :, span.slots])

        return Transit(exchange(send, recv), arrive, tuple(t for t, _ in send))

    def finish(self) -> Transit[None]:
        return Transit.done(None)


_MESSAGE = ring_message("ring_dilated_attention", "dilated_attention()")


@dataclass(frozen=True)
class RingDilatedRunner(FirstOrderOnly):
    """Ring dilated attention as a :class:`~dilated_attention.core.autograd.Runner`: the local
    branches on this rank's rows, the spanning ones through the peer exchange, merged.

    ``kernel``: the resolve step's choice for the local branches; when it is the plan kernel
    (the fused branches, ``kernel.runs_plan``) it runs the local branches, and its backend the
    spanning branches' calls. ``softcap``: every call's and branch launch's scores soft-capped.
    """

    plan: DilatedRingPlan
    setup: RingSetup
    kernel: Selection
    first_order_message: str = _MESSAGE
    softcap: float | None = None

    @property
    def _step_kernel(self) -> StepKernel:
        """The spanning branches' per-step kernel: merged into their compact cells."""
        return StepKernel(self.kernel.backend, self.setup.scale, merge_compact, self.softcap)

    @property
    def _local_kernel(self) -> KernelArgs:
        """The executor's kernel arguments for the local branches' plan."""
        return KernelArgs(self.kernel.backend, self.setup.scale, softcap=self.softcap)

    @property
    def _fused(self) -> bool:
        """The plan kernel runs the local branches (soft-capped too: Note [Soft-capped scores
        in the kernels] in ``backends/triton_kernels/device.py``)."""
        return bool(self.plan.local) and self.kernel.runs_plan

    def _span_forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, list[KeyBlock | None], list[Any]]:
        """Every spanning branch, merged per cell (Note [Spanning results stay compact]):
        ``out`` (B, M, D) and ``lse`` (B, M) float32 over ``plan.q_cells`` (``-inf`` where no
        key), each branch's gathered rows and each kernel call's ``aux``."""
        acc = accumulator_dtype(q.dtype)
        batch, _, _, dim = q.shape
        assert self.plan.q_cells is not None
        cells = self.plan.q_cells.rows.numel()
        out = torch.zeros(batch, cells, dim, dtype=acc, device=q.device)
        lse = torch.full((batch, cells), float("-inf"), dtype=acc, device=q.device)
        traffic = _Spans(self.plan, self.setup, local=(k, v, mask))
        auxes, kept = ring_forward(q, traffic, self._step_kernel, out, lse, keep=True)
        return out, lse, kept, auxes

    def _span_backward(
        self, b: Backward, kept: tuple[KeyBlock, ...], auxes: list[Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every spanning branch's gradients, compact: ``dq`` (B, M, D) over ``plan.q_cells``
        and ``dkv`` (2, B, K, D) over ``plan.kv_cells``, float32; each rank's share of dK/dV
        is sent straight back to it (Note [Local and spanning branches])."""
        dout, q, out, lse = b.dout, b.q, b.out, b.lse
        plan, acc = self.plan, accumulator_dtype(q.dtype)
        assert plan.q_cells is not None and plan.kv_cells is not None
        batch, _, _, dim = q.shape
        dq = torch.zeros(batch, plan.q_cells.rows.numel(), dim, dtype=acc, device=q.device)
        dkv = torch.zeros(2, batch, plan.kv_cells.rows.numel(), dim, dtype=acc, device=q.device)
        traffic = _Spans(plan, self.setup, kept=kept, dkv=dkv)
        ring_backward(dout, q, out, row_lse(lse), traffic, self._step_kernel, auxes, dq)
        return dq, dkv

    def forward(self, x: Inputs) -> Forward:
        q, k, v, key_padding_mask = x
        plan, setup, kernel = self.plan, self.setup, self.kernel
        backend = kernel.backend
        acc = accumulator_dtype(q.dtype)
        batch, n, heads, dim = q.shape
        auxes: list[Any] = []
        merge: Any = None
        # Run when the engine first asks for them (Note [Spanning results stay compact])
        spans = functools.cache(functools.partial(self._span_forward, q, k, v, key_padding_mask))
        if plan.spans:

            def merge(out: torch.Tensor, lse: torch.Tensor, *block: int) -> None:
                cell_out, cell_lse, _, _ = spans()
                merge_cells(plan.q_cells, cell_out, cell_lse, out, lse, *block)

        if self._fused:
            out, lse = fused_forward(
                q, k, v, key_padding_mask, plan.local_branches, backend,
                is_causal=setup.is_causal, scale=setup.scale, extra=merge,
                first_head=plan.first_head, softcap=self.softcap,
            )  # fmt: skip
        else:
            in_slots = None
            if plan.local:
                # the spanning results as a slot the merge reads, else merged into a float32
                # output (the engine's own dtype without spanning branches)
                local = local_plan(plan.local, q, k, setup, backend)
                if merge is not None:
                    in_slots = spanning_results(plan, local, q, spans)
                out, lse, auxes = plan_forward(
                    q, k, v, key_padding_mask, local, self._local_kernel,
                    out_dtype=acc if merge and not in_slots else None, extra=in_slots,
                )  # fmt: skip
            else:
                out = torch.zeros(batch, n, heads, dim, dtype=acc, device=q.device)
                lse = torch.full((batch, heads, n), float("-inf"), dtype=acc, device=q.device)
            if merge is not None and in_slots is None:
                merge(out, lse, 0, n, 0, heads)
            out = out.to(q.dtype)
        kept, span_auxes = spans()[2:] if plan.spans else ([], [])
        masks = [block.mask for block in kept]  # bytes, never differentiated
        saved = (k, v, key_padding_mask, *(block.kv for block in kept))
        return Forward(out, lse, saved=saved, state=(auxes, span_auxes, masks))

    def backward(self, b: Backward) -> Grads:
        dout, q, out, lse, saved, state = b
        k, v, key_padding_mask, *gathered_rows = saved
        auxes, span_auxes, masks = state
        kept = tuple(KeyBlock(*g) for g in zip(gathered_rows, masks, strict=True))
        plan, setup, backend = self.plan, self.setup, self.kernel.backend
        acc = accumulator_dtype(q.dtype)
        heads, group = q.shape[2], q.shape[2] // k.shape[2]
        b = b._replace(dout=dout.contiguous())
        add: Any = None
        # Run when the engine first asks for them (Note [Spanning results stay compact])
        spans = functools.cache(functools.partial(self._span_backward, b, kept, span_auxes))
        if plan.spans:

            def add(
                dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, start: int, end: int,
                h0: int, h1: int, rows: slice = slice(None),
            ) -> None:  # fmt: skip
                cell_dq, cell_dkv = spans()
                add_cells(plan.q_cells, cell_dq[rows], dq, start, end, h0, h1)
                for grad, cell_grad in zip((dk, dv), cell_dkv[:, rows], strict=True):
                    add_cells(plan.kv_cells, cell_grad, grad, start, end, h0 // group,
                              h1 // group)  # fmt: skip

        if self._fused:
            return fused_backward(
                b.dout, q, k, v, out, lse, key_padding_mask, plan.local_branches, backend,
                is_causal=setup.is_causal, scale=setup.scale, extra=add,
                first_head=plan.first_head, softcap=self.softcap,
            )  # fmt: skip
        if plan.local:
            local = local_plan(plan.local, q, k, setup, backend)
            extra: Any = None
            if add is not None:  # per position group where the plan is cut
                local = grouped_plan(local, q, _segment_lengths(plan), True, k.shape[2])
                extra = spanning_slots(plan, local, q, k, spans) or functools.partial(
                    _by_rows, add, heads
                )
            return plan_backward(
                b.dout, q, k, v, out, lse, key_padding_mask, local, self._local_kernel, auxes,
                extra=extra,
            )  # fmt: skip
        dq, dk, dv = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (q, k, v))
        if add is not None:
            add(dq, dk, dv, 0, q.shape[1], 0, heads)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _by_rows(
    add: Callable[..., None], heads: int, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
    start: int, end: int, rows: slice,
) -> None:  # fmt: skip
    """The executor's ``ExtraGradients`` of the spanning branches' ``add``: every head."""
    add(dq, dk, dv, start, end, 0, heads, rows)


def _segment_lengths(plan: DilatedRingPlan) -> tuple[int, ...]:
    """The local branches' segment lengths (where the executor's plan may be cut)."""
    return tuple(w for w, _ in plan.local_branches)


@eager_only("ring_dilated_attention")  # torch.compile runs it eagerly; torch.func raises
def ring_dilated_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segment_lengths: list[int] | tuple[int, ...],
    dilation_rates: list[int] | tuple[int, ...],
    *,
    group: dist.ProcessGroup | ContextParallel | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    layout: str = "contiguous",
    backend: str | None = None,
    return_lse: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | list[int] | None = None,
    window_size: tuple[int, int] | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact dilated attention over a sequence sharded across ``group``: this rank's shard of
    ``dilated_attention`` on the gathered sequence (Note [Local and spanning branches]).

    Args:
        query: (B, n, H, D) this rank's shard; key, value: (B, n, Hkv, D).
        segment_lengths, dilation_rates: the branches, over global positions.
        group, is_causal, scale, layout, backend, return_lse, key_padding_mask: as in
            ``ring_attention`` (the mask is this rank's (B, n) shard).
        cu_seqlens: packed documents of the whole row (B = 1), each segmented from its own
            first token, as in ``dilated_attention`` (Note [Packed documents across ranks] in
            ``packed_ring.py``: every key head of the positions a rank's calls read travels).
        window_size: ``(left, right)``: one more branch, a local window over global positions,
            joined to the others as in ``dilated_attention`` (Note [A local window as a
            branch] in ``resolve/windows.py``); only its halo travels (Note [Halo exchange] in
            ``halo.py``).
        softcap, sinks: as in ``ring_attention`` (soft-capped scores in every branch; the
            sinks counted once in the denominator of the union of the branches).

    Returns:
        ``out`` (B, n, H, D), or ``(out, lse)`` with ``lse`` (B, H, n); exact gradients for the
        local q, k, v. A batch of 0 (or 0 heads) gives empty tensors, as in one process.

    Raises:
        ValueError: on every rank, before other communication, for malformed or mismatched inputs
            or grad modes (as in ``ring_attention``, which also says what the timeout is for).
    """
    schedule = functools.partial(Schedule, segment_lengths, dilation_rates)
    options = dict(is_causal=is_causal, scale=scale, backend=backend, window_size=window_size,
                   softcap=softcap)  # fmt: skip
    if isinstance(group, ContextParallel):
        refuse_documents(cu_seqlens, group)
        out, lse = split_call(
            group, layout, query, key, value, key_padding_mask,
            local=functools.partial(_local_heads, schedule, sinks=sinks, **options),
            ring=functools.partial(_ring_shard, schedule, layout=layout, sinks=sinks, **options),
            what="ring_dilated_attention",
            options=lambda: (schedule(), _checked(is_causal, scale, backend),
                             *score_options(window_size, softcap, sinks, query)),
        )  # fmt: skip
        return (out, lse) if return_lse else out
    # The dilated ring has no comm option: its calls keep RingArgs' default, with documents or
    # without, so that the ranks' agreement compares only what the caller passed.
    args = RingArgs(
        query, key, value, group=group, layout=layout, key_padding_mask=key_padding_mask,
        cu_seqlens=cu_seqlens, sinks=sinks, **options,  # type: ignore[arg-type]
    )  # fmt: skip
    out, lse = _ring_dilated(args, schedule, 0)
    return (out, lse) if return_lse else out


def _ring_dilated(
    args: RingArgs, schedule: Callable[[], Schedule], first_head: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring dilated attention of checked-on-every-rank ``args`` (the agreement runs here),
    head ``h`` being layer head ``first_head + h`` (Note [Heads from a later layer head]):
    packed documents on the packed ring's dense per-step kernel, and a local window as one more
    branch over its halo."""
    packed = args.cu_seqlens is not None
    ring = prepare_ring(args, RingOperation(DENSE if packed else DILATED, schedule))
    q, k, v, setup = ring.q, ring.k, ring.v, ring.setup
    if ring.empty:  # batch 0 or 0 heads, agreed on every rank: as in one process
        return ring.empty_result()
    assert isinstance(ring.schedule, Schedule)
    runner: Runner
    if packed:
        runner = packed_runner(ring)
    else:
        layout_of = ring.schedule.at(setup.world_size * q.shape[1], q.shape[2], k.shape[2],
                                     first_head)  # fmt: skip
        plan = plan_ring_dilated(setup, layout_of.sharded(setup.world_size, setup.chunk_len),
                                 q.device)  # fmt: skip
        runner = RingDilatedRunner(plan, setup, ring.kernel, softcap=ring.softcap)
    if ring.window is not None:
        runner = UnionRunner(runner, windowed_runner(ring, _MESSAGE), _MESSAGE)
    mask = args.key_padding_mask
    mask = None if mask is None else mask.contiguous()  # type: ignore[attr-defined]
    k, v = hide_masked_keys(k, v, mask)  # Note [Hidden keys cannot poison rows]
    return run_attention(q, k, v, mask, runner, ring.sinks)


def _checked(is_causal: object, scale: object, backend: object) -> tuple[object, ...]:
    """The call's options, checked as one process checks them."""
    V.check_bool("is_causal", is_causal)
    return is_causal, V.check_scale(scale), check_backend_name(backend)  # type: ignore[arg-type]


def _local_heads(
    schedule: Callable[[], Schedule],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    first: int,
    *,
    is_causal: object,
    scale: object,
    backend: str | None,
    window_size: object,
    softcap: object,
    sinks: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dilated attention over the whole sequence of this rank's heads after a head all-to-all,
    from layer head ``first`` (Note [Heads from a later layer head]), with their sinks."""
    own = heads_sinks(sinks, first, q)
    request = Request.of(
        DILATED, q, k, v, is_causal=is_causal, has_mask=mask is not None,
        scale=V.check_scale(scale), backend=check_backend_name(backend), schedule=schedule(),
        first_head=first, window=V.check_window_size(window_size),
        softcap=V.check_softcap(softcap), sinks=own is not None,
    )  # fmt: skip
    return execute(request, q, k, v, mask, own)


def _ring_shard(
    schedule: Callable[[], Schedule],
    group: dist.ProcessGroup,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    first: int,
    *,
    sinks: torch.Tensor | None,
    **options: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring dilated attention over the ring group of a context-parallel call, this rank's heads
    from layer head ``first`` with their sinks."""
    args = RingArgs(q, k, v, group=group, key_padding_mask=mask,
                    sinks=heads_sinks(sinks, first, q), **options)  # fmt: skip
    return _ring_dilated(args, schedule, first)
