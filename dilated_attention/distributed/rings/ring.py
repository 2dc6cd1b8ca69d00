"""Ring attention: exact attention over a sequence sharded across the ranks of a process group.

Note [Ring schedule]
    Each rank keeps its queries and passes its key/value block around the ring: at step ``s`` rank
    ``r`` holds the block of rank ``r - s`` while the next one is already in flight
    (``dist.batch_isend_irecv``). Per step, every (query chunk, key chunk) pair is full, causal (the
    same chunk) or empty (a later chunk, under a causal mask); empty pairs cost nothing, and pairs
    are fused into as few kernel calls as the slices allow. Results merge in float32 through their
    log-sum-exp (Note [Merging partial softmaxes]).

    The backward passes the blocks again; each rank computes its dK/dV parts for a block with
    the *final* ``out``/``lse`` (Note [Backward with external statistics]) and sends them
    straight to the block's owner while the next step computes (Note [Gradients go home]).
    ``comm="allgather"`` instead gathers every block at once (Llama-3 style) and sends all parts
    home at the end. A key padding mask travels with its keys (:class:`KeyBlock`): n bytes per
    block beside the block's 2 n Hkv D values. The loop is the one ring template's (Note [One
    ring template] in ``template.py``); what travels is :class:`DenseSteps`.

Shape legend: B batch, n local tokens, H query heads, Hkv key/value heads, D head dim, W ranks.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ... import _validation as V
from ...backends.registry import check_backend_name
from ...compiled import eager_only
from ...core.autograd import Runner, run_attention
from ...core.geometry.calls import SliceCall
from ...core.hidden import hide_masked_keys
from ...core.higher_order import ring_message
from ...functional import attention
from ..comm.agreement import COMMS, PreparedRing, RingArgs, prepare_ring, refuse_documents
from ..comm.collectives import exchange, ring_all_gather
from ..context import ContextParallel
from ..layout.sharding import chunks_of
from .halo import windowed_runner
from .packed_ring import packed_runner
from .template import (
    KeyBlock,
    Part,
    RingRunner,
    RingSetup,
    StepGrads,
    StepKernel,
    Traffic,
    Transit,
)
from .ulysses import heads_sinks, score_options, split_call

__all__ = ["COMMS", "DenseSteps", "pass_on", "plan_block", "ring_attention"]


def plan_block(
    my_chunks: list[int], src_chunks: list[int], chunk_len: int, is_causal: bool
) -> list[SliceCall]:
    """Kernel calls for this rank's queries against one rank's key/value block.

    Chunk pairs are full, causal (same chunk) or empty (later key chunk, causal); runs of adjacent
    chunks with the same partners are fused into one call.
    """
    calls: list[tuple[list[int], list[int], bool]] = []
    for a, cq in enumerate(my_chunks):
        full = [b for b, ck in enumerate(src_chunks) if not is_causal or ck < cq]
        diag = [b for b, ck in enumerate(src_chunks) if is_causal and ck == cq]
        for keys, causal in ((full, False), (diag, True)):
            if not keys:
                continue
            if calls and not causal and not calls[-1][2] and calls[-1][1] == keys:
                calls[-1][0].append(a)  # the previous query chunk had the same full partners
            else:
                calls.append(([a], keys, causal))
    tasks = []
    for q_chunks, kv_chunks, causal in calls:
        for run in _runs(kv_chunks):
            tasks.append(
                SliceCall(
                    q=slice(q_chunks[0] * chunk_len, (q_chunks[-1] + 1) * chunk_len),
                    kv=slice(run[0] * chunk_len, (run[-1] + 1) * chunk_len),
                    causal=causal,
                )
            )
    return tasks


def _runs(indices: list[int]) -> list[list[int]]:
    """Split sorted indices into runs of consecutive values."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][-1] + 1 == i:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def tasks_of(setup: RingSetup, rank: int, src: int) -> list[SliceCall]:
    """Rank ``rank``'s kernel calls against the key/value block of rank ``src``."""
    me = chunks_of(rank, setup.world_size, setup.layout)
    other = chunks_of(src, setup.world_size, setup.layout)
    return plan_block(me, other, setup.chunk_len, setup.is_causal)


