"""MoBA's choice of key blocks with the affinities made a tile at a time on the tensor cores and
never stored (Note [Affinities a tile at a time]
    The choice ranks every candidate key block of a query block by its affinity (Note [MoBA's
    gate for a block of queries] in ``sparse/selection.py``). Made by a batched product and
    then read by the top-k kernel (Note [Top blocks in registers] in ``top_blocks.py``), the
    affinities are (B, H, Mq, Mk) float32: 4 GiB at 1M tokens, 16 heads and blocks of 128,
    written once and read twice: 5.5 of a choice's 7.7 ms on an H100 (the block means, which
    read the query and key once, take 1.8). The choice needs few of them: a row's ``topk``
    best columns lie in its ``topk`` groups of ``GROUP`` columns with the best maxima (each
    better column's group has a better maximum). So one kernel makes the affinities from the
    block means' bfloat16 parts, ``BLOCK_ROWS`` rows by ``GROUP`` columns at a time (three
    bfloat16 products into one float32 accumulator, the parts the product takes: Note
    [Affinities on tensor cores]), over the tiles that hold a candidate only (causal: the
    blocks before the row's own), and keeps per row only what can still be chosen:

    - ``PICKS`` slots (``topk`` rounded up to a power of two) hold the best groups so far: a
      group whose maximum beats the worst held takes that slot (the worst maximum, of the
      highest group among equal ones; an equal maximum does not enter, so the earlier, lower
      group wins a tie) and its values are stored in the slot's scratch. Groups come in
      increasing order, so at the end the slots hold the ``PICKS`` best groups, ranked by
      maximum and then by the lower group, and their values;
    - then the row's ``topk`` best columns among its slots' ``PICKS * GROUP`` values, in two
      steps again: the ``topk`` best parts of ``PART`` columns by their maxima, then the best
      of their columns, the lowest column among equal ones; ``SUB`` rows of the program at
      once (a reduction per pick across those rows, not a program per row), ``SUB`` the most
      rows whose ``PICKS * PART`` values stay within ``_RANKED``;
    - written with the row's own blocks, as :func:`~.top_blocks.top_blocks` writes a row.

    No (Mq x Mk) write or read: the affinities' arithmetic (half of it when causal) and a
    scratch of ``PICKS * (GROUP + GROUP / PART + 2)`` words per row. At 1M tokens the choice
    takes 4.5 ms on an H100, 0.9 ms at 256K (7.8 and 1.2 with the stored product). A NaN
    affinity ranks below every number and above the non-candidates, as everywhere. The tile
    sizes were chosen by measurement: 128 rows and 32 columns in 8 warps and 3 stages took
    2.4-2.7 ms at 1M (64 columns 2.8; 64 rows in 4 warps 3.2). Which choice is faster depends
    on the slots and the key blocks (:data:`MIN_COLUMNS`; on an H200, 16 heads, whole choices,
    tiles against the stored product): with 16 slots 0.25 / 0.73 / 3.57 against 0.19 / 0.89 /
    7.44 ms at 64K / 256K / 1M tokens; with 32 (``topk`` 31) 1.1-1.2 / 2.68 / 6.28 against 0.9 /
    2.61 / 8.86 ms at 256K / 512K / 1M; with 64 (``topk`` 63) 4.35 / 16.5 against 1.16 / 15.1
    ms at 256K / 1M, so from 64 slots the stored product always.

    A program holds its tiles in shared memory, as much as Triton's compiler lays out: with
    Triton 3.6, 128 KiB at head dim 128 for 16, 32 or 64 slots (ranking 128, 64 or 32 rows at
    once; 32 slots ranked 128 rows at once asked 256 KiB). An H100 or H200 has 227 KiB a
    program, many smaller GPUs 99-164 KiB. A launch that asks more than the device has raises
    Triton's :class:`OutOfResources` before it runs; the device, slots and head dim are then
    remembered, and :func:`takes` refuses them from then on (the caller makes that choice
    another way).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ...triton import interpreting
from ..launch import launch
from ..tiles import cdiv, next_power_of_2
from .top_blocks import _LOWEST, RowRanges, _row_bounds

#: Query blocks a program takes, columns per group (one tile), columns per part of a group,
#: the most values a program ranks at once (its rows ``SUB`` at a time), and a program's warps
#: and pipeline stages.
_BLOCK_ROWS = 128
_GROUP = 32
_PART = 8
_RANKED = 16384
_WARPS = 8
_STAGES = 3

#: The fewest key blocks for which this choice is used, by slots a row (up to 16, up to 32):
#: below, the stored product is as fast or faster, and with more slots always (Note [Affinities
#: a tile at a time]). Its most are ``top_blocks.MAX_COLUMNS``, whose groups stay below
#: ``_EMPTY``.
MIN_COLUMNS = {16: 1024, 32: 8192}

_EMPTY = tl.constexpr(2**16)  # a slot that holds no group (above every group's index)

#: (device, slots a row, head dim) whose program asked more shared memory than the device has.
_WITHOUT_ROOM: set[tuple[torch.device, int, int]] = set()


@triton.jit
def _query_parts(left, row, rows, s_lm, dim, DIM: tl.constexpr):
    """The three bfloat16 parts of the rows' query means, each (BLOCK_ROWS, DIM)."""
    d = tl.arange(0, DIM)
    where = (row < rows)[:, None] & (d < dim)[None, :]
    at = left + row[:, None] * s_lm + d[None, :]
    return (tl.load(at, mask=where, other=0.0), tl.load(at + dim, mask=where, other=0.0),
            tl.load(at + 2 * dim, mask=where, other=0.0))  # fmt: skip


