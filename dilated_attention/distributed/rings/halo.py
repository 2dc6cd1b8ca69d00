"""Local windows over ranks: each rank receives only the key rows its window reaches.

Note [Halo exchange]
    Under ``window_size=(left, right)`` position ``p`` sees keys ``p - left .. p + right``
    (Note [Local windows, soft-capping and sinks] in ``core/sinks.py``; causal attention cuts
    ``right`` to 0). A rank's queries, each chunk ``[a, b)`` of global positions it holds (one
    chunk, or two under the zigzag layout: Note [Sequence layouts] in ``sharding.py``), read
    only the keys ``[a - left, b + right)``, cut to the sequence and, with packed documents, to
    each document.
    The part held by other ranks is the chunk's *halo*: the ``left`` rows before it, from as many
    earlier ranks as ``left`` covers, and the ``right`` rows after it. Every rank computes every
    rank's halo from the geometry alone (world size, shard length, layout, window, documents), so
    each knows what to send to whom: nothing else travels, and a window as wide as one side of
    the sequence (``-1``) takes every row on that side.

    The steps are those of Note [Block-sparse exchange] (``exchange.py``): step 0 computes this
    rank's queries against its own keys while the halo is in flight; at step ``s`` rank ``r``
    receives from ``r - s`` the rows it needs and sends ``r + s`` those it needs (a key padding
    mask travels with its rows, one byte per row); a step with nothing to move is left out. The
    forward keeps the halo it received, so the backward sends only the halo's dK/dV home, in
    float32, where the owners add them into their accumulators (Note [Gradients go home] in
    ``ring.py``).
    Per layer a rank sends ``rows * 2 * B * Hkv * D`` elements forward (``rows``: the halo rows
    the other ranks read of it, at most ``left + right`` per chunk when they lie on the
    neighbours) and the float32 dK/dV of the rows it received backward (``halo_rows``;
    ``plan_context_parallel`` prices them).

    Every kernel call pairs a run of queries with a run of keys of consecutive positions (views,
    no copies). The call's window is the global one re-aligned to its rows: the rows are first
    trimmed to the queries that see a key of the run and the keys some query sees, and then,
    with ``q1``/``k1`` the last query/key position, the call's bottom-right window (Note
    [Scores a kernel call transforms]) is ``(left + k1 - q1, right - k1 + q1)``, both sides
    non-negative after the trim (a side that cannot bind is left unbounded, a call whose every
    pair is visible has no window). Causality is the window's right side 0, so the calls are
    never causal themselves.

Shape legend: B batch, n local tokens, H query heads, Hkv key/value heads, D head dim, W ranks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ...core.autograd import Backward, FirstOrderOnly, Forward, Grads, Inputs, Runner
from ...core.contract import Window
from ...core.geometry.calls import SliceCall
from ...core.merge import merge_partial
from ..comm.agreement import PreparedRing
from ..comm.exchange import ExchangeStep, SparseSteps
from ..layout.sharding import chunks_of, chunks_per_rank
from .template import RingRunner, StepKernel

__all__ = ["Halo", "UnionRunner", "halo_rows", "halo_steps", "windowed_runner"]

#: A run of consecutive positions at consecutive rows: (first position, length, first row).
Run = tuple[int, int, int]


@dataclass(frozen=True)
class Halo:
    """The geometry of a windowed ring (Note [Halo exchange]): ``world_size`` shards of ``n``
    rows in ``layout``; the window's sides ``left`` and ``right`` (``-1``: unbounded; ``right``
    0 under causal attention); packed documents' offsets over the whole row, or None."""

    world_size: int
    n: int
    layout: str
    left: int
    right: int
    documents: tuple[int, ...] | None = None

    @classmethod
    def of(cls, ring: PreparedRing) -> Halo:
        """The halo of an agreed ring call with a window."""
        assert ring.window is not None
        left, right = ring.window
        setup = ring.setup
        return cls(setup.world_size, ring.q.shape[1], setup.layout, left,
                   0 if setup.is_causal else right, ring.documents)  # fmt: skip

    def chunks(self, rank: int) -> list[Run]:
        """The runs of positions ``rank`` holds, at its local rows."""
        size = self.n // chunks_per_rank(self.layout)
        return [(c * size, size, i * size)
                for i, c in enumerate(chunks_of(rank, self.world_size, self.layout))]  # fmt: skip

    def spans(self) -> list[tuple[int, int]]:
        """The ranges no attention crosses: each document, or the whole sequence."""
        if self.documents is None:
            return [(0, self.world_size * self.n)]
        return list(zip(self.documents[:-1], self.documents[1:], strict=True))

    def reach(self, lo: int, hi: int) -> tuple[int, int]:
        """The keys ``[lo', hi')`` the queries ``[lo, hi)`` see (unbounded: the sequence)."""
        end = self.world_size * self.n
        return (0 if self.left < 0 else lo - self.left,
                end if self.right < 0 else hi + self.right)  # fmt: skip


