"""Triton kernels that read dilated rows through strides: forward, delta, dK/dV and dQ.

Imported only by ``backends/triton.py`` (lazily: this module needs the ``triton`` package).

Note [Strided dilated rows]
    One launch runs one branch ``(w, r)`` over the segments of a position range. A program owns
    the rows ``i`` of one (batch, segment, head) for a tile of ``BLOCK_M`` rows; head ``h`` reads,
    in the segment starting at ``t0``, the positions ``t0 + s + r*i`` with ``s = h mod r``, for
    queries and for keys of its key/value head ``h // G`` (GQA, ``G = H / Hkv``). The pointers step
    ``r * stride(seq)`` per row, so nothing is gathered. A segment of ``L`` positions gives head
    ``h`` ``ceil((L - s) / r)`` rows (fewer when ``r`` does not divide ``L``; none when ``s >= L``),
    so ragged segments and the short last segment need no special casing. Causal masking compares
    row indices, which within one offset class order like positions. A launch may cover a slice
    of the heads (the fused engine's head groups); ``head0`` names the layer head of the slice's
    first head, so offsets stay ``(head0 + h) mod r``.

    The forward keeps FlashAttention's running (max, sum, acc), the max over unscaled scores
    (Note [Exponents at large logits]), and with ``MERGE`` folds its result into the ``(out,
    lse)`` already stored for those rows (Note [Merging partial softmaxes]) in float32: branches
    run one launch after another, and rows of one launch belong to one program, so the
    read-modify-write needs no atomics. The backward kernels take the *merged* ``lse`` and
    ``delta = rowsum(dout * out)`` (Note [Exact gradients through the branch mix]); the dK/dV
    program of a key tile loops over every query head of its key/value head that has the same
    offset, so its rows are written by it alone, and ``ACCUMULATE`` adds into float32 gradient
    buffers shared by the branches.

Rectangular dense calls (one segment, ``r = 1``, different query and key lengths) use the same
kernels with separate query and key segment lengths.

Note [Rows through tensor descriptors]
    On Hopper the forward reads q, k and v with the tensor memory accelerator (TMA) instead of
    per-thread pointer loads: 9-14% faster at head dims 64 and 128 on an H100 on most branch
    shapes (``benchmarks/results/tma_forward_h100.md``). A (B, N, H, D) tensor whose length is a
    multiple of ``r`` is viewed as (B, N/r, r, H, D): position ``p`` is row ``p // r`` of class
    ``p % r``, so the rows ``first + r*i`` of one head in one segment are the consecutive rows
    ``first // r + i`` of class ``first % r``, whether or not the segment starts on a multiple
    of ``r``. One host-side descriptor per tensor and launch covers every segment and head (no
    per-program descriptors, no scratch memory). A box may run past a head's rows into the next
    segment, whose rows are real data: key scores there are masked like any row past the end,
    value rows there are zeroed (``0 * nan`` is nan), and query rows there are never stored.
    Everything else (mask, merge, output and lse stores) stays on pointers. ``_use_descriptors``
    says where this applies; anything else takes the pointer loads.

Shape legend: B batch, N positions, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from ._compat import _release
from ._triton_compile import Launch, compile_launches
from ._triton_tiles import TileConfig, cdiv, next_power_of_2

try:  # Triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: pointer loads only
    TensorDescriptor = None

LOG2E = math.log2(math.e)

#: Where the forward reads rows through tensor descriptors (Note [Rows through tensor
#: descriptors]): ``"auto"`` (Hopper or newer, Triton >= 3.6, 16-bit inputs, 64 <= head dim
#: <= 128: where it was measured faster), ``"always"`` (wherever the layout allows; tests and
#: the interpreter) or ``"never"``.
DESCRIPTOR_POLICY = "auto"
#: Oldest Triton whose compile of the descriptor forward was tested (5-D boxes reshaped to 2-D);
#: older ones keep pointer loads under ``"auto"`` rather than risk a compile failure mid-call.
DESCRIPTOR_MIN_TRITON = (3, 6)
_TRITON_VERSION = _release(triton.__version__)


@dataclass(frozen=True)
class Branch:
    """One launch's geometry: segments of ``seg_q`` query / ``seg_k`` key positions at stride
    ``rate``, the first starting at ``start``; query positions end at ``end_q``, keys at ``end_k``
    (the last segment is clipped there).

    With ``bounds`` (packed documents, Note [Segments from a table]) the segments are instead
    ``[bounds[i], bounds[i + 1])`` for queries and keys alike, the longest ``seg_q == seg_k``
    positions.
    """

    start: int
    seg_q: int
    seg_k: int
    end_q: int
    end_k: int
    rate: int
    bounds: torch.Tensor | None = None

    @property
    def num_segments(self) -> int:
        if self.bounds is not None:
            return self.bounds.numel() - 1
        return cdiv(self.end_q - self.start, self.seg_q)

    @property
    def max_rows_q(self) -> int:
        return cdiv(min(self.seg_q, self.end_q - self.start), self.rate)

    @property
    def max_rows_k(self) -> int:
        return cdiv(min(self.seg_k, self.end_k - self.start), self.rate)


# Note [Specialization and first calls]
#     Triton compiles a kernel once per *specialization*: its constexprs, and for every integer
#     argument whether it equals 1 and whether it is divisible by 16. Left alone, positions
#     (segment starts and ends, row offsets) and the strides of the (B, H, N) tensors (lse, delta
#     and the mask, whose strides are N and H * N) make a new length compile again: 8 of 12
#     kernels recompiled for N = 5001 after N = 4096 on an H100, 11 s
#     (``benchmarks/bench_first_call.py``). So positions are not specialized at all, and those
#     strides not on alignment (a stride of 1 still compiles as the constant 1). What remains in a
#     specialization is a *shape family*: dtype, head dim, tiles, causal, mask, merge/accumulate,
#     a rate of 1 or not, and whether rows are read through tensor descriptors.
#
#     The batch strides of the (B, N, H, D) tensors (q, k, v, out, dout, gradients) keep their
#     alignment class: they are N * (a row's elements), a multiple of 16 for every N whenever a
#     row's H * D is, so they cost no recompile; and a row pointer is 16-byte aligned, which
#     vector loads and stores need, only when Triton knows every term of it is. Without that
#     class every load of q, k, v and dout compiled to 2-byte scalar loads (``ld.global.b16``
#     where 16-byte ``ld.global.v4`` / ``cp.async`` belong): forward+backward of LongNet at
#     N = 64K, D = 64 took 24.1 ms on an H100 against 13.1 ms with it
#     (``tests/backends/test_triton_codegen.py`` compiles the kernels for sm90 and checks).
#
#     A family's kernels are compiled together before its first call (``compile_ahead``): the
#     engine runs once with every launch recorded instead of run, the recorded kernels compile
#     in parallel (Note [Compiling in forked processes] in ``_triton_compile.py``), and then the
#     engine runs for real. Compiled kernels are cached on disk by Triton (``TRITON_CACHE_DIR``,
#     default ``~/.triton/cache``), so a later process only loads them.

_POSITIONS = (
    "out_row0", "prev_row0", "q_row0", "delta_row0", "grad_row0", "start", "seg_q", "seg_k",
    "end_q", "end_k", "end", "head0",
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


#: Inside :func:`compile_ahead`: the launches recorded so far (``None`` outside).
_RECORDED: contextvars.ContextVar[list[Launch] | None] = contextvars.ContextVar(
    "dilated_attention_triton_recorded_launches", default=None
)


def _compiling() -> bool:
    """Whether launches are being recorded for :func:`compile_ahead` instead of run."""
    return _RECORDED.get() is not None


def _launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """Launch ``kernel``, or inside :func:`compile_ahead` only record the launch."""
    recorded = _RECORDED.get()
    if recorded is not None:
        recorded.append(Launch.record(kernel, grid, args, kwargs))
    else:
        kernel[grid](*args, **kwargs)


@contextlib.contextmanager
def compile_ahead(workers: int | None = None) -> Iterator[None]:
    """Inside, launches are recorded instead of run; on a normal exit every recorded kernel is
    compiled, in parallel (Note [Compiling in forked processes] in ``_triton_compile.py``).

    Outputs written inside are garbage: run the same calls again outside to compute.
    """
    recorded: list[Launch] = []
    token = _RECORDED.set(recorded)
    try:
        yield
    finally:
        _RECORDED.reset(token)
    compile_launches(recorded, workers)


# -- device helpers --------------------------------------------------------------------------------
# Addressing: each program forms 64-bit scalar pointers to row 0 of its rows, then steps
# ``rate * stride`` per row with 32-bit offsets (64-bit when ``WIDE``: a call whose offsets could
# pass 2**31 elements), which keeps the per-element pointer arithmetic cheap.


# Note [Segments from a table]
#     Packed documents (Note [Packed documents] in ``core/documents.py``) cut each document into
#     segments from its own first token, so a branch's segments over a range of positions are no
#     longer equal steps from one start: the last segment of each document is short, and a
#     document shorter than ``w`` is one segment of its own length. Such a launch takes the
#     segments' boundaries (``Bounds``, int32, the segments' starts and then the end of the last)
#     and program ``pid_seg`` reads segment ``[Bounds[pid_seg], Bounds[pid_seg + 1])``; the grid
#     covers the longest segment's rows, and the programs of shorter ones past their rows return
#     at once. Everything inside a segment (head offsets, rows, causality, the merge) is as
#     without a table, so all documents of a position group run in one launch per branch.


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


@triton.jit
def _forward_blocks(
    acc, l_i, m_i, q, k_ptr, v_ptr, mask_ptr, lo, hi, offs_m, offs_n0, offs_d, rows_k, k_step,
    v_step, mask_step, qk_scale, k_desc, v_desc, b, first_k, kvh, rate,
    HEAD_DIM: tl.constexpr, ON_DIAGONAL: tl.constexpr, HAS_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, CHECK: tl.constexpr,
    DESCRIPTORS: tl.constexpr,
):  # fmt: skip
    """Online softmax over key blocks [lo, hi); ``ON_DIAGONAL`` applies the causal mask,
    ``CHECK`` the end of the key rows (Note [Full blocks]); ``DESCRIPTORS`` reads k and v
    through ``k_desc``/``v_desc`` (Note [Rows through tensor descriptors])."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        k_ok = offs_n < rows_k
        if DESCRIPTORS:
            block_d: tl.constexpr = offs_d.shape[0]
            k = _descriptor_rows(k_desc, b, first_k, rate, kvh, start_n, BLOCK_N, block_d)
            v = _descriptor_rows(v_desc, b, first_k, rate, kvh, start_n, BLOCK_N, block_d)
            if CHECK:  # rows past the end are the next segment's: finite zeros, never read
                k = tl.where(k_ok[:, None], k, 0.0)
                v = tl.where(k_ok[:, None], v, 0.0)
        else:
            k = _load_tile(k_ptr, offs_n, k_step, k_ok, offs_d, HEAD_DIM, CHECK)
            v = _load_tile(v_ptr, offs_n, v_step, k_ok, offs_d, HEAD_DIM, CHECK)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if CHECK or HAS_MASK:
            qk += _key_bias(mask_ptr, offs_n, mask_step, k_ok, HAS_MASK)[None, :]
        if ON_DIAGONAL:
            qk = tl.where(offs_m[:, None] >= offs_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2((qk - m_safe[:, None]) * qk_scale)  # Note [Exponents at large logits]
        alpha = tl.exp2((m_i - m_safe) * qk_scale)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _dq_blocks(
    dq, q, do, lse, delta, k_ptr, v_ptr, mask_ptr, lo, hi, offs_m, offs_n0, offs_d, rows_k,
    k_step, v_step, mask_step, sm_scale,
    HEAD_DIM: tl.constexpr, ON_DIAGONAL: tl.constexpr, HAS_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, CHECK: tl.constexpr,
):  # fmt: skip
    """dQ contributions of key blocks [lo, hi) (Note [Full blocks])."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        k_ok = offs_n < rows_k
        k = _load_tile(k_ptr, offs_n, k_step, k_ok, offs_d, HEAD_DIM, CHECK)
        v = _load_tile(v_ptr, offs_n, v_step, k_ok, offs_d, HEAD_DIM, CHECK)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if CHECK or HAS_MASK:
            qk += _key_bias(mask_ptr, offs_n, mask_step, k_ok, HAS_MASK)[None, :]
        # Note [Exponents at large logits]
        p = tl.exp2((qk * sm_scale - lse[:, None]) * 1.4426950408889634)
        if ON_DIAGONAL:
            p = tl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _dkdv_blocks(
    dk, dv, k, v, keep, q_ptr, do_ptr, lse_ptr, delta_ptr, lo, hi, gap_at, gap, offs_n,
    offs_m0, offs_d, rows_q, q_step, do_step, lse_step, delta_step, sm_scale,
    HEAD_DIM: tl.constexpr, ON_DIAGONAL: tl.constexpr, HAS_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, CHECK: tl.constexpr,
):  # fmt: skip
    """dK, dV contributions of query blocks [lo, hi) of one head, where the blocks from
    ``gap_at`` on start ``gap`` rows later: two ranges in one loop (Note [Full blocks]). Key
    rows past the end are never stored and each key row's gradient depends on that row alone
    (Note [Rows past the end]), so only padding masks and the diagonal mask scores here."""
    for i in range(lo, hi, BLOCK_M):
        start_m = i
        if i >= gap_at:
            start_m = i + gap
        offs_m = start_m + offs_m0
        q_ok = offs_m < rows_q
        q = _load_tile(q_ptr, offs_m, q_step, q_ok, offs_d, HEAD_DIM, CHECK)
        do = _load_tile(do_ptr, offs_m, do_step, q_ok, offs_d, HEAD_DIM, CHECK)
        if CHECK:
            lse = tl.load(lse_ptr + offs_m * lse_step, mask=q_ok, other=0.0)
            delta = tl.load(delta_ptr + offs_m * delta_step, mask=q_ok, other=0.0)
        else:
            lse = tl.load(lse_ptr + offs_m * lse_step)
            delta = tl.load(delta_ptr + offs_m * delta_step)
        lse = tl.where(lse == float("-inf"), 0.0, lse)
        qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
        p_t = tl.exp2((qk_t * sm_scale - lse[None, :]) * 1.4426950408889634)  # Note [Exponents...]
        if HAS_MASK or ON_DIAGONAL:
            valid_t = keep[:, None]
            if ON_DIAGONAL:
                valid_t = valid_t & (offs_m[None, :] >= offs_n[:, None])
            p_t = tl.where(valid_t, p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
    return dk, dv


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
def _key_ranges(pid_m, rows_k, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(full, hi)`` for query tile ``pid_m``: key blocks [0, full) hold no row past the end and
    are visible to every row of the tile; [full, hi) are the rest of the tile's keys, cut by the
    end of the rows or by the causal diagonal (Note [Full blocks])."""
    hi = rows_k
    full = rows_k // BLOCK_N * BLOCK_N
    if CAUSAL:
        hi = tl.minimum(rows_k, (pid_m + 1) * BLOCK_M)
        full = tl.minimum(full, (pid_m * BLOCK_M) // BLOCK_N * BLOCK_N)
    return full, hi


# -- forward ---------------------------------------------------------------------------------------
@_jit
def _forward_kernel(
    Q, K, V, Out, Prev, Lse, Mask, Bounds, QDesc, KDesc, VDesc,
    stride_qb, stride_qn, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_on, stride_oh,
    stride_pb, stride_pn, stride_ph,
    stride_lb, stride_lh, stride_ln,
    stride_mb, stride_mh, stride_mn,
    out_row0, prev_row0, q_row0, start, seg_q, seg_k, end_q, end_k, rate, head0, num_heads,
    kv_group, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, MERGE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WIDE: tl.constexpr, DESCRIPTORS: tl.constexpr,
    TABLE: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_sh = tl.program_id(1)
    b32 = tl.program_id(2)
    b = b32.to(tl.int64)
    h = pid_sh % num_heads
    base_q, base_k, rows_q, rows_k = _segment_rows(
        pid_sh // num_heads, h, start, seg_q, seg_k, end_q, end_k, rate, head0, Bounds, TABLE
    )
    if pid_m * BLOCK_M >= rows_q:
        return
    # Positions before q_row0 have no query (Note [A chunk in one fused forward]).
    if base_q + ((pid_m + 1) * BLOCK_M - 1) * rate < q_row0:
        return
    kvh = h // kv_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = (offs_m < rows_q) & (base_q + offs_m * rate >= q_row0)
    if DESCRIPTORS:
        q = _descriptor_rows(QDesc, b32, base_q, rate, h, pid_m * BLOCK_M, BLOCK_M, BLOCK_D)
    else:
        q_ptr = _row0(Q, b, stride_qb, h, stride_qh, base_q - q_row0, stride_qn)
        q = _load_rows(q_ptr, offs_m, _step(rate, stride_qn, WIDE), row_ok, offs_d, HEAD_DIM)
    k_ptr = _row0(K, b, stride_kb, kvh, stride_kh, base_k, stride_kn)
    v_ptr = _row0(V, b, stride_vb, kvh, stride_vh, base_k, stride_vn)
    mask_ptr = _row0(Mask, b, stride_mb, h, stride_mh, base_k, stride_mn)
    args = (offs_m, offs_n0, offs_d, rows_k, _step(rate, stride_kn, WIDE),
            _step(rate, stride_vn, WIDE), _step(rate, stride_mn, WIDE), qk_scale,
            KDesc, VDesc, b32, base_k, kvh, rate)  # fmt: skip

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    full, hi = _key_ranges(pid_m, rows_k, CAUSAL, BLOCK_M, BLOCK_N)  # Note [Full blocks]
    acc, l_i, m_i = _forward_blocks(
        acc, l_i, m_i, q, k_ptr, v_ptr, mask_ptr, 0, full, *args,
        HEAD_DIM, False, HAS_MASK, DOT_PRECISION, BLOCK_N, False, DESCRIPTORS,
    )  # fmt: skip
    acc, l_i, m_i = _forward_blocks(
        acc, l_i, m_i, q, k_ptr, v_ptr, mask_ptr, full, hi, *args,
        HEAD_DIM, CAUSAL, HAS_MASK, DOT_PRECISION, BLOCK_N, True, DESCRIPTORS,
    )  # fmt: skip

    # A row that saw no key has l = 0: out 0, lse -inf; a NaN score makes l, out and lse NaN
    # (Note [NaN through the kernels]). One rounding in lse (Note [Exponents at large logits]).
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), m_i * sm_scale + tl.log(l_safe))
    out_ptr = _row0(Out, b, stride_ob, h, stride_oh, base_q - out_row0, stride_on)
    out_step = _step(rate, stride_on, WIDE)
    lse_row0 = _row0(Lse, b, stride_lb, h, stride_lh, base_q - q_row0, stride_ln)
    lse_ptrs = lse_row0 + offs_m * _step(rate, stride_ln, WIDE)
    if MERGE:
        # Rows no earlier branch wrote have lse = -inf and whatever the scratch held: their
        # weight is 0 and their values never enter the sum (Note [Fused branch engine]). A NaN
        # or +inf lse on either side makes the weights, and the merged row, NaN (Note [NaN
        # through the kernels]).
        old_lse = tl.load(lse_ptrs, mask=row_ok, other=float("-inf"))
        prev_ptr = _row0(Prev, b, stride_pb, h, stride_ph, base_q - prev_row0, stride_pn)
        old_o = _load_rows(
            prev_ptr, offs_m, _step(rate, stride_pn, WIDE), row_ok, offs_d, HEAD_DIM
        ).to(tl.float32)
        top = tl.maximum(old_lse, lse, propagate_nan=tl.PropagateNan.ALL)
        top_safe = tl.where(top == float("-inf"), 0.0, top)
        w_old = tl.exp(old_lse - top_safe)
        w_new = tl.exp(lse - top_safe)
        total = w_old + w_new
        none = total == 0.0  # both sides empty; a NaN total is not
        total_safe = tl.where(none, 1.0, total)
        merged_lse = tl.where(none, float("-inf"), top_safe + tl.log(total_safe))
        inv = 1.0 / total_safe
        old_part = tl.where((w_old == 0.0)[:, None], 0.0, old_o * (w_old * inv)[:, None])
        o = old_part + o * (w_new * inv)[:, None]
        lse = merged_lse
    _store_rows(out_ptr, offs_m, out_step, o, row_ok, offs_d, HEAD_DIM, False)
    tl.store(lse_ptrs, lse, mask=row_ok)


# -- backward --------------------------------------------------------------------------------------
@_jit
def _delta_kernel(
    Out, DO, Delta,
    stride_ob, stride_on, stride_oh,
    stride_db, stride_dn, stride_dh,
    stride_eb, stride_eh, stride_en,
    start, end, num_heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """``delta[b, h, n - start] = sum_d out[b, n, h, d] * dout[b, n, h, d]``, n in [start, end)."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    ok = start + offs_m < end
    rows = offs_m.to(tl.int64)  # a group may span more than 2**31 elements
    o = _load_rows(_row0(Out, b, stride_ob, h, stride_oh, start, stride_on), rows, stride_on,
                   ok, offs_d, HEAD_DIM)  # fmt: skip
    do = _load_rows(_row0(DO, b, stride_db, h, stride_dh, start, stride_dn), rows, stride_dn,
                    ok, offs_d, HEAD_DIM)  # fmt: skip
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + b * stride_eb + h * stride_eh + offs_m * stride_en, delta, mask=ok)


@_jit
def _dkdv_kernel(
    Q, K, V, DO, Lse, Delta, Mask, Bounds, DK, DV,
    stride_qb, stride_qn, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_db, stride_dn, stride_dh,
    stride_lb, stride_lh, stride_ln,
    stride_eb, stride_eh, stride_en,
    stride_mb, stride_mh, stride_mn,
    stride_gb, stride_gn, stride_gh,
    delta_row0, grad_row0, start, seg_q, seg_k, end_q, end_k, rate, head0, num_kv_heads, kv_group,
    num_offsets, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, ACCUMULATE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WIDE: tl.constexpr, TABLE: tl.constexpr,
):  # fmt: skip
    """dK, dV of one key tile of key/value head ``g`` at offset ``s``: every query head of ``g``
    with that offset contributes (heads ``g*G + j + t*r``)."""
    pid_n = tl.program_id(0)
    pid = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    j = pid % num_offsets
    g = (pid // num_offsets) % num_kv_heads
    h0 = g * kv_group + j
    base_q, base_k, rows_q, rows_k = _segment_rows(
        pid // (num_offsets * num_kv_heads), h0, start, seg_q, seg_k, end_q, end_k, rate, head0,
        Bounds, TABLE,
    )  # fmt: skip
    if pid_n * BLOCK_N >= rows_k:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    k_ok = offs_n < rows_k
    k_ptr = _row0(K, b, stride_kb, g, stride_kh, base_k, stride_kn)
    v_ptr = _row0(V, b, stride_vb, g, stride_vh, base_k, stride_vn)
    k = _load_rows(k_ptr, offs_n, _step(rate, stride_kn, WIDE), k_ok, offs_d, HEAD_DIM)
    v = _load_rows(v_ptr, offs_n, _step(rate, stride_vn, WIDE), k_ok, offs_d, HEAD_DIM)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # Query blocks [lo, diagonal_end) straddle the causal diagonal (none when not causal); after
    # it every row follows every key of the tile, unchecked up to ``full`` (Note [Full blocks]);
    # ``full`` is a multiple of BLOCK_M or ``diagonal_end``, so the checked blocks after it
    # continue the diagonal's on the same grid.
    lo = 0
    diagonal_end = 0
    if CAUSAL:
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
        diagonal_end = tl.minimum(tl.cdiv((pid_n + 1) * BLOCK_N - 1, BLOCK_M) * BLOCK_M, rows_q)
    full = tl.maximum(diagonal_end, rows_q // BLOCK_M * BLOCK_M)
    args = (offs_n, offs_m0, offs_d, rows_q, _step(rate, stride_qn, WIDE),
            _step(rate, stride_dn, WIDE), _step(rate, stride_ln, WIDE),
            _step(rate, stride_en, WIDE), sm_scale)  # fmt: skip
    mask_step = _step(rate, stride_mn, WIDE)
    for h in range(h0, (g + 1) * kv_group, rate):
        q_ptr = _row0(Q, b, stride_qb, h, stride_qh, base_q, stride_qn)
        do_ptr = _row0(DO, b, stride_db, h, stride_dh, base_q, stride_dn)
        lse_ptr = _row0(Lse, b, stride_lb, h, stride_lh, base_q, stride_ln)
        delta_ptr = _row0(Delta, b, stride_eb, h, stride_eh, base_q - delta_row0, stride_en)
        mask_ptr = _row0(Mask, b, stride_mb, h, stride_mh, base_k, stride_mn)
        keep = _keep_keys(mask_ptr, offs_n, mask_step, k_ok, HAS_MASK)
        ptrs = (k, v, keep, q_ptr, do_ptr, lse_ptr, delta_ptr)
        dk, dv = _dkdv_blocks(
            dk, dv, *ptrs, diagonal_end, full, full, 0, *args,
            HEAD_DIM, False, HAS_MASK, DOT_PRECISION, BLOCK_M, False,
        )  # fmt: skip
        # The checked blocks: those across the diagonal, then the one cut by the end of the
        # rows, which every row past ``diagonal_end`` sees whole (so the diagonal mask is moot).
        dk, dv = _dkdv_blocks(
            dk, dv, *ptrs, lo, diagonal_end + rows_q - full, diagonal_end, full - diagonal_end,
            *args, HEAD_DIM, CAUSAL, HAS_MASK, DOT_PRECISION, BLOCK_M, True,
        )  # fmt: skip
    grad_step = _step(rate, stride_gn, WIDE)
    dk_ptr = _row0(DK, b, stride_gb, g, stride_gh, base_k - grad_row0, stride_gn)
    dv_ptr = _row0(DV, b, stride_gb, g, stride_gh, base_k - grad_row0, stride_gn)
    _store_rows(dk_ptr, offs_n, grad_step, dk * sm_scale, k_ok, offs_d, HEAD_DIM, ACCUMULATE)
    _store_rows(dv_ptr, offs_n, grad_step, dv, k_ok, offs_d, HEAD_DIM, ACCUMULATE)


@_jit
def _dq_kernel(
    Q, K, V, DO, Lse, Delta, Mask, Bounds, DQ,
    stride_qb, stride_qn, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_db, stride_dn, stride_dh,
    stride_lb, stride_lh, stride_ln,
    stride_eb, stride_eh, stride_en,
    stride_mb, stride_mh, stride_mn,
    stride_gb, stride_gn, stride_gh,
    delta_row0, grad_row0, start, seg_q, seg_k, end_q, end_k, rate, head0, num_heads, kv_group,
    sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, ACCUMULATE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WIDE: tl.constexpr, TABLE: tl.constexpr,
):  # fmt: skip
    """dQ of one query tile of head ``h``."""
    pid_m = tl.program_id(0)
    pid_sh = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    h = pid_sh % num_heads
    base_q, base_k, rows_q, rows_k = _segment_rows(
        pid_sh // num_heads, h, start, seg_q, seg_k, end_q, end_k, rate, head0, Bounds, TABLE
    )
    if pid_m * BLOCK_M >= rows_q:
        return
    kvh = h // kv_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_ok = offs_m < rows_q
    q_ptr = _row0(Q, b, stride_qb, h, stride_qh, base_q, stride_qn)
    do_ptr = _row0(DO, b, stride_db, h, stride_dh, base_q, stride_dn)
    q = _load_rows(q_ptr, offs_m, _step(rate, stride_qn, WIDE), q_ok, offs_d, HEAD_DIM)
    do = _load_rows(do_ptr, offs_m, _step(rate, stride_dn, WIDE), q_ok, offs_d, HEAD_DIM)
    lse_ptr = _row0(Lse, b, stride_lb, h, stride_lh, base_q, stride_ln)
    lse = tl.load(lse_ptr + offs_m * _step(rate, stride_ln, WIDE), mask=q_ok, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    delta_ptr = _row0(Delta, b, stride_eb, h, stride_eh, base_q - delta_row0, stride_en)
    delta = tl.load(delta_ptr + offs_m * _step(rate, stride_en, WIDE), mask=q_ok, other=0.0)
    k_ptr = _row0(K, b, stride_kb, kvh, stride_kh, base_k, stride_kn)
    v_ptr = _row0(V, b, stride_vb, kvh, stride_vh, base_k, stride_vn)
    mask_ptr = _row0(Mask, b, stride_mb, h, stride_mh, base_k, stride_mn)
    args = (offs_m, offs_n0, offs_d, rows_k, _step(rate, stride_kn, WIDE),
            _step(rate, stride_vn, WIDE), _step(rate, stride_mn, WIDE), sm_scale)  # fmt: skip
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    full, hi = _key_ranges(pid_m, rows_k, CAUSAL, BLOCK_M, BLOCK_N)  # Note [Full blocks]
    dq = _dq_blocks(
        dq, q, do, lse, delta, k_ptr, v_ptr, mask_ptr, 0, full, *args,
        HEAD_DIM, False, HAS_MASK, DOT_PRECISION, BLOCK_N, False,
    )  # fmt: skip
    dq = _dq_blocks(
        dq, q, do, lse, delta, k_ptr, v_ptr, mask_ptr, full, hi, *args,
        HEAD_DIM, CAUSAL, HAS_MASK, DOT_PRECISION, BLOCK_N, True,
    )  # fmt: skip
    dq_ptr = _row0(DQ, b, stride_gb, h, stride_gh, base_q - grad_row0, stride_gn)
    _store_rows(dq_ptr, offs_m, _step(rate, stride_gn, WIDE), dq * sm_scale, q_ok, offs_d,
                HEAD_DIM, ACCUMULATE)  # fmt: skip


# -- launchers -------------------------------------------------------------------------------------
@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    """A GPU's compute capability; cached, as every launch asks."""
    return torch.cuda.get_device_capability(device_index)


def dot_precision(x: torch.Tensor) -> str:
    """``input_precision`` of the kernels' ``tl.dot`` for inputs like ``x``.

    Note [float32 products]
        16-bit inputs multiply exactly on tensor cores ("tf32" is ignored for them). float32
        inputs use "tf32x3" on GPUs with TF32 tensor cores (sm80+): each product is split into
        a high and a low TF32 part and three tensor-core products recover float32 accuracy. On
        an H100, forward+backward of four causal branches (N = 4,096, H = 8, D = 64) matched
        the float64 math backend as closely as with "ieee" (relative errors 2.7e-7 / 4.7e-7 /
        4.8e-7 / 3.5e-7 on out / dq / dk / dv, against 2.9e-7 / 4.1e-7 / 4.9e-7 / 4.2e-7) and
        ran 2.0x faster at N = 16,384 (5.0 against 10.2 ms;
        ``benchmarks/results/float32_products_h100.json``); "ieee" products are unrolled into
        FMA instructions, and one such kernel compiles for up to 4.1 s. Elsewhere (older
        GPUs, Triton's CPU interpreter) "ieee".
    """
    if x.dtype != torch.float32:
        return "tf32"
    if x.is_cuda and _capability(x.device.index) >= (8, 0):
        return "tf32x3"
    return "ieee"


def _block_d(head_dim: int) -> int:
    return max(16, next_power_of_2(head_dim))


def _mask_args(
    key_mask: torch.Tensor | None, like: torch.Tensor
) -> tuple[torch.Tensor, int, int, int]:
    """``(tensor, stride_b, stride_h, stride_n)`` of a (B, Hm, N) bool mask (Hm in {1, H})."""
    if key_mask is None:
        return like, 0, 0, 0
    mask = key_mask.view(torch.uint8)
    stride_h = 0 if mask.shape[1] == 1 else mask.stride(1)
    return mask, mask.stride(0), stride_h, mask.stride(2)


def _bounds(branch: Branch, like: torch.Tensor) -> torch.Tensor:
    """The segment table of a launch, or any tensor where there is none (never read)."""
    return like if branch.bounds is None else branch.bounds


def _bnh(x: torch.Tensor) -> tuple[int, ...]:
    return x.stride()[:3]


def _wide(branch: Branch, *tensors: torch.Tensor) -> bool:
    """Whether row offsets within one segment can pass 2**31 elements (then 64-bit offsets)."""
    return _wide_rows(branch, max(x.stride(1) for x in tensors))


def _wide_rows(branch: Branch, row_stride: int) -> bool:
    """:func:`_wide` for the largest row stride of a launch's tensors."""
    return max(branch.seg_q, branch.seg_k) * row_stride >= 2**31 - 2**20


def _descriptor_view_ok(x: torch.Tensor, rate: int) -> bool:
    """Whether (B, N, H, D) ``x`` can be read as (B, N/r, r, H, D) through a tensor descriptor:
    16-bit, last dim dense, base and (positive) strides 16-byte aligned, ``N`` a multiple of
    ``rate``."""
    if x.dtype not in (torch.float16, torch.bfloat16) or x.stride(-1) != 1:
        return False
    size = x.element_size()
    return (
        x.data_ptr() % 16 == 0
        and all(stride > 0 and stride * size % 16 == 0 for stride in x.stride()[:3])
        and x.shape[1] % rate == 0
        and x.numel() > 0
    )


def _use_descriptors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rate: int) -> bool:
    """Whether the forward reads rows through tensor descriptors (``DESCRIPTOR_POLICY``)."""
    if TensorDescriptor is None or DESCRIPTOR_POLICY == "never":
        return False
    if DESCRIPTOR_POLICY == "auto":
        dim = q.shape[-1]
        if not (q.is_cuda and 64 <= dim <= 128) or _TRITON_VERSION < DESCRIPTOR_MIN_TRITON:
            return False
        if _capability(q.device.index) < (9, 0):  # no tensor memory accelerators
            return False
    return all(_descriptor_view_ok(x, rate) for x in (q, k, v))


def _row_descriptor(x: torch.Tensor, rate: int, rows: int, block_d: int) -> Any:
    """Descriptor of (B, N, H, D) ``x`` viewed as (B, N/r, r, H, D), box (1, rows, 1, 1, block_d)
    (Note [Rows through tensor descriptors])."""
    batch, length, heads, dim = x.shape
    return TensorDescriptor(
        x,
        [batch, length // rate, rate, heads, dim],
        [x.stride(0), rate * x.stride(1), x.stride(1), x.stride(2), 1],
        [1, rows, 1, 1, block_d],
    )


def forward_branch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    key_mask: torch.Tensor | None,
    branch: Branch,
    *,
    out_row0: int,
    scale: float,
    is_causal: bool,
    merge: bool,
    config: TileConfig,
    descriptor_config: TileConfig | None = None,
    head0: int = 0,
    merge_from: torch.Tensor | None = None,
    merge_row0: int = 0,
    allow_descriptors: bool = True,
    q_row0: int = 0,
) -> None:
    """One branch's forward, written (or with ``merge``, merged) into ``out`` and ``lse``.

    Args:
        q: (B, Nq, H, D), row ``p - q_row0`` for query position ``p``; k, v: (B, Nk, Hkv, D),
            row ``p`` for position ``p``; any strides with stride(-1) == 1.
        out: (B, rows, H, D), row ``p - out_row0`` for query position ``p``.
        lse: (B, H, Nq) float32, natural log, column ``p - q_row0``.
        key_mask: (B, Hm, Nk) bool, ``True`` = ignore, or None.
        config: tiles of the pointer-load kernel; ``descriptor_config``: tiles when the rows are
            read through tensor descriptors (``_use_descriptors``), default ``config``.
        head0: the layer head that ``q``'s head 0 is (a call on a slice of the heads).
        merge_from: with ``merge``, where the running output is read (B, rows, H, D), row
            ``p - merge_row0``; default ``out`` itself. The merged rows go to ``out``.
        allow_descriptors: ``False`` reads rows through pointers even where descriptors apply.
        q_row0: the first position with a query (Note [A chunk in one fused forward] in
            ``core/fused.py``): the branch's rows before it are neither computed nor stored.
            Such a launch reads rows through pointers.
    """
    batch, _, heads, dim = q.shape
    block_d = _block_d(dim)
    mask, smb, smh, smn = _mask_args(key_mask, q)
    prev, prev_row0 = (out, out_row0) if merge_from is None else (merge_from, merge_row0)
    descriptors: tuple[Any, Any, Any] = (None, None, None)
    if allow_descriptors and q_row0 == 0 and _use_descriptors(q, k, v, branch.rate):
        if _compiling():
            # Lengths that r does not divide read through pointers: compile that variant too,
            # so a new length of the family compiles nothing (Note [Specialization and first
            # calls]).
            forward_branch(
                q, k, v, out, lse, key_mask, branch, out_row0=out_row0, scale=scale,
                is_causal=is_causal, merge=merge, config=config, head0=head0,
                merge_from=merge_from, merge_row0=merge_row0, allow_descriptors=False,
            )  # fmt: skip
        config = descriptor_config or config
        descriptors = (
            _row_descriptor(q, branch.rate, config.block_m, block_d),
            _row_descriptor(k, branch.rate, config.block_n, block_d),
            _row_descriptor(v, branch.rate, config.block_n, block_d),
        )
    grid = (cdiv(branch.max_rows_q, config.block_m), branch.num_segments * heads, batch)
    strides = [_bnh(x) for x in (q, k, v, out, prev)]
    _launch(
        _forward_kernel, grid, q, k, v, out, prev, lse, mask, _bounds(branch, lse),
        *descriptors, *itertools.chain.from_iterable(strides), *lse.stride(), smb, smh, smn,
        out_row0, prev_row0, q_row0, branch.start, branch.seg_q, branch.seg_k, branch.end_q,
        branch.end_k, branch.rate, head0, heads, heads // k.shape[2], scale * LOG2E, scale,
        HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        CAUSAL=is_causal, HAS_MASK=key_mask is not None, MERGE=merge,
        DOT_PRECISION=dot_precision(q), WIDE=_wide_rows(branch, max(s[1] for s in strides)),
        DESCRIPTORS=descriptors[0] is not None, TABLE=branch.bounds is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip


def row_delta(out: torch.Tensor, dout: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """``rowsum(out * dout)`` for positions [start, end): (B, H, end - start) float32."""
    batch, _, heads, dim = out.shape
    delta = torch.empty(batch, heads, end - start, dtype=torch.float32, device=out.device)
    block = 64
    grid = (cdiv(end - start, block), heads, batch)
    _launch(
        _delta_kernel, grid, out, dout, delta, *_bnh(out), *_bnh(dout), *delta.stride(), start,
        end, heads,
        HEAD_DIM=dim, BLOCK_D=_block_d(dim), BLOCK_M=block,
    )  # fmt: skip
    return delta


def backward_branch(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    key_mask: torch.Tensor | None,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    branch: Branch,
    *,
    delta_row0: int,
    grad_row0: int,
    scale: float,
    is_causal: bool,
    accumulate: bool,
    config_dkdv: TileConfig,
    config_dq: TileConfig,
    head0: int = 0,
) -> None:
    """One branch's gradients, written (or with ``accumulate``, added) into dq, dk, dv.

    Args:
        dout, q: (B, Nq, H, D); k, v: (B, Nk, Hkv, D).
        lse: (B, H, Nq) merged log-sum-exp; delta: (B, H, rows), row ``p - delta_row0``.
        dq: (B, rows, H, D); dk, dv: (B, rows, Hkv, D); row ``p - grad_row0`` for position ``p``.
        head0: the layer head that ``q``'s head 0 is (a call on a slice of the heads).
    """
    batch, _, heads, dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    offsets = min(group, branch.rate)
    mask, smb, smh, smn = _mask_args(key_mask, q)
    common = (
        *_bnh(q), *_bnh(k), *_bnh(v), *_bnh(dout), *lse.stride(), *delta.stride(), smb, smh, smn,
    )  # fmt: skip
    geometry = (
        branch.start, branch.seg_q, branch.seg_k, branch.end_q, branch.end_k, branch.rate, head0,
    )  # fmt: skip
    flags = {
        "HEAD_DIM": dim, "BLOCK_D": _block_d(dim), "CAUSAL": is_causal,
        "HAS_MASK": key_mask is not None, "ACCUMULATE": accumulate,
        "DOT_PRECISION": dot_precision(q), "WIDE": _wide(branch, q, k, v, dout, dq, dk),
        "TABLE": branch.bounds is not None,
    }  # fmt: skip
    grid = (
        cdiv(branch.max_rows_k, config_dkdv.block_n),
        branch.num_segments * kv_heads * offsets,
        batch,
    )
    _launch(
        _dkdv_kernel, grid, q, k, v, dout, lse, delta, mask, _bounds(branch, lse), dk, dv,
        *common, *_bnh(dk), delta_row0, grad_row0, *geometry, kv_heads, group, offsets, scale,
        BLOCK_M=config_dkdv.block_m, BLOCK_N=config_dkdv.block_n,
        num_warps=config_dkdv.num_warps, num_stages=config_dkdv.num_stages, **flags,
    )  # fmt: skip
    grid = (cdiv(branch.max_rows_q, config_dq.block_m), branch.num_segments * heads, batch)
    _launch(
        _dq_kernel, grid, q, k, v, dout, lse, delta, mask, _bounds(branch, lse), dq, *common,
        *_bnh(dq), delta_row0, grad_row0, *geometry, heads, group, scale,
        BLOCK_M=config_dq.block_m, BLOCK_N=config_dq.block_n,
        num_warps=config_dq.num_warps, num_stages=config_dq.num_stages, **flags,
    )  # fmt: skip