@triton.jit
def _part_product(rows, cols, acc, WIDEN: tl.constexpr):
    """``acc + rows @ cols.T`` of bfloat16 parts in float32; ``WIDEN`` (Triton's interpreter,
    whose product takes bfloat16 for integers) in float32 products, which are exact."""
    if WIDEN:
        return tl.dot(rows.to(tl.float32), tl.trans(cols.to(tl.float32)), acc,
                      input_precision="ieee")  # fmt: skip
    return tl.dot(rows, tl.trans(cols), acc)


@triton.jit
def _tile_scores(q0, q1, q2, right, s_rm, col, cols, lo, dim, DIM: tl.constexpr,
                 WIDEN: tl.constexpr):  # fmt: skip
    """The affinities of the rows (parts ``q0..q2``) with columns ``col`` (GROUP,): (BLOCK_ROWS,
    GROUP) float32, ``-inf`` where not a candidate (column ``lo`` on), the lowest number where
    NaN."""
    d = tl.arange(0, DIM)
    where = (col < cols)[:, None] & (d < dim)[None, :]
    at = right + col[:, None] * s_rm + d[None, :]
    acc = tl.zeros((q0.shape[0], col.shape[0]), tl.float32)
    acc = _part_product(q0, tl.load(at, mask=where, other=0.0), acc, WIDEN)
    acc = _part_product(q1, tl.load(at + dim, mask=where, other=0.0), acc, WIDEN)
    acc = _part_product(q2, tl.load(at + 2 * dim, mask=where, other=0.0), acc, WIDEN)
    score = tl.where(acc != acc, _LOWEST, acc)
    return tl.where(col[None, :] < lo[:, None], score, float("-inf"))


