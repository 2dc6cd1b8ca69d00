"""Dilated rows as strided views (``core/geometry/strided.py``): which groups become view calls,
that the views are views, and that a plan of them equals the float64 oracle on outputs, lse, every
gradient and double backward, with GQA, causality, masks and ragged segments beside them."""

from __future__ import annotations

import pytest
import torch
from support.oracle import oracle_dilated_attention

from dilated_attention import dilated_attention
from dilated_attention.backends import get_backend
from dilated_attention.core.geometry.segment import GroupCall, dilated_plan, plan_branches
from dilated_attention.core.geometry.strided import DiagonalCall, StridedCall, kv_head_slice

F64 = torch.float64
TIGHT = {"atol": 1e-10, "rtol": 1e-7}

#: (id, N, H, Hkv, segments, rates): strided groups beside gathered ones (ragged w % r, GQA
#: groupings the views cannot express) and rates above the head count.
SCHEDULES = [
    ("longnet", 64, 8, 8, (8, 16, 32), (1, 2, 4)),
    ("gqa_rate_multiple_of_group", 48, 8, 4, (8, 16), (2, 4)),
    ("gqa_group_multiple_of_rate", 48, 8, 2, (8, 16), (2, 4)),
    ("gqa_mixed_falls_back", 48, 6, 2, (12, 24), (2, 4)),
    ("ragged_beside", 50, 4, 4, (10, 16), (3, 4)),  # r does not divide w, short last segments
    ("last_segment_below_rate", 35, 4, 4, (8, 16), (1, 4)),
    ("ragged_gqa_falls_back", 50, 8, 4, (10, 16), (3, 4)),
    ("diagonal_runs_ragged", 88, 16, 16, (40, 16), (12, 1)),
    ("rate_above_heads", 40, 2, 1, (8, 16), (4, 8)),
    ("gqa_diagonal", 48, 8, 2, (16, 48), (1, 8)),  # two diagonal calls sharing a kv head each
]


#: (Hkv, calls for r = 2, 4, 8) over H = 8 heads.
BRANCH_CALLS = [(8, (2, 2, 1)), (4, (2, 4, 4))]


