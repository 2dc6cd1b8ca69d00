"""Block-sparse attention: dense attention restricted to the block pairs a pattern keeps.

Block ``i`` holds tokens ``[i * block_size, (i + 1) * block_size)`` (the last block may be
shorter). Query token ``p`` in block ``i`` attends key token ``t`` in block ``j`` when the
pattern keeps ``(i, j)`` and, for a causal call, ``t <= p`` (top-left aligned). For 4 blocks of 2
tokens, ``LocalWindow(0)`` and ``is_causal=True``::

    key         0 1 2 3 4 5 6 7
    query 0     x . . . . . . .
    query 1     x x . . . . . .
    query 2     . . x . . . . .
    query 3     . . x x . . . .
    ...

Three kernels compute it: the fallback, FlexAttention, and our block-sparse Triton kernels (Note
[Block-sparse Triton kernels] in ``backends/_triton_block_sparse.py``; chosen by ``_choose``).

Note [Block-sparse plan]
    The fallback (CPU, and CUDA without FlexAttention) computes only the kept pairs. For every
    query block it collects the key blocks it attends; under a causal mask the blocks before the
    diagonal are "full" and the diagonal block is a separate top-left causal call (a query piece
    that starts inside its block, as on a rank boundary, also reads the diagonal block's keys
    before its first row as full keys). Pieces with the same query and key row counts are stacked
    along the batch dimension into one kernel call from the registry (``select_backend``), in
    chunks of at most ``max(key_len, 8192)`` key rows, so extra memory stays near one copy of
    K/V and time is proportional to the kept pairs: nothing of size N x N is ever formed. Each
    call's ``(out, lse)`` merges into float32 accumulators (Note [Merging partial softmaxes]).
    The backward replays the same calls with the merged ``out``/``lse`` and each call's saved
    kernel ``aux`` (Note [Backward with external statistics]); dK/dV accumulate with
    ``index_add_`` because one key block serves many query blocks.

Note [FlexAttention block masks]
    On CUDA, compiled FlexAttention runs the pattern as a ``BlockMask`` of 128 x 128 tiles
    (``BlockMask.from_kv_blocks``). A tile whose every token pair is allowed is "full" (no
    per-element mask); a tile with some allowed pairs is "partial" and evaluates ``mask_mod``:
    ``allowed[q // block_size, kv // block_size]`` and, when causal, ``q >= kv``. Tiles of a
    ``block_size`` that is a multiple of 128 are all full except causal diagonal ones; other
    block sizes are exact too, with partial tiles where blocks straddle tiles. ``seq_lengths``
    carries the ragged ends. Gradients are FlexAttention's own autograd.

Note [Dense fallback]
    A pattern whose block mask keeps every block pair (every pair at or below the diagonal when
    causal) is dense attention, top-left causal when causal. ``block_sparse_attention`` then
    calls the library's dense ``attention`` (cuDNN on an H100) instead of either kernel above:
    FlexAttention walking every tile runs at about 0.7x of dense cuDNN (H100, N = 262,144: 0.64x
    forward, 0.71x forward+backward; ``benchmarks/results/block_sparse_long_h100.json``), and
    the fallback would split the work into many calls. Only ``backend="flex"`` (by argument,
    ``use_backend`` or the environment) keeps FlexAttention at full density.

Shape legend: B batch, Nq/Nk query/key tokens, H query heads, Hkv key/value heads, D head dim,
G query pieces stacked in one call, Lq/Lk rows per piece.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from . import _validation as V
from . import compiled
from .backends.base import Backend, KernelInputs
from .backends.registry import _requested, check_backend_name, get_backend, select_backend
from .core.engine import empty_attention
from .core.higher_order import RowCall, differentiable_grads
from .core.merge import merge_partial
from .patterns import Pattern, check_pattern

__all__ = ["SparseCall", "block_sparse_attention", "plan_calls"]

#: A call stacks query pieces until it holds max(key_len, this) key rows (Note [Block-sparse
#: plan]); tests lower it to exercise the chunking.
MIN_KV_ROWS_PER_CALL = 8192
#: FlexAttention's tile (its default sparse block size, which its kernels' tiles divide).
FLEX_TILE = 128


# -- validation -----------------------------------------------------------------------------------
def check_block_size(block_size: object) -> int:
    """Return ``block_size`` if it is a positive int, else raise."""
    if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral):
        raise TypeError(
            f"block_size must be a positive int (tokens per block, e.g. 64 or 128), got "
            f"{block_size!r} ({type(block_size).__name__})"
        )
    if block_size < 1:
        raise ValueError(
            f"block_size must be a positive int (tokens per block, e.g. 64 or 128), got "
            f"{block_size}; the last block may be shorter, so any seq_len works"
        )
    return int(block_size)


def _check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value


def num_blocks(length: int, block_size: int) -> int:
    """``ceil(length / block_size)``."""
    return -(-length // block_size)


def causal_block_mask(mask: torch.Tensor, is_causal: bool) -> torch.Tensor:
    """``mask`` without the pairs above the block diagonal when causal (top-left aligned)."""
    return torch.tril(mask) if is_causal else mask


# -- the plan (Note [Block-sparse plan]) ----------------------------------------------------------
@dataclass(frozen=True)
class SparseCall:
    """One kernel call: ``G`` query pieces of ``Lq`` rows against ``Lk`` key rows each.

    Attributes:
        q_index: (G, Lq) int64 rows of the local query tensor.
        kv_index: (G, Lk) int64 rows of the key/value tensor the call reads.
        causal: top-left causal within each piece.
    """

    q_index: torch.Tensor
    kv_index: torch.Tensor
    causal: bool

    def to(self, device: torch.device) -> SparseCall:
        return SparseCall(self.q_index.to(device), self.kv_index.to(device), self.causal)


def _block_tokens(blocks: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """Sorted token positions of ``blocks`` (sorted block indices), clipped to ``length``."""
    tokens = (blocks.view(-1, 1) * block_size + torch.arange(block_size)).flatten()
    return tokens[tokens < length]


def plan_calls(
    mask: torch.Tensor,
    *,
    block_size: int,
    query_len: int,
    key_len: int,
    is_causal: bool,
    query_range: tuple[int, int] | None = None,
    key_range: tuple[int, int] | None = None,
    max_kv_rows: int | None = None,
) -> list[SparseCall]:
    """The kernel calls computing the local queries against the available keys.

    Args:
        mask: (num_query_blocks, num_key_blocks) bool, already without the pairs above the
            diagonal when causal (see :func:`causal_block_mask`).
        block_size: tokens per block.
        query_len: Nq, global.
        key_len: Nk, global.
        is_causal: key ``t`` visible to query ``p`` only when ``t <= p``.
        query_range: global positions ``[lo, hi)`` of the local queries (default: all);
            ``q_index`` counts from ``lo``.
        key_range: global positions ``[lo, hi)`` the keys may come from (default: all);
            ``kv_index`` counts from ``lo``.
        max_kv_rows: key rows per call before stacking starts a new call (default
            ``max(key_len, MIN_KV_ROWS_PER_CALL)``).

    Returns:
        Calls on the CPU, in a deterministic order.
    """
    q_lo, q_hi = query_range if query_range is not None else (0, query_len)
    k_lo, k_hi = key_range if key_range is not None else (0, key_len)
    k_hi = min(k_hi, key_len)
    num_key_blocks = mask.shape[1]
    groups: dict[tuple[bool, int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def add(causal: bool, q_rows: torch.Tensor, k_pos: torch.Tensor) -> None:
        key = (causal, q_rows.numel(), k_pos.numel())
        qs, ks = groups.setdefault(key, ([], []))
        qs.append(q_rows)
        ks.append(k_pos)

    for i in range(q_lo // block_size, num_blocks(q_hi, block_size)):
        q0, q1 = max(i * block_size, q_lo), min((i + 1) * block_size, q_hi)
        if q0 >= q1:
            continue
        row = mask[i]
        full_blocks = row[: min(i, num_key_blocks)] if is_causal else row
        full = _block_tokens(full_blocks.nonzero().flatten(), block_size, key_len)
        full = full[(full >= k_lo) & (full < k_hi)]
        causal_keys = None
        if is_causal and i < num_key_blocks and bool(row[i]):
            k_end = min((i + 1) * block_size, key_len)
            # Keys of the diagonal block before this piece's first row: visible to every row.
            start = max(i * block_size, k_lo)
            before = torch.arange(start, max(start, min(q0, k_end, k_hi)))
            full = torch.cat([full, before])
            c0, c1 = max(q0, k_lo), min(k_end, k_hi)
            if c0 < c1 and c0 < q1:
                causal_keys = (torch.arange(c0, q1) - q_lo, torch.arange(c0, c1))
        if full.numel():
            add(False, torch.arange(q0, q1) - q_lo, full)
        if causal_keys is not None:
            add(True, *causal_keys)

    budget = max_kv_rows if max_kv_rows is not None else max(key_len, MIN_KV_ROWS_PER_CALL)
    calls = []
    for (causal, _, rows_k), (qs, ks) in groups.items():
        per_call = max(1, budget // rows_k)
        for start in range(0, len(qs), per_call):
            q_index = torch.stack(qs[start : start + per_call])
            kv_index = torch.stack(ks[start : start + per_call]) - k_lo
            calls.append(SparseCall(q_index, kv_index, causal))
    return calls


def call_positions(calls: list[SparseCall]) -> torch.Tensor:
    """Sorted unique ``kv_index`` values used by ``calls`` (int64, possibly empty)."""
    if not calls:
        return torch.zeros(0, dtype=torch.int64)
    return torch.unique(torch.cat([c.kv_index.flatten() for c in calls]))


# -- running the plan ------------------------------------------------------------------------------
def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def new_accumulators(
    q: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` (B, Nq, H, D) zeros and ``lse`` (B, Nq, H) ``-inf``, float32 (float64)."""
    batch, rows, heads, dim = q.shape
    acc = _acc_dtype(q.dtype)
    out = torch.zeros(batch, rows, heads, dim, dtype=acc, device=q.device)
    lse = torch.full((batch, rows, heads), float("-inf"), dtype=acc, device=q.device)
    return out, lse


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(B, N, h, D) and (G, L) -> (B * G, L, h, D)."""
    batch, _, heads, dim = x.shape
    g, length = index.shape
    return x.index_select(1, index.flatten()).view(batch * g, length, heads, dim)


def forward_calls(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    calls: list[SparseCall],
    backend: Backend,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    auxes: list[Any],
) -> None:
    """Run ``calls`` and merge each result into ``out`` (B, Nq, H, D) / ``lse`` (B, Nq, H).

    Args:
        q: (B, Nq, H, D) local queries; k, v: (B, Nk', Hkv, D), the rows ``kv_index`` reads.
        auxes: each call's kernel ``aux`` is appended, in call order.
    """
    batch, _, heads, dim = q.shape
    for call in calls:
        g, lq = call.q_index.shape
        res = backend.forward(
            _rows(q, call.q_index), _rows(k, call.kv_index), _rows(v, call.kv_index),
            scale=scale, is_causal=call.causal,
        )  # fmt: skip
        auxes.append(res.aux)
        rows = call.q_index.flatten()
        part_out = res.out.reshape(batch, g * lq, heads, dim)
        part_lse = res.lse.view(batch, g, heads, lq).transpose(2, 3).reshape(batch, g * lq, heads)
        new_out, new_lse = merge_partial(
            out.index_select(1, rows), lse.index_select(1, rows), part_out, part_lse
        )
        out.index_copy_(1, rows, new_out)
        lse.index_copy_(1, rows, new_lse)


def backward_calls(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    calls: list[SparseCall],
    backend: Backend,
    scale: float,
    auxes: Iterator[Any],
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
) -> None:
    """Replay ``calls`` with the merged statistics and add the gradients into dq, dk, dv.

    Args:
        dout, q, out: (B, Nq, H, D); lse: (B, H, Nq) merged; k, v: (B, Nk', Hkv, D).
        auxes: the forward's ``aux`` values, consumed in call order.
        dq: (B, Nq, H, D); dk, dv: (B, Nk', Hkv, D) accumulators (float32 or float64).
    """
    batch, _, heads, dim = q.shape
    kv_heads = k.shape[2]
    for call in calls:
        g, lq = call.q_index.shape
        lk = call.kv_index.shape[1]
        rows, keys = call.q_index.flatten(), call.kv_index.flatten()
        lse_rows = lse.index_select(2, rows).view(batch, heads, g, lq).transpose(1, 2)
        dq_c, dk_c, dv_c = backend.backward(
            _rows(dout, call.q_index), _rows(q, call.q_index), _rows(k, call.kv_index),
            _rows(v, call.kv_index), _rows(out, call.q_index),
            lse_rows.reshape(batch * g, heads, lq), next(auxes), scale=scale,
            is_causal=call.causal,
        )  # fmt: skip
        dq.index_add_(1, rows, dq_c.reshape(batch, g * lq, heads, dim).to(dq.dtype))
        dk.index_add_(1, keys, dk_c.reshape(batch, g * lk, kv_heads, dim).to(dk.dtype))
        dv.index_add_(1, keys, dv_c.reshape(batch, g * lk, kv_heads, dim).to(dv.dtype))


class BlockSparseFunction(torch.autograd.Function):
    """Autograd of :func:`forward_calls` / :func:`backward_calls` on one process.

    Returns ``out`` (B, Nq, H, D) in the input dtype and ``lse`` (B, H, Nq), not differentiable.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        calls: list[SparseCall],
        backend: Backend,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out_acc, lse_acc = new_accumulators(q)
        auxes: list[Any] = []
        forward_calls(q, k, v, calls, backend, scale, out_acc, lse_acc, auxes)
        out = out_acc.to(q.dtype)
        lse = lse_acc.transpose(1, 2).contiguous()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.calls, ctx.backend, ctx.scale, ctx.auxes = calls, backend, scale, auxes
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, dout: torch.Tensor, _dlse: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True (Note [Double backward])
            grads = _differentiable_grads(dout, q, k, v, lse, ctx.calls, ctx.scale)
            return (*grads, None, None, None)
        acc = _acc_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        backward_calls(
            dout.contiguous(), q, k, v, out, lse, ctx.calls, ctx.backend, ctx.scale,
            iter(ctx.auxes), dq, dk, dv,
        )  # fmt: skip
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def _differentiable_grads(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    calls: list[SparseCall],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of the calls' merged attention, differentiable to any order (Note [Double
    backward] in ``core/higher_order.py``); dout, q: (B, Nq, H, D), k, v: (B, Nk, Hkv, D)."""
    heads, kv_heads = q.shape[2], k.shape[2]
    rows = [RowCall.from_positions(c.q_index, c.kv_index, heads, kv_heads, c.causal) for c in calls]
    return differentiable_grads(dout, q, k, v, lse, rows, scale=scale)


@torch.compiler.disable  # a cached pure-Python plan: run it eagerly, never traced
@functools.lru_cache(maxsize=64)
def _local_plan(
    pattern: Pattern,
    block_size: int,
    query_len: int,
    key_len: int,
    is_causal: bool,
    device: torch.device,
    max_kv_rows: int,
) -> tuple[list[SparseCall], torch.Tensor]:
    """Calls (on ``device``) and the block mask (CPU, causal applied) of one local call."""
    mask = pattern.block_mask(num_blocks(query_len, block_size), num_blocks(key_len, block_size))
    mask = causal_block_mask(mask, is_causal)
    calls = plan_calls(
        mask, block_size=block_size, query_len=query_len, key_len=key_len, is_causal=is_causal,
        max_kv_rows=max_kv_rows,
    )  # fmt: skip
    return [c.to(device) for c in calls], mask


# -- FlexAttention (Note [FlexAttention block masks]) ----------------------------------------------
def _tile_block_ranges(length: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """First and last block index (inclusive) touched by each FLEX_TILE tile of ``length``."""
    starts = torch.arange(num_blocks(length, FLEX_TILE)) * FLEX_TILE
    ends = torch.clamp(starts + FLEX_TILE, max=length) - 1
    return starts // block_size, ends // block_size


def flex_tiles(
    mask: torch.Tensor, *, block_size: int, query_len: int, key_len: int, is_causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Classify FlexAttention tiles from a block mask (causal already applied).

    Returns:
        ``(full, partial)``: bool (query tiles, key tiles); ``full`` tiles have every token pair
        allowed, ``partial`` ones some but not all.
    """
    qa, qb = _tile_block_ranges(query_len, block_size)
    ka, kb = _tile_block_ranges(key_len, block_size)
    # 2-D prefix sums: allowed block pairs in each tile's block rectangle.
    sums = torch.zeros(mask.shape[0] + 1, mask.shape[1] + 1, dtype=torch.int64)
    sums[1:, 1:] = mask.to(torch.int64).cumsum(0).cumsum(1)
    qa, qb1, ka, kb1 = qa.view(-1, 1), (qb + 1).view(-1, 1), ka.view(1, -1), (kb + 1).view(1, -1)
    count = sums[qb1, kb1] - sums[qa, kb1] - sums[qb1, ka] + sums[qa, ka]
    every = count == (qb1 - qa) * (kb1 - ka)
    some = count > 0
    if is_causal:
        q_first = torch.arange(every.shape[0]).view(-1, 1) * FLEX_TILE
        q_last = torch.clamp(q_first + FLEX_TILE, max=query_len) - 1
        k_first = torch.arange(every.shape[1]).view(1, -1) * FLEX_TILE
        k_last = torch.clamp(k_first + FLEX_TILE, max=key_len) - 1
        every = every & (k_last <= q_first)  # every key precedes every query
        some = some & (k_first <= q_last)  # some key precedes some query
    return every, some & ~every


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(num, indices)`` in FlexAttention's layout (1, 1, Q) and (1, 1, Q, K), int32."""
    num = tiles.sum(-1).to(torch.int32)
    indices = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num.view(1, 1, -1), indices.view(1, 1, *indices.shape)


@torch.compiler.disable
@functools.lru_cache(maxsize=32)
def flex_block_mask(
    pattern: Pattern,
    block_size: int,
    query_len: int,
    key_len: int,
    is_causal: bool,
    device: torch.device,
) -> tuple[Any, torch.Tensor]:
    """A FlexAttention ``BlockMask`` for the pattern, and the (Nq,) bool "row sees no key".

    Built once per (pattern, shape) and cached: reusing the same ``BlockMask`` (and ``mask_mod``)
    keeps the compiled kernel's guards stable.
    """
    from torch.nn.attention.flex_attention import BlockMask

    nq, nk = num_blocks(query_len, block_size), num_blocks(key_len, block_size)
    mask = causal_block_mask(pattern.block_mask(nq, nk), is_causal)
    full, partial = flex_tiles(
        mask, block_size=block_size, query_len=query_len, key_len=key_len, is_causal=is_causal
    )
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    # Padded by one tile so that any index the kernel may form stays in bounds.
    pad_q = num_blocks(query_len + FLEX_TILE, block_size)
    pad_k = num_blocks(key_len + FLEX_TILE, block_size)
    lookup = torch.zeros(pad_q, pad_k, dtype=torch.bool)
    lookup[:nq, :nk] = mask
    lookup = lookup.to(device)

    if is_causal:

        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return lookup[q_idx // block_size, kv_idx // block_size] & (q_idx >= kv_idx)

    else:

        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return lookup[q_idx // block_size, kv_idx // block_size]

    block_mask = BlockMask.from_kv_blocks(
        kv_num.to(device), kv_idx.to(device), full_num.to(device), full_idx.to(device),
        BLOCK_SIZE=FLEX_TILE, mask_mod=mask_mod, seq_lengths=(query_len, key_len),
    )  # fmt: skip
    empty = ~mask.any(dim=1)
    empty_rows = empty.repeat_interleave(block_size)[:query_len].to(device)
    return block_mask, empty_rows


#: FlexAttention kernel options per (compute capability, head dim) for bf16/fp16 block-sparse
#: calls; anything not listed keeps Inductor's defaults. Measured with
#: ``benchmarks/tune_flex_block_sparse.py`` on an H100 80GB (record
#: ``benchmarks/results/tune_flex_block_sparse_h100.json``; torch 2.11, Triton 3.6; N = 65536,
#: H = 16, D = 128, bf16, random 10% block mask, block 128; median of CUDA-event timings,
#: forward / forward+backward): defaults 8.85 / 31.89 ms, max-autotune 8.76 / 31.89 ms (it picks
#: the configs below), USE_TMA 9.14 / 32.67 ms, dense cuDNN 55.4 / 214.6 ms. max-autotune's own
#: ranking put every other forward tile (128x128 two or one stage, 64x128, 64x64, 128x64 with 4
#: warps) at 85% or less of this one and every other backward config at 88% or less; 128x128 with
#: three stages needs more shared memory than an H100 has. The best measured configs are pinned,
#: so that a change of Inductor's heuristics cannot slow this path silently; they equal torch
#: 2.11's sm90 defaults, so on that torch they change no kernel.
_FLEX_KERNEL_OPTIONS: dict[tuple[tuple[int, int], int], dict[str, Any]] = {
    ((9, 0), 128): {
        "fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 8, "fwd_num_stages": 3,
        "bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
        "bwd_num_warps": 8, "bwd_num_stages": 3,
    },
}  # fmt: skip


@torch.compiler.disable
def flex_kernel_options(
    device: torch.device, head_dim: int, dtype: torch.dtype
) -> dict[str, Any] | None:
    """The ``kernel_options`` block-sparse FlexAttention uses here, or None for the defaults
    (a fresh dict per call: FlexAttention may add keys)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    options = _FLEX_KERNEL_OPTIONS.get((torch.cuda.get_device_capability(device), head_dim))
    return dict(options) if options is not None else None


def keeps_every_pair(mask: torch.Tensor, is_causal: bool) -> bool:
    """Whether the block mask keeps every block pair the causal mask (when causal) leaves.

    Then block-sparse attention IS dense attention (top-left causal when causal), and the dense
    kernel computes it exactly and faster than a sparse kernel walking every block.
    """
    if is_causal:
        mask = mask | ~torch.ones_like(mask).tril()
    return bool(mask.all())


@functools.lru_cache(maxsize=16)
def _is_dense(pattern: Pattern, nq: int, nk: int, is_causal: bool) -> bool:
    """``keeps_every_pair`` of the pattern's mask, kept per call shape (milliseconds at 256K
    tokens on a CPU, for an answer that never changes)."""
    return keeps_every_pair(pattern.block_mask(nq, nk), is_causal)


def _flex_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern: Pattern,
    *,
    block_size: int,
    is_causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention through compiled FlexAttention; (B, N, H, D) in and out."""
    from .backends.flex import compiled_flex_attention

    block_mask, empty_rows = flex_block_mask(
        pattern, block_size, q.shape[1], k.shape[1], is_causal, q.device
    )
    out, lse = compiled_flex_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask,
        scale=scale, kernel_options=flex_kernel_options(q.device, q.shape[-1], q.dtype),
        static_shapes=True,
    )  # fmt: skip
    lse = torch.where(empty_rows, float("-inf"), lse.detach().float())
    return out.transpose(1, 2), lse


# -- our Triton kernels (Note [Block-sparse Triton kernels] in backends/_triton_block_sparse.py) --
#: ``_choose``'s answers besides a fallback ``Backend``.
TRITON_KERNELS = "triton"
FLEX_KERNEL = "flex"


@functools.cache
def _triton_block_sparse() -> ModuleType:
    from .backends import _triton_block_sparse

    return _triton_block_sparse


def triton_kernel_reasons(q: torch.Tensor, k: torch.Tensor, block_size: int) -> list[str]:
    """Why the block-sparse Triton kernels cannot run these inputs; empty when they can."""
    reasons = get_backend("triton").not_supported_reasons(
        KernelInputs.from_tensors(q, k, is_causal=False)
    )
    if block_size % 64:
        reasons.append(
            f"block_size {block_size} is not a multiple of 64 (the block-sparse Triton kernels' "
            "tile rows)"
        )
    if q.shape[-1] > 128:
        reasons.append(f"head_dim {q.shape[-1]} > 128 (the block-sparse Triton kernels' tiles)")
    if q.device.type == "cuda" and q.dtype not in (torch.float16, torch.bfloat16):
        reasons.append(
            f"dtype {str(q.dtype).removeprefix('torch.')}: the block-sparse Triton kernels take "
            "float16/bfloat16 on CUDA (float32 tiles do not fit in shared memory)"
        )
    return reasons


@torch.compiler.disable
@functools.lru_cache(maxsize=32)
def _triton_lists(
    pattern: Pattern,
    block_size: int,
    query_len: int,
    key_len: int,
    is_causal: bool,
    device: torch.device,
) -> Any:
    """The pattern's ``BlockLists`` (causal applied) on ``device``, built once per shape."""
    nq, nk = num_blocks(query_len, block_size), num_blocks(key_len, block_size)
    mask = causal_block_mask(pattern.block_mask(nq, nk), is_causal)
    return _triton_block_sparse().block_lists(mask, device)


class TritonBlockSparseFunction(torch.autograd.Function):
    """Autograd of the block-sparse Triton kernels.

    Returns ``out`` (B, Nq, H, D) in the input dtype and ``lse`` (B, H, Nq) float32, not
    differentiable.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        lists: Any,
        block_size: int,
        is_causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = _triton_block_sparse().forward(
            q, k, v, lists, block_size=block_size, is_causal=is_causal, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.lists, ctx.block_size, ctx.is_causal, ctx.scale = lists, block_size, is_causal, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, dout: torch.Tensor, _dlse: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True (Note [Double backward])
            # The same pairs as the fallback's calls, from the kernels' block lists.
            lists, block_size = ctx.lists, ctx.block_size
            nq, nk = num_blocks(q.shape[1], block_size), num_blocks(k.shape[1], block_size)
            counts = (lists.key_start[1:] - lists.key_start[:-1]).long().cpu()
            mask = torch.zeros(nq, nk, dtype=torch.bool)
            mask[torch.arange(nq).repeat_interleave(counts), lists.key_blocks.long().cpu()] = True
            calls = plan_calls(
                mask, block_size=block_size, query_len=q.shape[1], key_len=k.shape[1],
                is_causal=ctx.is_causal,
            )  # fmt: skip
            calls = [c.to(q.device) for c in calls]
            grads = _differentiable_grads(dout, q, k, v, lse, calls, ctx.scale)
            return (*grads, None, None, None, None)
        dq, dk, dv = _triton_block_sparse().backward(
            dout.contiguous(), q, k, v, out, lse, ctx.lists, block_size=ctx.block_size,
            is_causal=ctx.is_causal, scale=ctx.scale,
        )  # fmt: skip
        return dq, dk, dv, None, None, None, None


@torch.compiler.disable  # selection probes kernels and caches: run it eagerly, never traced
def _choose(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    is_causal: bool,
    block_size: int,
    needs_grad: bool,
    backend: str | None,
) -> Backend | str:
    """``TRITON_KERNELS``, ``FLEX_KERNEL``, or the fallback's kernel.

    Nothing asked for (argument, ``use_backend``, environment), on CUDA: for a call without
    gradients our block-sparse Triton kernels where they run these inputs (their forward is
    1.1-1.4x FlexAttention's on an H100), for training FlexAttention (its backward is up to 6%
    faster at 64K tokens: docs/block_sparse.md), then whichever of the two runs, else the
    fallback.
    ``"triton"``: our Triton kernels, or where they cannot run these inputs the fallback with the
    dense Triton kernel. ``"flex"``: FlexAttention or a ``ValueError``. Any other name runs the
    fallback with that kernel.
    """
    inputs = KernelInputs.from_tensors(q, k, is_causal=is_causal)
    requested, _ = _requested(backend)
    if requested == FLEX_KERNEL:
        reasons = get_backend("flex").not_supported_reasons(inputs)
        if reasons:
            raise ValueError(
                f"backend 'flex' cannot run these inputs: {'; '.join(reasons)}; pass "
                "backend=None to use the fallback kernels"
            )
        return FLEX_KERNEL
    automatic = requested is None and q.device.type == "cuda"
    triton_runs = (automatic or requested == TRITON_KERNELS) and not triton_kernel_reasons(
        q, k, block_size
    )
    if triton_runs and (requested == TRITON_KERNELS or not needs_grad):
        return TRITON_KERNELS
    if automatic and not get_backend("flex").not_supported_reasons(inputs):
        return FLEX_KERNEL
    if triton_runs:
        return TRITON_KERNELS
    return select_backend(inputs, backend)


def block_sparse_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    pattern: Pattern,
    *,
    block_size: int = 128,
    is_causal: bool = False,
    scale: float | None = None,
    backend: str | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Dense attention restricted to the block pairs ``pattern`` keeps (and causal, when asked).

    Query token ``p`` (block ``p // block_size``) attends key token ``t`` (block
    ``t // block_size``) when the pattern keeps that block pair and, if causal, ``t <= p``.
    Query rows that attend no key give 0 (and ``lse = -inf``). Gradients are exact, and so are
    higher-order ones (``create_graph=True``) on every kernel but FlexAttention, for which
    torch.compile raises on double backward: pass ``backend="triton"`` or a fallback kernel name
    for a gradient penalty on CUDA.

    Args:
        query: (B, Nq, H, D).
        key: (B, Nk, Hkv, D), H % Hkv == 0 (GQA). Nk may differ from Nq.
        value: (B, Nk, Hkv, D).
        pattern: a :mod:`dilated_attention.patterns` pattern; it is asked for the block mask
            ``(ceil(Nq / block_size), ceil(Nk / block_size))``.
        block_size: tokens per block; the last block may be shorter.
        is_causal: top-left aligned causal mask (query ``p`` sees keys ``t <= p``).
        scale: softmax scale; ``None`` means ``D ** -0.5``.
        backend: ``None`` picks, on CUDA, our block-sparse Triton kernels for calls without
            gradients and FlexAttention for training (each where it runs), else the registry's
            kernel for the fallback (Note [Block-sparse plan]); ``"triton"`` forces our Triton
            kernels where they run (else the fallback with the dense Triton kernel); ``"flex"``
            forces FlexAttention; any other name from ``list_backends()`` runs the fallback with
            that kernel. A pattern
            that keeps every block pair runs dense ``attention`` with the same ``backend``
            (Note [Dense fallback]), except under ``"flex"``.
        return_lse: also return the log-sum-exp.

    Returns:
        ``out`` (B, Nq, H, D) in the input dtype, or ``(out, lse)`` with ``lse`` (B, H, Nq)
        float32 (float64 for float64 inputs on the fallback), detached.

    Raises:
        TypeError: ``pattern`` is not a Pattern; wrong argument types.
        ValueError: malformed tensors, ``block_size < 1``, a ``Custom`` mask of another block
            count, or a backend that cannot run the inputs.
    """
    q, k, v = V.check_qkv(query, key, value, same_length=False)
    pattern = check_pattern(pattern)
    block_size = check_block_size(block_size)
    is_causal = _check_flag("is_causal", is_causal)
    return_lse = _check_flag("return_lse", return_lse)
    checked_scale = V.check_scale(scale)
    backend = check_backend_name(backend)  # "auto" -> None; ValueError naming the valid ones
    if compiled.is_traced(q, k, v):  # Note [Custom operators for torch.compile] (compiled.py)
        out, lse = compiled.block_sparse(
            q, k, v, pattern, block_size=block_size, is_causal=is_causal, scale=checked_scale,
            backend=backend,
        )  # fmt: skip
        return (out, lse) if return_lse else out
    softmax_scale = checked_scale if checked_scale is not None else q.shape[-1] ** -0.5
    query_len, key_len = q.shape[1], k.shape[1]
    # Ask the pattern first: a Custom mask of the wrong size fails before any kernel work.
    dense = _is_dense(
        pattern, num_blocks(query_len, block_size), num_blocks(key_len, block_size), is_causal
    )
    if dense and _requested(backend)[0] != "flex":
        # Dense attention exactly (Note [Dense fallback]); a named kernel stays the kernel.
        from .functional import attention

        out, lse = attention(
            q, k, v, is_causal=is_causal, scale=softmax_scale, backend=backend, return_lse=True
        )
        return (out, lse) if return_lse else out
    if q.numel() == 0:  # batch 0 or 0 heads: empty out and grads, no kernel launch
        out, lse = empty_attention(q, k, v)
        return (out, lse) if return_lse else out
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    kernel = _choose(
        q, k, is_causal=is_causal, block_size=block_size, needs_grad=needs_grad, backend=backend
    )
    if kernel == TRITON_KERNELS:
        lists = _triton_lists(pattern, block_size, query_len, key_len, is_causal, q.device)
        out, lse = TritonBlockSparseFunction.apply(
            q.contiguous(), k.contiguous(), v.contiguous(), lists, block_size, is_causal,
            softmax_scale,
        )  # fmt: skip
    elif kernel == FLEX_KERNEL:
        out, lse = _flex_forward(
            q, k, v, pattern, block_size=block_size, is_causal=is_causal, scale=softmax_scale
        )
    else:
        budget = max(key_len, MIN_KV_ROWS_PER_CALL)
        calls, _ = _local_plan(pattern, block_size, query_len, key_len, is_causal, q.device, budget)
        out, lse = BlockSparseFunction.apply(
            q.contiguous(), k.contiguous(), v.contiguous(), calls, kernel, softmax_scale
        )
    return (out, lse) if return_lse else out
