"""FlashAttention-4's backward in chunks of heads: how many calls a backward runs in, and
which query and key/value heads each call takes (the calls themselves are
``_backward_calls`` in ``__init__.py``).

Note [FlashAttention-4's accumulators by head chunks]
    FA4's backward allocates float32 accumulators beside the gradients it writes: dq's (B, H,
    Nq, D), and where query heads share a key/value head, dk's and dv's (B, Hkv, Nk, D) each.
    With 16 query heads on 4 key/value heads that is 3 |q| on top of the 5 |q| a training call
    cannot avoid (q, k, v, out, dout, dq, dk, dv): a 1.6x peak. Heads are independent in the
    backward, so a backward runs in chunks of heads, each writing its heads' rows of dq, dk and
    dv: the fewest chunks whose accumulators, with the tile lists a run-time mask's backward
    makes for the chunk (per key tile a slot for every query tile: 2.5% of the unavoidable bytes
    for two query heads at 1M tokens), take at most :data:`ACCUMULATOR_SHARE` of the unavoidable
    bytes, leaving 1% of a 1.15x peak to the calls' small tensors (:func:`accumulator_chunks`).
    Chunks are whole groups of key/value heads (2 calls with 16 query and 16 key/value heads),
    else parts of each group (8 calls of 12.5% at 16 / 4 heads), else single query heads: the
    first part of a group writes its dk and dv to the gradients, each later part into a buffer
    of one key/value head in the gradients' dtype, added to them after its call (one more
    rounding of dk and dv). A block-sparse backward's chunks are only calls whose query heads
    share no key/value head (``ungrouped``), which skip FA4's float32 dk and dv and the atomics
    that add into them: with grouped heads, members of each group, a call taking one query head
    of every group of its key/value heads (a stepped slice of the heads: 0, 4, 8, 12 on
    key/value heads 0-3), the calls of one group's members adding their dk and dv like parts. A
    part writes every key tile of its dk and dv, zeros where none of its query tiles visits
    (FA4's block-sparse backward writes them; grouped heads' float32 accumulators start at
    zero): the GPU oracle tests run parts on buffers filled with NaN. Each chunk is one more
    call of FA4's Python on the host (~0.4 ms), so a backward with less than
    :data:`MIN_CHUNKED_ACCUMULATOR_BYTES` of accumulators stays one call: at 16K (192 MiB, ~2 ms
    on the GPU) four chunks made 1.9 ms 2.4-4.1. A whole call's chunks replay from one CUDA
    graph where each adds less than :data:`MAX_REPLAYED_CHUNK_BYTES` (:func:`replayable`; Note
    [A whole call's launches from a CUDA graph] in ``__init__.py``): then the graphs' pool keeps
    no more than an unchunked call below the floor keeps. A block-sparse backward replayed from
    a CUDA graph (Note [A block-sparse backward in one graph] in ``block_sparse/fa4.py``) costs
    that Python only before its capture, but chunking below the floor still costs GPU time
    (H200, MoBA, 16 / 4 heads: 2.3 -> 2.8 ms at 16K in four calls of members, 4.3 -> 5.5 ms at
    32K in eight, for peaks of 1.21x and 1.11x instead of 1.61x; single query heads 2.2 -> 5.4
    ms), so it keeps the floor.

    Measured (H100, MoBA's blocks of 128, 2,048 keys per query, 16 / 4 heads, D = 128; one
    call: 1.63-1.87x the unavoidable bytes), training peak and forward+backward at 64K / 256K
    / 1M: whole groups 1.16x / 1.17x / 1.21x at 8.5 / 47.9 / 235 ms back to back, halves of
    groups 1.13x / 1.14x / 1.155x at 10% / 5% / 3% more time, single query heads 1.06x / 1.06x
    / 1.07x at 10.1 / 48.0 / 231 ms. Members of groups (H200, one run beside the single query
    heads): eight calls at 64K, 1.11x at 9.01 ms (8.37 back to back) against 1.06x at 9.33
    (8.84). Dense calls that write their own gradients
    (``attention()``, NSA's window and compressed branches) take the chunks by the share alone:
    in single query heads NSA's dense branches were slower (197 -> 248 ms at 256K). A slotted
    plan's calls, which write into its gradient slots, stay one call each: they are short, the
    plan's peak lies in its slots, and split the same way a GQA dilated training step at 16K
    took 5.4 ms instead of 3.6.

Shapes: q (B, Nq, H, D), k/v (B, Nk, Hkv, D).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "ACCUMULATOR_SHARE", "MAX_REPLAYED_CHUNK_BYTES", "ListBytes", "accumulator_chunks",
    "head_chunks", "no_lists", "replayable",
]  # fmt: skip

#: The share of a training call's unavoidable bytes (q, k, v, out, dout, dq, dk and dv) that
#: one backward call's float32 accumulators, its dk / dv sums (part of a group of query heads)
#: and the tile lists made for it may take (Note [FlashAttention-4's accumulators by head
#: chunks]): 1% of a 1.15x peak is left to the calls' small tensors.
ACCUMULATOR_SHARE = 0.14
#: Below this many bytes of float32 accumulators a backward runs as one call: each chunk costs
#: FA4's Python on the host, which a short call does not hide.
MIN_CHUNKED_ACCUMULATOR_BYTES = 512 << 20
#: A whole backward in chunks replays from a CUDA graph where each of its calls adds fewer bytes
#: than this beside the gradients: what the graphs' shared pool then keeps reserved, at most
#: what an unchunked call below :data:`MIN_CHUNKED_ACCUMULATOR_BYTES` keeps there.
MAX_REPLAYED_CHUNK_BYTES = 512 << 20
#: The bytes of the tile lists made for a backward call of so many query and key/value heads.
ListBytes = Callable[[int, int], int]


def no_lists(heads: int, kv_heads: int) -> int:
    """A dense call's lists: none."""
    return 0