@pytest.mark.parametrize(("kv_heads", "calls"), BRANCH_CALLS, ids=["mha", "gqa"])
def test_a_branch_takes_min_of_rate_and_heads_over_rate_calls(
    kv_heads: int, calls: tuple[int, ...]
) -> None:
    """H = 8: r = 2 is two offset classes of four heads; r = 4 and r = 8 are two and one diagonal
    calls of r heads each (Note [Diagonal head calls]), each head at its own offset, read as a
    view. With GQA (two query heads per key/value head) a diagonal call stops where the
    key/value head changes: r = 4 keeps its four offset classes (as many as calls of two heads),
    r = 8 takes four diagonal calls of two heads instead of eight classes, the pair's shared
    key/value head read one position further for the second head."""
    n, heads, group = 64, 8, 8 // kv_heads
    x = torch.randn(1, n, heads, 4)
    kv = torch.randn(1, n, kv_heads, 4)
    for rate, count in zip((2, 4, 8), calls, strict=True):
        groups = plan_branches(n, heads, (16,), (rate,))
        plan = dilated_plan(groups, n, kv_heads, x.device, False, strided=True)
        assert len(plan.calls) == count, rate
        if count == rate:  # one call per offset class
            assert not any(isinstance(c, DiagonalCall) for c in plan.calls)
            continue
        for call in plan.calls:
            assert isinstance(call, DiagonalCall)
            rows, kv_rows = call.q_rows(x), call.kv_rows(kv)  # (n_segments, 16 / r, k, D)
            assert rows._base is x and kv_rows._base is kv
            for j in range(call.num_heads):  # head h0 + j reads positions s0 + j + r * m
                head = call.first_head + j
                by_offset = x[0].view(n // 16, 16 // rate, rate, heads, 4)
                assert torch.equal(rows[:, :, j], by_offset[:, :, head % rate, head])
                kv_by_offset = kv[0].view(n // 16, 16 // rate, rate, kv_heads, 4)
                want = kv_by_offset[:, :, head % rate, head // group]
                assert torch.equal(kv_rows[:, :, j], want)


def test_ragged_offset_classes_take_diagonal_runs() -> None:
    """H = 16, r = 12 (the paper's rate) on segments of 40: offsets 0-3 get 4 rows, 4-11 get 3.
    The heads with 4 rows (0-3 and 12-15) and with 3 rows (4-11) are three runs of consecutive
    heads at consecutive offsets: three diagonal calls instead of twelve offset classes, each
    reading head ``h0 + j`` at offset ``h0 mod r + j`` as a view; a shorter last segment of 8
    takes two (heads 0-7, 12-15)."""
    n, heads = 88, 16
    x = torch.randn(1, n, heads, 4)
    plan = dilated_plan(plan_branches(n, heads, (40,), (12,)), n, heads, x.device, False, True)
    got = [(c.start, c.num_segments, c.first_head, c.num_heads) for c in plan.calls]  # type: ignore[attr-defined]
    assert sorted(got) == [(0, 2, 0, 4), (0, 2, 4, 8), (0, 2, 12, 4), (80, 1, 0, 8), (80, 1, 12, 4)]
    for call in plan.calls:
        rows = call.q_rows(x)  # (n_segments, c, k, D)
        assert rows._base is x
        for j in range(call.num_heads):  # type: ignore[attr-defined]
            head = call.first_head + j  # type: ignore[attr-defined]
            offset = head % 12
            for seg in range(call.num_segments):  # type: ignore[attr-defined]
                first = call.start + seg * 40 + offset  # type: ignore[attr-defined]
                want = x[0, first : first + (call.segment_len - offset + 11) // 12 * 12 : 12, head]  # type: ignore[attr-defined]
                assert torch.equal(rows[seg, :, j], want), (head, seg)


@pytest.mark.parametrize(
    ("offset", "rate", "heads", "kv_heads", "expected"),
    [
        (1, 2, 8, 8, slice(1, None, 2)),  # no GQA: their own heads
        (3, 4, 8, 4, slice(1, None, 2)),  # r a multiple of g = 2
        (1, 2, 8, 2, slice(None)),  # g = 4 a multiple of r: every kv head, twice
        (1, 2, 6, 2, None),  # g = 3, r = 2: no one step
    ],
)
def test_kv_heads_of_an_offset_class(
    offset: int, rate: int, heads: int, kv_heads: int, expected: slice | None
) -> None:
    got = kv_head_slice(offset, rate, heads, kv_heads)
    assert got == expected
    if got is not None:  # query head i of the call reads kv head i // repeat
        q_heads = list(range(heads))[offset::rate]
        kv = list(range(kv_heads))[got]
        repeat = len(q_heads) // len(kv)
        group = heads // kv_heads
        assert [h // group for h in q_heads] == [kv[i // repeat] for i in range(len(q_heads))]


def test_plans_read_views_where_rows_are_strided_and_gather_elsewhere() -> None:
    """Over 4 query heads and 2 key/value heads, w = 16, r = 4 is strided, w = 10, r = 3 is not
    (GQA the views cannot express); without GQA both are, ragged w = 10, r = 3 too; the view
    calls read views of the inputs (a run of segments over the whole sequence, or a batch of 1:
    otherwise the batch and segment dimensions cannot merge into one stride and the rows are
    copied, still correct)."""
    groups = plan_branches(50, 4, (10, 16), (3, 4))
    plan = dilated_plan(groups, 50, 2, torch.device("cpu"), True, strided=True)
    assert any(isinstance(call, StridedCall) for call in plan.calls)
    assert any(isinstance(call, GroupCall) for call in plan.calls)
    plan = dilated_plan(groups, 50, 4, torch.device("cpu"), True, strided=True)
    assert all(isinstance(call, StridedCall) for call in plan.calls)
    gathered = dilated_plan(groups, 50, 4, torch.device("cpu"), True)
    assert all(isinstance(call, GroupCall) for call in gathered.calls)
    for n, batch in ((48, 2), (50, 1)):
        x = torch.randn(batch, n, 4, 8)
        plan = dilated_plan(plan_branches(n, 4, (16,), (3,)), n, 4, x.device, True, strided=True)
        for call in plan.calls:
            if isinstance(call, StridedCall):
                rows = call.q_rows(x)
                assert rows._base is x or rows._base is x._base, (n, batch)  # a view of x


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=[s[0] for s in SCHEDULES])
def test_strided_calls_match_the_oracle(schedule: tuple, is_causal: bool, masked: bool) -> None:
    """Through the math backend (which reads strided views): outputs, lse and gradients equal
    the float64 oracle."""
    assert get_backend("math").reads_strided_rows
    _, n, heads, kv_heads, segs, rates = schedule
    gen = torch.Generator().manual_seed(3)
    shapes = [(2, n, heads, 8), (2, n, kv_heads, 8), (2, n, kv_heads, 8)]
    leaves = [torch.randn(s, generator=gen, dtype=F64).requires_grad_() for s in shapes]
    mask = torch.rand(2, n, generator=gen) < 0.2 if masked else None
    out, lse = dilated_attention(
        *leaves, list(segs), list(rates), is_causal=is_causal, key_padding_mask=mask,
        backend="math", return_lse=True,
    )  # fmt: skip
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    ref, ref_lse = oracle_dilated_attention(
        *ref_leaves, segs, rates, is_causal=is_causal, key_padding_mask=mask
    )
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout)
    torch.testing.assert_close(out, ref.detach(), **TIGHT)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse[finite], ref_lse[finite])
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, **TIGHT)


def test_double_backward_through_strided_calls() -> None:
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 16, 4, 4, generator=gen, dtype=F64).requires_grad_() for _ in "qkv")
    assert torch.autograd.gradgradcheck(
        lambda a, b, c: dilated_attention(a, b, c, [8, 16], [2, 4], is_causal=True,
                                          backend="math"),
        (q, k, v),
    )  # fmt: skip


