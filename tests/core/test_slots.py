"""Branch slots merged once (Note [Branch slots merged once] in ``core/geometry/slots.py``).

On the CPU the math backend stands in for a kernel that writes into the buffers it is given (as
FlashAttention-4 does): slotted plans, whole and position-grouped, against the float64 oracle on
outputs, lse and every gradient (causal, key padding with rows that see no key, rows no branch
covers, rates above the head count, diagonal head calls, batches); every slot row written by
exactly one call; the plans that cannot use slots, and why. The one-pass kernels are checked
against the torch passes on the GPU and, with ``TRITON_INTERPRET=1``, on the CPU; the GPU test
runs FlashAttention-4 itself into the slots.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import pytest
import torch
from support.grouping import cut_small
from support.oracle import oracle_dilated_attention
from support.shared_results import shared_result
from support.tolerances import assert_close_to_oracle
from support.triton import KERNEL_DEVICES, poison_new_buffers, require_triton, skip_without_triton
from support.writing_kernel import write_into_buffers

import dilated_attention.core.execution.executor as executor
import dilated_attention.core.execution.grouped_runs as grouped_runs
import dilated_attention.core.execution.slot_runs as slot_runs
import dilated_attention.core.geometry.grouped as grouped
from dilated_attention import backend_reasons, dilated_attention
from dilated_attention.core.geometry.key_slots import KeySlots
from dilated_attention.core.geometry.segment import not_slotted_reason, plan_branches, slot_plan
from dilated_attention.core.geometry.slots import (
    Slot,
    SlotBuffers,
    SlotView,
    dest_slot,
    merge_slots_torch,
    slot_layout,
    sum_slots_torch,
)
from dilated_attention.resolve.resolver import clear_resolved

F64 = torch.float64
TIGHT = {"atol": 1e-10, "rtol": 1e-7}

#: (id, N, H, segments, rates), no GQA.
SCHEDULES = [
    ("longnet", 64, 8, (8, 16, 32), (1, 2, 4)),  # r = 4 > H / r: diagonal head calls
    ("rates_above_heads", 48, 2, (12, 48), (3, 6)),
    ("no_rate_one", 32, 4, (16, 32), (2, 4)),  # rows no branch covers: zeros, lse -inf
    ("one_branch", 32, 4, (16,), (2,)),
    ("segment_beyond_n", 40, 4, (8, 64), (1, 4)),  # w > N is one segment of N
    # Ragged branches: offset classes of different lengths (r does not divide w), a shorter
    # last segment (its run of whole segments before it: one batch element at a time), both,
    # a last segment shorter than the rate, diagonal calls on a shorter last segment.
    ("ragged_rows", 32, 4, (8, 32), (1, 3)),
    ("short_last_segment", 44, 4, (8, 16), (1, 2)),
    ("ragged_everything", 50, 4, (12, 20, 50), (1, 3, 7)),
    ("last_segment_below_rate", 35, 4, (8, 16), (1, 4)),
    ("diagonal_short_last", 72, 8, (8, 32), (1, 4)),
]
#: (id, N, H, Hkv, segments, rates) with GQA (Note [Key slots of GQA plans]): rates dividing
#: the group size (every key row written: the kernel's native GQA), rates above it (key slots
#: zeroed first), ragged branches, one key/value head.
GQA_SCHEDULES = [
    ("gqa_rates_in_group", 64, 8, 2, (8, 16, 32), (1, 2, 4)),
    ("gqa_rates_above_group", 64, 8, 4, (8, 16, 32), (1, 2, 4)),
    ("gqa_ragged", 50, 8, 4, (12, 20, 50), (1, 2, 4)),
    ("mqa", 48, 4, 1, (12, 48), (1, 4)),
    # Diagonal calls of the heads sharing a key/value head, above the group, shorter last segment.
    ("gqa_diagonal_above_group", 72, 8, 2, (8, 32), (1, 8)),
    # A group of 8 above r = 4: two runs of one key/value head would write the same key rows;
    # offset classes (the kernel's native GQA) instead.
    ("mqa_group_above_rate", 32, 8, 1, (8, 16), (1, 4)),
]
#: Every slotted case as (id, N, H, Hkv, segments, rates).
SLOTTED = [(name, n, h, h, segs, rates) for name, n, h, segs, rates in SCHEDULES] + GQA_SCHEDULES
#: (id, N, H, Hkv, segments, rates, the reason's words).
UNSLOTTED = [
    # Query heads 0, 3, 6 of offset class 0 read key/value heads 0, 0, 1: not one strided slice.
    ("gqa_rate_across_groups", 36, 8, 2, (12, 36), (1, 3), "GQA"),
    ("dense", 32, 4, 4, (32,), (1,), "one dense call"),
]


@pytest.fixture
def writing_kernel(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The math backend writing its results into the buffers it is handed; the passes that did."""
    return write_into_buffers(monkeypatch)


#: The modules whose functions call ``slot_forward``, ``slot_backward``, ``run_forward`` and
#: ``run_backward``, looking them up in their own namespace: a spy replaces the name in each.
CALLERS = (executor, grouped_runs)


def _spy(monkeypatch: pytest.MonkeyPatch, names: tuple[str, ...]) -> list[str]:
    runs: list[str] = []
    for name in names:
        callers = [module for module in CALLERS if hasattr(module, name)]
        assert callers, f"no module calls {name}"
        for module in callers:
            real = getattr(module, name)
            spy = lambda *a, n=name, f=real, **kw: runs.append(n) or f(*a, **kw)  # noqa: E731
            monkeypatch.setattr(module, name, spy)
    return runs


def _inputs(n: int, heads: int, dtype: torch.dtype = F64, batch: int = 2, dim: int = 8):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(batch, n, heads, dim, generator=gen).to(dtype) for _ in range(4)]


def _mask(n: int) -> torch.Tensor:
    """Batch element 1: every 5th key ignored, and the first 8 keys (a segment of rows that
    see no key when causal)."""
    mask = torch.zeros(2, n, dtype=torch.bool)
    mask[1, 3:n:5] = True
    mask[1, :8] = True
    return mask


