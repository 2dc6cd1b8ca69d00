"""Position-grouped plans (Note [Position-grouped plans] in ``core/geometry/grouped.py``): cut calls
cover exactly what the whole calls do, and a grouped plan equals the float64 oracle on outputs, lse
and every gradient (causal, GQA, ragged segments, key padding, batches), run on the CPU with the
grouping switched on there and groups made small. The GPU test checks the memory it saves."""

from __future__ import annotations

import pytest
import torch
from support.grouping import cut_small
from support.oracle import oracle_dilated_attention

import dilated_attention.core.execution.executor as executor
import dilated_attention.core.execution.fused as fused
import dilated_attention.core.geometry.grouped as grouped
from dilated_attention import dilated_attention
from dilated_attention.core.geometry.segment import dilated_plan, plan_branches
from dilated_attention.resolve.resolver import clear_resolved

F64 = torch.float64
TIGHT = {"atol": 1e-10, "rtol": 1e-7}

#: (id, N, H, Hkv, segments, rates): strided calls beside gathered ones (ragged w % r, a
#: shorter last segment, GQA the views cannot express) and a rate-1 reshape.
SCHEDULES = [
    ("longnet", 64, 8, 8, (8, 16, 32), (1, 2, 4)),
    ("gqa", 48, 8, 4, (8, 16), (2, 4)),
    ("gqa_gathered", 48, 6, 2, (12, 24), (2, 4)),
    ("ragged", 50, 4, 4, (10, 20), (3, 4)),
    ("short_last_segment", 44, 4, 2, (8, 16), (1, 2)),
]


@pytest.fixture
def small_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cut plans on the CPU too, into groups as small as the segments allow."""
    cut_small(monkeypatch)


def _inputs(n: int, heads: int, kv_heads: int, batch: int = 2, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n, heads, 8, generator=gen, dtype=F64)
    k, v = (torch.randn(batch, n, kv_heads, 8, generator=gen, dtype=F64) for _ in range(2))
    return q, k, v, torch.randn(batch, n, heads, 8, generator=gen, dtype=F64)


@pytest.mark.parametrize("strided", [True, False], ids=["views", "gathers"])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=[s[0] for s in SCHEDULES])
def test_cut_calls_cover_what_the_whole_calls_do(schedule, strided: bool) -> None:
    """Every (query row, key row) pair of the whole plan, once, from the cut calls shifted back
    by their group's start; groups start on segment boundaries of every branch."""
    _, n, heads, kv_heads, segs, rates = schedule
    plan = dilated_plan(plan_branches(n, heads, segs, rates), n, kv_heads, torch.device("cpu"),
                        False, strided)  # fmt: skip
    groups = fused.position_groups(n, segs, 1)
    assert len(groups) > 1, "the schedule must cut"
    q, k = torch.empty(1, n, heads, 8), torch.empty(1, n, kv_heads, 8)

    def pairs(row_calls, shift=0):
        seen = []
        for rc in row_calls:
            q_pos = rc.q_index // heads + shift
            kv_pos = rc.kv_index // kv_heads + shift
            seen.append(torch.stack([q_pos.flatten(), (rc.q_index % heads).flatten()], 1))
            seen.append(torch.stack([kv_pos.flatten(), (rc.kv_index % kv_heads).flatten()], 1))
        return sorted(map(tuple, torch.cat(seen).tolist()))

    whole = pairs(call.row_call(q, k) for call in plan.calls)
    cut = []
    for start, end in groups:
        sq, sk = q[:, start:end], k[:, start:end]
        for call in plan.calls:
            piece = call.within(start, end)
            if piece is not None:
                cut += pairs([piece.row_call(sq, sk)], start)
    assert sorted(cut) == whole


@pytest.mark.usefixtures("small_groups")
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=[s[0] for s in SCHEDULES])
def test_grouped_plan_matches_oracle(
    schedule, is_causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The math backend (reads strided rows) with a key padding mask on one batch element,
    against the float64 oracle: out, lse, dq, dk, dv from the whole forward and the grouped
    backward; then out and lse from the grouped forward of a call without gradients."""
    _, n, heads, kv_heads, segs, rates = schedule
    runs: list[str] = []
    for name in ("grouped_forward", "grouped_backward"):
        real = getattr(executor, name)
        spy = lambda *a, n=name, f=real, **kw: runs.append(n) or f(*a, **kw)  # noqa: E731
        monkeypatch.setattr(executor, name, spy)
    q, k, v, dout = _inputs(n, heads, kv_heads)
    mask = torch.zeros(2, n, dtype=torch.bool)
    mask[1, 3:n:5] = True
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = dilated_attention(*leaves, segs, rates, is_causal=is_causal, backend="math",
                                 key_padding_mask=mask, return_lse=True)  # fmt: skip
    grads = torch.autograd.grad(out, leaves, dout)
    assert runs == ["grouped_backward"], runs
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = oracle_dilated_attention(*ref_leaves, segs, rates, is_causal=is_causal,
                                                key_padding_mask=mask)  # fmt: skip
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, dout)
    torch.testing.assert_close(out, ref_out, **TIGHT)
    torch.testing.assert_close(lse, ref_lse, **TIGHT)
    for name, g, rg in zip("qkv", grads, ref_grads, strict=True):
        torch.testing.assert_close(g, rg, **TIGHT, msg=lambda m, x=name: f"d{x}: {m}")
    with torch.no_grad():
        out, lse = dilated_attention(q, k, v, segs, rates, is_causal=is_causal, backend="math",
                                     key_padding_mask=mask, return_lse=True)  # fmt: skip
    assert runs == ["grouped_backward", "grouped_forward"], runs
    torch.testing.assert_close(out, ref_out.detach(), **TIGHT)
    torch.testing.assert_close(lse, ref_lse, **TIGHT)


@pytest.mark.usefixtures("small_groups")
def test_grouped_backward_needs_the_forwards_aux(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dropout's kernel states belong to the whole forward's calls: the backward then runs whole
    too, and the gradients are those of the same dropout masks (the math backend's dropout is
    replayed from each call's generator state)."""
    _, n, heads, kv_heads, segs, rates = SCHEDULES[0]
    runs: list[str] = []
    real = executor.grouped_backward
    monkeypatch.setattr(executor, "grouped_backward",
                        lambda *a, **kw: runs.append("grouped") or real(*a, **kw))  # fmt: skip
    q, k, v, dout = _inputs(n, heads, kv_heads)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(3)
    out = dilated_attention(*leaves, segs, rates, dropout_p=0.3, backend="math")
    grads = torch.autograd.grad(out, leaves, dout)
    assert runs == []
    monkeypatch.setattr(grouped, "GROUPED_DEVICES", frozenset())
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(3)
    ref = dilated_attention(*ref_leaves, segs, rates, dropout_p=0.3, backend="math")
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    for g, rg in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, rg, atol=0, rtol=0)


