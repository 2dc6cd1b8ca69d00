"""The one executor (``core/execution/executor.py``, Note [One executor]) on plans no public
function builds: calls of different kinds in one plan, key rows repeated inside a call, a key
padding mask on block-sparse calls, GQA. Each is compared with the float64 oracle
(``tests/support/oracle.py``: dense attention weighted by how often each (query, key) pair occurs in
the plan), on outputs, lse, gradients and second-order gradients."""

from __future__ import annotations

import pytest
import torch
from support.oracle import masked_attention
from support.triton import KERNEL_DEVICES, skip_without_triton

from dilated_attention.backends import get_backend
from dilated_attention.block_sparse.plan import SparseCall
from dilated_attention.core.autograd import run_attention
from dilated_attention.core.execution.executor import PlanRunner
from dilated_attention.core.geometry.calls import WholeCall
from dilated_attention.core.geometry.plan import Plan

B, N, H, HKV, D = 2, 24, 4, 2, 8


def _multiplicity(calls: list, heads: int, n: int) -> torch.Tensor:
    """(H, N, N): how many times each (query, key) pair occurs in the calls."""
    m = torch.zeros(heads, n, n, dtype=torch.int64)
    for call in calls:
        if isinstance(call, WholeCall):
            pairs = torch.ones(n, n, dtype=torch.int64)
            m += torch.tril(pairs) if call.causal else pairs
            continue
        for q_rows, k_rows in zip(call.q_index.tolist(), call.kv_index.tolist(), strict=True):
            for i, p in enumerate(q_rows):
                for j, t in enumerate(k_rows):
                    if not call.causal or j <= i:
                        m[:, p, t] += 1
    return m


def _plan(seed: int, n: int = N, piece: int = 4) -> list:
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randperm(n, generator=gen)
    return [
        # distinct query rows per call; key rows drawn with repeats (a key counted twice)
        SparseCall(
            rows[: 3 * piece].view(3, piece), torch.randint(0, n, (3, piece + 1), generator=gen),
            False,
        ),
        SparseCall(
            rows[3 * piece : 5 * piece].view(2, piece),
            torch.randint(0, n, (2, piece), generator=gen), True,
        ),
        WholeCall(causal=True),
    ]  # fmt: skip


def _inputs(
    dtype: torch.dtype = torch.float64, shape: tuple[int, ...] = (B, N, H, HKV, D)
) -> list[torch.Tensor]:
    batch, n, heads, kv_heads, dim = shape
    gen = torch.Generator().manual_seed(0)
    shapes = [(batch, n, heads, dim), (batch, n, kv_heads, dim), (batch, n, kv_heads, dim)]
    return [torch.randn(s, generator=gen, dtype=dtype).requires_grad_() for s in shapes]


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("backend", ["math", "cpu_flash"])
def test_a_mixed_plan_matches_the_oracle(masked: bool, backend: str) -> None:
    calls = _plan(seed=1)
    dtype = torch.float64 if backend == "math" else torch.float32
    q, k, v = _inputs(dtype)
    mask = torch.zeros(B, N, dtype=torch.bool)
    mask[1, -5:] = True
    mask[0, 3] = True
    key_mask = mask if masked else None
    runner = PlanRunner(Plan(tuple(calls)), get_backend(backend), D**-0.5)
    out, lse = run_attention(q, k, v, key_mask, runner)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = masked_attention(
        *leaves, _multiplicity(calls, H, N), key_padding_mask=key_mask
    )
    ref_grads = torch.autograd.grad(ref_out, leaves, dout.double())
    tol = {"rtol": 1e-9, "atol": 1e-9} if dtype == torch.float64 else {"rtol": 2e-4, "atol": 2e-5}
    torch.testing.assert_close(out.double(), ref_out, **tol)
    torch.testing.assert_close(lse.double(), ref_lse, **tol)
    for got, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got.double(), ref, **tol)


