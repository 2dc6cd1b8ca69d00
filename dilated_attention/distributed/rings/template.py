"""The one ring template: the step loop every ring operation runs, forward and backward.

Note [One ring template]
    A ring operation runs in steps. At each step this rank holds some keys and values (its
    own, a block another rank passed on, the rows other ranks sent it) and runs kernel calls
    of its queries against them; results merge in float32 through their log-sum-exp (Note
    [Merging partial softmaxes]). While a step computes, the keys of the next step are already
    in flight. The backward walks the same steps with the final ``out``/``lse`` (Note [Backward
    with external statistics]); the dK/dV of keys that came from another rank go back to it
    while the next step computes, and what comes back for this rank's keys is added into its
    accumulators (Note [Gradients go home]).

    The loop is here, once (:func:`ring_forward`, :func:`ring_backward`). What differs between
    the operations is what travels, and is described by a :class:`Traffic`: the keys of each
    step (:meth:`Traffic.fetch`), the step's kernel calls (:meth:`Traffic.calls`), where the
    step's key gradients go (:meth:`Traffic.grads`) and how they go home
    (:meth:`Traffic.home`, :meth:`Traffic.finish`). Dense ring attention passes whole blocks
    on around the ring or gathers them at once (``ring.py``); block-sparse ring attention
    sends each rank only the kept blocks' keys it needs (``block_sparse_ring.py``); ring
    dilated attention sends only the dilated rows of its spanning branches, to the ranks that
    share their segments, and keeps them for the backward (``ring_dilated.py``); a local window
    sends each rank only the rows it reaches on other ranks, its halo, kept for the backward too
    (``halo.py``). The per-step kernel is a :class:`StepKernel`: the backend the resolve step
    chose, the softmax scale, the scores' soft-cap and how a call's result merges.

Shape legend: B batch, n local tokens, H query heads, Hkv key/value heads, D head dim, W ranks,
m key rows a step holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import torch
import torch.distributed as dist

from ...backends.base import Backend
from ...core.autograd import Backward, FirstOrderOnly, Forward, Grads, Inputs
from ...core.execution.call_runs import (
    Merge,
    accumulator_dtype,
    merge_rows,
    new_accumulators,
    row_lse,
    run_backward,
    run_forward,
)
from ...core.geometry.calls import Call, GradInputs, KernelArgs
from ..comm.collectives import wait_all

T = TypeVar("T")

#: One kernel call's key/value gradients: (rows of the keys the call read, dK, dV).
Part = tuple[Any, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class RingSetup:
    """Where this rank sits in the ring and how the sequence is laid out."""

    rank: int
    world_size: int
    global_ranks: tuple[int, ...]
    layout: str
    chunk_len: int
    is_causal: bool
    scale: float
    comm: str

    @property
    def next_rank(self) -> int:
        return self.global_ranks[(self.rank + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        return self.global_ranks[(self.rank - 1) % self.world_size]


@dataclass(frozen=True)
class KeyBlock:
    """Keys and values as they travel between ranks: ``kv`` (2, B, m, ...) (K then V) and, when
    the call has a key padding mask, ``mask`` (B, m) as uint8 (1 = ignore that key; gloo sends
    no bool tensors)."""

    kv: torch.Tensor
    mask: torch.Tensor | None = None

    @classmethod
    def of(
        cls, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None
    ) -> KeyBlock:
        """k, v (B, n, Hkv, D) and a (B, n) bool mask or None, stacked and contiguous."""
        mask = None
        if key_padding_mask is not None:
            mask = key_padding_mask.contiguous().view(torch.uint8)
        return cls(torch.stack([k, v]).contiguous(), mask)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What is sent for this block, in order."""
        return (self.kv,) if self.mask is None else (self.kv, self.mask)

    @property
    def key_padding_mask(self) -> torch.Tensor | None:
        """The block's (B, m) bool key padding mask, or None."""
        return None if self.mask is None else self.mask.view(torch.bool)


@dataclass(frozen=True)
class Transit(Generic[T]):
    """Transfers in flight (``requests``) and what they give once done (``then()``); ``sent``
    keeps the tensors being sent alive until they have left."""

    requests: Sequence[dist.Work]
    then: Callable[[], T]
    sent: tuple[torch.Tensor, ...] = ()

    @staticmethod
    def done(value: T) -> Transit[T]:
        """Nothing in flight: ``value`` at once."""
        return Transit((), lambda: value)

    def wait(self) -> T:
        """Wait for every transfer, then ``then()``."""
        wait_all(self.requests)
        return self.then()