def pass_on(block: KeyBlock, setup: RingSetup) -> Transit[KeyBlock | None]:
    """Post ``block`` to the next rank and the receive of the previous rank's block."""
    incoming = KeyBlock(*(torch.empty_like(t) for t in block.tensors()))
    pending = exchange(
        [(t, setup.next_rank) for t in block.tensors()],
        [(t, setup.prev_rank) for t in incoming.tensors()],
    )
    return Transit(pending, lambda: incoming, block.tensors())


def _add_parts(dkv: torch.Tensor, parts: list[Part]) -> None:
    """Add gradient parts into the (2, B, n, Hkv, D) accumulator ``dkv``."""
    for rows, dk, dv in parts:
        dkv[0][:, rows] += dk
        dkv[1][:, rows] += dv


def _part_tensors(parts: list[Part], peer: int) -> list[tuple[torch.Tensor, int]]:
    """``(tensor, peer)`` pairs for :func:`exchange`: each part's dK then dV."""
    return [(grad, peer) for _, dk, dv in parts for grad in (dk, dv)]


def _expected_parts(
    setup: RingSetup, sender: int, kv: torch.Tensor, dtype: torch.dtype
) -> list[Part]:
    """Empty buffers for the parts rank ``sender`` computes against this rank's block, in the
    order it sends them (its kernel calls, each dK then dV)."""
    parts = []
    for task in tasks_of(setup, sender, setup.rank):
        shape = kv[0][:, task.kv].shape  # (B, rows, Hkv, D)
        dk, dv = (torch.empty(shape, dtype=dtype, device=kv.device) for _ in range(2))
        parts.append((task.kv, dk, dv))
    return parts


@dataclass
class _Blocks:
    """One pass of dense ring attention over this rank's block ``local`` (Note [Ring
    schedule]); ``dkv`` (2, B, n, Hkv, D): its gradients' accumulators (backward).

    Note [Gradients go home]: remote dK/dV parts travel in the dtype the kernel produced them
    in (nothing is rounded) straight to the block's owner, which sums them in float32: half
    the bytes of passing float32 accumulators around the ring, and no last hop. Each rank's
    own block always has its diagonal call and is computed before any part is received, so
    the gradient dtype (``wire``) is known in time. A block this rank made no call against
    sends nothing.
    """

    setup: RingSetup
    local: KeyBlock
    dkv: torch.Tensor | None = None
    wire: torch.dtype | None = None

    @property
    def steps(self) -> int:
        return self.setup.world_size

    def src(self, step: int) -> int:
        """The rank whose block step ``step`` computes against."""
        raise NotImplementedError

    def calls(self, step: int) -> list[SliceCall]:
        return tasks_of(self.setup, self.setup.rank, self.src(step))

    def grads(self, step: int, keys: KeyBlock) -> StepGrads:
        return StepGrads()  # parts, each sent as the kernel returned it

    def _keep_own(self, grads: StepGrads | None) -> None:
        """Add the parts of this rank's own block and learn the wire dtype from them."""
        assert grads is not None and self.dkv is not None  # every rank's own block has calls
        _add_parts(self.dkv, grads.parts)
        self.wire = grads.parts[0][1].dtype

    def _arriving(self, sender: int) -> list[Part]:
        """Buffers for the parts rank ``sender`` sends for this rank's block."""
        assert self.wire is not None
        return _expected_parts(self.setup, sender, self.local.kv, self.wire)

    def _arrive(self, parts: list[Part]) -> None:
        assert self.dkv is not None
        _add_parts(self.dkv, parts)

    def finish(self) -> Transit[None]:
        return Transit.done(None)


class _Passed(_Blocks):
    """``comm="ring"``: at step s this rank holds the block of rank ``rank - s`` and passes it
    on while computing; its parts go home while the next step computes, and the parts for its
    own block computed by rank ``rank + s`` arrive meanwhile."""

    def src(self, step: int) -> int:
        return (self.setup.rank - step) % self.setup.world_size

    def fetch(self, step: int, held: KeyBlock | None) -> Transit[KeyBlock | None]:
        if step == 0:
            return Transit.done(self.local)
        assert held is not None  # every step of the dense ring holds a block
        return pass_on(held, self.setup)

    def home(self, step: int, grads: StepGrads | None) -> Transit[None]:
        if step == 0:
            self._keep_own(grads)
            return Transit.done(None)
        assert grads is not None
        setup = self.setup
        sender = (setup.rank + step) % setup.world_size
        arriving = self._arriving(sender)
        send = _part_tensors(grads.parts, setup.global_ranks[self.src(step)])
        recv = _part_tensors(arriving, setup.global_ranks[sender])
        sent = tuple(t for t, _ in send)  # alive until the send is waited on
        return Transit(exchange(send, recv), functools.partial(self._arrive, arriving), sent)


