"""MoBA's choice of key blocks on the GPU in one pass over the affinities (Note [Top blocks in
registers]). Imported on first use, because it needs the ``triton`` package.

Note [Top blocks in registers]
    ``select_blocks`` keeps, per query block, its own blocks and the ``topk`` candidates of
    highest affinity (Note [MoBA's gate for a block of queries] in ``sparse/selection.py``).
    With torch operations that is a NaN clean-up, a masked fill and ``topk`` over the whole
    (B, H, Mq, Mk) float32 affinity, then a scatter: 2 ms of a 3.3 ms selection on an H100 at
    262,144 tokens, 24 of 36 ms at 1M. Here one program takes a row: the ``topk`` best columns
    lie in the ``topk`` groups of ``G`` columns with the best maxima (each better column's group
    has a better maximum; equal ones go to the lower column, as the lower group). A first pass
    reads the row ``CHUNK`` columns at a time (its candidates only) and stores each group's
    maximum to a scratch row; the second takes the ``topk`` best group maxima, then the
    ``topk`` best of those groups' columns, read again (from the cache), the lowest column
    among equal ones: ``Mk / G + G topk`` values ranked for a row, not ``Mk``. ``G`` is the
    power of two that ranks the fewest (``Mk / G`` groups between ``topk`` and 256, ``G`` at
    most 64; :func:`group_width`): on an H100, 16 heads, ``topk`` 15 of 512 columns and rows
    took 27 us in groups of 8 against 52 in groups of 32, ``topk`` 63 of 2,048 1.05 ms in
    groups of 8 against 2.37 in groups of 32, the same picks. Each ranking is one bitonic
    top-k (Triton's ``tl.topk``) of one int64 per value, the score's bits turned to order as
    integers above the column's complement (:func:`_ranked`): the order is the score's and
    then the lower column's, with no second reduction for ties. Taking the maximum ``topk``
    times instead (two reductions each: the maximum, then its lowest column) took, on an
    H200, 16 heads, whole choices at 64K / 256K / 1M tokens, 0.21 / 1.12 / 9.20 ms against
    0.18 / 0.96 / 8.99 with ``topk`` 15 / 31 / 31, and 1.62 / 16.4 against 1.17 / 15.1 ms with
    ``topk`` 63 at 256K / 1M. A program is one warp up to 1,024 columns and two above: a
    wider program spends its time waiting on its reductions (one program of 8 warps holding
    the whole row took 6.5 ms at 1M tokens; on an H100, 16 heads, ``topk`` 15, one warp took
    33 / 53 / 182 us at 256 / 512 / 1,024 columns and rows, two warps 56 / 73 / 203 us). A
    NaN affinity ranks below every number and above the non-candidates, as the torch path
    ranks it.

Note [Chosen blocks as indices]
    Block-sparse kernels walk lists of key blocks; a bool (B, H, Mq, Mk) mask makes every
    list as wide as ``Mk`` (its longest row is not known without reading it on the host).
    The choice knows its widths: ``topk`` picks and the row's own blocks, a run of at most
    ``own_width`` consecutive columns (the blocks a query block overlaps, 1 or 2). So the
    program can write its row as ``topk + own_width`` int32 block indices instead, picks
    first, then the own run, ``-1`` where a row has fewer, in no particular order: no bool
    mask, no compaction, and lists of ``topk + own_width`` entries per row downstream.

Note [Candidates by position]
    Without packed documents a query block's candidates and own blocks follow from its
    position alone: causal, the key blocks before the one holding its first position, and
    the blocks from there to the one holding its last; not causal, every block and none.
    Made as (Mq, Mk) masks they cost ten small launches per choice (at 64K tokens more host
    time than the GPU spends on them) and a read of two mask rows per row. So the program
    takes the positions instead (:class:`RowRanges`: the first query block's index, the
    query's shift against the keys, the block size, the key length) and compares columns
    with its row's two bounds; masks are read only where documents cut the rows.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..launch import launch_recorded, run_site, site_key
from ..tiles import next_power_of_2

#: The most key blocks a row may have: its group maxima are held at once (256 of 64 columns).
MAX_COLUMNS = 16384

#: Columns a program reads at a time in its first pass, and its warps (one row per program):
#: one up to ``_ONE_WARP_COLUMNS`` columns, else ``_WARPS``.
_CHUNK = 1024
_WARPS = 2
_ONE_WARP_COLUMNS = 1024
#: The most groups a row holds and the widest group (Note [Top blocks in registers]).
_MOST_GROUPS = 256
_MOST_GROUP = 64


_LOWEST = tl.constexpr(-3.4028234663852886e38)  # a NaN affinity ranks here: below every number


@triton.jit
def _row_masks(candidates, own, cols, valid, lo, hi, RANGES: tl.constexpr):
    """Which of a row's ``cols`` are candidates and which its own blocks: read from the
    ``candidates`` and ``own`` rows, or with ``RANGES`` the columns below ``lo`` and those from
    ``lo`` to ``hi`` (Note [Candidates by position])."""
    if RANGES:
        allowed = valid & (cols < lo)
        keep = valid & (cols >= lo) & (cols <= hi)
    else:
        allowed = tl.load(candidates + cols, mask=valid, other=0) != 0
        keep = tl.load(own + cols, mask=valid, other=0) != 0
    return allowed, keep


@triton.jit
def _scores(affinity, allowed, cols):
    """A row's affinities at ``cols`` (any shape), ``-inf`` where not ``allowed``, the lowest
    number where NaN."""
    score = tl.load(affinity + cols, mask=allowed, other=0.0)
    score = tl.where(score != score, _LOWEST, score)
    return tl.where(allowed, score, float("-inf"))


#: The rank (:func:`_ranked`) of ``-inf`` with the lowest key: every ``-inf`` ranks at most here.
_UNRANKED = tl.constexpr(-9187343241983295489)


@triton.jit
def _ranked(score, key):
    """``score`` (float32, no NaN) and ``key`` (int32 in ``[0, 2**31)``), any shape, as one
    int64 that orders as the score and then as the lower key: the score's bits turned to order
    as integers (``-0.0`` as ``0.0``) above the key's complement."""
    bits = tl.where(score == 0.0, 0.0, score).to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - key).to(tl.int64)


