"""ResidueRows: runs of residue classes taken out of a tensor as strided views and put back,
against plain strided slices of each class (values and gradients, bit for bit) and float64
gradcheck."""

from __future__ import annotations

import pytest
import torch

from dilated_attention.sparse.residue_rows import ResidueRows


def _starts(classes: ResidueRows) -> list[int]:
    return [first + c for first, count in classes.runs for c in range(count)]


def _sliced(x: torch.Tensor, classes: ResidueRows, dim: int) -> list[torch.Tensor]:
    """Each class's rows, one strided slice per class, in the runs' order."""
    return [x[(slice(None),) * dim + (slice(s, None, classes.step),)] for s in _starts(classes)]


def _per_class(parts: tuple[torch.Tensor, ...] | list[torch.Tensor], dim: int) -> list:
    """The runs' views split into their classes (the run's class dimension is ``dim + 1``)."""
    return [c for part in parts for c in part.unbind(dim + 1)]


def _held(classes: ResidueRows) -> torch.Tensor:
    held = torch.zeros(classes.length, dtype=torch.bool)
    for s in _starts(classes):
        held[s :: classes.step] = True
    return held


RUNS = [
    (37, 4, ((1, 3), (0, 1)), 1),  # classes 1-3 one run (9 rows each), class 0 (10 rows)
    (32, 16, ((3, 13),), 1),  # NSA-like: 13 consecutive classes of 2 rows
    (34, 16, ((2, 15), (1, 1)), 1),  # the last class apart, a row short of a whole step
    (10, 3, ((2, 1),), 2),  # lse-like rows along dim 2
    (9, 1, ((0, 1),), 1),  # one class of every row
]


@pytest.mark.parametrize(("length", "step", "runs", "dim"), RUNS)
def test_gather_and_scatter_equal_strided_slices(length, step, runs, dim):
    torch.manual_seed(0)
    shape = [2, length, 3, 5] if dim == 1 else [2, 3, length]
    x = torch.randn(shape, dtype=torch.float32, requires_grad=True)
    classes = ResidueRows(runs, step, length)
    parts = classes.gather(x, dim)
    assert len(parts) == len(runs)
    expected = _sliced(x, classes, dim)
    for got, want in zip(_per_class(parts, dim), expected, strict=True):
        assert torch.equal(got, want)
    weights = [torch.randn_like(p) for p in parts]
    out = classes.scatter([p * w for p, w in zip(parts, weights, strict=True)], dim, -7.0)
    reference = torch.full_like(x, -7.0).detach()
    for s, p, w in zip(_starts(classes), expected, _per_class(weights, dim), strict=True):
        reference[(slice(None),) * dim + (slice(s, None, step),)] = (p * w).detach()
    assert torch.equal(out.detach(), reference)
    dout = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, x, dout)
    index = (slice(None),) * dim
    want = torch.zeros_like(x)
    for s, w in zip(_starts(classes), _per_class(weights, dim), strict=True):
        rows = (*index, slice(s, None, step))
        want[rows] = dout[rows] * w
    assert torch.equal(grad, want)
    assert not grad[(*index, ~_held(classes))].any()  # rows no class holds get no gradient


def test_gradcheck_float64():
    torch.manual_seed(1)
    x = torch.randn(1, 11, 2, 3, dtype=torch.float64, requires_grad=True)
    classes = ResidueRows(((2, 1), (0, 1)), 3, 11)

    def fn(x):
        a, b = classes.gather(x, 1)
        return classes.scatter([a.sin(), b * 2], 1, 0.0)

    assert torch.autograd.gradcheck(fn, (x,))
    assert torch.autograd.gradgradcheck(fn, (x,))


def test_one_class_of_every_row_is_a_view_of_the_tensor():
    x = torch.randn(1, 6, 2, 3)
    classes = ResidueRows(((0, 1),), 1, 6)
    (part,) = classes.gather(x, 1)
    assert part.shape == (1, 6, 1, 2, 3) and part.data_ptr() == x.data_ptr()
    assert torch.equal(classes.scatter([part], 1, 0.0), x)


