"""Our Triton kernel of the static decode step: one token per batch row reads its keys in place
from a static cache's buffers, every branch in one launch (imported on first use, because it
needs the ``triton`` package).

Note [A decode kernel reading the buffers in place]
    The static step (Note [A decode step with static shapes] in ``core/decoding/static_cache.py``)
    reads, per batch row, the slots of every branch: slot ``m`` of branch ``(w, r)`` is key position
    ``t0 + s + r * m`` with ``t0 = (p // w) * w`` and ``s = (p - t0) mod r`` for the row's
    position ``p``, at buffer row ``position mod R``. The key rows of a slot are the same for
    every head; which heads read it is not (``h mod r == s``). So a program takes one batch row,
    one key/value head and a run of slots: it computes the slots' buffer rows from ``p`` (read
    from the positions tensor, so a captured launch serves every position), loads each key and
    value row once for the query heads that share it (GQA), and only where one of them reads it
    (a branch of rate r is read by the heads of one offset class: 1 in r), masks the heads that
    do not read it and the slots past the token, and keeps an online softmax per head. A
    block of slots none of the program's heads reads (most blocks of a branch of high rate)
    is skipped whole, loads and arithmetic (without the skip an H100 ran the step up to 1.9x
    slower where every branch reads nearly its whole segment, 2-6x where few rows are read).
    No gather: each key row crosses memory at most once per key/value head. The slots are
    split into runs across programs (a token is a few thousand rows, too few for one program
    each per head), and the runs merge with :func:`~._triton_merge.merge_splits` into the
    output and its log-sum-exp. One softmax over every branch's slots is the branches' exact
    merge (Note [One call per decoded token] in ``core/decoding/decode.py``). Soft-capped scores
    (``SOFTCAP``) are capped before the heads' masks (Note [Soft-capped scores in the kernels]
    in ``triton_kernels/device.py``); attention sinks join the merge as one more run whose output is
    0 and whose log-sum-exp is the head's sink, which is exactly how a sink joins a call's result
    (Note [Local windows, soft-capping and sinks] in ``core/sinks.py``).

Shapes: q (B, 1, H, D); key/value buffers (B, R, Hkv, D), last dim contiguous; mask (B, R) bool;
positions and row offsets (B,) int64; slot tables (K,) int64; out (B, 1, H, D); lse (B, H, 1)
float32.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .device import _tanh
from .merge import merge_splits
from .tiles import cdiv, next_power_of_2

_LOG2E = 1.4426950408889634
#: The bytes of one key (or value) tile of a program's loop (its slots per block follow from the
#: head dim and dtype; a larger tile leaves the two tiles' stages past the shared memory); the
#: programs a step aims for per streaming multiprocessor (over all batch rows and key/value
#: heads: a short batch splits each row's slots into more runs, so that enough loads are in
#: flight to reach the memory's bandwidth); the runs per row and key/value head where the device
#: does not say its multiprocessors. Measured on an H100 (bf16, D = 128, the LongNet schedule's
#: 10,240 slots, rows just before a multiple of every segment length, where every branch reads
#: nearly its whole segment): 128 slots a block and 16 programs per multiprocessor came within
#: 1.04x of the fastest of 60 tilings at every batch (1, 2, 8), context (16K-1M) and key/value
#: head count (16, 4) tried.
_TILE_BYTES = 32 * 1024
_PROGRAMS_PER_SM = 16
_DEFAULT_RUNS = 16


@triton.jit
def _slots_read(Seg, Rate, Stride, j, hi, p, heads, head_ok):
    """Slots ``j`` (below ``hi``) for a token at position ``p``: each slot's key position
    ``t0 + s + r * m``, whether it is filled (at or before ``p``), and which of ``heads`` read
    it ((G, K): ``h mod r == s``, ``head_ok``)."""
    j_ok = j < hi
    w = tl.load(Seg + j, mask=j_ok, other=1)
    r = tl.load(Rate + j, mask=j_ok, other=1).to(tl.int32)
    step = tl.load(Stride + j, mask=j_ok, other=0).to(tl.int32)
    t0 = (p // w) * w
    offset = (p - t0).to(tl.int32)  # < w: 32-bit from here on (64-bit modulo is slow)
    s = offset % r
    filled = (step <= offset - s) & j_ok
    reads = filled[None, :] & ((heads[:, None] % r[None, :]) == s[None, :]) & head_ok[:, None]
    return t0 + s + step, filled, reads


@triton.jit
def _decode_kernel(
    Q, K, V, Mask, Pos, Off, Seg, Rate, Stride, Part, PartLse,
    num_slots, ring_rows, kv_heads, group, dim, slots_per_run, scale, cap_in, cap_out,
    s_qb, s_qh,
    s_kb, s_kr, s_kh,
    s_vb, s_vr, s_vh,
    s_mb,
    s_pb, s_ps, s_ph,
    s_lb, s_lh, s_ls,
    HAS_MASK: tl.constexpr, HAS_SHIFT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Program (b * Hkv + kv head, run): the run's slots for the query heads of one key/value
    head of batch row b, into split ``run`` of ``Part`` / ``PartLse``. Scores in log2 units:
    ``scale`` is the softmax scale times log2(e); with ``SOFTCAP`` each score is ``cap_out *
    tanh(dot * cap_in)`` (``cap_in`` the scale over the cap, ``cap_out`` the cap times
    log2(e))."""
    pid = tl.program_id(0)
    run = tl.program_id(1)
    b = (pid // kv_heads).to(tl.int64)
    kvh = pid % kv_heads
    g = tl.arange(0, BLOCK_G)
    heads = kvh * group + g
    head_ok = g < group
    d = tl.arange(0, BLOCK_D)
    d_ok = d < dim
    q = tl.load(
        Q + b * s_qb + heads[:, None] * s_qh + d[None, :],
        mask=head_ok[:, None] & d_ok[None, :], other=0.0,
    )  # fmt: skip
    p = tl.load(Pos + b)
    shift = 0
    if HAS_SHIFT:
        shift = tl.load(Off + b)  # the row's first position's buffer row (left padding)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    lo = run * slots_per_run
    hi = tl.minimum(lo + slots_per_run, num_slots)
    for start in range(lo, hi, BLOCK_K):
        first, filled, reads = _slots_read(Seg, Rate, Stride, start + tl.arange(0, BLOCK_K), hi,
                                           p, heads, head_ok)  # fmt: skip
        # Only the rows some head of this program reads are loaded (a branch of rate r is read
        # by 1 in r heads), and a block none of them reads is skipped whole. No select here:
        # Triton 3.6 fails to lay out one mask feeding both tiles (sm90, D 128).
        loaded = tl.max(reads.to(tl.int32), 0) > 0
        if tl.max(loaded.to(tl.int32), 0) > 0:
            row = (first + shift) % ring_rows
            # Both tiles' loads are issued before either is used: twice the bytes in flight.
            k = tl.load(
                K + b * s_kb + row[:, None] * s_kr + kvh * s_kh + d[None, :],
                mask=loaded[:, None] & d_ok[None, :], other=0.0,
            )  # fmt: skip
            v = tl.load(
                V + b * s_vb + row[:, None] * s_vr + kvh * s_vh + d[None, :],
                mask=loaded[:, None] & d_ok[None, :], other=0.0,
            )  # fmt: skip
            if HAS_MASK:
                hidden = tl.load(Mask + b * s_mb + row, mask=filled, other=1)
                reads = reads & (hidden == 0)[None, :]
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            if SOFTCAP:  # noqa: SIM108 (a constexpr branch); before the mask, tanh(-inf) is -1
                qk = cap_out * _tanh(qk * cap_in)
            else:
                qk = qk * scale
            qk = tl.where(reads, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            weights = tl.exp2(qk - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(weights, 1)
            acc = acc * alpha[:, None] + tl.dot(
                weights.to(v.dtype), v, input_precision=DOT_PRECISION
            )  # fmt: skip
            m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))  # fmt: skip
    tl.store(
        Part + b * s_pb + run * s_ps + heads[:, None] * s_ph + d[None, :], out,
        mask=head_ok[:, None] & d_ok[None, :],
    )  # fmt: skip
    tl.store(PartLse + b * s_lb + heads * s_lh + run * s_ls, lse, mask=head_ok)


def decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    positions: torch.Tensor,
    slots: tuple[torch.Tensor, ...],
    scale: float,
    row_offsets: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The static step's attention (Note [A decode kernel reading the buffers in place]).

    Args:
        q: (B, 1, H, D), last dim contiguous.
        k, v: the buffers (B, R, Hkv, D), last dim contiguous, holding the tokens' keys.
        key_padding_mask: (B, R) bool over the buffer rows, or None.
        positions: (B,) int64, each row's token position.
        slots: ``token_slots`` of the step's branches: per slot its ``w``, ``r`` and ``r * m``
            (K,) int64, and the heads' classes (unused here).
        scale: the softmax scale.
        row_offsets: (B,) int64, how many rows further each row's positions lie (None: 0).
        softcap: the scores soft-capped, or None; sinks: (H,) logits joined to every row, or
            None (no gradient reaches them here).

    Returns:
        ``out`` (B, 1, H, D) in q's dtype and ``lse`` (B, H, 1) float32 (the sinks' included).
    """
    batch, _, heads, dim = q.shape
    ring_rows, kv_heads = k.shape[1], k.shape[2]
    seg, rate, stride = (x.contiguous() for x in slots[:3])
    num_slots = seg.shape[0]
    block_d = max(16, next_power_of_2(dim))
    block_k = _block_slots(block_d * k.element_size())
    blocks = cdiv(num_slots, block_k)
    runs = max(1, min(_runs_wanted(q.device, batch * kv_heads), blocks))
    per_run = cdiv(blocks, runs) * block_k
    runs = cdiv(num_slots, per_run)
    extra = 0 if sinks is None else 1  # the sinks' run: output 0, log-sum-exp the sink
    part = torch.empty(batch, runs + extra, heads, dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, heads, runs + extra, dtype=torch.float32, device=q.device)
    if sinks is not None:
        part[:, runs].zero_()
        part_lse[:, :, runs].copy_(sinks.detach().to(torch.float32).expand(batch, heads))
    mask = key_padding_mask if key_padding_mask is not None else positions
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    q3 = q[:, 0]
    shift = positions if row_offsets is None else row_offsets.contiguous()  # read if given
    _decode_kernel[(batch * kv_heads, runs)](
        q3, k, v, mask, positions, shift, seg, rate, stride, part, part_lse,
        num_slots, ring_rows, kv_heads, heads // kv_heads, dim, per_run, scale * _LOG2E,
        scale / (softcap or 1.0), (softcap or 1.0) * _LOG2E,
        q3.stride(0), q3.stride(1),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        mask.stride(0) if key_padding_mask is not None else 0,
        *part.stride()[:3], *part_lse.stride(),
        HAS_MASK=key_padding_mask is not None, HAS_SHIFT=row_offsets is not None,
        BLOCK_G=max(16, next_power_of_2(heads // kv_heads)), BLOCK_K=block_k,
        BLOCK_D=block_d, DOT_PRECISION=precision, SOFTCAP=softcap is not None, num_warps=4,
        num_stages=2,
    )  # fmt: skip
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, 1, dtype=torch.float32, device=q.device)
    merge_splits(part, part_lse, out, lse)
    return out, lse


def _block_slots(row_bytes: int) -> int:
    """Slots per block of a program's loop: a key tile of at most ``_TILE_BYTES`` (rows of
    ``row_bytes``), between 16 (a dot's smallest side) and 128."""
    return max(16, min(128, next_power_of_2(_TILE_BYTES // row_bytes + 1) // 2))


@functools.lru_cache(maxsize=16)
def _runs_wanted(device: torch.device, rows: int) -> int:
    """Runs per (batch row, key/value head) so that the step's ``rows * runs`` programs fill
    every multiprocessor ``_PROGRAMS_PER_SM`` times (``_DEFAULT_RUNS`` off CUDA)."""
    if device.type != "cuda":
        return _DEFAULT_RUNS
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, -(-_PROGRAMS_PER_SM * sms // rows))
