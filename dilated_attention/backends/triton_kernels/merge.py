"""Fused merges of partial attention results (CUDA): one partial result into float32
accumulators in place (:func:`merge_into`), the key splits of one call (:func:`merge_splits`),
and a dilated plan's branch slots, merged or summed once (:class:`SlotKernels`).

The ring merges every step's kernel result into its running ``(out, lse)``
(Note [Merging partial softmaxes] in ``core/merge.py``). Done with torch ops that is about ten
passes over the output, ~40 bytes moved per element; this kernel reads both outputs and both
log-sum-exps once and writes the merged row back: 10 bytes per element (float32 accumulator,
16-bit part). Imported on first use, because it needs the ``triton`` package.

Shapes of :func:`merge_into`: ``out`` (B, n, H, D) float32, ``lse`` (B, n, H) float32, ``part``
(B, n, H, D) any float dtype, ``part_lse`` (B, n, H) (any strides, e.g. a transposed (B, H, n)
kernel lse).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from ...core.geometry.slots import merge_slots_torch, sum_slots_torch
from .launch import launch
from .tiles import cdiv, next_power_of_2

_BLOCK_ROWS = 32


@triton.jit
def _program_rows(num_rows, seq_len, heads, BLOCK_ROWS: tl.constexpr):
    """This program's ``BLOCK_ROWS`` (batch, position, head) rows: whether each exists, and its
    batch ``b``, position ``i`` and head ``h`` (64-bit)."""
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    return row < num_rows, row // (heads * seq_len), (row // heads) % seq_len, row % heads


@triton.jit
def _merge_kernel(
    out, lse, part, part_lse,
    num_rows, seq_len, heads, dim,
    s_ob, s_on, s_oh,
    s_lb, s_ln, s_lh,
    s_pb, s_pn, s_ph,
    s_qb, s_qn, s_qh,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Each program merges ``BLOCK_ROWS`` (batch, position, head) rows of ``D`` elements."""
    valid, b, i, h = _program_rows(num_rows, seq_len, heads, BLOCK_ROWS)
    lse_ptr = lse + b * s_lb + i * s_ln + h * s_lh
    lse_a = tl.load(lse_ptr, mask=valid, other=float("-inf"))
    lse_b = tl.load(part_lse + b * s_qb + i * s_qn + h * s_qh, mask=valid, other=float("-inf"))
    lse_b = lse_b.to(tl.float32)
    # NaN in, NaN out: a NaN lse (a NaN query row) must not lose to the other side's maximum.
    top = tl.maximum(lse_a, lse_b, propagate_nan=tl.PropagateNan.ALL)
    top = tl.where(top == float("-inf"), 0.0, top)  # both sides empty: weights 0, lse stays -inf
    w_a = tl.exp(lse_a - top)
    w_b = tl.exp(lse_b - top)
    total = w_a + w_b  # in [1, 2]; 0 when both sides are empty; NaN for NaN or +inf lse
    inv = tl.where(total == 0.0, 0.0, 1.0 / total)
    cols = tl.arange(0, BLOCK_D)
    mask = valid[:, None] & (cols < dim)[None, :]
    out_ptr = out + (b * s_ob + i * s_on + h * s_oh)[:, None] + cols[None, :]
    part_ptr = part + (b * s_pb + i * s_pn + h * s_ph)[:, None] + cols[None, :]
    o_a = tl.load(out_ptr, mask=mask, other=0.0)
    o_b = tl.load(part_ptr, mask=mask, other=0.0).to(tl.float32)
    merged = o_a * (w_a * inv)[:, None] + o_b * (w_b * inv)[:, None]
    tl.store(out_ptr, merged, mask=mask)
    tl.store(lse_ptr, top + tl.log(total), mask=valid)  # log(0) = -inf: empty stays empty


