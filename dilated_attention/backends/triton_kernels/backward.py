"""The backward kernels of our dense and dilated Triton kernels: the row delta, dK/dV of a key
tile and dQ of a query tile, from the merged log-sum-exp (Note [Strided dilated rows] in
``triton_kernels/launchers.py``, which launches them). Their tiles, exponents and rows follow Note
[Full blocks], Note [Exponents at large logits] and Note [Rows past the end] in
``triton_kernels/device.py``.

Shape legend: B batch, N positions, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .device import (
    _backward_probabilities,
    _jit,
    _keep_keys,
    _key_bias,
    _key_ranges,
    _load_rows,
    _load_tile,
    _query_ranges,
    _row0,
    _segment_rows,
    _step,
    _store_rows,
    _tile_and_group,
    _visible,
)


@triton.jit
def _dq_blocks(
    dq, q, do, lse, delta, k_ptr, v_ptr, mask_ptr, lo, hi, gap_at, gap, offs_m, offs_n0, offs_d,
    rows_k, k_step, v_step, mask_step, sm_scale, win_lo, win_hi, softcap,
    HEAD_DIM: tl.constexpr, ON_DIAGONAL: tl.constexpr, HAS_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, CHECK: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """dQ contributions of key blocks [lo, hi), those from ``gap_at`` on ``gap`` rows later with
    ``WINDOW`` (Note [Full blocks], Note [Local windows in the kernels])."""
    for i in range(lo, hi, BLOCK_N):
        start_n = i
        if WINDOW:  # noqa: SIM102 (a constexpr test apart: no select without a window)
            if i >= gap_at:
                start_n = i + gap
        offs_n = start_n + offs_n0
        k_ok = offs_n < rows_k
        k = _load_tile(k_ptr, offs_n, k_step, k_ok, offs_d, HEAD_DIM, CHECK)
        v = _load_tile(v_ptr, offs_n, v_step, k_ok, offs_d, HEAD_DIM, CHECK)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if SOFTCAP:  # the mask after the cap: tanh(-inf) would be -1
            p, slope = _backward_probabilities(qk, lse[:, None], sm_scale, softcap, True)
            if CHECK or HAS_MASK:
                keep = _keep_keys(mask_ptr, offs_n, mask_step, k_ok, HAS_MASK)
                p = tl.where(keep[None, :], p, 0.0)
        else:
            if CHECK or HAS_MASK:
                qk += _key_bias(mask_ptr, offs_n, mask_step, k_ok, HAS_MASK)[None, :]
            p, slope = _backward_probabilities(qk, lse[:, None], sm_scale, softcap, False)
        if ON_DIAGONAL or WINDOW:
            seen = _visible(offs_m[:, None], offs_n[None, :], win_lo, win_hi, ON_DIAGONAL, WINDOW)
            p = tl.where(seen, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * slope
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _dkdv_blocks(
    dk, dv, k, v, keep, q_ptr, do_ptr, lse_ptr, delta_ptr, lo, hi, gap_at, gap, offs_n,
    offs_m0, offs_d, rows_q, q_step, do_step, lse_step, delta_step, sm_scale, win_lo, win_hi,
    softcap,
    HEAD_DIM: tl.constexpr, ON_DIAGONAL: tl.constexpr, HAS_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, CHECK: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """dK, dV contributions of query blocks [lo, hi) of one head, where the blocks from
    ``gap_at`` on start ``gap`` rows later: two ranges in one loop (Note [Full blocks]). Key
    rows past the end are never stored and each key row's gradient depends on that row alone
    (Note [Rows past the end]), so only padding masks, the diagonal and the window mask scores
    here."""
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
        p_t, slope_t = _backward_probabilities(qk_t, lse[None, :], sm_scale, softcap, SOFTCAP)
        if HAS_MASK or ON_DIAGONAL or WINDOW:
            valid_t = keep[:, None]
            if ON_DIAGONAL or WINDOW:
                valid_t = valid_t & _visible(
                    offs_m[None, :], offs_n[:, None], win_lo, win_hi, ON_DIAGONAL, WINDOW
                )
            p_t = tl.where(valid_t, p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFTCAP:
            ds_t = ds_t * slope_t
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
    return dk, dv


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
    num_offsets, sm_scale, win_lo, win_hi, softcap,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, ACCUMULATE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WIDE: tl.constexpr, TABLE: tl.constexpr, WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr, TILES_OUTER: tl.constexpr,
):  # fmt: skip
    """dK, dV of one key tile of key/value head ``g`` at offset ``s``: every query head of ``g``
    with that offset contributes (heads ``g*G + j + t*r``)."""
    pid_n, pid = _tile_and_group(TILES_OUTER, False)  # Note [Heavy tiles first]
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
    lo, f0, f1, hi = _query_ranges(
        pid_n, rows_q, rows_k, win_lo, win_hi, CAUSAL, WINDOW, BLOCK_M, BLOCK_N
    )  # Note [Full blocks]
    args = (offs_n, offs_m0, offs_d, rows_q, _step(rate, stride_qn, WIDE),
            _step(rate, stride_dn, WIDE), _step(rate, stride_ln, WIDE),
            _step(rate, stride_en, WIDE), sm_scale, win_lo, win_hi, softcap)  # fmt: skip
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
            dk, dv, *ptrs, f0, f1, f1, 0, *args,
            HEAD_DIM, False, HAS_MASK, DOT_PRECISION, BLOCK_M, False, False, SOFTCAP,
        )  # fmt: skip
        # The checked blocks: [lo, f0) (across the diagonal, the window's edge), then [f1, hi)
        # (the window's other edge, the one cut by the end of the rows).
        dk, dv = _dkdv_blocks(
            dk, dv, *ptrs, lo, f0 + hi - f1, f0, f1 - f0, *args,
            HEAD_DIM, CAUSAL, HAS_MASK, DOT_PRECISION, BLOCK_M, True, WINDOW, SOFTCAP,
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
    sm_scale, win_lo, win_hi, softcap,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, ACCUMULATE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WIDE: tl.constexpr, TABLE: tl.constexpr, WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr, TILES_OUTER: tl.constexpr,
):  # fmt: skip
    """dQ of one query tile of head ``h``."""
    pid_m, pid_sh = _tile_and_group(TILES_OUTER, True)  # Note [Heavy tiles first]
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
            _step(rate, stride_vn, WIDE), _step(rate, stride_mn, WIDE), sm_scale, win_lo,
            win_hi, softcap)  # fmt: skip
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    f0, f1, lo, hi, gap_at, gap = _key_ranges(
        pid_m, rows_q, rows_k, win_lo, win_hi, CAUSAL, WINDOW, BLOCK_M, BLOCK_N
    )  # Note [Full blocks]
    dq = _dq_blocks(
        dq, q, do, lse, delta, k_ptr, v_ptr, mask_ptr, f0, f1, f1, 0, *args,
        HEAD_DIM, False, HAS_MASK, DOT_PRECISION, BLOCK_N, False, False, SOFTCAP,
    )  # fmt: skip
    dq = _dq_blocks(
        dq, q, do, lse, delta, k_ptr, v_ptr, mask_ptr, lo, hi, gap_at, gap, *args,
        HEAD_DIM, CAUSAL, HAS_MASK, DOT_PRECISION, BLOCK_N, True, WINDOW, SOFTCAP,
    )  # fmt: skip
    dq_ptr = _row0(DQ, b, stride_gb, h, stride_gh, base_q - grad_row0, stride_gn)
    _store_rows(dq_ptr, offs_m, _step(rate, stride_gn, WIDE), dq * sm_scale, q_ok, offs_d,
                HEAD_DIM, ACCUMULATE)  # fmt: skip