@triton.jit
def _choice_kernel(
    left, right, values, maxima, picked, chosen,
    rows, cols, heads, shared, dim, topk,
    s_lh, s_lm, s_rh, s_rm, s_xb, s_xh, s_xr,
    own_width, first_row, shift, block_size, key_len, causal,
    BLOCK_ROWS: tl.constexpr,
    SUB: tl.constexpr,
    GROUP: tl.constexpr,
    PART: tl.constexpr,
    PICKS: tl.constexpr,
    DIM: tl.constexpr,
    CHUNK: tl.constexpr,
    OWN: tl.constexpr,
    INDICES: tl.constexpr,
    WIDEN: tl.constexpr,
):  # fmt: skip
    """Program (batch row and head ``bh``, row tile): the rows' choice (Note [Affinities a tile
    at a time]). Scratch per row: ``values`` (PICKS, GROUP) of the groups held, ``maxima``
    (PICKS, GROUP / PART) of their parts, ``picked`` 2 PICKS int32 (the groups held, then the
    parts taken). ``INDICES``: block indices into ``chosen``, else a bool row as int8."""
    bh = tl.program_id(0).to(tl.int64)
    kv = bh // heads * (heads // shared) + bh % heads // shared
    # The last row tiles first: causal, they have the most tiles to make (a shorter tail).
    first = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_ROWS
    row = first + tl.arange(0, BLOCK_ROWS)
    lo, _ = _row_bounds(row, first_row, shift, block_size, key_len, cols, causal)
    lo = tl.where(row < rows, lo, 0)  # no candidate past the last row
    q0, q1, q2 = _query_parts(left + bh * s_lh, row, rows, s_lm, dim, DIM)
    slots = values + (bh * rows + row[:, None]) * (PICKS * GROUP)
    slot = tl.arange(0, PICKS)[None, :]
    best = tl.full((BLOCK_ROWS, PICKS), float("-inf"), tl.float32)
    held = tl.full((BLOCK_ROWS, PICKS), _EMPTY, tl.int32)  # the group in each slot
    span = tl.arange(0, GROUP)[None, :]
    for tile in range(0, tl.cdiv(tl.max(lo, axis=0), GROUP)):
        col = tile * GROUP + tl.arange(0, GROUP)
        score = _tile_scores(q0, q1, q2, right + kv * s_rh, s_rm, col, cols, lo, dim, DIM, WIDEN)
        top = tl.max(score, axis=1)
        worst = tl.min(best, axis=1)
        enter = top > worst  # a later group's equal maximum loses to the earlier group
        # The slot given up: the worst maximum held, of the highest group among equal ones.
        key = tl.where(best == worst[:, None], held * PICKS + slot, -1)
        gone = tl.max(key, axis=1) % PICKS
        replace = enter[:, None] & (slot == gone[:, None])
        best = tl.where(replace, top[:, None], best)
        held = tl.where(replace, tile, held)
        tl.store(slots + gone[:, None] * GROUP + span, score, mask=enter[:, None])
    tl.store(picked + (bh * rows + row[:, None]) * (2 * PICKS) + slot, held,
             mask=(row < rows)[:, None])  # fmt: skip
    tl.debug_barrier()  # the groups' values are stored before they are read back
    for sub in range(first, first + BLOCK_ROWS, SUB):  # the rows SUB at a time
        _choose_rows(values, maxima, picked, chosen + bh // heads * s_xb + bh % heads * s_xh,
                     bh * rows, sub + tl.arange(0, SUB), rows, cols, topk, s_xr, own_width,
                     first_row, shift, block_size, key_len, causal, GROUP, PART, PICKS, CHUNK,
                     OWN, INDICES)  # fmt: skip


@triton.jit
def _choose_rows(values, maxima, picked, chosen, base, row, rows, cols, topk, s_xr, own_width,
                 first_row, shift, block_size, key_len, causal, GROUP: tl.constexpr,
                 PART: tl.constexpr, PICKS: tl.constexpr, CHUNK: tl.constexpr,
                 OWN: tl.constexpr, INDICES: tl.constexpr):  # fmt: skip
    """Rows ``row`` (R,) of a program (``base + row`` in the scratch), their groups' values
    held: the maxima of the groups' parts, the ``topk`` best columns, written with the rows'
    own blocks into their rows of ``chosen`` (the batch row and head's result)."""
    PARTS: tl.constexpr = GROUP // PART
    inside = row < rows
    lo, hi = _row_bounds(row, first_row, shift, block_size, key_len, cols, causal)
    lo = tl.where(inside, lo, 0)
    values += (base + row)[:, None] * (PICKS * GROUP)
    maxima += (base + row)[:, None] * (PICKS * PARTS)
    picked += (base + row)[:, None] * (2 * PICKS)
    span = tl.arange(0, GROUP)[None, :]
    for s in range(PICKS):  # the maxima of the groups' parts, once per row
        score = tl.load(values + s * GROUP + span, mask=inside[:, None])
        parts = tl.max(tl.reshape(score, (row.shape[0], PARTS, PART)), axis=2)
        tl.store(maxima + s * PARTS + tl.arange(0, PARTS)[None, :], parts,
                 mask=inside[:, None])  # fmt: skip
    tl.debug_barrier()  # the parts' maxima are stored before they are read back
    best = _best_columns(values, maxima, picked, inside, topk, GROUP, PART, PICKS)
    _write_rows(chosen + row[:, None] * s_xr, best, lo, hi, inside, cols, topk, own_width, CHUNK,
                OWN, INDICES)  # fmt: skip


@triton.jit
def _take_best(score, key, topk, NONE: tl.constexpr, PICKS: tl.constexpr):
    """Each row's ``topk`` (at most ``PICKS``) best of ``score`` (R, C), the lowest ``key``
    among equal ones each time: their keys (R, PICKS), ``NONE`` where fewer are above
    ``-inf``. Every row of the program at once, the maximum ``PICKS`` times: a bitonic top-k
    of ranks (``top_blocks._best_of_row``) made these programs slower (on an H200, 16 heads,
    ``topk`` 15 at 1M tokens, 3.81 -> 4.37 ms a choice)."""
    slot = tl.arange(0, PICKS)[None, :]
    taken = tl.full((score.shape[0], PICKS), NONE, tl.int32)
    for t in range(PICKS):
        top = tl.max(score, axis=1)
        first = tl.min(tl.where(score == top[:, None], key, NONE), axis=1)
        first = tl.where((top > float("-inf")) & (t < topk), first, NONE)
        taken = tl.where(slot == t, first[:, None], taken)
        score = tl.where(key == first[:, None], float("-inf"), score)
    return taken


