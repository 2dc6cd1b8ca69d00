"""Dilated rows as strided views: kernel calls that read and write their rows in place.

Note [Strided row calls]
    The rows of the heads with offset ``s`` in every segment of a run are a plain strided view
    of the tensor: ``x.view(B, n, L, H, D)[:, :, s::r, s::r]``, shaped (B * n, c_s, Hc, D) with
    ``c_s = ceil((L - s) / r)`` rows, a row stride of ``r * H * D`` and a head stride of ``r * D``
    (LongNet Sec. 2.3: head ``j`` has offset ``j mod r``). A kernel that reads arbitrary strides
    (FlashAttention-4 does) can then run every offset class of a branch with no gather and write
    its result back through the same view, instead of ``index_select`` / ``index_copy`` (Note
    [Row groups] in ``segment.py``). One call per offset class: ``min(r, H)`` calls per run of
    segments. Ragged branches are views too: where ``r`` does not divide ``L`` the offset classes
    differ in row count (each is its own call anyway), and a shorter last segment is a run of its
    own. The batch and segment dimensions merge into one stride where the run covers the
    sequence (or the batch has one element); a run of whole segments before a shorter last one
    is a view per batch element only (:meth:`StridedCall.whole_batch`).

    Grouped-query attention keeps its key/value heads as a strided view too when the query heads
    ``s, s + r, ...`` map onto key/value heads with one step and one repeat: without GQA (their
    own heads, step ``r``), when ``r`` is a multiple of the group size ``g = H / Hkv`` (step
    ``r / g``, each once) or when ``g`` is a multiple of ``r`` (every key/value head, each used
    by ``g / r`` consecutive query heads of the call: the kernel's native GQA). Other
    combinations keep the gathers.

    A backend reads these views only when it declares ``reads_strided_rows``; the others get
    contiguous gathered rows as before.

Note [Diagonal head calls]
    An offset class holds ``H / r`` heads, so a branch with ``r > H / r`` makes ``r`` calls of
    few heads each (16 calls of one head for ``r = 16, H = 16``): small grids and a launch per
    class. Cut the other way, consecutive heads ``h0 .. h0 + k - 1`` whose offsets are
    consecutive too (``h0 mod r + k <= r``) put head ``h0 + j`` at offset ``s0 + j``: its rows
    sit one position and one head further than the previous head's, a strided view with a head
    stride of ``(H + 1) * D`` (``as_strided`` over q's strides), shaped (B * n, c, k, D), where
    those offset classes have the same row count ``c``. A row group (Note [Row groups] in
    ``segment.py``) takes such diagonal calls, one per maximal run of its heads, where they are
    fewer than its offset classes: ``H / r`` calls of ``r`` heads for ``r > H / r`` where ``r``
    divides ``H`` and ``L``, 3 calls for the paper's ``r = 12`` over 16 heads of segments that
    leave offsets 0-3 one row more (heads 0-3, 4-11, 12-15) instead of 12. Each head of a
    diagonal call reads keys at its own offset, so without GQA its key/value heads are its own
    (the same view of k and v). With GQA a run stops where the key/value head changes: its heads
    share one key/value head, whose rows for head ``h0 + j`` sit ``j`` positions further, a
    view with the position stride as its head stride (LongNet's r = 16 over 16 heads sharing 4
    key/value heads: 4 calls of 4 heads instead of 16 of one). Only where the group size ``g``
    is at most ``r``: above it a key/value head's ``g`` query heads repeat offsets, so several
    of its runs would read and write the same key rows, whose gradients must add up (a key
    slot takes one write per row, Note [Key slots of GQA plans] in ``key_slots.py``); its offset
    classes (the kernel's native GQA) sum them instead. Key masks become per head
    ((B * n, k, c)).

Shape legend: B batch, N positions, H query heads, Hkv key/value heads, D head dim, n segments of
a run, L segment length, c rows of a segment in one call, Hc / Hkc heads of one call.
"""