@dataclass(frozen=True)
class StepKernel:
    """The per-step kernel: ``backend`` (the resolve step's choice) with softmax ``scale``;
    ``merge``: how a call's result merges into the forward's accumulators (the executor's
    :func:`~dilated_attention.core.execution.call_runs.merge_rows` for (B, n, H, D) ones);
    ``softcap``: every call's scores soft-capped (Note [Scores a kernel call transforms] in
    ``core/contract.py``)."""

    backend: Backend
    scale: float
    merge: Merge = merge_rows
    softcap: float | None = None


@dataclass(frozen=True)
class StepGrads:
    """Where one step's key/value gradients go: ``dkv`` (2, B, m, ...) accumulators like the
    step's keys, or, with ``dkv`` None, ``parts``: each kernel call's (rows, dK, dV) as the
    kernel returned them (:meth:`keep`)."""

    dkv: torch.Tensor | None = None
    parts: list[Part] = field(default_factory=list)

    def keep(self, call: Any, dk: torch.Tensor, dv: torch.Tensor) -> None:
        """``run_backward``'s ``kv_grads``: keep the call's gradients of its rows ``call.kv``."""
        self.parts.append((call.kv, dk.contiguous(), dv.contiguous()))


class Traffic(Protocol):
    """What travels between the ranks of one ring operation, for one pass (a forward or a
    backward) over ``steps`` steps (Note [One ring template])."""

    steps: int

    def fetch(self, step: int, held: KeyBlock | None) -> Transit[KeyBlock | None]:
        """Start moving the keys step ``step`` computes against (``held``: the previous step's
        keys); None: nothing to compute at that step."""
        ...

    def calls(self, step: int) -> Sequence[Call]:
        """The kernel calls of this rank's queries against the step's keys."""
        ...

    def grads(self, step: int, keys: KeyBlock) -> StepGrads:
        """Where the step's key/value gradients go (backward)."""
        ...

    def home(self, step: int, grads: StepGrads | None) -> Transit[None]:
        """Start sending the step's gradients (None: it computed nothing) to the ranks the keys
        came from and receiving what comes back for this rank's keys; the transit adds that in
        once done (backward)."""
        ...

    def finish(self) -> Transit[None]:
        """What goes home after the last step (backward)."""
        ...


def ring_forward(
    q: torch.Tensor,
    traffic: Traffic,
    kernel: StepKernel,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    keep: bool = False,
) -> tuple[list[Any], list[KeyBlock | None]]:
    """The forward of Note [One ring template]: every step's calls merged into ``out``/``lse``.

    Args:
        q: (B, n, H, D) local queries.
        out, lse: the accumulators ``kernel.merge`` merges into (for the executor's merge
            :func:`~dilated_attention.core.execution.call_runs.new_accumulators`: (B, n, H, D), (B,
            n, H, 1)).
        keep: also return every step's keys (for a backward that does not fetch them again).

    Returns:
        Every kernel call's ``aux`` in call order (the backward replays the same calls), and
        with ``keep`` each step's keys (else an empty list).
    """
    auxes: list[Any] = []
    kept: list[KeyBlock | None] = []
    transit = traffic.fetch(0, None) if traffic.steps else None
    for step in range(traffic.steps):
        assert transit is not None
        keys = transit.wait()
        if step + 1 < traffic.steps:
            transit = traffic.fetch(step + 1, keys)  # in flight while this step computes
        if keep:
            kept.append(keys)
        if keys is not None:
            run_forward(
                q, keys.kv[0], keys.kv[1], keys.key_padding_mask, traffic.calls(step),
                kernel.backend, scale=kernel.scale, out=out, lse=lse, auxes=auxes,
                merge=kernel.merge, softcap=kernel.softcap,
            )  # fmt: skip
    return auxes, kept


