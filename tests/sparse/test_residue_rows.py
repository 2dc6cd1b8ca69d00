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