from __future__ import annotations

import copy

import torch

from ..higher_order import RowCall
from .calls import put_view
from .slots import segment_rows


class StridedCall:
    """The rows of offset ``s`` of a run of ``n`` segments of length ``L`` from ``start`` in
    branch rate ``r``, as views (``Call`` in ``calls.py``; Note [Strided row calls])."""

    def __init__(
        self,
        start: int,
        num_segments: int,
        segment_len: int,
        rate: int,
        offset: int,
        kv_heads: slice,
        causal: bool,
    ) -> None:
        self.start, self.num_segments, self.segment_len = start, num_segments, segment_len
        self.rate, self.offset, self.kv_heads, self.causal = rate, offset, kv_heads, causal
        self.q_heads = slice(offset, None, rate)
        self.slot = -1  # the branch slot the call writes into (Note [Branch slots merged once])
        self.slot_segment_len = segment_len  # the segment length of that slot's branch

    @property
    def rows(self) -> int:
        """c: the call's rows in each segment."""
        return len(range(self.offset, self.segment_len, self.rate))

    def whole_batch(self, seq_len: int) -> bool:
        """Whether the call's rows of every batch element are one view over ``seq_len``
        positions: a single segment, or a run that covers the sequence (Note [Strided row
        calls]); else the executor runs it one batch element at a time."""
        return self.num_segments == 1 or self.num_segments * self.segment_len == seq_len

    def in_slot(self, slot: int, segment_len: int) -> StridedCall:
        """This call writing into branch slot ``slot`` of a branch of ``segment_len`` (a copy;
        a shorter last segment's call has a shorter ``segment_len`` of its own)."""
        call = copy.copy(self)
        call.slot, call.slot_segment_len = slot, segment_len
        return call

    @property
    def slot_heads(self) -> slice:
        """The call's heads of its slot (Note [Branch slots merged once] in ``slots.py``)."""
        return self.q_heads

    def _slot_block(self, buffer: torch.Tensor, per_segment: int) -> torch.Tensor:
        """The call's segments of a slot buffer of ``per_segment`` entries a segment along dim
        1, (B, S * per_segment, ...) -> (B * n, per_segment, ...), a view (``view`` raises where
        the run's batch elements are not one stride: the executor splits those, see
        :meth:`whole_batch`)."""
        first = self.start // self.slot_segment_len * per_segment
        block = buffer[:, first : first + self.num_segments * per_segment]
        return block.view(buffer.shape[0] * self.num_segments, per_segment, *buffer.shape[2:])

    def slot_rows(self, buffer: torch.Tensor) -> torch.Tensor:
        """(B, S * C, H, E) slot of the branch -> the call's rows (B * n, c, Hc, E), a view:
        row ``seg * C + m`` holds position ``seg * Lb + s + r * m`` of the heads at offset ``s``
        (``C = ceil(Lb / r)`` rows for each of the branch's segments of ``Lb``)."""
        per_segment = segment_rows(self.slot_segment_len, self.rate)
        return self._slot_block(buffer, per_segment)[:, : self.rows, self.slot_heads]

    def slot_lse(self, buffer: torch.Tensor) -> torch.Tensor:
        """(B, S, H, C) slot lse -> the call's (B * n, Hc, c), a view."""
        return self._slot_block(buffer, 1).squeeze(1)[:, self.slot_heads, : self.rows]

    def kv_slot_rows(self, buffer: torch.Tensor) -> torch.Tensor:
        """(B, N, Hkv, E) key slot (Note [Key slots of GQA plans] in ``key_slots.py``) -> the call's
        key rows (B * n, c, Hkc, E): the view :meth:`kv_rows` reads of k (``view`` raises where
        the run's batch elements are not one stride, see :meth:`whole_batch`)."""
        rows = self._rows(buffer, self.kv_heads)
        return rows.view(rows.shape[0] * rows.shape[1], *rows.shape[2:])

    def within(self, start: int, end: int) -> StridedCall | None:
        """The call cut to positions ``[start, end)``, in the coordinates of ``x[:, start:end]``,
        or None where it has no row there; ``start`` falls on a segment boundary and ``end`` on
        one or on the end of the call's run (Note [Position-grouped plans] in ``grouped.py``)."""
        length = self.segment_len
        first = max(self.start, start)
        stop = min(self.start + self.num_segments * length, end)
        if stop <= first:
            return None
        if (stop - first) % length:
            raise RuntimeError(
                f"a position group [{start}, {end}) cuts a segment of the call's run from "
                f"{self.start} ({self.num_segments} x {length}): groups end on segment bounds"
            )
        cut = copy.copy(self)
        cut.start, cut.num_segments = first - start, (stop - first) // length
        return cut

    def _rows(self, x: torch.Tensor, heads: slice) -> torch.Tensor:
        """The call's rows of ``x`` (B, N, Hx, E): (B, n, c, Hx', E), a view."""
        batch, _, heads_x, dim = x.shape
        n, length = self.num_segments, self.segment_len
        block = x[:, self.start : self.start + n * length].view(batch, n, length, heads_x, dim)
        return block[:, :, self.offset :: self.rate, heads]

    def _view(self, x: torch.Tensor, heads: slice) -> torch.Tensor:
        """(B, N, Hx, E) -> (B * n, c, Hx', E): a view where the batch and segment dimensions
        merge into one stride (:meth:`whole_batch`, or a batch of 1), else a copy."""
        rows = self._rows(x, heads)
        return rows.reshape(rows.shape[0] * rows.shape[1], *rows.shape[2:])  # no -1: batch 0

    def _put(self, dest: torch.Tensor, heads: slice, rows: torch.Tensor, accumulate: bool) -> None:
        view = self._rows(dest, heads)
        put_view(view, rows.reshape(view.shape), accumulate)

    def q_rows(self, x: torch.Tensor) -> torch.Tensor:
        return self._view(x, self.q_heads)

    def kv_rows(self, x: torch.Tensor) -> torch.Tensor:
        return self._view(x, self.kv_heads)

    def key_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """(B, N) bool -> (B * n, 1, c)."""
        if mask is None:
            return None
        rows = self._view(mask.view(*mask.shape, 1, 1), slice(None))
        return rows.reshape(rows.shape[0], 1, rows.shape[1])

    def put_q(self, dest: torch.Tensor, rows: torch.Tensor, *, accumulate: bool) -> None:
        self._put(dest, self.q_heads, rows, accumulate)

    def put_kv(self, dest: torch.Tensor, rows: torch.Tensor, *, accumulate: bool) -> None:
        self._put(dest, self.kv_heads, rows, accumulate)

    def row_call(self, q: torch.Tensor, k: torch.Tensor) -> RowCall:
        num_heads, num_kv_heads, device = q.shape[2], k.shape[2], q.device
        n, length, rate = self.num_segments, self.segment_len, self.rate
        base = self.start + torch.arange(n, device=device) * length  # (n,)
        rows = (self.offset + rate * torch.arange(self.rows, device=device)).view(1, -1, 1)
        q_heads = torch.arange(num_heads, device=device)[self.q_heads].view(1, 1, -1)
        kv_heads = torch.arange(num_kv_heads, device=device)[self.kv_heads].view(1, 1, -1)
        positions = base.view(-1, 1, 1) + rows
        q_index = (positions * num_heads + q_heads).view(n, -1)
        kv_index = (positions * num_kv_heads + kv_heads).view(n, -1)
        return RowCall(q_index, kv_index, q_heads.numel(), kv_heads.numel(), self.causal)


