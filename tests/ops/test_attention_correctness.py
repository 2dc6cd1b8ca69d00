"""Dense ``attention`` vs the float64 oracle and F.scaled_dot_product_attention, all backends.

Outputs, lse and dq/dk/dv are compared. Backends come from the registry; one that cannot run the
inputs is skipped with its own reasons. ``None`` (automatic selection) is always tested.
"""

from __future__ import annotations

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
from support.oracle import oracle_attention
from support.tolerances import LOW_PRECISION, assert_close_to_oracle
from torch import Tensor

from dilated_attention import attention


@dataclass(frozen=True)
class Shape:
    """One dense-attention configuration."""

    id: str
    N: int
    H: int
    H_kv: int
    D: int = 16
    B: int = 2
    padding: str | None = None  # None | "random" | "prefix" (fully masked rows when causal)
    scale: float | None = None


SHAPES = [
    Shape("n1", N=1, H=2, H_kv=2, D=8),
    Shape("odd_17", N=17, H=3, H_kv=3),
    Shape("n64", N=64, H=4, H_kv=4, D=8),
    Shape("odd_93", N=93, H=2, H_kv=2, B=1),
    Shape("gqa_8_2", N=33, H=8, H_kv=2, D=8),
    Shape("mqa_4_1", N=40, H=4, H_kv=1),
    Shape("pad_random", N=48, H=4, H_kv=2, padding="random"),
    Shape("pad_prefix", N=31, H=2, H_kv=2, padding="prefix"),
    Shape("pad_all_row", N=24, H=2, H_kv=1, padding="all"),
    Shape("explicit_scale", N=37, H=4, H_kv=4, scale=0.21),
]


def _padding_mask(shape: Shape) -> Tensor | None:
    """(B, N) bool, True = ignore the key.

    "prefix": batch 1 pads its first 5 keys (causal rows 0..4 see nothing).
    "all": batch 1 pads every key (every row of batch 1 sees nothing).
    """
    if shape.padding is None:
        return None
    mask = torch.rand(shape.B, shape.N) < 0.3
    if shape.padding == "prefix":
        mask[1] = False
        mask[1, :5] = True
    elif shape.padding == "all":
        mask[1] = True
    return mask


def _inputs(shape: Shape, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """q, k, v, dout drawn in float64 and rounded once to ``dtype``."""
    q = torch.randn(shape.B, shape.N, shape.H, shape.D, dtype=torch.float64)
    k = torch.randn(shape.B, shape.N, shape.H_kv, shape.D, dtype=torch.float64)
    v = torch.randn(shape.B, shape.N, shape.H_kv, shape.D, dtype=torch.float64)
    dout = torch.randn(shape.B, shape.N, shape.H, shape.D, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype), dout.to(dtype)


def _sdpa_bnhd(
    q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool, scale: float | None, mask: Tensor | None
) -> Tensor:
    """F.scaled_dot_product_attention in BNHD layout; ``mask``: key padding, True = ignore."""
    attn_mask = None
    if mask is not None:
        attn_mask = ~mask[:, None, None, :]
        if is_causal:  # SDPA refuses attn_mask together with is_causal: fold causality in
            N = q.shape[1]
            attn_mask = attn_mask & torch.ones(N, N, dtype=torch.bool).tril()
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=attn_mask,
        is_causal=is_causal and mask is None,
        scale=scale,
        enable_gqa=k.shape[2] != q.shape[2],
    )
    return out.transpose(1, 2)


