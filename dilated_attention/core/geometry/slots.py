"""Branch slots: each dilated branch's results in a compact buffer of its own, merged once.

Note [Branch slots merged once]
    The executor's default merge keeps float32 accumulators shaped like the output and merges
    every call's result into them as it comes (Note [One executor] in ``executor.py``): zeroing
    them, one read-modify-write of float32 rows per call, a rounding pass at the end, and the
    same again for dq, dk, dv in the backward. Around FlashAttention-4's kernels on strided
    views that traffic cost about as much time as the kernels (1M tokens on an H100:
    ``findings_h100``). A kernel that writes its result into buffers it is given (``into``,
    Note [The backend contract] in ``contract.py``) makes it unnecessary:

    - every branch ``(L, r)`` gets a *slot*: a compact buffer of the rows it covers, shaped
      (B, S * C, H, D) in the input dtype for its ``S = ceil(N / L)`` segments of
      ``C = ceil(L / r)`` rows (N / r in all where ``r`` divides ``L`` and ``L`` divides N),
      row ``seg * C + m`` of head ``h`` holding position ``seg * L + (h mod r) + r * m``
      (LongNet's offset ``h mod r``), and its log-sum-exp (B, S, H, C) float32. A ragged branch
      leaves some rows unused: the offset classes with fewer rows than ``C``, and a shorter
      last segment's. The calls of a branch (offset classes or
      diagonal head blocks, Note [Strided row calls] in ``strided.py``) write straight into
      views of it (:meth:`~dilated_attention.core.geometry.strided.StridedCall.slot_rows`): each row
      of a slot is written by exactly one call;
    - after the last call one pass merges every slot into the output (Note [Merging partial
      softmaxes] weights over the branches covering a row, float32, one rounding), writing the
      merged lse too: it reads each slot row once and writes each output row once;
    - backward, every call writes its dq, dk, dv rows into the slots of three gradient buffers,
      and one pass per gradient sums a row's slots in float32 and rounds once.

    Each slot is a 16-bit result the kernel rounded once, so the sum is what the float32
    accumulators computed, in another order. The slots take ``sum 1 / r_i`` units of q per
    buffer, less the rate-1 branch's unit (Note [A rate-1 slot is its destination]: 0.94 for
    LongNet's r = 1..16): forward that stays below the backward's tensors; the
    backward runs in position groups where it would not (Note [Position-grouped plans] in
    ``grouped.py``), with slots of the group's size, and slots of the whole sequence for the
    branches whose segments are longer than a group (``Slot.spanning``): the merge and the sums
    read *views* (:class:`SlotView`) of a group's positions, its own slots and its part of
    those. Measured on an H100 (LongNet schedule, 1M tokens, H = 16, bf16): the merge 5.2 ms
    and each sum 4.1 ms at D = 128, 3 TB/s.

    A plan runs in slots when its calls are strided views of every offset class (Note [Strided
    row calls] in ``strided.py``), ragged branches included: always without GQA, and with GQA
    where each offset class's key/value heads are one strided slice (Note [Key slots of GQA
    plans] in ``key_slots.py``). Other plans merge as they go.

    The merge and the sums run as one Triton kernel each on CUDA (:func:`register_slot_kernels`,
    filled by the Triton backend), else as the torch ops of :func:`merge_slots_torch` and
    :func:`sum_slots_torch`, which address the slots through views and share nothing with the
    kernels.

Note [A rate-1 slot is its destination]
    A branch of rate 1 whose segments end with the positions (``L`` divides N, or the last
    segment is the rest) covers every position and head, and its slot's layout, row
    ``seg * L + m`` of head ``h`` for position ``seg * L + m``, is the position layout of the
    output. So its slot *is* the output (or, backward, the gradient it sums into,
    :class:`SlotBuffers` ``dest``): its calls write there, and the merge (or the sum) reads
    each cell of it and of the other slots before writing that cell, in one program (the torch
    passes read every view into float32 accumulators first). The arithmetic does not change:
    the slot row was the kernel's 16-bit result before and still is. It takes the rate-1
    branch's unit of q out of every buffer (LongNet's r = 1..16: 0.94 units instead of 1.94),
    which the grouped backward spends on fewer, longer position groups (Note
    [Position-grouped plans] in ``grouped.py``): half the FlashAttention-4 calls for the same
    memory. Only the first such branch, and only where ``dest`` has the input's dtype and a
    slot's row layout (a float32 output that ring dilated attention merges further does not).
    A GQA key slot of rate 1 is by position, the layout of dk and dv, so it is their
    destination too.

Shape legend: B batch, N positions of the plan (or of a position group), H heads, D head dim,
L segment length, r rate, S segments, C slot rows per segment, n segments and c rows of a call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

import torch

from ..merge import merge_partial


def segment_rows(segment_len: int, rate: int) -> int:
    """C: a slot's rows per segment of ``segment_len`` at ``rate``, ``ceil(L / r)`` (the longest
    offset class's)."""
    return -(-segment_len // rate)


@dataclass(frozen=True)
class Slot:
    """The compact buffer of branch ``(segment_len, rate)`` (Note [Branch slots merged once]);
    ``spanning``: its segments are longer than the position groups of a grouped plan, so its
    calls run once over the whole sequence and every group reads its part of the slot (Note
    [Position-grouped plans] in ``grouped.py``)."""

    segment_len: int
    rate: int
    spanning: bool = False

    @property
    def segment_rows(self) -> int:
        """C: slot rows per segment (:func:`segment_rows`)."""
        return segment_rows(self.segment_len, self.rate)

    def segments(self, seq_len: int) -> int:
        """S: the segments over ``seq_len`` positions, a shorter last one included."""
        return -(-seq_len // self.segment_len)

    def rows(self, seq_len: int) -> int:
        """Rows per batch element and head over ``seq_len`` positions: S * C (N / r where ``r``
        divides ``L`` and ``L`` divides N)."""
        return self.segments(seq_len) * self.segment_rows


@dataclass(frozen=True)
class SlotView:
    """One slot over a run of positions, as the merge and the sums read it.

    Attributes:
        rows: (B, S * C, H, D), rows contiguous (any batch stride): row ``seg * C + m`` of head
            ``h`` holds position ``seg * L + (h mod r) + r * m`` of the run, ``C = ceil(L / r)``.
        lse: (B, S, H, C) (last dim contiguous), or None for gradients.
        segment_len: L: the branch's segment length, or the run's own length where the run lies
            inside one of the branch's segments (a spanning slot's part of a position group).
        rate: r.
    """

    rows: torch.Tensor
    lse: torch.Tensor | None
    segment_len: int
    rate: int

    @property
    def segment_rows(self) -> int:
        """C (:func:`segment_rows`)."""
        return segment_rows(self.segment_len, self.rate)


class SlotBuffers:
    """The slots ``held`` (indices into ``slots``) of a plan in one flat buffer (and one flat lse
    buffer), for the batch elements, ``seq_len`` positions and H heads of ``dim`` channels of
    ``like`` (B, N', H, D); with ``dest``, the slot of the first rate-1 branch that covers every
    position is ``dest`` itself (Note [A rate-1 slot is its destination]).

    Attributes:
        flat: the other slots' rows, slot ``i`` as (B, S * C, H, D) (:meth:`out`).
        lse_flat: every held slot's lse (``None`` for gradient buffers), slot ``i`` as
            (B, S, H, C).
        in_dest: the index of the slot that is ``dest``, or None.
    """

    def __init__(
        self,
        slots: Sequence[Slot],
        like: torch.Tensor,
        seq_len: int,
        *,
        with_lse: bool,
        held: Sequence[int] | None = None,
        dest: torch.Tensor | None = None,
    ) -> None:
        batch, _, heads, dim = like.shape
        self.slots = tuple(slots)
        self.held = tuple(range(len(slots))) if held is None else tuple(held)
        self.seq_len, self.batch, self.heads, self.dim = seq_len, batch, heads, dim
        with_dest = dest is not None and dest_layout(like, seq_len, dest)
        self._layout = slot_layout(self.slots, self.held, seq_len, batch, heads, with_dest)
        self.in_dest = self._layout.in_dest
        self._dest = dest
        self.flat = torch.empty(self._layout.own * dim, dtype=like.dtype, device=like.device)
        lse_dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
        self.lse_flat = (
            torch.empty(self._layout.total, dtype=lse_dtype, device=like.device)
            if with_lse else None
        )  # fmt: skip

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The buffers the calls write and the merge or sum reads."""
        return (self.flat,) if self.lse_flat is None else (self.flat, self.lse_flat)

    def out(self, index: int) -> torch.Tensor:
        """Slot ``index``'s rows, (B, S * C, H, D)."""
        if index == self.in_dest and self._dest is not None:
            return self._dest
        rows, size = self._layout.rows[index], self._layout.sizes[index]
        start = self._layout.row_starts[index]
        flat = self.flat[start * self.dim : (start + size) * self.dim]
        return flat.view(self.batch, rows, self.heads, self.dim)

    def lse(self, index: int) -> torch.Tensor:
        """Slot ``index``'s log-sum-exp, (B, S, H, C)."""
        if self.lse_flat is None:
            raise RuntimeError("these slot buffers hold gradients: they have no lse")
        size, start = self._layout.sizes[index], self._layout.starts[index]
        return self.lse_flat[start : start + size].view(self._layout.lse_shapes[index])

    def views(
        self, batch: slice = slice(None), start: int = 0, end: int | None = None
    ) -> list[SlotView]:
        """Every held slot over positions ``[start, end)`` of batch elements ``batch``: whole
        segments of its branch (the last may end with the sequence), or a run inside one
        segment (then ``start`` is a multiple of its rate)."""
        end = self.seq_len if end is None else end
        whole = start == 0 and end == self.seq_len  # the slots as they are: no slicing
        every = batch == slice(None)
        views = []
        for index in self.held:
            slot = self.slots[index]
            length, rate = slot.segment_len, slot.rate
            rows = self.out(index)
            lse = None if self.lse_flat is None else self.lse(index)
            if not every:
                rows, lse = rows[batch], None if lse is None else lse[batch]
            if not whole:
                rows, lse, length = _run_of(rows, lse, slot, start, end, self.seq_len)
            views.append(SlotView(rows, lse, length, rate))
        return views

    def call_rows(self, call: SlotCall, batch: slice) -> torch.Tensor:
        """The rows ``call`` writes of its slot, for batch elements ``batch``: (B' * n, c, Hc,
        D), a view."""
        rows = self.out(call.slot)
        return call.slot_rows(rows if batch == slice(None) else rows[batch])

    def sum_into(self, grad: torch.Tensor, extra: Sequence[SlotView] = ()) -> None:
        """Write the sum of every held slot and the ``extra`` views into ``grad`` (B, N, H, D)
        (:func:`sum_slots`)."""
        sum_slots([*self.views(), *extra], grad)


def _run_of(
    rows: torch.Tensor,
    lse: torch.Tensor | None,
    slot: Slot,
    start: int,
    end: int,
    seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """A slot's rows (B, S * C, H, D) and lse (B, S, H, C) over positions ``[start, end)`` of
    ``seq_len``, with the segment length its view has: whole segments of the branch (the last
    may end with the sequence), or a run inside one segment (``start`` a multiple of the
    rate)."""
    length, rate, per_segment = slot.segment_len, slot.rate, slot.segment_rows
    if start % length == 0 and (end % length == 0 or end == seq_len):
        first, stop = start // length, -(-end // length)
        rows = rows[:, first * per_segment : stop * per_segment]
        return rows, None if lse is None else lse[:, first:stop], length
    seg, first = start // length, (start % length) // rate  # inside one segment
    count = -(-(end - start) // rate)
    rows = rows[:, seg * per_segment + first :][:, :count]
    lse = None if lse is None else lse[:, seg : seg + 1, :, first : first + count]
    return rows, lse, end - start


@dataclass(frozen=True)
class ExtraSlotGradients:
    """Gradients of branches beyond a plan's own, laid out as one float32 slot of ``rate``
    whose one segment holds all N positions of the plan (position ``(h mod r) + r * m`` of head
    ``h`` at row ``m``): the sums read their views beside the plan's own slots, so they join
    before the one rounding with no float32 gradients of the positions (ring dilated attention's
    spanning branches: Note [Spanning results stay compact] in
    ``distributed/rings/ring_dilated.py``).

    Attributes:
        make: returns dq, dk, dv, each (B, ceil(N / r), H, D) float32; called once, when the
            first sum needs them.
        rate: r; every position group's start is a multiple of it.
    """

    make: Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    rate: int

    def views(self, batch: slice, start: int, end: int) -> list[list[SlotView]]:
        """Each gradient's view over positions ``[start, end)`` of batch elements ``batch``."""
        first, count = start // self.rate, -(-(end - start) // self.rate)
        return [
            [SlotView(rows[batch, first : first + count], None, end - start, self.rate)]
            for rows in self.make()
        ]


def dest_layout(like: torch.Tensor, seq_len: int, dest: torch.Tensor) -> bool:
    """Whether ``dest`` (B, N', H, D) may be a slot of ``like``'s (Note [A rate-1 slot is its
    destination]): ``like``'s shape over ``seq_len`` positions, dtype and device, and a slot's
    row layout (heads and channels contiguous in each position)."""
    batch, _, heads, dim = like.shape
    return (
        dest.shape == (batch, seq_len, heads, dim) and dest.dtype == like.dtype
        and dest.device == like.device and dest.stride()[1:] == (heads * dim, dim, 1)
    )  # fmt: skip


def dest_slot(
    slots: Sequence[Slot],
    held: Sequence[int],
    seq_len: int,
    like: torch.Tensor,
    dest: torch.Tensor,
) -> int | None:
    """The held slot whose rows may be ``dest`` (B, N', H, D) itself (Note [A rate-1 slot is its
    destination]): the first of rate 1 whose slot rows are the positions (its segments end with
    the ``seq_len`` positions), where :func:`dest_layout`; else None."""
    if not dest_layout(like, seq_len, dest):
        return None
    return _rate_one_slot(tuple(slots), tuple(held), seq_len)


def _rate_one_slot(slots: tuple[Slot, ...], held: tuple[int, ...], seq_len: int) -> int | None:
    for index in held:
        slot = slots[index]
        if slot.rate == 1 and not slot.spanning and slot.rows(seq_len) == seq_len:
            return index
    return None


@dataclass(frozen=True)
class SlotLayout:
    """Where :class:`SlotBuffers` keeps each held slot, per slot index: its rows (S * C), its
    elements per channel (B * S * C * H), its lse's shape (B, S, H, C) and start in the flat lse
    buffer, its start (in rows of one channel) in the flat rows buffer; the elements per channel
    of the flat rows (``own``) and of the lse (``total``); the slot that is the destination.
    Cached and shared by every call of its plan and shape: the mappings are read-only."""

    rows: Mapping[int, int]
    sizes: Mapping[int, int]
    lse_shapes: Mapping[int, tuple[int, int, int, int]]
    starts: Mapping[int, int]
    row_starts: Mapping[int, int]
    own: int
    total: int
    in_dest: int | None


@functools.lru_cache(maxsize=1024)
def slot_layout(
    slots: tuple[Slot, ...],
    held: tuple[int, ...],
    seq_len: int,
    batch: int,
    heads: int,
    with_dest: bool,
) -> SlotLayout:
    """The :class:`SlotLayout` of the ``held`` slots over ``seq_len`` positions, ``batch``
    elements and ``heads`` heads, the rate-1 slot in the destination where ``with_dest``:
    plain values of the plan and the call's shapes, so computed once per plan and shape and
    cached (a slotted call's host time counts: Note [Position-grouped plans])."""
    if len(set(held)) != len(held):
        raise ValueError(f"held: slot indices must be distinct, got {held}")
    in_dest = _rate_one_slot(slots, held, seq_len) if with_dest else None
    rows = {i: slots[i].rows(seq_len) for i in held}
    sizes = {i: batch * rows[i] * heads for i in held}
    own = [size if i != in_dest else 0 for i, size in sizes.items()]
    shapes = {i: (batch, slots[i].segments(seq_len), heads, slots[i].segment_rows) for i in held}
    return SlotLayout(
        rows=MappingProxyType(rows),
        sizes=MappingProxyType(sizes),
        lse_shapes=MappingProxyType(shapes),
        starts=MappingProxyType(dict(zip(held, _starts(list(sizes.values())), strict=True))),
        row_starts=MappingProxyType(dict(zip(held, _starts(own), strict=True))),
        own=sum(own),
        total=sum(sizes.values()),
        in_dest=in_dest,
    )


def _starts(sizes: Sequence[int]) -> list[int]:
    starts, total = [], 0
    for size in sizes:
        starts.append(total)
        total += size
    return starts


class SlotCall(Protocol):
    """What a call of a slotted plan adds to ``Call`` (``calls.py``)."""

    slot: int

    def whole_batch(self, seq_len: int) -> bool:
        """Whether the call's rows of every batch element are one view (else it runs one batch
        element at a time)."""
        ...

    def slot_rows(self, buffer: torch.Tensor) -> torch.Tensor:
        """(B, S * C, H, E) slot -> the call's (B * n, c, Hc, E) rows of it, a view."""
        ...

    def slot_lse(self, buffer: torch.Tensor) -> torch.Tensor:
        """(B, S, H, C) slot lse -> the call's (B * n, Hc, c), a view."""
        ...

    def kv_slot_rows(self, buffer: torch.Tensor) -> torch.Tensor:
        """(B, N, Hkv, E) key slot -> the call's key rows (B * n, c, Hkc, E), a view."""
        ...


# -- the torch passes ------------------------------------------------------------------------------
def offset_views(
    view: SlotView, dest: torch.Tensor, group: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(dest rows, slot rows)`` pairs, one per run of segments (the whole ones, then a shorter
    last one) and offset class ``s`` of ``view``: the rows ``seg * L + s + r * m`` of the heads
    ``s, s + r, ...`` of ``dest`` (B, Np, H, E) and of the view's rows, both (B, n, c, Hc, E).
    With ``group`` > 1, ``dest`` holds the H / group key/value heads and the view is a key slot
    in the query layout (Note [Key slots of GQA plans] in ``key_slots.py``): the offset class's
    heads go to key/value heads ``s // group, s // group + r / group, ...``."""
    batch, positions, dest_heads, dim = dest.shape
    heads = dest_heads * group
    length, rate, per_segment = view.segment_len, view.rate, view.segment_rows
    full, rest = divmod(positions, length)
    compact = view.rows.reshape(batch, -(-positions // length), per_segment, heads, -1)
    pairs = []
    for first, count, run in ((0, full, length), (full, 1, rest)):
        if count == 0 or run == 0:
            continue
        by_offset = dest[:, first * length : first * length + count * run]
        by_offset = by_offset.view(batch, count, run, dest_heads, dim)
        part = compact[:, first : first + count]
        for s in range(min(rate, heads, run)):
            rows = len(range(s, run, rate))
            kv = slice(s // group, None, max(1, rate // group))
            pairs.append((by_offset[:, :, s::rate, kv], part[:, :, :rows, s::rate]))
    return pairs


def merge_slots_torch(views: Sequence[SlotView], out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge the slot ``views`` into ``out`` (B, N, H, D) and ``lse`` (B, H, N) with torch ops
    (Note [Branch slots merged once]): float32 accumulators, one rounding."""
    acc, acc_lse = _accumulators(out, -float("inf"))
    for view in views:
        if view.lse is None:
            raise ValueError("merging needs every slot's lse")
        lse_rows = view.lse.transpose(-1, -2).unsqueeze(-1)  # (B, n, L/r, H, 1)
        lse_view = SlotView(lse_rows.flatten(1, 2), None, view.segment_len, view.rate)
        for (dest, part), (dest_lse, part_lse) in zip(
            offset_views(view, acc), offset_views(lse_view, acc_lse), strict=True
        ):
            merged, merged_lse = merge_partial(
                dest, dest_lse.squeeze(-1), part, part_lse.squeeze(-1)
            )
            dest.copy_(merged)
            dest_lse.copy_(merged_lse.unsqueeze(-1))
    out.copy_(acc)
    lse.copy_(acc_lse.squeeze(-1).transpose(1, 2))


def sum_slots_torch(views: Sequence[SlotView], grad: torch.Tensor) -> None:
    """Write the sum of the slot ``views``' rows into ``grad`` (B, N, H, D): float32, one
    rounding."""
    acc, _ = _accumulators(grad, 0.0)
    for view in views:
        for dest, part in offset_views(view, acc):
            dest.add_(part)
    grad.copy_(acc)


def _accumulators(like: torch.Tensor, lse_fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (float64 for float64) zeros shaped like ``like`` (B, N, H, D) and an lse
    (B, N, H, 1) filled with ``lse_fill``."""
    dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    acc = torch.zeros(like.shape, dtype=dtype, device=like.device)
    lse = torch.full((*like.shape[:3], 1), lse_fill, dtype=dtype, device=like.device)
    return acc, lse


# -- the per-device kernels ------------------------------------------------------------------------
class SlotKernels(Protocol):
    """One-pass kernels of a device: ``merge(views, out, lse)`` and ``sum(views, grad)``, with
    the arguments of :func:`merge_slots_torch` and :func:`sum_slots_torch`."""

    def merge(self, views: Sequence[SlotView], out: torch.Tensor, lse: torch.Tensor) -> None: ...

    def sum(self, views: Sequence[SlotView], grad: torch.Tensor) -> None: ...


_SLOT_KERNELS: dict[str, Callable[[], SlotKernels | None]] = {}


def register_slot_kernels(device_type: str, load: Callable[[], SlotKernels | None]) -> None:
    """Give the executor one-pass slot kernels on ``device_type``; ``load()`` returns them, or
    None where they cannot be loaded (then the torch passes run)."""
    _SLOT_KERNELS[device_type] = load


def _kernels(like: torch.Tensor) -> SlotKernels | None:
    if like.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return None
    load = _SLOT_KERNELS.get(like.device.type)
    return None if load is None else load()


def merge_slots(views: Sequence[SlotView], out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge the slot ``views`` into ``out`` (B, N, H, D, last dim contiguous) and ``lse``
    (B, H, N), one rounding; the device's kernel where one is registered."""
    kernels = _kernels(out)
    if kernels is None:
        merge_slots_torch(views, out, lse)
    else:
        kernels.merge(views, out, lse)


def sum_slots(views: Sequence[SlotView], grad: torch.Tensor) -> None:
    """Write the float32 sum of the slot ``views``' rows into ``grad`` (B, N, H, D), one
    rounding."""
    kernels = _kernels(grad)
    if kernels is None:
        sum_slots_torch(views, grad)
    else:
        kernels.sum(views, grad)
