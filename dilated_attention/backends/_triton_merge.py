"""One fused, in-place merge of a partial attention result into float32 accumulators (CUDA).

The ring merges every step's kernel result into its running ``(out, lse)``
(Note [Merging partial softmaxes] in ``core/merge.py``). Done with torch ops that is about ten
passes over the output, ~40 bytes moved per element; this kernel reads both outputs and both
log-sum-exps once and writes the merged row back: 10 bytes per element (float32 accumulator,
16-bit part). Imported on first use, because it needs the ``triton`` package.

Shapes: ``out`` (B, n, H, D) float32, ``lse`` (B, n, H) float32, ``part`` (B, n, H, D) any float
dtype, ``part_lse`` (B, n, H) (any strides, e.g. a transposed (B, H, n) kernel lse).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_ROWS = 32


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
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    valid = row < num_rows
    h = row % heads
    i = (row // heads) % seq_len
    b = row // (heads * seq_len)
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