def _queries(halo: Halo, rank: int) -> list[tuple[Run, tuple[int, int]]]:
    """Each run of ``rank``'s queries cut to one span, with that span."""
    found = []
    for run in halo.chunks(rank):
        for lo, hi in halo.spans():
            if max(run[0], lo) < min(run[0] + run[1], hi):
                found.append((run, (lo, hi)))
    return found


def key_runs(halo: Halo, dst: int, src: int) -> list[Run]:
    """The runs of ``src``'s keys that ``dst``'s queries read (at ``src``'s local rows),
    merged and in row order (``src == dst``: its own keys)."""
    wanted = []
    for (pos, length, _), (lo, hi) in _queries(halo, dst):
        first, last = halo.reach(max(pos, lo), min(pos + length, hi))
        first, last = max(first, lo), min(last, hi)
        for kpos, klen, krow in halo.chunks(src):
            a, b = max(first, kpos), min(last, kpos + klen)
            if a < b:
                wanted.append((krow + a - kpos, b - a, a))
    merged: list[list[int]] = []
    for row, length, pos in sorted(wanted):
        if merged and row <= merged[-1][0] + merged[-1][1] and pos - row == merged[-1][2]:
            merged[-1][1] = max(merged[-1][1], row + length - merged[-1][0])
        else:
            merged.append([row, length, pos - row])
    return [(row + shift, length, row) for row, length, shift in merged]


def _window(
    halo: Halo, q: tuple[int, int], k: tuple[int, int]
) -> tuple[slice, slice, Window | None]:
    """Queries ``q`` and keys ``k`` (position ranges) trimmed to the pairs the window lets see
    each other, as offsets into the ranges, and the call's window over its rows (Note [Halo
    exchange]); empty slices when no pair is visible."""
    (qa, qb), (ka, kb), left, right = q, k, halo.left, halo.right
    q0 = qa if right < 0 else max(qa, ka - right)
    q1 = qb if left < 0 else min(qb, kb + left)
    k0 = ka if left < 0 else max(ka, qa - left)
    k1 = kb if right < 0 else min(kb, qb + right)
    if q0 >= q1 or k0 >= k1:
        return slice(0, 0), slice(0, 0), None
    shift = k1 - q1  # last key - last query
    side_l = -1 if left < 0 or left + shift >= k1 - k0 - 1 else left + shift
    side_r = -1 if right < 0 or right - shift >= q1 - q0 - 1 else right - shift
    window = None if side_l < 0 and side_r < 0 else Window(side_l, side_r)
    return slice(q0 - qa, q1 - qa), slice(k0 - ka, k1 - ka), window


