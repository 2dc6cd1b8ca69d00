"""``dilated_attention`` beyond the oracle suite (``test_correctness.py``): one full branch equals
SDPA, output and lse dtypes, inference without gradients, strided inputs, the default scale."""

from __future__ import annotations

import math

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
)
from support.cases import DILATED_CASES, Case, case_named, inputs
from support.oracle import oracle_dilated_attention
from support.tolerances import assert_close_to_oracle
from torch import Tensor

from dilated_attention import dilated_attention


def _case(case_id: str) -> Case:
    return case_named(DILATED_CASES, case_id)


def _run_impl(
    c: Case, backend: str | None, q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool,
    key_padding_mask: Tensor | None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    return c.run(q, k, v, is_causal=is_causal, key_padding_mask=key_padding_mask, backend=backend)


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
    q, k, v, _ = inputs(case, torch.float32)
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