class DiagonalCall(StridedCall):
    """The heads ``h0 .. h0 + k - 1`` of a run of segments, head ``h0 + j`` at offset
    ``h0 mod r + j`` (Note [Diagonal head calls]), every offset class of the call with the same
    row count; with GQA (``group_size`` query heads per key/value head) the heads share one
    key/value head."""

    def __init__(
        self,
        start: int,
        num_segments: int,
        segment_len: int,
        rate: int,
        first_head: int,
        num_heads: int,
        causal: bool,
        group_size: int = 1,
    ) -> None:
        heads = slice(first_head, first_head + num_heads)
        kv_heads = heads
        if group_size > 1:
            kv_head = first_head // group_size
            if (first_head + num_heads - 1) // group_size != kv_head:
                raise ValueError(
                    f"a diagonal call's heads {first_head}..{first_head + num_heads - 1} must "
                    f"share one key/value head (group size {group_size})"
                )
            kv_heads = slice(kv_head, kv_head + 1)
        super().__init__(start, num_segments, segment_len, rate, first_head % rate, kv_heads,
                         causal)  # fmt: skip
        self.q_heads = heads
        self.first_head, self.num_heads, self.group_size = first_head, num_heads, group_size

    @property
    def slot_heads(self) -> slice:
        return self.q_heads

    def _rows(self, x: torch.Tensor, heads: slice) -> torch.Tensor:
        """(B, N, Hx, E) -> (B, n, c, k, E), a view: row ``m`` of head ``h0 + j`` at position
        ``seg * L + s0 + j + r * m`` (one position and one head further per head: a head stride
        of the position and head strides together); for the shared key/value head of a GQA
        call, one position further per head (a head stride of the position stride)."""
        batch, _, _, dim = x.shape
        s_b, s_n, s_h, s_d = x.stride()
        shared = self.group_size > 1 and heads is self.kv_heads
        first = x.storage_offset() + (self.start + self.offset) * s_n + heads.start * s_h
        shape = (batch, self.num_segments, self.rows, self.num_heads, dim)
        head_stride = s_n if shared else s_n + s_h
        strides = (s_b, self.segment_len * s_n, self.rate * s_n, head_stride, s_d)
        return x.as_strided(shape, strides, first)

    def key_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """(B, N) bool -> (B * n, k, c): each head's keys at its own offset."""
        if mask is None:
            return None
        s_b, s_n = mask.stride()
        first = mask.storage_offset() + (self.start + self.offset) * s_n
        shape = (mask.shape[0], self.num_segments, self.num_heads, self.rows)
        strides = (s_b, self.segment_len * s_n, s_n, self.rate * s_n)
        rows = mask.as_strided(shape, strides, first)
        return rows.reshape(mask.shape[0] * self.num_segments, self.num_heads, self.rows)

    def row_call(self, q: torch.Tensor, k: torch.Tensor) -> RowCall:
        total_heads, kv_heads, device = q.shape[2], k.shape[2], q.device
        n, length, rate, count = self.num_segments, self.segment_len, self.rate, self.num_heads
        base = self.start + torch.arange(n, device=device) * length  # (n,)
        steps = torch.arange(count, device=device)
        rows = rate * torch.arange(self.rows, device=device).view(-1, 1) + self.offset + steps
        positions = base.view(-1, 1, 1) + rows  # (n, c, k)
        index = (positions * total_heads + self.first_head + steps).view(n, -1)
        if self.group_size == 1:
            return RowCall(index, index, count, count, self.causal)
        kv_index = (positions * kv_heads + self.kv_heads.start).view(n, -1)
        return RowCall(index, kv_index, count, count, self.causal)


def kv_head_slice(offset: int, rate: int, num_heads: int, num_kv_heads: int) -> slice | None:
    """The key/value heads of the query heads ``offset::rate`` as one strided slice, each used
    by the same number of consecutive query heads, or None where they are not (Note [Strided row
    calls])."""
    group = num_heads // num_kv_heads
    if group == 1:
        return slice(offset, None, rate)
    if rate % group == 0:
        return slice(offset // group, None, rate // group)
    if group % rate == 0:
        return slice(None)
    return None