def _calls(halo: Halo, rank: int, runs: list[Run]) -> list[SliceCall]:
    """``rank``'s kernel calls against the keys ``runs`` (positions at the rows of a step's
    keys): one per query run, key run and span with a visible pair."""
    calls = []
    for (pos, length, row), (lo, hi) in _queries(halo, rank):
        qa, qb = max(pos, lo), min(pos + length, hi)
        for kpos, klen, krow in runs:
            ka, kb = max(kpos, lo), min(kpos + klen, hi)
            if ka >= kb:
                continue
            qs, ks, window = _window(halo, (qa, qb), (ka, kb))
            if qs.stop > qs.start:
                q0, k0 = row + qa - pos + qs.start, krow + ka - kpos + ks.start
                rows = slice(q0, q0 + qs.stop - qs.start)
                calls.append(SliceCall(rows, slice(k0, k0 + ks.stop - ks.start), False, window))
    return calls


@functools.lru_cache(maxsize=32)
def halo_steps(halo: Halo, rank: int, device: torch.device) -> tuple[ExchangeStep, ...]:
    """This rank's steps of Note [Halo exchange] (pure: the same on every call): its own keys,
    then one step per rank distance with rows to receive or send."""
    none = torch.zeros(0, dtype=torch.int64)
    steps = [ExchangeStep(rank, rank, 0, none.to(device),
                          _calls(halo, rank, key_runs(halo, rank, rank)))]  # fmt: skip
    for shift in range(1, halo.world_size):
        src, dst = (rank - shift) % halo.world_size, (rank + shift) % halo.world_size
        received, at = [], 0  # the rows arrive one run after another
        for pos, length, _ in key_runs(halo, rank, src):
            received.append((pos, length, at))
            at += length
        sent = key_runs(halo, dst, rank)
        if not (at or sent):
            continue
        index = torch.cat([none, *(torch.arange(row, row + length) for _, length, row in sent)])
        steps.append(ExchangeStep(src, dst, at, index.to(device), _calls(halo, rank, received)))
    return tuple(steps)


def halo_rows(halo: Halo, rank: int) -> tuple[int, int]:
    """``(rows sent, rows received)`` by ``rank`` in the forward of Note [Halo exchange]."""
    others = [r for r in range(halo.world_size) if r != rank]
    sent = sum(length for dst in others for _, length, _ in key_runs(halo, dst, rank))
    received = sum(length for src in others for _, length, _ in key_runs(halo, rank, src))
    return sent, received


def windowed_runner(ring: PreparedRing, message: str) -> RingRunner:
    """The runner of an agreed ring call's local window over its halo (Note [Halo exchange]),
    on the call's kernel and soft-cap; ``message``: its double-backward error."""
    setup = ring.setup
    steps = halo_steps(Halo.of(ring), setup.rank, ring.q.device)
    kernel = StepKernel(ring.kernel.backend, setup.scale, softcap=ring.softcap)
    return RingRunner(SparseSteps(steps, setup), kernel, message, keep=True)


@dataclass(frozen=True)
class UnionRunner(FirstOrderOnly):
    """Two runners over the same inputs as one: their results merged through their
    log-sum-exp, one softmax over the union of their keys (LongNet Eq. 10); each backward reads
    the merged ``out`` and ``lse`` (Note [Exact gradients through the branch mix] in
    ``core/execution/call_runs.py``), and the gradients add. Ring dilated attention with a local
    window as one more branch (Note [A local window as a branch] in ``resolve/windows.py``)."""

    first: Runner
    second: Runner
    first_order_message: str

    def forward(self, x: Inputs) -> Forward:
        a, b = self.first.forward(x), self.second.forward(x)
        acc = a.lse.dtype
        out, lse = merge_partial(a.out.to(acc), a.lse.transpose(1, 2),
                                 b.out.to(acc), b.lse.transpose(1, 2))  # fmt: skip
        state = (len(a.saved), a.state, b.state)
        return Forward(out.to(x.q.dtype), lse.transpose(1, 2).contiguous(),
                       saved=(*a.saved, *b.saved), state=state)  # fmt: skip

    def backward(self, b: Backward) -> Grads:
        split, first, second = b.state
        grads_a = self.first.backward(b._replace(saved=b.saved[:split], state=first))
        grads_b = self.second.backward(b._replace(saved=b.saved[split:], state=second))
        dq, dk, dv = (x + y for x, y in zip(grads_a, grads_b, strict=True))
        return dq, dk, dv