def merge_into(
    out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor
) -> None:
    """Merge ``(part, part_lse)`` into ``(out, lse)`` in place.

    Args:
        out: (B, n, H, D) float32 accumulator, last dim contiguous.
        lse: (B, n, H) float32 accumulator.
        part: (B, n, H, D) a kernel's output over other keys, last dim contiguous.
        part_lse: (B, n, H) its log-sum-exp.
    """
    batch, seq_len, heads, dim = out.shape
    num_rows = batch * seq_len * heads
    if num_rows == 0:
        return
    grid = (cdiv(num_rows, _BLOCK_ROWS),)
    launch(_merge_kernel, grid, (
        out, lse, part, part_lse,
        num_rows, seq_len, heads, dim,
        *out.stride()[:3], *lse.stride(), *part.stride()[:3], *part_lse.stride(),
    ), dict(BLOCK_ROWS=_BLOCK_ROWS, BLOCK_D=next_power_of_2(dim)))  # fmt: skip


@triton.jit
def _merge_splits_kernel(
    part, part_lse, out, lse,
    seq_len, heads, dim, splits,
    s_pb, s_ps, s_pn, s_ph,
    s_qb, s_qh, s_qs, s_qn,
    s_ob, s_on, s_oh,
    s_lb, s_lh, s_ln,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Program (b * n + i) * H + h merges the ``splits`` partial results of one (batch b,
    position i, head h) row, ``BLOCK_S`` splits a tile: weights normalized by their own sum,
    NaN carried (Note [Merging partial softmaxes] in ``core/merge.py``)."""
    row = tl.program_id(0).to(tl.int64)
    h = row % heads
    i = (row // heads) % seq_len
    b = row // (heads * seq_len)
    lse_ptr = part_lse + b * s_qb + h * s_qh + i * s_qn
    tile = tl.arange(0, BLOCK_S).to(tl.int64)
    top = tl.full([], float("-inf"), tl.float32)
    for first in range(0, splits, BLOCK_S):
        split_lse = tl.load(lse_ptr + (first + tile) * s_qs, mask=first + tile < splits,
                            other=float("-inf"))  # fmt: skip
        top = tl.maximum(top, tl.max(split_lse, 0))
    # Every split empty: weights 0, lse -inf. NaN in, NaN out: a NaN (or +inf) lse gives its
    # split a NaN weight, so the total, the row and its lse are NaN whatever the maximum.
    top = tl.where(top == float("-inf"), 0.0, top)
    cols = tl.arange(0, BLOCK_D)
    part_ptr = part + b * s_pb + i * s_pn + h * s_ph + cols[None, :]
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for first in range(0, splits, BLOCK_S):
        present = first + tile < splits
        weight = tl.exp(tl.load(lse_ptr + (first + tile) * s_qs, mask=present,
                                other=float("-inf")) - top)  # fmt: skip
        split_out = tl.load(part_ptr + (first + tile)[:, None] * s_ps,
                            mask=present[:, None] & (cols < dim)[None, :], other=0.0)  # fmt: skip
        total += tl.sum(weight, 0)
        acc += tl.sum(split_out * weight[:, None], 0)
    inv = tl.where(total == 0.0, 0.0, 1.0 / total)  # NaN total (NaN or +inf lse) stays NaN
    tl.store(out + b * s_ob + i * s_on + h * s_oh + cols, (acc * inv).to(out.dtype.element_ty),
             mask=cols < dim)  # fmt: skip
    tl.store(lse + b * s_lb + h * s_lh + i * s_ln, top + tl.log(total))


#: Splits a tile of the split merge (a program per row reads them at once).
_SPLITS_TILE = 64


def merge_splits(
    part: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
) -> None:
    """Merge the key splits of one call into ``out`` and ``lse``, one rounding into ``out``.

    Args:
        part: (B, S * n, H, D) float32: split ``s`` of query row ``i`` at row ``s * n + i``.
        part_lse: (B, H, S * n) float32, rows as in ``part``.
        out: (B, n, H, D) any float dtype, last dim contiguous; written.
        lse: (B, H, n) float32; written.
    """
    batch, seq_len, heads, dim = out.shape
    num_rows = batch * seq_len * heads
    if num_rows == 0:
        return
    splits = part.shape[1] // seq_len
    _merge_splits_kernel[(num_rows,)](
        part, part_lse, out, lse,
        seq_len, heads, dim, splits,
        part.stride(0), seq_len * part.stride(1), part.stride(1), part.stride(2),
        part_lse.stride(0), part_lse.stride(1), seq_len * part_lse.stride(2), part_lse.stride(2),
        *out.stride()[:3], *lse.stride(),
        BLOCK_S=min(_SPLITS_TILE, max(2, next_power_of_2(splits))),
        BLOCK_D=next_power_of_2(dim),
    )  # fmt: skip


# -- branch slots (Note [Branch slots merged once] in core/geometry/slots.py)
# ------------------------------- A program takes BLOCK_CELLS consecutive (position, head) cells of
# one batch element: its output rows are one contiguous run of memory, and so are the slot rows it
# reads (the heads of a slot row are positions next to each other). Each cell finds its row in every
# slot by dividing its position by the slot's segment length and its place in the segment by the
# rate (a ragged branch's slot has ceil(L / r) rows a segment, some unused); with those (and the
# head count) compile-time constants the divisions are multiplications. Runtime 64-bit divisions,
# computed once per thread that holds a piece of the row, ran these kernels 5-10x below the memory
# bandwidth of an H100 (0.7 of 3 TB/s). The slots come as tuples of views
# (``core.slots.SlotView``): a plan's own slots and a spanning slot's part of a position group
# alike.
@triton.jit
def _slot_cell(
    b, p, h, valid, row_b, lse_b, lse_seg, lse_h,
    SEG: tl.constexpr, RATE: tl.constexpr, HEADS: tl.constexpr, DIM: tl.constexpr,
):  # fmt: skip
    """A slot view (segment ``SEG``, rate ``RATE``) at cell (batch ``b``, position ``p``, head
    ``h``): whether it covers the cell, the element offset of its row (rows counted in cells,
    times ``DIM`` last: the compiler then knows rows are ``DIM``-aligned and loads them in
    vectors) and of its lse."""
    rows_per_segment = (SEG + RATE - 1) // RATE  # compile-time: SEG and RATE are
    seg = p // SEG
    t = p - seg * SEG  # the position in its segment
    m = t // RATE
    covered = valid & ((t - m * RATE) == (h % RATE))
    row_at = b * row_b + ((seg * rows_per_segment + m).to(tl.int64) * HEADS + h) * DIM
    lse_at = b * lse_b + seg.to(tl.int64) * lse_seg + h * lse_h + m
    return covered, row_at, lse_at


@triton.jit
def _slot_program(seq_len, HEADS: tl.constexpr, BLOCK_CELLS: tl.constexpr):
    """This program's batch ``b`` and ``BLOCK_CELLS`` cells: whether each exists, its position
    ``p`` and head ``h``."""
    b = tl.program_id(1).to(tl.int64)
    cell = tl.program_id(0) * BLOCK_CELLS + tl.arange(0, BLOCK_CELLS)  # < 2**31: _fits
    p = cell // HEADS
    return b, cell < seq_len * HEADS, p, cell - p * HEADS


@triton.jit
def _merge_slots_kernel(
    rows, lses, row_b, lse_b, lse_seg, lse_h, out, lse,
    seq_len,
    s_ob, s_on, s_oh,
    s_lb, s_lh, s_ln,
    SEGS: tl.constexpr,
    RATES: tl.constexpr,
    NUM_SLOTS: tl.constexpr,
    HEADS: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_CELLS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Each program merges the slots of ``BLOCK_CELLS`` cells: the largest lse first, then the
    weighted rows, one rounding (NaN carried, as in :func:`_merge_kernel`)."""
    b, valid, p, h = _slot_program(seq_len, HEADS, BLOCK_CELLS)
    top = tl.full([BLOCK_CELLS], float("-inf"), dtype=tl.float32)
    for i in tl.static_range(NUM_SLOTS):
        covered, _, lse_at = _slot_cell(b, p, h, valid, row_b[i], lse_b[i], lse_seg[i], lse_h[i],
                                        SEGS[i], RATES[i], HEADS, DIM)  # fmt: skip
        part_lse = tl.load(lses[i] + lse_at, mask=covered, other=float("-inf"))
        top = tl.maximum(top, part_lse, propagate_nan=tl.PropagateNan.ALL)
    top = tl.where(top == float("-inf"), 0.0, top)  # no slot saw a key: weights 0, lse -inf
    cols = tl.arange(0, BLOCK_D)
    total = tl.zeros([BLOCK_CELLS], dtype=tl.float32)
    acc = tl.zeros([BLOCK_CELLS, BLOCK_D], dtype=tl.float32)
    for i in tl.static_range(NUM_SLOTS):
        covered, row_at, lse_at = _slot_cell(b, p, h, valid, row_b[i], lse_b[i], lse_seg[i],
                                             lse_h[i], SEGS[i], RATES[i], HEADS, DIM)  # fmt: skip
        weight = tl.exp(tl.load(lses[i] + lse_at, mask=covered, other=float("-inf")) - top)
        mask = covered[:, None] & (cols < DIM)[None, :]
        part = tl.load(rows[i] + row_at[:, None] + cols[None, :], mask=mask, other=0.0)
        acc += part.to(tl.float32) * weight[:, None]
        total += weight
    inv = tl.where(total == 0.0, 0.0, 1.0 / total)
    mask = valid[:, None] & (cols < DIM)[None, :]
    cell_at = b * s_ob + p.to(tl.int64) * s_on + h * s_oh
    tl.store(out + cell_at[:, None] + cols[None, :], (acc * inv[:, None]).to(out.dtype.element_ty),
             mask=mask)  # fmt: skip
    lse_ptr = lse + b * s_lb + h * s_lh + p.to(tl.int64) * s_ln
    tl.store(lse_ptr, top + tl.log(total), mask=valid)  # log(0) = -inf: empty stays empty


@triton.jit
def _sum_slots_kernel(
    rows, row_b, grad,
    seq_len,
    s_gb, s_gn, s_gh,
    SEGS: tl.constexpr,
    RATES: tl.constexpr,
    NUM_SLOTS: tl.constexpr,
    HEADS: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_CELLS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Each program sums the slots of ``BLOCK_CELLS`` cells in float32 and writes the rows once."""
    b, valid, p, h = _slot_program(seq_len, HEADS, BLOCK_CELLS)
    cols = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_CELLS, BLOCK_D], dtype=tl.float32)
    for i in tl.static_range(NUM_SLOTS):
        covered, row_at, _ = _slot_cell(b, p, h, valid, row_b[i], 0, 0, 0, SEGS[i], RATES[i],
                                        HEADS, DIM)  # fmt: skip
        mask = covered[:, None] & (cols < DIM)[None, :]
        part = tl.load(rows[i] + row_at[:, None] + cols[None, :], mask=mask, other=0.0)
        acc += part.to(tl.float32)
    mask = valid[:, None] & (cols < DIM)[None, :]
    cell_at = b * s_gb + p.to(tl.int64) * s_gn + h * s_gh
    tl.store(grad + cell_at[:, None] + cols[None, :], acc.to(grad.dtype.element_ty), mask=mask)


#: float32 elements of a slot program's accumulator (cells x head dim).
_SLOT_CELLS = 4096
#: The segment length given for a view whose one segment holds every position of the launch.
_ONE_SEGMENT = 2**31 - 1


def _segment_constant(segment_len: int, seq_len: int) -> int:
    """The compile-time segment length of a slot view over ``seq_len`` positions: its own where
    segments end inside the launch, else :data:`_ONE_SEGMENT` (every position is then in
    segment 0, whatever the length: a spanning slot's part of a shorter last group is a run of
    ``N - k G`` positions, which would otherwise compile the kernels anew for every N)."""
    return segment_len if segment_len < seq_len else _ONE_SEGMENT


def _fits(views: Sequence[Any], dest: torch.Tensor) -> bool:
    """Whether a launch covers ``dest`` (B, N, H, D): cells of one batch element below 2**31,
    batch elements within the grid's second axis, slot rows contiguous within a batch element."""
    batch, seq_len, heads, dim = dest.shape
    rows_ok = all(
        v.rows.stride(3) == 1 and v.rows.stride(2) == dim and v.rows.stride(1) == heads * dim
        for v in views
    )
    return rows_ok and seq_len * heads < 2**31 and batch < 2**16


def _launch(views: Sequence[Any], dest: torch.Tensor) -> tuple[tuple[int, int], dict[str, Any]]:
    """The grid and the slot arguments of a slot kernel writing ``dest`` (B, N, H, D)."""
    batch, seq_len, heads, dim = dest.shape
    block_d = next_power_of_2(dim)
    block_cells = max(16, _SLOT_CELLS // block_d)
    grid = (cdiv(seq_len * heads, block_cells), batch)
    args = {
        "rows": tuple(v.rows for v in views), "row_b": tuple(v.rows.stride(0) for v in views),
        "SEGS": tuple(_segment_constant(v.segment_len, seq_len) for v in views),
        "RATES": tuple(v.rate for v in views),
        "NUM_SLOTS": len(views), "HEADS": heads, "DIM": dim, "BLOCK_CELLS": block_cells,
        "BLOCK_D": block_d,
    }  # fmt: skip
    return grid, args


class SlotKernels:
    """The one-pass slot kernels on CUDA (``core.slots.SlotKernels``): compiled once per
    schedule (its segment lengths and rates are compile-time constants), head count and dim;
    the torch passes where a launch cannot cover the slots (:func:`_fits`)."""

    @staticmethod
    def merge(views: Sequence[Any], out: torch.Tensor, lse: torch.Tensor) -> None:
        """Merge the slot ``views`` (``core.slots.SlotView``) into ``out`` (B, N, H, D), last dim
        contiguous, and ``lse`` (B, H, N) float32."""
        if not _fits(views, out) or any(v.lse is None or v.lse.stride(3) != 1 for v in views):
            merge_slots_torch(views, out, lse)
            return
        grid, args = _launch(views, out)
        if 0 in grid or not views:
            merge_slots_torch(views, out, lse)
            return
        lses = tuple(v.lse for v in views)
        _merge_slots_kernel[grid](
            lses=lses, lse_b=tuple(x.stride(0) for x in lses),
            lse_seg=tuple(x.stride(1) for x in lses), lse_h=tuple(x.stride(2) for x in lses),
            out=out, lse=lse, seq_len=out.shape[1], s_ob=out.stride(0), s_on=out.stride(1),
            s_oh=out.stride(2), s_lb=lse.stride(0), s_lh=lse.stride(1), s_ln=lse.stride(2),
            **args,
        )  # fmt: skip

    @staticmethod
    def sum(views: Sequence[Any], grad: torch.Tensor) -> None:
        """Write the sum of the slot ``views``' rows into ``grad`` (B, N, H, D), last dim
        contiguous."""
        grid, args = _launch(views, grad)
        if not _fits(views, grad) or 0 in grid or not views:
            sum_slots_torch(views, grad)
            return
        _sum_slots_kernel[grid](
            grad=grad, seq_len=grad.shape[1], s_gb=grad.stride(0), s_gn=grad.stride(1),
            s_gh=grad.stride(2), **args,
        )  # fmt: skip
