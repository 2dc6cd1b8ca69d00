"""Gated rows in one pass each (CUDA): ``total + gate * out`` row by row, its gradients, and a
copy of rows between strided views. Imported on first use, because it needs ``triton``.

Note [Gated rows in one pass]
    NSA combines its branches by gates, one per row (``o = sum_c g_c o_c``, Note [Gated
    branches] in ``sparse/branches.py``), and puts its compressed branch's residue classes back
    into rows through strided views (Note [Runs of classes as one view] in
    ``sparse/residue_rows.py``). Done with torch ops, a gate that broadcasts over the head dim
    or a strided view keeps torch's elementwise kernels off their vectorized path: on an H200 at
    64K tokens (H = 16, D = 128, bf16) ``gate * out`` took 330 us where a copy of the same bytes
    took 130; ``total + gate * out`` 513 us in two kernels; the two gradients ``gate * dout``
    and ``sum(dout * out)`` 645 us in three (one a product the size of the output, kept until
    its sum); a strided copy of 15 residue classes 337 us. Here each is one kernel over rows of
    ``D`` contiguous elements, a block of rows per program, each operand addressed through its
    own strides of up to four leading dimensions (a (B, N, H) tensor, or the (B, n, G, H) view
    of a run of classes), so no operand is copied to make it contiguous first.

    Rounding: ``gate * out`` alone, and ``gate * dout``, are rounded once, as torch's product
    rounds, so they have its bits. ``total + gate * out`` is formed in float32 and rounded
    once (the compiler may fuse the product and the sum), where torch's two ops round twice:
    the two can differ by a unit in the last place of the output's dtype. The gated sum with
    gradients and the one without (Note [Gated branches]) run the same ops on one device, so
    they keep equal bits. The gate's gradient is a float32 sum of float32 products, rounded
    once (torch rounds each product to 16 bits first).

Shapes: every operand ``(*lead, D)`` with ``lead`` of at most four dimensions and ``D``
contiguous (a gate ``(*lead, 1)``); operands broadcast along leading dimensions of size 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch
from .tiles import cdiv, next_power_of_2

__all__ = ["copy_rows", "gate_grads_into", "gated_rows_into"]

_BLOCK_ROWS = 32
#: Leading dimensions a row's address is made of.
_LEAD = 4


@triton.jit
def _row_offsets(rows, s1, s2, s3, t0, t1, t2, t3):
    """The element offset of each row of an operand with leading strides ``t0..t3``, the rows
    counted over leading sizes ``(., s1, s2, s3)`` (64-bit)."""
    i3 = rows % s3
    i2 = (rows // s3) % s2
    i1 = (rows // (s3 * s2)) % s1
    i0 = rows // (s3 * s2 * s1)
    return i0 * t0 + i1 * t1 + i2 * t2 + i3 * t3


@triton.jit
def _program_rows(num_rows, dim, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's ``BLOCK_ROWS`` rows (64-bit), which of them exist, the columns of a row
    and the elements that exist."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    valid = rows < num_rows
    cols = tl.arange(0, BLOCK_D)
    return rows, valid, cols, valid[:, None] & (cols < dim)[None, :]


@triton.jit
def _gated_rows_kernel(
    result, out, gate, total,
    num_rows, s1, s2, s3, dim,
    r0, r1, r2, r3,
    o0, o1, o2, o3,
    g0, g1, g2, g3,
    t0, t1, t2, t3,
    HAS_GATE: tl.constexpr,
    HAS_TOTAL: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """``result = total + gate * out`` for ``BLOCK_ROWS`` rows (``gate``, ``total`` optional),
    in float32, rounded once (Note [Gated rows in one pass])."""
    rows, valid, cols, mask = _program_rows(num_rows, dim, BLOCK_ROWS, BLOCK_D)
    at_out = _row_offsets(rows, s1, s2, s3, o0, o1, o2, o3)
    value = tl.load(out + at_out[:, None] + cols[None, :], mask=mask, other=0.0)
    if HAS_GATE:
        at_gate = _row_offsets(rows, s1, s2, s3, g0, g1, g2, g3)
        g = tl.load(gate + at_gate, mask=valid, other=0.0).to(tl.float32)
        value = value.to(tl.float32) * g[:, None]
    if HAS_TOTAL:
        at_total = _row_offsets(rows, s1, s2, s3, t0, t1, t2, t3)
        before = tl.load(total + at_total[:, None] + cols[None, :], mask=mask, other=0.0)
        value = before.to(tl.float32) + value.to(tl.float32)
    at_result = _row_offsets(rows, s1, s2, s3, r0, r1, r2, r3)
    tl.store(result + at_result[:, None] + cols[None, :], value.to(result.dtype.element_ty),
             mask=mask)  # fmt: skip


@triton.jit
def _gate_grads_kernel(
    d_out, d_gate, dout, out, gate,
    num_rows, s1, s2, s3, dim,
    a0, a1, a2, a3,
    b0, b1, b2, b3,
    c0, c1, c2, c3,
    e0, e1, e2, e3,
    g0, g1, g2, g3,
    NEED_OUT: tl.constexpr,
    NEED_GATE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """The gradients of ``gate * out`` for ``BLOCK_ROWS`` rows: ``d_out = gate * dout`` and
    ``d_gate = sum(dout * out)`` over the row (either optional)."""
    rows, valid, cols, mask = _program_rows(num_rows, dim, BLOCK_ROWS, BLOCK_D)
    at_dout = _row_offsets(rows, s1, s2, s3, c0, c1, c2, c3)
    upstream = tl.load(dout + at_dout[:, None] + cols[None, :], mask=mask, other=0.0)
    upstream = upstream.to(tl.float32)
    if NEED_OUT:
        at_gate = _row_offsets(rows, s1, s2, s3, g0, g1, g2, g3)
        g = tl.load(gate + at_gate, mask=valid, other=0.0).to(tl.float32)
        at_d_out = _row_offsets(rows, s1, s2, s3, a0, a1, a2, a3)
        tl.store(d_out + at_d_out[:, None] + cols[None, :],
                 (upstream * g[:, None]).to(d_out.dtype.element_ty), mask=mask)  # fmt: skip
    if NEED_GATE:
        at_out = _row_offsets(rows, s1, s2, s3, e0, e1, e2, e3)
        value = tl.load(out + at_out[:, None] + cols[None, :], mask=mask, other=0.0)
        at_d_gate = _row_offsets(rows, s1, s2, s3, b0, b1, b2, b3)
        tl.store(d_gate + at_d_gate, tl.sum(upstream * value.to(tl.float32), axis=1)
                 .to(d_gate.dtype.element_ty), mask=valid)  # fmt: skip


def _lead(lead: torch.Size, x: torch.Tensor | None) -> tuple[int, ...]:
    """The strides of ``x``'s leading dimensions broadcast to ``lead`` (0 along one of size 1,
    and along those ``x`` lacks in front), padded in front to :data:`_LEAD`; zeros for None.
    Read off the shape, without a broadcast view (host time per launch)."""
    if x is None:
        return (0,) * _LEAD
    pairs = zip(x.shape[:-1], x.stride()[:-1], strict=True)
    strides = [0 if size == 1 else stride for size, stride in pairs]
    return (0,) * (_LEAD - len(strides)) + tuple(strides)


def _sizes(lead: torch.Size) -> tuple[int, int, int, int]:
    """The leading sizes ``(rows, s1, s2, s3)``: all rows, and the last three dimensions'
    sizes (1 where ``lead`` has fewer)."""
    padded = (1,) * (_LEAD - len(lead)) + tuple(lead)
    return lead.numel(), padded[1], padded[2], padded[3]


def gated_rows_into(
    result: torch.Tensor,
    out: torch.Tensor,
    gate: torch.Tensor | None = None,
    total: torch.Tensor | None = None,
) -> None:
    """``result = total + gate * out`` row by row, in one pass, rounded once (Note [Gated rows
    in one pass]); without ``gate`` ``out`` itself, without ``total`` no sum: a copy of rows.

    Args:
        result: (*lead, D), written; may be ``out`` or ``total`` (each row is read before it
            is written).
        out: (*lead, D); gate: (*lead, 1) or None; total: (*lead, D) or None. Any of them may
            broadcast along leading dimensions of size 1 and be strided, D contiguous.
    """
    lead = result.shape[:-1]
    num_rows, s1, s2, s3 = _sizes(lead)
    if num_rows == 0:
        return
    dim = result.shape[-1]
    launch(_gated_rows_kernel, (cdiv(num_rows, _BLOCK_ROWS),), (
        result, out, out if gate is None else gate, out if total is None else total,
        num_rows, s1, s2, s3, dim,
        *_lead(lead, result), *_lead(lead, out), *_lead(lead, gate), *_lead(lead, total),
    ), dict(HAS_GATE=gate is not None, HAS_TOTAL=total is not None, BLOCK_ROWS=_BLOCK_ROWS,
            BLOCK_D=next_power_of_2(dim)))  # fmt: skip


def copy_rows(source: torch.Tensor, target: torch.Tensor) -> None:
    """``target.copy_(source)`` for strided views with contiguous rows, in one pass."""
    gated_rows_into(target, source)


def gate_grads_into(
    d_out: torch.Tensor | None,
    d_gate: torch.Tensor | None,
    dout: torch.Tensor,
    out: torch.Tensor | None,
    gate: torch.Tensor | None,
) -> None:
    """The gradients of ``gate * out`` given ``dout``, in one pass: ``d_out = gate * dout``
    and ``d_gate = sum(dout * out)`` over each row (Note [Gated rows in one pass]).

    Args:
        d_out: (*lead, D) written, or None; d_gate: (*lead, 1) written, or None.
        dout: (*lead, D); out: (*lead, D), None where ``d_gate`` is; gate: (*lead, 1), None
            where ``d_out`` is. Strided as :func:`gated_rows_into` takes them.
    """
    lead = dout.shape[:-1]
    num_rows, s1, s2, s3 = _sizes(lead)
    if num_rows == 0 or (d_out is None and d_gate is None):
        return
    dim = dout.shape[-1]
    launch(_gate_grads_kernel, (cdiv(num_rows, _BLOCK_ROWS),), (
        dout if d_out is None else d_out, dout if d_gate is None else d_gate, dout,
        dout if out is None else out, dout if gate is None else gate,
        num_rows, s1, s2, s3, dim,
        *_lead(lead, d_out), *_lead(lead, d_gate), *_lead(lead, dout), *_lead(lead, out),
        *_lead(lead, gate),
    ), dict(NEED_OUT=d_out is not None, NEED_GATE=d_gate is not None, BLOCK_ROWS=_BLOCK_ROWS,
            BLOCK_D=next_power_of_2(dim)))  # fmt: skip
