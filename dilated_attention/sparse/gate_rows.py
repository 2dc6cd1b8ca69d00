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


def _kernels(*tensors: torch.Tensor | None, gate: torch.Tensor | None = None) -> ModuleType | None:
    """The Triton gate kernels where they take ``tensors`` and ``gate`` (CUDA, 16- or 32-bit
    floats of one dtype, contiguous rows, at most four leading dimensions, one gate per row,
    nothing autograd would record, not while torch.compile traces), else None (torch ops)."""
    given = [x for x in (*tensors, gate) if x is not None]
    first = given[0]
    if not first.is_cuda or torch.compiler.is_compiling() or first.dim() > 5:
        return None
    if torch.is_grad_enabled() and any(x.requires_grad for x in given):
        return None  # recorded by autograd (a double backward's ops): torch's ops
    if gate is not None and (gate.shape[-1] != 1 or gate.dim() != first.dim()):
        return None
    if any(x.dtype != first.dtype or x.dtype not in _KERNEL_DTYPES for x in given):
        return None
    if any(x.stride(-1) != 1 and x.shape[-1] != 1 for x in given):
        return None
    return kernel_module("gates")


def gated_rows(
    out: torch.Tensor,
    gate: torch.Tensor,
    total: torch.Tensor | None = None,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """``total + gate * out`` (rounded once on the GPU, product and sum rounded each by torch's
    ops elsewhere), written into ``into`` (which may be ``out`` or ``total``) or a new tensor
    shaped like ``out`` in the operands' promoted dtype; without gradients (:func:`gated_add`
    records them)."""
    if into is None:
        dtype = torch.promote_types(out.dtype, gate.dtype)
        into = torch.empty_like(out, dtype=dtype if total is None else
                                torch.promote_types(dtype, total.dtype))  # fmt: skip
    result = into
    kernels = _kernels(result, out, total, gate=gate)
    if kernels is not None:
        kernels.gated_rows(result, out, gate, total)
        return result
    if total is None:
        return torch.mul(out, gate, out=result)
    return torch.add(total, out * gate, out=result)


def copy_rows(source: torch.Tensor, target: torch.Tensor) -> None:
    """``target.copy_(source)``, one kernel on the GPU for strided views of contiguous rows."""
    kernels = _kernels(target, source)
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
    """The gradients of ``gate * out`` given ``dout``, written into ``d_out`` (``gate * dout``,
    shaped like ``dout``) and ``d_gate`` (``dout . out`` summed over each row and over the
    leading dimensions where it has size 1), either None where not wanted."""
    if d_gate is not None and d_gate.shape != (*dout.shape[:-1], 1):  # a gate that broadcasts
        d_gate.copy_((dout * out).sum_to_size(d_gate.shape))
        d_gate = None
    kernels = _kernels(dout, out, d_out, d_gate, gate=gate)
    if kernels is not None:
        kernels.gate_grads(d_out, d_gate, dout, out, gate)
        return
    if d_out is not None:
        torch.mul(dout, gate, out=d_out)
    if d_gate is not None:
        d_gate.copy_((dout * out).sum(-1, keepdim=True))


class _GatedAdd(torch.autograd.Function):
    """``total + gate * out`` with its gradients (``total`` may be None)."""

    @staticmethod
    def forward(ctx: Any, total: torch.Tensor | None, out: torch.Tensor,
                gate: torch.Tensor) -> torch.Tensor:  # fmt: skip
        ctx.save_for_backward(out, gate)
        return gated_rows(out, gate, total)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        out, gate = ctx.saved_tensors
        need_total, need_out, need_gate = ctx.needs_input_grad
        d_total = grad if need_total else None
        if torch.is_grad_enabled():  # create_graph=True: differentiable ops
            d_out = grad * gate if need_out else None
            d_gate = (grad * out).sum_to_size(gate.shape) if need_gate else None
            return d_total, d_out, d_gate
        d_out = torch.empty_like(out) if need_out else None
        d_gate = torch.empty_like(gate) if need_gate else None
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