@triton.jit
def _best_of_row(score, key, topk, NONE: tl.constexpr, PICKS: tl.constexpr):
    """One row's ``topk`` (at most ``PICKS``) best of ``score`` (C,), C a power of two at least
    ``PICKS``, the lowest ``key`` among equal ones: their keys (PICKS,), ``NONE`` where fewer
    are above ``-inf`` (Note [Top blocks in registers])."""
    top = tl.topk(_ranked(score, key), PICKS)  # descending
    slot = tl.arange(0, PICKS)
    first = 0x7FFFFFFF - (top & 0x7FFFFFFF).to(tl.int32)
    return tl.where((top > _UNRANKED) & (slot < topk), first, NONE)


@triton.jit
def _row_bounds(row, first_row, shift, block_size, key_len, cols, causal):
    """Query blocks ``row`` (any shape): their candidates are the columns below ``lo``, their
    own blocks ``lo .. hi`` (Note [Candidates by position])."""
    position = (first_row + row) * block_size + shift  # the query block's first position
    lo = tl.where(causal != 0, position // block_size, cols)
    hi = tl.where(causal != 0, tl.minimum(position + block_size - 1, key_len - 1) // block_size,
                  -1)  # fmt: skip
    return lo, hi


@triton.jit
def _top_blocks_kernel(
    affinity, candidates, own, chosen, maxima,
    cols, heads, rows, topk,
    s_ab, s_ah, s_ar,
    s_cb, s_ch, s_cr,
    s_ob, s_oh, s_or,
    s_xb, s_xh, s_xr,
    own_width, first_row, shift, block_size, key_len, causal,
    CHUNK: tl.constexpr,
    GROUP: tl.constexpr,
    GROUPS: tl.constexpr,
    PICKS: tl.constexpr,
    OWN: tl.constexpr,
    INDICES: tl.constexpr,
    RANGES: tl.constexpr,
):  # fmt: skip
    """Program ``bh * rows + r``: row ``r`` of batch row and head ``bh`` (Note [Top blocks in
    registers]); ``INDICES``: the row as block indices (Note [Chosen blocks as indices]),
    else as a bool row. ``maxima``: (programs, GROUPS) float32 scratch. ``RANGES``: the
    candidates and own blocks by position, query block ``first_row + r`` (Note [Candidates
    by position]), else read from ``candidates`` and ``own``."""
    program = tl.program_id(0).to(tl.int64)
    bh, r = program // rows, program % rows
    b, h = bh // heads, bh % heads
    affinity += b * s_ab + h * s_ah + r * s_ar
    candidates += b * s_cb + h * s_ch + r * s_cr
    own += b * s_ob + h * s_oh + r * s_or
    chosen += b * s_xb + h * s_xh + r * s_xr
    maxima += program * GROUPS
    lo, hi = _row_bounds(r, first_row, shift, block_size, key_len, cols, causal)
    first = cols
    owned = 0
    # Pass 1, CHUNK columns at a time: the row's own blocks, and each group's maximum.
    for start in range(0, GROUPS * GROUP, CHUNK):  # every group's maximum, -inf past cols
        col = start + tl.arange(0, CHUNK)
        inside = col < cols
        allowed, keep = _row_masks(candidates, own, col, inside, lo, hi, RANGES)
        if INDICES:
            first = tl.minimum(first, tl.min(tl.where(keep, col, cols), axis=0))
            owned += tl.sum(keep.to(tl.int32), axis=0)
        else:
            tl.store(chosen + col, keep.to(tl.int8), mask=inside)
        score = _scores(affinity, allowed, col)
        group = start // GROUP + tl.arange(0, CHUNK // GROUP)
        best = tl.max(tl.reshape(score, (CHUNK // GROUP, GROUP)), axis=1)
        tl.store(maxima + group, best, mask=group < GROUPS)
    if INDICES:
        run = tl.arange(0, OWN)
        tl.store(chosen + topk + run, tl.where(run < owned, first + run, -1), mask=run < own_width)
    tl.debug_barrier()  # the maxima are stored before they are read back
    slot = tl.arange(0, PICKS)
    # Pass 2: the best PICKS groups by their maxima hold the row's best PICKS columns.
    group = tl.arange(0, GROUPS)
    best = tl.load(maxima + group)
    taken = _best_of_row(best, group, topk, GROUPS, PICKS)
    where = taken[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # (PICKS, GROUP) columns
    where = tl.reshape(where, (PICKS * GROUP,))
    allowed, _ = _row_masks(candidates, own, where, where < cols, lo, hi, RANGES)
    score = _scores(affinity, allowed, where)
    picked = _best_of_row(score, where, topk, GROUPS * GROUP, PICKS)
    if INDICES:
        tl.store(chosen + slot, tl.where(picked < cols, picked, -1), mask=slot < topk)
    else:
        tl.debug_barrier()  # the row's own blocks are stored before the picks are set
        tl.store(chosen + picked, tl.full((PICKS,), 1, tl.int8), mask=picked < cols)


@functools.cache
def group_width(cols: int, topk: int) -> int:
    """Columns per group of a row of ``cols`` for ``topk`` picks (Note [Top blocks in
    registers]): the power of two ``G`` with the fewest ``cols / G + picks * G`` (the larger
    of equal ones), ``picks`` the picks rounded up to a power of two, among those that leave
    between ``picks`` and ``_MOST_GROUPS`` groups with ``G <= _MOST_GROUP``; the widest that
    leaves ``picks`` groups where none does."""
    block, picks = next_power_of_2(cols), next_power_of_2(max(1, topk))
    widths = [1 << i for i in range(_MOST_GROUP.bit_length())]
    fits = [g for g in widths if picks <= block // g <= _MOST_GROUPS]
    if not fits:
        return max(1, min(_MOST_GROUP, block // picks))
    return min(fits, key=lambda g: (block // g + picks * g, -g))


def scratch_shape(rows: int, cols: int, topk: int) -> tuple[int, int]:
    """The float32 scratch of :func:`top_blocks` for ``rows`` rows (every batch row and head's)
    of ``cols`` columns: a row's group maxima."""
    return rows, next_power_of_2(cols) // group_width(cols, topk)


def _columns_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself where its columns are contiguous (a broadcast keeps its stride 0 rows),
    else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


class RowRanges(NamedTuple):
    """A row's candidates and own blocks by its position (Note [Candidates by position]): query
    block ``first_row + r`` starts at position ``(first_row + r) * block_size + shift``; with
    ``causal`` its candidates are the key blocks before that position's and its own blocks
    those up to its last position (at most ``key_len - 1``); without, every block is a
    candidate and none its own."""

    first_row: int
    shift: int
    block_size: int
    key_len: int
    causal: bool


def top_blocks(
    affinity: torch.Tensor,
    candidates: torch.Tensor | RowRanges,
    own: torch.Tensor | None,
    topk: int,
    out: torch.Tensor | None = None,
    *,
    own_width: int | None = None,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each row's own blocks and its ``min(topk, candidates)`` candidates of highest affinity.

    Args:
        affinity: (B, Hs, Mq, Mk) float32, Mk <= :data:`MAX_COLUMNS`.
        candidates, own: bool broadcastable to it; or ``candidates`` the rows'
            :class:`RowRanges` and ``own`` None (no mask read).
        out: where to write (a slice of a larger result, contiguous columns), or None for a
            new tensor: (B, Hs, Mq, Mk) bool, or with ``own_width`` (B, Hs, Mq,
            topk + own_width) int32.
        own_width: None for a bool mask; else the rows as block indices (Note [Chosen blocks
            as indices]), each row's own blocks a run of at most ``own_width`` columns.
        scratch: float32 of :func:`scratch_shape` (B Hs Mq rows), contiguous; None for a new
            one.

    Returns:
        (B, Hs, Mq, Mk) bool, or (B, Hs, Mq, topk + own_width) int32 with ``-1`` = none:
        ``out``, or a new tensor.
    """
    batch, heads, rows, cols = affinity.shape
    indices = own_width is not None
    width = topk + own_width if own_width is not None else cols
    if out is None:
        out = torch.empty(batch, heads, rows, width, device=affinity.device,
                          dtype=torch.int32 if indices else torch.bool)  # fmt: skip
    if out.numel() == 0:
        return out
    shape = tuple(affinity.shape)
    affinity = _columns_contiguous(affinity)
    ranges = candidates if isinstance(candidates, RowRanges) else None
    if ranges is None:
        masks = [_columns_contiguous(x.expand(shape)).view(torch.uint8) for x in (candidates, own)]
    else:  # not read: any tensor of the right layout stands in
        masks = [affinity.view(torch.uint8)] * 2
    maxima = scratch
    if maxima is None:
        maxima = torch.empty(scratch_shape(batch * heads * rows, cols, topk),
                             dtype=torch.float32, device=affinity.device)  # fmt: skip
    written = out if indices else out.view(torch.int8)
    # A known layout replays its launch (Note [Bound launches] in launch.py); the masks are
    # roles only where they are read.
    roles = (affinity, written, maxima) if ranges is not None else (
        affinity, *masks, written, maxima)  # fmt: skip
    site = site_key("top_blocks", roles, topk, own_width, ranges)
    run_site(site, roles, lambda: _launch(affinity, masks, written, maxima, topk, own_width,
                                          ranges))  # fmt: skip
    return out


def _launch(
    affinity: torch.Tensor,
    masks: list[torch.Tensor],
    written: torch.Tensor,
    maxima: torch.Tensor,
    topk: int,
    own_width: int | None,
    ranges: RowRanges | None,
) -> None:
    """The launch of :func:`top_blocks` into ``written`` (its ``out``, bool as int8)."""
    batch, heads, rows, cols = affinity.shape
    block = next_power_of_2(cols)
    picks = next_power_of_2(topk)
    group = block // maxima.shape[1]
    where = ranges or RowRanges(0, 0, 1, 1, False)
    args = (affinity, *masks, written, maxima, cols, heads, rows, topk, *affinity.stride()[:3],
            *masks[0].stride()[:3], *masks[1].stride()[:3], *written.stride()[:3],
            own_width or 0, where.first_row, where.shift, where.block_size, where.key_len,
            int(where.causal))  # fmt: skip
    options = {"CHUNK": min(block, _CHUNK), "GROUP": group, "GROUPS": block // group,
               "PICKS": picks, "OWN": next_power_of_2(max(1, own_width or 0)),
               "INDICES": own_width is not None, "RANGES": ranges is not None,
               "num_warps": 1 if cols <= _ONE_WARP_COLUMNS else _WARPS}  # fmt: skip
    launch_recorded(_top_blocks_kernel, (batch * heads * rows,), args, options)
