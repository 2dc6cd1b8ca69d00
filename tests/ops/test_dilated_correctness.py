"""``dilated_attention`` vs the float64 oracle: out, lse and dq/dk/dv, for every backend and dtype.

Backends come from the registry (``list_backends()``), so a new backend is covered by these tests;
one that cannot run the inputs is skipped with the reasons it gives (``backend_reasons``).
``None`` (automatic selection) is always tested.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from support.backend_params import (
    CPU_BACKENDS,
    DEVICE_BACKENDS,
    DTYPES,
    backend_id,
    dtype_id,
    leaves,
    skip_unless_runnable,
    to,
)
from support.oracle import oracle_dilated_attention
from support.tolerances import LOW_PRECISION, assert_close_to_oracle
from torch import Tensor

from dilated_attention import dilated_attention


@dataclass(frozen=True)
class Case:
    """One dilated-attention configuration."""

    id: str
    N: int
    H: int
    segments: tuple[int, ...]
    rates: tuple[int, ...]
    H_kv: int | None = None
    B: int = 2
    D: int = 16
    padding: str | None = None  # None | "random" | "segment"
    scale: float | None = None

    @property
    def kv_heads(self) -> int:
        return self.H if self.H_kv is None else self.H_kv


CASES = [
    Case("one_branch_dense", N=32, H=2, segments=(32,), rates=(1,), D=8),
    Case("pow2_three_branches", N=64, H=4, segments=(8, 16, 32), rates=(1, 2, 4)),
    Case("rates_3_6", N=72, H=6, segments=(12, 24, 72), rates=(1, 3, 6), D=8),
    # LongNet pairs r=6 with w=16384: rates that do not divide their segment -> ragged rows;
    # N=50 also leaves a last w=16 segment of length 2, shorter than most offsets.
    Case("ragged_w10r3_w16r6", N=50, H=6, segments=(10, 16), rates=(3, 6)),
    Case("partial_last_37", N=37, H=4, segments=(8, 16), rates=(1, 2), D=8),
    Case("partial_last_61", N=61, H=4, segments=(8, 24, 48), rates=(1, 2, 4)),
    Case("segment_longer_than_seq", N=40, H=4, segments=(16, 128), rates=(1, 4), D=8),
    Case("heads_more_than_rates", N=64, H=8, segments=(8, 16, 32), rates=(1, 2, 4), D=8),
    Case("heads_fewer_than_rate", N=64, H=2, segments=(8, 32), rates=(1, 4)),
    Case("long_schedule_r12", N=96, H=8, B=1, segments=(16, 32, 96), rates=(1, 6, 12), D=8),
    Case("gqa_8_2", N=64, H=8, H_kv=2, segments=(8, 16, 32), rates=(1, 2, 4), D=8),
    Case("mqa_4_1", N=48, H=4, H_kv=1, segments=(12, 24), rates=(1, 3)),
    Case("pad_random", N=64, H=4, H_kv=2, segments=(8, 16, 32), rates=(1, 2, 4), padding="random"),
    Case("pad_whole_segment", N=64, H=4, segments=(16, 32), rates=(1, 2), padding="segment"),
    # head 0 covers only even positions, head 1 only odd ones: half the rows are uncovered
    Case("uncovered_rows", N=32, H=2, segments=(8,), rates=(2,)),
    # one branch, rate 1: local attention in several segments (one dense row group) and, with
    # w = N, plain dense attention (the plan of one whole call)
    Case("one_branch_local", N=32, H=4, H_kv=2, segments=(8,), rates=(1,), D=8),
    Case("one_branch_whole", N=24, H=2, segments=(24,), rates=(1,), D=8),
    Case("uncovered_gqa_partial", N=43, H=3, H_kv=1, segments=(9,), rates=(4,), D=8),
    Case("segment_length_one", N=20, H=2, segments=(1, 8), rates=(1, 2), D=8),
    Case("explicit_scale", N=48, H=4, segments=(8, 16, 48), rates=(1, 2, 3), scale=0.3),
]


def _padding_mask(case: Case) -> Tensor | None:
    """(B, N) bool, True = ignore. "segment": batch 1 pads the first w=32 segment entirely."""
    if case.padding is None:
        return None
    mask = torch.rand(case.B, case.N) < 0.3
    if case.padding == "segment":
        mask[1] = False
        mask[1, :32] = True
    return mask


def _inputs(case: Case, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """q, k, v, dout drawn in float64 and rounded once to ``dtype``."""
    q = torch.randn(case.B, case.N, case.H, case.D, dtype=torch.float64)
    k = torch.randn(case.B, case.N, case.kv_heads, case.D, dtype=torch.float64)
    v = torch.randn(case.B, case.N, case.kv_heads, case.D, dtype=torch.float64)
    dout = torch.randn(case.B, case.N, case.H, case.D, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype), dout.to(dtype)


def _run_impl(
    case: Case,
    backend: str | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    is_causal: bool,
    key_padding_mask: Tensor | None,
) -> tuple[Tensor, Tensor]:
    out, lse = dilated_attention(
        q,
        k,
        v,
        list(case.segments),
        list(case.rates),
        is_causal=is_causal,
        scale=case.scale,
        key_padding_mask=key_padding_mask,
        backend=backend,
        return_lse=True,
    )
    return out, lse


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize(("device", "backend"), DEVICE_BACKENDS)
def test_matches_oracle(
    case: Case, is_causal: bool, dtype: torch.dtype, backend: str | None, device: str
) -> None:
    """Output, lse and dq/dk/dv equal the float64 oracle (table, plus low-precision ratio)."""
    q0, k0, v0, dout = _inputs(case, dtype)
    mask = _padding_mask(case)
    q, k, v = leaves(q0, k0, v0, device=device)
    dev_mask = to(mask, device)
    skip_unless_runnable(backend, q, k, v, is_causal=is_causal, key_padding_mask=dev_mask)

    out, lse = _run_impl(case, backend, q, k, v, is_causal=is_causal, key_padding_mask=dev_mask)
    assert out.dtype == dtype and out.shape == q.shape and out.device == q.device
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert lse.shape == (case.B, case.H, case.N) and lse.device == q.device
    assert not lse.requires_grad
    grads = [g.cpu() for g in torch.autograd.grad(out, (q, k, v), dout.to(device))]
    out, lse = out.detach().cpu(), lse.cpu()

    kwargs = dict(is_causal=is_causal, scale=case.scale, key_padding_mask=mask)
    q64, k64, v64 = leaves(q0, k0, v0, dtype=torch.float64)
    out64, lse64 = oracle_dilated_attention(q64, k64, v64, case.segments, case.rates, **kwargs)
    grads64 = torch.autograd.grad(out64, (q64, k64, v64), dout.to(torch.float64))

    ref_out = ref_lse = None
    ref_grads: tuple[Tensor | None, ...] = (None, None, None)
    if dtype in LOW_PRECISION:
        ql, kl, vl = leaves(q0, k0, v0)
        ref_out, ref_lse = oracle_dilated_attention(
            ql, kl, vl, case.segments, case.rates, compute_dtype=dtype, **kwargs
        )
        ref_grads = torch.autograd.grad(ref_out, (ql, kl, vl), dout)

    assert_close_to_oracle(out, out64, ref_out, name="out", dtype=dtype)
    assert_close_to_oracle(lse, lse64, ref_lse, name="lse", dtype=dtype)
    for name, g, g64, gref in zip(("dq", "dk", "dv"), grads, grads64, ref_grads, strict=True):
        assert g.dtype == dtype
        assert bool(torch.isfinite(g).all()), f"{name} has non-finite entries"
        assert_close_to_oracle(g, g64, gref, name=name, dtype=dtype, grad=True)

    # Rows no branch covers (or with every key masked) are exactly zero, with lse -inf.
    empty = torch.isneginf(lse64).transpose(1, 2)  # (B, N, H)
    assert torch.equal(torch.isneginf(lse).transpose(1, 2), empty)
    assert bool((out[empty] == 0).all()), "uncovered rows must output exactly 0"
    assert not bool(torch.isinf(out).any())


def _case(case_id: str) -> Case:
    return next(c for c in CASES if c.id == case_id)


def test_cases_exercise_what_they_claim() -> None:
    """The case table really contains uncovered rows, fully masked rows and partial segments."""
    for case_id in ("uncovered_rows", "uncovered_gqa_partial", "pad_whole_segment"):
        case = _case(case_id)
        q, k, v, _ = _inputs(case, torch.float64)
        mask = _padding_mask(case)
        _, lse = oracle_dilated_attention(q, k, v, case.segments, case.rates, key_padding_mask=mask)
        assert bool(torch.isneginf(lse).any()), case_id
        assert not bool(torch.isneginf(lse).all()), case_id
    for case_id in ("partial_last_37", "partial_last_61", "ragged_w10r3_w16r6"):
        case = _case(case_id)
        assert any(case.N % w for w in case.segments), case_id
    ragged = _case("ragged_w10r3_w16r6")
    assert all(w % r for w, r in zip(ragged.segments, ragged.rates, strict=True))


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("H", "H_kv"), [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=dtype_id)
@pytest.mark.parametrize(("device", "backend"), DEVICE_BACKENDS)
def test_single_full_branch_is_sdpa(
    is_causal: bool, H: int, H_kv: int, dtype: torch.dtype, backend: str | None, device: str
) -> None:
    """One branch (N, 1) is plain attention: equals F.scaled_dot_product_attention, grads too."""
    B, N, D = 2, 29, 16
    q0 = torch.randn(B, N, H, D, dtype=torch.float64).to(dtype)
    k0 = torch.randn(B, N, H_kv, D, dtype=torch.float64).to(dtype)
    v0 = torch.randn(B, N, H_kv, D, dtype=torch.float64).to(dtype)
    dout = torch.randn(B, N, H, D, dtype=torch.float64)
    q, k, v = leaves(q0, k0, v0, device=device)
    skip_unless_runnable(backend, q, k, v, is_causal=is_causal, key_padding_mask=None)
    out = dilated_attention(q, k, v, [N], [1], is_causal=is_causal, backend=backend)
    assert isinstance(out, Tensor)  # return_lse=False gives the output alone
    grads = [g.cpu() for g in torch.autograd.grad(out, (q, k, v), dout.to(device, dtype))]
    out = out.detach().cpu()

    q64, k64, v64 = leaves(q0, k0, v0, dtype=torch.float64)
    want = F.scaled_dot_product_attention(
        q64.transpose(1, 2),
        k64.transpose(1, 2),
        v64.transpose(1, 2),
        is_causal=is_causal,
        enable_gqa=H_kv != H,
    ).transpose(1, 2)
    want_grads = torch.autograd.grad(want, (q64, k64, v64), dout)
    assert_close_to_oracle(out, want, name="out", dtype=dtype)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads, strict=True):
        assert_close_to_oracle(g, w, name=name, dtype=dtype, grad=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_output_and_lse_dtypes(dtype: torch.dtype) -> None:
    """out keeps the input dtype; lse is float64 for float64 inputs, else float32, and detached."""
    q = torch.randn(1, 24, 2, 8, dtype=dtype, requires_grad=True)
    out, lse = dilated_attention(q, q, q, [8, 24], [1, 2], return_lse=True)
    assert out.dtype == dtype
    assert out.shape == (1, 24, 2, 8)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert lse.shape == (1, 2, 24)
    assert not lse.requires_grad and lse.grad_fn is None
    assert out.requires_grad
    plain = dilated_attention(q, q, q, [8, 24], [1, 2])
    assert isinstance(plain, Tensor)
    torch.testing.assert_close(plain, out, atol=0, rtol=0)


@pytest.mark.parametrize("case_id", ["pow2_three_branches", "ragged_w10r3_w16r6", "gqa_8_2"])
@pytest.mark.parametrize("backend", CPU_BACKENDS, ids=backend_id)
def test_forward_without_grad(case_id: str, backend: str | None) -> None:
    """Inference (no_grad, inputs without requires_grad) gives the oracle's output and lse."""
    case = _case(case_id)
    q, k, v, _ = _inputs(case, torch.float32)
    skip_unless_runnable(backend, q, k, v, is_causal=True, key_padding_mask=None)
    with torch.no_grad():
        out, lse = _run_impl(case, backend, q, k, v, is_causal=True, key_padding_mask=None)
    want, want_lse = oracle_dilated_attention(q, k, v, case.segments, case.rates, is_causal=True)
    assert_close_to_oracle(out, want, name="out")
    assert_close_to_oracle(lse, want_lse, name="lse", dtype=torch.float32)


