"""Branches joined as they come: the gated sum's values and gradients against the plain formula
(float64 gradcheck and gradgradcheck), the bits of the inference sum, and the order in which
autograd runs the branches' backwards (one branch gradient alive at a time)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.branch_order import backward_order, most_pending, watch

from dilated_attention.sparse.branches import gated_sum, gated_sum_of, merge_branches
from dilated_attention.sparse.gate_rows import gated_add

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


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("order", [None, (1, 2, 0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_inference_sum_has_the_bits_of_the_trained_one(
    dtype: torch.dtype, order: Any, device: str
) -> None:
    """Both sums join each term through the same op (one kernel on the GPU: Note [Gated rows in
    one pass]), so their bits agree; torch's ops (two roundings per term) agree to a unit in
    the last place."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(1)
    outs = [x.detach().to(device) for x in _outs(dtype)]
    gates = torch.rand(*SHAPE[:3], 3, dtype=dtype).to(device)
    trained = gated_sum([lambda x=x: x.clone().requires_grad_() for x in outs], gates, order)
    streamed = gated_sum_of([lambda x=x: x.clone() for x in outs], gates, order)
    assert torch.equal(trained.detach(), streamed)
    first, *rest = order or (0, 1, 2)
    by_ops = gates[..., first, None] * outs[first]
    for c in rest:
        by_ops = by_ops + gates[..., c, None] * outs[c]
    terms = sum(gates[..., c, None].double().abs() * outs[c].double().abs() for c in range(3))
    ulps = 4 * torch.finfo(dtype).eps * terms + torch.finfo(dtype).tiny  # two roundings a term
    assert ((streamed.double() - by_ops.double()).abs() <= ulps).all()
    want = sum(gates[..., c, None].double() * outs[c].double() for c in range(3)).cpu()
    torch.testing.assert_close(streamed.cpu().double(), want, atol=1e-2, rtol=1e-2)


def test_each_branch_backward_runs_before_the_next_branch_gradient() -> None:
    """One branch gradient (the size of the output) is alive at a time, not three (two in the
    log-sum-exp merge, whose first step joins two branches): each branch's backward starts
    before the next branch's gradient is made, and the branch that joins last runs its
    backward first (Note [Branches joined as they come])."""
    torch.manual_seed(2)
    outs = _outs()
    gates = torch.rand(*SHAPE[:3], 3, dtype=torch.float64, requires_grad=True)
    made: dict[int, torch.Tensor] = {}

    def branch(c: int) -> torch.Tensor:  # a node of its own, made when called, as a branch's
        made[c] = outs[c].exp()
        return made[c]

    for order, backwards in ((None, [2, 1, 0]), ((1, 2, 0), [0, 2, 1])):
        total = gated_sum([lambda c=c: branch(c) for c in range(3)], gates, order)
        events: list[str] = []
        watch(total, {c: made[c].grad_fn for c in range(3)}, events)
        total.backward(torch.randn_like(total))
        assert most_pending(events) == 1, events
        assert backward_order(events) == [str(c) for c in backwards]

    calls = [lambda c=c: (branch(c), outs[c].sum(-1).transpose(1, 2)) for c in range(3)]
    merged = merge_branches(calls)
    events = []
    watch(merged, {c: made[c].grad_fn for c in range(3)}, events)
    merged.backward(torch.randn_like(merged))
    # The first merge step joins branches 0 and 1, so its backward makes both their gradients.
    assert most_pending(events) == 2, events
    assert backward_order(events) == ["2", "1", "0"]


def test_a_bad_order_raises() -> None:
    outs = [x.detach() for x in _outs()]
    gates = torch.rand(*SHAPE[:3], 3, dtype=torch.float64)
    for order in ((0, 1), (0, 1, 1), (0, 1, 3)):
        with pytest.raises(ValueError, match="order"):
            gated_sum([lambda x=x: x.clone() for x in outs], gates, order)
        with pytest.raises(ValueError, match="order"):
            gated_sum_of([lambda x=x: x.clone() for x in outs], gates, order)


@pytest.mark.parametrize("order", [(1, 2, 0), (0, 2, 1)])
def test_a_self_gated_call_gets_its_gate_and_the_sum_and_gives_the_joined_sum(
    order: tuple[int, int, int],
) -> None:
    """``self_gated``: that call is given its gate (B, N, H, 1) and the sum so far (None when it
    joins first) and its return is the sum as it is; the sum and its gradients are those of the
    plain gated sum."""
    torch.manual_seed(3)
    outs = _outs()
    gates = torch.rand(*SHAPE[:3], 3, dtype=torch.float64, requires_grad=True)
    given: list[tuple[tuple[int, ...], bool]] = []

    def own(gate: torch.Tensor, total: torch.Tensor | None) -> torch.Tensor:
        given.append((tuple(gate.shape), total is None))
        return gated_add(total, outs[1].exp(), gate)

    calls = [lambda: outs[0].exp(), own, lambda: outs[2].exp()]
    total = gated_sum(calls, gates, order, self_gated=(1,))
    want = gated_sum([lambda c=c: outs[c].exp() for c in range(3)], gates, order)
    assert given == [((*SHAPE[:3], 1), order[0] == 1)]
    assert torch.equal(total, want)
    dout = torch.randn_like(total)
    for a, b in zip(torch.autograd.grad(total, [gates, *outs], dout),
                    torch.autograd.grad(want, [gates, *outs], dout), strict=True):  # fmt: skip
        assert torch.equal(a, b)