@pytest.mark.parametrize("shape", SHAPES, ids=[s.id for s in SHAPES])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize(("device", "backend"), DEVICE_BACKENDS)
def test_matches_oracle(
    shape: Shape, is_causal: bool, dtype: torch.dtype, backend: str | None, device: str
) -> None:
    """Output, lse and dq/dk/dv equal the float64 oracle (table, plus low-precision ratio)."""
    q0, k0, v0, dout = _inputs(shape, dtype)
    mask = _padding_mask(shape)
    q, k, v = leaves(q0, k0, v0, device=device)
    dev_mask = to(mask, device)
    skip_unless_runnable(backend, q, k, v, is_causal=is_causal, key_padding_mask=dev_mask)

    out, lse = attention(
        q,
        k,
        v,
        is_causal=is_causal,
        scale=shape.scale,
        key_padding_mask=dev_mask,
        backend=backend,
        return_lse=True,
    )
    assert out.dtype == dtype and out.shape == q.shape and out.device == q.device
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert lse.shape == (shape.B, shape.H, shape.N) and lse.device == q.device
    assert not lse.requires_grad
    grads = [g.cpu() for g in torch.autograd.grad(out, (q, k, v), dout.to(device))]
    out, lse = out.detach().cpu(), lse.cpu()

    kwargs = dict(is_causal=is_causal, scale=shape.scale, key_padding_mask=mask)
    q64, k64, v64 = leaves(q0, k0, v0, dtype=torch.float64)
    out64, lse64 = oracle_attention(q64, k64, v64, **kwargs)
    grads64 = torch.autograd.grad(out64, (q64, k64, v64), dout.to(torch.float64))

    ref_out = ref_lse = None
    ref_grads: tuple[Tensor | None, ...] = (None, None, None)
    if dtype in LOW_PRECISION:
        ql, kl, vl = leaves(q0, k0, v0)
        ref_out, ref_lse = oracle_attention(ql, kl, vl, compute_dtype=dtype, **kwargs)
        ref_grads = torch.autograd.grad(ref_out, (ql, kl, vl), dout)

    assert_close_to_oracle(out, out64, ref_out, name="out", dtype=dtype)
    assert_close_to_oracle(lse, lse64, ref_lse, name="lse", dtype=dtype)
    for name, g, g64, gref in zip(("dq", "dk", "dv"), grads, grads64, ref_grads, strict=True):
        assert g.dtype == dtype
        assert bool(torch.isfinite(g).all()), f"{name} has non-finite entries"
        assert_close_to_oracle(g, g64, gref, name=name, dtype=dtype, grad=True)

    # Rows whose keys are all masked output exactly 0, with lse -inf.
    empty = torch.isneginf(lse64).transpose(1, 2)  # (B, N, H)
    assert torch.equal(torch.isneginf(lse).transpose(1, 2), empty)
    assert bool((out[empty] == 0).all()), "fully masked rows must output exactly 0"


@pytest.mark.parametrize("shape", SHAPES, ids=[s.id for s in SHAPES])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=dtype_id)
@pytest.mark.parametrize(("device", "backend"), DEVICE_BACKENDS)
def test_matches_sdpa(
    shape: Shape, is_causal: bool, dtype: torch.dtype, backend: str | None, device: str
) -> None:
    """Output and grads equal F.scaled_dot_product_attention (float64) wherever a row has a key."""
    q0, k0, v0, dout = _inputs(shape, dtype)
    mask = _padding_mask(shape)
    q, k, v = leaves(q0, k0, v0, device=device)
    dev_mask = to(mask, device)
    skip_unless_runnable(backend, q, k, v, is_causal=is_causal, key_padding_mask=dev_mask)
    out = attention(
        q, k, v, is_causal=is_causal, scale=shape.scale, key_padding_mask=dev_mask, backend=backend
    )
    assert isinstance(out, Tensor)  # return_lse=False gives the output alone
    q64, k64, v64 = leaves(q0, k0, v0, dtype=torch.float64)
    want = _sdpa_bnhd(q64, k64, v64, is_causal=is_causal, scale=shape.scale, mask=mask)
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
    shape = next(s for s in SHAPES if s.id == "gqa_8_2")
    q, k, v, _ = _inputs(shape, torch.float32)
    skip_unless_runnable(backend, q, k, v, is_causal=True, key_padding_mask=None)
    with torch.no_grad():
        out, lse = attention(q, k, v, is_causal=True, backend=backend, return_lse=True)
    want, want_lse = oracle_attention(q, k, v, is_causal=True)
    assert_close_to_oracle(out, want, name="out")
    assert_close_to_oracle(lse, want_lse, name="lse", dtype=torch.float32)