@pytest.mark.usefixtures("small_groups")
def test_grouped_plan_equals_whole_plan_and_double_backward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cutting changes no row's arithmetic: the same out, lse and gradients as the whole plan;
    and create_graph=True (the double backward reads the whole plan's calls) still works."""
    _, n, heads, kv_heads, segs, rates = SCHEDULES[0]
    q, k, v, dout = _inputs(n, heads, kv_heads, batch=1)

    def run(create_graph: bool = False):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = dilated_attention(*leaves, segs, rates, is_causal=True, backend="math",
                                     return_lse=True)  # fmt: skip
        grads = torch.autograd.grad(out, leaves, dout, create_graph=create_graph)
        return out, lse, grads, leaves

    out, lse, grads, leaves = run(create_graph=True)
    second = torch.autograd.grad(sum(g.square().sum() for g in grads), leaves)
    monkeypatch.setattr(grouped, "GROUPED_DEVICES", frozenset())
    ref_out, ref_lse, ref_grads, ref_leaves = run(create_graph=True)
    ref_second = torch.autograd.grad(sum(g.square().sum() for g in ref_grads), ref_leaves)
    torch.testing.assert_close(out, ref_out, **TIGHT)
    torch.testing.assert_close(lse, ref_lse, **TIGHT)
    for g, rg in zip((*grads, *second), (*ref_grads, *ref_second), strict=True):
        torch.testing.assert_close(g, rg, **TIGHT)


def test_plans_stay_whole_where_the_scratch_is_small() -> None:
    """Off the listed devices and for dense plans the plan is returned as it is."""
    q = torch.empty(1, 64, 8, 8)
    plan = dilated_plan(plan_branches(64, 8, (8, 16), (1, 2)), 64, 8, q.device, False, True)
    assert grouped.grouped_plan(plan, q, (8, 16), True) is plan  # the CPU is not listed
    dense = dilated_plan(plan_branches(64, 8, (64,), (1,)), 64, 8, q.device, False, True)
    assert dense.whole and grouped.grouped_plan(dense, q, (64,), True) is dense


@pytest.mark.gpu
def test_grouped_views_bound_the_memory_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel that reads strided rows, grouped as every plan whose scratch is more than four
    heads of the smallest group: peak memory of forward+backward within 1.15x the eight
    unavoidable tensors (q, k, v, out and their gradients, plus dout), where the whole plan's
    gradient slots (0.75 units of q each, the rate-1 slot being the gradient) and the kernel's
    float32 dq accumulator take about 1.5x."""
    monkeypatch.setattr(fused, "MIN_GROUP_POSITIONS", 8192)
    device = torch.device("cuda")
    n, heads, dim = 1 << 17, 8, 64
    segs, rates = (2048, 4096, 8192), (1, 2, 4)
    q, k, v, dout = (torch.randn(1, n, heads, dim, device=device, dtype=torch.bfloat16)
                     for _ in range(4))  # fmt: skip
    leaves = [t.requires_grad_() for t in (q, k, v)]
    unit = q.numel() * q.element_size()

    def peak(backend: str) -> float:
        for t in leaves:
            t.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = dilated_attention(*leaves, segs, rates, is_causal=True, backend=backend)
        out.backward(dout)
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base + 4 * unit) / (8 * unit)

    backend = "flash_attn4" if not _reasons("flash_attn4", q) else "math"
    if backend == "math":
        pytest.skip("needs a kernel that reads strided rows on the GPU (flash_attn4)")
    grouped_ratio = peak(backend)
    monkeypatch.setattr(grouped, "GROUPED_DEVICES", frozenset())
    clear_resolved()  # a request's plans are made once: made again without groups
    whole_ratio = peak(backend)
    assert grouped_ratio <= 1.15, (grouped_ratio, whole_ratio)
    assert whole_ratio > grouped_ratio + 0.2, (grouped_ratio, whole_ratio)  # what grouping saves


def _reasons(name: str, q: torch.Tensor) -> list[str]:
    from dilated_attention.backends import get_backend
    from dilated_attention.backends.base import KernelInputs

    inputs = KernelInputs.from_tensors(q, q, requires_grad=True, dilated=True)
    return get_backend(name).not_supported_reasons(inputs)
