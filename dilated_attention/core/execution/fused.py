"""The engine of the dilated registry's plan kernel: whole dilated branches run in place.

Note [Fused branch engine]
    A fused backend reads every branch's rows straight from q, k, v through strides (no gather),
    merges its result into the running ``(out, lse)`` and, backward, adds its gradients into dq,
    dk, dv itself (Note [Strided dilated rows] in ``backends/triton_kernels/launchers.py``). What is
    left to the engine is where those running values live. Keeping them in float32 for the whole
    sequence would cost 2x the output (and 2x dq, dk, dv) on top of the tensors that cannot be
    avoided; instead the sequence is cut into position groups that no segment of any branch crosses
    (multiples of the least common multiple of the segment lengths), and each group is finished
    before the next starts: float32 scratch for one group, every branch launched over it. A
    rate-1 branch covers every row, so it runs last and its merge writes the finished rows straight
    into the output (in the output's dtype: no cast pass); the scratch rows it reads that no earlier
    branch wrote have ``lse = -inf``, weight zero, and are never summed, so the scratch needs no
    zeroing. Without a rate-1 branch the scratch starts at zero and is cast into the output at the
    end. Where a group is long against the sequence (segments as long as the sequence make one group
    of it all; LongNet's 32K segments make two of 64K tokens), the heads are split too
    (``head_groups``: whole key/value head groups, each launch told which layer head it starts at,
    so offsets stay ``h mod r``) until the scratch of one (position group, head group) takes at most
    1/SCRATCH_SHARE of the bytes every implementation holds (``scratch_fraction``: q, k, v and out
    forward, with dout and the three gradients backward), so the peak stays near 1.13x those bytes
    forward and 1.10x forward+backward at any length, with GQA too. Splitting has a price where the
    launches are small: every head group launches every branch again, and each launch costs host
    time. So one scratch tensor may always hold MIN_SCRATCH_HEADS heads of MIN_GROUP_POSITIONS rows
    (enough programs for every branch to fill a GPU): below 64K tokens of 16 heads the scratch is
    then a larger share of a small q. Both splits leave every row's arithmetic as it is (programs
    tile rows within a segment, segments start at group starts), so the results do not depend on
    them.

    Backward, the order is reversed: a rate-1 branch runs first and writes (rather than adds)
    every row of the float32 dq, dk, dv scratch, the other branches add into it, and the scratch
    is cast into the gradients at the end. So no buffer is zero-filled when a rate-1 branch
    exists (Note [Strided dilated rows]: each row of a launch is written by one program); without
    one the scratch starts at zero. The gradients themselves are written whole, group by group.

    Special cases: a single branch writes straight into the output (each row is written once); the
    merged ``lse`` is float32 already and is written in place for the whole sequence.

    A caller with more results for some rows (ring dilated attention's branches that span ranks)
    passes ``extra``: it is called once per (position group, head group) with the float32 scratch,
    after every branch but a final rate-1 one (forward) or after every branch (backward), so
    those results join the running values before the single rounding into the output's dtype.
    Forward, the scratch rows no branch has reached yet hold whatever memory held, with
    ``lse = -inf``; the callback must give them weight zero without reading them.

Note [A chunk in one fused forward]
    Chunked prefill gives a call the queries at positions ``c .. N - 1`` and the keys so far (a
    cache's held rows). In branch ``(w, r)`` the query at ``p`` reads the keys of its segment,
    which starts at ``(p // w) * w``; so each branch's segments, counted from the start of the
    first query's segment, are the branch's segments of the whole sequence, and the causal mask
    within a segment compares rows as in the full forward. The kernels take the position of
    the first query (``q_row0``): tiles wholly before it return at once, rows before it are
    neither loaded nor stored, and q, out and lse hold the chunk's rows only. So a chunk is one
    forward of the fused engine: one launch per branch, merged in place as in the whole
    sequence's forward, reading the earlier keys where they lie, with no work or memory for the
    positions before the chunk. A launch whose first query is not its first row reads rows
    through pointers (the tensor descriptors' boxes would start before it). Forward only: a
    chunk that needs gradients runs decoding rows (Note [Decoding rows] in ``decode.py``).

Shape legend: B batch, N seq_len, H query heads, Hkv key/value heads, D head dim, Nc positions in a
group, Nq a chunk's queries.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..contract import BranchSpan, FusedBackend
from .fused_heads import backward_heads, branches_backward, forward_heads
from .packed_spans import Spans, group_size, packed_spans

#: A group holds at least this many positions (enough programs per launch to fill a GPU) ...
MIN_GROUP_POSITIONS = 32768
#: ... and at most 1/GROUPS_PER_SEQUENCE of the sequence beyond that (scratch <= q / 8 in bf16).
GROUPS_PER_SEQUENCE = 16
#: Heads are split until the float32 scratch takes at most 1/SCRATCH_SHARE of the bytes every
#: implementation holds (:func:`scratch_fraction`), or one key/value head group, or
#: MIN_SCRATCH_HEADS heads of MIN_GROUP_POSITIONS rows, whichever is more (Note [Fused branch
#: engine]).
SCRATCH_SHARE = 8
MIN_SCRATCH_HEADS = 4


#: ``extra`` of :func:`fused_forward`: ``(scratch, lse, start, end, h0, h1)``, scratch
#: (B, end - start, h1 - h0, D) float32 for positions [start, end) and heads [h0, h1), lse the
#: whole (B, H, N) merged lse; merges more results into both in place.
ForwardExtra = Callable[[torch.Tensor, torch.Tensor, int, int, int, int], None]
#: ``extra`` of :func:`fused_backward`: ``(dq, dk, dv, start, end, h0, h1)``, float32 scratch
#: (B, end - start, h1 - h0, D) and (B, end - start, (h1 - h0) / G, D); adds more gradients in.
BackwardExtra = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int, int, int], None]


def position_groups(
    seq_len: int, segment_lengths: tuple[int, ...], min_positions: int | None = None
) -> list[tuple[int, int]]:
    """Consecutive ``[start, end)`` ranges covering ``[0, seq_len)`` that no segment crosses.

    Every start is a multiple of every (clipped) segment length, so each branch's segments inside
    a group start at the group's start. ``min_positions`` (default :data:`MIN_GROUP_POSITIONS`)
    sets the smallest group; tests lower it.
    """
    floor = MIN_GROUP_POSITIONS if min_positions is None else min_positions
    size = group_size(seq_len, segment_lengths, floor, GROUPS_PER_SEQUENCE)
    if size >= seq_len:
        return [(0, seq_len)]
    return [(start, min(start + size, seq_len)) for start in range(0, seq_len, size)]


@dataclass(frozen=True)
class ChunkQueries:
    """Queries at the last positions of the keys (Note [A chunk in one fused forward]): q's row
    0 is k's row ``first``, and k's row 0 is position ``origin`` of the sequence (a cache's
    first held row), from which the segments of every branch are counted."""

    first: int
    origin: int

    def segment_start(self, segment_len: int) -> int:
        """The k row where the segment of the first query starts in a branch of
        ``segment_len``."""
        return (self.origin + self.first) // segment_len * segment_len - self.origin


def _spans(
    seq_len: int,
    branches: tuple[tuple[int, int], ...],
    min_positions: int | None,
    documents: tuple[int, ...] | None,
    device: torch.device,
    chunk: ChunkQueries | None = None,
) -> list[Spans]:
    """The position groups of a call and each branch's span over them: equal segments from
    each group's start; for packed documents the segments of each document's own (Note
    [Packed documents in the fused engine] in ``packed_spans.py``); for a chunk one group of
    its queries, each branch from the start of the first query's segment (Note [A chunk in
    one fused forward])."""
    if chunk is not None:
        spans = (BranchSpan(chunk.segment_start(w), seq_len, w, r) for w, r in branches)
        return [(chunk.first, seq_len, tuple(spans))]
    if documents is None:
        limits = (MIN_GROUP_POSITIONS, GROUPS_PER_SEQUENCE)  # the cache sees changed limits
        return _sequence_spans(seq_len, branches, min_positions, limits)
    floor = MIN_GROUP_POSITIONS if min_positions is None else min_positions
    return packed_spans(documents, branches, floor, GROUPS_PER_SEQUENCE, device)


@functools.lru_cache(maxsize=256)  # every call of a shape asks again
def _sequence_spans(
    seq_len: int,
    branches: tuple[tuple[int, int], ...],
    min_positions: int | None,
    limits: tuple[int, int],
) -> list[Spans]:
    """The position groups of one sequence per row and each branch's span over them: equal
    segments from each group's start. ``limits``: the module's group limits when asked."""
    segs = tuple(w for w, _ in branches)
    return [
        (start, end, tuple(BranchSpan(start, end, min(w, seq_len), r) for w, r in branches))
        for start, end in position_groups(seq_len, segs, min_positions)
    ]


def scratch_fraction(kv_group: int, backward: bool) -> float:
    """The share of q's (position, head) cells that float32 scratch may cover at once: 1 /
    SCRATCH_SHARE of the bytes every implementation holds (q, k, v, out; backward also dout and
    the three gradients), counted in 16-bit q cells (2 + 2 / G forward, twice that backward, G
    query heads per key/value head), over the scratch's bytes per cell (a float32 output: 2;
    float32 dq, dk, dv: 2 + 4 / G). Forward 1/4 of the cells (GQA with G = 4: 0.16), backward
    1/6 (0.21)."""
    unavoidable = (2 + 2 / kv_group) * (2 if backward else 1)
    per_cell = 2 + (4 / kv_group if backward else 0)
    return unavoidable / SCRATCH_SHARE / per_cell


def head_groups(
    heads: int,
    kv_group: int,
    rows: int,
    seq_len: int,
    min_positions: int | None = None,
    backward: bool = False,
) -> list[tuple[int, int]]:
    """Consecutive ``[h0, h1)`` head ranges for one position group of ``rows`` positions.

    Each range holds whole key/value head groups (``kv_group`` query heads each) and all ranges
    are equal; the widest split whose ``rows * (h1 - h0)`` is at most
    ``max(seq_len * heads * scratch_fraction(kv_group, backward), min_positions *
    MIN_SCRATCH_HEADS)`` (Note [Fused branch engine]), or one key/value head group where even
    that is more.
    """
    floor = MIN_GROUP_POSITIONS if min_positions is None else min_positions
    share = scratch_fraction(kv_group, backward)
    budget = max(int(seq_len * heads * share), floor * MIN_SCRATCH_HEADS)
    kv_heads = heads // kv_group
    per = kv_heads
    while per > 1 and (rows * per * kv_group > budget or kv_heads % per):
        per -= 1
    width = per * kv_group
    return [(h0, h0 + width) for h0 in range(0, heads, width)]


def _ordered(branches: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """Branches with a rate-1 branch last: it covers every row, so its merge can write the
    finished rows straight into the output (Note [Fused branch engine])."""
    return tuple(sorted(branches, key=lambda wr: wr[1] == 1))


#: One position group, its branches' spans and its head groups (none for a single branch).
Group = tuple[int, int, tuple[BranchSpan, ...], list[tuple[int, int]]]


def _groups(
    spans: list[Spans], heads: int, kv_group: int, seq_len: int, single: bool,
    min_positions: int | None, backward: bool,
) -> list[Group]:  # fmt: skip
    """Each position group with its head groups (:func:`head_groups`; none where a single
    branch writes the output itself)."""
    return [
        (start, end, group_spans, [] if single else
         head_groups(heads, kv_group, end - start, seq_len, min_positions, backward))
        for start, end, group_spans in spans
    ]  # fmt: skip


def _scratch(groups: list[Group], per_head: int, *widths: int) -> list[int]:
    """The float32 cells of the largest (position group, head group) of each scratch tensor:
    ``per_head`` cells per row and head, ``widths[i]`` heads of scratch ``i`` per query head
    (1 for out and dq; 1 / G for dk and dv, given as G)."""
    sizes = [0] * len(widths)
    for start, end, _, ranges in groups:
        for h0, h1 in ranges:
            for i, width in enumerate(widths):
                sizes[i] = max(sizes[i], (end - start) * (h1 - h0) // width * per_head)
    return sizes


def _limits() -> tuple[int, int, int, int]:
    """The module's group limits, part of every graph key (tests change them)."""
    return (MIN_GROUP_POSITIONS, GROUPS_PER_SEQUENCE, SCRATCH_SHARE, MIN_SCRATCH_HEADS)


