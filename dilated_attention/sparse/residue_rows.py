"""The rows of residue classes (every ``step``-th row from a start) taken out of a tensor and
put back, runs of consecutive classes one strided view each, with gradients that cost one
full-size tensor per direction.

Note [Residue classes gathered once]
    The compressed branch of NSA runs attention on the residue classes of the query rows
    (Note [The compressed branch exactly, per residue class] in ``nsa.py``): 16 classes for
    NSA's stride. Taken as strided slices of the query and written into strided slices of the
    output, each class costs a full-size tensor in the backward (a slice's gradient is zeros
    of the whole query with the slice filled; a write's is a clone of the whole output's
    gradient), 16 of each. Here the classes are taken in one autograd step and put back in
    another: the gradient of the taking is one tensor, each class's gradient copied into its
    rows; the gradient of each put-back class is a strided view of the output's gradient, no
    copy. Values and gradients are the slices' own, bit for bit.

Note [Runs of classes as one view]
    Classes that start on consecutive rows ``first, first + 1, ..., first + G - 1`` with as
    many rows ``n`` each (a *run*, ``G <= step``) are one strided view of the tensor: row
    ``m`` of class ``c`` is row ``first + c + m * step``, so along the classes' dimension the
    view is ``(n, G)`` with strides ``(step, 1)`` rows. NSA's classes alike (Note [Residue
    classes as heads] in ``nsa.py``) start on consecutive rows, so each of its calls takes and
    gives back one view: one copy per run and direction instead of one per class (at 64K
    tokens, 16 classes of 4K rows each cost 2-3 ms per training step on an H200 as separate
    strided copies and products).

Shape legend: any tensor; the classes run along one dimension ``dim``, which a run's view
replaces with two, ``(n, G)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .gate_rows import copy_rows, gate_grads, gated_add, gated_rows

__all__ = ["ResidueRows"]


@dataclass(frozen=True)
class ResidueRows:
    """Runs of classes of rows, class ``first + c`` of a run being its rows ``first + c,
    first + c + step, ...`` below ``length`` (Note [Runs of classes as one view]).

    Attributes:
        runs: each run's ``(first, count)``: its first class's first row and its classes, all
            with as many rows, ``count <= step``; no row in two classes.
        step: rows between a class's rows.
        length: the rows along the dimension the classes run.
    """

    runs: tuple[tuple[int, int], ...]
    step: int
    length: int

    def __post_init__(self) -> None:
        for first, count in self.runs:
            if not (first >= 0 and 0 < count <= self.step
                    and self.rows(first) == self.rows(first + count - 1)):  # fmt: skip
                raise ValueError(
                    f"runs: ({first}, {count}) is not a run of classes with as many rows (at "
                    f"most step={self.step} classes from a row >= 0, rows below length="
                    f"{self.length}); split it"
                )
        starts = self.starts()
        if len({start % self.step for start in starts}) != len(starts):
            raise ValueError(
                f"runs: {self.runs} put a row in two classes (two first rows alike modulo "
                f"step={self.step}); each residue may start one class"
            )

    def starts(self) -> list[int]:
        """Every class's first row, run by run."""
        return [first + c for first, count in self.runs for c in range(count)]

    def rows(self, start: int) -> int:
        """How many rows the class starting at ``start`` has."""
        return len(range(start, self.length, self.step))

    def every_row(self) -> bool:
        """Whether the classes are one class of every row, in order."""
        return self.runs == ((0, 1),) and self.step == 1

    def view(self, x: torch.Tensor, dim: int, run: tuple[int, int]) -> torch.Tensor:
        """The rows of ``run`` in ``x`` as one strided view, ``dim`` replaced by ``(n,
        count)``; ``x`` may broadcast (size 1) along any other dimension."""
        first, count = run
        stride = x.stride(dim)
        return x.as_strided(
            (*x.shape[:dim], self.rows(first), count, *x.shape[dim + 1 :]),
            (*x.stride()[:dim], self.step * stride, stride, *x.stride()[dim + 1 :]),
            x.storage_offset() + first * stride,
        )

    def gather(self, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, ...]:
        """Each run's rows of ``x`` (:meth:`view`), differentiable in ``x``."""
        if x.shape[dim] != self.length:
            raise ValueError(
                f"gather: x must have length={self.length} rows along dim {dim}, got shape "
                f"{tuple(x.shape)}; pass the tensor the classes were made for"
            )
        if self.every_row():
            return (x.unsqueeze(dim + 1),)
        return _Gather.apply(x, dim, self)  # type: ignore[no-any-return]

    def scatter(
        self,
        parts: list[torch.Tensor],
        dim: int,
        fill: float,
        scale: torch.Tensor | None = None,
        total: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``parts`` (one per run, as :meth:`gather` gives them) put back along ``dim`` into
        ``length`` rows, ``fill`` in the rows no class holds; differentiable in every part.
        With ``scale`` (as many dimensions as the result, each of its size or 1): ``scale *
        scatter(parts, dim, fill)`` (NaN where ``scale`` is not finite in a filled row), and
        with ``total`` too (the result's shape) ``total + scale * scatter(parts, dim, fill)``,
        differentiable in ``scale`` and ``total`` too, without making or keeping the unscaled
        tensor or the product (Note [Scaled as they are put back])."""
        if scale is not None and scale.shape[dim] != self.length:
            raise ValueError(
                f"scale: expected {self.length} rows along dim {dim} (one per row put back), "
                f"got shape {tuple(scale.shape)}; pass the rows' own scales, not a broadcast"
            )
        if total is not None and scale is None:
            raise ValueError(
                "total: a sum is joined only to scaled parts (total + scale * parts), got "
                "scale=None; pass scale too, or add total to the result yourself"
            )
        for run, part in zip(self.runs, parts, strict=True):
            if tuple(part.shape[dim : dim + 2]) != (self.rows(run[0]), run[1]):
                raise ValueError(
                    f"scatter: the part of run {run} must have ({self.rows(run[0])}, {run[1]}) "
                    f"along dims {dim} and {dim + 1}, got shape {tuple(part.shape)}; pass the "
                    f"parts as gather gives them"
                )
        shape = tuple(_whole_shape(parts[0], dim, self))
        if total is not None and tuple(total.shape) != shape:
            raise ValueError(
                f"total: expected the result's shape {shape}, got shape {tuple(total.shape)}; "
                f"pass the sum the rows are added to, not a broadcast or a slice of it"
            )
        if self.every_row():
            whole = parts[0].squeeze(dim + 1)
            return whole if scale is None else gated_add(total, whole, scale)
        if scale is None:
            return _Scatter.apply(dim, self, fill, *parts)  # type: ignore[no-any-return]
        return _ScaledScatter.apply(  # type: ignore[no-any-return]
            dim, self, fill, scale, total, *parts
        )

    def filled(self, dim: int) -> tuple[slice, ...]:
        """The index along ``dim`` of rows that hold every row no class holds: those below the
        last class's first row, or all where a residue has no class."""
        starts = self.starts()
        end = self.length
        if len({start % self.step for start in starts}) == self.step:
            end = min(max(starts), self.length)
        return (slice(None),) * dim + (slice(0, end),)

    def fill_unheld(self, out: torch.Tensor, dim: int, fill: float) -> None:
        """``fill`` written into the :meth:`filled` rows of ``out`` (every row no class holds,
        and held rows that are written after)."""
        out[self.filled(dim)] = fill


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, classes: ResidueRows) -> Any:
        ctx.shape, ctx.dim, ctx.classes = x.shape, dim, classes
        return tuple(classes.view(x, dim, run) for run in classes.runs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        classes, dim = ctx.classes, ctx.dim
        grad = grads[0].new_empty(ctx.shape)
        classes.fill_unheld(grad, dim, 0.0)
        for run, part in zip(classes.runs, grads, strict=True):
            copy_rows(part, classes.view(grad, dim, run))
        return grad, None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, dim: int, classes: ResidueRows, fill: float,
                *parts: torch.Tensor) -> torch.Tensor:  # fmt: skip
        ctx.dim, ctx.classes = dim, classes
        out = parts[0].new_empty(_whole_shape(parts[0], dim, classes))
        classes.fill_unheld(out, dim, fill)
        for run, part in zip(classes.runs, parts, strict=True):
            copy_rows(part, classes.view(out, dim, run))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        classes = ctx.classes
        views = tuple(classes.view(grad, ctx.dim, run) for run in classes.runs)
        return (None, None, None, *views)


class _ScaledScatter(torch.autograd.Function):
    """Note [Scaled as they are put back]
    ``total + scale * scatter(parts)`` row by row (``total`` optional): the rows
    :meth:`ResidueRows.filled` names get ``total + scale * fill`` (every row no class holds
    lies there), then each run's rows ``total[rows] + part * scale[rows]``, written in place
    (one pass per run each way on the GPU: Note [Gated rows in one pass] in
    ``backends/triton_kernels/gates.py``). Without ``total`` the products are the ones the
    whole product makes, so the bits are its bits; with it a held row's sum is rounded once on
    the GPU, as every gated term's join (Note [Branches joined as they come] in
    ``branches.py``), and a filled row's is torch's (``total + scale * fill``). The
    gradients are the product's and the sum's, per row: ``grad`` for ``total``, ``grad *
    scale`` for a part (its bits), the sum of ``grad * part`` (``grad * fill`` in a filled row)
    over the dimensions ``scale`` broadcasts, for ``scale`` (on the GPU a float32 sum of
    float32 products per row, equal to torch's to rounding). Kept for the backward: ``scale``
    and the parts, which are views of what their makers keep (NSA's kernel outputs), not the
    put-back tensor, nor the product the size of the result that ``total + product`` would
    make on the way."""

    @staticmethod
    def forward(ctx: Any, dim: int, classes: ResidueRows, fill: float, scale: torch.Tensor,
                total: torch.Tensor | None, *parts: torch.Tensor) -> torch.Tensor:  # fmt: skip
        dtype = torch.result_type(scale, parts[0])
        dtype = dtype if total is None else torch.promote_types(dtype, total.dtype)
        out = torch.empty(_whole_shape(parts[0], dim, classes), dtype=dtype,
                          device=parts[0].device)  # fmt: skip
        below = classes.filled(dim)
        filled = scale[_rows_of(scale, below)].to(dtype) * fill
        if total is None:
            out[below] = filled
        else:
            torch.add(total[below], filled, out=out[below])
        for run, part in zip(classes.runs, parts, strict=True):
            gated_rows(part, classes.view(scale, dim, run),
                       None if total is None else classes.view(total, dim, run),
                       into=classes.view(out, dim, run))  # fmt: skip
        ctx.dim, ctx.classes, ctx.fill = dim, classes, fill
        ctx.save_for_backward(scale, *parts)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        scale, *parts = ctx.saved_tensors
        classes, dim = ctx.classes, ctx.dim
        need_scale, need_parts = ctx.needs_input_grad[3], any(ctx.needs_input_grad[5:])
        d_total = grad if ctx.needs_input_grad[4] else None
        dscale = torch.empty_like(scale) if need_scale else None
        if dscale is not None:
            below = classes.filled(dim)
            at = _rows_of(scale, below)
            dscale[at] = (grad[below] * ctx.fill).sum_to_size(dscale[at].shape)
        dparts = []
        for run, part in zip(classes.runs, parts, strict=True):
            at = None if dscale is None else classes.view(dscale, dim, run)
            dpart = torch.empty_like(part) if need_parts else None  # laid out as the part
            gate_grads(classes.view(grad, dim, run), part, classes.view(scale, dim, run),
                       dpart, at)  # fmt: skip
            dparts.append(dpart)
        return (None, None, None, dscale, d_total, *dparts)


def _whole_shape(part: torch.Tensor, dim: int, classes: ResidueRows) -> list[int]:
    """The shape of the tensor a run's ``part`` (``dim`` split in two) is put back into."""
    return [*part.shape[:dim], classes.length, *part.shape[dim + 2 :]]


def _rows_of(scale: torch.Tensor, rows: tuple[slice, ...]) -> tuple[slice, ...]:
    """``rows`` of the result as an index of ``scale``, which broadcasts along dimensions of
    size 1 (all of them there)."""
    return tuple(slice(None) if scale.shape[d] == 1 else r for d, r in enumerate(rows))
