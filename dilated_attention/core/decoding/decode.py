"""Queries shorter than the keys: the last positions of a causal dilated call (decoding).

Note [Decoding rows]
    In the causal forward over ``Nk`` positions, branch ``(w, r)`` gives the query at position
    ``p`` and head ``h`` the keys ``t0 + s + r*m <= p`` of its segment, where ``t0 = (p // w) * w``
    and ``s = h mod r``, provided ``p`` is itself one of the head's rows (``(p - t0) mod r == s``);
    otherwise that branch does not cover the row (Note [Row groups] in ``segment.py``). So the
    queries at the last ``Nq`` positions ``Nk - Nq .. Nk - 1`` need no other queries. Per branch,
    segment and offset class ``s``, the queries of the chunk in that segment with that offset
    (every ``r``-th position, a strided slice of the heads) read the keys of that class from
    the segment's start: the keys before the chunk's first such query are visible to all of
    them (one call without a mask), and the rest are the queries' own positions (one square
    causal call). One new token is a single call per branch against at most ``ceil(w / r)``
    keys; a chunk of ``C`` tokens is at most two calls per (branch, segment, offset class),
    whatever ``C`` (chunked prefill). The executor merges the calls as in the full forward (Note
    [One executor] in ``executor.py``), so each row equals that row of the full causal forward
    over the ``Nk`` positions, whatever ``Nk`` is: the cost of a decoded token is the sum over
    branches of ``w / r`` keys. The branches are the effective ones of ``Nk`` positions (Note
    [Effective branches]): ``w > Nk`` is one segment.

Note [One call per decoded token]
    One new token at position ``p`` reads, in branch ``(w, r)``, the keys ``t0 + s + r*m <= p``
    with ``t0 = (p // w) * w`` and ``s = (p - t0) mod r``, and only the heads ``h`` with
    ``h mod r == s`` read them (Note [Decoding rows]). The key positions of a branch are the same
    for every head that reads them; only which heads read them differs. So all branches fit one
    kernel call: the keys of every branch side by side (``sum of ceil(w / r)`` slots, the last
    ones of a branch padding until its segment fills) with a per-head key mask saying which
    heads read which slots. One softmax over the slots a head reads is exactly the merge of its
    branches (LongNet Eq. 10: one softmax over the multiset union of the branches' keys), so
    the result equals the per-branch calls' and the full causal forward's. The call's shape is
    the same for every token once the context reaches the longest segment (before, one per
    doubling of the context: :func:`decode_token_plan`), and it replaces one call per branch
    (each with its own gather, kernel launch and merge) by one of each: decoding is bound by a
    few launches rather than by the number of branches. On the Triton kernels the call splits
    its slots into runs (Note [Split keys for few queries] in ``backends/triton.py``): on an
    H100, one token of the LongNet schedule (H = 16, D = 128, bf16) took 41 us in the kernel
    and 7 us in the merge of the runs, against 310 us unsplit. It runs without gradients; a
    decoding step that needs gradients keeps the per-branch plan (:func:`decode_plan`), whose
    calls can also be differentiated twice. The price is the slots: every head reads every slot
    (masked), about ``H * sum(ceil(w / r))`` rows against the per-branch calls'
    ``sum(H / r * ceil(w / r))`` (2.6x for the LongNet schedule), and they are gathered. That is
    noise on a GPU, where a token's few thousand rows take microseconds and each launch and
    merge costs more, but not on the CPU, where the per-branch calls read their rows as views
    (Note [Strided row calls]) and the gather alone took 7x the per-branch step (2 cores,
    LongNet schedule, H = 16, D = 64, float32, 16K positions: 62 ms against 8.4 ms). So the one
    call is made on ``ONE_CALL_DEVICE_TYPES`` only.

Shape legend: B batch, Nq query positions (the last of the Nk key positions), H query heads,
Hkv key/value heads, D head dim, Hc heads of one call, Lq queries and Lk keys of one call.
"""

from __future__ import annotations

import functools

import torch

from ..contract import Window
from ..geometry.calls import SliceCall, put_view
from ..geometry.plan import Plan
from ..geometry.segment import effective_branches
from ..geometry.strided import kv_head_slice
from ..higher_order import RowCall, flat_rows


