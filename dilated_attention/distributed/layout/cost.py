"""What each way of splitting a sequence over ranks sends, and the split a simple cost model
picks.

Note [Choosing the context-parallel split]
    ``W`` ranks can split a layer as a ring of ``W``, a head all-to-all of ``W``, or a ring of
    ``Wr`` around head groups of ``Wh`` (``W = Wr * Wh``; Note [Context parallel groups] in
    ``context.py``). The bytes each rank sends per layer are counted from the plans the
    functions run (:func:`split_volume`): a head all-to-all moves ``(Wh - 1) / Wh`` of q, k, v
    and the output forward, and of their gradients backward, whatever the schedule; a dense
    ring passes every other rank's keys and values (and the key gradients home); ring dilated
    attention sends only the dilated rows of the branches whose segments cross ranks, to the
    ranks sharing those segments (Note [Local and spanning branches] in ``ring_dilated.py``),
    so short segments cost nothing and long sparse ones little; a local window sends only its
    halo, the rows it reaches on other ranks (Note [Halo exchange] in ``halo.py``), and their
    gradients back. The model
    (:func:`plan_split`) prices a split as ``compute + all-to-all + max(0, ring - compute)``:
    the ring's transfers overlap the steps' compute, the all-to-alls do not; compute is the
    attention pairs of a rank at ``Topology.tflops``; a head group inside a node exchanges at
    the node's bandwidth, and a ring whose ranks span nodes at the network's. It refuses
    splits the functions refuse (positions or heads that do not divide) and says why. The
    figures are a model, not a measurement: pass the split by name (``ContextParallel``) to
    override it.

Shape legend: N positions, B batch, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ... import _validation as V
from ...core.geometry.schedule import Schedule
from ..context import ContextParallel, kv_repeats
from ..rings.halo import Halo, halo_rows
from ..rings.ring import tasks_of
from ..rings.template import RingSetup
from .dilated_plan import span_peers, span_rows, span_segments
from .sharding import check_layout, chunks_per_rank

__all__ = [
    "Split", "SplitPlan", "Topology", "Volume", "plan_context_parallel", "plan_split",
    "split_volume",
]  # fmt: skip


@dataclass(frozen=True)
class Volume:
    """Bytes one rank sends for one layer call: in the forward and in the backward."""

    forward: int = 0
    backward: int = 0

    def __add__(self, other: Volume) -> Volume:
        return Volume(self.forward + other.forward, self.backward + other.backward)


@dataclass(frozen=True)
class Shape:
    """The layer call: batch, positions, heads, key/value heads, head dim, dtype, causal,
    sequence layout, key padding mask, the dilated schedule (None: dense), and a local window
    ``(left, right)`` (None: none; with a schedule, one more branch)."""

    batch: int
    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    is_causal: bool = False
    layout: str = "contiguous"
    masked: bool = False
    schedule: Schedule | None = None
    window: tuple[int, int] | None = None

    @property
    def element(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def accumulator(self) -> int:
        """Bytes of the float32 (float64 for float64) accumulators gradients travel in."""
        return 8 if self.dtype == torch.float64 else 4


def head_volume(shape: Shape, ranks: int, local: int) -> Volume:
    """A head all-to-all over ``ranks`` of ``local`` positions each (Note [Head all-to-all] in
    ``alltoall.py``): q, k, v, the mask and the lse out, the output back; backward the
    output's gradient out, q's, k's and v's back. Bytes per rank."""
    if ranks == 1:
        return Volume()
    rows = shape.batch * local * (ranks - 1) // ranks  # a rank keeps its own share
    kv_heads = shape.kv_heads * kv_repeats(shape.heads, shape.kv_heads, ranks)
    q = rows * shape.heads * shape.head_dim * shape.element
    kv = rows * kv_heads * shape.head_dim * shape.element
    lse = rows * shape.heads * shape.accumulator
    mask = rows * ranks if shape.masked else 0  # one byte per position, for every rank
    return Volume(2 * q + 2 * kv + lse + mask, 2 * q + 2 * kv)


def ring_volume(shape: Shape, ranks: int) -> Volume:
    """A ring over ``ranks`` of the call's shards: the most any rank sends."""
    if ranks == 1:
        return Volume()
    if shape.schedule is not None:
        volumes = _dilated_ring(shape, ranks)
    elif shape.window is None:
        volumes = [_dense_ring(shape, ranks, r) for r in range(ranks)]
    else:
        volumes = [Volume()] * ranks  # the window alone: its halo below
    if shape.window is not None:
        volumes = [v + h for v, h in zip(volumes, halo_volumes(shape, ranks), strict=True)]
    return max(volumes, key=_total)


