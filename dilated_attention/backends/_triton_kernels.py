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
    row indices, which within one offset class order like positions.

    The forward keeps FlashAttention's running (max, sum, acc) in log2 units and, with ``MERGE``,
    folds its result into the ``(out, lse)`` already stored for those rows (Note [Merging partial
    softmaxes]) in float32: branches run one launch after another, and rows of one launch belong
    to one program, so the read-modify-write needs no atomics. The backward kernels take the
    *merged* ``lse`` and ``delta = rowsum(dout * out)`` (Note [Exact gradients through the branch
    mix]); the dK/dV program of a key tile loops over every query head of its key/value head that
    has the same offset, so its rows are written by it alone, and ``ACCUMULATE`` adds into float32
    gradient buffers shared by the branches.

Rectangular dense calls (one segment, ``r = 1``, different query and key lengths) use the same
kernels with separate query and key segment lengths.

Shape legend: B batch, N positions, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class Branch:
    """One launch's geometry: segments of ``seg_q`` query / ``seg_k`` key positions at stride
    ``rate``, the first starting at ``start``; query positions end at ``end_q``, keys at ``end_k``
    (the last segment is clipped there).
    """

    start: int
    seg_q: int
    seg_k: int
    end_q: int
    end_k: int
    rate: int

    @property
    def num_segments(self) -> int:
        return triton.cdiv(self.end_q - self.start, self.seg_q)

    @property
    def max_rows_q(self) -> int:
        return triton.cdiv(min(self.seg_q, self.end_q - self.start), self.rate)

    @property
    def max_rows_k(self) -> int:
        return triton.cdiv(min(self.seg_k, self.end_k - self.start), self.rate)


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes and launch options of one kernel."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# -- device helpers --------------------------------------------------------------------------------
@triton.jit
def _segment_rows(
    pid_seg, h, start, seg_q, seg_k, end_q, end_k, rate,
):  # fmt: skip
    """First query/key position of head ``h``'s rows in segment ``pid_seg``, and row counts."""
    seg_start_q = start + pid_seg * seg_q
    seg_start_k = start + pid_seg * seg_k
    len_q = tl.minimum(seg_q, end_q - seg_start_q)
    len_k = tl.minimum(seg_k, end_k - seg_start_k)
    s = h % rate
    rows_q = tl.maximum(len_q - s + rate - 1, 0) // rate
    rows_k = tl.maximum(len_k - s + rate - 1, 0) // rate
    return seg_start_q + s, seg_start_k + s, rows_q, rows_k