class DecodeCall:
    """Query positions of one offset class against their keys in one branch and segment
    (``Call`` in ``calls.py``): the rows ``q[:, q_pos, heads]`` and, with each query head
    reading its own key/value head (GQA heads repeated), the keys and values at ``kv_pos``;
    ``causal``: the keys are the queries' own positions (a square, top-left causal call)."""

    def __init__(
        self,
        q_pos: torch.Tensor,
        heads: slice,
        kv_pos: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        *,
        causal: bool,
    ) -> None:
        self.heads, self.causal = heads, causal
        head_ids = torch.arange(num_heads, device=kv_pos.device)[heads]
        kv_heads = head_ids // (num_heads // num_kv_heads)  # (Hc,)
        # (1, Lq * Hc) and (1, Lk * Hc) in (row, head) order: the rows of q.view(B, Nq * H, D)
        # and of k.view(B, Nk * Hkv, D) the call reads.
        self.q_flat = (q_pos.view(-1, 1) * num_heads + head_ids.view(1, -1)).view(1, -1)
        self.kv_flat = (kv_pos.view(-1, 1) * num_kv_heads + kv_heads.view(1, -1)).view(1, -1)
        self.q_pos, self.kv_pos, self.call_heads = q_pos, kv_pos, head_ids.numel()

    def q_rows(self, x: torch.Tensor) -> torch.Tensor:
        return flat_rows(x, self.q_flat, self.call_heads)

    def kv_rows(self, x: torch.Tensor) -> torch.Tensor:
        return flat_rows(x, self.kv_flat, self.call_heads)

    def key_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """(B, Nk) bool -> (B, 1, Lk)."""
        return None if mask is None else mask[:, self.kv_pos].unsqueeze(1)

    def put_q(self, dest: torch.Tensor, rows: torch.Tensor, *, accumulate: bool) -> None:
        _put_flat(dest, self.q_flat, rows, accumulate)

    def put_kv(self, dest: torch.Tensor, rows: torch.Tensor, *, accumulate: bool) -> None:
        _put_flat(dest, self.kv_flat, rows, accumulate)

    def row_call(self, q: torch.Tensor, k: torch.Tensor) -> RowCall:
        heads = self.call_heads
        return RowCall(self.q_flat, self.kv_flat, heads, heads, causal=self.causal)


def _put_flat(
    dest: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, accumulate: bool
) -> None:
    """Write (or add) ``rows`` (B, L, Hc, E) into the (position, head) rows ``index`` (1, L * Hc)
    of ``dest`` (B, N, H, E), contiguous, in place."""
    batch, dim = dest.shape[0], dest.shape[-1]
    flat = dest.view(batch, -1, dim)
    src = rows.reshape(batch, -1, dim).to(dest.dtype)
    if accumulate:
        flat.index_add_(1, index.view(-1), src)
    else:
        flat.index_copy_(1, index.view(-1), src)


class DecodeViewCall:
    """:class:`DecodeCall` read through views, for a kernel that takes strided rows: the queries
    ``q[:, q_rows, heads]`` and the keys ``k[:, kv_rows, kv_heads]`` are slices with a step
    (every ``r``-th position, every ``r``-th head), no gather; the key/value heads are the call's
    own (each used by consecutive query heads: the kernel's GQA; Note [Strided row calls] in
    ``strided.py``)."""

    def __init__(
        self, q_rows: slice, heads: slice, kv_rows: slice, kv_heads: slice, *, causal: bool
    ) -> None:
        self.q_slice, self.heads, self.kv_slice, self.kv_heads = q_rows, heads, kv_rows, kv_heads
        self.causal = causal

    def q_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, self.q_slice, self.heads]

    def kv_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, self.kv_slice, self.kv_heads]

    def key_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """(B, Nk) bool -> (B, 1, Lk)."""
        return None if mask is None else mask[:, self.kv_slice].unsqueeze(1)

    def put_q(self, dest: torch.Tensor, rows: torch.Tensor, *, accumulate: bool) -> None:
        put_view(self.q_rows(dest), rows, accumulate)

    def put_kv(self, dest: torch.Tensor, rows: torch.Tensor, *, accumulate: bool) -> None:
        put_view(self.kv_rows(dest), rows, accumulate)

    def row_call(self, q: torch.Tensor, k: torch.Tensor) -> RowCall:
        device = q.device

        def flat(rows: slice, heads: slice, length: int, num_heads: int) -> torch.Tensor:
            pos = torch.arange(length, device=device)[rows].view(-1, 1)
            head = torch.arange(num_heads, device=device)[heads].view(1, -1)
            return (pos * num_heads + head).view(1, -1)

        q_index = flat(self.q_slice, self.heads, q.shape[1], q.shape[2])
        kv_index = flat(self.kv_slice, self.kv_heads, k.shape[1], k.shape[2])
        heads = len(range(q.shape[2])[self.heads])
        kv_heads = len(range(k.shape[2])[self.kv_heads])
        return RowCall(q_index, kv_index, heads, kv_heads, causal=self.causal)


