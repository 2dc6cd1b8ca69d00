"""The key and value gradient slots of GQA plans: a branch's key gradients by position, or in
the query slots' layout where its rate is a multiple of the group (beside the query slots of
``slots.py``, whose merge and sums they share).

Note [Key slots of GQA plans]
    Without GQA a key row of head ``h`` meets one call per branch, that of query head ``h``'s
    offset class, so dk and dv share the query slots' layout. With GQA (``g = H / Hkv`` query
    heads per key/value head) the strided calls of a branch still write each (position,
    key/value head) at most once: an offset class ``s`` reads the key rows ``s + r * m`` only
    (Note [Strided row calls] in ``strided.py``). Two layouts follow, per branch
    (:class:`KeySlots`):

    - ``r`` a multiple of ``g``: a key/value head's ``g`` query heads have ``g`` distinct
      offsets, and each call runs one key/value head per query head (a strided slice of step
      ``r / g``, or a diagonal call's shared head read one position further per head), so the
      key rows of query head ``h`` at offset ``h mod r`` are key/value head ``h // g``'s alone:
      the key slot has the query slots' layout, (B, S * C, H, D), each call writing its key
      gradients through the rows it writes dq through. It takes ``1 / r`` of q, where a slot by
      position takes ``1 / g``, only ``g / r`` of it written (the rest zeros): at 256K tokens
      the backward of LongNet's rates 1-128 at ``g = 4`` reached FA4's calls holding 1.8 units
      of q less (5.5 GiB instead of 7.3, ``dilated_gqa_keyslots_h100``).
    - otherwise (``r`` below ``g``, or not a multiple of it): by position, (B, N, Hkv, D), each
      call writing its key rows through the same view it read them with (the kernel sums the
      query heads of one key/value head: native GQA). Where ``r`` divides ``g`` every offset
      class holds query heads of every key/value head, so every key row is written; elsewhere
      the slot is zeroed first.

    One pass sums a position's slots over the branches in float32 and rounds once: the slots by
    position as a stack, then each slot in the query layout, its offset class ``s`` adding into
    the positions ``s + r * m`` of the key/value heads ``s // g, s // g + r / g, ...``; where the
    slot's segments are whole and its rate divides them, all classes at once through one
    strided view of the sum. (With one add per class, up to 16 small launches per slot and
    group, FA4's GQA training at 16K-64K ran 7-10% slower than in the records before the query
    layout, where the fused kernels' times held within 3%.) Key slots take ``1 / g`` of q per
    branch by position and ``1 / r`` per branch in the query layout, and are cut into position
    groups with the query slots.

Shape legend: B batch, N' positions, H query heads, Hkv key/value heads (g = H / Hkv), D head
dim, S segments of a branch, C rows of a segment in its slot, r the branch's rate.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .slots import Slot, SlotBuffers, SlotCall, SlotView, dest_slot, offset_views

__all__ = ["KeySlots", "key_rows_covered", "query_layout"]


class KeySlots:
    """The key (or value) gradient slots of a GQA plan (Note [Key slots of GQA plans]): slot
    ``i`` of the ``held`` ones is (B, N', Hkv, D) by position over the positions of ``like``
    (B, N', Hkv, D), zeroed where its branch's calls leave rows unwritten, or, where its rate is
    a multiple of ``group_size``, (B, S * C, H, D) in the query slots' layout; with ``dest``,
    the slot of the first rate-1 branch that covers every position is ``dest`` itself (Note [A
    rate-1 slot is its destination] in ``slots.py``).

    Attributes:
        flat: the other slots by position, (len, B, N', Hkv, D).
        by_queries: the slots in the query slots' layout.
        in_dest: the index of the slot that is ``dest``, or None.
    """

    def __init__(
        self,
        slots: Sequence[Slot],
        like: torch.Tensor,
        group_size: int,
        held: Sequence[int] | None = None,
        dest: torch.Tensor | None = None,
    ) -> None:
        batch, positions, kv_heads, dim = like.shape
        held = tuple(range(len(slots))) if held is None else tuple(held)
        self.group_size = group_size
        self.query_layout = {i for i in held if query_layout(slots[i].rate, group_size)}
        by_position = [i for i in held if i not in self.query_layout]
        self.in_dest = None if dest is None else dest_slot(slots, by_position, positions, like,
                                                           dest)  # fmt: skip
        self._dest = dest if self.in_dest is not None else None
        self.held = tuple(i for i in by_position if i != self.in_dest)
        self._index = {slot: i for i, slot in enumerate(self.held)}
        self.flat = torch.empty((len(self.held), *like.shape), dtype=like.dtype, device=like.device)
        for i, slot in enumerate(self.held):
            if not key_rows_covered(slots[slot].rate, group_size):
                self.flat[i].zero_()
        queries = like[:, :, :1].expand(batch, positions, kv_heads * group_size, dim)
        self.by_queries = SlotBuffers(slots, queries, positions, with_lse=False,
                                      held=sorted(self.query_layout))  # fmt: skip

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The buffers the calls write and the sum reads."""
        return self.flat, self.by_queries.flat

    def out(self, index: int) -> torch.Tensor:
        """Slot ``index``: (B, N', Hkv, D) by position (``dest`` itself for the rate-1 slot
        that is it), or (B, S * C, H, D) in the query layout."""
        if index in self.query_layout:
            return self.by_queries.out(index)
        if index == self.in_dest and self._dest is not None:  # (in_dest is set with it)
            return self._dest
        return self.flat[self._index[index]]

    def call_rows(self, call: SlotCall, batch: slice) -> torch.Tensor:
        """The key rows ``call`` writes of its slot, for batch elements ``batch``: (B' * n, c,
        Hkc, D), a view."""
        if call.slot in self.query_layout:
            return self.by_queries.call_rows(call, batch)
        return call.kv_slot_rows(self.out(call.slot)[batch])

    def views(
        self, batch: slice = slice(None), start: int = 0, end: int | None = None
    ) -> list[torch.Tensor | SlotView]:
        """The held slots over positions ``[start, end)`` of batch elements ``batch``: one
        (len, B', N'', Hkv, D) view of the slots by position (the one that is ``dest`` as a
        stack of its own), and a :class:`SlotView` of each slot in the query layout."""
        by_position = [self.flat[:, batch, start:end]]
        if self._dest is not None:
            by_position.append(self._dest[batch, start:end].unsqueeze(0))
        return [*by_position, *self.by_queries.views(batch, start, end)]

    def sum_into(self, grad: torch.Tensor, extra: Sequence[torch.Tensor | SlotView] = ()) -> None:
        """Write the float32 sum of every held slot and the ``extra`` views (``views`` of the
        spanning slots) into ``grad`` (B, N', Hkv, D), one rounding."""
        dtype = torch.float64 if grad.dtype == torch.float64 else torch.float32
        views = [*self.views(), *extra]  # every read before grad (maybe dest) is written
        stacks = [v for v in views if not isinstance(v, SlotView) and v.shape[0]]
        if stacks:
            total = stacks[0].sum(0, dtype=dtype)
        else:
            total = torch.zeros(grad.shape, dtype=dtype, device=grad.device)
        for stack in stacks[1:]:
            total.add_(stack.sum(0, dtype=dtype))
        for view in views:
            if isinstance(view, SlotView):
                for dest, part in _key_pairs(view, total, self.group_size):
                    dest.add_(part)
        grad.copy_(total)


def key_rows_covered(rate: int, group_size: int) -> bool:
    """Whether the calls of a branch at ``rate`` write every key row of every key/value head
    whose query heads are ``group_size`` consecutive ones (Note [Key slots of GQA plans]): where
    ``rate`` divides ``group_size``, the group's query heads take every offset."""
    return group_size % rate == 0


def query_layout(rate: int, group_size: int) -> bool:
    """Whether a GQA plan's key slot of a branch of ``rate`` has the query slots' layout: its
    rate is a multiple of the ``group_size`` query heads of a key/value head (Note [Key slots of
    GQA plans])."""
    return rate % group_size == 0


def _key_pairs(
    view: SlotView, dest: torch.Tensor, group: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``offset_views`` (``slots.py``) of a key slot in the query layout (Note [Key slots of GQA
    plans]) into ``dest`` (B, Np, Hkv, E), as one pair where the view's segments are whole and
    its rate divides them and the heads (or passes the heads): head ``h = t * r + a * g + i``
    holds, at row ``m``, position ``(a * g + i) + r * m`` of key/value head ``t * r / g + a``,
    one strided view of ``dest`` (one sum instead of one per offset class); else the offset
    classes' pairs."""
    batch, positions, kv_heads, dim = dest.shape
    heads, length, rate = kv_heads * group, view.segment_len, view.rate
    whole = positions % length == 0 and length % rate == 0
    if not whole or not (rate >= heads or heads % rate == 0):
        return offset_views(view, dest, group)
    segments, per_segment = positions // length, length // rate
    runs, offsets = max(1, heads // rate), min(rate, heads) // group  # t and a
    s_b, s_n, s_h, s_d = dest.stride()
    target = dest.as_strided(
        (batch, segments, per_segment, runs, offsets, group, dim),
        (s_b, length * s_n, rate * s_n, rate // group * s_h, group * s_n + s_h, s_n, s_d),
        dest.storage_offset(),
    )
    part = view.rows.reshape(batch, segments, per_segment, runs, offsets, group, dim)
    return [(target, part)]