@dataclass(frozen=True)
class FusedPlan:
    """What one direction of a fused call derives from its shapes and options, made once
    (Note [A fused call planned once]).

    Attributes:
        branches: the ``(w, r)`` pairs in launch order (Note [Fused branch engine]).
        spans: the position groups and each branch's span over them.
        groups: those groups with their head groups.
        cells: the float32 scratch cells: ``(out,)`` forward, ``(dq, dk)`` backward (dv as dk).
        longest: backward, the rows of the longest group (its ``delta``); 0 forward.
        covers_all: a rate-1 branch covers every row; single: one branch and no ``extra``.
        kv_group: query heads per key/value head.
        key: what, with the tensors' addresses, decides every launch (Note [A call's
            launches from a CUDA graph] in ``graphs.py``); None with ``extra`` (its launches
            are the caller's).
    """

    branches: tuple[tuple[int, int], ...]
    spans: tuple[Spans, ...]
    groups: tuple[Group, ...]
    cells: tuple[int, ...]
    longest: int
    covers_all: bool
    single: bool
    kv_group: int
    key: tuple[Any, ...] | None


@functools.lru_cache(maxsize=256)
def _plan(
    backward: bool, batch: int, rows: int, heads: int, kv_heads: int, dim: int,
    branches: tuple[tuple[int, int], ...], device: torch.device, is_causal: bool, scale: float,
    chunk: ChunkQueries | None, documents: tuple[int, ...] | None, first_head: int,
    softcap: float | None, min_positions: int | None, extra: bool, limits: tuple[int, ...],
) -> FusedPlan:  # fmt: skip
    """:func:`fused_forward`'s plan, or with ``backward`` :func:`fused_backward`'s (a rate-1
    branch first: Note [Fused branch engine]; no ``chunk``); ``limits``: :func:`_limits`,
    which it depends on.

    Note [A fused call planned once]
        Everything a fused call derives from its shapes and options (the branches' order, the
        position and head groups, the scratch's size, the key its launches are replayed
        under) is made once per (shapes, options) and kept, as flashinfer plans once and runs
        many: a call whose plan is kept allocates its outputs and scratch and replays or
        makes its launches, and nothing more (every layer of a model asks again, every step).
        Packed documents' plans are made per call: a batch's documents change every step, and
        ``packed_spans`` keeps their segment tables.
    """
    seq_len = rows if chunk is None else chunk.first + rows
    ordered = _ordered(branches)[::-1] if backward else _ordered(branches)
    single = len(ordered) == 1 and not extra
    kv_group = heads // kv_heads
    spans = _spans(seq_len, ordered, min_positions, documents, device, chunk)
    groups = _groups(spans, heads, kv_group, seq_len, single, min_positions, backward)
    key = None if extra else (
        "fused_backward" if backward else "fused_forward", ordered, is_causal, scale, chunk,
        documents, first_head, softcap, min_positions, limits,
    )  # fmt: skip
    longest = max(end - start for start, end, _, _ in groups) if backward else 0
    cells = tuple(_scratch(groups, batch * dim, 1, *((kv_group,) if backward else ())))
    covers_all = any(rate == 1 for _, rate in ordered)  # last forward, first backward
    return FusedPlan(ordered, tuple(spans), tuple(groups), cells, longest, covers_all, single,
                     kv_group, key)  # fmt: skip