def test_a_mixed_plan_has_exact_second_order_gradients() -> None:
    n = 10
    calls = tuple(_plan(seed=2, n=n, piece=2))
    q, k, v = _inputs(shape=(1, n, 2, 1, 3))
    mask = torch.zeros(1, n, dtype=torch.bool)
    mask[0, -3:] = True
    math = get_backend("math")

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return run_attention(q, k, v, mask, PlanRunner(Plan(calls), math, 3**-0.5))[0]

    assert torch.autograd.gradcheck(run, (q, k, v))
    plain = torch.autograd.grad(run(q, k, v).square().sum(), (q, k, v))
    graph = torch.autograd.grad(run(q, k, v).square().sum(), (q, k, v), create_graph=True)
    for first, recomputed in zip(plain, graph, strict=True):  # the double-backward recompute
        torch.testing.assert_close(recomputed, first, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradgradcheck(run, (q, k, v))


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_in_place_merge_gets_the_rows_of_view_calls(
    is_causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A registered in-place merge (``register_in_place_merge``; the Triton one on CUDA) merges
    the calls whose rows are views of the accumulators, strided and diagonal ones included, and
    the gathered copies of the others, which are written back: the result equals the float32 run
    without it and the float64 oracle. A merge that received the wrong rows or lse layout, or a
    gathered copy that was not written back, would change it."""
    from support.oracle import oracle_dilated_attention

    from dilated_attention import dilated_attention
    from dilated_attention.core.execution import call_runs
    from dilated_attention.core.merge import merge_partial

    merged: list[tuple[int, ...]] = []

    def in_place(out, lse, part, part_lse):
        new_out, new_lse = merge_partial(out, lse, part, part_lse)
        out.copy_(new_out)
        lse.copy_(new_lse)
        merged.append(tuple(part.shape))

    gen = torch.Generator().manual_seed(4)
    # Two key/value heads for four query heads: w = 10, r = 3 is gathered (GQA the views cannot
    # express); r = 2 is two offset classes; r = 4 two diagonal calls of the two heads that
    # share a key/value head.
    q = torch.randn(1, 40, 4, 8, generator=gen)
    k, v = (torch.randn(1, 40, 2, 8, generator=gen) for _ in range(2))
    schedule = ([10, 8, 16], [3, 2, 4])
    plain = dilated_attention(q, k, v, *schedule, is_causal=is_causal, backend="math")
    monkeypatch.setitem(call_runs._IN_PLACE_MERGES, "cpu", lambda: in_place)
    got, lse = dilated_attention(
        q, k, v, *schedule, is_causal=is_causal, backend="math", return_lse=True
    )
    # (segments, rows, heads, D): w = 16's diagonal calls over its two whole segments and its
    # last, short one; two offset classes of w = 8; the gathered w = 10 as its copies (4 rows of
    # heads 0 and 3; 3 rows of heads 1 and 2).
    assert sorted(merged) == [
        *[(1, 2, 2, 8)] * 2, *[(2, 4, 2, 8)] * 2, (4, 3, 2, 8), (4, 4, 2, 8), (5, 4, 2, 8),
        (5, 4, 2, 8),
    ]  # fmt: skip
    want, want_lse = oracle_dilated_attention(
        *(x.double() for x in (q, k, v)), *schedule, is_causal=is_causal
    )
    torch.testing.assert_close(got, plain, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


def _calls_of_every_kind(device: str) -> dict[str, object]:
    """(B, 12, 4, D) rows: a slice, an offset class (w = 4, r = 2), a diagonal (w = 8, r = 4)
    and a gathered group (w = 6, r = 4, ragged)."""
    from dilated_attention.core.geometry.calls import SliceCall
    from dilated_attention.core.geometry.segment import GroupCall, plan_branches
    from dilated_attention.core.geometry.strided import DiagonalCall, StridedCall

    ragged = plan_branches(12, 4, (6,), (4,))[0]
    return {
        "slice": SliceCall(q=slice(3, 11), kv=slice(0, 5), causal=False),
        "offset_class": StridedCall(0, 3, 4, 2, 1, slice(1, None, 2), False),
        "diagonal": DiagonalCall(0, 1, 8, 4, 0, 4, False),
        "gathered": GroupCall(ragged, 4, torch.device(device), False),
    }


@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
@pytest.mark.parametrize("kind", ["slice", "offset_class", "diagonal", "gathered"])
def test_triton_in_place_merge_writes_the_calls_rows_like_the_torch_merge(
    kind: str, device: str, dtypes: list[torch.dtype], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``merge_rows`` merges view calls with the Triton kernel in place (on CUDA; on the CPU
    through Triton's interpreter), and gathered ones in their copies, written back: only the
    call's rows change, to the torch merge's values; empty (-inf) accumulator rows take the
    part as it is; a strided 16-bit part (as a backend may return) is read right."""
    from dilated_attention.backends.triton import merge_kernel
    from dilated_attention.core.execution import call_runs

    skip_without_triton(device)
    monkeypatch.setitem(call_runs._IN_PLACE_MERGES, device, merge_kernel)
    call = _calls_of_every_kind(device)[kind]
    gen = torch.Generator(device=device).manual_seed(0)
    out = torch.randn(1, 12, 4, 16, device=device, generator=gen)
    lse = torch.randn(1, 12, 4, 1, device=device, generator=gen)
    lse[:, 4] = float("-inf")
    out[:, 4] = 0.0
    rows = call.q_rows(out)  # (B', L, Hc, D)
    part_out = torch.randn(rows.shape[0], rows.shape[2], rows.shape[1], 16, device=device,
                           generator=gen).transpose(1, 2).to(dtypes[-1])  # fmt: skip
    part_lse = torch.randn(rows.shape[0], rows.shape[2], rows.shape[1], device=device,
                           generator=gen)  # fmt: skip
    fused_out, fused_lse = out.clone(), lse.clone()
    call_runs.merge_rows(call, fused_out, fused_lse, part_out, part_lse)
    monkeypatch.delitem(call_runs._IN_PLACE_MERGES, device)
    want_out, want_lse = out.clone(), lse.clone()
    call_runs.merge_rows(call, want_out, want_lse, part_out, part_lse)
    torch.testing.assert_close(fused_out, want_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(fused_lse, want_lse, atol=1e-6, rtol=1e-6)
    assert not torch.equal(fused_out, out)  # the call's rows did change
