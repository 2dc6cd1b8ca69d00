"""The exchange of Note [Block-sparse exchange]: a plan of position calls over a sequence sharded
across ranks, each step between ranks ``s`` apart moving only the keys the other rank's calls
read, and their dK/dV back. Block-sparse ring attention (``block_sparse_ring.py``) and packed
documents over ranks (``packed_ring.py``) give the plan; the loop is the one ring template's.

Shape legend: B batch, n local tokens, Hkv key/value heads, D head dim, m positions exchanged by
a pair of ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ...block_sparse.plan import SparseCall
from ..rings.template import KeyBlock, RingSetup, StepGrads, Traffic, Transit
from . import collectives as _comm

__all__ = ["ExchangeStep", "Needs", "SparseSteps", "exchange_steps"]


@dataclass(frozen=True)
class ExchangeStep:
    """One step of Note [Block-sparse exchange] for this rank.

    Attributes:
        src: group rank whose keys this step reads (this rank at step 0).
        dst: group rank this step sends to (this rank at step 0).
        recv_len: positions received from ``src`` (0: nothing to receive or compute).
        send_index: (m,) int64 local rows sent to ``dst`` (empty: nothing to send).
        calls: kernel calls (``SparseCall``, or any executor ``Call``); their key rows count
            rows of the local shard (step 0) or of the received buffer.
    """

    src: int
    dst: int
    recv_len: int
    send_index: torch.Tensor
    calls: list[Any]


#: ``needs(dst, src)``: the global key positions of ``src``'s shard that ``dst``'s queries need,
#: and dst's calls on them (``kv_index`` relative to ``src``'s shard).
Needs = Callable[[int, int], tuple[torch.Tensor, list[SparseCall]]]


def exchange_steps(
    needs: Needs, n: int, world_size: int, rank: int, device: torch.device
) -> tuple[ExchangeStep, ...]:
    """This rank's steps of Note [Block-sparse exchange] for any plan of position calls whose
    rank pairs ``needs`` gives (a pattern's blocks, packed documents)."""
    steps: list[ExchangeStep] = []
    for shift in range(world_size):
        src, dst = (rank - shift) % world_size, (rank + shift) % world_size
        needed, calls = needs(rank, src)
        if shift == 0:
            steps.append(ExchangeStep(src, dst, 0, torch.zeros(0, dtype=torch.int64), calls))
            continue
        # Received rows arrive compacted, in the order of ``needed``.
        calls = [
            replace(c, kv_index=torch.searchsorted(needed, c.kv_index + src * n)) for c in calls
        ]
        sent, _ = needs(dst, rank)
        steps.append(ExchangeStep(src, dst, needed.numel(), sent - rank * n, calls))
    return tuple(
        ExchangeStep(
            step.src, step.dst, step.recv_len, step.send_index.to(device),
            [c.to(device) for c in step.calls],
        )
        for step in steps
    )


def _post_kv(local: KeyBlock, step: ExchangeStep, setup: RingSetup) -> Transit[KeyBlock | None]:
    """Start the K/V exchange of ``step``: send the rows ``step.dst`` needs, receive those from
    ``step.src`` (None: nothing to receive); a key padding mask travels with its rows."""
    kv, mask = local.kv, local.mask
    send, recv = [], []
    payload: tuple[torch.Tensor, ...] = ()
    if step.send_index.numel():
        payload = (kv.index_select(2, step.send_index).contiguous(),)
        if mask is not None:
            payload += (mask.index_select(1, step.send_index).contiguous(),)
        send += [(t, setup.global_ranks[step.dst]) for t in payload]
    received = None
    if step.recv_len:
        buffer = torch.empty(
            (2, kv.shape[1], step.recv_len, *kv.shape[3:]), dtype=kv.dtype, device=kv.device
        )
        rows = None if mask is None else mask.new_empty((mask.shape[0], step.recv_len))
        received = KeyBlock(buffer, rows)
        recv += [(t, setup.global_ranks[step.src]) for t in received.tensors()]
    return Transit(_comm.exchange(send, recv), lambda: received, payload)


@dataclass(frozen=True)
class _Exchange:
    """One pass of Note [Block-sparse exchange] over this rank's keys ``local`` (kv
    (2, B, n, Hkv, D)); ``dkv``: their gradients' float32 accumulators (backward); ``kept``:
    the keys each step received in the forward (backward: nothing travels but gradients)."""

    schedule: tuple[ExchangeStep, ...]
    setup: RingSetup
    local: KeyBlock
    dkv: torch.Tensor | None = None
    kept: Sequence[KeyBlock | None] | None = None

    @property
    def steps(self) -> int:
        return len(self.schedule)

    def fetch(self, step: int, held: KeyBlock | None) -> Transit[KeyBlock | None]:
        if step == 0:
            return Transit.done(self.local)
        if self.kept is not None:
            return Transit.done(self.kept[step])
        return _post_kv(self.local, self.schedule[step], self.setup)

    def calls(self, step: int) -> list[Any]:
        return self.schedule[step].calls

    def grads(self, step: int, keys: KeyBlock) -> StepGrads:
        if step == 0:
            return StepGrads(self.dkv)  # this rank's own keys: straight into its accumulators
        assert self.dkv is not None
        return StepGrads(torch.zeros(keys.kv.shape, dtype=self.dkv.dtype, device=keys.kv.device))

    def home(self, step: int, grads: StepGrads | None) -> Transit[None]:
        """dK/dV of the rows received from ``src`` go home to it; those of the rows this rank
        sent to ``dst`` come back and add into its accumulators."""
        if step == 0:
            return Transit.done(None)
        entry, dkv = self.schedule[step], self.dkv
        assert dkv is not None
        send, recv = [], []
        if grads is not None and grads.dkv is not None:
            send.append((grads.dkv, self.setup.global_ranks[entry.src]))
        incoming = None
        if entry.send_index.numel():
            incoming = torch.empty(
                (2, dkv.shape[1], entry.send_index.numel(), *dkv.shape[3:]), dtype=dkv.dtype,
                device=dkv.device,
            )  # fmt: skip
            recv.append((incoming, self.setup.global_ranks[entry.dst]))

        def arrive() -> None:
            if incoming is not None:
                dkv.index_add_(2, entry.send_index, incoming)

        return Transit(_comm.exchange(send, recv), arrive, tuple(t for t, _ in send))

    def finish(self) -> Transit[None]:
        return Transit.done(None)


@dataclass(frozen=True)
class SparseSteps:
    """What travels in block-sparse ring attention (Note [Block-sparse exchange]): the keys of
    the kept block pairs, each step between ranks ``s`` apart, and their dK/dV back."""

    schedule: tuple[ExchangeStep, ...]
    setup: RingSetup

    def open(
        self,
        local: KeyBlock,
        dkv: torch.Tensor | None = None,
        kept: Sequence[KeyBlock | None] | None = None,
    ) -> Traffic:
        """The traffic of one pass over this rank's keys (:class:`~.template.Steps`)."""
        return _Exchange(self.schedule, self.setup, local, dkv, kept)
