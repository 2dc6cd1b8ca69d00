"""Dense and dilated attention against the float64 oracle: out, lse and dq/dk/dv, for every
operation, backend and dtype (one suite; the cases are in ``tests/support/cases.py``).

Backends come from the registry (``list_backends()``), so a new backend is covered by these tests;
one that cannot run the inputs is skipped with the reasons it gives (``backend_reasons``).
``None`` (automatic selection) is always tested.
"""

from __future__ import annotations

import pytest
import torch
from support.backend_params import (
    DEVICE_BACKENDS,
    DTYPES,
    dtype_id,
    leaves,
    skip_unless_runnable,
    to,
)
from support.cases import DENSE_CASES, DILATED_CASES, Case, case_named, inputs, padding_mask
from support.tolerances import LOW_PRECISION, assert_close_to_oracle
from torch import Tensor

CASES = DENSE_CASES + DILATED_CASES


@pytest.mark.parametrize("case", CASES, ids=[c.param_id for c in CASES])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize(("device", "backend"), DEVICE_BACKENDS)
def test_matches_oracle(
    case: Case, is_causal: bool, dtype: torch.dtype, backend: str | None, device: str
) -> None:
    """Output, lse and dq/dk/dv equal the float64 oracle (table, plus low-precision ratio); rows
    that see no key (uncovered by every branch, or every key masked) are exactly 0 with lse
    -inf."""
    q0, k0, v0, dout = inputs(case, dtype)
    mask = padding_mask(case)
    q, k, v = leaves(q0, k0, v0, device=device)
    dev_mask = to(mask, device)
    skip_unless_runnable(backend, q, k, v, is_causal=is_causal, key_padding_mask=dev_mask)

    out, lse = case.run(q, k, v, is_causal=is_causal, key_padding_mask=dev_mask, backend=backend)
    assert out.dtype == dtype and out.shape == q.shape and out.device == q.device
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert lse.shape == (case.B, case.H, case.N) and lse.device == q.device
    assert not lse.requires_grad
    grads = [g.cpu() for g in torch.autograd.grad(out, (q, k, v), dout.to(device))]
    out, lse = out.detach().cpu(), lse.cpu()

    q64, k64, v64 = leaves(q0, k0, v0, dtype=torch.float64)
    out64, lse64 = case.oracle(q64, k64, v64, is_causal=is_causal, key_padding_mask=mask)
    grads64 = torch.autograd.grad(out64, (q64, k64, v64), dout.to(torch.float64))

    ref_out = ref_lse = None
    ref_grads: tuple[Tensor | None, ...] = (None, None, None)
    if dtype in LOW_PRECISION:
        ql, kl, vl = leaves(q0, k0, v0)
        ref_out, ref_lse = case.oracle(
            ql, kl, vl, is_causal=is_causal, key_padding_mask=mask, compute_dtype=dtype
        )
        ref_grads = torch.autograd.grad(ref_out, (ql, kl, vl), dout)

    assert_close_to_oracle(out, out64, ref_out, name="out", dtype=dtype)
    assert_close_to_oracle(lse, lse64, ref_lse, name="lse", dtype=dtype)
    for name, g, g64, gref in zip(("dq", "dk", "dv"), grads, grads64, ref_grads, strict=True):
        assert g.dtype == dtype
        assert bool(torch.isfinite(g).all()), f"{name} has non-finite entries"
        assert_close_to_oracle(g, g64, gref, name=name, dtype=dtype, grad=True)

    empty = torch.isneginf(lse64).transpose(1, 2)  # (B, N, H)
    assert torch.equal(torch.isneginf(lse).transpose(1, 2), empty)
    assert bool((out[empty] == 0).all()), "rows that see no key must output exactly 0"
    assert not bool(torch.isinf(out).any())


def test_cases_exercise_what_they_claim() -> None:
    """The case tables really contain uncovered rows, fully masked rows and partial segments."""
    for cases, case_id in [
        (DILATED_CASES, "uncovered_rows"),
        (DILATED_CASES, "uncovered_gqa_partial"),
        (DILATED_CASES, "pad_whole_segment"),
        (DENSE_CASES, "pad_prefix"),
        (DENSE_CASES, "pad_all_row"),
    ]:
        c = case_named(cases, case_id)
        q, k, v, _ = inputs(c, torch.float64)
        _, lse = c.oracle(q, k, v, is_causal=True, key_padding_mask=padding_mask(c))
        assert bool(torch.isneginf(lse).any()), case_id
        assert not bool(torch.isneginf(lse).all()), case_id
    for case_id in ("partial_last_37", "partial_last_61", "ragged_w10r3_w16r6"):
        c = case_named(DILATED_CASES, case_id)
        assert any(c.N % w for w in c.segments), case_id
    ragged = case_named(DILATED_CASES, "ragged_w10r3_w16r6")
    assert all(w % r for w, r in zip(ragged.segments, ragged.rates, strict=True))
