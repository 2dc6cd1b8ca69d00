"""Triton kernels for block-sparse attention: only the kept (query block, key block) pairs.

Imported on first use (it needs the ``triton`` package); ``block_sparse.py`` drives it.

Note [Block-sparse Triton kernels]
    The block mask (causal already applied) becomes two sets of lists (:class:`BlockLists`): for
    every query block the key blocks it keeps, and for every key block the query blocks that keep
    it, each list a ``(start, count)`` into a flat array of block indices. A pattern's lists are
    one set in CSR form (``block_lists``, made on the host); a run-time mask's are one set per
    batch row and mask head (Note [Run-time block masks] in ``block_sparse/runtime.py``), rows of
    a padded array made on the device, query head ``h`` reading mask head ``h // list_group``
    (a size-1 batch or head dimension has stride 0). A forward program owns ``BLOCK_M`` query
    rows of one head and walks the key list of their block (of their batch row and head) in
    ``BLOCK_N``-row tiles with the online softmax, then writes its rows of ``out`` and ``lse``
    once. The backward is the FlashAttention-2 split: a dK/dV program owns ``BLOCK_N``
    key rows of one key/value head and walks, for every query head of its GQA group, the query
    blocks that keep its key block; a dQ program owns ``BLOCK_M`` query rows and walks the key
    list again. Every program writes its own rows once, so no output needs zero-filling and no
    atomics are used: an atomic dQ inside the dK/dV loop (five products instead of seven) was
    slower on an H100 than the separate dQ pass (25.7 against 21.8-22.6 ms at N = 65,536, 10%
    density; ``benchmarks/results/findings_h100.json``, "Block-sparse Triton backward").

    Tiles never straddle blocks, so ``block_size`` must be a multiple of the tile rows (64).
    Rows past the end of the query or key tensor load as zeros: the forward gives them ``-inf``
    scores; in the backward a zero key row adds nothing to dQ (``ds * k``) and its own dK/dV rows
    are never stored, and a zero query row has ``dout = 0`` and adds nothing to dK/dV (Note [Rows
    past the end] in ``triton_kernels/device.py``). Under the causal mask only the diagonal block's
    tiles need the ``q >= kv`` test, but it is applied to every tile of a causal call: cheaper
    than a branch in the pipelined loop. Exponents and NaN rows follow Note [Exponents at large
    logits] and Note [NaN through the kernels] in ``triton_kernels/device.py``, soft-capped scores
    (``SOFTCAP``) Note [Soft-capped scores in the kernels] there.

Shapes: q, dout, out, dq (B, Nq, H, D); k, v, dk, dv (B, Nk, Hkv, D); lse, delta (B, H, Nq)
float32, natural log.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .device import _backward_probabilities, _tanh
from .launch import launch
from .launchers import _block_d, dot_precision, row_delta
from .tiles import cdiv

LOG2E = 1.4426950408889634

#: Rows of every tile; ``block_size`` must be a multiple of it.
TILE_ROWS = 64


@dataclass(frozen=True)
class BlockLists:
    """The kept block pairs as lists per (batch row, mask head), on the kernels' device.

    Attributes:
        key_start, key_count: (Bl, Hl, Mq) int64 and int32: the key blocks of query block ``i``
            of batch row ``b`` and mask head ``g`` are ``key_blocks[s : s + c]`` with ``s =
            key_start[b, g, i]`` and ``c = key_count[b, g, i]``, ascending. ``Bl`` is 1 (every
            row) or B, ``Hl`` 1, Hkv or H (query head ``h`` reads mask head ``h // (H // Hl)``).
        key_blocks: flat int32.
        query_start, query_count, query_blocks: the query blocks that keep key block ``j``,
            likewise ((Bl, Hl, Mk)).
    """

    key_start: torch.Tensor
    key_count: torch.Tensor
    key_blocks: torch.Tensor
    query_start: torch.Tensor
    query_count: torch.Tensor
    query_blocks: torch.Tensor

    def layout(self, heads: int, *, by_key: bool = False) -> tuple[int, int, int]:
        """A kernel's ``(list_sb, list_sh, list_group)`` for the lists of query blocks (or,
        ``by_key``, of key blocks): the batch and head strides of their (Bl, Hl, M) starts and
        counts (0 for a size-1 dimension), and ``H // Hl``."""
        start, count = (self.query_start, self.query_count) if by_key else (
            self.key_start, self.key_count)  # fmt: skip
        if start.shape != count.shape or start.stride() != count.stride():
            raise RuntimeError(
                f"block-sparse Triton kernels: list starts {tuple(start.shape)} and counts "
                f"{tuple(count.shape)} must share shape and strides"
            )
        batch, list_heads, _ = start.shape
        sb = start.stride(0) if batch > 1 else 0
        return sb, (start.stride(1) if list_heads > 1 else 0), heads // list_heads