def _oracle(q, k, v, dout, segs, rates, is_causal, mask):
    leaves = [t.detach().to(F64).requires_grad_() for t in (q, k, v)]
    out, lse = oracle_dilated_attention(*leaves, segs, rates, is_causal=is_causal,
                                        key_padding_mask=mask)  # fmt: skip
    return out, lse, torch.autograd.grad(out, leaves, dout.to(F64))


class _Trained(NamedTuple):
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    mask: torch.Tensor
    leaves: list[torch.Tensor]
    ref_out: torch.Tensor
    ref_lse: torch.Tensor


def _trained_like_the_oracle(schedule, is_causal: bool) -> _Trained:  # type: ignore[no-untyped-def]
    """A forward+backward of ``schedule`` (its N, H, Hkv, segments, rates) on the math backend,
    with the key padding mask of :func:`_mask`, checked against the float64 oracle on out, lse
    and every gradient; returns its inputs, leaves and the oracle's out and lse."""
    _, n, heads, kv_heads, segs, rates = schedule
    q, k, v, dout = _inputs(n, heads)
    k, v = k[:, :, :kv_heads], v[:, :, :kv_heads]
    mask = _mask(n)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = dilated_attention(*leaves, segs, rates, is_causal=is_causal, backend="math",
                                 key_padding_mask=mask, return_lse=True)  # fmt: skip
    grads = torch.autograd.grad(out, leaves, dout)
    ref_out, ref_lse, ref_grads = _oracle(q, k, v, dout, segs, rates, is_causal, mask)
    torch.testing.assert_close(out, ref_out, **TIGHT)
    torch.testing.assert_close(lse, ref_lse, **TIGHT)
    for name, g, rg in zip("qkv", grads, ref_grads, strict=True):
        torch.testing.assert_close(g, rg, **TIGHT, msg=lambda m, x=name: f"d{x}: {m}")
    return _Trained(q, k, v, dout, mask, leaves, ref_out, ref_lse)


