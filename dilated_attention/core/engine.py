"""The one executor: run a plan of kernel calls, merge their results, and differentiate exactly.

Note [One executor]
    Dense attention, dilated attention through gathers, block-sparse attention on any dense
    kernel, and the local pieces of the ring paths are all *plans*: lists of kernel calls, each
    reading some query rows against some key/value rows (:class:`Call`). A call says how its rows
    are read and written back; the executor does the rest, the same way for every plan: each
    call's ``(out, lse)`` merged into float32 accumulators (Note [Merging partial softmaxes]),
    then the backward replaying every call with the merged statistics. Row addressing comes in
    four kinds: the whole tensors (:class:`WholeCall`, dense attention), slices of positions
    (:class:`SliceCall`, ring attention's calls against a key/value block), dilated row groups
    (``GroupCall`` in ``segment.py``) and stacked index lists (``SparseCall`` in
    ``block_sparse/plan.py``). A dilated plan on a kernel that writes into given buffers runs
    its calls into branch slots merged once instead (Note [Branch slots merged once] in
    ``slots.py``). :class:`PlanRunner` runs a plan under the one autograd Function
    (Note [One autograd Function] in ``autograd.py``); the ring paths drive the runners
    (:func:`run_forward`, :func:`run_backward`) block by block in runners of their own, which
    own the communication; kernels that run a whole plan themselves (the fused dilated Triton
    kernels, ``fused.py``; our block-sparse Triton kernels) are runners too.

Note [Exact gradients through the branch mix]
    The forward merges each group's ``(o_i, lse_i)`` into a running ``(out, lse)``
    (Note [Merging partial softmaxes]), which is LongNet Eq. 10: one softmax over the multiset union
    of the branches' keys. The mixing weights ``exp(lse_i - LSE)`` depend on q and k, so their
    gradient matters. Writing the merged result as that single softmax, its gradient with respect to
    the rows of branch ``i`` is exactly one attention backward over those rows with the *merged*
    ``out`` and ``LSE`` (Note [Backward with external statistics]). The backward therefore re-reads
    each group's rows, calls the kernel's backward with the merged statistics, and adds the row
    gradients into dq, dk, dv: no per-branch outputs are stored, and torchscale's no-grad weights
    are avoided.

Shape legend: B batch, N seq_len, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, cast

import torch

from .autograd import Backward, Forward, Grads, Inputs
from .contract import KernelBackend, KernelOutput
from .higher_order import RowCall, differentiable_grads, no_higher_order_message
from .merge import merge_partial
from .slots import KeySlots, Slot, SlotBuffers, SlotCall, SlotView, merge_slots


class Call(Protocol):
    """One kernel call of a plan: how it reads its rows and writes them back.

    A call reads ``G`` pieces of ``Lq`` query rows with ``Hc`` heads against ``Lk`` key/value
    rows with ``Hkc`` heads each; the pieces are stacked along the batch dimension.
    """

    causal: bool  # top-left causal within each piece

    def q_rows(self, x: torch.Tensor) -> torch.Tensor:
        """(B, Nq, H, E) -> (B * G, Lq, Hc, E): the call's rows of a query-side tensor."""
        ...

    def kv_rows(self, x: torch.Tensor) -> torch.Tensor:
        """(B, Nk, Hkv, E) -> (B * G, Lk, Hkc, E): the call's rows of a key-side tensor."""
        ...

    def key_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """(B, Nk) bool (``True`` = ignore) -> the kernels' (B * G, 1 or Hc, Lk), or None."""
        ...

    def put_q(self, dest: torch.Tensor, rows: torch.Tensor, *, accumulate: bool) -> None:
        """Write (or add) ``rows`` (B * G, Lq, Hc, E) into ``dest`` (B, Nq, H, E) in place."""
        ...

    def put_kv(self, dest: torch.Tensor, rows: torch.Tensor, *, accumulate: bool) -> None:
        """Write (or add) ``rows`` (B * G, Lk, Hkc, E) into ``dest`` (B, Nk, Hkv, E)."""
        ...

    def row_call(self, q: torch.Tensor, k: torch.Tensor) -> RowCall:
        """The call's rows as flat (position, head) indices, for the double backward."""
        ...


@dataclass(frozen=True)
class WholeCall:
    """Every row of q against every row of k and v, as they are (dense attention)."""

    causal: bool
    reads_all_queries: ClassVar[bool] = True  # Plan.one_call

    def q_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def kv_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def key_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        return None if mask is None else mask.unsqueeze(1)

    def put_q(self, dest: torch.Tensor, rows: torch.Tensor, *, accumulate: bool) -> None:
        _put_slice(dest, slice(None), rows, accumulate)

    put_kv = put_q

    def row_call(self, q: torch.Tensor, k: torch.Tensor) -> RowCall:
        positions = [torch.arange(x.shape[1], device=q.device).view(1, -1) for x in (q, k)]
        return RowCall.from_positions(*positions, q.shape[2], k.shape[2], self.causal)