#: Where one decoded token is one call (Note [One call per decoded token]).
ONE_CALL_DEVICE_TYPES = frozenset({"cuda"})


class DecodeTokenCall:
    """The one call of a decoded token (Note [One call per decoded token]): the token's query
    rows as they are against the key/value rows ``positions`` (every branch's slots side by
    side), with ``ignore`` saying which heads do not read which slots. ``positions`` (K,) and
    ``ignore`` (H, K) are the same for every batch row; (B, K) and (B, H, K) give each row its
    own (rows at different positions: Note [A decode step with static shapes] in
    ``static_cache.py``). Forward only."""

    causal = False
    reads_all_queries = True  # Plan.one_call: the call's results are the plan's

    def __init__(
        self,
        positions: torch.Tensor,
        ignore: torch.Tensor,
        batch: int,
        branches: tuple[tuple[int, int], ...] = (),
    ) -> None:
        self.positions, self.ignore, self.batch = positions, ignore, batch
        self.branches = branches  # the (w, r) whose ceil(w / r) slots lie side by side

    def q_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def kv_rows(self, x: torch.Tensor) -> torch.Tensor:
        """(B, Nk, Hkv, E) -> (B, K, Hkv, E), gathered."""
        if self.positions.dim() == 1:
            return x.index_select(1, self.positions)
        index = self.positions[:, :, None, None].expand(-1, -1, *x.shape[2:])
        return x.gather(1, index)

    def key_mask(self, mask: torch.Tensor | None) -> torch.Tensor:
        """(B, Nk) bool or None -> (B, H, K): the heads' slots, and the padded keys."""
        ignore = self.ignore.expand(self.batch, *self.ignore.shape[-2:])
        if mask is not None:
            if self.positions.dim() == 1:
                hidden = mask.index_select(1, self.positions)
            else:
                hidden = mask.gather(1, self.positions)
            ignore = ignore | hidden.unsqueeze(1)
        return ignore.contiguous()

    def put_q(self, dest: torch.Tensor, rows: torch.Tensor, *, accumulate: bool) -> None:
        put_view(dest, rows, accumulate)

    def put_kv(self, dest: torch.Tensor, rows: torch.Tensor, *, accumulate: bool) -> None:
        if self.positions.dim() != 1:
            raise RuntimeError("a decode step with per-row positions runs without gradients")
        if not accumulate:  # slots of two branches can hold the same position: add them up
            dest.index_fill_(1, self.positions, 0)
        dest.index_add_(1, self.positions, rows.to(dest.dtype))

    def row_call(self, q: torch.Tensor, k: torch.Tensor) -> RowCall:
        raise RuntimeError(
            "the one-call decoding plan runs without gradients; decoding with gradients uses "
            "the per-branch plan (core.decode.decode_plan)"
        )


