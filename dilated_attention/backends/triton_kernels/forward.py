"""The forward kernel of our dense and dilated Triton kernels: one branch's online softmax over
its rows, read through strides or tensor descriptors, merged in place into the running output
(Note [Strided dilated rows] and Note [Rows through tensor descriptors] in
``triton_kernels/launchers.py``, which launches it). Its tiles, exponents and NaN rows follow Note
[Full blocks], Note [Exponents at large logits] and Note [NaN through the kernels] in
``triton_kernels/device.py``.

Shape legend: B batch, N positions, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .device import (
    _descriptor_rows,
    _jit,
    _key_bias,
    _key_ranges,
    _load_rows,
    _load_tile,
    _row0,
    _segment_rows,
    _step,
    _store_rows,
    _tanh,
    _tile_and_group,
    _visible,
)


@triton.jit
def _forward_blocks(
    acc, l_i, m_i, q, k_ptr, v_ptr, mask_ptr, lo, hi, gap_at, gap, offs_m, offs_n0, offs_d,
    rows_k, k_step, v_step, mask_step, qk_scale, k_desc, v_desc, b, first_k, kvh, rate, win_lo,
    win_hi, cap_in, softcap,
    HEAD_DIM: tl.constexpr, ON_DIAGONAL: tl.constexpr, HAS_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, CHECK: tl.constexpr,
    DESCRIPTORS: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Online softmax over key blocks [lo, hi); ``ON_DIAGONAL`` applies the causal mask,
    ``CHECK`` the end of the key rows (Note [Full blocks]), ``WINDOW`` the local window, the
    blocks from ``gap_at`` on starting ``gap`` rows later (Note [Local windows in the
    kernels]); ``SOFTCAP`` caps the scores (Note [Soft-capped scores in the kernels]);
    ``DESCRIPTORS`` reads k and v through ``k_desc``/``v_desc`` (Note [Rows through tensor
    descriptors])."""
    for i in range(lo, hi, BLOCK_N):
        start_n = i
        if WINDOW:  # noqa: SIM102 (a constexpr test apart: no select without a window)
            if i >= gap_at:
                start_n = i + gap
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
        if SOFTCAP:  # before the masks: tanh(-inf) would be -1
            qk = softcap * _tanh(qk * cap_in)
        if CHECK or HAS_MASK:
            qk += _key_bias(mask_ptr, offs_n, mask_step, k_ok, HAS_MASK)[None, :]
        if ON_DIAGONAL or WINDOW:
            seen = _visible(offs_m[:, None], offs_n[None, :], win_lo, win_hi, ON_DIAGONAL, WINDOW)
            qk = tl.where(seen, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2((qk - m_safe[:, None]) * qk_scale)  # Note [Exponents at large logits]
        alpha = tl.exp2((m_i - m_safe) * qk_scale)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _merged(o, lse, lse_ptrs, prev_ptr, offs_m, prev_step, row_ok, offs_d,
            HEAD_DIM: tl.constexpr):  # fmt: skip
    """A tile's ``(o, lse)`` merged with the running ``(out, lse)`` stored for its rows (Note
    [Merging partial softmaxes]). Rows no earlier branch wrote have lse = -inf and whatever the
    scratch held: their weight is 0 and their values never enter the sum (Note [Fused branch
    engine]). A NaN or +inf lse on either side makes the weights, and the merged row, NaN (Note
    [NaN through the kernels])."""
    old_lse = tl.load(lse_ptrs, mask=row_ok, other=float("-inf"))
    old_o = _load_rows(prev_ptr, offs_m, prev_step, row_ok, offs_d, HEAD_DIM).to(tl.float32)
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
    return old_part + o * (w_new * inv)[:, None], merged_lse


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
    kv_group, qk_scale, sm_scale, win_lo, win_hi, cap_in, softcap,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, MERGE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WIDE: tl.constexpr, DESCRIPTORS: tl.constexpr,
    TABLE: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, TILES_OUTER: tl.constexpr,
):  # fmt: skip
    """One branch's forward for query tile ``pid_m`` of one (segment, head) and batch row.
    With ``SOFTCAP``, ``qk_scale`` is log2(e) and ``sm_scale`` 1 (the capped scores are scaled
    already, ``cap_in = scale / softcap``; Note [Soft-capped scores in the kernels])."""
    pid_m, pid_sh = _tile_and_group(TILES_OUTER, True)  # Note [Heavy tiles first]
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
    args = (offs_m, tl.arange(0, BLOCK_N), offs_d, rows_k, _step(rate, stride_kn, WIDE),
            _step(rate, stride_vn, WIDE), _step(rate, stride_mn, WIDE), qk_scale,
            KDesc, VDesc, b32, base_k, kvh, rate, win_lo, win_hi, cap_in, softcap)  # fmt: skip
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    f0, f1, lo, hi, gap_at, gap = _key_ranges(
        pid_m, rows_q, rows_k, win_lo, win_hi, CAUSAL, WINDOW, BLOCK_M, BLOCK_N
    )  # Note [Full blocks]
    acc, l_i, m_i = _forward_blocks(
        acc, l_i, m_i, q, k_ptr, v_ptr, mask_ptr, f0, f1, f1, 0, *args,
        HEAD_DIM, False, HAS_MASK, DOT_PRECISION, BLOCK_N, False, DESCRIPTORS, False, SOFTCAP,
    )  # fmt: skip
    acc, l_i, m_i = _forward_blocks(
        acc, l_i, m_i, q, k_ptr, v_ptr, mask_ptr, lo, hi, gap_at, gap, *args,
        HEAD_DIM, CAUSAL, HAS_MASK, DOT_PRECISION, BLOCK_N, True, DESCRIPTORS, WINDOW, SOFTCAP,
    )  # fmt: skip
    # A row that saw no key has l = 0: out 0, lse -inf; a NaN score makes l, out and lse NaN
    # (Note [NaN through the kernels]). One rounding in lse (Note [Exponents at large logits]).
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), m_i * sm_scale + tl.log(l_safe))
    lse_row0 = _row0(Lse, b, stride_lb, h, stride_lh, base_q - q_row0, stride_ln)
    lse_ptrs = lse_row0 + offs_m * _step(rate, stride_ln, WIDE)
    if MERGE:
        prev_ptr = _row0(Prev, b, stride_pb, h, stride_ph, base_q - prev_row0, stride_pn)
        o, lse = _merged(o, lse, lse_ptrs, prev_ptr, offs_m, _step(rate, stride_pn, WIDE),
                         row_ok, offs_d, HEAD_DIM)  # fmt: skip
    out_ptr = _row0(Out, b, stride_ob, h, stride_oh, base_q - out_row0, stride_on)
    _store_rows(out_ptr, offs_m, _step(rate, stride_on, WIDE), o, row_ok, offs_d, HEAD_DIM, False)
    tl.store(lse_ptrs, lse, mask=row_ok)