@triton.jit
def _load_rows(ptr, pos, row_ok, offs_d, HEAD_DIM: tl.constexpr, stride_n):
    """(len(pos), BLOCK_D) tile of rows at positions ``pos`` (zeros where masked)."""
    mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    return tl.load(ptr + pos[:, None] * stride_n + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def _valid_pairs(
    offs_m, offs_n, rows_q, rows_k, mask_ptr, k_pos, stride_mn,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
):  # fmt: skip
    """(BLOCK_M, BLOCK_N) bool: the query row may attend the key row."""
    valid = (offs_m < rows_q)[:, None] & (offs_n < rows_k)[None, :]
    if CAUSAL:
        valid = valid & (offs_m[:, None] >= offs_n[None, :])
    if HAS_MASK:
        ignore = tl.load(mask_ptr + k_pos * stride_mn, mask=offs_n < rows_k, other=1)
        valid = valid & (ignore == 0)[None, :]
    return valid


@triton.jit
def _valid_pairs_t(offs_m, offs_n, rows_q, keep_k, CAUSAL: tl.constexpr):
    """(BLOCK_N, BLOCK_M) bool, transposed :func:`_valid_pairs` with the key mask pre-loaded."""
    valid = keep_k[:, None] & (offs_m < rows_q)[None, :]
    if CAUSAL:
        valid = valid & (offs_m[None, :] >= offs_n[:, None])
    return valid


# -- forward ---------------------------------------------------------------------------------------
@triton.jit
def _forward_kernel(
    Q, K, V, Out, Lse, Mask,
    stride_qb, stride_qn, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_on, stride_oh,
    stride_lb, stride_lh, stride_ln,
    stride_mb, stride_mh, stride_mn,
    out_row0, start, seg_q, seg_k, end_q, end_k, rate, num_heads, kv_group, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, MERGE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_sh = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    h = pid_sh % num_heads
    base_q, base_k, rows_q, rows_k = _segment_rows(
        pid_sh // num_heads, h, start, seg_q, seg_k, end_q, end_k, rate
    )
    if pid_m * BLOCK_M >= rows_q:
        return
    kvh = h // kv_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_pos = (base_q + offs_m * rate).to(tl.int64)
    q = _load_rows(Q + b * stride_qb + h * stride_qh, q_pos, offs_m < rows_q, offs_d, HEAD_DIM, stride_qn)
    k_ptr = K + b * stride_kb + kvh * stride_kh
    v_ptr = V + b * stride_vb + kvh * stride_vh
    mask_ptr = Mask + b * stride_mb + h * stride_mh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    hi = rows_k
    if CAUSAL:
        hi = tl.minimum(rows_k, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        k_pos = (base_k + offs_n * rate).to(tl.int64)
        k_ok = offs_n < rows_k
        k = _load_rows(k_ptr, k_pos, k_ok, offs_d, HEAD_DIM, stride_kn)
        v = _load_rows(v_ptr, k_pos, k_ok, offs_d, HEAD_DIM, stride_vn)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        valid = _valid_pairs(offs_m, offs_n, rows_q, rows_k, mask_ptr, k_pos, stride_mn, CAUSAL, HAS_MASK)
        qk = tl.where(valid, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
    row_ok = offs_m < rows_q
    out_ptrs = Out + b * stride_ob + h * stride_oh + (q_pos - out_row0)[:, None] * stride_on + offs_d[None, :]
    lse_ptrs = Lse + b * stride_lb + h * stride_lh + q_pos * stride_ln
    out_mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    if MERGE:
        old_lse = tl.load(lse_ptrs, mask=row_ok, other=float("-inf"))
        old_o = tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32)
        top = tl.maximum(old_lse, lse)
        top_safe = tl.where(top == float("-inf"), 0.0, top)
        w_old = tl.exp(old_lse - top_safe)
        w_new = tl.exp(lse - top_safe)
        total = w_old + w_new
        merged_lse = tl.where(total > 0.0, top_safe + tl.log(tl.where(total > 0.0, total, 1.0)), float("-inf"))
        inv = 1.0 / tl.where(total > 0.0, total, 1.0)
        o = old_o * (w_old * inv)[:, None] + o * (w_new * inv)[:, None]
        lse = merged_lse
    tl.store(out_ptrs, o.to(Out.dtype.element_ty), mask=out_mask)
    tl.store(lse_ptrs, lse, mask=row_ok)


# -- backward --------------------------------------------------------------------------------------
@triton.jit
def _delta_kernel(
    Out, DO, Delta,
    stride_ob, stride_on, stride_oh,
    stride_db, stride_dn, stride_dh,
    stride_eb, stride_eh, stride_en,
    start, end, num_heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """``delta[b, h, n - start] = sum_d out[b, n, h, d] * dout[b, n, h, d]`` for n in [start, end)."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    pos = (start + offs_m).to(tl.int64)
    ok = pos < end
    o = _load_rows(Out + b * stride_ob + h * stride_oh, pos, ok, offs_d, HEAD_DIM, stride_on)
    do = _load_rows(DO + b * stride_db + h * stride_dh, pos, ok, offs_d, HEAD_DIM, stride_dn)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + b * stride_eb + h * stride_eh + offs_m * stride_en, delta, mask=ok)


@triton.jit
def _store_grad(ptrs, value, mask, ACCUMULATE: tl.constexpr):
    if ACCUMULATE:
        value += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, value.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _dkdv_kernel(
    Q, K, V, DO, Lse, Delta, Mask, DK, DV,
    stride_qb, stride_qn, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_db, stride_dn, stride_dh,
    stride_lb, stride_lh, stride_ln,
    stride_eb, stride_eh, stride_en,
    stride_mb, stride_mh, stride_mn,
    stride_gb, stride_gn, stride_gh,
    delta_row0, grad_row0, start, seg_q, seg_k, end_q, end_k, rate, num_kv_heads, kv_group,
    num_offsets, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, ACCUMULATE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
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
        pid // (num_offsets * num_kv_heads), h0, start, seg_q, seg_k, end_q, end_k, rate
    )
    if pid_n * BLOCK_N >= rows_k:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    k_pos = (base_k + offs_n * rate).to(tl.int64)
    k_ok = offs_n < rows_k
    k = _load_rows(K + b * stride_kb + g * stride_kh, k_pos, k_ok, offs_d, HEAD_DIM, stride_kn)
    v = _load_rows(V + b * stride_vb + g * stride_vh, k_pos, k_ok, offs_d, HEAD_DIM, stride_vn)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    lo = 0
    if CAUSAL:
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
    for h in range(h0, (g + 1) * kv_group, rate):
        q_ptr = Q + b * stride_qb + h * stride_qh
        do_ptr = DO + b * stride_db + h * stride_dh
        lse_ptr = Lse + b * stride_lb + h * stride_lh
        delta_ptr = Delta + b * stride_eb + h * stride_eh
        keep_t = k_ok
        if HAS_MASK:
            ignore = tl.load(Mask + b * stride_mb + h * stride_mh + k_pos * stride_mn, mask=k_ok, other=1)
            keep_t = k_ok & (ignore == 0)
        for start_m in range(lo, rows_q, BLOCK_M):
            offs_m = start_m + offs_m0
            q_pos = (base_q + offs_m * rate).to(tl.int64)
            q_ok = offs_m < rows_q
            q = _load_rows(q_ptr, q_pos, q_ok, offs_d, HEAD_DIM, stride_qn)
            do = _load_rows(do_ptr, q_pos, q_ok, offs_d, HEAD_DIM, stride_dn)
            lse = tl.load(lse_ptr + q_pos * stride_ln, mask=q_ok, other=0.0)
            lse = tl.where(lse == float("-inf"), 0.0, lse) * 1.4426950408889634
            delta = tl.load(delta_ptr + (q_pos - delta_row0) * stride_en, mask=q_ok, other=0.0)
            valid_t = _valid_pairs_t(offs_m, offs_n, rows_q, keep_t, CAUSAL)
            qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale
            p_t = tl.where(valid_t, tl.exp2(qk_t - lse[None, :]), 0.0)
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
    grad_mask = k_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    grad_off = b * stride_gb + g * stride_gh + (k_pos - grad_row0)[:, None] * stride_gn + offs_d[None, :]
    _store_grad(DK + grad_off, dk * sm_scale, grad_mask, ACCUMULATE)
    _store_grad(DV + grad_off, dv, grad_mask, ACCUMULATE)


@triton.jit
def _dq_kernel(
    Q, K, V, DO, Lse, Delta, Mask, DQ,
    stride_qb, stride_qn, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_db, stride_dn, stride_dh,
    stride_lb, stride_lh, stride_ln,
    stride_eb, stride_eh, stride_en,
    stride_mb, stride_mh, stride_mn,
    stride_gb, stride_gn, stride_gh,
    delta_row0, grad_row0, start, seg_q, seg_k, end_q, end_k, rate, num_heads, kv_group,
    qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, ACCUMULATE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """dQ of one query tile of head ``h``."""
    pid_m = tl.program_id(0)
    pid_sh = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    h = pid_sh % num_heads
    base_q, base_k, rows_q, rows_k = _segment_rows(
        pid_sh // num_heads, h, start, seg_q, seg_k, end_q, end_k, rate
    )
    if pid_m * BLOCK_M >= rows_q:
        return
    kvh = h // kv_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_pos = (base_q + offs_m * rate).to(tl.int64)
    q_ok = offs_m < rows_q
    q = _load_rows(Q + b * stride_qb + h * stride_qh, q_pos, q_ok, offs_d, HEAD_DIM, stride_qn)
    do = _load_rows(DO + b * stride_db + h * stride_dh, q_pos, q_ok, offs_d, HEAD_DIM, stride_dn)
    lse = tl.load(Lse + b * stride_lb + h * stride_lh + q_pos * stride_ln, mask=q_ok, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse) * 1.4426950408889634
    delta = tl.load(Delta + b * stride_eb + h * stride_eh + (q_pos - delta_row0) * stride_en, mask=q_ok, other=0.0)
    k_ptr = K + b * stride_kb + kvh * stride_kh
    v_ptr = V + b * stride_vb + kvh * stride_vh
    mask_ptr = Mask + b * stride_mb + h * stride_mh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    hi = rows_k
    if CAUSAL:
        hi = tl.minimum(rows_k, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        k_pos = (base_k + offs_n * rate).to(tl.int64)
        k_ok = offs_n < rows_k
        k = _load_rows(k_ptr, k_pos, k_ok, offs_d, HEAD_DIM, stride_kn)
        v = _load_rows(v_ptr, k_pos, k_ok, offs_d, HEAD_DIM, stride_vn)
        valid = _valid_pairs(offs_m, offs_n, rows_q, rows_k, mask_ptr, k_pos, stride_mn, CAUSAL, HAS_MASK)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        p = tl.where(valid, tl.exp2(qk - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    grad_mask = q_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    grad_off = b * stride_gb + h * stride_gh + (q_pos - grad_row0)[:, None] * stride_gn + offs_d[None, :]
    _store_grad(DQ + grad_off, dq * sm_scale, grad_mask, ACCUMULATE)


# -- launchers -------------------------------------------------------------------------------------
_DOT_PRECISION = {torch.float32: "ieee", torch.float16: "tf32", torch.bfloat16: "tf32"}


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _mask_args(key_mask: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """``(tensor, stride_b, stride_h, stride_n)`` of a (B, Hm, N) bool mask (Hm in {1, H})."""
    if key_mask is None:
        return like, 0, 0, 0
    mask = key_mask.view(torch.uint8)
    stride_h = 0 if mask.shape[1] == 1 else mask.stride(1)
    return mask, mask.stride(0), stride_h, mask.stride(2)


def _bnh(x: torch.Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


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
) -> None:
    """One branch's forward, written (or with ``merge``, merged) into ``out`` and ``lse``.

    Args:
        q: (B, Nq, H, D); k, v: (B, Nk, Hkv, D); any strides with stride(-1) == 1.
        out: (B, rows, H, D), row ``p - out_row0`` for query position ``p``.
        lse: (B, H, Nq) float32, natural log.
        key_mask: (B, Hm, Nk) bool, ``True`` = ignore, or None.
    """
    batch, _, heads, dim = q.shape
    mask, smb, smh, smn = _mask_args(key_mask, q)
    grid = (triton.cdiv(branch.max_rows_q, config.block_m), branch.num_segments * heads, batch)
    _forward_kernel[grid](
        q, k, v, out, lse, mask,
        *_bnh(q), *_bnh(k), *_bnh(v), *_bnh(out), lse.stride(0), lse.stride(1), lse.stride(2),
        smb, smh, smn,
        out_row0, branch.start, branch.seg_q, branch.seg_k, branch.end_q, branch.end_k,
        branch.rate, heads, heads // k.shape[2], scale * LOG2E,
        HEAD_DIM=dim, BLOCK_D=_block_d(dim), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        CAUSAL=is_causal, HAS_MASK=key_mask is not None, MERGE=merge,
        DOT_PRECISION=_DOT_PRECISION[q.dtype],
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip


def row_delta(out: torch.Tensor, dout: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """``rowsum(out * dout)`` for positions [start, end): (B, H, end - start) float32."""
    batch, _, heads, dim = out.shape
    delta = torch.empty(batch, heads, end - start, dtype=torch.float32, device=out.device)
    block = 64
    grid = (triton.cdiv(end - start, block), heads, batch)
    _delta_kernel[grid](
        out, dout, delta, *_bnh(out), *_bnh(dout), *delta.stride(), start, end, heads,
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
) -> None:
    """One branch's gradients, written (or with ``accumulate``, added) into dq, dk, dv.

    Args:
        dout, q: (B, Nq, H, D); k, v: (B, Nk, Hkv, D).
        lse: (B, H, Nq) merged log-sum-exp; delta: (B, H, rows), row ``p - delta_row0``.
        dq: (B, rows, H, D); dk, dv: (B, rows, Hkv, D); row ``p - grad_row0`` for position ``p``.
    """
    batch, _, heads, dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    offsets = min(group, branch.rate)
    mask, smb, smh, smn = _mask_args(key_mask, q)
    common = (
        *_bnh(q), *_bnh(k), *_bnh(v), *_bnh(dout), *lse.stride(), *delta.stride(), smb, smh, smn,
    )  # fmt: skip
    geometry = (branch.start, branch.seg_q, branch.seg_k, branch.end_q, branch.end_k, branch.rate)
    flags = {
        "HEAD_DIM": dim, "BLOCK_D": _block_d(dim), "CAUSAL": is_causal,
        "HAS_MASK": key_mask is not None, "ACCUMULATE": accumulate,
        "DOT_PRECISION": _DOT_PRECISION[q.dtype],
    }  # fmt: skip
    grid = (
        triton.cdiv(branch.max_rows_k, config_dkdv.block_n),
        branch.num_segments * kv_heads * offsets,
        batch,
    )
    _dkdv_kernel[grid](
        q, k, v, dout, lse, delta, mask, dk, dv, *common, *_bnh(dk),
        delta_row0, grad_row0, *geometry, kv_heads, group, offsets, scale * LOG2E, scale,
        BLOCK_M=config_dkdv.block_m, BLOCK_N=config_dkdv.block_n,
        num_warps=config_dkdv.num_warps, num_stages=config_dkdv.num_stages, **flags,
    )  # fmt: skip
    grid = (triton.cdiv(branch.max_rows_q, config_dq.block_m), branch.num_segments * heads, batch)
    _dq_kernel[grid](
        q, k, v, dout, lse, delta, mask, dq, *common, *_bnh(dq),
        delta_row0, grad_row0, *geometry, heads, group, scale * LOG2E, scale,
        BLOCK_M=config_dq.block_m, BLOCK_N=config_dq.block_n,
        num_warps=config_dq.num_warps, num_stages=config_dq.num_stages, **flags,
    )  # fmt: skip