def _csr(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    count = mask.sum(1)
    start = torch.zeros(mask.shape[0], dtype=torch.int64)
    start[1:] = count.cumsum(0)[:-1]
    blocks = mask.nonzero()[:, 1].to(torch.int32)
    return start.view(1, 1, -1), count.to(torch.int32).view(1, 1, -1), blocks


def block_lists(mask: torch.Tensor, device: torch.device) -> BlockLists:
    """``BlockLists`` of a pattern's (query blocks, key blocks) bool mask (causal already
    applied), one set for every row and head, in CSR form."""
    lists = (*_csr(mask), *_csr(mask.t()))
    return BlockLists(*(t.to(device) for t in lists))


def padded_lists(
    forward: tuple[torch.Tensor, torch.Tensor], backward: tuple[torch.Tensor, torch.Tensor]
) -> BlockLists:
    """``BlockLists`` of a run-time mask's lists on the device, ``(count, index)`` per direction:
    counts (Bl, Hl, M) int32, indices (Bl, Hl, M, W) int32 contiguous (``compact_rows`` in
    ``block_sparse/runtime.py``); every row of indices starts ``W`` entries after the last."""
    lists: list[torch.Tensor] = []
    for count, index in (forward, backward):
        width = index.shape[-1]
        start = torch.arange(count.numel(), dtype=torch.int64, device=count.device) * width
        lists += [start.view(count.shape), count.contiguous(), index.flatten()]
    return BlockLists(*lists)


# -- device helpers --------------------------------------------------------------------------------
# Every tensor of the query side (q, dout, out, dq) shares one set of strides, and so does every
# tensor of the key side (k, v, dk, dv): a tile's 64-bit element offsets are formed once and
# serve both loads of a pair (k and v, q and dout), which measured 8-12% faster on an H100 than
# forming them per tensor.


@triton.jit
def _offsets(rows, stride_n, offs_d):
    """(len(rows), BLOCK_D) int64 element offsets of ``rows``."""
    return rows.to(tl.int64)[:, None] * stride_n + offs_d[None, :]


@triton.jit
def _tile(ptr, offsets, rows, limit, offs_d, HEAD_DIM: tl.constexpr, EVEN: tl.constexpr):
    """The tile at ``ptr + offsets``; rows at or past ``limit`` and columns past ``HEAD_DIM``
    read 0. ``EVEN``: every row and column exists (no mask)."""
    if EVEN:
        tile = tl.load(ptr + offsets)
    else:
        keep = (rows < limit)[:, None] & (offs_d < HEAD_DIM)[None, :]
        tile = tl.load(ptr + offsets, mask=keep, other=0.0)
    return tile


@triton.jit
def _store_tile(ptr, offsets, rows, limit, offs_d, value, HEAD_DIM: tl.constexpr,
                EVEN: tl.constexpr):  # fmt: skip
    value = value.to(ptr.dtype.element_ty)
    if EVEN:
        tl.store(ptr + offsets, value)
    else:
        keep = (rows < limit)[:, None] & (offs_d < HEAD_DIM)[None, :]
        tl.store(ptr + offsets, value, mask=keep)


@triton.jit
def _list_tiles(Start, Count, row, TILES: tl.constexpr):
    """``[lo, hi)``: the tiles of list ``row`` (an offset into the starts and counts), ``TILES``
    per listed block."""
    lo = tl.load(Start + row) * TILES
    return lo, lo + tl.load(Count + row) * TILES


@triton.jit
def _listed_rows(Blocks, t, offs0, BLOCK: tl.constexpr, TILES: tl.constexpr):
    """Rows of list tile ``t``: tile ``t % TILES`` of block ``Blocks[t // TILES]``."""
    return tl.load(Blocks + t // TILES) * BLOCK + (t % TILES) * offs0.shape[0] + offs0


@triton.jit
def _row_stats(lse_ptr, delta_ptr, rows, limit, EVEN: tl.constexpr):
    """``lse`` (``+inf`` for rows that see no key: their probabilities are 0) and ``delta`` of
    ``rows`` (0 past ``limit``)."""
    if EVEN:
        lse = tl.load(lse_ptr + rows)
        delta = tl.load(delta_ptr + rows)
    else:
        lse = tl.load(lse_ptr + rows, mask=rows < limit, other=0.0)
        delta = tl.load(delta_ptr + rows, mask=rows < limit, other=0.0)
    return tl.where(lse == float("-inf"), float("inf"), lse), delta


# -- kernels (Note [Block-sparse Triton kernels]) ------------------------------------------------
# Strides: ``stride_q*`` of every query-side tensor, ``stride_k*`` of every key-side tensor,
# ``stride_l*`` of lse and delta (B, H, Nq).
@triton.jit
def _forward_kernel(
    Q, K, V, Out, Lse, KeyStart, KeyCount, KeyBlocks,
    stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh, stride_lb, stride_lh,
    list_sb, list_sh, list_group, query_len, key_len, kv_group, qk_scale, scale, cap_in, softcap,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, EVEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Out and lse of ``BLOCK_M`` query rows of one head (with ``SOFTCAP``: ``qk_scale`` is
    log2(e), ``scale`` 1 and ``cap_in`` the scale over the cap)."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    m0 = pid_m * BLOCK_M
    TILES: tl.constexpr = BLOCK // BLOCK_N
    row = b * list_sb + (h // list_group) * list_sh + m0 // BLOCK
    lo, hi = _list_tiles(KeyStart, KeyCount, row, TILES)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_row0 = b * stride_qb + h * stride_qh
    q_offsets = _offsets(offs_m, stride_qn, offs_d)
    q = _tile(Q + q_row0, q_offsets, offs_m, query_len, offs_d, HEAD_DIM, EVEN)
    kv_row0 = b * stride_kb + (h // kv_group) * stride_kh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for t in range(lo, hi):
        offs_n = _listed_rows(KeyBlocks, t, offs_n0, BLOCK, TILES)
        kv_offsets = _offsets(offs_n, stride_kn, offs_d)
        k = _tile(K + kv_row0, kv_offsets, offs_n, key_len, offs_d, HEAD_DIM, EVEN)
        v = _tile(V + kv_row0, kv_offsets, offs_n, key_len, offs_d, HEAD_DIM, EVEN)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if SOFTCAP:  # before the masks
            qk = softcap * _tanh(qk * cap_in)
        if CAUSAL or not EVEN:
            valid = (offs_n < key_len)[None, :]
            if CAUSAL:
                valid = valid & (offs_m[:, None] >= offs_n[None, :])
            qk = tl.where(valid, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))  # unscaled scores
        m_safe = m_new
        if CAUSAL or not EVEN:  # a row may have seen no key yet
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2((qk - m_safe[:, None]) * qk_scale)
        alpha = tl.exp2((m_i - m_safe) * qk_scale)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    empty = l_i == 0.0  # NaN rows are not empty: their out and lse stay NaN
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), m_i * scale + tl.log(l_safe))
    _store_tile(Out + q_row0, q_offsets, offs_m, query_len, offs_d, out, HEAD_DIM, EVEN)
    lse_ptrs = Lse + b * stride_lb + h * stride_lh + offs_m
    if EVEN:
        tl.store(lse_ptrs, lse)
    else:
        tl.store(lse_ptrs, lse, mask=offs_m < query_len)


@triton.jit
def _dkdv_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV, QueryStart, QueryCount, QueryBlocks,
    stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh, stride_lb, stride_lh,
    list_sb, list_sh, list_group, query_len, key_len, kv_group, scale, softcap,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, EVEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):  # fmt: skip
    """dK and dV of ``BLOCK_N`` key rows of one key/value head."""
    pid_n = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    n0 = pid_n * BLOCK_N
    TILES: tl.constexpr = BLOCK // BLOCK_M
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    kv_row0 = b * stride_kb + kvh * stride_kh
    kv_offsets = _offsets(offs_n, stride_kn, offs_d)
    k = _tile(K + kv_row0, kv_offsets, offs_n, key_len, offs_d, HEAD_DIM, EVEN)
    v = _tile(V + kv_row0, kv_offsets, offs_n, key_len, offs_d, HEAD_DIM, EVEN)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for g in range(0, kv_group):
        h = kvh * kv_group + g
        row = b * list_sb + (h // list_group) * list_sh + n0 // BLOCK
        lo, hi = _list_tiles(QueryStart, QueryCount, row, TILES)
        q_row0 = b * stride_qb + h * stride_qh
        stats_row0 = b * stride_lb + h * stride_lh
        for t in range(lo, hi):
            offs_m = _listed_rows(QueryBlocks, t, offs_m0, BLOCK, TILES)
            q_offsets = _offsets(offs_m, stride_qn, offs_d)
            q = _tile(Q + q_row0, q_offsets, offs_m, query_len, offs_d, HEAD_DIM, EVEN)
            do = _tile(DO + q_row0, q_offsets, offs_m, query_len, offs_d, HEAD_DIM, EVEN)
            lse, delta = _row_stats(Lse + stats_row0, Delta + stats_row0, offs_m, query_len, EVEN)
            qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
            p_t, slope_t = _backward_probabilities(qk_t, lse[None, :], scale, softcap, SOFTCAP)
            if CAUSAL:
                p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
            ds_t = p_t * (dp_t - delta[None, :])
            if SOFTCAP:
                ds_t = ds_t * slope_t
            dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
    _store_tile(DK + kv_row0, kv_offsets, offs_n, key_len, offs_d, dk * scale, HEAD_DIM, EVEN)
    _store_tile(DV + kv_row0, kv_offsets, offs_n, key_len, offs_d, dv, HEAD_DIM, EVEN)


@triton.jit
def _dq_kernel(
    Q, K, V, DO, Lse, Delta, DQ, KeyStart, KeyCount, KeyBlocks,
    stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh, stride_lb, stride_lh,
    list_sb, list_sh, list_group, query_len, key_len, kv_group, scale, softcap,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, EVEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):  # fmt: skip
    """dQ of ``BLOCK_M`` query rows of one head."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    m0 = pid_m * BLOCK_M
    TILES: tl.constexpr = BLOCK // BLOCK_N
    row = b * list_sb + (h // list_group) * list_sh + m0 // BLOCK
    lo, hi = _list_tiles(KeyStart, KeyCount, row, TILES)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_row0 = b * stride_qb + h * stride_qh
    q_offsets = _offsets(offs_m, stride_qn, offs_d)
    q = _tile(Q + q_row0, q_offsets, offs_m, query_len, offs_d, HEAD_DIM, EVEN)
    do = _tile(DO + q_row0, q_offsets, offs_m, query_len, offs_d, HEAD_DIM, EVEN)
    stats_row0 = b * stride_lb + h * stride_lh
    lse, delta = _row_stats(Lse + stats_row0, Delta + stats_row0, offs_m, query_len, EVEN)
    kv_row0 = b * stride_kb + (h // kv_group) * stride_kh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for t in range(lo, hi):
        offs_n = _listed_rows(KeyBlocks, t, offs_n0, BLOCK, TILES)
        kv_offsets = _offsets(offs_n, stride_kn, offs_d)
        k = _tile(K + kv_row0, kv_offsets, offs_n, key_len, offs_d, HEAD_DIM, EVEN)
        v = _tile(V + kv_row0, kv_offsets, offs_n, key_len, offs_d, HEAD_DIM, EVEN)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        p, slope = _backward_probabilities(qk, lse[:, None], scale, softcap, SOFTCAP)
        if CAUSAL:
            p = tl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * slope
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    _store_tile(DQ + q_row0, q_offsets, offs_m, query_len, offs_d, dq * scale, HEAD_DIM, EVEN)


# -- launchers -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Tiles:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def _tiles(block_size: int) -> dict[str, _Tiles]:
    """Tiles per kernel, from the block-sparse Triton tile sweeps in
    ``benchmarks/results/findings_h100.json`` (H100, N = 65,536, H = 16, D = 128, bf16, random
    10% block mask of 128-token blocks): forward 128 x 64 with 4 warps and 3 stages 7.2 ms
    against 8.0-12.7 ms for the other tiles and for tensor-descriptor loads; dK/dV 64 x 64 with 4
    warps 12.6 ms (14.0-83 ms); dQ 64 x 64 with 4 warps 10.0 ms (10.3-13.4 ms with pointer
    loads)."""
    forward_rows = 128 if block_size % 128 == 0 else TILE_ROWS
    return {
        "forward": _Tiles(forward_rows, 64, 4, 3),
        "dkdv": _Tiles(64, 64, 4, 3),
        "dq": _Tiles(64, 64, 4, 3),
    }


def _even(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether every tile row and column exists (no masked loads or stores)."""
    dim = q.shape[-1]
    return q.shape[1] % 128 == 0 and k.shape[1] % 128 == 0 and dim == _block_d(dim)


def _strides(first: torch.Tensor, *others: torch.Tensor) -> tuple[int, int, int]:
    """The (batch, row, head) strides that ``first`` and ``others`` share (contiguous tensors of
    one shape; a dim of size 1 may carry any stride, as it is only ever indexed at 0)."""
    for x in others:
        for size, a, b in zip(first.shape[:3], first.stride()[:3], x.stride()[:3], strict=True):
            if size > 1 and a != b:
                raise RuntimeError(
                    f"block-sparse Triton kernels: strides {first.stride()} and {x.stride()} differ"
                )
    return first.stride(0), first.stride(1), first.stride(2)


def _forward_scales(scale: float, softcap: float | None) -> tuple[float, float, float, float]:
    """``(qk_scale, scale, cap_in, softcap)`` of the forward kernel: with a cap, the capped
    scores are scaled already (Note [Soft-capped scores in the kernels])."""
    if softcap is None:
        return scale * LOG2E, scale, 1.0, 1.0
    return LOG2E, 1.0, scale / softcap, softcap


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lists: BlockLists,
    *,
    block_size: int,
    is_causal: bool,
    scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention forward: ``out`` (B, Nq, H, D) in q's dtype, ``lse`` (B, H, Nq)
    float32 (``-inf`` for rows that see no key, whose ``out`` is 0). Inputs contiguous;
    ``softcap``: the scores soft-capped (Note [Scores a kernel call transforms]), or None."""
    batch, query_len, heads, dim = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, query_len, dtype=torch.float32, device=q.device)
    tiles = _tiles(block_size)["forward"]
    grid = (cdiv(query_len, tiles.block_m), heads, batch)
    launch(_forward_kernel, grid, (
        q, k, v, out, lse, lists.key_start, lists.key_count, lists.key_blocks,
        *_strides(q, out), *_strides(k, v), lse.stride(0), lse.stride(1), *lists.layout(heads),
        query_len, k.shape[1], heads // k.shape[2], *_forward_scales(scale, softcap),
    ), dict(
        BLOCK=block_size, HEAD_DIM=dim, BLOCK_D=_block_d(dim), BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, CAUSAL=is_causal, EVEN=_even(q, k),
        DOT_PRECISION=dot_precision(q), SOFTCAP=softcap is not None, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    ))  # fmt: skip
    return out, lse


def backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    lists: BlockLists,
    *,
    block_size: int,
    is_causal: bool,
    scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact gradients ``(dq, dk, dv)`` in the inputs' dtypes from the forward's ``out`` and
    ``lse`` (B, H, Nq). Inputs contiguous; ``softcap`` as in :func:`forward`."""
    batch, query_len, heads, dim = q.shape
    key_len, kv_heads = k.shape[1], k.shape[2]
    delta = row_delta(out, dout, 0, query_len)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    tiles = _tiles(block_size)
    common = dict(
        BLOCK=block_size, HEAD_DIM=dim, BLOCK_D=_block_d(dim), CAUSAL=is_causal,
        EVEN=_even(q, k), DOT_PRECISION=dot_precision(q), SOFTCAP=softcap is not None,
    )  # fmt: skip
    args = (*_strides(q, dout, dq), *_strides(k, v, dk, dv), *_strides(lse, delta)[:2])
    sizes = (query_len, key_len, heads // kv_heads, scale, 1.0 if softcap is None else softcap)
    config = tiles["dkdv"]
    launch(_dkdv_kernel, (cdiv(key_len, config.block_n), kv_heads, batch), (
        q, k, v, dout, lse, delta, dk, dv, lists.query_start, lists.query_count,
        lists.query_blocks, *args, *lists.layout(heads, by_key=True), *sizes,
    ), dict(
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, num_warps=config.num_warps,
        num_stages=config.num_stages, **common,
    ))  # fmt: skip
    config = tiles["dq"]
    launch(_dq_kernel, (cdiv(query_len, config.block_m), heads, batch), (
        q, k, v, dout, lse, delta, dq, lists.key_start, lists.key_count, lists.key_blocks,
        *args, *lists.layout(heads), *sizes,
    ), dict(
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, num_warps=config.num_warps,
        num_stages=config.num_stages, **common,
    ))  # fmt: skip
    return dq, dk, dv