def _kept(documents: tuple[int, ...] | None) -> Callable[..., FusedPlan]:
    """:func:`_plan`, kept per arguments, or made afresh for packed documents: a batch's
    documents change every step, and their segment tables are kept by ``packed_spans``
    already."""
    return _plan.__wrapped__ if documents is not None else _plan  # type: ignore[attr-defined]


def fused_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    branches: tuple[tuple[int, int], ...],
    backend: FusedBackend,
    *,
    is_causal: bool,
    scale: float,
    min_group_positions: int | None = None,
    out_dtype: torch.dtype | None = None,
    extra: ForwardExtra | None = None,
    documents: tuple[int, ...] | None = None,
    first_head: int = 0,
    chunk: ChunkQueries | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every branch merged (LongNet Eq. 10), group by group (Note [Fused branch engine]); the
    buffers allocated first, then the launches, replayed from a CUDA graph where the backend
    can (Note [A call's launches from a CUDA graph] in ``graphs.py``).

    Args:
        q: (B, Nq, H, D); k, v: (B, N, Hkv, D); stride(-1) == 1; ``Nq == N`` but for a chunk.
        key_padding_mask: (B, N) bool, ``True`` = ignore, or None.
        branches: ``(segment_len, rate)`` pairs.
        out_dtype: dtype of ``out`` (default q's; float32 where more results merge in later).
        extra: merges more results into the float32 running values (Note [Fused branch engine]).
        documents: packed documents' offsets (B = 1; Note [Packed documents in the fused
            engine]), or None.
        first_head: the layer head that q's head 0 is (Note [Heads from a later layer head]).
        chunk: queries at the last ``Nq`` of the ``N`` positions (causal, no ``extra`` or
            ``documents``; Note [A chunk in one fused forward]), or None.
        softcap: every branch's scores soft-capped (Note [Scores a kernel call transforms]).

    Returns:
        ``out`` (B, Nq, H, D) and ``lse`` (B, H, Nq) float32 (``-inf`` where no key).
    """
    batch, rows, heads, dim = q.shape
    first = 0 if chunk is None else chunk.first  # the position of q's row 0
    plan = _kept(documents)(
        False, batch, rows, heads, k.shape[2], dim, branches, q.device, is_causal, scale, chunk,
        documents, first_head, softcap, min_group_positions, extra is not None, _limits(),
    )  # fmt: skip
    groups, covers_all, single = plan.groups, plan.covers_all, plan.single
    key_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(1)
    lse = torch.empty((batch, heads, rows), dtype=torch.float32, device=q.device)
    out = torch.empty(q.shape, dtype=out_dtype or q.dtype, device=q.device)
    (cells,) = plan.cells
    scratch = torch.empty(cells, dtype=torch.float32, device=q.device) if cells else None
    options = {"scale": scale, "is_causal": is_causal, "q_row0": first, "softcap": softcap}

    def launches() -> None:
        lse.fill_(float("-inf"))
        if single and not covers_all:
            out.zero_()
        for start, end, group_spans, ranges in groups:
            if single:
                backend.forward_branch(
                    q, k, v, out, lse, key_mask, group_spans[0], out_row0=first, merge=False,
                    head0=first_head, **options,
                )  # fmt: skip
            for h0, h1 in ranges:
                forward_heads(
                    backend, plan, (q, k, v, out, lse, key_mask), scratch,  # type: ignore[arg-type]
                    (start, end, group_spans), (h0, h1), first_head, extra, options,
                )  # fmt: skip

    tensors = (q, k, v, key_mask, out, lse, scratch)
    backend.run_launches(plan.key, tensors, launches, keep=plan.spans)
    return out, lse


def fused_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    branches: tuple[tuple[int, int], ...],
    backend: FusedBackend,
    *,
    is_causal: bool,
    scale: float,
    min_group_positions: int | None = None,
    grad_dtype: torch.dtype | None = None,
    extra: BackwardExtra | None = None,
    documents: tuple[int, ...] | None = None,
    first_head: int = 0,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact gradients of :func:`fused_forward` with the merged ``out`` and ``lse``; buffers
    first, then the launches, as in :func:`fused_forward`.

    Args:
        dout, out: (B, N, H, D); lse: (B, H, N) merged.
        grad_dtype: dtype of the gradients (default the inputs'; float32 where more add in).
        extra: adds more gradients into the float32 scratch (Note [Fused branch engine]).
        documents, first_head, softcap: as in :func:`fused_forward`.

    Returns:
        ``(dq, dk, dv)`` shaped like ``(q, k, v)``.
    """
    batch, seq_len, heads, dim = q.shape
    plan = _kept(documents)(
        True, batch, seq_len, heads, k.shape[2], dim, branches, q.device, is_causal, scale, None,
        documents, first_head, softcap, min_group_positions, extra is not None, _limits(),
    )  # fmt: skip
    groups, covers_all, single = plan.groups, plan.covers_all, plan.single
    key_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(1)
    dq, dk, dv = (torch.empty_like(x, dtype=grad_dtype or x.dtype) for x in (q, k, v))
    delta = torch.empty(batch, heads, plan.longest, dtype=torch.float32, device=q.device)
    q_cells, kv_cells = plan.cells
    scratch = (
        torch.empty(q_cells + 2 * kv_cells, dtype=torch.float32, device=q.device)
        if q_cells else None
    )  # fmt: skip
    options = {"scale": scale, "is_causal": is_causal, "softcap": softcap}

    def launches() -> None:
        if single and not covers_all:
            for grad in (dq, dk, dv):
                grad.zero_()
        for start, end, group_spans, ranges in groups:
            rows = end - start
            group_delta = delta[:, :, :rows]
            backend.row_delta(out, dout, start, end, group_delta)
            if single:
                branches_backward(
                    backend, (dout, q, k, v, lse, group_delta), key_mask, (dq, dk, dv),
                    group_spans[:1], options, delta_row0=start, grad_row0=0, accumulate=False,
                    head0=first_head,
                )  # fmt: skip
            for h0, h1 in ranges:
                backward_heads(backend, plan, (dout, q, k, v, lse, group_delta, key_mask),
                                (dq, dk, dv), scratch,  # type: ignore[arg-type]
                                (start, end, group_spans), (h0, h1), first_head, extra,
                                options)  # fmt: skip

    tensors = (dout, q, k, v, out, lse, key_mask, dq, dk, dv, delta, scratch)
    backend.run_launches(plan.key, tensors, launches, keep=plan.spans)
    return dq, dk, dv
