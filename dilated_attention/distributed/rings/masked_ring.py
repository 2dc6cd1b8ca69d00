"""Block-sparse ring attention whose blocks a run-time block mask chooses: the mask's checks, its
rows for this rank, and what travels (:class:`MaskedSteps`) in the one ring template.

Note [Run-time masks over the ring]
    A run-time block mask (Note [Run-time block masks] in ``block_sparse/runtime.py``) lives
    on the device: which block pairs it keeps is not known on the host without a
    synchronisation, so no rank can plan which keys another needs (as a pattern's exchange does,
    Note [Block-sparse exchange] in ``block_sparse_ring.py``). The key/value shards therefore
    travel as in the dense ring (Note [Ring schedule] in ``ring.py``): at step ``s`` rank ``r``
    holds the shard of rank ``r - s`` while the next is in flight. Each step runs the
    one-process fallback's calls (Note [Run-time masks on a dense kernel] in
    ``block_sparse/rows.py``) of this rank's query blocks against the visiting shard, each call
    reading its key mask from the step's slice of the kept blocks: the rows of this rank's query
    blocks, the columns of the visiting shard's blocks. Shards are whole blocks, so the slice's
    columns are exactly that shard's blocks. Causal: a later shard is not computed against (and
    its gradients send nothing), the rank's own shard runs the fallback's causal calls, and
    earlier shards are seen whole. Results merge through their log-sum-exp as every ring step's
    do; a step whose slice keeps nothing still costs its transfer (only a host read could skip
    it).

    The backward passes the shards again; each step's dK/dV go into one accumulator like the
    visiting shard (float32; float64 for float64 inputs), which goes home to its owner while
    the next step computes, as in the block-sparse exchange. Per layer a rank sends
    ``(W - 1)`` shards forward, and backward ``(W - 1)`` shards again plus one accumulator for
    each other rank whose shard it computed against (:func:`masked_ring_volume`).

Shape legend: B batch, n local tokens, N = W n positions, H query heads, Hkv key/value heads, D
head dim, W ranks, bs block size, mq = n / bs local query blocks, M = N / bs key blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ...block_sparse.plan import check_block_size
from ...block_sparse.rows import BlockRowCall, row_plan
from ...block_sparse.runtime import MaskLayout, check_block_mask, kept_blocks, per_query_head
from ..comm import collectives as _comm
from ..layout.cost import Volume
from .ring import pass_on
from .template import KeyBlock, RingSetup, StepGrads, Traffic, Transit

__all__ = ["MaskedSteps", "check_ring_mask", "local_rows", "masked_ring_volume"]


def check_ring_mask(
    query: torch.Tensor,
    key: torch.Tensor,
    mask: torch.Tensor,
    block_size: object,
    group: dist.ProcessGroup | None,
    cu_seqlens: object,
) -> MaskLayout:
    """A run-time block mask of a ring call, checked on its metadata (no host read).

    Args:
        query: (B, n, H, D) and key (B, n, Hkv, D): this rank's checked shards.
        mask: bool (Bm, Hm, Mq, M) or int block indices (Bm, Hm, Mq, K) over the whole
            sequence's key blocks, its rows all ``N / bs`` query blocks (the same mask on every
            rank) or this rank's ``n / bs`` (``shard_sequence(mask, seq_dim=2)``).

    Raises:
        TypeError / ValueError: as ``block_sparse_attention`` for the mask; a shard that is
            not whole blocks; packed documents (not supported with a run-time mask).
    """
    size = check_block_size(block_size)
    if cu_seqlens is not None:
        raise ValueError(
            "block_sparse_ring_attention with a run-time block mask takes no cu_seqlens: drop "
            "the pairs of two documents from the mask itself, or pass a pattern"
        )
    batch, n, heads, dim = query.shape
    world = _comm.group_rank_and_size(group)[1]
    if n % size:
        raise ValueError(
            f"block_sparse_ring_attention with a run-time block mask needs every shard to be "
            f"whole blocks: the local seq_len ({n}) must be a multiple of block_size={size}; "
            f"pad the sequence to a multiple of world_size x block_size ({world * size}) or "
            f"use a block_size that divides {n}"
        )
    rows = n if world > 1 and mask.dim() == 4 and mask.shape[2] == n // size else n * world
    # Zero-stride stand-ins: the check reads shapes and the device only.
    q_like = query.new_empty(()).expand(batch, rows, heads, dim)
    k_like = key.new_empty(()).expand(batch, n * world, key.shape[2], dim)
    return check_block_mask(mask, q_like, k_like, size)


def local_rows(
    mask: torch.Tensor, q: torch.Tensor, setup: RingSetup, block_size: int
) -> torch.Tensor:
    """The kept blocks of this rank's query blocks as its calls read them.

    Args:
        mask: a checked (:func:`check_ring_mask`) run-time mask.
        q: (B, n, H, D) this rank's queries.

    Returns:
        (B, 1 or H, mq, M) bool, True = the pair attends (causality is the calls').
    """
    n = q.shape[1]
    mq = n // block_size
    if mask.shape[2] != mq:  # the whole sequence's rows: this rank's
        mask = mask[:, :, setup.rank * mq : (setup.rank + 1) * mq]
    kept = kept_blocks(mask, block_size=block_size, query_len=n,
                       key_len=n * setup.world_size, is_causal=False)  # fmt: skip
    kept = per_query_head(kept, q.shape[2])
    return kept.expand(q.shape[0], *kept.shape[1:])


def _visible(setup: RingSetup, dst: int, src: int) -> bool:
    """Whether rank ``dst``'s queries see any key of rank ``src``'s shard (contiguous)."""
    return not setup.is_causal or src <= dst


@dataclass(frozen=True)
class MaskedSteps:
    """What travels in block-sparse ring attention with a run-time mask (Note [Run-time masks
    over the ring]): whole shards around the ring, and one dK/dV accumulator home per shard
    computed against.

    Attributes:
        kept: (B, 1 or H, mq, M) bool from :func:`local_rows`.
    """

    setup: RingSetup
    kept: torch.Tensor
    block_size: int

    def open(
        self,
        local: KeyBlock,
        dkv: torch.Tensor | None = None,
        kept: Sequence[KeyBlock | None] | None = None,
    ) -> Traffic:
        """The traffic of one pass over this rank's shard (:class:`~.template.Steps`; every
        shard travels again in the backward)."""
        return _MaskedBlocks(self, local, dkv)


@dataclass(frozen=True)
class _MaskedBlocks:
    """One pass of :class:`MaskedSteps` over this rank's shard ``local``; ``dkv`` (2, B, n,
    Hkv, D): its gradients' accumulators (backward)."""

    plan: MaskedSteps
    local: KeyBlock
    dkv: torch.Tensor | None = None

    @property
    def steps(self) -> int:
        return self.plan.setup.world_size

    def _src(self, step: int) -> int:
        setup = self.plan.setup
        return (setup.rank - step) % setup.world_size

    def fetch(self, step: int, held: KeyBlock | None) -> Transit[KeyBlock | None]:
        if step == 0:
            return Transit.done(self.local)
        assert held is not None  # every step holds a shard
        return pass_on(held, self.plan.setup)

    def calls(self, step: int) -> list[BlockRowCall]:
        """The fallback's calls of this rank's query blocks against rank ``src``'s shard, each
        with its row of the step's columns of the kept blocks."""
        setup, src, size = self.plan.setup, self._src(step), self.plan.block_size
        if not _visible(setup, setup.rank, src):
            return []
        n = self.local.kv.shape[2]
        columns = self.plan.kept[..., src * (n // size) : (src + 1) * (n // size)]
        plan = row_plan(n, n, size, setup.is_causal and src == setup.rank)
        return [replace(call, kept=columns) for call in plan.calls]

    def grads(self, step: int, keys: KeyBlock) -> StepGrads:
        if step == 0:
            return StepGrads(self.dkv)  # this rank's own keys: straight into its accumulators
        assert self.dkv is not None
        return StepGrads(torch.zeros(keys.kv.shape, dtype=self.dkv.dtype, device=keys.kv.device))

    def home(self, step: int, grads: StepGrads | None) -> Transit[None]:
        """The step's dK/dV go to the visiting shard's owner; those of this rank's shard
        computed by rank ``rank + step`` come back and add into its accumulators."""
        if step == 0:
            return Transit.done(None)
        setup, dkv = self.plan.setup, self.dkv
        assert dkv is not None
        src, sender = self._src(step), (setup.rank + step) % setup.world_size
        send, recv = [], []
        if grads is not None and grads.dkv is not None and _visible(setup, setup.rank, src):
            send.append((grads.dkv, setup.global_ranks[src]))
        incoming = None
        if _visible(setup, sender, setup.rank):
            incoming = torch.empty_like(dkv)
            recv.append((incoming, setup.global_ranks[sender]))

        def arrive() -> None:
            if incoming is not None:
                dkv.add_(incoming)

        return Transit(_comm.exchange(send, recv), arrive, tuple(t for t, _ in send))

    def finish(self) -> Transit[None]:
        return Transit.done(None)


def masked_ring_volume(
    key: torch.Tensor, setup: RingSetup, accumulator: torch.dtype
) -> Volume:
    """Bytes this rank sends in one call (Note [Run-time masks over the ring]).

    Args:
        key: (B, n, Hkv, D) this rank's keys (the shards' size and dtype).
        accumulator: the dtype the key gradients go home in.
    """
    ranks, rank = setup.world_size, setup.rank
    shard = 2 * key.numel() * key.element_size()
    grads = 2 * key.numel() * torch.empty(0, dtype=accumulator).element_size()
    home = sum(_visible(setup, rank, src) for src in range(ranks) if src != rank)
    return Volume((ranks - 1) * shard, (ranks - 1) * shard + home * grads)
