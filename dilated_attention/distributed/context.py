"""Context parallelism as the ranks of a mesh: a ring over one group, a head all-to-all over
another, or both.

Note [Context parallel groups]
    A long-sequence job splits the sequence over ``W`` ranks. :class:`ContextParallel` says how:
    a *head* group of ``Wh`` ranks exchanges heads for positions (Note [Head all-to-all] in
    ``alltoall.py``: each then holds ``Wh`` shards' positions of ``H / Wh`` heads), and a *ring*
    group of ``Wr`` ranks runs the ring functions over those larger shards, ``W = Wr * Wh``.
    Either may be absent: a ring alone is today's ring attention, heads alone DeepSpeed-Ulysses,
    both the hybrid of USP and TransformerEngine's ``a2a+p2p``. The groups usually come from a
    ``DeviceMesh`` (:meth:`ContextParallel.from_mesh`): the head group within a node, where the
    all-to-all is cheap, the ring across nodes.

    Rank ``(r, a)`` (ring rank ``r``, head rank ``a``) holds the ``a``-th ``1 / Wh`` of each
    chunk of ring shard ``r`` (Note [Sequence layouts] in ``sharding.py``): after the head
    all-to-all it holds ring shard ``r`` whole, in the ring's layout
    (:func:`mesh_positions`; ``shard_sequence(x, group=cp)`` cuts it so).

Note [One answer on every rank of a mesh]
    On a mesh a call's ranks agree in two steps: each head group, then each ring group (a
    collective needs all of its group's ranks, and the ranks of one group are those that meet
    next). Both steps must give every rank of the mesh the same answer, or some ranks raise
    while others wait for them in a later collective until the process group's timeout:

    - an error in the first step is carried into the second (:func:`check_same_everywhere`,
      ``reject_ring_call``), where the ranks of the other head groups wait;
    - the head group compares everything the ring's agreement compares (shapes, dtype, device
      type, grad mode, layout, options, schedule, mask), so a ring group that finds a
      difference is never alone: every ring group meets ranks that differ alike, and all raise
      together. (A ring group that raised while another went on would leave the ranks of the
      one waiting in the exchange back to the others' heads.)

Shape legend: N positions, n a rank's positions, H query heads, Hkv key/value heads.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .. import _validation as V
from .comm.alltoall import HeadExchange
from .comm.collectives import (
    GRAD_MODE,
    GRAD_MODE_FIX,
    backward_follows,
    check_same_on_all_ranks,
    global_rank,
    group_rank_and_size,
)

__all__ = [
    "DOCUMENTS",
    "DOCUMENTS_FIX",
    "HEAD_FIELDS",
    "ContextParallel",
    "HeadSplit",
    "agree_on_heads",
    "check_same_everywhere",
    "kv_repeats",
    "mesh_positions",
    "no_documents",
]  # fmt: skip

#: The agreement field of packed documents' offsets (the ring's, ``LongNetLM``'s), and its
#: advice on a mismatch.
DOCUMENTS = "cu_seqlens (packed documents' offsets)"
DOCUMENTS_FIX = (
    "every rank must pass the same cu_seqlens (the offsets of the documents over the whole "
    "sharded row), or every rank none"
)

#: What the ranks of a head group compare before the exchange (Note [One answer on every rank
#: of a mesh]).
HEAD_FIELDS = ("batch", "local seq_len", "query heads", "key/value heads", "head_dim", "dtype",
               "key_padding_mask given (0/1)", "options and schedule", "device type",
               GRAD_MODE)  # fmt: skip


@dataclass(frozen=True)
class ContextParallel:
    """The groups of context parallelism (Note [Context parallel groups]); pass it as ``group=``
    to the ring functions and modules, ``shard_sequence`` and ``sequence_positions``.

    Attributes:
        ring: the group keys travel around (None: no ring).
        heads: the group of the head all-to-all (None: no all-to-all).
    """

    ring: dist.ProcessGroup | None = None
    heads: dist.ProcessGroup | None = None

    @classmethod
    def from_mesh(
        cls, mesh: Any, *, ring: str | None = None, heads: str | None = None
    ) -> ContextParallel:
        """The groups of the named dimensions of a ``torch.distributed.device_mesh.DeviceMesh``.

        Raises:
            ValueError: neither dimension named, or a name the mesh does not have.
        """
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if ring is None and heads is None:
            raise ValueError(
                "name the mesh dimension of the ring (ring='cp') and/or of the head all-to-all "
                "(heads='cp_heads')"
            )
        for dim in (ring, heads):
            if dim is not None and dim not in names:
                raise ValueError(
                    f"the mesh has dimensions {names}, got {dim!r}; name one of them, e.g. "
                    f"init_device_mesh(device, (2, 2), mesh_dim_names=('dp', 'cp'))"
                )
        return cls(
            ring=None if ring is None else mesh.get_group(ring),
            heads=None if heads is None else mesh.get_group(heads),
        )

    def sizes(self) -> tuple[int, int]:
        """``(ring ranks, head ranks)``, 1 for an absent group."""
        ring = 1 if self.ring is None else group_rank_and_size(self.ring)[1]
        heads = 1 if self.heads is None else group_rank_and_size(self.heads)[1]
        return ring, heads

    def ranks(self) -> tuple[int, int]:
        """This process's ``(ring rank, head rank)``, 0 in an absent group."""
        ring = 0 if self.ring is None else group_rank_and_size(self.ring)[0]
        heads = 0 if self.heads is None else group_rank_and_size(self.heads)[0]
        return ring, heads

    def head_exchange(self, parts: int) -> HeadExchange:
        """This rank's place in the head all-to-all, the ring shard cut into ``parts`` chunks."""
        rank, size = group_rank_and_size(self.heads)
        ranks = tuple(global_rank(self.heads, r) for r in range(size))
        return HeadExchange(rank, ranks, parts)

    def __str__(self) -> str:
        ring, heads = self.sizes()
        return f"ring of {ring} x head all-to-all of {heads}"