@pytest.mark.parametrize("cut", [False, True], ids=["whole", "grouped"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("schedule", SLOTTED, ids=[s[0] for s in SLOTTED])
def test_slotted_plan_matches_oracle(
    schedule, is_causal: bool, cut: bool, writing_kernel: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """out, lse, dq, dk, dv of a slotted plan (the kernel writing every call into its slot)
    equal the float64 oracle, with gradients and without, whole and in position groups, with
    and without GQA."""
    _, n, _, _, segs, rates = schedule
    if cut:
        cut_small(monkeypatch)
    runs = _spy(monkeypatch, ("slot_forward", "slot_backward", "run_forward", "run_backward"))
    q, k, v, _, mask, _, ref_out, ref_lse = _trained_like_the_oracle(schedule, is_causal)
    assert set(runs) == {"slot_forward", "slot_backward"}, runs
    assert runs.count("slot_forward") == 1  # a differentiated forward runs whole
    if cut:  # groups of the shortest segment (the longer branches' slots span them), or none
        slots = tuple(Slot(min(w, n), r) for w, r in zip(segs, rates, strict=True))
        size = grouped.slot_group_length(slots, n, 1)
        assert size in (None, min(segs))
        assert runs.count("slot_backward") == 2 * -(-n // (size or n))  # batch 2
    else:
        assert runs.count("slot_backward") == 1
    assert {"forward", "backward"} == set(writing_kernel)
    runs.clear()
    with torch.no_grad():
        out, lse = dilated_attention(q, k, v, segs, rates, is_causal=is_causal, backend="math",
                                     key_padding_mask=mask, return_lse=True)  # fmt: skip
    torch.testing.assert_close(out, ref_out.detach(), **TIGHT)
    torch.testing.assert_close(lse, ref_lse, **TIGHT)
    assert set(runs) == {"slot_forward"}, runs


def _used_rows(slot: Slot, n: int, heads: int) -> torch.Tensor:
    """(S * C, H) bool: the slot rows some position fills, from the slot's definition."""
    used = torch.zeros(slot.rows(n), heads, dtype=torch.bool)
    for position, head in itertools.product(range(n), range(heads)):
        seg, t = divmod(position, slot.segment_len)
        if t % slot.rate == head % slot.rate:
            used[seg * slot.segment_rows + t // slot.rate, head] = True
    return used


def test_grouped_backward_takes_longer_groups_where_calls_would_be_too_many(
    writing_kernel: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With at most 4 calls to a grouped backward, LongNet's 64 positions go in groups of 16
    (3 calls each: r = 1, and r = 2's two offset classes) instead of 8 (1 call each, 8 groups),
    and still match the oracle."""
    _, n, heads, segs, rates = SCHEDULES[0]
    cut_small(monkeypatch)
    counts = []
    for cap in (1000, 4):
        monkeypatch.setattr(grouped, "MAX_GROUPED_CALLS", cap)
        clear_resolved()  # a request's plans are made once: made again under the new bound
        runs = _spy(monkeypatch, ("slot_backward",))
        q, k, v, dout = _inputs(n, heads)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = dilated_attention(*leaves, segs, rates, is_causal=True, backend="math")
        grads = torch.autograd.grad(out, leaves, dout)
        _, _, ref_grads = _oracle(q, k, v, dout, segs, rates, True, None)
        for g, rg in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, rg, **TIGHT)
        counts.append(len(runs))
        monkeypatch.undo()
        write_into_buffers(monkeypatch)
        cut_small(monkeypatch)
    assert counts == [2 * 8, 2 * 4]  # batch 2


@pytest.mark.parametrize("schedule", SCHEDULES, ids=[s[0] for s in SCHEDULES])
def test_each_slot_row_is_written_by_one_call(schedule) -> None:
    """Adding one through every call's slot rows (and slot lse) fills each slot row a position
    of the branch owns with one exactly, and leaves the others (a ragged branch's unused rows)
    zero: the calls of a branch tile its slot, rows and heads, with no overlap."""
    _, n, heads, segs, rates = schedule
    segs = tuple(min(w, n) for w in segs)
    plan = slot_plan(plan_branches(n, heads, segs, rates), n, heads, False)
    like = torch.empty(2, n, heads, 3)
    buffers = SlotBuffers(plan.slots, like, n, with_lse=True)
    buffers.flat.zero_()
    buffers.lse_flat.zero_()  # type: ignore[union-attr]
    for call in plan.calls:
        rows = [slice(None)] if call.whole_batch(n) else [slice(0, 1), slice(1, 2)]  # type: ignore[attr-defined]
        for batch in rows:
            call.slot_rows(buffers.out(call.slot)[batch]).add_(1)  # type: ignore[attr-defined]
            call.slot_lse(buffers.lse(call.slot)[batch]).add_(1)  # type: ignore[attr-defined]
    for index, slot in enumerate(plan.slots):
        used = _used_rows(slot, n, heads)
        expected = used.to(like.dtype).expand(2, *used.shape)
        torch.testing.assert_close(buffers.out(index), expected[..., None].expand(-1, -1, -1, 3))
        lse = buffers.lse(index).transpose(2, 3).flatten(1, 2)  # (B, S * C, H)
        torch.testing.assert_close(lse, expected)
    assert [s.rate for s in plan.slots] == list(rates)


@pytest.mark.parametrize("schedule", GQA_SCHEDULES, ids=[s[0] for s in GQA_SCHEDULES])
def test_each_key_slot_row_is_written_by_one_call(
    schedule, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With GQA, adding one through every call's key rows of its key slot (new buffers start
    NaN: a write counts as one) fills, by position, each (position, key/value head) that some
    query head of the group reads in that branch with one exactly, and leaves the others at the
    zero :class:`KeySlots` gives them; in the query layout (rates that are multiples of the
    group), each slot row a position of the branch owns with one exactly, the others unwritten
    (Note [Key slots of GQA plans])."""
    _, n, heads, kv_heads, segs, rates = schedule
    segs = tuple(min(w, n) for w in segs)
    plan = slot_plan(plan_branches(n, heads, segs, rates), n, kv_heads, False)
    group = heads // kv_heads
    poison_new_buffers(monkeypatch)
    slots = KeySlots(plan.slots, torch.empty(2, n, kv_heads, 3), group)
    for call in plan.calls:
        rows = [slice(None)] if call.whole_batch(n) else [slice(0, 1), slice(1, 2)]  # type: ignore[attr-defined]
        for batch in rows:
            view = slots.call_rows(call, batch)  # type: ignore[arg-type]
            view.copy_(torch.where(view.isnan(), 1.0, view + 1))
    assert slots.query_layout == {i for i, s in enumerate(plan.slots) if s.rate % group == 0}
    for index, slot in enumerate(plan.slots):
        if index in slots.query_layout:
            used = _used_rows(slot, n, heads)
            expected = torch.where(used, 1.0, torch.nan).expand(2, -1, -1)[..., None]
            torch.testing.assert_close(slots.out(index), expected.expand(-1, -1, -1, 3),
                                       equal_nan=True)  # fmt: skip
            continue
        read = torch.zeros(n, kv_heads)
        for position, head in itertools.product(range(n), range(heads)):
            if (position % slot.segment_len) % slot.rate == head % slot.rate:
                read[position, head // group] = 1.0
        expected = read[None, :, :, None].expand(2, -1, -1, 3)
        torch.testing.assert_close(slots.out(index), expected, msg=lambda m, i=index: f"{i}: {m}")


@pytest.mark.parametrize("rate", [1, 2], ids=["by_position", "query_layout"])
def test_key_slots_sum_in_float32_and_round_once(rate: int) -> None:
    """bfloat16 key slots holding 1, 2**-8 and (a spanning slot) 2**-9 sum to 1 + 2**-7: 0.75 of
    1's spacing, rounded once, up; adding in bfloat16 as it goes would stay at 1 (1 + 2**-8 is a
    tie that rounds to even). The last two slots by position, or (``rate`` 2, a multiple of the
    group of 2) in the query layout, whose two offsets cover every key row of a key/value
    head once."""
    slots = (Slot(8, 1), Slot(8, rate), Slot(8, rate))
    like = torch.empty(1, 8, 2, 4, dtype=torch.bfloat16)
    own = KeySlots(slots, like, 2, held=[0, 1])
    spanning = KeySlots(slots, like, 2, held=[2])
    own.out(0).fill_(1.0)
    own.out(1).fill_(2.0**-8)
    spanning.out(2).fill_(2.0**-9)
    grad = torch.empty(1, 8, 2, 4, dtype=torch.bfloat16)
    own.sum_into(grad, spanning.views())
    assert torch.all(grad == 1.0 + 2.0**-7), grad
    one = torch.tensor(1.0, dtype=torch.bfloat16)
    assert one + 2.0**-8 + 2.0**-9 == 1.0  # in bfloat16 as it goes


@pytest.mark.parametrize(
    ("heads", "group", "rate", "length", "positions"),
    [(16, 4, 4, 32, 128), (16, 4, 8, 32, 64), (16, 4, 32, 64, 128), (8, 2, 2, 8, 24),
     (4, 4, 4, 12, 48), (8, 4, 8, 32, 72), (8, 2, 4, 10, 25), (16, 4, 12, 48, 96)],
    ids=["below-heads", "below-heads-2", "above-heads", "group-2", "mqa", "ragged-last",
         "ragged-rows", "rate-not-dividing-heads"],
)  # fmt: skip
def test_query_layout_key_slot_sums_into_its_key_rows(
    heads: int, group: int, rate: int, length: int, positions: int
) -> None:
    """A key slot in the query layout adds row ``seg * C + m`` of head ``h`` into position
    ``seg * L + (h mod r) + r * m`` of key/value head ``h // g`` (Note [Key slots of GQA
    plans]): checked cell by cell against a loop, on whole segments (one strided view) and on
    ragged ones (the offset classes)."""
    per_segment = -(-length // rate)
    segments = -(-positions // length)
    rows = torch.randn(2, segments * per_segment, heads, 3, dtype=F64)
    kv_heads = heads // group
    expected = torch.zeros(2, positions, kv_heads, 3, dtype=F64)
    for seg, m, h in itertools.product(range(segments), range(per_segment), range(heads)):
        offset = h % rate + rate * m
        if offset < length and seg * length + offset < positions:
            expected[:, seg * length + offset, h // group] += rows[:, seg * per_segment + m, h]
    slots = KeySlots((Slot(length, rate),), torch.empty(2, positions, kv_heads, 3, dtype=F64),
                     group)  # fmt: skip
    slots.out(0).copy_(rows)
    grad = torch.empty(2, positions, kv_heads, 3, dtype=F64)
    slots.sum_into(grad)
    torch.testing.assert_close(grad, expected, rtol=0, atol=0)
    assert isinstance(slots.views()[1], SlotView)


def test_rate_one_key_slot_is_the_key_gradient() -> None:
    """Note [A rate-1 slot is its destination]: a GQA key slot of rate 1 is by position, the
    gradient's layout, so with the gradient given it is the gradient itself (no buffer of its
    own), and the sum reads it whole before writing the gradient: in float32, one rounding."""
    slots = (Slot(8, 1), Slot(8, 2), Slot(8, 4))
    like = torch.empty(1, 8, 2, 4, dtype=torch.bfloat16)
    grad = torch.empty(1, 8, 2, 4, dtype=torch.bfloat16)
    own = KeySlots(slots, like, 4, dest=grad)
    assert own.in_dest == 0 and own.out(0) is grad and own.flat.shape[0] == 1
    assert own.query_layout == {2}
    own.out(0).fill_(1.0)
    own.out(1).fill_(2.0**-8)
    own.out(2).fill_(2.0**-9)  # every key row of a key/value head: its 4 heads' offsets
    own.sum_into(grad)
    assert torch.all(grad == 1.0 + 2.0**-7), grad
    assert KeySlots(slots, like, 4, dest=grad.float()).in_dest is None  # another dtype
    assert KeySlots(slots, like, 4, dest=grad.transpose(1, 2).contiguous().transpose(1, 2)
                    ).in_dest is None  # fmt: skip


@pytest.mark.parametrize("case", UNSLOTTED, ids=[c[0] for c in UNSLOTTED])
def test_plans_without_slots_say_why_and_merge_as_they_go(
    case, writing_kernel: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """GQA, ragged rows, a shorter last segment and dense attention keep the executor's running
    merge (and still match the oracle)."""
    _, n, heads, kv_heads, segs, rates, words = case
    reason = not_slotted_reason(plan_branches(n, heads, segs, rates), n, kv_heads)
    assert reason is not None and words in reason
    runs = _spy(monkeypatch, ("slot_forward",))
    q, _, _, dout = _inputs(n, heads)
    k, v = (t[:, :, :kv_heads] for t in _inputs(n, heads)[1:3])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = dilated_attention(*leaves, segs, rates, backend="math")
    grads = torch.autograd.grad(out, leaves, dout)
    ref_out, _, ref_grads = _oracle(q, k, v, dout, segs, rates, False, None)
    torch.testing.assert_close(out, ref_out, **TIGHT)
    for g, rg in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, rg, **TIGHT)
    assert runs == [] and writing_kernel == []


# -- the one-pass kernels --------------------------------------------------------------------------
#: (id, N, slots, regions (batch, start, end)): every slot whole; then a region of batch element
#: 1 that some slots see as whole segments and others as a run inside one segment. Ragged: r not
#: dividing L, shorter last segments, a region that ends with the sequence inside a segment.
SLOT_CASES = [
    ("longnet", 128, (Slot(16, 1), Slot(32, 2), Slot(64, 4), Slot(64, 16)),
     [(slice(None), 0, 128), (slice(1, 2), 64, 96)]),
    ("ragged", 100, (Slot(10, 1), Slot(20, 3), Slot(40, 8), Slot(100, 5)),
     [(slice(None), 0, 100), (slice(1, 2), 40, 60), (slice(1, 2), 80, 100)]),
]  # fmt: skip


def _random_slots(device: str, dtype: torch.dtype, n: int, heads: int, dim: int, slots):
    """Slot buffers of ``slots`` with random rows and lse: a row of slot 0 (rate 1) NaN (the
    merged row is NaN, its lse is not), the lse of some rows -inf (no key in that branch), of
    one row -inf in every slot."""
    like = torch.empty(2, n, heads, dim, dtype=dtype, device=device)
    buffers = SlotBuffers(slots, like, n, with_lse=True)
    gen = torch.Generator().manual_seed(5)
    buffers.flat.copy_(torch.randn(buffers.flat.shape, generator=gen).to(dtype))
    lse = torch.randn(buffers.lse_flat.shape, generator=gen) * 3  # type: ignore[union-attr]
    lse[torch.rand(lse.shape, generator=gen) < 0.1] = float("-inf")
    buffers.lse_flat.copy_(lse)  # type: ignore[union-attr]
    buffers.out(0)[1, 5, 2] = float("nan")  # position 5, head 2 of batch 1
    for index in range(len(slots)):  # position 0, head 0 of batch 0: no slot saw a key
        buffers.lse(index)[0, 0, 0, 0] = float("-inf")
    return buffers


@pytest.mark.parametrize("case", SLOT_CASES, ids=[c[0] for c in SLOT_CASES])
@pytest.mark.parametrize("device,dtypes", KERNEL_DEVICES)
def test_slot_kernels_match_the_torch_passes(
    device: str, dtypes: list[torch.dtype], case, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Triton merge and sum of slots against :func:`merge_slots_torch` /
    :func:`sum_slots_torch`, into strided views of NaN-filled outputs: equal up to float32
    summation order, NaN carried, empty rows 0 with lse -inf."""
    skip_without_triton(device)
    from dilated_attention.backends.triton_kernels.merge import SlotKernels

    poison_new_buffers(monkeypatch)
    _, n, slots, regions = case
    heads = 4
    for dtype, dim, (batch, start, end) in itertools.product(dtypes, (32, 40), regions):
        buffers = _random_slots(device, dtype, n, heads, dim, slots)
        views = buffers.views(batch, start, end)
        shape = (len(range(2)[batch]), end - start, heads, dim)
        wide = torch.full((*shape[:3], dim + 8), float("nan"), dtype=dtype, device=device)
        out, ref = wide[..., :dim], torch.empty(shape, dtype=dtype, device=device)
        lse = torch.full((shape[0], heads, 2 * shape[1]), float("nan"), device=device)[..., ::2]
        ref_lse = torch.empty(shape[0], heads, shape[1], device=device)
        SlotKernels.merge(views, out, lse)
        merge_slots_torch(views, ref, ref_lse)
        if start == 0:
            assert torch.isnan(out[1, 5, 2]).all() and torch.isfinite(lse[1, 2, 5])
            assert torch.equal(out[0, 0, 0], torch.zeros_like(out[0, 0, 0]))
            assert lse[0, 0, 0] == float("-inf")
        tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {}
        torch.testing.assert_close(out, ref, equal_nan=True, **tol)
        torch.testing.assert_close(lse, ref_lse, equal_nan=True, atol=1e-5, rtol=1e-5)
        grad, ref_grad = out.clone(), torch.empty_like(ref)
        grad.fill_(float("nan"))
        SlotKernels.sum(views, grad)
        sum_slots_torch(views, ref_grad)
        torch.testing.assert_close(grad, ref_grad, equal_nan=True, **tol)


def _in_place_matches_separate(merge, add, device: str, dtype: torch.dtype) -> None:
    """``merge`` and ``add`` (a one-pass merge and sum) over slots whose rate-1 slot is the
    output (or gradient) itself give what the torch passes give over separate slots."""
    _, n, slots, _ = SLOT_CASES[0]
    heads, dim = 4, 32
    separate = _random_slots(device, dtype, n, heads, dim, slots)
    like = torch.empty(2, n, heads, dim, dtype=dtype, device=device)
    ref, ref_lse = torch.empty_like(like), torch.empty(2, heads, n, device=device)
    merge_slots_torch(separate.views(), ref, ref_lse)
    ref_grad = torch.empty_like(like)
    sum_slots_torch(separate.views(), ref_grad)
    # float32: summation order; 16-bit: the rounding of an order-dependent float32 sum
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {}
    for with_lse in (True, False):
        dest = separate.out(0).clone()
        aliased = SlotBuffers(slots, like, n, with_lse=with_lse, dest=dest)
        assert aliased.in_dest == 0 and aliased.out(0) is dest
        assert aliased.flat.numel() == separate.flat.numel() - dest.numel()
        for index in range(1, len(slots)):
            aliased.out(index).copy_(separate.out(index))
        if with_lse:
            aliased.lse_flat.copy_(separate.lse_flat)  # type: ignore[union-attr]
            lse = torch.full((2, heads, n), float("nan"), device=device)
            merge(aliased.views(), dest, lse)
            torch.testing.assert_close(dest, ref, equal_nan=True, **tol)
            torch.testing.assert_close(lse, ref_lse, equal_nan=True, atol=1e-5, rtol=1e-5)
        else:
            add(aliased.views(), dest)
            torch.testing.assert_close(dest, ref_grad, equal_nan=True, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_torch_passes_merge_and_sum_in_place_over_the_rate_one_slot(dtype: torch.dtype) -> None:
    """Note [A rate-1 slot is its destination]: the torch passes read every slot, the one that
    is the output included, before writing the output."""
    _in_place_matches_separate(merge_slots_torch, sum_slots_torch, "cpu", dtype)


@pytest.mark.parametrize("device,dtypes", KERNEL_DEVICES)
def test_slot_kernels_merge_and_sum_in_place_over_the_rate_one_slot(
    device: str, dtypes: list[torch.dtype]
) -> None:
    """Note [A rate-1 slot is its destination]: each program of the Triton merge and sum reads
    its cells of every slot, the output's own included, before writing them."""
    skip_without_triton(device)
    from dilated_attention.backends.triton_kernels.merge import SlotKernels

    for dtype in dtypes:
        _in_place_matches_separate(SlotKernels.merge, SlotKernels.sum, device, dtype)


def test_rate_one_slot_is_the_destination_only_where_it_has_the_layout() -> None:
    """The first rate-1 slot whose rows are the positions is ``dest``; not a spanning slot, not
    where the last segment leaves unused rows, not a ``dest`` of another dtype or layout."""
    like = torch.empty(2, 32, 4, 8)
    slots = (Slot(8, 2), Slot(8, 1), Slot(16, 1))
    assert dest_slot(slots, range(3), 32, like, torch.empty_like(like)) == 1
    assert dest_slot(slots, [0, 2], 32, like, torch.empty_like(like)) == 2
    assert dest_slot(slots, [0], 32, like, torch.empty_like(like)) is None
    assert dest_slot((Slot(8, 1, spanning=True),), [0], 32, like, torch.empty_like(like)) is None
    assert dest_slot((Slot(12, 1),), [0], 32, like, torch.empty_like(like)) is None  # 3 x 12 > 32
    assert dest_slot((Slot(12, 1),), [0], 36, torch.empty(2, 36, 4, 8),
                     torch.empty(2, 36, 4, 8)) == 0  # fmt: skip
    assert dest_slot(slots, range(3), 32, like, torch.empty_like(like, dtype=F64)) is None
    wide = torch.empty(2, 32, 4, 16)[..., :8]  # heads not contiguous rows of 8
    assert dest_slot(slots, range(3), 32, like, wide) is None
    batch_strided = torch.empty(3, 32, 4, 8)[::2]  # any batch stride is a slot's
    assert dest_slot(slots, range(3), 32, like, batch_strided) == 1


def test_backward_groups_follow_the_gradient_slots_memory() -> None:
    """Note [Position-grouped plans]: as many groups (a power of two) as bring the gradient
    slots to the fused engine's 6 / 16 units of q; LongNet's rate-1 slots are the gradients
    (8 groups), with GQA its key slots are one per branch (16), without a rate-1 branch the
    slots take 1.94 units a gradient (16); with GQA (4 query heads a key/value head) its key
    slots take 1 / 4 of q by position for rate 2 (rate 1's is the gradient) and 1 / r in the
    query layout for rates 4-16 (8; 16 when every key slot was by position), with 8 query heads
    1 / 8 for rates 2 and 4 and 1 / r for 8 and 16 (8)."""
    longnet = tuple(Slot(2048 << i, 1 << i) for i in range(5))
    assert grouped.backward_slot_groups(longnet, 1) == 8
    assert grouped.backward_slot_groups(longnet, 4) == 8
    assert grouped.backward_slot_groups(longnet, 8) == 8
    assert grouped.backward_slot_groups(tuple(Slot(s.segment_len, 2 * s.rate) for s in longnet),
                                        1) == 8  # fmt: skip
    assert grouped.backward_slot_groups((Slot(2048, 1), Slot(4096, 2)), 1) == 4
    assert grouped.backward_slot_groups((Slot(2048, 1),), 1) == 1


@pytest.mark.parametrize("kv_heads", [8, 4, 2, 1])
def test_gradient_slot_share_is_what_the_slots_allocate(kv_heads: int) -> None:
    """``gradient_slot_share``, which sets the backward's position groups, counts the bytes the
    gradient slots of a LongNet-like plan allocate (query slots, key slots by position and in
    the query layout, the rate-1 slots being the gradients), in units of q, for 1-8 query heads
    per key/value head."""
    from dilated_attention.core.execution.slot_runs import grad_slots

    n, heads = 256, 8
    slots = tuple(Slot(16 << i, 1 << i) for i in range(5))
    q = torch.empty(2, n, heads, 4)
    k, v = torch.empty(2, n, kv_heads, 4), torch.empty(2, n, kv_heads, 4)
    grads = [torch.empty_like(x) for x in (q, k, v)]
    buffers = grad_slots(slots, q, k, v, None, grads)
    held = sum(t.numel() for own in buffers for t in own.tensors)
    share = grouped.gradient_slot_share(slots, heads // kv_heads)
    assert held / q.numel() == pytest.approx(share), (held / q.numel(), share)


#: (id, N, H, segments, rates) of the GPU test: LongNet-like; ragged (r = 3 does not divide
#: w = 256, shorter last segments, whole segments before them one batch element at a time).
#: (id, N, H, Hkv, segments, rates).
GPU_SCHEDULES = [
    ("longnet", 1024, 8, 8, (128, 256, 512), (1, 2, 4)),
    ("ragged", 1000, 8, 8, (128, 256, 600), (1, 3, 4)),
    ("gqa_in_group", 1024, 8, 2, (128, 256, 512), (1, 2, 4)),  # native GQA calls
    ("gqa_above_group", 1000, 8, 4, (128, 256, 600), (1, 2, 4)),  # zeroed key slots, ragged
]
#: The whole and grouped runs of a schedule share its oracle (``_gpu_oracles``): under
#: ``--dist loadgroup`` they run in one pytest-xdist worker, which computes it once.
GPU_PARAMS = [
    pytest.param(
        schedule,
        is_causal,
        cut,
        id=f"{schedule[0]}-{causal_id}-{cut_id}",
        marks=pytest.mark.xdist_group(f"slots-{schedule[0]}-{causal_id}"),
    )
    for schedule in GPU_SCHEDULES
    for is_causal, causal_id in ((False, "full"), (True, "causal"))
    for cut, cut_id in ((False, "whole"), (True, "grouped"))
]


def _gpu_inputs(schedule: tuple) -> list[torch.Tensor]:
    """bf16 q (B, N, H, 64), k, v (B, N, Hkv, 64), dout (B, N, H, 64) of a GPU schedule."""
    _, n, heads, kv_heads, _, _ = schedule
    q, k, v, dout = _inputs(n, heads, torch.bfloat16, dim=64)
    return [q, k[:, :, :kv_heads], v[:, :, :kv_heads], dout]


@shared_result
def _gpu_oracles(schedule: tuple, is_causal: bool) -> list[tuple]:
    """``(out, lse, (dq, dk, dv))`` of the float64 oracle and of its naive bf16 replica on
    ``_gpu_inputs(schedule)``: computed once per process (two dense N x N softmaxes and their
    backward at N = 1024, seconds each), shared by the whole and grouped runs."""
    _, _, _, _, segs, rates = schedule
    q, k, v, dout = _gpu_inputs(schedule)
    results = []
    for cdt in (F64, torch.bfloat16):
        leaves = [t.detach().to(cdt).requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = oracle_dilated_attention(*leaves, segs, rates, is_causal=is_causal,
                                                    compute_dtype=cdt)  # fmt: skip
        results.append((ref_out, ref_lse, torch.autograd.grad(ref_out, leaves, dout.to(cdt))))
    return results


def test_slot_kernels_compile_once_for_every_shorter_last_group() -> None:
    """A spanning slot's part of a shorter last group is a run of N - k G positions inside one
    of its segments; the kernels get one compile-time segment length for such runs whatever N,
    so sequences of 44, 45 and 46 positions share their compiled merge."""
    require_triton()
    from dilated_attention.backends.triton_kernels.merge import _launch

    slots = (Slot(8, 1), Slot(32, 4, spanning=True))
    segs = set()
    for n in (44, 45, 46):
        like = torch.empty(1, n, 4, 8)
        buffers = SlotBuffers(slots, like, n, with_lse=True, held=[1])
        views = buffers.views(slice(None), 40, n)
        assert views[0].segment_len == n - 40  # the torch passes read the run as it is
        segs.add(_launch(views, like[:, 40:])[1]["SEGS"])
    assert len(segs) == 1, segs


@pytest.mark.gpu
@pytest.mark.parametrize(("schedule", "is_causal", "cut"), GPU_PARAMS)
def test_cuda_flash_attn4_writes_into_slots(
    schedule, is_causal: bool, cut: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FlashAttention-4 on the strided views of the slots (out, lse, dq, dk, dv written where
    they belong, nothing copied; with GQA, dk and dv into key slots) against the float64
    oracle, whole and in position groups with slots that span them."""
    _, n, _, _, segs, rates = schedule
    q, k, v, dout = _gpu_inputs(schedule)
    dev = [t.cuda().requires_grad_() for t in (q, k, v)]
    reasons = backend_reasons(*dev, is_causal=is_causal)["flash_attn4"]
    if reasons:
        pytest.skip(f"flash_attn4 cannot run here: {'; '.join(reasons)}")
    if cut:
        cut_small(monkeypatch)
    copies: list[tuple[int, ...]] = []
    real_fill = slot_runs._fill

    def counting_fill(dest: torch.Tensor, result: torch.Tensor) -> None:
        if result.data_ptr() != dest.data_ptr():
            copies.append(tuple(dest.shape))
        real_fill(dest, result)

    monkeypatch.setattr(slot_runs, "_fill", counting_fill)
    runs = _spy(monkeypatch, ("slot_forward", "slot_backward"))
    poison_new_buffers(monkeypatch)
    out, lse = dilated_attention(*dev, segs, rates, is_causal=is_causal, backend="flash_attn4",
                                 return_lse=True)  # fmt: skip
    grads = torch.autograd.grad(out, dev, dout.cuda())
    assert "slot_forward" in runs and "slot_backward" in runs
    # Cut: groups of the shortest segment (batch 2), the longer slots spanning them; where no
    # group length fits the schedule (ragged), one group per batch element.
    slots = tuple(Slot(min(w, n), r) for w, r in zip(segs, rates, strict=True))
    size = grouped.slot_group_length(slots, n, 1) or n
    assert runs.count("slot_backward") == (2 * -(-n // size) if cut else 1)
    assert copies == [], "FlashAttention-4 did not write into the slots it was given"
    (ref_out, ref_lse, ref_grads), (low_out, low_lse, low_grads) = _gpu_oracles(schedule, is_causal)
    assert_close_to_oracle(out.cpu(), ref_out, low_out, name="out", dtype=torch.bfloat16)
    assert_close_to_oracle(lse.cpu(), ref_lse, low_lse, name="lse", dtype=torch.bfloat16)
    for name, got, ref, low in zip("qkv", grads, ref_grads, low_grads, strict=True):
        assert_close_to_oracle(got.cpu(), ref, low, name=f"d{name}", dtype=torch.bfloat16,
                               grad=True)  # fmt: skip


def test_gpu_oracles_are_the_oracle_computed_once() -> None:
    """The GPU test's shared oracles, on a small schedule: the float64 oracle (and its bf16
    replica) of ``_gpu_inputs``, computed once for a schedule's whole and grouped runs."""
    schedule = ("small", 40, 4, 2, (8, 16), (1, 2))
    _gpu_oracles.cache_clear()
    for _ in range(2):
        (out, lse, grads), (low_out, _, low_grads) = _gpu_oracles(schedule, True)
    q, k, v, dout = _gpu_inputs(schedule)
    assert q.shape == (2, 40, 4, 64) and k.shape == v.shape == (2, 40, 2, 64)
    leaves = [t.to(F64).requires_grad_() for t in (q, k, v)]
    want_out, want_lse = oracle_dilated_attention(*leaves, (8, 16), (1, 2), is_causal=True)
    want_grads = torch.autograd.grad(want_out, leaves, dout.to(F64))
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert all(torch.equal(g, w) for g, w in zip(grads, want_grads, strict=True))
    assert low_out.dtype == torch.bfloat16 and [g.dtype for g in low_grads] == [torch.bfloat16] * 3
    info = _gpu_oracles.cache_info()
    assert (info.hits, info.misses) == (1, 1)


def test_explain_says_whether_branches_go_into_slots() -> None:
    """``describe_plan`` (``explain``'s lines) on a kernel that writes into given buffers: every
    group of a slotted schedule says it goes into its slot, a GQA one where its key gradients
    go (by position below the group of 4 query heads, in the query layout from it); a GQA
    schedule whose offset classes' key heads are no strided slice says why not."""
    from dilated_attention.core.geometry.segment import describe_plan

    lines = describe_plan(plan_branches(64, 8, (8, 16, 32), (1, 2, 4)), 64, 8, True, True)
    assert len(lines) == 3
    assert all(line.endswith("merged once with the other branches") for line in lines), lines
    lines = describe_plan(plan_branches(64, 8, (8, 16, 32), (1, 2, 4)), 64, 2, True, True)
    layouts = [line.rpartition(" (GQA: dk, dv in key slots by ")[2] for line in lines]
    assert layouts == ["position)", "position)", "the query slots' layout)"], lines
    lines = describe_plan(plan_branches(36, 8, (12, 36), (1, 3)), 36, 2, True, True)
    assert all("merged as it comes (no branch slots: w=36 r=3: GQA" in line for line in lines)
    assert not any("slot" in line for line in describe_plan(
        plan_branches(64, 8, (8, 16), (1, 2)), 64, 8, True, False))  # fmt: skip
    # Ragged: r = 3 does not divide w = 16 (two offset-class lengths), N = 44 leaves shorter last
    # segments, whose whole segments before them run one batch element at a time.
    lines = describe_plan(plan_branches(44, 4, (8, 16), (1, 3)), 44, 4, True, True)
    assert all(line.endswith("merged once with the other branches") for line in lines), lines
    assert ["one batch element at a time" in line for line in lines] == [
        True, False, True, True, False
    ], lines  # fmt: skip


def _pairs(positions: int, rate: int, shift: int = 0, heads: int = 4) -> list[tuple[int, int]]:
    """The (position, head) cells where position and head share their class."""
    cells = itertools.product(range(positions), range(heads))
    return [(p, h) for p, h in cells if p % rate == (h + shift) % rate]


@pytest.mark.parametrize(
    ("pairs", "heads", "exact"),
    [
        (_pairs(12, 4), 4, True),
        (_pairs(12, 4, heads=8), 8, True),  # rows m * 8 + h: not the cells' own order
        (_pairs(13, 4), 4, False),  # a cell at position 12, past the 12 positions
        (_pairs(12, 4)[1:], 4, False),  # one cell missing
        (_pairs(12, 4, shift=1), 4, False),  # heads from a later one
        (_pairs(12, 2), 4, False),  # a finer rate's cells
    ],
    ids=["exact", "eight_heads", "past_the_end", "one_missing", "heads_shifted", "finer_rate"],
)
def test_cells_are_one_slot_only_where_they_are_exactly_its_rows(
    pairs: list[tuple[int, int]], heads: int, exact: bool
) -> None:
    """``Cells.slot_rows``: the cells of a rate-4 class over 12 positions are the slot's rows
    ``m * H + h`` (a spanning branch's compact results read as a slot); any other set, however
    close, is not."""
    from dilated_attention.core.geometry.cells import Cells

    positions, head_of = (torch.tensor(x) for x in zip(*pairs, strict=True))
    cells, _ = Cells.of([positions], [head_of], heads)
    index = cells.slot_rows(4, heads, 12)
    assert (index is not None) == exact
    if exact:
        want = torch.tensor([(p - h % 4) // 4 * heads + h for p, h in sorted(pairs)])
        assert torch.equal(index, want)


class _RecordedRuns:
    """``MathBackend.run_launches`` as a stand-in for a replay (Note [A slotted call's launches
    from a CUDA graph] in ``core/execution/executor.py``): each call's launches run, then the
    outputs they write are poisoned with NaN and the launches run again, as a replay into
    fresh buffers at the same addresses would (a backward's lse rows too: its launches copy
    them, so a replay does); the keys seen are kept."""

    def __init__(self) -> None:
        self.keys: list[tuple[object, ...]] = []

    def __call__(self, key: tuple[object, ...], tensors: list[torch.Tensor | None],
                 launches: object, keep: object = None) -> None:  # fmt: skip
        self.keys.append(key)
        launches()  # type: ignore[operator]
        # forward: (q, k, v, mask, out, lse, slots, slot lse); backward: (dout, q, k, v, out,
        # lse rows, mask, dq, dk, dv, slots..., lse): what the launches must write whole
        outputs = tensors[4:8] if key[0] == "slot_forward" else [tensors[5], *tensors[7:10]]
        for x in outputs:
            if x is not None and x.is_floating_point():
                x.fill_(float("nan"))
        launches()  # type: ignore[operator]


@pytest.mark.parametrize("cut", [False, True], ids=["whole", "grouped"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "schedule", [SLOTTED[0], SLOTTED[5], *GQA_SCHEDULES[:2]], ids=lambda s: s[0]
)
def test_slotted_calls_launch_through_the_backend_runner(
    schedule, is_causal: bool, cut: bool, writing_kernel: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A slotted plan's forward and backward, whole or in position groups, run their calls and
    merges through the backend's ``run_launches``, keyed by the step and the plan, and the
    launches write every output afresh: run a second time over outputs poisoned with NaN (a
    replay's fresh buffers), they give the float64 oracle's results, outputs and all gradients,
    with gradients and without."""
    from dilated_attention.backends.math import MathBackend

    segs, rates = schedule[4:]
    if cut:
        cut_small(monkeypatch)
    runs = _RecordedRuns()
    monkeypatch.setattr(MathBackend, "run_launches", lambda self, *args, **kw: runs(*args, **kw))
    q, k, v, dout, mask, leaves, ref_out, ref_lse = _trained_like_the_oracle(schedule, is_causal)
    # a differentiated forward runs whole; a cut plan's backward runs in groups
    steps = ["slot_forward", "grouped_backward" if cut else "slot_backward"]
    assert [key[0] for key in runs.keys] == steps
    again = dilated_attention(*leaves, segs, rates, is_causal=is_causal, backend="math",
                              key_padding_mask=mask)  # fmt: skip
    torch.autograd.grad(again, leaves, dout)
    # one plan for every call of the request, named by its identity: the calls' keys repeat
    assert runs.keys[2:] == runs.keys[:2] and runs.keys[0][1] == runs.keys[1][1]
    with torch.no_grad():
        out, lse = dilated_attention(q, k, v, segs, rates, is_causal=is_causal, backend="math",
                                     key_padding_mask=mask, return_lse=True)  # fmt: skip
    torch.testing.assert_close(out, ref_out.detach(), **TIGHT)
    torch.testing.assert_close(lse, ref_lse, **TIGHT)
    assert runs.keys[-1][0] == ("grouped_forward" if cut else "slot_forward")


def test_slotted_calls_with_dropout_launch_as_they_are(
    writing_kernel: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Calls that keep an ``aux`` (dropout's state) never go through ``run_launches``: a replay
    would make none."""
    from dilated_attention.backends.math import MathBackend

    runs = _RecordedRuns()
    monkeypatch.setattr(MathBackend, "run_launches", lambda self, *args, **kw: runs(*args, **kw))
    _, n, heads, _, segs, rates = SLOTTED[0]
    q, k, v, dout = _inputs(n, heads)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = dilated_attention(*leaves, segs, rates, backend="math", dropout_p=0.1)
    torch.autograd.grad(out, leaves, dout)
    assert runs.keys == [] and {"forward", "backward"} <= set(writing_kernel)


def test_slot_layout_is_computed_once_per_plan_and_shape() -> None:
    """A slotted call's buffer layout comes from the plan and the shapes alone: a second call of
    the same plan and shape reuses it, another shape gets its own, and the buffers' views
    over the whole range are the slots themselves (every row, every segment's lse)."""
    slots = (Slot(8, 1), Slot(16, 2), Slot(16, 4))
    like = torch.zeros(2, 20, 4, 3)
    slot_layout.cache_clear()
    first = SlotBuffers(slots, like, 20, with_lse=True)
    second = SlotBuffers(slots, like, 20, with_lse=True)
    assert (slot_layout.cache_info().misses, slot_layout.cache_info().hits) == (1, 1)
    one_row = SlotBuffers(slots, like[:1], 20, with_lse=True)
    assert slot_layout.cache_info().misses == 2
    for buffers, batch in ((first, 2), (second, 2), (one_row, 1)):
        spans: dict[str, list[tuple[int, int]]] = {"rows": [], "lse": []}
        for index, view in enumerate(buffers.views()):
            slot = slots[index]
            segments, rows = -(-20 // slot.segment_len), -(-slot.segment_len // slot.rate)
            assert view.rows.shape == (batch, segments * rows, 4, 3)
            assert view.lse is not None and view.lse.shape == (batch, segments, 4, rows)
            assert view.rows.data_ptr() == buffers.out(index).data_ptr()
            for name, part, flat in (("rows", view.rows, buffers.flat),
                                     ("lse", view.lse, buffers.lse_flat)):  # fmt: skip
                assert flat is not None and part.is_contiguous()
                start = (part.data_ptr() - flat.data_ptr()) // part.element_size()
                spans[name].append((start, start + part.numel()))
        # The slots tile each flat buffer: one after another, nothing shared, nothing left over.
        for name, flat in (("rows", buffers.flat), ("lse", buffers.lse_flat)):
            ends = spans[name]
            assert [a for a, _ in ends] == [0, *(b for _, b in ends[:-1])], name
            assert flat is not None and ends[-1][1] == flat.numel(), name
    with pytest.raises(ValueError, match="held"):
        SlotBuffers(slots, like, 20, with_lse=True, held=[1, 1])
