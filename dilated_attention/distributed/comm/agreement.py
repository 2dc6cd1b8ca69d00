"""The agreement every ring call starts with: each rank checks its own inputs, then all ranks
compare one small summary, so that a bad or mismatched call raises on every rank instead of
leaving some of them waiting; and the per-step kernel, from the resolve step.

Shape legend: B batch, n local tokens, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ... import _validation as V
from ...backends.registry import Selection, check_backend_name
from ...core.execution.executor import empty_attention
from ...core.geometry.documents import check_offsets
from ...core.geometry.schedule import Schedule
from ...core.geometry.schedule_state import describe_schedule, dilated_schedule
from ...resolve import DENSE, DILATED, Request, resolve
from ..context import DOCUMENTS, DOCUMENTS_FIX, HEAD_FIELDS, ContextParallel, no_documents
from ..layout.sharding import check_layout, chunks_per_rank, rank_positions
from ..rings.template import RingSetup
from .collectives import (
    GRAD_MODE,
    GRAD_MODE_FIX,
    backward_follows,
    check_same_on_all_ranks,
    global_rank,
    group_rank_and_size,
    raise_on_all_ranks,
)

COMMS = ("ring", "allgather")

_DILATED_SCHEDULE = "schedule (segment_lengths, dilation_rates)"
_FIXES = {GRAD_MODE: GRAD_MODE_FIX, DOCUMENTS: DOCUMENTS_FIX}


def _field_names(schedule_name: str) -> tuple[str, ...]:
    """What the ranks compare, in order, named for the messages."""
    return (
        "local seq_len", "batch", "query heads", "key/value heads", "head_dim", "dtype",
        "is_causal", "layout", "comm", "scale", "backend", schedule_name,
        "key_padding_mask given (0/1)", "device type", GRAD_MODE, DOCUMENTS, "window_size",
        "softcap", "sinks given (0/1)",
    )  # fmt: skip


@dataclass(frozen=True)
class RingArgs:
    """A ring call's arguments as the public function received them (unchecked): query (B, n,
    H, D), key and value (B, n, Hkv, D), key_padding_mask (B, n) bool or None, options,
    ``cu_seqlens``: packed documents over the whole sharded row (B = 1), or None, and the
    scores' options (Note [Local windows, soft-capping and sinks] in ``core/sinks.py``): a local
    window ``(left, right)`` over global positions, a soft-cap, sinks (H,)."""

    query: object
    key: object
    value: object
    group: dist.ProcessGroup | None = None
    is_causal: object = False
    scale: object = None
    layout: object = "contiguous"
    backend: str | None = None
    comm: object = "ring"
    key_padding_mask: object = None
    cu_seqlens: object = None
    window_size: object = None
    softcap: object = None
    sinks: object = None


@dataclass(frozen=True)
class RingOperation:
    """What a ring function adds to the agreement.

    Attributes:
        operation: the resolve step's operation for its per-step kernel (``"dense"``, or
            ``"dilated"``: the request then carries the schedule and the shard).
        check_schedule: checks the function's own arguments and returns the schedule the ranks
            compare (a :class:`~dilated_attention.core.geometry.schedule.Schedule`, or its text);
            None without one.
        schedule_name: the schedule's name in a mismatch message.
        key_masks: the per-step calls read key masks of their own (a run-time block mask's
            rows), so the kernel must take one even without a key padding mask.
    """

    operation: str = DENSE
    check_schedule: Callable[[], object] | None = None
    schedule_name: str = _DILATED_SCHEDULE
    key_masks: bool = False


@dataclass(frozen=True)
class PreparedRing:
    """A ring call every rank agreed on: contiguous q (B, n, H, D), k and v (B, n, Hkv, D),
    where this rank sits (``setup``), the per-step kernel, the checked schedule, the checked
    offsets of packed documents over the whole row (None without), and the checked local
    window ``(left, right)``, soft-cap and sinks (H,) (None where not asked)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    setup: RingSetup
    kernel: Selection
    schedule: object = None
    documents: tuple[int, ...] | None = None
    window: tuple[int, int] | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None

    @property
    def empty(self) -> bool:
        """A batch of 0 or 0 heads, on every rank: empty results, as in one process."""
        return self.q.numel() == 0

    def empty_result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` of an :attr:`empty` call, as in one process: empty tensors, linked to
        the sinks where given (their gradient is then zeros, not None)."""
        out, lse = empty_attention(self.q, self.k, self.v)
        if self.sinks is not None:
            out = out + (self.sinks.sum() * 0).to(out.dtype)
        return out, lse


@dataclass(frozen=True)
class _Checked:
    """One rank's checked inputs (:func:`_check`)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    schedule: object
    layout: str
    scale: float | None
    chunk_len: int
    documents: tuple[int, ...] | None
    window: tuple[int, int] | None
    softcap: float | None
    sinks: torch.Tensor | None


def _digest(value: object) -> int:
    """What the ranks compare for ``value``: an int (or bool) itself, else 63 bits of a hash of
    its ``repr`` (exact for floats: their ``repr`` round-trips)."""
    if isinstance(value, int):
        return int(value)
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _schedule_text(schedule: object) -> str | None:
    """What ``check_schedule`` returned, readable: a dilated :class:`Schedule`, or the text a
    block-sparse check gives; ``None`` without a schedule."""
    if schedule is None or isinstance(schedule, str):
        return schedule
    assert isinstance(schedule, Schedule)
    return describe_schedule(dilated_schedule(schedule.segment_lengths, schedule.dilation_rates))


def _check(call: RingArgs, op: RingOperation, world_size: int) -> _Checked:
    """This rank's inputs, checked in the order one process checks them."""
    q, k, v = V.check_qkv(call.query, call.key, call.value, same_length=True)
    schedule = op.check_schedule() if op.check_schedule is not None else None
    if not isinstance(call.is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {call.is_causal!r}")
    layout = check_layout(call.layout)
    if call.comm not in COMMS:
        raise ValueError(f"comm must be one of {COMMS}, got {call.comm!r}")
    scale = V.check_scale(call.scale)
    if layout == "zigzag" and not call.is_causal:
        raise ValueError(
            "layout='zigzag' balances causal work only; with is_causal=False every rank "
            "already does the same work: use layout='contiguous'"
        )
    n = q.shape[1]
    V.check_key_padding_mask(call.key_padding_mask, q.shape[0], n, q.device)
    parts = chunks_per_rank(layout)
    if n % parts:
        raise ValueError(
            f"the local seq_len ({n}) must be even for layout='zigzag' (two chunks per rank); "
            "shard a sequence divisible by 2 x world size with shard_sequence"
        )
    documents = None if call.cu_seqlens is None else _check_documents(call, q, world_size)
    window, softcap, sinks = _check_scores(call, q)
    return _Checked(q, k, v, schedule, layout, scale, n // parts, documents, window, softcap, sinks)


def _check_scores(
    call: RingArgs, q: torch.Tensor
) -> tuple[tuple[int, int] | None, float | None, torch.Tensor | None]:
    """The call's local window, soft-cap and sinks (H,), checked as one process checks them; a
    window travels as its halo only (Note [Halo exchange] in ``halo.py``), never with
    ``comm='allgather'``."""
    window = V.check_window_size(call.window_size)
    if window is not None and call.comm != "ring":
        raise ValueError(
            f"window_size={call.window_size!r} exchanges only the window's halo between "
            f"neighbours, never whole blocks: comm={call.comm!r} does not apply; pass "
            f"comm='ring' (the default)"
        )
    return window, V.check_softcap(call.softcap), V.check_sinks(call.sinks, q)


def _check_documents(call: RingArgs, q: torch.Tensor, world_size: int) -> tuple[int, ...]:
    """The offsets of packed documents over the whole row of ``world_size`` shards like ``q``
    (1, n, H, D), checked (Note [Packed documents across ranks] in ``packed_ring.py``)."""
    if call.key_padding_mask is not None or call.layout != "contiguous" or call.comm != "ring":
        raise ValueError(
            "cu_seqlens in a ring takes contiguous shards (layout='contiguous', "
            "comm='ring') and no key_padding_mask: packed documents need no padding"
        )
    if q.shape[0] != 1:
        raise ValueError(
            f"cu_seqlens in a ring takes one packed row: query of shape (1, n, H, D), got "
            f"{tuple(q.shape)}; pack the batch's documents into one row"
        )
    return check_offsets(call.cu_seqlens, 1, q.shape[1] * world_size, q.device)


def _kernel(checked: _Checked, call: RingArgs, op: RingOperation, world_size: int) -> Selection:
    """The per-step kernel, from the resolve step (for ``"dilated"``: chosen for the local
    branches of this rank's shard, ``Request.shard``)."""
    fields: dict[str, Any] = {}
    if op.operation == DILATED:
        fields = {"schedule": checked.schedule, "shard": (world_size, checked.chunk_len)}
    request = Request.of(
        op.operation, checked.q, checked.k, checked.v, is_causal=call.is_causal,
        has_mask=call.key_padding_mask is not None or op.key_masks, backend=call.backend,
        window=checked.window, softcap=checked.softcap, sinks=checked.sinks is not None,
        **fields,
    )  # fmt: skip
    kernel = resolve(request).kernel
    assert kernel is not None  # dense and sharded dilated requests always name one
    return kernel


def _shown(checked: _Checked, call: RingArgs) -> list[object]:
    """This rank's summary, readable (the mismatch message shows it)."""
    q, k, sinks = checked.q, checked.k, checked.sinks
    documents = None if checked.documents is None else list(checked.documents)
    inputs = (q, k, checked.v) if sinks is None else (q, k, checked.v, sinks)
    return [
        q.shape[1], q.shape[0], q.shape[2], k.shape[2], q.shape[3], str(q.dtype), call.is_causal,
        checked.layout, call.comm, checked.scale, check_backend_name(call.backend) or "auto",
        _schedule_text(checked.schedule), int(call.key_padding_mask is not None), q.device.type,
        int(backward_follows(*inputs)), documents, checked.window, checked.softcap,
        int(sinks is not None),
    ]  # fmt: skip


def prepare_ring(call: RingArgs, op: RingOperation | None = None) -> PreparedRing:
    """Validate a ring call on every rank and return the agreed call with its kernel.

    ``key_padding_mask``, when given, must be this rank's (B, n) bool shard; every rank must pass
    one or none.

    Each rank checks its own inputs, then all ranks exchange one small summary (a fixed number of
    integers: an error flag, shapes, dtype, device type, options (the local window, soft-cap and
    whether sinks are given among them), grad mode, the packed documents' offsets, a hash of
    what ``check_schedule`` validates and returns, e.g. the dilated branches; where a field
    differs, the message shows every rank's value readably, schedules and offsets included). A
    rank whose inputs were rejected raises its own error and every other rank a ``ValueError``
    naming it, and any field that differs between ranks raises on every rank: never a hang.
    Grad mode (grad enabled and an input, sinks included, requires grad) is part of the summary
    because the backward communicates:
    a backward on some ranks only would wait for the others until the timeout. The kernel
    comes from the resolve step, as for a call in one process (``resolve(Request.of(...))``):
    for ``"dilated"`` the request carries the schedule and ``shard=(world_size, chunk_len)``, so
    the kernel is chosen for the branches a rank runs alone, told whether they write into
    branch slots (``ScheduleLayout.sharded``).
    """
    op = op or RingOperation()
    names = _field_names(op.schedule_name)
    rank, size = group_rank_and_size(call.group)
    error: Exception | None = None
    fields: list[int] = [0] * len(names)
    shown: list[object] | None = None  # readable, for a mismatch message
    try:
        checked = _check(call, op, size)
        kernel = _kernel(checked, call, op, size)
        shown = _shown(checked, call)
        fields = [_digest(x) for x in shown]
    except Exception as exc:  # any rejection on one rank must reach the others: no hang
        error = exc
    check_same_on_all_ranks(fields, names, call.group, error, fixes=_FIXES, shown=shown)
    scale = checked.scale if checked.scale is not None else checked.q.shape[-1] ** -0.5
    ranks = tuple(global_rank(call.group, r) for r in range(size))
    setup = RingSetup(
        rank=rank, world_size=size, global_ranks=ranks, layout=checked.layout,
        chunk_len=checked.chunk_len, is_causal=bool(call.is_causal), scale=scale,
        comm=str(call.comm),
    )  # fmt: skip
    q, k, v = (x.contiguous() for x in (checked.q, checked.k, checked.v))
    return PreparedRing(
        q, k, v, setup, kernel, checked.schedule, checked.documents, checked.window,
        checked.softcap, checked.sinks,
    )  # fmt: skip


def reject_ring_call(
    error: Exception, group: dist.ProcessGroup | ContextParallel | None
) -> NoReturn:
    """Take part in a ring call's agreement (:func:`prepare_ring`) with this rank's ``error``,
    then raise it: for a caller whose own checks rejected this rank's call before the ring
    function was reached, so that the peers already waiting in the agreement raise too instead of
    waiting until the process group's timeout. Under a :class:`ContextParallel` the head group's
    agreement comes first (Note [Calls under a head all-to-all]), then the ring's.

    Raises:
        Exception: ``error`` on this rank (peers raise ``ValueError`` naming this rank).
    """
    if isinstance(group, ContextParallel):
        if group.heads is not None:
            with contextlib.suppress(Exception):  # this rank's own error is raised below
                check_same_on_all_ranks([0] * len(HEAD_FIELDS), HEAD_FIELDS, group.heads, error)
        if group.ring is None:
            raise error
        group = group.ring
    raise_on_all_ranks(error, _field_names(_DILATED_SCHEDULE), group)


def refuse_documents(cu_seqlens: object, cp: ContextParallel) -> None:
    """Packed documents under ``cp`` are not supported (:func:`~.context.no_documents`): a rank
    that passes them takes part in the call's agreement with that error
    (:func:`reject_ring_call`), so that every rank raises, including those that passed none and
    wait in the agreement.

    Raises:
        ValueError: ``cu_seqlens`` given (its peers raise ``ValueError`` naming this rank).
    """
    try:
        no_documents(cu_seqlens)
    except ValueError as exc:
        reject_ring_call(exc, cp)


class AgreedForward:
    """Mixin for a multihead layer whose ``attention`` is a ring module (with ``group`` and a
    ``ring_calls`` counter of the calls that reached a ring function, and so its agreement).

    The layer's forward (its own checks and projections, then the ring call) runs as in the
    next class of the MRO; an error raised before the ring call was reached takes part in that
    call's agreement (the ring module's ``reject_call``: :func:`reject_ring_call`, or the
    agreement of its own ring function), so that it raises on every rank instead of
    leaving the others waiting. Its rotary positions default to the shard's global positions
    (:meth:`_default_positions`), computed without communication.

    Raises:
        Exception: what the forward raised, on this rank; ``ValueError`` on the other ranks.
    """

    attention: Any

    def _default_positions(self, n: int, device: torch.device) -> torch.Tensor:
        """This rank's global positions in the sharded sequence, for rotary (the multihead
        layer's default when ``forward`` is given none), with no collective of their own
        (``rank_positions``): the ring call that follows agrees on the shards, and a rank whose
        call this layer rejected meets its peers there."""
        layout = getattr(self.attention, "layout", "contiguous")
        return rank_positions(n, group=self.attention.group, layout=layout, device=device)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        reached = self.attention.ring_calls
        try:
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        except Exception as exc:
            if self.attention.ring_calls != reached:
                raise  # the ring call's agreement already ran on every rank
            self.attention.reject_call(exc)  # its ring function's agreement, with this error
