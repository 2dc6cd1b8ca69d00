"""Fused merges of partial attention results (CUDA): one partial result into float32
accumulators in place (:func:`merge_into`), and the key splits of one call (:func:`merge_splits`).

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

import torch
import triton
import triton.language as tl

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
    grid = (triton.cdiv(num_rows, _BLOCK_ROWS),)
    _merge_kernel[grid](
        out, lse, part, part_lse,
        num_rows, seq_len, heads, dim,
        *out.stride()[:3], *lse.stride(), *part.stride()[:3], *part_lse.stride(),
        BLOCK_ROWS=_BLOCK_ROWS, BLOCK_D=triton.next_power_of_2(dim),
    )  # fmt: skip


@triton.jit
def _merge_splits_kernel(
    part, part_lse, out, lse,
    num_rows, seq_len, heads, dim, splits,
    s_pb, s_ps, s_pn, s_ph,
    s_qb, s_qh, s_qs, s_qn,
    s_ob, s_on, s_oh,
    s_lb, s_lh, s_ln,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Each program merges the ``splits`` partial results of ``BLOCK_ROWS`` (batch, position,
    head) rows: weights normalized by their own sum, NaN carried (Note [Merging partial
    softmaxes] in ``core/merge.py``)."""
    valid, b, i, h = _program_rows(num_rows, seq_len, heads, BLOCK_ROWS)
    lse_ptr = part_lse + b * s_qb + h * s_qh + i * s_qn
    top = tl.full([BLOCK_ROWS], float("-inf"), dtype=tl.float32)
    for s in range(splits):
        split_lse = tl.load(lse_ptr + s * s_qs, mask=valid, other=float("-inf"))
        top = tl.maximum(top, split_lse, propagate_nan=tl.PropagateNan.ALL)
    top = tl.where(top == float("-inf"), 0.0, top)  # every split empty: weights 0, lse -inf
    cols = tl.arange(0, BLOCK_D)
    mask = valid[:, None] & (cols < dim)[None, :]
    part_ptr = part + (b * s_pb + i * s_pn + h * s_ph)[:, None] + cols[None, :]
    total = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    acc = tl.zeros([BLOCK_ROWS, BLOCK_D], dtype=tl.float32)
    for s in range(splits):
        weight = tl.exp(tl.load(lse_ptr + s * s_qs, mask=valid, other=float("-inf")) - top)
        split_out = tl.load(part_ptr + s * s_ps, mask=mask, other=0.0)
        total += weight
        acc += split_out * weight[:, None]
    inv = tl.where(total == 0.0, 0.0, 1.0 / total)  # NaN total (NaN or +inf lse) stays NaN
    out_ptr = out + (b * s_ob + i * s_on + h * s_oh)[:, None] + cols[None, :]
    tl.store(out_ptr, (acc * inv[:, None]).to(out.dtype.element_ty), mask=mask)
    tl.store(lse + b * s_lb + h * s_lh + i * s_ln, top + tl.log(total), mask=valid)


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
    grid = (triton.cdiv(num_rows, _BLOCK_ROWS),)
    _merge_splits_kernel[grid](
        part, part_lse, out, lse,
        num_rows, seq_len, heads, dim, splits,
        part.stride(0), seq_len * part.stride(1), part.stride(1), part.stride(2),
        part_lse.stride(0), part_lse.stride(1), seq_len * part_lse.stride(2), part_lse.stride(2),
        *out.stride()[:3], *lse.stride(),
        BLOCK_ROWS=_BLOCK_ROWS, BLOCK_D=triton.next_power_of_2(dim),
    )  # fmt: skip