def mesh_positions(
    local_len: int, cp: ContextParallel, parts: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """The global positions (int64, ``(local_len,)``) of this rank's tokens under ``cp``, the
    ring's shards in ``parts`` chunks per rank (1: contiguous, 2: zigzag; Note [Context
    parallel groups])."""
    (ring_rank, head_rank), (ring_size, head_size) = cp.ranks(), cp.sizes()
    piece = local_len // parts  # this rank's share of one ring chunk
    chunk = piece * head_size
    chunks = [ring_rank] if parts == 1 else [ring_rank, 2 * ring_size - 1 - ring_rank]
    starts = [c * chunk + head_rank * piece for c in chunks]
    return torch.cat([torch.arange(a, a + piece, device=device) for a in starts])


def kv_repeats(num_heads: int, num_kv_heads: int, ranks: int) -> int:
    """How many times each key/value head is repeated so that the key/value heads split over
    ``ranks`` with their query heads (Note [Calls under a head all-to-all]).

    Raises:
        ValueError: ``num_heads`` not divisible by ``ranks``, or by the repeated key/value heads.
    """
    if num_heads % ranks:
        raise ValueError(
            f"a head all-to-all over {ranks} ranks needs the query heads ({num_heads}) divisible "
            f"by {ranks}; use a head group whose size divides the heads, or a ring alone"
        )
    repeats = ranks // math.gcd(num_kv_heads, ranks)
    if num_heads % (num_kv_heads * repeats):
        raise ValueError(
            f"{num_kv_heads} x {repeats} = {num_kv_heads * repeats} key/value heads (the "
            f"{num_kv_heads} repeated to split over {ranks} ranks) do not divide the "
            f"{V.counted(num_heads, 'query head')}; use a head group of a size that divides both"
        )
    return repeats


@dataclass(frozen=True)
class HeadSplit:
    """A call's heads over a head group: ``ranks`` ranks, each with ``heads`` query heads and
    ``kv_heads`` key/value heads (each of the call's repeated ``kv_repeats`` times)."""

    ranks: int
    heads: int
    kv_heads: int
    kv_repeats: int

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, ranks: int) -> HeadSplit:
        repeats = kv_repeats(num_heads, num_kv_heads, ranks)
        return cls(ranks, num_heads // ranks, num_kv_heads * repeats // ranks, repeats)


def agree_on_heads(
    q: object,
    k: object,
    v: object,
    mask: object,
    cp: ContextParallel,
    what: str,
    options: Callable[[], object] | None = None,
) -> HeadSplit:
    """Check this rank's tensors and ``options()`` (the call's options and schedule, checked;
    their text is compared), then agree on them over the head group (an error on any rank
    raises on every rank); the call's heads over the group. Grad mode is compared because the
    exchange's backward is itself an exchange: a rank that records no graph would leave its
    peers' backward waiting."""
    _, ranks = cp.sizes()
    names = HEAD_FIELDS
    fields, error, split = [0] * len(names), None, None
    try:
        qt, kt, vt = V.check_qkv(q, k, v, same_length=True)
        V.check_key_padding_mask(mask, qt.shape[0], qt.shape[1], qt.device)
        split = HeadSplit.of(qt.shape[2], kt.shape[2], ranks)
        said = "" if options is None else str(options())
        fields = [qt.shape[0], qt.shape[1], qt.shape[2], kt.shape[2], qt.shape[3],
                  zlib.crc32(str(qt.dtype).encode()), int(mask is not None),
                  zlib.crc32(said.encode()), zlib.crc32(qt.device.type.encode()),
                  int(backward_follows(qt, kt, vt))]  # fmt: skip
    except Exception as exc:  # a rejection on one rank must reach the others: no hang
        error = exc
    check_same_on_all_ranks(fields, names, cp.heads, error, what=f"{what} under a head all-to-all",
                            fixes={GRAD_MODE: GRAD_MODE_FIX})  # fmt: skip
    assert split is not None  # check_same_on_all_ranks raised otherwise
    return split


def no_documents(cu_seqlens: object) -> None:
    """Raise ``ValueError`` for packed documents under a :class:`ContextParallel` group."""
    if cu_seqlens is not None:
        raise ValueError(
            "cu_seqlens (packed documents) with a ContextParallel group is not supported: pass "
            "the ring's process group (group=cp.ring) for packed documents over ranks"
        )


def check_same_everywhere(
    fields: list[int],
    names: Sequence[str],
    group: ContextParallel | dist.ProcessGroup | None,
    error: Exception | None = None,
    **options: Any,
) -> None:
    """``check_same_on_all_ranks`` over a process group, or over both groups of a
    :class:`ContextParallel` in turn, an error of the first carried into the second: every
    rank of the mesh's context-parallel ranks raises when any of them does."""
    if not isinstance(group, ContextParallel):
        check_same_on_all_ranks(fields, names, group, error, **options)
        return
    for part in (group.heads, group.ring):
        if part is None:
            continue
        try:
            check_same_on_all_ranks(fields, names, part, error, **options)
        except Exception as exc:  # carried into the next group's check: no hang there
            error = exc
    if error is not None:
        raise error


def check_group(group: object, name: str = "group") -> None:
    """Raise ``TypeError`` unless ``group`` is a :class:`ContextParallel`, a process group or
    None (the world)."""
    if group is not None and not isinstance(group, ContextParallel | dist.ProcessGroup):
        raise TypeError(
            f"{name} must be a ContextParallel, a torch.distributed process group or None, got "
            f"{group!r} ({type(group).__name__}); e.g. ContextParallel.from_mesh(mesh, "
            f"ring='cp')"
        )
