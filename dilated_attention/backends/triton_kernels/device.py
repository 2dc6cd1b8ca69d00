"""Device helpers of our dense and dilated Triton kernels (``triton_kernels/forward.py``,
``triton_kernels/backward.py``): row addressing, masked loads and stores, key masks, the key ranges
of a tile, and the jit that leaves positions unspecialized.

Imported only by those modules (lazily, through ``backends/triton.py``: it needs the ``triton``
package). The kernels' geometry is Note [Strided dilated rows] in ``triton_kernels/launchers.py``.

Shape legend: B batch, N positions, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import triton
import triton.language as tl

#: Integer arguments never specialized (Note [Specialization and first calls] in
#: ``triton_kernels/launchers.py``).
_POSITIONS = (
    "out_row0", "prev_row0", "q_row0", "delta_row0", "grad_row0", "start", "seg_q", "seg_k",
    "end_q", "end_k", "end", "head0", "win_lo", "win_hi",
)  # fmt: skip
#: Strides of the (B, H, N) statistics (lse, delta) and mask: N and H * N, so their alignment
#: class changes with the length (Note [Specialization and first calls]).
_STATISTICS_STRIDES = (
    "stride_lb", "stride_lh", "stride_eb", "stride_eh", "stride_mb", "stride_mh", "stride_mn",
)  # fmt: skip


def _jit(fn: Callable[..., Any]) -> Any:
    """``triton.jit`` that specializes neither positions nor the statistics' and mask's strides
    on alignment (Note [Specialization and first calls]); hints an older Triton lacks are left
    out."""
    names = set(inspect.signature(fn).parameters)
    hints = {
        "do_not_specialize": [n for n in _POSITIONS if n in names],
        "do_not_specialize_on_alignment": [n for n in _STATISTICS_STRIDES if n in names],
    }
    accepted = inspect.signature(triton.jit).parameters
    return triton.jit(fn, **{k: v for k, v in hints.items() if k in accepted})


# -- device helpers --------------------------------------------------------------------------------
# Addressing: each program forms 64-bit scalar pointers to row 0 of its rows, then steps
# ``rate * stride`` per row with 32-bit offsets (64-bit when ``WIDE``: a call whose offsets could
# pass 2**31 elements), which keeps the per-element pointer arithmetic cheap.


# Note [Segments from a table]
#     Packed documents (Note [Packed documents] in ``core/geometry/documents.py``) cut each document
#     into segments from its own first token, so a branch's segments over a range of positions are
#     no longer equal steps from one start: the last segment of each document is short, and a
#     document shorter than ``w`` is one segment of its own length. Such a launch takes the
#     segments' boundaries (``Bounds``, int32, the segments' starts and then the end of the last)
#     and program ``pid_seg`` reads segment ``[Bounds[pid_seg], Bounds[pid_seg + 1])``; the grid
#     covers the longest segment's rows, and the programs of shorter ones past their rows return
#     at once. Everything inside a segment (head offsets, rows, causality, the merge) is as
#     without a table, so all documents of a position group run in one launch per branch.


# Note [Heavy tiles first]
#     A causal launch's programs do unequal work: in a segment of T tiles, forward and dQ tile i
#     visits i + 1 key tiles and dK/dV tile i visits T - i query tiles (and a GQA dK/dV program does
#     that for each of its G query heads). The GPU starts programs, in practice (CUDA does not
#     promise it), in the order of their linear index, x fastest and the batch row slowest. With the
#     tile on x, every (segment, head) group's tiles start together, heavy and light mixed, and the
#     last wave holds whole groups' heaviest tiles: the launch waits on a few programs while most
#     SMs idle. With ``TILES_OUTER`` the grid is (groups, tiles, batch) and the tile comes from y,
#     heaviest first (forward and dQ count down from the last tile, dK/dV up from the first): tiles
#     start one index at a time across a batch row's groups, the heaviest index first, so the last
#     waves hold the lightest tiles (longest-processing-time-first scheduling). Before this, at N =
#     32K the rate-1 dK/dV launch of LongNet's schedule ran 24% slower with 4 key/value heads than
#     with 16 (fewer, longer programs). Launchers (``_grid`` in ``triton_kernels/launchers.py``) set
#     it for causal launches whose tiles fit y (2**16 - 1 programs), and for any launch with more
#     (segment, head) groups than y holds; results do not depend on it. A causal launch of more
#     tiles than y holds (over 2M rows per segment) takes the other variant, compiled on its first
#     use.


@triton.jit
def _tile_and_group(TILES_OUTER: tl.constexpr, HEAVY_LAST: tl.constexpr):
    """``(tile, group)`` of this program (Note [Heavy tiles first]): the tile index and the
    (segment, head) group's index. ``HEAVY_LAST``: a tile's work grows with its index."""
    if TILES_OUTER:
        tile = tl.program_id(1)
        if HEAVY_LAST:
            tile = tl.num_programs(1) - 1 - tile
        group = tl.program_id(0)
    else:
        tile = tl.program_id(0)
        group = tl.program_id(1)
    return tile, group


@triton.jit
def _segment_rows(
    pid_seg, h, start, seg_q, seg_k, end_q, end_k, rate, head0, Bounds, TABLE: tl.constexpr,
):  # fmt: skip
    """First query/key position of head ``h``'s rows in segment ``pid_seg``, and row counts.

    ``h`` counts from the first head of the call, which is head ``head0`` of the layer: the
    offset is ``(head0 + h) mod rate`` (Note [Strided dilated rows]). With ``TABLE`` the
    segment is ``[Bounds[pid_seg], Bounds[pid_seg + 1])`` (Note [Segments from a table])."""
    if TABLE:
        seg_start_q = tl.load(Bounds + pid_seg)
        seg_start_k = seg_start_q
        len_q = tl.load(Bounds + pid_seg + 1) - seg_start_q
        len_k = len_q
    else:
        seg_start_q = start + pid_seg * seg_q
        seg_start_k = start + pid_seg * seg_k
        len_q = tl.minimum(seg_q, end_q - seg_start_q)
        len_k = tl.minimum(seg_k, end_k - seg_start_k)
    s = (head0 + h) % rate
    rows_q = tl.maximum(len_q - s + rate - 1, 0) // rate
    rows_k = tl.maximum(len_k - s + rate - 1, 0) // rate
    return seg_start_q + s, seg_start_k + s, rows_q, rows_k


@triton.jit
def _row0(X, b, stride_b, head, stride_h, pos, stride_n):
    """Scalar pointer to ``X[b, pos, head]`` (64-bit arithmetic)."""
    return X + b * stride_b + tl.cast(head, tl.int64) * stride_h + tl.cast(pos, tl.int64) * stride_n


@triton.jit
def _step(rate, stride_n, WIDE: tl.constexpr):
    """Elements between consecutive dilated rows (int64 when ``WIDE``)."""
    step = rate * stride_n
    if WIDE:  # one return statement: Triton wants one return type
        step = tl.cast(rate, tl.int64) * stride_n
    return step


@triton.jit
def _load_rows(ptr, rows, step, row_ok, offs_d, HEAD_DIM: tl.constexpr):
    """(len(rows), BLOCK_D) tile of rows ``ptr + rows * step`` (zeros where masked)."""
    mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    return tl.load(ptr + (rows * step)[:, None] + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def _load_tile(ptr, rows, step, row_ok, offs_d, HEAD_DIM: tl.constexpr, CHECK: tl.constexpr):
    """``_load_rows``, or without ``CHECK`` (every row exists) a load masked by columns only
    (none when ``HEAD_DIM`` is a power of two)."""
    if CHECK:
        tile = _load_rows(ptr, rows, step, row_ok, offs_d, HEAD_DIM)
    else:
        ptrs = ptr + (rows * step)[:, None] + offs_d[None, :]
        if offs_d.shape[0] == HEAD_DIM:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
    return tile


@triton.jit
def _descriptor_rows(desc, b, first, rate, head, row, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """(ROWS, BLOCK_D) tile of rows ``row, row + 1, ...`` of the head whose row 0 is position
    ``first``, through a (B, N/r, r, H, D) descriptor (Note [Rows through tensor descriptors])."""
    return desc.load([b, first // rate + row, first % rate, head, 0]).reshape(ROWS, BLOCK_D)


@triton.jit
def _keep_keys(mask_ptr, offs_n, mask_step, k_ok, HAS_MASK: tl.constexpr):
    """(BLOCK_N,) bool: the key row exists and the padding mask keeps it."""
    keep = k_ok
    if HAS_MASK:
        ignore = tl.load(mask_ptr + offs_n * mask_step, mask=k_ok, other=1)
        keep = keep & (ignore == 0)
    return keep


@triton.jit
def _key_bias(mask_ptr, offs_n, mask_step, k_ok, HAS_MASK: tl.constexpr):
    """(BLOCK_N,) float32 added to a tile's scores: 0 for kept keys, ``-inf`` for keys past the
    end or masked. One add per score: forwards with a padding mask measured 8-16% faster on an
    H100 than with the scores selected by ``tl.where``."""
    return tl.where(_keep_keys(mask_ptr, offs_n, mask_step, k_ok, HAS_MASK), 0.0, float("-inf"))


# Note [Full blocks]
#     Every loop over key (or query) blocks runs in two parts: the blocks whose rows all exist
#     and that no causal diagonal crosses, with plain loads and no bounds test on the scores
#     (``CHECK=False``), then in one loop the rest: the one block cut by the end of the rows
#     (masked loads, ``-inf`` scores past the end) and, when causal, the blocks the diagonal
#     crosses (the causal mask is applied to all of them; on blocks wholly below the diagonal
#     it changes nothing). Without a padding mask, a full block applies no mask at all. Each
#     part is a copy of the loop body in the compiled kernel: two parts rather than three (full,
#     end, diagonal) leave less code to compile, and the first call of a causal family with an
#     empty cache took 4.7 s rather than 5.0 s on an H100 (``benchmarks/bench_first_call.py``;
#     forward+backward times at N = 256K unchanged within the benchmark's noise). The softmax scale
#     is applied inside the exponent (Note [Exponents at large logits]); scales are positive, so
#     the running maximum of the unscaled scores is the maximum of the scaled ones.
#
# Note [Exponents at large logits]
#     Scores ``qk`` (unscaled, float32) may be huge (logits 1e6) while their softmax is one-hot
#     or spread over keys within O(1) of each other, so every exponent is formed from a
#     *difference* that is exact or rounded at its own small size, never from two large
#     rounded terms:
#
#     * forward: ``p = exp2((qk - m) * c)`` with ``m`` the row's running max of the unscaled
#       scores and ``c = scale * log2(e)``: a subtraction and a multiply per score. The former
#       ``exp2(qk * c - m')`` with ``m' = fl(max(qk) * c)`` compiles to one fused multiply-add,
#       which subtracts the rounded ``m'`` from the *exact* product: the top key's ``p`` came
#       out ``2**r`` with ``r`` up to half a float32 spacing of ``m'`` (0.06 at logits 1e6), not
#       1. ``l`` sums that ``p`` while ``acc`` sums it rounded to the value dtype, so a one-hot
#       row's ``out`` was ``v * (1 + 2**-9)`` in bfloat16, ``delta = dout . out`` missed the
#       row's ``dp`` by that much, and ``ds * k`` with ``|k| ~ 1e3`` gave dQ errors of 12
#       (bfloat16, logits 1e6) and 0.44 (float16, 6e4) where the true dQ is ~0 (H100).
#     * ``lse = m * scale + log(l)`` (natural log, one FMA, one rounding), not through log2
#       units (``(m' + log2 l) / log2(e)``: three roundings at |lse|).
#     * backward: ``p = exp2((qk * scale - lse) * log2(e))``: the FMA forms ``qk * scale - lse``
#       exactly up to one rounding at the size of the difference, the same ``scale`` as the
#       forward's ``lse``. Multiplying the loaded lse by ``log2(e)`` first rounded at |lse|
#       once more (0.06 in log2 units at 1e6). What remains is the lse's own float32 rounding
#       (half a spacing at |lse|: Note [Tolerances at extreme logits] in the tests). One more
#       multiply per score than ``exp2(qk * c - lse2)``.
#
# Note [NaN through the kernels]
#     A NaN score (a NaN query element, or a NaN key element the row attends) makes ``p``, and so
#     ``l``, ``acc``, the row's out and lse NaN, which the backward carries into its gradients;
#     ``tl.max`` drops NaN, but ``l`` does not. Empty rows are recognized by ``l == 0`` (out 0,
#     lse -inf), never by ``l > 0``, which a NaN fails too. The in-kernel merge does the same
#     with its weights: ``total == 0`` only where both sides are empty, and an earlier result
#     is dropped only where its weight is exactly 0 (its scratch row was never written).
#
# Note [Rows past the end]
#     Query rows past a head's last row load q, dout, lse and delta as zeros. The forward and dQ
#     never store them; in dK/dV their probabilities are exp2(0 - 0) = 1 but dout = 0 gives
#     dp = 0, so they add exactly zero to dV (p * dout) and dK (p * (dp - delta) * q). So only
#     the key side is masked inside the loops.
#
# Note [Local windows in the kernels]
#     A dense launch (one segment, rate 1) may see a local window of its rows (Note [Scores a
#     kernel call transforms] in ``core/contract.py``): key row ``j`` is visible to query row
#     ``i`` iff ``win_lo <= j - i <= win_hi`` (``win_lo = shift - left``, ``win_hi = shift +
#     right``, ``shift = Nk - Nq``; an unbounded side is clamped past the rows), intersected
#     with the causal mask and the key mask. The loops visit only the blocks some row of the
#     tile sees (``_key_ranges``, ``_query_ranges``): for query tile [m0, m1] the key blocks
#     from the one holding key ``m0 + win_lo`` to key ``m1 + win_hi`` (and the diagonal), for
#     key tile [n0, n1] in dK/dV the query blocks from row ``n0 - win_hi`` to row ``n1 -
#     win_lo``. A block outside is never loaded: a window of ``W`` keys costs about ``W /
#     BLOCK_N + 1`` blocks per tile, whatever the call's length, and a NaN or inf key there
#     reaches no row (only the blocks a window's edge cuts keep ``0 * NaN``, as the causal
#     diagonal does: Note [Hidden keys cannot poison rows] in ``core/hidden.py``). Of the
#     visited blocks, those every row of the tile sees whole (inside the window, below the
#     diagonal, all rows present) run unchecked, with no mask but the key padding mask (Note
#     [Full blocks]); the rest, on either edge of the window, run checked in the second loop,
#     which walks its two ranges with one jump (``gap_at``, ``gap``) as dK/dV's loop walks the
#     diagonal's and the end's. ``WINDOW`` is a constexpr: calls without a window compile the
#     loops as before. The fused dilated branches take no window (a window is a call of its
#     own: Note [A local window as a branch] in ``resolve/windows.py``).
#
# Note [Soft-capped scores in the kernels]
#     With ``SOFTCAP`` (a constexpr: no cost without a cap) every score becomes ``s = c *
#     tanh(qk * scale / c)`` before any mask is applied (a ``-inf`` mask would otherwise come
#     out ``-c``). The scores are then bounded by ``c``, so Note [Exponents at large logits]
#     needs nothing more: the forward's running max is over ``s`` itself, ``p = exp2((s - m) *
#     log2(e))`` and ``lse = m + log(l)`` (the launcher passes ``qk_scale = log2(e)``,
#     ``sm_scale = 1``, ``cap_in = scale / c``). The backward recomputes ``t = tanh(qk * scale /
#     c)``, ``p = exp2((c t - lse) * log2(e))``, and multiplies ``dS`` by ``1 - t**2`` before
#     ``dQ`` and ``dK`` take their ``scale``. ``tanh`` is built from ``exp2`` (:func:`_tanh`:
#     libdevice's cannot run in Triton's interpreter), accurate to a few float32 ulps: an odd
#     Taylor polynomial to ``x**9`` below ``|x| = 0.25`` (truncation below 1e-8 relative), else
#     ``(1 - e) / (1 + e)`` with ``e = exp(-2|x|) <= 0.61``, whose subtraction loses at most a
#     factor 1.6 of ``e``'s rounding. ``1 - t**2`` is exact where it matters: near 0 it is 1,
#     and where ``t`` rounds to 1 the true factor is below 1e-7.


@triton.jit
def _store_rows(ptr, rows, step, value, row_ok, offs_d, HEAD_DIM: tl.constexpr,
                ACCUMULATE: tl.constexpr):  # fmt: skip
    """Write (or with ``ACCUMULATE`` add) a float32 tile into rows ``ptr + rows * step``."""
    ptrs = ptr + (rows * step)[:, None] + offs_d[None, :]
    mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    if ACCUMULATE:
        value += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, value.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _key_ranges(
    pid_m, rows_q, rows_k, win_lo, win_hi,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The key blocks of query tile ``pid_m`` (Note [Full blocks]): ``(f0, f1, lo, hi, gap_at,
    gap)``, blocks [f0, f1) visible whole to every row of the tile (no row past the end), and
    the rest in one checked loop from ``lo`` to ``hi`` whose blocks from ``gap_at`` on start
    ``gap`` rows later. Without ``WINDOW`` the full blocks start at key 0 and the checked ones
    are those cut by the end of the rows or the causal diagonal; with it, only the blocks the
    window reaches (Note [Local windows in the kernels])."""
    if WINDOW:
        m0 = pid_m * BLOCK_M
        m1 = tl.minimum(m0 + BLOCK_M, rows_q) - 1  # the tile's last row
        hi = tl.minimum(rows_k, m1 + win_hi + 1)
        top = tl.minimum(rows_k, m0 + win_hi + 1)  # every row sees the keys below ``top``
        if CAUSAL:
            hi = tl.minimum(hi, m1 + 1)
            top = tl.minimum(top, m0 + 1)
        lo = tl.maximum(m0 + win_lo, 0) // BLOCK_N * BLOCK_N
        hi = tl.maximum(hi, lo)
        f0 = tl.minimum(tl.cdiv(tl.maximum(m1 + win_lo, 0), BLOCK_N) * BLOCK_N, hi)
        f1 = tl.maximum(tl.maximum(top, 0) // BLOCK_N * BLOCK_N, f0)
        gap_at = f0
        gap = f1 - f0
        hi = f0 + hi - f1
    else:
        hi = rows_k
        f1 = rows_k // BLOCK_N * BLOCK_N
        if CAUSAL:
            hi = tl.minimum(rows_k, (pid_m + 1) * BLOCK_M)
            f1 = tl.minimum(f1, (pid_m * BLOCK_M) // BLOCK_N * BLOCK_N)
        f0 = 0
        lo = f1
        gap_at = hi
        gap = 0
    return f0, f1, lo, hi, gap_at, gap


@triton.jit
def _query_ranges(
    pid_n, rows_q, rows_k, win_lo, win_hi,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The query blocks of key tile ``pid_n`` in dK/dV: ``(lo, f0, f1, hi)``, blocks [f0, f1)
    in which every row sees every key of the tile (all rows exist), and [lo, f0) and [f1, hi)
    the rest (Note [Full blocks]); with ``WINDOW`` only the rows the window reaches (Note [Local
    windows in the kernels])."""
    n0 = pid_n * BLOCK_N
    if WINDOW:
        n1 = tl.minimum(n0 + BLOCK_N, rows_k) - 1  # the tile's last key
        first = tl.maximum(n0 - win_hi, 0)  # the first row that sees a key of the tile
        whole = tl.maximum(n1 - win_hi, 0)  # rows from here see the last key
        if CAUSAL:
            first = tl.maximum(first, n0)
            whole = tl.maximum(whole, n1)
        lo = first // BLOCK_M * BLOCK_M
        hi = tl.maximum(tl.minimum(rows_q, n1 - win_lo + 1), lo)
        f0 = tl.minimum(tl.cdiv(whole, BLOCK_M) * BLOCK_M, hi)
        top = tl.maximum(tl.minimum(rows_q, n0 - win_lo + 1), 0)  # rows below see the first key
        f1 = tl.maximum(top // BLOCK_M * BLOCK_M, f0)
    else:
        # Without a window: the blocks across the diagonal (none when not causal), then every row
        # follows every key of the tile, unchecked up to ``f1``; ``f1`` is a multiple of BLOCK_M
        # or ``f0``, so the checked blocks after it continue the diagonal's on the same grid.
        lo = 0
        f0 = 0
        if CAUSAL:
            lo = n0 // BLOCK_M * BLOCK_M
            f0 = tl.minimum(tl.cdiv(n0 + BLOCK_N - 1, BLOCK_M) * BLOCK_M, rows_q)
        hi = rows_q
        f1 = tl.maximum(f0, rows_q // BLOCK_M * BLOCK_M)
    return lo, f0, f1, hi


@triton.jit
def _visible(rows, keys, win_lo, win_hi, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """Bool, broadcast of query rows and key rows: the causal mask (``keys <= rows``) and the
    window (``win_lo <= keys - rows <= win_hi``) as asked (at least one of them)."""
    if WINDOW:
        diff = keys - rows
        ok = (diff >= win_lo) & (diff <= win_hi)
        if CAUSAL:
            ok = ok & (diff <= 0)
    else:
        ok = rows >= keys
    return ok


@triton.jit
def _tanh(x):
    """``tanh(x)`` in float32 from ``exp2`` (Note [Soft-capped scores in the kernels]): an odd
    Taylor polynomial below ``|x| = 0.25``, else ``(1 - e) / (1 + e)`` with ``e = exp(-2|x|)``
    (no overflow); NaN stays NaN, ``+-inf`` gives ``+-1``."""
    a = tl.abs(x)
    e = tl.exp2(a * -2.8853900817779268)  # exp(-2|x|)
    x2 = x * x
    series = a * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (
        -0.05396825396825397 + x2 * 0.021869488536155203))))  # fmt: skip
    r = tl.where(a < 0.25, series, (1.0 - e) / (1.0 + e))
    return tl.where(x < 0, -r, r)


@triton.jit
def _backward_probabilities(qk, lse, sm_scale, softcap, SOFTCAP: tl.constexpr):
    """``p = exp(s - lse)`` of unscaled scores ``qk`` (``lse`` broadcast to them) with ``s``
    the scaled score, soft-capped with ``SOFTCAP``; and the factor of ``dS`` (``1 - tanh**2``
    of the capped score; with no cap ``p`` itself, unused). Note [Exponents at large logits],
    Note [Soft-capped scores in the kernels]."""
    if SOFTCAP:
        t = _tanh(qk * (sm_scale / softcap))
        p = tl.exp2((t * softcap - lse) * 1.4426950408889634)
        slope = 1.0 - t * t
    else:
        p = tl.exp2((qk * sm_scale - lse) * 1.4426950408889634)
        slope = p
    return p, slope