def _total(volume: Volume) -> int:
    return volume.forward + volume.backward


def _setup(shape: Shape, ranks: int, rank: int) -> RingSetup:
    local = shape.seq_len // ranks
    chunk = local // chunks_per_rank(shape.layout)
    return RingSetup(rank, ranks, tuple(range(ranks)), shape.layout, chunk, shape.is_causal,
                     1.0, "ring")  # fmt: skip


def _dense_ring(shape: Shape, ranks: int, rank: int) -> Volume:
    """Dense ring attention (Note [Ring schedule]): every other rank's block passes through,
    forward and again backward, and the key gradients of the blocks this rank computed against
    go home."""
    local = shape.seq_len // ranks
    kv_row = 2 * shape.batch * shape.kv_heads * shape.head_dim
    block = local * kv_row * shape.element + (shape.batch * local if shape.masked else 0)
    setup = _setup(shape, ranks, rank)
    home = 0
    for src in range(ranks):
        if src != rank:
            rows = sum(len(range(local)[t.kv]) for t in tasks_of(setup, rank, src))
            home += rows * kv_row * shape.element
    return Volume((ranks - 1) * block, (ranks - 1) * block + home)


def _dilated_ring(shape: Shape, ranks: int) -> list[Volume]:
    """Ring dilated attention, every rank's: each spanning branch's rows to the ranks sharing
    its segments, and their gradients back (float32 accumulators)."""
    assert shape.schedule is not None
    local = shape.seq_len // ranks
    layout = shape.schedule.at(shape.seq_len, shape.heads, shape.kv_heads)
    split = layout.sharded(ranks, local // chunks_per_rank(shape.layout))
    cpu = torch.device("cpu")
    forward, backward = [0] * ranks, [0] * ranks
    for w, r in split.spanning:
        _, rows, positions = span_rows(
            ranks, shape.layout, local, shape.heads, shape.kv_heads, w, r, cpu
        )
        segments = span_segments(positions, min(w, shape.seq_len))
        kv = 2 * shape.batch * rows * shape.head_dim
        for rank in range(ranks):
            peers = len(span_peers(segments, rank))
            mask = shape.batch * rows if shape.masked else 0
            forward[rank] += peers * (kv * shape.element + mask)
            backward[rank] += peers * kv * shape.accumulator
    return [Volume(f, b) for f, b in zip(forward, backward, strict=True)]


def halo_volumes(shape: Shape, ranks: int) -> list[Volume]:
    """A local window's halo, every rank's (Note [Halo exchange] in ``halo.py``): the rows the
    others' windows reach of its shard forward (with their mask), and float32 dK/dV of the rows
    it received backward."""
    assert shape.window is not None
    left, right = shape.window
    halo = Halo(ranks, shape.seq_len // ranks, shape.layout, left, 0 if shape.is_causal else right)
    kv_row = 2 * shape.batch * shape.kv_heads * shape.head_dim
    mask = shape.batch if shape.masked else 0
    volumes = []
    for rank in range(ranks):
        sent, received = halo_rows(halo, rank)
        volumes.append(
            Volume(sent * (kv_row * shape.element + mask), received * kv_row * shape.accumulator)
        )
    return volumes


def split_volume(shape: Shape, ring: int, heads: int) -> Volume:
    """Bytes a rank sends per layer call under a ring of ``ring`` around head groups of
    ``heads`` (Note [Choosing the context-parallel split])."""
    if heads == 1:
        return ring_volume(shape, ring)
    repeats = kv_repeats(shape.heads, shape.kv_heads, heads)
    inner = Shape(
        shape.batch, shape.seq_len, shape.heads // heads, shape.kv_heads * repeats // heads,
        shape.head_dim, shape.dtype, shape.is_causal, shape.layout, shape.masked, shape.schedule,
        shape.window,
    )  # fmt: skip
    local = shape.seq_len // (ring * heads)
    return head_volume(shape, heads, local) + ring_volume(inner, ring)


@dataclass(frozen=True)
class Topology:
    """What the model prices transfers and compute at (defaults: an H100 node of 8 GPUs on
    NVLink, 400 Gb/s InfiniBand per GPU between nodes, 400 TFLOP/s of attention).

    Attributes:
        ranks_per_node: ranks sharing a node's fast links.
        node_gbps: GB/s a rank sends to others of its node.
        network_gbps: GB/s a rank sends to other nodes.
        tflops: attention TFLOP/s of a rank.
    """

    ranks_per_node: int = 8
    node_gbps: float = 400.0
    network_gbps: float = 50.0
    tflops: float = 400.0


@dataclass(frozen=True)
class Split:
    """One way to split: a ring of ``ring`` around head groups of ``heads``, its bytes per
    rank and predicted milliseconds per layer (forward + backward), or why it cannot run."""

    ring: int
    heads: int
    volume: Volume | None = None
    predicted_ms: float | None = None
    refused: str | None = None
    kv_repeats: int = 1  # each key/value head repeated for the head all-to-all (GQA)

    @property
    def name(self) -> str:
        if self.heads == 1:
            return f"ring {self.ring}"
        return f"head all-to-all {self.heads}" if self.ring == 1 else (
            f"ring {self.ring} x head all-to-all {self.heads}"
        )


@dataclass(frozen=True)
class SplitPlan:
    """The split :func:`plan_split` picks, and every split it weighed."""

    chosen: Split
    splits: tuple[Split, ...] = field(default=())
    note: str = ""

    def mesh(self, device_type: str, data_parallel: int = 1) -> tuple[Any, ContextParallel]:
        """The ``(dp, ring, heads)`` ``DeviceMesh`` of the chosen split (head groups on
        consecutive ranks: inside a node) and its :class:`ContextParallel`; every rank calls
        it."""
        from torch.distributed.device_mesh import init_device_mesh

        ring, heads = self.chosen.ring, self.chosen.heads
        mesh = init_device_mesh(
            device_type, (data_parallel, ring, heads), mesh_dim_names=("dp", "ring", "heads")
        )
        cp = ContextParallel.from_mesh(
            mesh, ring="ring" if ring > 1 else None, heads="heads" if heads > 1 else None
        )
        return mesh, cp

    def __str__(self) -> str:
        return self.describe()

    def describe(self) -> str:
        """The choice and, for every split, its bytes, predicted time or why it was refused."""
        lines = [f"context parallel: {self.chosen.name} (the fastest predicted)"]
        if self.note:
            lines.append(f"  {self.note}")
        for split in self.splits:
            if split.refused is not None:
                lines.append(f"  {split.name}: refused ({split.refused})")
                continue
            assert split.volume is not None and split.predicted_ms is not None
            repeats = split.kv_repeats
            repeated = f", each key/value head repeated {repeats}x" if repeats > 1 else ""
            lines.append(
                f"  {split.name}: {split.volume.forward / 2**20:,.1f} MiB forward, "
                f"{split.volume.backward / 2**20:,.1f} MiB backward per rank, "
                f"{split.predicted_ms:,.2f} ms predicted{repeated}"
            )
        return "\n".join(lines)


def _pairs(shape: Shape) -> float:
    """Query-key pairs of the whole call (a causal call half of them; a local window's rows
    as many as it reaches, edges counted whole)."""
    n = shape.seq_len
    if shape.schedule is None:
        pairs = 0.0 if shape.window is not None else shape.heads * n * n
    else:
        branches = shape.schedule.at(n, shape.heads, shape.kv_heads).branches
        pairs = shape.heads * n * sum(min(w, n) / (r * r) for w, r in branches)
    pairs *= 0.5 if shape.is_causal else 1.0
    if shape.window is not None:
        left, right = (n if side < 0 else side for side in shape.window)
        pairs += shape.heads * n * min(n, left + (0 if shape.is_causal else right) + 1)
    return shape.batch * pairs


def _predicted_ms(shape: Shape, split: Split, world: int, topology: Topology) -> float:
    assert split.volume is not None
    compute = 7 * 2 * shape.head_dim * _pairs(shape) / world / (topology.tflops * 1e12)
    heads = head_volume(shape, split.heads, shape.seq_len // world)
    ring = split.volume.forward + split.volume.backward - heads.forward - heads.backward
    inside = split.heads <= topology.ranks_per_node
    a2a = (heads.forward + heads.backward) / (
        (topology.node_gbps if inside else topology.network_gbps) * 1e9
    )
    ring_gbps = topology.node_gbps if world <= topology.ranks_per_node else topology.network_gbps
    ring_s = ring / (ring_gbps * 1e9)
    return 1e3 * (compute + a2a + max(0.0, ring_s - compute))


def _refused(shape: Shape, ring: int, heads: int) -> str | None:
    """Why a ring of ``ring`` around head groups of ``heads`` cannot run ``shape``, or None."""
    parts = ring * heads * chunks_per_rank(shape.layout)
    if shape.seq_len % parts:
        return f"seq_len {shape.seq_len} does not divide into {parts} chunks"
    try:
        kv_repeats(shape.heads, shape.kv_heads, heads)
    except ValueError as exc:
        return str(exc).split(";")[0]
    return None


def plan_context_parallel(
    world_size: int,
    *,
    seq_len: int,
    num_heads: int,
    head_dim: int,
    num_kv_heads: int | None = None,
    batch: int = 1,
    segment_lengths: Sequence[int] | None = None,
    dilation_rates: Sequence[int] | None = None,
    is_causal: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    layout: str = "contiguous",
    topology: Topology | None = None,
    window_size: tuple[int, int] | None = None,
) -> SplitPlan:
    """The split of ``world_size`` ranks for a layer call of these properties (Note [Choosing
    the context-parallel split]); ``str(plan)`` says why, ``plan.mesh(device_type)`` builds it.

    Args:
        world_size: the context-parallel ranks.
        seq_len, num_heads, head_dim, num_kv_heads, batch: the whole call's shape.
        segment_lengths, dilation_rates: a dilated schedule (None: dense attention).
        is_causal, dtype, layout: the call's mask, dtype and sequence layout.
        topology: links and compute of the ranks (default :class:`Topology`).
        window_size: a local window ``(left, right)`` (with a schedule, one more branch): a ring
            then sends only its halo (Note [Halo exchange] in ``halo.py``), which the plan says.

    Raises:
        ValueError / TypeError: a bad argument, or no split runs the call.
    """
    world_size = V.check_positive_int("world_size", world_size)
    num_kv_heads = V.check_heads(head_dim * num_heads, num_heads, num_kv_heads)
    schedule = None
    if segment_lengths is not None or dilation_rates is not None:
        schedule = Schedule(segment_lengths, dilation_rates)  # type: ignore[arg-type]
    shape = Shape(
        V.check_positive_int("batch", batch), V.check_positive_int("seq_len", seq_len),
        num_heads, num_kv_heads, V.check_positive_int("head_dim", head_dim), dtype,
        V.check_bool("is_causal", is_causal), check_layout(layout), False, schedule,
        V.check_window_size(window_size),
    )  # fmt: skip
    return plan_split(shape, world_size, topology)


def plan_split(shape: Shape, world: int, topology: Topology | None = None) -> SplitPlan:
    """The split of ``world`` ranks the model predicts fastest for ``shape`` (Note [Choosing
    the context-parallel split]), with every split weighed; ties go to the larger ring (its
    transfers overlap compute).

    Raises:
        ValueError: no split can run ``shape`` (each split's reason in the message).
    """
    topology = topology or Topology()
    splits = []
    for heads in (h for h in range(1, world + 1) if world % h == 0):
        ring = world // heads
        reason = _refused(shape, ring, heads)
        if reason is not None:
            splits.append(Split(ring, heads, refused=reason))
            continue
        split = Split(ring, heads, split_volume(shape, ring, heads))
        ms = _predicted_ms(shape, split, world, topology)
        repeats = kv_repeats(shape.heads, shape.kv_heads, heads)
        splits.append(Split(ring, heads, split.volume, ms, kv_repeats=repeats))
    runnable = [s for s in splits if s.refused is None]
    if not runnable:
        reasons = "; ".join(f"{s.name}: {s.refused}" for s in splits)
        raise ValueError(f"no split of {world} ranks runs this call: {reasons}")
    chosen = min(runnable, key=lambda s: (round(s.predicted_ms or 0.0, 6), -s.ring))
    note = ""
    if shape.window is not None:
        note = (f"local window {shape.window}: a ring sends each rank only the key rows the "
                f"window reaches on other ranks (its halo), and their gradients back")  # fmt: skip
    return SplitPlan(chosen, tuple(splits), note)
