"""Dense ``attention`` beyond the oracle suite (``test_correctness.py``): against
F.scaled_dot_product_attention on every backend, output and lse dtypes, inference without
gradients."""

from __future__ import annotations

import pytest
import torch
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
from support.cases import DENSE_CASES, Case, case_named, inputs, padding_mask
from support.oracle import oracle_attention
from support.sdpa import sdpa_bnhd
from support.tolerances import assert_close_to_oracle
from torch import Tensor

from dilated_attention import attention


@pytest.mark.parametrize("shape", DENSE_CASES, ids=[s.id for s in DENSE_CASES])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=dtype_id)
@pytest.mark.parametrize(("device", "backend"), DEVICE_BACKENDS)
def test_matches_sdpa(
    shape: Case, is_causal: bool, dtype: torch.dtype, backend: str | None, device: str
) -> None:
    """Output and grads equal F.scaled_dot_product_attention (float64) wherever a row has a key."""
    q0, k0, v0, dout = inputs(shape, dtype)
    mask = padding_mask(shape)
    q, k, v = leaves(q0, k0, v0, device=device)
    dev_mask = to(mask, device)
    skip_unless_runnable(backend, q, k, v, is_causal=is_causal, key_padding_mask=dev_mask)
    out = attention(
        q, k, v, is_causal=is_causal, scale=shape.scale, key_padding_mask=dev_mask, backend=backend
    )
    assert isinstance(out, Tensor)  # return_lse=False gives the output alone
    q64, k64, v64 = leaves(q0, k0, v0, dtype=torch.float64)
    want = sdpa_bnhd(q64, k64, v64, is_causal=is_causal, scale=shape.scale, mask=mask)
    # SDPA gives NaN on rows with no visible key (the library gives 0): compare the others only.
    has_key = ~torch.isnan(want).any(dim=-1)  # (B, N, H)
    assert bool(has_key.any())
    dout = dout.to(torch.float64) * has_key[..., None]
    grads = [g.cpu() for g in torch.autograd.grad(out, (q, k, v), dout.to(device, dtype))]
    want_grads = torch.autograd.grad(want[has_key], (q64, k64, v64), dout[has_key])
    out = out.detach().cpu()
    assert_close_to_oracle(out[has_key], want[has_key], name="out", dtype=dtype)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads, strict=True):
        assert_close_to_oracle(g, w, name=name, dtype=dtype, grad=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_output_and_lse_dtypes(dtype: torch.dtype) -> None:
    """out keeps the input dtype; lse is float64 for float64 inputs, else float32, and detached."""
    q = torch.randn(2, 9, 2, 8, dtype=dtype, requires_grad=True)
    out, lse = attention(q, q, q, is_causal=True, return_lse=True)
    assert out.dtype == dtype and out.shape == (2, 9, 2, 8)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert lse.shape == (2, 2, 9)
    assert not lse.requires_grad and lse.grad_fn is None
    assert out.requires_grad


@pytest.mark.parametrize("backend", CPU_BACKENDS, ids=backend_id)
def test_forward_without_grad(backend: str | None) -> None:
    """Inference (no_grad, inputs without requires_grad) gives the oracle's output and lse."""
    q, k, v, _ = inputs(case_named(DENSE_CASES, "gqa_8_2"), torch.float32)
    skip_unless_runnable(backend, q, k, v, is_causal=True, key_padding_mask=None)
    with torch.no_grad():
        out, lse = attention(q, k, v, is_causal=True, backend=backend, return_lse=True)
    want, want_lse = oracle_attention(q, k, v, is_causal=True)
    assert_close_to_oracle(out, want, name="out")
    assert_close_to_oracle(lse, want_lse, name="lse", dtype=torch.float32)
