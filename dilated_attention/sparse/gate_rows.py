"""Gated rows: ``total + gate * out`` row by row with its gradients, and copies of rows between
strided views, one kernel each on the GPU (Note [Gated rows in one pass] in
``backends/triton_kernels/gates.py``: the sum rounded once there), torch ops elsewhere.

Shape legend: every tensor ``(*lead, D)`` with at most four leading dimensions, a gate
``(*lead, 1)``; any of them strided with contiguous rows, broadcasting along leading dimensions
of size 1.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from ..backends.triton import kernel_module

__all__ = ["copy_rows", "gate_grads", "gated_add", "gated_rows"]

#: The dtypes the kernels take (their products and sums in float32, as torch's opmath).
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _kernels(
    full: torch.Tensor,
    *others: torch.Tensor | None,
    gate: torch.Tensor | None = None,
    written: tuple[torch.Tensor | None, ...] = (),
) -> ModuleType | None:
    """The Triton gate kernels where they take the operands, else None (torch's ops): CUDA, one
    device, 16- or 32-bit floats of one dtype, contiguous rows, at most four leading dimensions,
    one gate per row, nothing autograd would record, not while torch.compile traces. ``full``
    (*lead, D) gives the rows; every operand has its dimensions, each of ``full``'s size or 1;
    each of ``written`` (among them) has all of ``full``'s leading sizes and its own memory
    for each row (no zero stride: no racing writes)."""
    given = [x for x in (full, *others, gate) if x is not None]
    if not full.is_cuda or torch.compiler.is_compiling() or full.dim() > 5:
        return None
    if torch.is_grad_enabled() and any(x.requires_grad for x in given):
        return None  # recorded by autograd (a double backward's ops): torch's ops
    if gate is not None and gate.shape[-1] != 1:
        return None
    if any(x.device != full.device or x.dtype != full.dtype for x in given):
        return None
    if full.dtype not in _KERNEL_DTYPES or any(x.stride(-1) != 1 and x.shape[-1] != 1
                                               for x in given):  # fmt: skip
        return None
    lead = full.shape[:-1]
    for x in given:
        if x.dim() != full.dim() or any(
            n not in (1, m) for n, m in zip(x.shape[:-1], lead, strict=True)
        ):  # fmt: skip
            return None
    for x in written:
        if x is not None and (x.shape[:-1] != lead or any(
            stride == 0 for n, stride in zip(lead, x.stride()[:-1], strict=True) if n > 1
        )):  # fmt: skip
            return None
    return kernel_module("gates")


def gated_rows(
    out: torch.Tensor,
    gate: torch.Tensor,
    total: torch.Tensor | None = None,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """``total + gate * out`` (rounded once on the GPU, product and sum rounded each by torch's
    ops elsewhere), without gradients (:func:`gated_add` records them).

    Args:
        out: (*lead, D); gate: (*lead, 1); total: (*lead, D) or None. Each may broadcast
            along leading dimensions of size 1.
        into: where the result goes, (*lead, D), which may be ``out`` or ``total``; None: a
            new tensor of the broadcast shape in the operands' promoted dtype.

    Returns:
        ``into``, or the new tensor.
    """
    if into is None:
        shape = torch.broadcast_shapes(out.shape, gate.shape,
                                       *(() if total is None else (total.shape,)))  # fmt: skip
        dtype = torch.promote_types(out.dtype, gate.dtype)
        dtype = dtype if total is None else torch.promote_types(dtype, total.dtype)
        into = out.new_empty(shape, dtype=dtype)
    kernels = _kernels(into, out, total, gate=gate, written=(into,))
    if kernels is not None:
        kernels.gated_rows_into(into, out, gate, total)
        return into
    if total is None:
        return torch.mul(out, gate, out=into)
    return torch.add(total, out * gate, out=into)


def copy_rows(source: torch.Tensor, target: torch.Tensor) -> None:
    """``target.copy_(source)``, one kernel on the GPU for strided views of contiguous rows.

    Args:
        source: (*lead, D), or broadcasting to ``target`` along dimensions of size 1.
        target: (*lead, D), written.
    """
    kernels = _kernels(target, source, written=(target,))
    if kernels is None:
        target.copy_(source)
    else:
        kernels.copy_rows(source, target)


def gate_grads(
    dout: torch.Tensor,
    out: torch.Tensor,
    gate: torch.Tensor,
    d_out: torch.Tensor | None,
    d_gate: torch.Tensor | None,
) -> None:
    """The gradients of ``gate * out`` given ``dout``, written into ``d_out`` and ``d_gate``,
    either None where not wanted; differentiable where autograd records (a backward under
    ``create_graph=True``: torch's ops, written by copies).

    Args:
        dout: (*lead, D), the upstream gradient; out: (*lead, D); gate: (*lead, 1), both
            broadcasting to ``dout`` along dimensions of size 1.
        d_out: ``gate * dout`` summed to ``out``'s shape, written; d_gate: ``dout . out``
            over each row summed to ``gate``'s shape (over the leading dimensions where it
            has size 1), written.
    """
    if d_gate is not None and d_gate.shape != (*dout.shape[:-1], 1):  # a gate that broadcasts
        d_gate.copy_((dout * out).sum_to_size(d_gate.shape))
        d_gate = None
    if d_out is not None and d_out.shape != dout.shape:  # an output that broadcasts
        d_out.copy_((dout * gate).sum_to_size(d_out.shape))
        d_out = None
    if d_out is None and d_gate is None:
        return
    kernels = _kernels(dout, out, d_out, d_gate, gate=gate, written=(d_out, d_gate))
    if kernels is not None:
        kernels.gate_grads_into(d_out, d_gate, dout, out, gate)
        return
    if d_out is not None:  # a copy autograd records under create_graph (out= is not one)
        if torch.is_grad_enabled():
            d_out.copy_(dout * gate)
        else:
            torch.mul(dout, gate, out=d_out)
    if d_gate is not None:
        d_gate.copy_((dout * out).sum(-1, keepdim=True))


class _GatedAdd(torch.autograd.Function):
    """``total + gate * out`` with its gradients (``total`` may be None). Keeps ``out`` only
    where the gate's gradient is asked for and ``gate`` where the output's is, as torch's
    product does."""

    @staticmethod
    def forward(ctx: Any, total: torch.Tensor | None, out: torch.Tensor,
                gate: torch.Tensor) -> torch.Tensor:  # fmt: skip
        _, need_out, need_gate = ctx.needs_input_grad
        ctx.save_for_backward(out if need_gate else None, gate if need_out else None)
        ctx.shapes = (out.shape, gate.shape)
        return gated_rows(out, gate, total)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        out, gate = ctx.saved_tensors
        need_total, need_out, need_gate = ctx.needs_input_grad
        d_total = grad if need_total else None
        d_out = grad.new_empty(ctx.shapes[0]) if need_out else None
        d_gate = grad.new_empty(ctx.shapes[1]) if need_gate else None
        gate_grads(grad, out, gate, d_out, d_gate)
        return d_total, d_out, d_gate


def gated_add(total: torch.Tensor | None, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``total + gate * out`` (``gate * out`` where ``total`` is None), differentiable in all
    three, one kernel each way on the GPU (Note [Gated rows in one pass]); the bits of
    :func:`gated_rows`.

    Args:
        total: (*lead, D) or None; out: (*lead, D); gate: (*lead, 1).
    """
    return _GatedAdd.apply(total, out, gate)  # type: ignore[no-any-return]
