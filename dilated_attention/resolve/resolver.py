"""The resolve step: one :class:`Request` in, one :class:`Strategy` out.

Note [One resolve step]
    Every public call is validate -> resolve -> run. The public function checks its arguments
    and describes the call as a :class:`Request` (plain values: operation, shapes, dtype,
    device, flags, schedule or pattern, gradient needs, a kernel asked for by name);
    :func:`resolve` makes every decision about it in one place: which kernel of which registry
    (the registries only say what each kernel can run and in which order they are tried), and
    how the work is cut into kernel calls; :meth:`Strategy.run` runs it under the one autograd
    Function. ``explain()`` and ``python -m dilated_attention info`` describe the same strategy
    (:meth:`Strategy.describe`), the custom operators of ``compiled/`` run it, and the ring
    asks it for the kernel of its steps. A new operation, kernel family or mask kind is one
    resolver here (and a kernel in ``backends/``), not a change in every public function.
    Packed documents and decoding caches are part of the request too, and the public
    functions hand every call to one route: a packed batch resolves as one row around which
    it is flattened (Note [Packed documents as one row] in ``packed.py``), a cache call as the
    keys it reads inside a strategy that joins them with the cache (Note [A cache call is one
    request] in ``caches.py``).

Note [Dense fallback]
    A pattern whose block mask keeps every block pair (every pair at or below the diagonal when
    causal) is dense attention, with the same causal mask: the block-sparse request resolves to
    the dense one (cuDNN on an H100) instead of a block-sparse kernel. FlexAttention walking
    every tile runs at about 0.7x of dense cuDNN (H100, N = 262,144: 0.64x forward, 0.71x
    forward+backward; ``benchmarks/results/block_sparse_long_h100.json``), and the plan would
    split the work into many calls. Only ``backend="flex"`` (by argument, ``use_backend`` or
    the environment) keeps FlexAttention at full density.

Note [End-aligned causal blocks]
    A causal block-sparse query shorter than the key holds the last ``Nq`` of the ``Nk``
    positions, as in dense and dilated attention: query row ``i`` is position
    ``p = Nk - Nq + i``, in block ``p // block_size``, and sees key ``t`` when the pattern keeps
    ``(p // block_size, t // block_size)`` and ``t <= p``. The pattern is asked for the square
    block mask of the ``Nk`` positions. The plan computes exactly those rows (every causal call
    it makes is square, so any dense kernel runs it). FlashAttention-4's block sparsity, our
    block-sparse Triton kernels and FlexAttention take a top-left causal mask over the query
    rows they are given, so such a call never goes to them: chosen automatically it runs the
    plan, and naming one of them raises ``ValueError`` before any work.

Shape legend: B batch, Nq query rows, Nk key rows, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import replace

import torch

from .. import _validation as V
from ..backends.base import KernelInputs
from ..backends.priority_rules import float32_share_beside_spanning, puts_slots_first
from ..backends.registry import BLOCK_SPARSE as BLOCK_SPARSE_REGISTRY
from ..backends.registry import DENSE as DENSE_REGISTRY
from ..backends.registry import DILATED as DILATED_REGISTRY
from ..backends.registry import Selection, _requested, generation, registry_for
from ..block_sparse import plan as block_plan
from ..core.contract import Window
from ..core.decoding import decode
from ..core.geometry.calls import WholeCall
from ..core.geometry.documents import document_groups
from ..core.geometry.grouped import grouped_plan, slot_group_length
from ..core.geometry.plan import Plan
from ..core.geometry.schedule import ShardedBranches
from ..core.geometry.segment import branch_plan, describe_plan, dilated_plan, effective_branches
from ..core.geometry.slots import Slot
from ..patterns import Pattern
from .block_masks import refuse_end_aligned_kernels, runtime_blocks
from .caches import cache_call, static_branches
from .decoding import decode_call, fused_notes
from .packed import packed_call
from .request import BLOCK_SPARSE, DECODE, DENSE, DILATED, OPERATIONS, Request, forget_requests
from .request import kernel_inputs as _kernel_inputs
from .strategy import (
    BlockSparseKernelStrategy,
    EmptyStrategy,
    FusedStrategy,
    KernelOnlyStrategy,
    PlanStrategy,
    Strategy,
)
from .windows import packed_windows, windowed_dilated

__all__ = ["clear_resolved", "execute", "keeps_every_pair", "resolve", "static_branches"]

#: Strategies already resolved: (request, the backend asked for by name and from where, the
#: registry's generation) -> strategy (Note [Resolved once per request]).
_RESOLVED: dict[tuple[object, ...], Strategy] = {}
#: Requests remembered at most; the oldest is dropped first.
RESOLVED_LIMIT = 512


@torch.compiler.disable  # selection probes kernels and caches: run it eagerly, never traced
def resolve(request: Request) -> Strategy:
    """The strategy that runs ``request`` (Note [One resolve step]), resolved once per request.

    Note [Resolved once per request]
        A strategy depends on the request (plain values), on the kernel asked for by name
        (the argument, :func:`~dilated_attention.use_backend` or the environment) and on the
        registered kernels, whose probes and priority tables are cached for the process.
        So each strategy is kept under those three (``registry.generation()`` changes when a
        kernel is registered) and a later call with the same request takes it at the cost of
        one dictionary lookup: at short lengths the choice alone (the registry walking the
        priority list, asking every kernel for its reasons) cost more host time than the
        kernels' launches. :func:`clear_resolved` forgets them (tests that change a kernel's
        reasons mid-process). The eager route (:func:`execute`) looks a kept strategy up
        itself, under the same key, and calls this function only when there is none:
        ``resolve`` runs outside any trace (``torch.compiler.disable``), and switching frames
        for that on every call cost host time though ``execute`` is never traced (a strategy
        is kept only once resolved, so a request that fails this function's checks is never
        found there).

    Raises:
        ValueError: ``request.operation`` is unknown; a kernel asked for by name cannot run the
            request, or none can (the message lists every kernel with its reasons); a
            ``Custom`` block-sparse mask of another block count.
    """
    if request.operation not in _RESOLVERS:
        raise ValueError(f"operation must be one of {OPERATIONS}, got {request.operation!r}")
    sliced = request.first_head != 0
    if sliced and (request.operation != DILATED or request.documents or request.shard):
        raise ValueError(
            f"first_head={request.first_head}: a call on a slice of a layer's heads is "
            f"dilated attention over one sequence per row only, got a {request.operation} call"
            f"{' on packed documents' if request.documents else ''}"
            f"{' over a sharded sequence' if request.shard else ''}"
        )
    key = _resolved_key(request)
    strategy = _RESOLVED.get(key)
    if strategy is None:
        strategy = _resolve(request)
        if len(_RESOLVED) >= RESOLVED_LIMIT:
            del _RESOLVED[next(iter(_RESOLVED))]
        _RESOLVED[key] = strategy
    return strategy


def _resolved_key(request: Request) -> tuple[object, ...]:
    """What a strategy is kept under (Note [Resolved once per request])."""
    return (request, _requested(request.backend), generation())


def _resolve(request: Request) -> Strategy:
    """A cache call around the strategy of the keys it reads (Note [A cache call is one
    request] in ``caches.py``), a packed batch around its row's (Note [Packed documents as one
    row] in ``packed.py``), else the operation's resolver."""
    if request.cache is not None:
        return cache_call(request, _resolve)
    if request.documents is not None and request.block_mask is None:  # a mask's blocks: rows'
        return packed_call(request, lambda row: _RESOLVERS[row.operation](row))
    return _RESOLVERS[request.operation](request)