@triton.jit
def _best_columns(values, maxima, picked, inside, topk, GROUP: tl.constexpr,
                  PART: tl.constexpr, PICKS: tl.constexpr):  # fmt: skip
    """Each row's ``topk`` best columns among the groups it held (R, PICKS), ``2**30`` where
    none: the ``topk`` best parts of ``PART`` columns by their maxima, then the best of their
    columns, the lowest column among equal ones each time."""
    PARTS: tl.constexpr = GROUP // PART
    part = tl.arange(0, PICKS * PARTS)[None, :]  # slot * PARTS + part of its group
    group = tl.load(picked + part // PARTS, mask=inside[:, None], other=_EMPTY)
    first = tl.where(group < _EMPTY, group * GROUP + part % PARTS * PART, 2**30)
    score = tl.load(maxima + part, mask=first < 2**30, other=float("-inf"))
    taken = _take_best(score, first, topk, 2**30, PICKS)  # first columns of the parts
    # The slot and part of each taken part, from its first column and the groups held.
    slot = tl.arange(0, PICKS)[None, :]
    index = tl.full(taken.shape, PICKS * PARTS, tl.int32)
    for s in range(PICKS):
        held = tl.load(picked + s, mask=inside[:, None], other=_EMPTY)  # (R, 1)
        mine = (taken < 2**30) & (taken // GROUP == held)
        index = tl.where(mine, s * PARTS + taken % GROUP // PART, index)
    tl.store(picked + PICKS + slot, index, mask=inside[:, None])
    tl.debug_barrier()  # the parts taken are stored before they are read back
    entry = tl.arange(0, PICKS * PART)[None, :]
    chosen = tl.load(picked + PICKS + entry // PART, mask=inside[:, None], other=PICKS * PARTS)
    kept = chosen < PICKS * PARTS
    group = tl.load(picked + chosen // PARTS, mask=kept, other=0)
    column = tl.where(kept, group * GROUP + chosen % PARTS * PART + entry % PART, 2**30)
    score = tl.load(values + chosen * PART + entry % PART, mask=kept, other=float("-inf"))
    return _take_best(score, column, topk, 2**30, PICKS)


@triton.jit
def _write_rows(chosen, best, lo, hi, inside, cols, topk, own_width, CHUNK: tl.constexpr,
                OWN: tl.constexpr, INDICES: tl.constexpr):  # fmt: skip
    """The rows' picks ``best`` (R, PICKS) and own blocks ``lo .. hi`` into their ``chosen``
    rows (R, 1) pointers, as ``top_blocks.top_blocks`` writes a row."""
    slot = tl.arange(0, best.shape[1])[None, :]
    inside = inside[:, None]
    if INDICES:
        tl.store(chosen + slot, tl.where(best < cols, best, -1), mask=inside & (slot < topk))
        run = tl.arange(0, OWN)[None, :]
        owned = tl.maximum(hi - lo + 1, 0)[:, None]
        tl.store(chosen + topk + run, tl.where(run < owned, lo[:, None] + run, -1),
                 mask=inside & (run < own_width))  # fmt: skip
    else:
        for start in range(0, cols, CHUNK):
            col = start + tl.arange(0, CHUNK)[None, :]
            own = (col >= lo[:, None]) & (col <= hi[:, None])
            tl.store(chosen + col, own.to(tl.int8), mask=inside & (col < cols))
        tl.debug_barrier()  # the rows' own blocks are stored before the picks are set
        tl.store(chosen + best, tl.full(best.shape, 1, tl.int8), mask=inside & (best < cols))


def takes(cols: int, topk: int, device: torch.device, dim: int) -> bool:
    """Whether this choice runs ``cols`` key blocks (and is the faster one there), ``topk``
    picks per row, on ``device`` at head dim ``dim`` (not where its program did not fit the
    device's shared memory)."""
    slots = max(16, _slots(topk))
    if topk < 1 or slots not in MIN_COLUMNS or cols < MIN_COLUMNS[slots]:
        return False
    return _program(device, topk, dim) not in _WITHOUT_ROOM


def _program(device: torch.device, topk: int, dim: int) -> tuple[torch.device, int, int]:
    """What decides whether a program fits: the device (with its index), slots, head dim."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device, _slots(topk), dim


def _slots(topk: int) -> int:
    """Slots a row of the program holds for ``topk`` picks (its ``PICKS``)."""
    return next_power_of_2(max(1, topk))


#: A row's scratch per pick, (4-byte words, dtype) of each part: the values of the groups it
#: holds, their parts' maxima, and two lists of int32 (the groups held, the parts taken).
_SCRATCH = ((_GROUP, torch.float32), (_GROUP // _PART, torch.float32), (2, torch.int32))


def scratch_per_row(topk: int) -> int:
    """The scratch of a row of :func:`top_blocks_from_parts`, in 4-byte words."""
    return _slots(topk) * sum(words for words, _ in _SCRATCH)


def empty_scratch(rows: int, topk: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The scratch of :func:`top_blocks_from_parts` for ``rows`` rows (every batch row and
    head's), uninitialised: three tensors of ``rows`` rows, any leading rows of which serve
    fewer."""
    picks = _slots(topk)
    return tuple(torch.empty(rows, picks * words, dtype=dtype, device=device)
                 for words, dtype in _SCRATCH)  # fmt: skip


def top_blocks_from_parts(
    left: torch.Tensor,
    right: torch.Tensor,
    ranges: RowRanges,
    topk: int,
    out: torch.Tensor,
    *,
    own_width: int | None = None,
    scratch: tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor:
    """Each row's own blocks and its ``min(topk, candidates)`` candidates of highest affinity,
    the affinities made from the block means' parts (Note [Affinities a tile at a time]).

    Args:
        left: (B Hs, Mq, 3 D) bfloat16, the query means' parts laid ``[hi, hi, lo]``, rows of
            contiguous parts (any stride between heads and rows); ``Hs`` the heads chosen for.
        right: (B Hkv, Mk, 3 D) bfloat16, the key means' parts laid ``[hi, lo, hi]``, Hs a
            multiple of Hkv (query head ``h`` takes key head ``h // (Hs / Hkv)``).
        ranges: the rows' candidates and own blocks by position (query block
            ``ranges.first_row + r`` is row ``r``).
        topk: picks per row, with :func:`takes` true of ``Mk``.
        out: (B, Hs, Mq, Mk) bool, or with ``own_width`` (B, Hs, Mq, topk + own_width) int32,
            contiguous columns: written in place.
        own_width: None for a bool mask; else block indices (Note [Chosen blocks as indices]
            in ``top_blocks.py``).
        scratch: :func:`empty_scratch` of at least B Hs Mq rows; None for a new one.

    Returns:
        ``out``.

    Raises:
        OutOfResources: the program asks more shared memory than the device has (the kernel
            did not run; :func:`takes` refuses the device, slots and head dim from now on).
    """
    batch, heads, rows = out.shape[:3]
    cols, dim = right.shape[1], right.shape[2] // 3
    if out.numel() == 0:
        return out
    needed = batch * heads * rows
    if scratch is None:
        scratch = empty_scratch(needed, topk, left.device)
    values, maxima, picked = (x[:needed] for x in scratch)
    picks = _slots(topk)
    written = out if own_width is not None else out.view(torch.int8)
    args = (left, right, values, maxima, picked, written, rows, cols, heads,
            heads // (right.shape[0] // batch), dim, topk, left.stride(0), left.stride(1),
            *right.stride()[:2], *out.stride()[:3], own_width or 0, ranges.first_row,
            ranges.shift, ranges.block_size, ranges.key_len, int(ranges.causal))  # fmt: skip
    options = {"BLOCK_ROWS": _BLOCK_ROWS, "SUB": min(_BLOCK_ROWS, _RANKED // (picks * _PART)),
               "GROUP": _GROUP, "PART": _PART, "PICKS": picks,
               "DIM": max(16, next_power_of_2(dim)), "CHUNK": min(next_power_of_2(cols), 256),
               "OWN": next_power_of_2(max(1, own_width or 0)), "INDICES": own_width is not None,
               "WIDEN": interpreting(), "num_warps": _WARPS,
               "num_stages": _STAGES}  # fmt: skip
    try:
        launch(_choice_kernel, (batch * heads, cdiv(rows, _BLOCK_ROWS)), args, options)
    except OutOfResources:  # the kernel did not run; refused on this device from now on
        _WITHOUT_ROOM.add(_program(out.device, topk, dim))
        raise
    return out