@pytest.mark.parametrize(
    ("length", "step", "runs"),
    [(37, 4, ((2, 3), (5, 1))), (32, 16, ((3, 13),)), (20, 3, ((2, 1), (4, 1))),
     (9, 1, ((0, 1),))],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("joined", [False, True])
def test_scaled_scatter_has_the_bits_and_gradients_of_the_product(
    length, step, runs, dtype, joined
):
    """``scatter(parts, scale=s)`` against ``s * scatter(parts)`` (``joined``: ``scatter(parts,
    scale=s, total=t)`` against ``t + s * scatter(parts)``): the same bits on the CPU, the same
    gradients of every part, of ``s`` (and of ``t``), with non-finite scales in rows no class
    holds (NaN there, as the product gives) and a non-finite upstream gradient in such a row."""
    torch.manual_seed(2)
    classes = ResidueRows(runs, step, length)
    x = torch.randn(2, length, 3, 5, dtype=dtype)
    scale = torch.rand(2, length, 3, 1, dtype=dtype)
    free = (~_held(classes)).nonzero().flatten().tolist()
    if free:
        scale[0, free[0], 1] = float("inf")
        scale[1, free[-1], 0] = float("nan")
    dout = torch.randn(2, length, 3, 5, dtype=dtype)
    if free:
        dout[1, free[0], 2, 3] = float("inf")

    before = torch.randn(2, length, 3, 5, dtype=dtype)

    def run(scaled: bool) -> tuple[torch.Tensor, ...]:
        s = scale.clone().requires_grad_()
        t = before.clone().requires_grad_() if joined else None
        parts = [p.clone().requires_grad_() for p in classes.gather(x, 1)]
        if scaled:
            out = classes.scatter(parts, 1, 0.0, scale=s, total=t)
        else:
            out = s * classes.scatter(parts, 1, 0.0)
            out = out if t is None else t + out
        leaves = [s, *parts] if t is None else [s, t, *parts]
        return (out.detach(), *torch.autograd.grad(out, leaves, dout))

    for got, want in zip(run(True), run(False), strict=True):
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert (not free) or run(True)[0][1, free[-1], 0].isnan().all()


def test_scaled_scatter_of_a_strided_scale_gradchecks_float64():
    """A scale that is a strided view (one gate of several, as NSA's) and parts of runs, alone
    and joined to a sum (itself a function of the input)."""
    torch.manual_seed(3)
    x = torch.randn(1, 11, 2, 3, dtype=torch.float64, requires_grad=True)
    gates = torch.rand(1, 11, 2, 3, dtype=torch.float64, requires_grad=True)
    classes = ResidueRows(((2, 2), (4, 1)), 3, 11)

    def fn(x, gates):
        a, b = classes.gather(x, 1)
        return classes.scatter([a.sin(), b * 2], 1, 0.5, scale=gates[..., 1, None])

    def joined(x, gates):
        a, b = classes.gather(x, 1)
        return classes.scatter([a.sin(), b * 2], 1, 0.5, scale=gates[..., 1, None],
                               total=x.cos() * gates[..., :1])  # fmt: skip

    for f in (fn, joined):
        assert torch.autograd.gradcheck(f, (x, gates))
        assert torch.autograd.gradgradcheck(f, (x, gates))


def test_scaled_scatter_rejects_a_broadcast_scale_and_a_sum_without_a_scale_or_of_another_shape():
    classes = ResidueRows(((0, 2),), 2, 6)
    parts = list(classes.gather(torch.randn(1, 6, 2, 3), 1))
    with pytest.raises(ValueError, match=r"scale: expected 6 rows along dim 1.*\(1, 1, 2, 1\)"):
        classes.scatter(parts, 1, 0.0, scale=torch.ones(1, 1, 2, 1))
    with pytest.raises(ValueError, match=r"total: a sum is joined only to scaled parts.*None"):
        classes.scatter(parts, 1, 0.0, total=torch.ones(1, 6, 2, 3))
    scale = torch.ones(1, 6, 2, 1)
    for total in (torch.ones(1, 1, 2, 3), torch.ones(1, 5, 2, 3)):
        with pytest.raises(ValueError, match=r"total: expected the result's shape \(1, 6, 2, 3\)"):
            classes.scatter(parts, 1, 0.0, scale=scale, total=total)


@pytest.mark.parametrize("runs", [((0, 3),), ((0, 2),), ((0, 0),)])
def test_a_run_of_classes_with_unequal_rows_or_past_the_step_is_refused(runs):
    """Length 7, step 2: classes 0 and 1 have 4 and 3 rows; 3 classes exceed the step."""
    with pytest.raises(ValueError, match="is not a run of classes with as many rows"):
        ResidueRows(runs, 2, 7)


@pytest.mark.parametrize(
    ("runs", "message"),
    [(((-1, 1),), "from a row >= 0"), (((0, 2), (1, 1)), "put a row in two classes"),
     (((1, 1), (3, 1)), "put a row in two classes")],
)  # fmt: skip
def test_runs_before_the_rows_or_sharing_a_row_are_refused(runs, message):
    with pytest.raises(ValueError, match=message):
        ResidueRows(runs, 2, 10)


def test_gather_and_scatter_check_the_shapes_they_are_given():
    classes = ResidueRows(((0, 2),), 4, 20)
    with pytest.raises(ValueError, match=r"gather: x must have length=20 rows along dim 1"):
        classes.gather(torch.randn(1, 10, 2), 1)
    (part,) = classes.gather(torch.randn(1, 20, 2), 1)
    with pytest.raises(ValueError, match=r"scatter: the part of run \(0, 2\) must have \(5, 2\)"):
        classes.scatter([part[:, :1]], 1, 0.0)


def test_a_view_with_a_storage_offset_gathers_its_own_rows():
    """``x`` a slice of a longer tensor: each run's rows are ``x``'s, not its storage's."""
    big = torch.arange(60.0).view(1, 30, 2)
    x = big[:, 5:15]
    classes = ResidueRows(((0, 2), (2, 1)), 4, 10)
    for got, want in zip(_per_class(classes.gather(x, 1), 1), _sliced(x, classes, 1), strict=True):
        assert torch.equal(got, want)