@pytest.mark.parametrize("backend", CPU_BACKENDS, ids=backend_id)
def test_non_contiguous_inputs(backend: str | None) -> None:
    """Inputs that are (B, H, N, D) storage viewed as BNHD (non-contiguous) match the oracle."""
    case = _case("partial_last_37")
    B, N, H, D = case.B, case.N, case.H, case.D
    base = [torch.randn(B, H, N, D, dtype=torch.float64) for _ in range(4)]
    q, k, v = (x.transpose(1, 2).requires_grad_() for x in base[:3])
    dout = base[3].transpose(1, 2)
    assert not q.is_contiguous()
    skip_unless_runnable(backend, q, k, v, is_causal=True, key_padding_mask=None)
    out, lse = _run_impl(case, backend, q, k, v, is_causal=True, key_padding_mask=None)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = leaves(q, k, v)
    want, want_lse = oracle_dilated_attention(
        q64, k64, v64, case.segments, case.rates, is_causal=True
    )
    want_grads = torch.autograd.grad(want, (q64, k64, v64), dout)
    assert_close_to_oracle(out, want, name="out")
    assert_close_to_oracle(lse, want_lse, name="lse")
    for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads, strict=True):
        assert_close_to_oracle(g, w, name=name, grad=True)


def test_default_scale_is_inverse_sqrt_head_dim() -> None:
    """scale=None equals scale=head_dim**-0.5 and differs from another scale."""
    q, k, v = (torch.randn(1, 32, 2, 16, dtype=torch.float64) for _ in range(3))
    default = dilated_attention(q, k, v, [8, 32], [1, 2])
    explicit = dilated_attention(q, k, v, [8, 32], [1, 2], scale=1 / math.sqrt(16))
    other = dilated_attention(q, k, v, [8, 32], [1, 2], scale=0.5)
    torch.testing.assert_close(default, explicit, atol=1e-12, rtol=1e-10)
    assert (default - other).abs().max() > 1e-3
