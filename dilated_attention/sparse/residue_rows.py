"""The rows of residue classes (every ``step``-th row from a start) taken out of a tensor and
put back, each class one tensor, with gradients that cost one full-size tensor per direction.

Note [Residue classes gathered once]
    The compressed branch of NSA runs one attention call per residue class of the query rows
    (Note [The compressed branch exactly, per residue class] in ``nsa.py``): 16 classes for
    NSA's stride. Taken as strided slices of the query and written into strided slices of the
    output, each class costs a full-size tensor in the backward (a slice's gradient is zeros
    of the whole query with the slice filled; a write's is a clone of the whole output's
    gradient), 16 of each. Here the classes are taken in one autograd step and put back in
    another: the gradient of the taking is one tensor, each class's gradient copied into its
    rows; the gradient of each put-back class is a strided view of the output's gradient, no
    copy. Values and gradients are the slices' own, bit for bit.

Shape legend: any tensor; the classes run along one dimension ``dim``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ResidueRows"]


@dataclass(frozen=True)
class ResidueRows:
    """Classes of rows ``start, start + step, ...`` below ``length``, one per start.

    Attributes:
        starts: each class's first row, in the order its tensors go.
        step: rows between a class's rows.
        length: the rows along the dimension the classes run.
    """

    starts: tuple[int, ...]
    step: int
    length: int

    def every_row(self) -> bool:
        """Whether the classes are one class of every row, in order."""
        return self.starts == (0,) and self.step == 1

    def gather(self, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, ...]:
        """Each class's rows of ``x`` along ``dim``, a strided view each (``x`` itself for one
        class of every row); differentiable in ``x``."""
        if self.every_row():
            return (x,)
        return _Gather.apply(x, dim, self)  # type: ignore[no-any-return]

    def scatter(
        self, parts: list[torch.Tensor], dim: int, fill: float, scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``parts`` (one per class, as :meth:`gather` gives them) put back along ``dim``
        into ``length`` rows, ``fill`` in the rows no class holds; differentiable in every
        part. With ``scale`` (as many dimensions as the result, each of its size or 1):
        ``scale * scatter(parts, dim, fill)`` with its bits (NaN where ``scale`` is not finite
        in a filled row), differentiable in ``scale`` too, without making or keeping the
        unscaled tensor (Note [Scaled as they are put back])."""
        if scale is not None and scale.shape[dim] != self.length:
            raise ValueError(
                f"scale: expected {self.length} rows along dim {dim} (one per row put back), "
                f"got shape {tuple(scale.shape)}; pass the rows' own scales, not a broadcast"
            )
        if self.every_row():
            return parts[0] if scale is None else scale * parts[0]
        if scale is None:
            return _Scatter.apply(dim, self, fill, *parts)  # type: ignore[no-any-return]
        return _ScaledScatter.apply(dim, self, fill, scale, *parts)  # type: ignore[no-any-return]

    def filled(self, dim: int) -> tuple[slice, ...]:
        """The index along ``dim`` of rows that hold every row no class holds: those below the
        last class's first row, or all where a residue has no class."""
        end = self.length
        if len({start % self.step for start in self.starts}) == self.step:
            end = min(max(self.starts), self.length)
        return (slice(None),) * dim + (slice(0, end),)

    def rows(self, dim: int, start: int) -> tuple[slice, ...]:
        """The index of class ``start``'s rows along ``dim``."""
        return (slice(None),) * dim + (slice(start, self.length, self.step),)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, classes: ResidueRows) -> Any:
        ctx.shape, ctx.dim, ctx.classes = x.shape, dim, classes
        return tuple(x[classes.rows(dim, start)] for start in classes.starts)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        classes = ctx.classes
        grad = grads[0].new_zeros(ctx.shape)
        for start, part in zip(classes.starts, grads, strict=True):
            grad[classes.rows(ctx.dim, start)] = part
        return grad, None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, dim: int, classes: ResidueRows, fill: float,
                *parts: torch.Tensor) -> torch.Tensor:  # fmt: skip
        ctx.dim, ctx.classes = dim, classes
        shape = list(parts[0].shape)
        shape[dim] = classes.length
        out = parts[0].new_full(shape, fill)
        for start, part in zip(classes.starts, parts, strict=True):
            out[classes.rows(dim, start)] = part
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        classes = ctx.classes
        views = tuple(grad[classes.rows(ctx.dim, start)] for start in classes.starts)
        return (None, None, None, *views)


class _ScaledScatter(torch.autograd.Function):
    """Note [Scaled as they are put back]
    ``scale * scatter(parts)`` row by row: the rows :meth:`ResidueRows.filled` names
    get ``scale * fill`` (every row no class holds lies there), then each class's rows
    ``part * scale[rows]``, written in place. The products are the ones the whole product makes,
    so the bits are its bits; the gradients are its gradients, per row: ``grad * scale`` for
    a part, the sum of ``grad * part`` (``grad * fill`` in a filled row) over the dimensions
    ``scale`` broadcasts, for ``scale``. Kept for the backward: ``scale`` and the parts, which
    are views of what their makers keep (NSA's kernel outputs), not the put-back tensor."""

    @staticmethod
    def forward(ctx: Any, dim: int, classes: ResidueRows, fill: float, scale: torch.Tensor,
                *parts: torch.Tensor) -> torch.Tensor:  # fmt: skip
        shape = list(parts[0].shape)
        shape[dim] = classes.length
        dtype = torch.result_type(scale, parts[0])
        out = torch.empty(shape, dtype=dtype, device=parts[0].device)
        below = classes.filled(dim)
        out[below] = scale[_rows_of(scale, below)] * fill
        for start, part in zip(classes.starts, parts, strict=True):
            rows = classes.rows(dim, start)
            torch.mul(part, scale[_rows_of(scale, rows)], out=out[rows])
        ctx.dim, ctx.classes, ctx.fill = dim, classes, fill
        ctx.save_for_backward(scale, *parts)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        scale, *parts = ctx.saved_tensors
        classes, dim = ctx.classes, ctx.dim
        need_scale, need_parts = ctx.needs_input_grad[3], any(ctx.needs_input_grad[4:])
        dscale = torch.empty_like(scale) if need_scale else None
        if dscale is not None:
            below = classes.filled(dim)
            at = _rows_of(scale, below)
            dscale[at] = (grad[below] * ctx.fill).sum_to_size(dscale[at].shape)
        dparts = []
        for start, part in zip(classes.starts, parts, strict=True):
            rows = classes.rows(dim, start)
            at = _rows_of(scale, rows)
            if dscale is not None:
                dscale[at] = (grad[rows] * part).sum_to_size(dscale[at].shape)
            dparts.append(grad[rows] * scale[at] if need_parts else None)
        return (None, None, None, dscale, *dparts)


def _rows_of(scale: torch.Tensor, rows: tuple[slice, ...]) -> tuple[slice, ...]:
    """``rows`` of the result as an index of ``scale``, which broadcasts along dimensions of
    size 1 (all of them there)."""
    return tuple(slice(None) if scale.shape[d] == 1 else r for d, r in enumerate(rows))