@dataclass(frozen=True)
class SliceCall:
    """Query rows ``q`` against key/value rows ``kv``, both slices of positions (views, no
    copies; ring attention's calls against one key/value block)."""

    q: slice
    kv: slice
    causal: bool

    def q_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, self.q]

    def kv_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, self.kv]

    def key_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        return None if mask is None else mask[:, None, self.kv]

    def put_q(self, dest: torch.Tensor, rows: torch.Tensor, *, accumulate: bool) -> None:
        _put_slice(dest, self.q, rows, accumulate)

    def put_kv(self, dest: torch.Tensor, rows: torch.Tensor, *, accumulate: bool) -> None:
        _put_slice(dest, self.kv, rows, accumulate)

    def row_call(self, q: torch.Tensor, k: torch.Tensor) -> RowCall:
        positions = [
            torch.arange(rows.start, rows.stop, device=q.device).view(1, -1)
            for rows in (self.q, self.kv)
        ]
        return RowCall.from_positions(*positions, q.shape[2], k.shape[2], self.causal)


def put_view(view: torch.Tensor, values: torch.Tensor, accumulate: bool) -> None:
    """Write (or add) ``values`` into ``view``, a view of a call's destination, in place (a
    16-bit ``values`` adds into a float32 ``view`` in one pass, without a float32 copy)."""
    if not accumulate:
        view.copy_(values)
    elif torch.promote_types(view.dtype, values.dtype) == view.dtype:
        view.add_(values)
    else:
        view.add_(values.to(view.dtype))


def _put_slice(dest: torch.Tensor, rows: slice, values: torch.Tensor, accumulate: bool) -> None:
    put_view(dest[:, rows], values, accumulate)


@dataclass(frozen=True)
class PositionGroup:
    """The calls of a plan cut to positions ``[start, end)``, in the coordinates of
    ``x[:, start:end]`` (Note [Position-grouped plans] in ``grouped.py``)."""

    start: int
    end: int
    calls: tuple[Call, ...]


