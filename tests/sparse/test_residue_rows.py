"""ResidueRows: the rows of residue classes taken out of a tensor and put back, against plain
strided slices (values and gradients, bit for bit) and float64 gradcheck."""

from __future__ import annotations

import pytest
import torch

from dilated_attention.sparse.residue_rows import ResidueRows


def _sliced(x: torch.Tensor, classes: ResidueRows, dim: int) -> list[torch.Tensor]:
    return [x[(slice(None),) * dim + (slice(s, None, classes.step),)] for s in classes.starts]


@pytest.mark.parametrize(
    ("length", "step", "starts", "dim"),
    [(37, 4, (1, 2, 3, 0), 1), (32, 16, tuple(range(3, 16)), 1), (10, 3, (2,), 2), (9, 1, (0,), 1)],
)
def test_gather_and_scatter_equal_strided_slices(length, step, starts, dim):
    torch.manual_seed(0)
    shape = [2, length, 3, 5] if dim == 1 else [2, 3, length]
    x = torch.randn(shape, dtype=torch.float32, requires_grad=True)
    classes = ResidueRows(starts, step, length)
    parts = classes.gather(x, dim)
    expected = _sliced(x, classes, dim)
    assert len(parts) == len(starts)
    for got, want in zip(parts, expected, strict=True):
        assert torch.equal(got, want)
    weights = [torch.randn_like(p) for p in parts]
    out = classes.scatter([p * w for p, w in zip(parts, weights, strict=True)], dim, -7.0)
    reference = torch.full_like(x, -7.0).detach()
    for s, p, w in zip(starts, expected, weights, strict=True):
        reference[(slice(None),) * dim + (slice(s, None, step),)] = (p * w).detach()
    assert torch.equal(out.detach(), reference)
    held = torch.zeros(length, dtype=torch.bool)
    for s in starts:
        held[s::step] = True
    dout = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, x, dout)
    index = (slice(None),) * dim
    want = torch.zeros_like(x)
    for s, w in zip(starts, weights, strict=True):
        rows = (*index, slice(s, None, step))
        want[rows] = dout[rows] * w
    assert torch.equal(grad, want)
    assert not grad[(*index, ~held)].any()  # rows no class holds get no gradient


def test_gradcheck_float64():
    torch.manual_seed(1)
    x = torch.randn(1, 11, 2, 3, dtype=torch.float64, requires_grad=True)
    classes = ResidueRows((2, 0), 3, 11)

    def fn(x):
        a, b = classes.gather(x, 1)
        return classes.scatter([a.sin(), b * 2], 1, 0.0)

    assert torch.autograd.gradcheck(fn, (x,))
    assert torch.autograd.gradgradcheck(fn, (x,))


def test_one_class_of_every_row_is_the_tensor_itself():
    x = torch.randn(1, 6, 2, 3)
    classes = ResidueRows((0,), 1, 6)
    (part,) = classes.gather(x, 1)
    assert part is x
    assert classes.scatter([x], 1, 0.0) is x


@pytest.mark.parametrize(
    ("length", "step", "starts"),
    [(37, 4, (5, 2, 3, 4)), (32, 16, tuple(range(3, 16))), (20, 3, (2, 4)), (9, 1, (0,))],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scaled_scatter_has_the_bits_and_gradients_of_the_product(length, step, starts, dtype):
    """``scatter(parts, scale=s)`` against ``s * scatter(parts)``: the same bits, the same
    gradients of every part and of ``s``, with non-finite scales in rows no class holds (NaN
    there, as the product gives) and a non-finite upstream gradient in such a row."""
    torch.manual_seed(2)
    classes = ResidueRows(starts, step, length)
    x = torch.randn(2, length, 3, 5, dtype=dtype)
    scale = torch.rand(2, length, 3, 1, dtype=dtype)
    held = torch.zeros(length, dtype=torch.bool)
    for s in starts:
        held[s::step] = True
    free = (~held).nonzero().flatten().tolist()
    if free:
        scale[0, free[0], 1] = float("inf")
        scale[1, free[-1], 0] = float("nan")
    dout = torch.randn(2, length, 3, 5, dtype=dtype)
    if free:
        dout[1, free[0], 2, 3] = float("inf")

    def run(scaled: bool) -> tuple[torch.Tensor, ...]:
        s = scale.clone().requires_grad_()
        parts = [p.clone().requires_grad_() for p in classes.gather(x, 1)]
        out = (classes.scatter(parts, 1, 0.0, scale=s) if scaled
               else s * classes.scatter(parts, 1, 0.0))  # fmt: skip
        return (out.detach(), *torch.autograd.grad(out, [s, *parts], dout))

    for got, want in zip(run(True), run(False), strict=True):
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert (not free) or run(True)[0][1, free[-1], 0].isnan().all()


def test_scaled_scatter_gradchecks_float64():
    torch.manual_seed(3)
    x = torch.randn(1, 11, 2, 3, dtype=torch.float64, requires_grad=True)
    scale = torch.rand(1, 11, 2, 1, dtype=torch.float64, requires_grad=True)
    classes = ResidueRows((2, 4, 6), 3, 11)

    def fn(x, scale):
        a, b, c = classes.gather(x, 1)
        return classes.scatter([a.sin(), b * 2, c], 1, 0.5, scale=scale)

    assert torch.autograd.gradcheck(fn, (x, scale))
    assert torch.autograd.gradgradcheck(fn, (x, scale))


def test_scaled_scatter_rejects_a_broadcast_scale():
    classes = ResidueRows((1, 0), 2, 6)
    parts = list(classes.gather(torch.randn(1, 6, 2, 3), 1))
    with pytest.raises(ValueError, match=r"scale: expected 6 rows along dim 1.*\(1, 1, 2, 1\)"):
        classes.scatter(parts, 1, 0.0, scale=torch.ones(1, 1, 2, 1))