@dataclass
class _Gathered(_Blocks):
    """``comm="allgather"``: every block gathered at once, computed in rank order; all parts
    go home after the last step, in one exchange."""

    blocks: list[KeyBlock] = field(default_factory=list)
    send: list[tuple[torch.Tensor, int]] = field(default_factory=list)

    def src(self, step: int) -> int:
        return step

    def fetch(self, step: int, held: KeyBlock | None) -> Transit[KeyBlock | None]:
        if step == 0:
            setup = self.setup
            gathered = ring_all_gather(self.local.tensors(), setup.global_ranks, setup.rank)
            self.blocks = [KeyBlock(*tensors) for tensors in gathered]
        return Transit.done(self.blocks[step])

    def home(self, step: int, grads: StepGrads | None) -> Transit[None]:
        if step == self.setup.rank:
            self._keep_own(grads)
        elif grads is not None:
            self.send += _part_tensors(grads.parts, self.setup.global_ranks[step])
        return Transit.done(None)

    def finish(self) -> Transit[None]:
        setup = self.setup
        arriving: list[Part] = []
        recv: list[tuple[torch.Tensor, int]] = []
        for sender in range(setup.world_size):
            if sender != setup.rank:
                expected = self._arriving(sender)
                arriving += expected
                recv += _part_tensors(expected, setup.global_ranks[sender])
        sent = tuple(t for t, _ in self.send)
        pending = exchange(self.send, recv)
        return Transit(pending, functools.partial(self._arrive, arriving), sent)


@dataclass(frozen=True)
class DenseSteps:
    """What travels in dense ring attention (Note [Ring schedule]): whole key/value blocks,
    passed on around the ring or gathered at once (``setup.comm``), and dK/dV parts home."""

    setup: RingSetup

    def open(
        self,
        local: KeyBlock,
        dkv: torch.Tensor | None = None,
        kept: Sequence[KeyBlock | None] | None = None,
    ) -> Traffic:
        """The traffic of one pass over this rank's block (:class:`~.template.Steps`; every
        block travels again in the backward: nothing is ``kept``)."""
        kind = _Gathered if self.setup.comm == "allgather" else _Passed
        return kind(self.setup, local, dkv)


