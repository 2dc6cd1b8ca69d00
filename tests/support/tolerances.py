"""Per-dtype tolerances and the comparison helper used by every correctness test (DESIGN section 7).

Every quantity is compared with a float64 oracle computed from the *same* (already rounded) inputs,
so the measured error is the kernel's arithmetic error only. For bfloat16/float16 there is a second,
relative check: the implementation's error must be at most ``RATIO`` times the error of a naive
reference computed in the same low dtype, plus the unavoidable error of rounding the exact result
to that dtype (``rounding_floor``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "RATIO",
    "TOLERANCES",
    "Tolerance",
    "assert_close_to_oracle",
    "max_abs_error",
    "rounding_floor",
]


class Tolerance(NamedTuple):
    """Absolute/relative tolerances for forward quantities (out, lse) and for gradients."""

    atol: float
    rtol: float
    grad_atol: float
    grad_rtol: float


#: The one table. Keyed by the dtype of the *inputs* (lse of bf16 inputs is float32 but carries
#: bf16-sized error, so it is judged by the bf16 row).
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(atol=1e-10, rtol=1e-7, grad_atol=1e-10, grad_rtol=1e-7),
    torch.float32: Tolerance(atol=1e-5, rtol=1.3e-6, grad_atol=2e-5, grad_rtol=1e-5),
    torch.bfloat16: Tolerance(atol=2e-2, rtol=1.6e-2, grad_atol=5e-2, grad_rtol=1.6e-2),
    torch.float16: Tolerance(atol=4e-3, rtol=1e-3, grad_atol=1e-2, grad_rtol=2e-3),
}

#: err(impl vs fp64) <= RATIO * err(same-dtype naive reference vs fp64) + rounding_floor.
RATIO = 2.0

LOW_PRECISION = (torch.bfloat16, torch.float16)


def max_abs_error(actual: Tensor, expected: Tensor) -> float:
    """Largest |actual - expected| over the entries where ``expected`` is finite."""
    finite = torch.isfinite(expected)
    if not bool(finite.any()):
        return 0.0
    diff = (actual.detach().to(torch.float64) - expected.detach().to(torch.float64)).abs()
    return float(diff[finite].max())


def rounding_floor(expected: Tensor, dtype: torch.dtype) -> float:
    """Two ulps (in ``dtype``) at the largest finite magnitude in ``expected`` (at least 1).

    A kernel that returns ``dtype`` rounds its result at least once, and a fused backward rounds
    partial sums (per kv head for GQA, per block) a few more times; a fixed absolute floor would
    ignore that the error scales with the values (dk/dv of shared keys reach ~10 here). Even
    PyTorch's own CPU flash kernel exceeds ``2 x naive error`` on MQA dv by about one ulp for
    some seeds (measured over 150 seeds); this floor absorbs that.
    """
    finite = expected[torch.isfinite(expected)].detach()
    largest = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
    ulp = 2.0 ** math.floor(math.log2(largest)) * torch.finfo(dtype).eps
    return 2 * ulp


def assert_close_to_oracle(
    actual: Tensor,
    expected: Tensor,
    reference_same_dtype: Tensor | None = None,
    *,
    name: str,
    dtype: torch.dtype | None = None,
    grad: bool = False,
) -> None:
    """Check ``actual`` against the float64 oracle value ``expected``.

    ``dtype`` selects the table row (default: ``actual.dtype``); ``grad`` selects the gradient
    columns. Non-finite entries of ``expected`` (``-inf`` lse of empty rows) must match exactly.
    ``actual`` must never contain NaN. For bfloat16/float16 ``reference_same_dtype`` is required and
    the ratio check above is applied in addition to the table tolerance.
    """
    dtype = actual.dtype if dtype is None else dtype
    tol = TOLERANCES[dtype]
    atol, rtol = (tol.grad_atol, tol.grad_rtol) if grad else (tol.atol, tol.rtol)
    assert actual.shape == expected.shape, (
        f"{name}: shape {tuple(actual.shape)} != {expected.shape}"
    )
    assert not bool(torch.isnan(actual).any()), f"{name}: contains NaN"
    torch.testing.assert_close(
        actual.detach().to(torch.float64),
        expected.detach().to(torch.float64),
        atol=atol,
        rtol=rtol,
        msg=lambda m: f"{name} ({dtype}, vs float64 oracle): {m}",
    )
    if dtype in LOW_PRECISION:
        assert reference_same_dtype is not None, (
            f"{name}: low precision needs a same-dtype reference"
        )
        err = max_abs_error(actual, expected)
        ref_err = max_abs_error(reference_same_dtype, expected)
        floor = rounding_floor(expected, dtype)
        bound = RATIO * ref_err + floor
        assert err <= bound, (
            f"{name} ({dtype}): max error {err:.3e} vs float64 oracle exceeds {RATIO} x the "
            f"error of a naive {dtype} reference ({ref_err:.3e}) + floor {floor:.1e}"
        )


def assert_rows(
    out: Tensor, lse: Tensor, want: Tensor, want_lse: Tensor, *, atol: float, rtol: float
) -> None:
    """Decoded rows against the full forward's: ``out`` within (atol, rtol), ``-inf`` lse on
    the same rows, the finite lse within torch's default tolerance for its dtype."""
    torch.testing.assert_close(out, want, atol=atol, rtol=rtol)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    torch.testing.assert_close(lse[~torch.isneginf(lse)], want_lse[~torch.isneginf(want_lse)])
