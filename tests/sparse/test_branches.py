"""Branches joined as they come: the gated sum's values and gradients against the plain formula
(float64 gradcheck and gradgradcheck), the bits of the inference sum, and the order in which
autograd runs the branches' backwards (one branch gradient alive at a time)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dilated_attention.sparse.branches import gated_sum, gated_sum_of, merge_branches

SHAPE = (2, 5, 3, 4)  # (B, N, H, D)


def _outs(dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    return [torch.randn(SHAPE, dtype=dtype, requires_grad=True) for _ in range(3)]


def test_gated_sum_matches_the_formula_and_gradchecks() -> None:
    torch.manual_seed(0)
    outs = _outs()
    gates = torch.rand(*SHAPE[:3], 3, dtype=torch.float64, requires_grad=True)

    def fn(g: torch.Tensor, *xs: torch.Tensor) -> torch.Tensor:
        return gated_sum([lambda x=x: x * 1.0 for x in xs], g)

    want = sum(gates[..., c, None] * outs[c] for c in range(3))
    torch.testing.assert_close(fn(gates, *outs), want, rtol=0, atol=1e-14)
    assert torch.autograd.gradcheck(fn, (gates, *outs))
    assert torch.autograd.gradgradcheck(fn, (gates, *outs))


@pytest.mark.parametrize("order", [None, (1, 2, 0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_inference_sum_has_the_bits_of_the_trained_one(dtype: torch.dtype, order: Any) -> None:
    torch.manual_seed(1)
    outs = [x.detach() for x in _outs(dtype)]
    gates = torch.rand(*SHAPE[:3], 3, dtype=dtype)
    trained = gated_sum([lambda x=x: x.clone().requires_grad_() for x in outs], gates, order)
    streamed = gated_sum_of([lambda x=x: x.clone() for x in outs], gates, order)
    assert torch.equal(trained.detach(), streamed)
    want = sum(gates[..., c, None].double() * outs[c].double() for c in range(3))
    torch.testing.assert_close(streamed.double(), want, atol=1e-2, rtol=1e-2)


def _branch(x: torch.Tensor, c: int, events: list[str]) -> torch.Tensor:
    """A branch output with a node of its own (as a branch's attention call has), logging when
    its gradient arrives and when its backward has run."""
    out = x.exp()
    out.register_hook(lambda g: events.append(f"gradient {c}"))
    out.grad_fn.register_hook(lambda *_: events.append(f"backward {c}"))
    return out


def test_each_branch_backward_runs_before_the_next_branch_gradient() -> None:
    """Each branch's backward runs right after its gradient is made, so one branch gradient
    (the size of the output) is alive at a time, not three (Note [Branches joined as they
    come])."""
    torch.manual_seed(2)
    outs = _outs()
    gates = torch.rand(*SHAPE[:3], 3, dtype=torch.float64, requires_grad=True)
    events: list[str] = []
    total = gated_sum([lambda c=c: _branch(outs[c], c, events) for c in range(3)], gates)
    total.backward(torch.randn_like(total))
    assert events == [f"{kind} {c}" for c in (2, 1, 0) for kind in ("gradient", "backward")]

    events.clear()  # in a given order: the branch that joins last runs its backward first
    total = gated_sum([lambda c=c: _branch(outs[c], c, events) for c in range(3)], gates,
                      (1, 2, 0))  # fmt: skip
    total.backward(torch.randn_like(total))
    assert events == [f"{kind} {c}" for c in (0, 2, 1) for kind in ("gradient", "backward")]

    events.clear()
    calls = [lambda c=c: (_branch(outs[c], c, events), outs[c].sum(-1).transpose(1, 2))
             for c in range(3)]  # fmt: skip
    merged = merge_branches(calls)
    merged.backward(torch.randn_like(merged))
    assert events == [f"{kind} {c}" for c in (2, 1, 0) for kind in ("gradient", "backward")]
