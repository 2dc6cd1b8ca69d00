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
    block beside the block's 2 n Hkv D values.

Shape legend: B batch, n local tokens, H query heads, Hkv key/value heads, D head dim, W ranks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn

import torch
import torch.distributed as dist

from .. import _validation as V
from ..backends.base import Backend, KernelInputs
from ..backends.registry import DENSE, Selection, check_backend_name, registry_for
from ..compiled import eager_only
from ..core.autograd import Backward, FirstOrderOnly, Forward, Grads, Inputs, run_attention
from ..core.engine import (
    SliceCall,
    accumulator_dtype,
    empty_attention,
    new_accumulators,
    row_lse,
    run_backward,
    run_forward,
)
from ..core.hidden import hide_masked_keys
from ..core.higher_order import ring_message
from ..core.schedule_state import describe_schedule, dilated_schedule
from ._comm import (
    check_same_on_all_ranks,
    exchange,
    global_rank,
    group_rank_and_size,
    ring_all_gather,
    wait_all,
)
from .sharding import check_layout, chunks_of, chunks_per_rank

COMMS = ("ring", "allgather")


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


@dataclass(frozen=True)
class RingSetup:
    """Where this rank sits in the ring and how the sequence is laid out."""

    rank: int
    world_size: int
    global_ranks: tuple[int, ...]
    layout: str
    chunk_len: int
    is_causal: bool
    scale: float
    comm: str

    def tasks(self, src: int) -> list[SliceCall]:
        """This rank's kernel calls against the key/value block of rank ``src``."""
        return self.tasks_of(self.rank, src)

    def tasks_of(self, rank: int, src: int) -> list[SliceCall]:
        """Rank ``rank``'s kernel calls against the key/value block of rank ``src``."""
        me = chunks_of(rank, self.world_size, self.layout)
        other = chunks_of(src, self.world_size, self.layout)
        return plan_block(me, other, self.chunk_len, self.is_causal)

    @property
    def next_rank(self) -> int:
        return self.global_ranks[(self.rank + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        return self.global_ranks[(self.rank - 1) % self.world_size]


@dataclass(frozen=True)
class KeyBlock:
    """One rank's keys and values as they travel around the ring: ``kv`` (2, B, n, Hkv, D) and,
    when the call has a key padding mask, ``mask`` (B, n) as uint8 (1 = ignore that key)."""

    kv: torch.Tensor
    mask: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What is sent for this block, in order."""
        return (self.kv,) if self.mask is None else (self.kv, self.mask)

    @property
    def key_padding_mask(self) -> torch.Tensor | None:
        """The block's (B, n) bool key padding mask, or None."""
        return None if self.mask is None else self.mask.view(torch.bool)


def _pass_on(block: KeyBlock, setup: RingSetup) -> tuple[list[dist.Work], KeyBlock]:
    """Post ``block`` to the next rank and the receive of the previous rank's block."""
    incoming = KeyBlock(*(torch.empty_like(t) for t in block.tensors()))
    pending = exchange(
        [(t, setup.next_rank) for t in block.tensors()],
        [(t, setup.prev_rank) for t in incoming.tensors()],
    )
    return pending, incoming


def _all_blocks(block: KeyBlock, setup: RingSetup) -> list[KeyBlock]:
    """Every rank's block, in rank order (``comm="allgather"``)."""
    return [
        KeyBlock(*tensors)
        for tensors in ring_all_gather(block.tensors(), setup.global_ranks, setup.rank)
    ]


def ring_forward(
    q: torch.Tensor, local: KeyBlock, setup: RingSetup, backend: Backend
) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
    """Forward of Note [Ring schedule].

    Args:
        q: (B, n, H, D) local queries.
        local: this rank's keys and values (and mask), contiguous.

    Returns:
        ``out`` (B, n, H, D) float32, ``lse`` (B, n, H, 1) float32 (float64 for float64 inputs),
        and every kernel call's ``aux`` in call order (the backward replays the same calls).
    """
    out, lse = new_accumulators(q)
    auxes: list[Any] = []

    def compute(block: KeyBlock, src: int) -> None:
        run_forward(
            q, block.kv[0], block.kv[1], block.key_padding_mask, setup.tasks(src), backend,
            scale=setup.scale, out=out, lse=lse, auxes=auxes,
        )  # fmt: skip

    if setup.comm == "allgather":
        for src, block in enumerate(_all_blocks(local, setup)):
            compute(block, src)
        return out, lse, auxes
    block = local
    for step in range(setup.world_size):
        src = (setup.rank - step) % setup.world_size
        pending, incoming = [], None
        if step < setup.world_size - 1:
            pending, incoming = _pass_on(block, setup)
        compute(block, src)
        wait_all(pending)
        if incoming is not None:
            block = incoming
    return out, lse, auxes


#: One kernel call's key/value gradients: (rows of the key/value block, dK, dV).
Part = tuple[slice, torch.Tensor, torch.Tensor]


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
    for task in setup.tasks_of(sender, setup.rank):
        shape = kv[0][:, task.kv].shape  # (B, rows, Hkv, D)
        dk, dv = (torch.empty(shape, dtype=dtype, device=kv.device) for _ in range(2))
        parts.append((task.kv, dk, dv))
    return parts


def ring_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    local: KeyBlock,
    out: torch.Tensor,
    lse: torch.Tensor,
    setup: RingSetup,
    backend: Backend,
    auxes: list[Any],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of Note [Ring schedule].

    Args:
        dout, q, out: (B, n, H, D); local: this rank's block (kv (2, B, n, Hkv, D));
        lse: (B, H, n) final statistics.
        auxes: the forward's kernel ``aux`` values, in call order.

    Returns:
        ``dq`` (B, n, H, D) and ``dkv`` (2, B, n, Hkv, D), float32 (float64 for float64 inputs).
    """
    acc = accumulator_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = local.kv
    dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
    aux_iter = iter(auxes)
    lse_rows = row_lse(lse)

    def compute(block: KeyBlock, src: int) -> list[Part]:
        """Kernel gradients against ``block``: dQ added into ``dq``; the dK/dV parts returned."""
        parts: list[Part] = []

        def keep(call: SliceCall, dk: torch.Tensor, dv: torch.Tensor) -> None:
            parts.append((call.kv, dk.contiguous(), dv.contiguous()))

        run_backward(
            dout, q, block.kv[0], block.kv[1], out, lse_rows, block.key_padding_mask,
            setup.tasks(src), backend, aux_iter, scale=setup.scale, dq=dq, dk=None, dv=None,
            kv_grads=keep,
        )  # fmt: skip
        return parts

    # Note [Gradients go home]: remote dK/dV parts travel in the dtype the kernel produced them
    # in (nothing is rounded) straight to the block's owner, which sums them in float32: half
    # the bytes of passing float32 accumulators around the ring, and no last hop. Each rank's
    # own block always has its diagonal call and is computed before any part is received, so
    # the gradient dtype is known in time. A block this rank made no call against sends
    # nothing. Calls run in the forward's order: each consumes its own forward ``aux``.
    if setup.comm == "allgather":
        send, wire = [], q.dtype
        blocks = _all_blocks(local, setup)
        for src, block in enumerate(blocks):  # the forward's order: each call's aux in turn
            parts = compute(block, src)
            if src == setup.rank:
                _add_parts(dkv, parts)
                wire = parts[0][1].dtype
            else:
                send += _part_tensors(parts, setup.global_ranks[src])
        arriving, recv = [], []
        for sender in range(setup.world_size):
            if sender != setup.rank:
                expected = _expected_parts(setup, sender, kv, wire)
                arriving += expected
                recv += _part_tensors(expected, setup.global_ranks[sender])
        wait_all(exchange(send, recv))
        _add_parts(dkv, arriving)
        return dq, dkv
    # Ring: at step s this rank computes its parts for the block of rank - s and sends them
    # there while the next step computes; meanwhile the parts for its own block computed by
    # rank + s arrive and are added.
    block = local
    returning: list[dist.Work] = []
    arriving: list[Part] = []
    in_flight: list[Part] = []  # the parts being sent: alive until their send is waited on
    wire = q.dtype
    for step in range(setup.world_size):
        src = (setup.rank - step) % setup.world_size
        pending, incoming = [], None
        if step < setup.world_size - 1:
            pending, incoming = _pass_on(block, setup)
        parts = compute(block, src)
        wait_all(returning)  # the previous step's parts have left; its arrivals are here
        in_flight.clear()
        _add_parts(dkv, arriving)
        if step == 0:
            _add_parts(dkv, parts)
            wire = parts[0][1].dtype
        else:
            sender = (setup.rank + step) % setup.world_size
            arriving = _expected_parts(setup, sender, kv, wire)
            recv = _part_tensors(arriving, setup.global_ranks[sender])
            returning = exchange(_part_tensors(parts, setup.global_ranks[src]), recv)
            in_flight.extend(parts)
        wait_all(pending)
        if incoming is not None:
            block = incoming
    wait_all(returning)
    _add_parts(dkv, arriving)
    return dq, dkv


def finished_forward(
    q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, saved: tuple[Any, ...], state: Any
) -> Forward:
    """A ring runner's :class:`Forward` from its float32 accumulators ``out`` (B, n, H, D) and
    ``lse`` (B, n, H, 1): ``out`` in q's dtype, ``lse`` (B, H, n)."""
    return Forward(
        out.to(q.dtype), lse.squeeze(-1).transpose(1, 2).contiguous(), saved=saved, state=state
    )


def finished_grads(q: torch.Tensor, dq: torch.Tensor, dkv: torch.Tensor) -> Grads:
    """dq and the (2, B, n, Hkv, D) dK/dV accumulator as dq, dk, dv in the inputs' dtype."""
    return dq.to(q.dtype), dkv[0].to(q.dtype), dkv[1].to(q.dtype)


@dataclass(frozen=True)
class RingRunner(FirstOrderOnly):
    """Ring attention as a :class:`~dilated_attention.core.autograd.Runner`:
    :func:`ring_forward` / :func:`ring_backward` on this rank's shard."""

    setup: RingSetup
    backend: Backend
    first_order_message: ClassVar[str] = ring_message("ring_attention", "attention()")

    def forward(self, x: Inputs) -> Forward:
        q, k, v, key_padding_mask = x
        mask = None
        if key_padding_mask is not None:  # bytes on the wire: gloo sends no bool tensors
            mask = key_padding_mask.contiguous().view(torch.uint8)
        local = KeyBlock(torch.stack([k, v]).contiguous(), mask)
        out, lse, auxes = ring_forward(q, local, self.setup, self.backend)
        return finished_forward(q, out, lse, (local.kv, mask), auxes)

    def backward(self, b: Backward) -> Grads:
        dout, q, out, lse, saved, state = b
        kv, mask = saved
        dq, dkv = ring_backward(
            dout.contiguous(), q, KeyBlock(kv, mask), out, lse, self.setup, self.backend, state
        )
        return finished_grads(q, dq, dkv)


_GRAD_MODE = "grad mode (1: grad enabled and an input requires grad, so a backward may follow)"
_FIELDS = (
    "local seq_len", "batch", "query heads", "key/value heads", "head_dim", "dtype", "is_causal",
    "layout", "comm", "scale", "backend", "schedule (segment_lengths, dilation_rates)",
    "key_padding_mask given (0/1)", "device type", _GRAD_MODE,
)  # fmt: skip
_FIXES = {
    _GRAD_MODE: (
        "every rank must call in the same grad mode: all under torch.no_grad() (or with inputs "
        "that do not require grad), or all with grad enabled and inputs that require grad; the "
        "backward exchanges gradients between the ranks, so it cannot run on some ranks only"
    ),
}


def _digest(value: object) -> int:
    """What the ranks compare for ``value``: an int (or bool) itself, else 63 bits of a hash of
    its ``repr`` (exact for floats: their ``repr`` round-trips)."""
    if isinstance(value, int):
        return int(value)
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _schedule_text(schedule: object) -> str | None:
    """What ``check_schedule`` returned, readable: a dilated ``(segments, rates)`` pair, or the
    text a block-sparse check gives; ``None`` without a schedule."""
    if schedule is None or isinstance(schedule, str):
        return schedule
    segments, rates = schedule  # type: ignore[misc]
    return describe_schedule(dilated_schedule(segments, rates))


def prepare_ring(
    query: object,
    key: object,
    value: object,
    *,
    group: dist.ProcessGroup | None,
    is_causal: bool,
    scale: float | None,
    layout: str,
    backend: str | None,
    comm: str,
    check_schedule: Callable[[], object] | None = None,
    operation: str = DENSE,
    key_padding_mask: object = None,
    branch_slots: Callable[[object, torch.Tensor, torch.Tensor, int, int], bool] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, RingSetup, Selection]:
    """Validate a ring call on every rank and return contiguous q, k, v, the setup and the kernel.

    ``key_padding_mask``, when given, must be this rank's (B, n) bool shard; every rank must pass
    one or none.

    Each rank checks its own inputs, then all ranks exchange one small summary (a fixed number of
    integers: an error flag, shapes, dtype, device type, options, grad mode, a hash of what
    ``check_schedule`` validates and returns, e.g. the dilated branches; where a field differs,
    the message shows every rank's value readably, schedules included). A rank whose
    inputs were rejected raises its own error and every other rank a ``ValueError`` naming it, and
    any field that differs between ranks raises on every rank: never a hang. Grad mode (grad
    enabled and an input requires grad) is part of the summary because the backward communicates:
    a backward on some ranks only would wait for the others until the timeout. The kernel
    comes from ``operation``'s registry (``registry_for``): ``"dilated"`` for ring dilated
    attention, whose local branches a plan kernel may run; ``branch_slots(schedule, q, k,
    world_size, chunk_len)`` says whether they write into branch slots (the registry's
    ``KernelInputs.branch_slots``).
    """
    rank, size = group_rank_and_size(group)
    error: Exception | None = None
    fields: list[int] = [0] * len(_FIELDS)
    shown: list[object] | None = None  # readable, for a mismatch message
    try:
        q, k, v = V.check_qkv(query, key, value, same_length=True)  # first, as in one process
        schedule = check_schedule() if check_schedule is not None else None
        if not isinstance(is_causal, bool):
            raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
        layout = check_layout(layout)
        if comm not in COMMS:
            raise ValueError(f"comm must be one of {COMMS}, got {comm!r}")
        checked_scale = V.check_scale(scale)
        if layout == "zigzag" and not is_causal:
            raise ValueError(
                "layout='zigzag' balances causal work only; with is_causal=False every rank "
                "already does the same work: use layout='contiguous'"
            )
        n = q.shape[1]
        V.check_key_padding_mask(key_padding_mask, q.shape[0], n, q.device)
        has_mask = key_padding_mask is not None
        parts = chunks_per_rank(layout)
        if n % parts:
            raise ValueError(
                f"the local seq_len ({n}) must be even for layout='zigzag' (two chunks per rank); "
                "shard a sequence divisible by 2 x world size with shard_sequence"
            )
        slots = branch_slots is not None and branch_slots(schedule, q, k, size, n // parts)
        inputs = KernelInputs.from_tensors(
            q, k, is_causal=is_causal, has_mask=has_mask, branch_slots=slots
        )
        kernel = registry_for(operation).select(inputs, backend)
        # A rank that records no graph never runs the ring backward: its peers' backward would
        # wait for it until the process group's timeout.
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        shown = [
            n, q.shape[0], q.shape[2], k.shape[2], q.shape[3], str(q.dtype), is_causal, layout,
            comm, checked_scale, check_backend_name(backend) or "auto", _schedule_text(schedule),
            int(has_mask), q.device.type, int(needs_grad),
        ]  # fmt: skip
        fields = [_digest(x) for x in shown]
    except Exception as exc:  # any rejection on one rank must reach the others: no hang
        error = exc
    check_same_on_all_ranks(fields, _FIELDS, group, error, fixes=_FIXES, shown=shown)
    setup = RingSetup(
        rank=rank,
        world_size=size,
        global_ranks=tuple(global_rank(group, r) for r in range(size)),
        layout=layout,
        chunk_len=n // parts,
        is_causal=is_causal,
        scale=checked_scale if checked_scale is not None else q.shape[-1] ** -0.5,
        comm=comm,
    )
    return q.contiguous(), k.contiguous(), v.contiguous(), setup, kernel


def reject_ring_call(error: Exception, group: dist.ProcessGroup | None) -> NoReturn:
    """Take part in a ring call's agreement (:func:`prepare_ring`) with this rank's ``error``,
    then raise it: for a caller whose own checks rejected this rank's call before the ring
    function was reached, so that the peers already waiting in the agreement raise too instead of
    waiting until the process group's timeout.

    Raises:
        Exception: ``error`` on this rank (peers raise ``ValueError`` naming this rank).
    """
    check_same_on_all_ranks([0] * len(_FIELDS), _FIELDS, group, error)
    raise error  # not reached: check_same_on_all_ranks raises the local error


class AgreedForward:
    """Mixin for a multihead layer whose ``attention`` is a ring module (with ``group`` and a
    ``ring_calls`` counter of the calls that reached a ring function, and so its agreement).

    The layer's forward (its own checks and projections, then the ring call) runs as in the
    next class of the MRO; an error raised before the ring call was reached takes part in that
    call's agreement (:func:`reject_ring_call`), so that it raises on every rank instead of
    leaving the others waiting.

    Raises:
        Exception: what the forward raised, on this rank; ``ValueError`` on the other ranks.
    """

    attention: Any

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        reached = self.attention.ring_calls
        try:
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        except Exception as exc:
            if self.attention.ring_calls != reached:
                raise  # the ring call's agreement already ran on every rank
            reject_ring_call(exc, self.attention.group)


@eager_only("ring_attention")  # torch.compile runs it eagerly; torch.func raises
def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    layout: str = "contiguous",
    backend: str | None = None,
    return_lse: bool = False,
    comm: str = "ring",
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over a sequence sharded across ``group``; this rank's shard of the result.

    Args:
        query: (B, n, H, D) this rank's shard (``n = N / W``; see ``shard_sequence``).
        key: (B, n, Hkv, D).
        value: (B, n, Hkv, D).
        group: the process group (default: the world).
        is_causal: causal over global positions.
        scale: softmax scale; ``None`` means ``D ** -0.5``.
        layout: ``"contiguous"`` or ``"zigzag"`` (causal only), as the shards were made.
        backend: kernel name, or ``None`` for the automatic choice.
        return_lse: also return the log-sum-exp (B, H, n).
        comm: ``"ring"`` (P2P, next block in flight during compute) or ``"allgather"``.
        key_padding_mask: (B, n) bool, this rank's shard of the (B, N) mask (``True`` = ignore
            that key; shard it like the keys), or None. Queries that see no key give zeros.

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
    q, k, v, setup, kernel = prepare_ring(
        query, key, value, group=group, is_causal=is_causal, scale=scale, layout=layout,
        backend=backend, comm=comm, key_padding_mask=key_padding_mask,
    )  # fmt: skip
    if q.numel() == 0:  # batch 0 or 0 heads, agreed on every rank: as in one process
        out, lse = empty_attention(q, k, v)
    else:
        k, v = hide_masked_keys(k, v, key_padding_mask)  # Note [Hidden keys cannot poison rows]
        out, lse = run_attention(q, k, v, key_padding_mask, RingRunner(setup, kernel.backend))
    return (out, lse) if return_lse else out