def test_double_backward_through_ragged_and_diagonal_run_calls() -> None:
    """Ragged offset classes (r = 3 on segments of 8), diagonal runs of heads at consecutive
    offsets with one row count (r = 5 over 4 heads on segments of 12: heads 0-1 and 2-3) and
    shorter last segments (N = 22), differentiated twice."""
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 22, 4, 2, generator=gen, dtype=F64).requires_grad_() for _ in "qkv")
    groups = plan_branches(22, 4, (8, 12), (3, 5))
    plan = dilated_plan(groups, 22, 4, q.device, True, strided=True)
    assert any(isinstance(call, DiagonalCall) and call.num_heads == 2 for call in plan.calls)
    assert all(isinstance(call, StridedCall) for call in plan.calls)
    assert torch.autograd.gradgradcheck(
        lambda a, b, c: dilated_attention(a, b, c, [8, 12], [3, 5], is_causal=True,
                                          backend="math"),
        (q, k, v),
    )  # fmt: skip


def test_double_backward_through_gqa_diagonal_calls() -> None:
    """Two query heads per key/value head, r = 4 over 4 heads: two diagonal calls whose heads
    share a key/value head (Note [Diagonal head calls]), with a shorter last segment (N = 22),
    differentiated twice."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(1, 22, 4, 2, generator=gen, dtype=F64).requires_grad_()
    k, v = (torch.randn(1, 22, 2, 2, generator=gen, dtype=F64).requires_grad_() for _ in "kv")
    plan = dilated_plan(plan_branches(22, 4, (4, 12), (1, 4)), 22, 2, q.device, True, True)
    diagonal = [call for call in plan.calls if isinstance(call, DiagonalCall)]
    assert [(c.first_head, c.num_heads, c.kv_heads.start) for c in diagonal] == [
        (0, 2, 0), (2, 2, 1), (0, 2, 0), (2, 2, 1),
    ]  # fmt: skip
    assert torch.autograd.gradgradcheck(
        lambda a, b, c: dilated_attention(a, b, c, [4, 12], [1, 4], is_causal=True,
                                          backend="math"),
        (q, k, v),
    )  # fmt: skip