def clear_resolved() -> None:
    """Forget every resolved strategy (Note [Resolved once per request]) and every kept request
    (Note [One request per description] in ``request.py``)."""
    _RESOLVED.clear()
    forget_requests()


def execute(
    request: Request,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    sinks: torch.Tensor | None = None,
    cache: object = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Resolve and run a checked call: q (B, Nq, H, D), k and v (B, Nk, Hkv, D), the call's
    mask tensor (Note [The call's mask tensor]: a key padding mask (B, Nk) bool, a run-time
    block mask, or None), sinks (H,) or None, the decoding cache the request names (or None)
    -> ``(out, lse)``, out (B, Nq, H, D), lse (B, H, Nq). Keys a key padding mask hides are
    zeroed first (Note [Hidden keys cannot poison rows]); ``Strategy.call``. A strategy
    already kept is taken without :func:`resolve` (Note [Resolved once per request]): this runs
    eagerly only, ``compiled.route`` sending traced calls to the custom operators, whose
    implementations run eagerly."""
    return kept_or_resolved(request).call(q, k, v, mask, sinks, cache)


def kept_or_resolved(request: Request) -> Strategy:
    """The strategy kept for ``request``, else :func:`resolve`'s (Note [Resolved once per
    request]): for eager code only (a custom operator's implementation, :func:`execute`), which
    a kept strategy spares the frame switch of :func:`resolve`'s ``torch.compiler.disable``."""
    strategy = _RESOLVED.get(_resolved_key(request))
    return resolve(request) if strategy is None else strategy


def _dense(request: Request) -> Strategy:
    """One dense call; a causal query shorter than the key (end-aligned) as a call without a
    mask and a square causal call (``decode.dense_decode_plan``), the kernel chosen for those.
    A local window runs in the calls' kernel (Note [Local windows, soft-capping and sinks])."""
    nq, nk, window = request.query_len, request.key_len, request.window
    if request.documents is not None:
        if window is not None:
            return packed_windows(request)
        return _packed(request, (nq,), (1,), DENSE_REGISTRY, "attention")  # one branch (N, 1)
    end_aligned = request.is_causal and nq < nk
    inputs = _kernel_inputs(request, key_len=nq if end_aligned else None)
    kernel = registry_for(DENSE_REGISTRY).select(inputs, request.backend)
    if end_aligned:
        plan = decode.dense_decode_plan(nq, nk, window)
        how = (
            f"the keys before the query in one call, then one square causal call of "
            f"{V.counted(nq, 'row')}"
        )
        if window is not None:
            how = (
                f"one call of the {V.counted(nq, 'query', 'queries')} over the keys their local "
                f"window {window} reaches"
            )
    else:  # a window places the queries at the last positions of the keys
        plan = Plan((WholeCall(request.is_causal, None if window is None else Window(*window)),))
        how = "one dense call" + ("" if window is None else f" in a local window {window}")
    recorded = _recorded(request, kernel)
    if recorded:
        how += ", recorded by torch's autograd when run eagerly"
    return PlanStrategy(
        request, kernel, DENSE_REGISTRY, inputs, how, plan=plan, what="attention",
        recorded=recorded,
    )  # fmt: skip


def _recorded(request: Request, kernel: Selection) -> bool:
    """Whether a dense training call runs its kernel's op as torch's autograd records it (Note
    [Dense calls on torch's autograd] in ``core/higher_order.py``): one call with nothing
    around it (no mask, window, soft-cap, sinks or dropout, square when causal; packed
    documents never reach here) of at least
    the kernel's ``min_rows`` rows, its key/value heads as the op takes them (the node's
    inputs are the call's q, k and v), on a kernel that ``records_autograd``."""
    r, backend = request, kernel.backend
    plain = not (
        r.has_mask or r.window is not None or r.softcap is not None or r.sinks or r.dropout_p
        or (r.is_causal and r.query_len != r.key_len)
    )  # fmt: skip
    rows = min(r.query_len, r.key_len) >= backend.min_rows
    heads = backend.native_gqa or r.num_heads == r.num_kv_heads
    return r.requires_grad and plain and rows and heads and backend.records_autograd


def _dilated(request: Request) -> Strategy:
    """Our fused kernels over every branch, or the executor's plan of branch calls: gathered,
    as strided views, or written into slots merged once (Note [Branch slots merged once])."""
    if request.schedule is None:  # explain() of a kernel call's shape: the registry's answer
        inputs = _kernel_inputs(request)
        kernel = registry_for(DILATED_REGISTRY).select(inputs, request.backend)
        return KernelOnlyStrategy(request, kernel, DILATED_REGISTRY, inputs, _summary(kernel))
    if request.shard is not None:
        return _shard(request)
    if request.window is not None:
        return windowed_dilated(request)
    if request.documents is not None:
        schedule = request.schedule
        return _packed(
            request, schedule.segment_lengths, schedule.dilation_rates, DILATED_REGISTRY,
            "dilated_attention",
        )  # fmt: skip
    layout = request.schedule.at(
        request.query_len, request.num_heads, request.num_kv_heads, request.first_head
    )
    inputs = _kernel_inputs(request, branch_slots=layout.in_slots)
    kernel = registry_for(DILATED_REGISTRY).select(inputs, request.backend)
    if kernel.runs_plan:  # the fused kernels run every branch themselves (core/execution/fused.py)
        notes = fused_notes(kernel.backend.name, layout.branches)
        return FusedStrategy(
            request, kernel, DILATED_REGISTRY, inputs, _summary(kernel), notes, layout.branches,
            layout.first_head,
        )  # fmt: skip
    strided, writes = kernel.backend.reads_strided_rows, kernel.backend.writes_into
    hkv, causal = request.num_kv_heads, request.is_causal
    branches = branch_plan(
        layout.groups, request.query_len, hkv, request.device, causal, strided, writes
    )
    plan_of = functools.partial(
        grouped_plan, branches, segment_lengths=layout.segment_lengths,
        needs_grad=request.requires_grad, kv_heads=hkv,
    )  # fmt: skip
    notes = describe_plan(layout.groups, request.query_len, hkv, strided, writes)
    how = "the executor's plan of branch calls on this kernel, merged by log-sum-exp"
    return PlanStrategy(
        request, kernel, DILATED_REGISTRY, inputs, how, notes, plan_of=plan_of,
        what="dilated_attention",
    )  # fmt: skip


def _shard(request: Request) -> Strategy:
    """One rank's shard of ring dilated attention (``request.shard``): the kernel for its local
    branches, told whether they write into branch slots (``ScheduleLayout.sharded``). The ring
    runs them and the spanning branches itself (Note [Local and spanning branches] in
    ``distributed/rings/ring_dilated.py``); this strategy names its kernel and runs nothing."""
    assert request.schedule is not None and request.shard is not None
    world, chunk = request.shard
    heads, kv_heads = request.num_heads, request.num_kv_heads
    split = request.schedule.at(world * request.query_len, heads, kv_heads).sharded(world, chunk)
    inputs = _kernel_inputs(request, branch_slots=split.in_slots)
    too_large = _float32_beside_spans(request, split, inputs)
    inputs = replace(inputs, branch_slots=split.in_slots and too_large is None)
    kernel = registry_for(DILATED_REGISTRY).select(inputs, request.backend)
    notes = tuple(f"w={w} r={r}: local, inside one chunk of {chunk}" for w, r in split.local)
    notes += tuple(f"w={w} r={r}: spans ranks, its rows exchanged" for w, r in split.spanning)
    notes += (too_large,) if too_large else ()
    how = (
        f"ring dilated attention, {V.counted(world, 'rank')} of "
        f"{V.counted(request.query_len, 'position')}: the local "
        "branches on this kernel, the spanning branches' calls on its backend"
    )
    return KernelOnlyStrategy(request, kernel, DILATED_REGISTRY, inputs, how, notes)


def _float32_beside_spans(
    request: Request, split: ShardedBranches, inputs: KernelInputs
) -> str | None:
    """Why the automatic choice should not put a kernel that writes into branch slots first for
    a shard's local branches (``inputs``), or None: where it would, beside spanning branches.

    Such a kernel merges the spanning results into a float32 ``out`` (B, n, H, D) of the whole
    shard in the forward, and its gradients into float32 scratch of one position group where
    the local branches' slots can be cut into groups (Note [Spanning results stay compact] in
    ``distributed/rings/ring_dilated.py``), else into float32 ``dq``, ``dk``, ``dv`` of the whole
    shard; our fused kernels keep one head group's float32 scratch. The larger whole-shard
    result may take the device's ``float32_share_beside_spanning`` of its memory
    (``priorities.json``)."""
    if not split.spanning or request.backend is not None or not puts_slots_first(inputs):
        return None
    share = float32_share_beside_spanning(request.device)
    if share is None:
        return None
    heads = request.num_heads  # out; the gradients of the whole shard where they are not cut
    slots = tuple(Slot(w, r) for w, r in split.local)
    if request.requires_grad and slot_group_length(slots, request.query_len, 1) is None:
        heads += 2 * request.num_kv_heads
    need = 4 * request.batch * request.query_len * heads * request.head_dim
    total = torch.cuda.get_device_properties(request.device).total_memory
    if need <= share * total:
        return None
    return (
        f"kernels writing into branch slots not put first: beside the spanning branches they "
        f"hold the shard's float32 results ({need / 2**30:.1f} GiB), over {share:.0%} of the "
        f"device's {total / 2**30:.0f} GiB"
    )


def _packed(
    request: Request,
    segment_lengths: tuple[int, ...],
    dilation_rates: tuple[int, ...],
    operation: str,
    what: str,
) -> Strategy:
    """Packed documents (Note [Packed documents]): our fused kernels over every document's
    segments at once (Note [Packed documents in the fused engine] in
    ``core/execution/packed_spans.py``), or every document's row groups, where it starts, as the
    executor's plan on the operation's kernel."""
    documents = request.documents
    assert documents is not None
    inputs = _kernel_inputs(request)
    kernel = registry_for(operation).select(inputs, request.backend)
    count = len(documents) - 1
    if kernel.runs_plan:
        longest = max(b - a for a, b in itertools.pairwise(documents))
        segs, rates = effective_branches(
            longest, request.num_heads, segment_lengths, dilation_rates
        )
        branches = tuple(zip(segs, rates, strict=True))
        notes = (f"{count} packed documents, each segmented from its own first token: one "
                 f"launch per branch and position group, segments read from a table",
                 *fused_notes(kernel.backend.name, branches))  # fmt: skip
        return FusedStrategy(request, kernel, operation, inputs, _summary(kernel), notes, branches)
    groups = document_groups(documents, request.num_heads, segment_lengths, dilation_rates)
    plan = dilated_plan(
        groups, request.query_len, request.num_kv_heads, request.device, request.is_causal
    )
    notes = (f"{count} packed documents, each segmented from its own first token: "
             f"{len(plan.calls)} kernel calls",)  # fmt: skip
    how = "the executor's plan of every document's calls on this kernel, merged by log-sum-exp"
    return PlanStrategy(request, kernel, operation, inputs, how, notes, plan=plan, what=what)


def keeps_every_pair(mask: torch.Tensor, is_causal: bool) -> bool:
    """Whether the block mask keeps every block pair the causal mask (when causal) leaves.

    Then block-sparse attention IS dense attention (causal when causal), and the dense kernel
    computes it exactly and faster than a sparse kernel walking every block. ``mask``: square
    when causal (the blocks of the key positions, Note [End-aligned causal blocks]).
    """
    if is_causal:
        mask = mask | ~torch.ones_like(mask).tril()
    return bool(mask.all())


@functools.lru_cache(maxsize=16)
def _is_dense(pattern: Pattern, nq: int, nk: int, is_causal: bool) -> bool:
    """``keeps_every_pair`` of the pattern's mask, kept per call shape (milliseconds at 256K
    tokens on a CPU, for an answer that never changes)."""
    return keeps_every_pair(pattern.block_mask(nq, nk), is_causal)


def _block_sparse(request: Request) -> Strategy:
    """The dense call where the pattern keeps every pair (Note [Dense fallback]); else, on
    CUDA, one of the operation's own kernels (FlashAttention-4's block sparsity, our Triton
    kernels, FlexAttention) where it runs, else the plan of the kept blocks on a dense kernel
    (Note [Block-sparse plan]); an end-aligned causal query always runs the plan (Note
    [End-aligned causal blocks])."""
    pattern, size = request.pattern, request.block_size
    if request.block_mask is not None:  # Note [Run-time block masks]
        return runtime_blocks(request)
    if pattern is None:  # explain() of a kernel call's shape: the registry's answer
        inputs = _kernel_inputs(request, block_size=size)
        kernel = registry_for(BLOCK_SPARSE_REGISTRY).select(inputs, request.backend)
        return KernelOnlyStrategy(
            request, kernel, BLOCK_SPARSE_REGISTRY, inputs, _summary(kernel, BLOCK_SPARSE)
        )
    if request.documents is not None:
        return _packed_blocks(request)
    nq, nk, causal = request.query_len, request.key_len, request.is_causal
    query_start = nk - nq if causal else 0
    # Ask the pattern first: a Custom mask of the wrong size fails before any kernel work.
    rows = block_plan.num_blocks(nk if causal else nq, size)
    if _is_dense(pattern, rows, block_plan.num_blocks(nk, size), causal) and (
        _requested(request.backend)[0] != "flex"
    ):
        dense = _dense(replace(request, operation=DENSE, pattern=None))
        how = f"the pattern keeps every block pair: dense attention ({dense.how})"
        return replace(dense, how=how)
    if request.empty:
        return EmptyStrategy(request, None, BLOCK_SPARSE_REGISTRY, None, "no query rows")
    if query_start:
        return _end_aligned_blocks(request, query_start)
    inputs = _kernel_inputs(request, block_size=size)
    kernel = registry_for(BLOCK_SPARSE_REGISTRY).select(inputs, request.backend)
    if kernel.runs_plan:
        return BlockSparseKernelStrategy(
            request, kernel, BLOCK_SPARSE_REGISTRY, inputs, _summary(kernel, BLOCK_SPARSE)
        )
    return _block_plan(request, kernel, inputs, BLOCK_SPARSE_REGISTRY, 0)


def _end_aligned_blocks(request: Request, query_start: int) -> Strategy:
    """The plan of an end-aligned causal block-sparse call on the dense kernel chosen for its
    square causal calls; a block-sparse kernel asked for by name raises ``ValueError``."""
    refuse_end_aligned_kernels(request)
    inputs = _kernel_inputs(request, key_len=request.query_len, is_causal=True)
    kernel = registry_for(DENSE_REGISTRY).select(inputs, request.backend)
    return _block_plan(request, kernel, inputs, DENSE_REGISTRY, query_start)


def _packed_blocks(request: Request) -> Strategy:
    """Packed documents: each document's kept blocks, counted from its own first token, as
    stacked calls on a dense kernel (Note [Packed documents])."""
    assert request.pattern is not None and request.documents is not None
    inputs = _kernel_inputs(request, block_size=request.block_size)
    kernel = registry_for(BLOCK_SPARSE_REGISTRY).select(inputs, request.backend)
    calls = block_plan.document_calls(
        request.pattern, request.block_size, request.documents, request.is_causal,
        request.device,
    )  # fmt: skip
    notes = (f"{len(request.documents) - 1} packed documents, blocks from each one's first "
             f"token: {len(calls)} kernel calls",)  # fmt: skip
    how = "every document's kept blocks as stacked calls on this dense kernel"
    return PlanStrategy(
        request, kernel, BLOCK_SPARSE_REGISTRY, inputs, how, notes, plan=Plan(calls),
        what="block_sparse_attention",
    )  # fmt: skip


def _block_plan(
    request: Request, kernel: Selection, inputs: object, operation: str, query_start: int
) -> Strategy:
    """The pattern's kept blocks as stacked calls on the dense kernel ``kernel``."""
    assert request.pattern is not None
    shape = (request.pattern, request.block_size, request.query_len, request.key_len)
    budget = max(request.key_len, block_plan.MIN_KV_ROWS_PER_CALL)

    def plan_of(q: torch.Tensor) -> Plan:
        calls, _ = block_plan._local_plan(*shape, request.is_causal, q.device, budget, query_start)
        return Plan(tuple(calls))

    how = "the kept blocks as stacked calls on this dense kernel (Note [Block-sparse plan])"
    return PlanStrategy(
        request, kernel, operation, inputs, how, plan_of=plan_of,  # type: ignore[arg-type]
        what="block_sparse_attention",
    )  # fmt: skip


def _summary(kernel: Selection, operation: str = DILATED) -> str:
    """What a plan kernel runs, from its registry; the executor's role otherwise."""
    registry = registry_for(DILATED_REGISTRY if operation == DILATED else BLOCK_SPARSE_REGISTRY)
    if kernel.runs_plan:
        return registry.plan_kernels[kernel.backend.name].summary
    return "once per kernel call of the plan"


_RESOLVERS = {
    DENSE: _dense,
    DILATED: _dilated,
    DECODE: decode_call,
    BLOCK_SPARSE: _block_sparse,
}