@dataclass(frozen=True)
class Plan:
    """The kernel calls of one attention call.

    Attributes:
        calls: in the order they run (the backward replays them in the same order).
        groups: when not empty, the same calls cut into position groups, which the executor
            runs one batch element and group at a time with float32 scratch of the group's size
            (Note [Position-grouped plans]); ``calls`` still describes the whole plan.
        grouped_forward: the forward runs the groups too (a call without gradients); else it
            runs ``calls`` and only the backward runs the groups.
        slots: when not empty, each call writes into the slot ``call.slot`` of its branch and
            the slots merge once (Note [Branch slots merged once] in ``slots.py``); else every
            result merges into float32 accumulators as it comes.
        spanning: with ``groups``, the calls of the slots whose segments span groups: they run
            whole, once, before the groups, which read their parts of those slots.
        whole: a single :class:`WholeCall`: its kernel's results and gradients are the plan's,
            with no accumulators or merge.
        one_call: a single call that reads every query row as it is (``reads_all_queries``): its
            kernel's results are the plan's forward (its gradients may still need scattering).
    """

    calls: tuple[Call, ...]
    groups: tuple[PositionGroup, ...] = ()
    grouped_forward: bool = False
    slots: tuple[Slot, ...] = ()
    spanning: tuple[Call, ...] = ()

    @property
    def whole(self) -> bool:
        return len(self.calls) == 1 and isinstance(self.calls[0], WholeCall)

    @property
    def one_call(self) -> bool:
        return len(self.calls) == 1 and getattr(self.calls[0], "reads_all_queries", False)

    @classmethod
    def dense(cls, is_causal: bool) -> Plan:
        return cls((WholeCall(is_causal),))


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def new_accumulators(
    q: torch.Tensor, out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty merged results for queries like ``q`` (B, N, H, D): ``out`` (B, N, H, D) zeros and
    ``lse`` (B, N, H, 1) ``-inf``, both float32 (float64 for float64 inputs; ``out`` in
    ``out_dtype`` when given)."""
    batch, rows, heads, dim = q.shape
    acc = accumulator_dtype(q.dtype)
    out = torch.zeros(batch, rows, heads, dim, dtype=out_dtype or acc, device=q.device)
    lse = torch.full((batch, rows, heads, 1), float("-inf"), dtype=acc, device=q.device)
    return out, lse


def row_lse(lse: torch.Tensor) -> torch.Tensor:
    """(B, H, N) -> (B, N, H, 1), the layout a call reads its rows' statistics from."""
    return lse.transpose(1, 2).contiguous().unsqueeze(-1)


def _call_lse(call: Call, lse_rows: torch.Tensor) -> torch.Tensor:
    """The call's (B * G, Hc, Lq) statistics from (B, N, H, 1)."""
    return call.q_rows(lse_rows).squeeze(-1).transpose(1, 2)


#: How a call's result merges into the accumulators: ``(call, out, lse, part_out, part_lse)``
#: with ``out`` (B, Nq, H, D), ``lse`` (B, Nq, H, 1), ``part_out`` (B * G, Lq, Hc, D) and
#: ``part_lse`` (B * G, Hc, Lq) as the kernel returned them.
Merge = Callable[[Call, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


#: A fused in-place merge: ``(out, lse, part, part_lse)`` with ``out`` (B', L, Hc, D) and ``lse``
#: (B', L, Hc) float32 views of the accumulators, ``part`` (B', L, Hc, D) last dim contiguous and
#: ``part_lse`` (B', L, Hc), any strides.
InPlaceMerge = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
_IN_PLACE_MERGES: dict[str, Callable[[], InPlaceMerge | None]] = {}


def register_in_place_merge(device_type: str, load: Callable[[], InPlaceMerge | None]) -> None:
    """Give the executor a one-kernel merge for float32 accumulators on ``device_type``.

    ``load()`` returns the merge, or None where its kernel cannot be loaded (then the torch ops
    of :func:`~dilated_attention.core.merge.merge_partial` merge). The Triton backend registers
    CUDA's: it reads each output once and writes the merged row back, a quarter of the bytes of
    the torch ops (about ten passes over the call's rows).
    """
    _IN_PLACE_MERGES[device_type] = load


def _in_place_merge(out: torch.Tensor, lse: torch.Tensor) -> InPlaceMerge | None:
    if out.dtype != torch.float32 or lse.dtype != torch.float32:
        return None
    load = _IN_PLACE_MERGES.get(out.device.type)
    return None if load is None else load()


def _is_view_of(rows: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether ``rows`` (a call's rows of ``base``) is ``base`` or a view of it, so that writing
    into it writes ``base`` (a call's rows are a copy where they are gathered)."""
    return rows is base or rows._base is base


def merge_rows(
    call: Call, out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor
) -> None:
    """The executor's :data:`Merge`: merge the call's result into its rows of the accumulators
    (Note [Merging partial softmaxes]), in place with one kernel where one is registered
    (:func:`register_in_place_merge`): into the accumulators themselves where the call's rows
    are views, else into the gathered copy of its rows, which is then written back. Without a
    registered kernel: torch ops on the rows, written back."""
    rows, lse_rows = call.q_rows(out), call.q_rows(lse)
    fused = _in_place_merge(out, lse)
    if fused is not None:
        part = part_out if part_out.stride(-1) == 1 else part_out.contiguous()
        fused(rows, lse_rows.squeeze(-1), part, part_lse.transpose(1, 2))
        if _is_view_of(rows, out) and _is_view_of(lse_rows, lse):
            return
        new_out, new_lse = rows, lse_rows  # gathered copies, merged: write them back
    else:
        merged_out, merged_lse = merge_partial(
            rows, lse_rows.squeeze(-1), part_out, part_lse.transpose(1, 2)
        )
        new_out, new_lse = merged_out, merged_lse.unsqueeze(-1)
    call.put_q(out, new_out, accumulate=False)
    call.put_q(lse, new_lse, accumulate=False)


def _call_forward(
    call: Call,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    backend: KernelBackend,
    *,
    scale: float,
    dropout_p: float,
    into: KernelOutput | None = None,
) -> KernelOutput:
    """The kernel's forward on ``call``'s rows (into ``into`` where the backend writes there)."""
    return backend.forward(
        call.q_rows(q), call.kv_rows(k), call.kv_rows(v), scale=scale, is_causal=call.causal,
        key_mask=call.key_mask(key_padding_mask), dropout_p=dropout_p, into=into,
    )  # fmt: skip


def _call_backward(
    call: Call,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse_rows: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    aux: Any,
    backend: KernelBackend,
    *,
    scale: float,
    dropout_p: float,
    into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's backward on ``call``'s rows with the merged statistics ``out`` and
    ``lse_rows`` (B, Nq, H, 1); into ``into`` where the backend writes there."""
    return backend.backward(
        call.q_rows(dout), call.q_rows(q), call.kv_rows(k), call.kv_rows(v), call.q_rows(out),
        _call_lse(call, lse_rows), aux, scale=scale, is_causal=call.causal,
        key_mask=call.key_mask(key_padding_mask), dropout_p=dropout_p, into=into,
    )  # fmt: skip


def run_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    calls: Sequence[Call],
    backend: KernelBackend,
    *,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    auxes: list[Any],
    dropout_p: float = 0.0,
    merge: Merge | None = merge_rows,
) -> None:
    """Run ``calls`` and merge each result into ``out`` / ``lse`` in place.

    Args:
        q: (B, Nq, H, D); k, v: (B, Nk, Hkv, D): the rows the calls read.
        key_padding_mask: (B, Nk) bool (``True`` = ignore), or None.
        out: (B, Nq, H, D), ``lse``: (B, Nq, H, 1): accumulators (:func:`new_accumulators`), or,
            with ``merge=None``, buffers each call writes its rows into directly (calls that
            cover disjoint rows).
        auxes: each call's kernel ``aux`` is appended, in call order.
        merge: how a result merges in (:func:`merge_rows`).
    """
    for call in calls:
        res = _call_forward(call, q, k, v, key_padding_mask, backend, scale=scale,
                            dropout_p=dropout_p)  # fmt: skip
        auxes.append(res.aux)
        if merge is not None:
            merge(call, out, lse, res.out, res.lse)
        else:
            call.put_q(out, res.out, accumulate=False)
            call.put_q(lse, res.lse.transpose(1, 2).unsqueeze(-1), accumulate=False)


def run_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse_rows: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    calls: Sequence[Call],
    backend: KernelBackend,
    auxes: Iterator[Any],
    *,
    scale: float,
    dq: torch.Tensor,
    dk: torch.Tensor | None,
    dv: torch.Tensor | None,
    dropout_p: float = 0.0,
    kv_grads: Callable[[Call, torch.Tensor, torch.Tensor], None] | None = None,
) -> None:
    """Replay ``calls`` with the merged statistics and add their gradients into dq, dk, dv
    (Note [Exact gradients through the branch mix]).

    Args:
        dout, q, out: (B, Nq, H, D); k, v: (B, Nk, Hkv, D).
        lse_rows: (B, Nq, H, 1) merged log-sum-exp (:func:`row_lse` of the (B, H, Nq) one).
        auxes: the forward's ``aux`` values, consumed in call order.
        dq: (B, Nq, H, D); dk, dv: (B, Nk, Hkv, D): accumulators.
        kv_grads: where each call's key/value gradients (B * G, Lk, Hkc, D) go instead of
            ``dk`` / ``dv`` (ring attention sends them to the block's owner).
    """
    for call in calls:
        dq_rows, dk_rows, dv_rows = _call_backward(
            call, dout, q, k, v, out, lse_rows, key_padding_mask, next(auxes), backend,
            scale=scale, dropout_p=dropout_p,
        )  # fmt: skip
        call.put_q(dq, dq_rows, accumulate=True)
        if kv_grads is not None:
            kv_grads(call, dk_rows, dv_rows)
        elif dk is None or dv is None:
            raise TypeError("run_backward needs dk and dv accumulators, or kv_grads")
        else:
            call.put_kv(dk, dk_rows, accumulate=True)
            call.put_kv(dv, dv_rows, accumulate=True)


def _fill(dest: torch.Tensor, result: torch.Tensor) -> None:
    """Copy a kernel's ``result`` into ``dest``, unless the kernel wrote it there."""
    same = result.data_ptr() == dest.data_ptr() and result.stride() == dest.stride()
    if not same:
        dest.copy_(result)


def _batch_rows(call: Call, batch: int, seq_len: int) -> tuple[slice, ...]:
    """The batch rows a slot call runs on at once: all, or one batch element at a time where
    its rows are views only within one (a run of whole segments before a shorter last one,
    ``StridedCall.whole_batch``)."""
    if batch == 1 or cast(SlotCall, call).whole_batch(seq_len):
        return (slice(None),)
    return tuple(slice(b, b + 1) for b in range(batch))


def _rows_of(
    x: torch.Tensor | None, rows: slice | tuple[slice, slice]
) -> torch.Tensor | None:
    """``x[rows]``, or None for None (an optional key padding mask)."""
    return None if x is None else x[rows]


def fill_slots(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    calls: Sequence[Call],
    buffers: SlotBuffers,
    backend: KernelBackend,
    *,
    scale: float,
    auxes: list[Any],
    dropout_p: float = 0.0,
) -> None:
    """Run ``calls``, each writing its out and lse into its slot of ``buffers`` (Note [Branch
    slots merged once] in ``slots.py``).

    Args:
        q, k, v: (B, N, H, D), the positions the calls and ``buffers`` address.
        calls: calls with ``slot``, ``slot_rows`` and ``slot_lse`` (``StridedCall``).
        auxes: each call's kernel ``aux`` is appended, in call order (and batch order, for a
            call run one batch element at a time).
    """
    for call in calls:
        slotted = cast(SlotCall, call)
        for rows in _batch_rows(call, *q.shape[:2]):
            into = KernelOutput(
                slotted.slot_rows(buffers.out(slotted.slot)[rows]),
                slotted.slot_lse(buffers.lse(slotted.slot)[rows]),
            )
            res = _call_forward(call, q[rows], k[rows], v[rows], _rows_of(key_padding_mask, rows),
                                backend, scale=scale, dropout_p=dropout_p, into=into)  # fmt: skip
            auxes.append(res.aux)
            _fill(into.out, res.out)
            _fill(into.lse, res.lse)


def fill_grad_slots(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse_rows: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    calls: Sequence[Call],
    grads: Sequence[SlotBuffers | KeySlots],
    backend: KernelBackend,
    auxes: Iterator[Any],
    *,
    scale: float,
    dropout_p: float = 0.0,
) -> None:
    """The backward of :func:`fill_slots`: each call's dq, dk, dv rows written into its slots of
    ``grads`` (three buffers, for q, k and v: :func:`grad_slots`).

    Args:
        lse_rows: (B, N, H, 1) merged log-sum-exp (:func:`row_lse`).
        auxes: the forward's ``aux`` values, consumed in the order :func:`fill_slots` made them.
    """
    for call in calls:
        slotted = cast(SlotCall, call)
        for rows in _batch_rows(call, *q.shape[:2]):
            into = tuple(g.call_rows(slotted, rows) for g in grads)
            results = _call_backward(
                call, dout[rows], q[rows], k[rows], v[rows], out[rows], lse_rows[rows],
                _rows_of(key_padding_mask, rows), next(auxes), backend, scale=scale,
                dropout_p=dropout_p, into=into,
            )  # fmt: skip
            for dest, result in zip(into, results, strict=True):
                _fill(dest, result)


def grad_slots(
    slots: Sequence[Slot],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    held: Sequence[int] | None,
    grads: Sequence[torch.Tensor | None] = (None, None, None),
) -> list[SlotBuffers | KeySlots]:
    """The gradient slots of a slotted plan's backward over the positions of q, k, v (B, N',
    H or Hkv, D): query slots for dq, and for dk and dv the query slots' layout without GQA,
    else key slots by position (Note [Key slots of GQA plans] in ``slots.py``); a rate-1 query
    slot is the gradient of ``grads`` it sums into, where given (Note [A rate-1 slot is its
    destination])."""
    dq = SlotBuffers(slots, q, q.shape[1], with_lse=False, held=held, dest=grads[0])
    if k.shape[2] == q.shape[2]:
        return [dq, *(SlotBuffers(slots, x, x.shape[1], with_lse=False, held=held, dest=grad)
                      for x, grad in zip((k, v), grads[1:], strict=True))]  # fmt: skip
    group_size = q.shape[2] // k.shape[2]
    return [dq, *(KeySlots(slots, x, group_size, held=held) for x in (k, v))]


def _own_slots(slots: Sequence[Slot], spanning: bool = False) -> list[int]:
    """The indices of the slots that span position groups (``spanning``) or do not."""
    return [i for i, slot in enumerate(slots) if slot.spanning == spanning]


def slot_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    calls: Sequence[Call],
    slots: Sequence[Slot],
    backend: KernelBackend,
    *,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    auxes: list[Any],
    dropout_p: float = 0.0,
    spanning: Sequence[SlotView] | None = None,
) -> None:
    """Run ``calls`` into slots of their own over q's positions, then merge them once into
    ``out`` (B, N, H, D) and ``lse`` (B, H, N) (Note [Branch slots merged once] in
    ``slots.py``); with ``spanning`` (a position group's part of the slots that span groups),
    only the other slots are the calls' own, and those views join the merge."""
    held = None if spanning is None else _own_slots(slots)
    buffers = SlotBuffers(slots, q, q.shape[1], with_lse=True, held=held, dest=out)
    fill_slots(q, k, v, key_padding_mask, calls, buffers, backend, scale=scale, auxes=auxes,
               dropout_p=dropout_p)  # fmt: skip
    merge_slots([*buffers.views(), *(spanning or ())], out, lse)


def slot_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse_rows: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    calls: Sequence[Call],
    slots: Sequence[Slot],
    backend: KernelBackend,
    auxes: Iterator[Any],
    *,
    scale: float,
    grads: Sequence[torch.Tensor],
    dropout_p: float = 0.0,
    spanning: Sequence[Sequence[Any]] | None = None,
) -> None:
    """The backward of :func:`slot_forward`: each call's gradients written into slots of three
    gradient buffers (:func:`grad_slots`), each summed (with the ``spanning`` views of that
    gradient's slots) once into ``grads`` (dq, dk, dv, (B, N, H or Hkv, D))."""
    held = None if spanning is None else _own_slots(slots)
    buffers = grad_slots(slots, q, k, v, held, grads)
    fill_grad_slots(dout, q, k, v, out, lse_rows, key_padding_mask, calls, buffers, backend,
                    auxes, scale=scale, dropout_p=dropout_p)  # fmt: skip
    for own, extra, grad in zip(buffers, spanning or ((), (), ()), grads, strict=True):
        own.sum_into(grad, extra)


def plan_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    plan: Plan,
    backend: KernelBackend,
    *,
    scale: float,
    dropout_p: float = 0.0,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
    """Forward of a whole plan (Note [One executor]).

    Args:
        q: (B, Nq, H, D); k, v: (B, Nk, Hkv, D), contiguous.
        key_padding_mask: (B, Nk) bool (``True`` = ignore) or None.
        out_dtype: dtype of ``out`` (default ``q.dtype``; float32 keeps the merge unrounded for a
            caller that merges further, e.g. ring dilated attention).

    Returns:
        ``out`` (B, Nq, H, D), ``lse`` (B, H, Nq) float32 (float64 for float64 inputs; ``-inf``
        where no key is seen), and each call's backend ``aux`` for the backward.
    """
    acc = accumulator_dtype(q.dtype)
    if plan.groups and plan.grouped_forward:
        return _grouped_forward(
            q, k, v, key_padding_mask, plan, backend, scale=scale, dropout_p=dropout_p,
            out_dtype=out_dtype,
        )  # fmt: skip
    if plan.slots:
        batch, seq_len, heads, _ = q.shape
        out = torch.empty(q.shape, dtype=out_dtype or q.dtype, device=q.device)
        lse = torch.empty(batch, heads, seq_len, dtype=acc, device=q.device)
        auxes: list[Any] = []
        slot_forward(
            q, k, v, key_padding_mask, plan.calls, plan.slots, backend, scale=scale, out=out,
            lse=lse, auxes=auxes, dropout_p=dropout_p,
        )  # fmt: skip
        return out, lse, auxes
    if plan.one_call:
        (call,) = plan.calls
        res = backend.forward(
            q, call.kv_rows(k), call.kv_rows(v), scale=scale, is_causal=call.causal,
            key_mask=call.key_mask(key_padding_mask), dropout_p=dropout_p,
        )  # fmt: skip
        out = res.out.contiguous().to(out_dtype or q.dtype)
        return out, res.lse.to(acc).contiguous(), [res.aux]
    merging = len(plan.calls) > 1
    # One call: its rows are written as they come, so out needs no float32 copy.
    out, lse = new_accumulators(q, None if merging else q.dtype)
    auxes = []
    run_forward(
        q, k, v, key_padding_mask, plan.calls, backend, scale=scale, out=out, lse=lse,
        auxes=auxes, dropout_p=dropout_p, merge=merge_rows if merging else None,
    )  # fmt: skip
    return out.to(out_dtype or q.dtype), lse.squeeze(-1).transpose(1, 2).contiguous(), auxes


def _pieces(
    batch: int, groups: Sequence[PositionGroup]
) -> Iterator[tuple[tuple[slice, slice], PositionGroup]]:
    """``((batch rows, positions), group)`` for every batch element and position group, in the
    order both passes run them (the backward consumes the forward's ``aux`` values in order)."""
    for i in range(batch):
        for group in groups:
            yield (slice(i, i + 1), slice(group.start, group.end)), group


def _grouped_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    plan: Plan,
    backend: KernelBackend,
    *,
    scale: float,
    dropout_p: float,
    out_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
    """:func:`plan_forward` one batch element and position group at a time, each merged in
    float32 scratch (or slots) of its own size and rounded once into ``out`` (Note
    [Position-grouped plans]); the slots that span groups are filled first, whole."""
    batch, seq_len, heads, _ = q.shape
    out = torch.empty(q.shape, dtype=out_dtype or q.dtype, device=q.device)
    lse = torch.empty(batch, heads, seq_len, dtype=accumulator_dtype(q.dtype), device=q.device)
    auxes: list[Any] = []
    slots, spanning = plan.slots, None
    if plan.spanning:
        spanning = SlotBuffers(slots, q, seq_len, with_lse=True, held=_own_slots(slots, True))
        fill_slots(q, k, v, key_padding_mask, plan.spanning, spanning, backend, scale=scale,
                   auxes=auxes, dropout_p=dropout_p)  # fmt: skip
    for (rows, positions), group in _pieces(batch, plan.groups):
        piece_q = q[rows, positions]
        mask = _rows_of(key_padding_mask, (rows, positions))
        if slots:
            parts = None if spanning is None else spanning.views(rows, group.start, group.end)
            slot_forward(
                piece_q, k[rows, positions], v[rows, positions], mask, group.calls, slots,
                backend, scale=scale, out=out[rows, positions], lse=lse[rows, :, positions],
                auxes=auxes, dropout_p=dropout_p, spanning=parts,
            )  # fmt: skip
            continue
        piece_out, piece_lse = new_accumulators(piece_q)
        run_forward(
            piece_q, k[rows, positions], v[rows, positions], mask, group.calls, backend,
            scale=scale, out=piece_out, lse=piece_lse, auxes=auxes, dropout_p=dropout_p,
        )  # fmt: skip
        out[rows, positions] = piece_out
        lse[rows, :, positions] = piece_lse.squeeze(-1).transpose(1, 2)
    return out, lse, auxes


def _grouped_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    plan: Plan,
    backend: KernelBackend,
    auxes: list[Any],
    *,
    scale: float,
    dropout_p: float,
    grad_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`plan_backward` of :func:`_grouped_forward`: each group's gradients summed in
    float32 scratch (or slots) of its own size, then written once; the gradient slots that span
    groups are filled first, whole."""
    grads = [
        torch.empty(x.shape, dtype=grad_dtype or x.dtype, device=x.device) for x in (q, k, v)
    ]
    lse_rows, aux = row_lse(lse), iter(auxes)
    slots, spanning = plan.slots, None
    if plan.spanning:
        spanning = grad_slots(slots, q, k, v, _own_slots(slots, True))
        fill_grad_slots(dout, q, k, v, out, lse_rows, key_padding_mask, plan.spanning, spanning,
                        backend, aux, scale=scale, dropout_p=dropout_p)  # fmt: skip
    for (rows, positions), group in _pieces(q.shape[0], plan.groups):
        piece = [x[rows, positions] for x in (q, k, v)]
        mask = _rows_of(key_padding_mask, (rows, positions))
        if slots:
            parts = None if spanning is None else [
                g.views(rows, group.start, group.end) for g in spanning
            ]
            slot_backward(
                dout[rows, positions], *piece, out[rows, positions], lse_rows[rows, positions],
                mask, group.calls, slots, backend, aux, scale=scale,
                grads=[grad[rows, positions] for grad in grads], dropout_p=dropout_p,
                spanning=parts,
            )  # fmt: skip
            continue
        scratch = [torch.zeros(x.shape, dtype=accumulator_dtype(q.dtype), device=q.device)
                   for x in piece]  # fmt: skip
        run_backward(
            dout[rows, positions], *piece, out[rows, positions], lse_rows[rows, positions],
            mask, group.calls, backend, aux, scale=scale, dq=scratch[0], dk=scratch[1],
            dv=scratch[2], dropout_p=dropout_p,
        )  # fmt: skip
        for grad, part in zip(grads, scratch, strict=True):
            grad[rows, positions] = part
    dq, dk, dv = grads
    return dq, dk, dv


def plan_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    plan: Plan,
    backend: KernelBackend,
    auxes: list[Any],
    *,
    scale: float,
    dropout_p: float = 0.0,
    grad_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact gradients of :func:`plan_forward`.

    Args:
        dout: (B, Nq, H, D) upstream gradient of ``out``.
        out: (B, Nq, H, D) merged output; ``lse``: (B, H, Nq) merged log-sum-exp.
        grad_dtype: dtype of the gradients (default: the inputs' dtypes).

    Returns:
        ``(dq, dk, dv)`` shaped like ``(q, k, v)``.
    """
    dout = dout.contiguous()
    # Groups replay the forward's calls cut, so the kernels' aux values (dropout states) must
    # come from the same cut calls; a whole forward's calls with no aux cut freely.
    if plan.groups and (plan.grouped_forward or all(aux is None for aux in auxes)):
        if not plan.grouped_forward:
            cut = sum(len(group.calls) for group in plan.groups) * q.shape[0]
            spanning = sum(len(_batch_rows(c, *q.shape[:2])) for c in plan.spanning)
            auxes = [None] * (spanning + cut)
        return _grouped_backward(
            dout, q, k, v, out, lse, key_padding_mask, plan, backend, auxes, scale=scale,
            dropout_p=dropout_p, grad_dtype=grad_dtype,
        )  # fmt: skip
    if plan.slots:
        grads = [
            torch.empty(x.shape, dtype=grad_dtype or x.dtype, device=x.device) for x in (q, k, v)
        ]
        slot_backward(
            dout, q, k, v, out, row_lse(lse), key_padding_mask, plan.calls, plan.slots,
            backend, iter(auxes), scale=scale, grads=grads, dropout_p=dropout_p,
        )  # fmt: skip
        dq, dk, dv = grads
        return dq, dk, dv
    if plan.whole:
        (call,) = plan.calls
        grads = backend.backward(
            dout, q, k, v, out, lse, auxes[0], scale=scale, is_causal=call.causal,
            key_mask=call.key_mask(key_padding_mask), dropout_p=dropout_p,
        )  # fmt: skip
    else:
        acc = grad_dtype or accumulator_dtype(q.dtype)
        grads = tuple(torch.zeros(x.shape, dtype=acc, device=q.device) for x in (q, k, v))
        run_backward(
            dout, q, k, v, out, row_lse(lse), key_padding_mask, plan.calls, backend,
            iter(auxes), scale=scale, dq=grads[0], dk=grads[1], dv=grads[2],
            dropout_p=dropout_p,
        )  # fmt: skip
    dtypes = [grad_dtype] * 3 if grad_dtype is not None else [x.dtype for x in (q, k, v)]
    dq, dk, dv = (g.to(dtype) for g, dtype in zip(grads, dtypes, strict=True))
    return dq, dk, dv


_DROPOUT_MESSAGE = no_higher_order_message(
    "{what} with dropout_p > 0",
    "the dropout mask is not replayed differentiably",
    "Pass dropout_p=0 (call module.eval()) for a gradient penalty or other double backward.",
)


@dataclass(frozen=True)
class PlanRunner:
    """The executor as a :class:`~dilated_attention.core.autograd.Runner`: ``plan`` on
    ``backend`` (:func:`plan_forward` / :func:`plan_backward`). ``what``: the public function's
    name, for the double-backward error under dropout."""

    plan: Plan
    backend: KernelBackend
    scale: float
    dropout_p: float = 0.0
    what: str = "attention"

    @property
    def first_order_message(self) -> str:
        return _DROPOUT_MESSAGE.format(what=self.what)

    def forward(self, x: Inputs) -> Forward:
        q, k, v, key_padding_mask = x
        out, lse, auxes = plan_forward(
            q, k, v, key_padding_mask, self.plan, self.backend, scale=self.scale,
            dropout_p=self.dropout_p,
        )  # fmt: skip
        return Forward(out, lse, saved=(k, v, key_padding_mask), state=auxes)

    def backward(self, b: Backward) -> Grads:
        dout, q, out, lse, saved, state = b
        k, v, key_padding_mask = saved
        return plan_backward(
            dout, q, k, v, out, lse, key_padding_mask, self.plan, self.backend, state,
            scale=self.scale, dropout_p=self.dropout_p,
        )  # fmt: skip

    def differentiable_backward(self, b: Backward) -> Grads | None:
        dout, q, _, lse, saved, _ = b
        if self.dropout_p:
            return None  # the dropout mask is not replayed differentiably
        k, v, key_padding_mask = saved
        calls = [call.row_call(q, k) for call in self.plan.calls]
        return differentiable_grads(
            dout, q, k, v, lse, calls, scale=self.scale, key_padding_mask=key_padding_mask
        )


def empty_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` for a checked call with no query rows (batch 0 or 0 heads).

    SDPA returns empty tensors there; so do we, without launching a kernel (some reject empty
    launches). ``out`` is tied to q, k and v through their sums (of zero elements: free), so
    backward gives all three their empty gradients.

    Args:
        q: (B, Nq, H, D) with B * H == 0.
        k: (B, Nk, Hkv, D).
        v: (B, Nk, Hkv, D).

    Returns:
        out (B, Nq, H, D) in q's dtype; lse (B, H, Nq) float32 (float64 for float64 inputs).
    """
    batch, query_len, heads, _ = q.shape
    link = (q.sum() + k.sum() + v.sum()) * 0
    out = torch.zeros_like(q) + link
    lse = q.new_full((batch, heads, query_len), float("-inf"), dtype=accumulator_dtype(q.dtype))
    return out, lse