def _call_bytes(
    q: torch.Tensor, k: torch.Tensor, heads: int, kv_heads: int, list_bytes: ListBytes = no_lists
) -> int:
    """The bytes one backward call of ``heads`` query heads on ``kv_heads`` key/value heads adds
    beside the gradients: float32 dq, float32 dk and dv where its query heads share key/value
    heads, the call's dk and dv (in the gradients' dtype) when it holds part of a group
    only, added to the group's others afterwards, and ``list_bytes(heads, kv_heads)`` of lists."""
    group = q.shape[2] // k.shape[2]
    per_kv_head = k.numel() // k.shape[2]
    added = 4 * heads * (q.numel() // q.shape[2]) + list_bytes(heads, kv_heads)
    if heads > kv_heads:
        added += 8 * kv_heads * per_kv_head
    if heads < group * kv_heads:
        added += 2 * k.element_size() * kv_heads * per_kv_head
    return added


@dataclass(frozen=True)
class _Split:
    """One way to split a backward's heads: ``calls`` calls of ``heads`` query heads on
    ``kv_heads`` key/value heads each (:func:`head_chunks` gives their slices)."""

    calls: int
    heads: int
    kv_heads: int


def _splits(heads: int, kv_heads: int, ungrouped: bool) -> list[_Split]:
    """The ways to split, fewest calls first: whole groups (a divisor of Hkv calls), parts of
    each group (Hkv times a divisor of H / Hkv); ``ungrouped`` only those whose query heads
    share no key/value head, and members of groups (H / Hkv times a divisor of Hkv calls,
    one query head of each group per call) in place of parts."""
    group = heads // kv_heads
    whole = [_Split(c, heads // c, kv_heads // c) for c in _divisors(kv_heads)]
    if not ungrouped:
        parts = [_Split(kv_heads * p, group // p, 1) for p in _divisors(group) if p > 1]
        return whole + parts
    if group == 1:
        return whole
    return [_Split(group * c, kv_heads // c, kv_heads // c) for c in _divisors(kv_heads)]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def accumulator_chunks(
    q: torch.Tensor,
    k: torch.Tensor,
    list_bytes: ListBytes = no_lists,
    ungrouped: bool = False,
) -> int:
    """How many calls a backward of q (B, Nq, H, D) and k/v (B, Nk, Hkv, D) runs in (Note
    [FlashAttention-4's accumulators by head chunks]): one below
    :data:`MIN_CHUNKED_ACCUMULATOR_BYTES` of float32 accumulators, else the fewest whose calls
    each add at most :data:`ACCUMULATOR_SHARE` of the unavoidable bytes (with the tile lists
    ``list_bytes`` gives per call, block-sparse): chunks of whole groups (a divisor of Hkv),
    then parts of each group (Hkv times a divisor of H / Hkv), else one call per query head.
    ``ungrouped``: only calls whose query heads share no key/value head, members of each group
    in place of parts."""
    heads, kv_heads = q.shape[2], k.shape[2]
    if _call_bytes(q, k, heads, kv_heads) < MIN_CHUNKED_ACCUMULATOR_BYTES:
        return 1
    budget = ACCUMULATOR_SHARE * 4 * (q.numel() + k.numel()) * q.element_size()
    splits = _splits(heads, kv_heads, ungrouped)
    for split in splits:
        if _call_bytes(q, k, split.heads, split.kv_heads, list_bytes) <= budget:
            return split.calls
    return heads


def head_chunks(
    q: torch.Tensor,
    k: torch.Tensor,
    list_bytes: ListBytes = no_lists,
    ungrouped: bool = False,
) -> list[tuple[slice, slice]]:
    """The (query heads, key/value heads) of each call of :func:`accumulator_chunks`: whole
    groups of key/value heads, consecutive parts of one key/value head's group, or (members)
    one query head of each group of consecutive key/value heads, a stepped slice."""
    heads, kv_heads = q.shape[2], k.shape[2]
    group, calls = heads // kv_heads, accumulator_chunks(q, k, list_bytes, ungrouped)
    if ungrouped and group > 1 and calls % group == 0 and kv_heads % (calls // group) == 0:
        step = kv_heads // (calls // group)  # key/value heads a call, one member of each group
        return [
            (
                slice(first * group + member, (first + step) * group, group),
                slice(first, first + step),
            )
            for member in range(group)
            for first in range(0, kv_heads, step)
        ]
    if calls <= kv_heads:
        step = kv_heads // calls
        return [
            (slice(first * group, (first + step) * group), slice(first, first + step))
            for first in range(0, kv_heads, step)
        ]
    step = heads // calls
    return [(slice(h, h + step), slice(h // group, h // group + 1)) for h in range(0, heads, step)]


def replayable(q: torch.Tensor, k: torch.Tensor, chunks: list[tuple[slice, slice]]) -> bool:
    """Whether a whole backward of q (B, Nq, H, D) and k/v (B, Nk, Hkv, D) in ``chunks``
    (:func:`head_chunks`) may replay from a CUDA graph: one call, or calls that each add fewer
    than :data:`MAX_REPLAYED_CHUNK_BYTES` beside the gradients (Note [FlashAttention-4's
    accumulators by head chunks])."""
    if len(chunks) == 1:
        return True
    heads, kv_heads = q.shape[2], k.shape[2]
    largest = max(
        _call_bytes(q, k, len(range(*h.indices(heads))), len(range(*kv.indices(kv_heads))))
        for h, kv in chunks
    )
    return largest < MAX_REPLAYED_CHUNK_BYTES
