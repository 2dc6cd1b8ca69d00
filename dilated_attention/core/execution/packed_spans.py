"""The position groups of packed documents in the fused engine, with each branch's segment
table (Note [Packed documents in the fused engine]).

Shape legend: N positions of the packed row.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math

import torch

from ..contract import BranchSpan

__all__ = ["Spans", "group_size", "packed_spans"]

#: One position group and every branch's span over it, in the order of the branches.
Spans = tuple[int, int, tuple[BranchSpan, ...]]


def group_size(
    seq_len: int, segment_lengths: tuple[int, ...], floor: int, groups_per_sequence: int
) -> int:
    """Positions per group of ``fused.position_groups`` (``seq_len``: one group): the least
    multiple of the segments' (clipped) least common multiple that reaches ``floor`` and
    ``1 / groups_per_sequence`` of the sequence."""
    lcm = 1
    for seg in segment_lengths:
        lcm = math.lcm(lcm, min(seg, seq_len))
        if lcm >= seq_len:
            return seq_len
    wanted = max(floor, -(-seq_len // groups_per_sequence))
    return -(-wanted // lcm) * lcm


@functools.lru_cache(maxsize=32)
def packed_spans(
    documents: tuple[int, ...],
    branches: tuple[tuple[int, int], ...],
    floor: int,
    groups_per_sequence: int,
    device: torch.device,
) -> list[Spans]:
    """Note [Packed documents in the fused engine]
        Packed documents (Note [Packed documents] in ``documents.py``) run on the fused kernels
        with each branch's segments read from a table (Note [Segments from a table] in
        ``backends/triton_kernels/device.py``). The position groups are each document's own
        (``fused.position_groups`` of its length), consecutive ones joined while the joined group
        stays within the size of the groups of one sequence of the batch's length (the whole
        row where that sequence's segments allow no cut, the heads then split to bound the
        scratch as for that sequence); so no segment of any branch crosses a group, and a
        group of many documents is one launch per branch. A branch's table in a group lists,
        document by document, the starts of its segments (``min(w, length)`` apart from the
        document's first token) and then the group's end.
        The tables of a call are one int32 tensor on the device (cached: every layer of a packed
        batch asks again).

    Returns:
        ``(start, end, spans)`` per position group.
    """
    total = documents[-1]
    if total >= 2**31:
        raise ValueError(
            f"packed documents of {total} positions in all: the fused kernels index them in 32 "
            "bits; pass fewer than 2**31 positions per call"
        )
    segs = tuple(w for w, _ in branches)
    size = group_size(total, segs, floor, groups_per_sequence)
    groups: list[tuple[int, int]] = []
    for a, b in itertools.pairwise(documents):
        own = group_size(b - a, segs, floor, groups_per_sequence)  # the document's groups
        for start, end in ((s, min(s + own, b - a)) for s in range(0, b - a, own)):
            if groups and end + a - groups[-1][0] <= size:
                groups[-1] = (groups[-1][0], end + a)
            else:
                groups.append((start + a, end + a))
    tables: list[list[int]] = []
    for start, end in groups:
        first = bisect.bisect_right(documents, start) - 1
        for w, _ in branches:
            table = []
            for a, b in itertools.pairwise(documents[first:]):
                if a >= end:
                    break
                table.extend(range(max(a, start), min(b, end), min(w, b - a)))
            tables.append([*table, end])
    flat = torch.tensor(list(itertools.chain.from_iterable(tables)), dtype=torch.int32,
                        device=device).split([len(t) for t in tables])  # fmt: skip
    spans: list[Spans] = []
    for i, (start, end) in enumerate(groups):
        row = []
        for j, (_, r) in enumerate(branches):
            table = tables[i * len(branches) + j]
            longest = max(b - a for a, b in itertools.pairwise(table))
            row.append(BranchSpan(start, end, longest, r, flat[i * len(branches) + j]))
        spans.append((start, end, tuple(row)))
    return spans