@eager_only("ring_attention")  # torch.compile runs it eagerly; torch.func raises
def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    group: dist.ProcessGroup | ContextParallel | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    layout: str = "contiguous",
    backend: str | None = None,
    return_lse: bool = False,
    comm: str = "ring",
    key_padding_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | list[int] | None = None,
    window_size: tuple[int, int] | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over a sequence sharded across ``group``; this rank's shard of the result.

    Args:
        query: (B, n, H, D) this rank's shard (``n = N / W``; see ``shard_sequence``).
        key: (B, n, Hkv, D).
        value: (B, n, Hkv, D).
        group: the process group (default: the world), or a :class:`ContextParallel` (a ring
            group and/or a head all-to-all group, Note [Context parallel groups]).
        is_causal: causal over global positions.
        scale: softmax scale; ``None`` means ``D ** -0.5``.
        layout: ``"contiguous"`` or ``"zigzag"`` (causal only), as the shards were made.
        backend: kernel name, or ``None`` for the automatic choice.
        return_lse: also return the log-sum-exp (B, H, n).
        comm: ``"ring"`` (P2P, next block in flight during compute) or ``"allgather"``.
        key_padding_mask: (B, n) bool, this rank's shard of the (B, N) mask (``True`` = ignore
            that key; shard it like the keys), or None. Queries that see no key give zeros.
        cu_seqlens: packed documents of the whole row (B = 1, ``W * n`` positions), as in
            :func:`~dilated_attention.attention`: attention within each document, documents of
            any length spanning shards (Note [Packed documents across ranks] in
            ``packed_ring.py``; :func:`~dilated_attention.distributed.ring_load` tells the
            work per rank).
        window_size: ``(left, right)`` over global positions, as in ``attention``: only the
            key rows it reaches on other ranks travel (Note [Halo exchange] in ``halo.py``).
        softcap: every scaled score ``s`` becomes ``softcap * tanh(s / softcap)``.
        sinks: (H,) logits, as in ``attention``, alike on every rank; a rank's gradient is its
            rows' share (the shares sum to the one-process gradient).

    Returns:
        ``out`` (B, n, H, D): this rank's shard of ``attention`` on the gathered sequence, with
        exact gradients for the local q, k, v; or ``(out, lse)``. A batch of 0 (or 0 heads) on
        every rank gives empty tensors and empty gradients, as ``attention`` does.

    Raises:
        ValueError: on every rank, before any other communication, when shards or options differ
            between ranks or are malformed, or when the ranks differ in grad mode (grad enabled
            and an input requires grad on some ranks only: their backward would wait for the
            others). A rank that never reaches the call (it raised in its own code and goes on)
            leaves the others waiting until the process group's timeout: set one
            (``init_process_group(timeout=...)``, docs/ring.md).
    """
    scores = dict(window_size=window_size, softcap=softcap, sinks=sinks)
    if isinstance(group, ContextParallel):
        refuse_documents(cu_seqlens, group)
        out, lse = _over_context(
            group, query, key, value, key_padding_mask, is_causal=is_causal, scale=scale,
            backend=backend, layout=layout, comm=comm, **scores,
        )  # fmt: skip
        return (out, lse) if return_lse else out
    args = RingArgs(
        query, key, value, group=group, is_causal=is_causal, scale=scale, layout=layout,
        backend=backend, comm=comm, key_padding_mask=key_padding_mask, cu_seqlens=cu_seqlens,
        **scores,
    )  # fmt: skip
    ring = prepare_ring(args)
    q, k, v = ring.q, ring.k, ring.v
    if ring.empty:  # batch 0 or 0 heads, agreed on every rank: as in one process
        out, lse = ring.empty_result()
    else:
        k, v = hide_masked_keys(k, v, key_padding_mask)  # Note [Hidden keys cannot poison rows]
        out, lse = run_attention(q, k, v, key_padding_mask, _runner(ring), ring.sinks)
    return (out, lse) if return_lse else out


def _runner(ring: PreparedRing) -> Runner:
    """What runs an agreed :func:`ring_attention` call: its local window over the halo, its
    packed documents' exchange, or whole blocks around the ring."""
    message = ring_message("ring_attention", "attention()")
    if ring.window is not None:
        return windowed_runner(ring, message)
    if ring.documents is not None:
        return packed_runner(ring)
    kernel = StepKernel(ring.kernel.backend, ring.setup.scale, softcap=ring.softcap)
    return RingRunner(DenseSteps(ring.setup), kernel, message)


def _over_context(
    cp: ContextParallel,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    *,
    is_causal: bool,
    scale: float | None,
    backend: str | None,
    layout: str,
    comm: str,
    window_size: object,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ring_attention` under a :class:`ContextParallel` (Note [Calls under a head
    all-to-all] in ``ulysses.py``, each rank with the sinks of its heads): ``(out, lse)``."""
    options = dict(is_causal=is_causal, scale=scale, backend=backend, return_lse=True,
                   window_size=window_size, softcap=softcap)  # fmt: skip

    def local(q, k, v, mask, first):  # type: ignore[no-untyped-def]
        return attention(q, k, v, key_padding_mask=mask, sinks=heads_sinks(sinks, first, q),
                         **options)  # fmt: skip

    def ring(group, q, k, v, mask, first):  # type: ignore[no-untyped-def]
        return ring_attention(q, k, v, group=group, key_padding_mask=mask, layout=layout,
                              comm=comm, sinks=heads_sinks(sinks, first, q), **options)  # fmt: skip

    def agreed() -> object:
        checked = (V.check_scale(scale), check_backend_name(backend), comm)
        return (is_causal, *checked, *score_options(window_size, softcap, sinks, query))

    return split_call(
        cp, layout, query, key, value, key_padding_mask, local=local, ring=ring,
        what="ring_attention", options=agreed,
    )  # fmt: skip