@functools.cache
def token_slots(
    num_heads: int,
    segment_lengths: tuple[int, ...],
    dilation_rates: tuple[int, ...],
    device: torch.device,
) -> tuple[torch.Tensor, ...]:
    """Per slot of the one call (every branch's ``ceil(w / r)`` side by side, slot ``m`` of a
    branch): the branch's ``w`` and ``r`` (K,), ``r * m`` (K,), and ``h mod r`` (H, K); on
    ``device``, made once per schedule and kept for the process (a captured decoding step,
    kept across calls, reads them: Note [A captured step kept across calls] in
    ``models/captured.py``)."""
    slot, seg, rate = [], [], []
    for w, r in zip(segment_lengths, dilation_rates, strict=True):
        count = -(-w // r)
        slot.append(torch.arange(count))
        seg.append(torch.full((count,), w))
        rate.append(torch.full((count,), r))
    slots, segs, rates = (torch.cat(x).to(device) for x in (slot, seg, rate))
    head_class = torch.arange(num_heads, device=device).view(-1, 1) % rates.view(1, -1)
    return segs, rates, rates * slots, head_class


def token_keys(
    last: int | torch.Tensor, slots: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys a token at position ``last`` reads in the one call (Note [One call per decoded
    token]), from :func:`token_slots`' ``slots``: each slot's key position (..., K) (the token's
    own where the slot is past it) and ``ignore`` (..., H, K), True where a head does not read
    the slot. ``last``: an int, or a (B, 1) int64 tensor (one position per batch row, computed on
    its device with no host synchronization)."""
    seg, rate, stride, head_class = slots
    t0 = torch.div(last, seg, rounding_mode="floor") * seg  # each slot's segment start
    offset = last - t0
    s = offset % rate  # the token's offset class in each branch
    filled = stride <= offset - s  # the keys t0 + s, t0 + s + r, ..., last
    positions = torch.where(filled, t0 + s + stride, last)
    # (..., H, K): heads h with h mod r != s read nothing
    ignore = (head_class != s.unsqueeze(-2)) | ~filled.unsqueeze(-2)
    return positions, ignore


def decode_token_plan(
    key_len: int,
    num_heads: int,
    segment_lengths: tuple[int, ...],
    dilation_rates: tuple[int, ...],
    device: torch.device,
    key_start: int = 0,
    batch: int = 1,
) -> Plan:
    """The one-call plan of the token at position ``key_len - 1`` (Note [One call per decoded
    token]) for the layer's ``segment_lengths`` / ``dilation_rates``; ``key_start``: the
    position of the keys' first row. Built by a few tensor ops on ``device`` from per-schedule
    constants, with no host-to-device copy per token (a copy from pageable memory can stall the
    host until the GPU has caught up). The branches are the effective ones (Note [Effective
    branches]) of ``key_len`` rounded up to a power of two: a segment longer than the keys has
    the same geometry clipped at any length from ``key_len`` on, and the rounding gives the
    call, and its constants, one shape per doubling rather than a new one per token while the
    context is shorter than the longest segment (at most twice the slots there)."""
    segs, rates = effective_branches(
        1 << (key_len - 1).bit_length(), num_heads, segment_lengths, dilation_rates
    )
    positions, ignore = token_keys(key_len - 1, token_slots(num_heads, segs, rates, device))
    positions = positions - key_start
    branches = tuple(zip(segs, rates, strict=True))
    return Plan((DecodeTokenCall(positions, ignore, batch, branches),))


def static_token_plan(
    positions: torch.Tensor,
    ring_rows: int,
    slots: tuple[torch.Tensor, ...],
    segment_lengths: tuple[int, ...],
    dilation_rates: tuple[int, ...],
    row_offsets: torch.Tensor | None = None,
) -> Plan:
    """The one-call plan of one token per batch row at ``positions`` (B,) int64, against
    buffers holding key position ``x`` of row ``b`` at row ``(x + row_offsets[b]) mod
    ring_rows`` (Note [A decode step with static shapes] in ``static_cache.py``; offsets: a
    left-padded row's padding slots, None: 0); ``segment_lengths`` / ``dilation_rates``: the
    effective branches every step reads. Device arithmetic only: no host synchronization, and
    the same shapes at every position. ``slots``: :func:`token_slots` of the branches."""
    keys, ignore = token_keys(positions.view(-1, 1), slots)  # (B, K), (B, H, K)
    if row_offsets is not None:
        keys = keys + row_offsets.view(-1, 1)
    branches = tuple(zip(segment_lengths, dilation_rates, strict=True))
    return Plan((DecodeTokenCall(keys % ring_rows, ignore, positions.shape[0], branches),))


@functools.lru_cache(maxsize=64)
def decode_plan(
    query_len: int,
    key_len: int,
    num_heads: int,
    num_kv_heads: int,
    segment_lengths: tuple[int, ...],
    dilation_rates: tuple[int, ...],
    device: torch.device,
    key_start: int = 0,
    views: bool = False,
) -> Plan:
    """The executor's plan for the queries at the last ``query_len`` of ``key_len`` positions
    (Note [Decoding rows]); ``segment_lengths`` / ``dilation_rates`` are the effective branches
    of ``key_len`` positions. Per (branch, segment, offset class) with queries: a call for the
    keys before the first query and a causal call for the queries' own keys (one call when
    there is one query). ``key_start``: the position of the keys' first row (a cache holds the
    later rows only; every key a call reads is at or after it). ``views``: the kernel takes
    strided rows, so calls read slices (:class:`DecodeViewCall`) where the key/value heads of an
    offset class are one strided slice."""
    calls: list = []
    first = key_len - query_len

    def positions(lo: int, hi: int, step: int, origin: int) -> torch.Tensor:
        return torch.arange(lo - origin, hi - origin, step, device=device)

    def call(q_lo: int, hi: int, kv_lo: int, kv_hi: int, r: int, s: int, causal: bool) -> None:
        heads = slice(s, num_heads, r)
        kv_heads = kv_head_slice(s, r, num_heads, num_kv_heads) if views else None
        if kv_heads is not None:
            q_rows = slice(q_lo - first, hi - first, r)
            kv_rows = slice(kv_lo - key_start, kv_hi - key_start, r)
            calls.append(DecodeViewCall(q_rows, heads, kv_rows, kv_heads, causal=causal))
            return
        q_pos, kv_pos = positions(q_lo, hi, r, first), positions(kv_lo, kv_hi, r, key_start)
        calls.append(DecodeCall(q_pos, heads, kv_pos, num_heads, num_kv_heads, causal=causal))

    for w, r in zip(segment_lengths, dilation_rates, strict=True):
        for t0 in range((first // w) * w, key_len, w):
            lo, hi = max(first, t0), min(key_len, t0 + w)  # the chunk's positions in the segment
            for s in range(min(r, num_heads)):
                q_lo = t0 + s + -(-(lo - t0 - s) // r) * r  # the first query of class s
                if q_lo >= hi:
                    continue
                if q_lo + r >= hi:  # one query: every key up to it, no mask
                    call(q_lo, hi, t0 + s, q_lo + 1, r, s, causal=False)
                    continue
                if q_lo > t0 + s:  # keys before the first query: seen by every query
                    call(q_lo, hi, t0 + s, q_lo, r, s, causal=False)
                call(q_lo, hi, q_lo, hi, r, s, causal=True)
    return Plan(tuple(calls))


@functools.lru_cache(maxsize=64)
def dense_decode_plan(
    query_len: int, key_len: int, window: tuple[int, int] | None = None
) -> Plan:
    """The executor's plan of causal dense attention for queries at the last ``query_len`` of
    ``key_len`` positions (``query_len < key_len``; the public convention, Note [Decoding rows]):
    query row ``i`` is position ``key_len - query_len + i`` and sees the keys up to it. The
    kernels' causal mask is top-left (query ``i`` sees key ``j <= i``), so the keys before the
    first query are one call without a mask and the queries' own positions one square causal
    call; one query is a single call against every key. With a local ``window`` ``(left,
    right)`` over the positions (Note [Local windows, soft-capping and sinks] in ``sinks.py``)
    it is one call over the keys from ``left`` positions before the first query: a windowed
    layer's decoding reads its window, not every key."""
    first, rows = key_len - query_len, slice(0, query_len)
    if window is None:
        if query_len == 1:
            return Plan.dense(False)
        return Plan(
            (SliceCall(rows, slice(0, first), False), SliceCall(rows, slice(first, key_len), True))
        )
    left, right = window
    low = 0 if left < 0 else max(0, first - left)
    # One call over the keys the window reaches, causality as the window's right side: the
    # queries are its last rows (bottom-right, Note [Scores a kernel call transforms]).
    return Plan((SliceCall(rows, slice(low, key_len), False, Window(left, min(right, 0))),))
