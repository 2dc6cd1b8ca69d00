"""Planning block-sparse attention: the block geometry and the kernel calls of a pattern.

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

Shape legend: B batch, Nq/Nk query/key tokens, H query heads, Hkv key/value heads, D head dim,
G query pieces stacked in one call, Lq/Lk rows per piece.
"""

from __future__ import annotations

import functools
import itertools
import numbers
from dataclasses import dataclass

import torch

from ..core.autograd import Backward, Grads
from ..core.higher_order import RowCall, differentiable_grads
from ..patterns import Pattern

#: A call stacks query pieces until it holds max(key_len, this) key rows (Note [Block-sparse
#: plan]); tests lower it to exercise the chunking.
MIN_KV_ROWS_PER_CALL = 8192


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

    # The executor's ``Call`` (``core/geometry/calls.py``): every head, rows picked by position.
    def q_rows(self, x: torch.Tensor) -> torch.Tensor:
        return _rows(x, self.q_index)

    def kv_rows(self, x: torch.Tensor) -> torch.Tensor:
        return _rows(x, self.kv_index)

    def key_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """(B, Nk) bool -> (B * G, 1, Lk)."""
        if mask is None:
            return None
        return _rows(mask.view(*mask.shape, 1), self.kv_index).transpose(1, 2)

    def put_q(self, dest: torch.Tensor, rows: torch.Tensor, *, accumulate: bool) -> None:
        _put(dest, self.q_index, rows, accumulate)

    def put_kv(self, dest: torch.Tensor, rows: torch.Tensor, *, accumulate: bool) -> None:
        _put(dest, self.kv_index, rows, accumulate)

    def row_call(self, q: torch.Tensor, k: torch.Tensor) -> RowCall:
        return RowCall.from_positions(
            self.q_index, self.kv_index, q.shape[2], k.shape[2], self.causal
        )


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(B, N, h, ...) and (G, L) -> (B * G, L, h, ...)."""
    g, length = index.shape
    return x.index_select(1, index.flatten()).view(x.shape[0] * g, length, *x.shape[2:])


def _put(dest: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, accumulate: bool) -> None:
    """Write (or add) (B * G, L, h, ...) rows into ``dest`` (B, N, h, ...) at ``index`` (G, L)."""
    flat = rows.reshape(dest.shape[0], index.numel(), *rows.shape[2:]).to(dest.dtype)
    if accumulate:
        dest.index_add_(1, index.flatten(), flat)
    else:
        dest.index_copy_(1, index.flatten(), flat)


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
    query_start: int = 0,
) -> tuple[list[SparseCall], torch.Tensor]:
    """Calls (on ``device``) and the block mask (CPU, causal applied) of one local call.

    ``query_start``: the position of the first query row; the query rows are the positions
    ``[query_start, query_start + query_len)`` (an end-aligned causal query: ``key_len -
    query_len``), and the block mask covers those positions' blocks from block 0."""
    end = query_start + query_len
    mask = pattern.block_mask(num_blocks(end, block_size), num_blocks(key_len, block_size))
    mask = causal_block_mask(mask, is_causal)
    calls = plan_calls(
        mask, block_size=block_size, query_len=end, key_len=key_len, is_causal=is_causal,
        query_range=(query_start, end), max_kv_rows=max_kv_rows,
    )  # fmt: skip
    return [c.to(device) for c in calls], mask


@functools.lru_cache(maxsize=16)
def document_calls(
    pattern: Pattern,
    block_size: int,
    documents: tuple[int, ...],
    is_causal: bool,
    device: torch.device,
) -> tuple[SparseCall, ...]:
    """The calls of packed documents (Note [Packed documents] in ``core/geometry/documents.py``):
    each document's kept blocks, counted from its own first token, at the positions it holds among
    the ``documents[-1]`` positions of the flattened batch. ``documents``: their offsets."""
    calls: list[SparseCall] = []
    spans = list(itertools.pairwise(documents))
    budget = max(max(end - start for start, end in spans), MIN_KV_ROWS_PER_CALL)
    for start, end in spans:
        own, _ = _local_plan(pattern, block_size, end - start, end - start, is_causal, device,
                             budget)  # fmt: skip
        calls.extend(SparseCall(c.q_index + start, c.kv_index + start, c.causal) for c in own)
    return tuple(calls)


def recomputed_grads(
    b: Backward, mask: torch.Tensor, block_size: int, is_causal: bool, scale: float
) -> Grads:
    """Differentiable ``(dq, dk, dv)`` (Note [Double backward]) over the calls of ``plan_calls``
    for the block pairs of ``mask`` (causal applied): how a block-sparse kernel without a
    differentiable backward of its own serves ``create_graph=True``.

    Args:
        b: the runner's :class:`~dilated_attention.core.autograd.Backward`; its ``saved`` is
            ``(k, v)``.
        mask: (ceil(Nq / block_size), ceil(Nk / block_size)) bool.
    """
    dout, q, _, lse, saved, _ = b
    k, v = saved
    calls = plan_calls(
        mask, block_size=block_size, query_len=q.shape[1], key_len=k.shape[1], is_causal=is_causal
    )
    rows = [call.to(q.device).row_call(q, k) for call in calls]
    return differentiable_grads(dout, q, k, v, lse, rows, scale=scale)