def ring_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    out: torch.Tensor,
    lse_rows: torch.Tensor,
    traffic: Traffic,
    kernel: StepKernel,
    auxes: list[Any],
    dq: torch.Tensor,
) -> None:
    """The backward of Note [One ring template]: dQ added into ``dq``, the key gradients sent
    home by ``traffic``, which adds what comes back into this rank's accumulators.

    Args:
        dout, q: (B, n, H, D); out, lse_rows: the final statistics as the calls read them
            ((B, n, H, D) and :func:`~dilated_attention.core.execution.call_runs.row_lse`'s (B, n,
            H, 1)).
        auxes: the forward's kernel ``aux`` values, in call order.
        dq: the accumulator the calls add dQ into.
    """
    aux_iter = iter(auxes)
    step_args = KernelArgs(kernel.backend, kernel.scale, softcap=kernel.softcap)
    returning: Transit[None] = Transit.done(None)
    transit = traffic.fetch(0, None) if traffic.steps else None
    for step in range(traffic.steps):
        assert transit is not None
        keys = transit.wait()
        if step + 1 < traffic.steps:
            transit = traffic.fetch(step + 1, keys)
        grads = None
        if keys is not None:  # calls run in the forward's order: each consumes its own aux
            grads = traffic.grads(step, keys)
            dkv = grads.dkv
            saved = GradInputs(dout, q, *keys.kv, out, lse_rows, keys.key_padding_mask)
            run_backward(
                saved, traffic.calls(step), step_args, aux_iter, dq=dq,
                dk=None if dkv is None else dkv[0], dv=None if dkv is None else dkv[1],
                kv_grads=grads.keep if dkv is None else None,
            )  # fmt: skip
        returning.wait()  # the previous step's gradients have left; what came back is added
        returning = traffic.home(step, grads)
    returning.wait()
    traffic.finish().wait()


class Steps(Protocol):
    """A ring operation's description of what travels: a :class:`Traffic` per pass."""

    def open(
        self,
        local: KeyBlock,
        dkv: torch.Tensor | None = None,
        kept: Sequence[KeyBlock | None] | None = None,
    ) -> Traffic:
        """The traffic of one pass over this rank's keys ``local``; ``dkv`` (2, B, n, Hkv, D):
        the backward's accumulators of their gradients (None in the forward); ``kept``: every
        step's keys as the forward held them, for a backward that fetches nothing again (only
        for steps that keep them, :attr:`RingRunner.keep`)."""
        ...


def finished_forward(
    q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, saved: tuple[Any, ...], state: Any
) -> Forward:
    """A ring runner's :class:`Forward` from its float32 accumulators ``out`` (B, n, H, D) and
    ``lse`` (B, n, H, 1): ``out`` in q's dtype, ``lse`` (B, H, n)."""
    return Forward(
        out.to(q.dtype), lse.squeeze(-1).transpose(1, 2).contiguous(), saved=saved, state=state
    )


def finished_grads(q: torch.Tensor, dq: torch.Tensor, dkv: torch.Tensor) -> Grads:
    """dq and the (2, B, n, Hkv, D) dK/dV accumulator as dq, dk, dv in the inputs' dtype."""
    return dq.to(q.dtype), dkv[0].to(q.dtype), dkv[1].to(q.dtype)


@dataclass(frozen=True)
class RingRunner(FirstOrderOnly):
    """A ring operation whose result is the ring's alone (dense, block-sparse, windowed) as a
    :class:`~dilated_attention.core.autograd.Runner`: :func:`ring_forward` and
    :func:`ring_backward` over this rank's keys, with the traffic of ``steps`` and ``kernel``.

    Attributes:
        first_order_message: the double-backward error (``ring_message``).
        keep: the forward keeps every step's keys and the backward reads them instead of
            fetching them again (few keys: a window's halo); else they travel again.
    """

    steps: Steps
    kernel: StepKernel
    first_order_message: str
    keep: bool = False

    def forward(self, x: Inputs) -> Forward:
        q, k, v, key_padding_mask = x
        local = KeyBlock.of(k, v, key_padding_mask)
        out, lse = new_accumulators(q)
        auxes, kept = ring_forward(
            q, self.steps.open(local), self.kernel, out, lse, keep=self.keep
        )
        held = tuple(None if block is None else block.kv for block in kept)
        masks = [None if block is None else block.mask for block in kept]  # bytes, no grads
        return finished_forward(q, out, lse, (local.kv, local.mask, *held), (auxes, masks))

    def backward(self, b: Backward) -> Grads:
        dout, q, out, lse, saved, (auxes, masks) = b
        local = KeyBlock(saved[0], saved[1])
        kept = None
        if self.keep:
            kept = [None if kv is None else KeyBlock(kv, mask)
                    for kv, mask in zip(saved[2:], masks, strict=True)]  # fmt: skip
        acc = accumulator_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dkv = torch.zeros(local.kv.shape, dtype=acc, device=q.device)
        traffic = self.steps.open(local, dkv, kept)
        ring_backward(dout.contiguous(), q, out, row_lse(lse), traffic, self.kernel, auxes, dq)
        return finished_grads(q, dq, dkv)
