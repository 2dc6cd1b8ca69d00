"""Block-sparse attention over a sequence sharded across the ranks of a process group.

Each rank holds a contiguous shard (B, n, ...) of a sequence of ``N = W * n`` tokens (rank ``r``
holds tokens ``[r * n, (r + 1) * n)``; see ``shard_sequence``). Blocks are global: block ``i``
holds tokens ``[i * block_size, (i + 1) * block_size)`` of the whole sequence, and a block may
straddle two shards. The result is this rank's shard of :func:`block_sparse_attention` on the
gathered sequence, with exact gradients.

Note [Block-sparse exchange]
    The pattern is global, so every rank can compute, for every pair of ranks ``(dst, src)``,
    exactly which key positions of ``src``'s shard the queries of ``dst`` need (the keys of the
    kept block pairs, cut to causal visibility; Note [Block-sparse plan]). The schedule has
    ``W`` steps. Step 0 computes against the local shard. At step ``s`` rank ``r`` receives from
    ``r - s`` the positions it needs from that rank and sends to ``r + s`` the positions ``r + s``
    needs from it; a pair that needs nothing exchanges nothing, so a step whose block pairs are
    empty for every rank sends no bytes at all (e.g. ``LocalWindow(0)`` with block-aligned
    shards, or every later rank under a causal mask), and a sparse step sends only the needed
    keys instead of the whole shard. The next step's exchange is in flight while the current one
    computes. Results merge in float32 (Note [Merging partial softmaxes]).

    The backward walks the same schedule: the needed K/V travel again (nothing is kept from the
    forward), each rank replays its kernel calls with the final ``out``/``lse``, and the dK/dV
    of the positions it received go back to their owner in the same step, where they add into
    the owner's float32 accumulators.

    Unlike the dense ring (``ring.py``), blocks are not forwarded around the ring: each step is a
    direct exchange between ranks ``s`` apart, which is what lets steps be skipped.

Shape legend: B batch, n local tokens, H query heads, Hkv key/value heads, D head dim, W ranks,
m positions exchanged by a pair of ranks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from .. import _validation as V
from ..backends.base import Backend
from ..backends.registry import check_backend_name
from ..block_sparse import plan as block_plan
from ..block_sparse.plan import (
    SparseCall,
    call_positions,
    causal_block_mask,
    check_block_size,
    num_blocks,
    plan_calls,
)
from ..compiled import eager_only
from ..core.autograd import Backward, FirstOrderOnly, Forward, Grads, Inputs, run_attention
from ..core.engine import (
    accumulator_dtype,
    empty_attention,
    new_accumulators,
    row_lse,
    run_backward,
    run_forward,
)
from ..core.higher_order import ring_message
from ..core.schedule_state import (
    BlockSparseScheduleState,
    block_sparse_schedule,
    describe_schedule,
)
from ..modules import BlockSparseMultiheadAttention, build_block_sparse_kind
from ..patterns import Pattern, check_pattern
from . import _comm
from .ring import (
    AgreedForward,
    RingSetup,
    finished_forward,
    finished_grads,
    prepare_ring,
    reject_ring_call,
)

__all__ = [
    "BlockSparseRingAttention",
    "BlockSparseRingDilatedAttention",
    "BlockSparseRingMultiheadAttention",
    "BlockSparseRingMultiheadDilatedAttention",
    "block_sparse_ring_attention",
]


@dataclass(frozen=True)
class _Step:
    """One step of Note [Block-sparse exchange] for this rank.

    Attributes:
        src: group rank whose keys this step reads (this rank at step 0).
        dst: group rank this step sends to (this rank at step 0).
        recv_len: positions received from ``src`` (0: nothing to receive or compute).
        send_index: (m,) int64 local rows sent to ``dst`` (empty: nothing to send).
        calls: kernel calls; ``kv_index`` counts rows of the local shard (step 0) or of the
            received buffer.
    """

    src: int
    dst: int
    recv_len: int
    send_index: torch.Tensor
    calls: list[SparseCall]


def _needs(
    mask: torch.Tensor,
    block_size: int,
    n: int,
    world_size: int,
    dst: int,
    src: int,
    is_causal: bool,
    budget: int,
) -> tuple[torch.Tensor, list[SparseCall]]:
    """Global key positions of ``src``'s shard that ``dst`` needs, and dst's calls on them
    (``kv_index`` relative to ``src``'s shard)."""
    seq_len = n * world_size
    calls = plan_calls(
        mask, block_size=block_size, query_len=seq_len, key_len=seq_len, is_causal=is_causal,
        query_range=(dst * n, (dst + 1) * n), key_range=(src * n, (src + 1) * n),
        max_kv_rows=budget,
    )  # fmt: skip
    return call_positions(calls) + src * n, calls


@functools.lru_cache(maxsize=32)
def _schedule(
    pattern: Pattern,
    block_size: int,
    n: int,
    world_size: int,
    rank: int,
    is_causal: bool,
    device: torch.device,
    budget: int,
) -> tuple[_Step, ...]:
    """This rank's steps of Note [Block-sparse exchange] (pure: the same on every call)."""
    blocks = num_blocks(n * world_size, block_size)
    mask = causal_block_mask(pattern.block_mask(blocks, blocks), is_causal)
    steps = []
    for shift in range(world_size):
        src, dst = (rank - shift) % world_size, (rank + shift) % world_size
        needed, calls = _needs(mask, block_size, n, world_size, rank, src, is_causal, budget)
        if shift == 0:
            steps.append(_Step(src, dst, 0, torch.zeros(0, dtype=torch.int64), calls))
            continue
        # Received rows arrive compacted, in the order of ``needed``.
        calls = [
            SparseCall(c.q_index, torch.searchsorted(needed, c.kv_index + src * n), c.causal)
            for c in calls
        ]
        sent, _ = _needs(mask, block_size, n, world_size, dst, rank, is_causal, budget)
        steps.append(_Step(src, dst, needed.numel(), sent - rank * n, calls))
    return tuple(
        _Step(s.src, s.dst, s.recv_len, s.send_index.to(device), [c.to(device) for c in s.calls])
        for s in steps
    )


_Pending = tuple[list[Any], torch.Tensor | None, torch.Tensor | None]


def _post_kv(kv: torch.Tensor, step: _Step, setup: RingSetup) -> _Pending:
    """Start the K/V exchange of ``step``: (requests, receive buffer, send buffer)."""
    send, recv = [], []
    payload = buffer = None
    if step.send_index.numel():
        payload = kv.index_select(2, step.send_index).contiguous()
        send.append((payload, setup.global_ranks[step.dst]))
    if step.recv_len:
        buffer = torch.empty(
            (2, kv.shape[1], step.recv_len, *kv.shape[3:]), dtype=kv.dtype, device=kv.device
        )
        recv.append((buffer, setup.global_ranks[step.src]))
    return _comm.exchange(send, recv), buffer, payload


def _ring_forward(
    q: torch.Tensor, kv: torch.Tensor, steps: tuple[_Step, ...], setup: RingSetup, kernel: Backend
) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
    """Forward of Note [Block-sparse exchange].

    Args:
        q: (B, n, H, D); kv: (2, B, n, Hkv, D) contiguous.

    Returns:
        ``out`` (B, n, H, D) and ``lse`` (B, n, H, 1), float32 (float64 for float64 inputs), and
        every kernel call's ``aux`` in call order.
    """
    out, lse = new_accumulators(q)
    auxes: list[Any] = []
    pending = _post_kv(kv, steps[1], setup) if len(steps) > 1 else None
    options = {"scale": setup.scale, "out": out, "lse": lse, "auxes": auxes}
    run_forward(q, kv[0], kv[1], None, steps[0].calls, kernel, **options)
    for index in range(1, len(steps)):
        assert pending is not None
        requests, buffer, _ = pending
        _comm.wait_all(requests)
        pending = _post_kv(kv, steps[index + 1], setup) if index + 1 < len(steps) else None
        if buffer is not None:
            calls = steps[index].calls
            run_forward(q, buffer[0], buffer[1], None, calls, kernel, **options)
    return out, lse, auxes


def _ring_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    steps: tuple[_Step, ...],
    setup: RingSetup,
    kernel: Backend,
    auxes: list[Any],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of Note [Block-sparse exchange].

    Args:
        dout, q, out: (B, n, H, D); kv: (2, B, n, Hkv, D); lse: (B, H, n) final statistics.

    Returns:
        ``dq`` (B, n, H, D) and ``dkv`` (2, B, n, Hkv, D), float32 (float64 for float64 inputs).
    """
    acc = accumulator_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
    aux_iter = iter(auxes)
    scale = setup.scale
    pending = _post_kv(kv, steps[1], setup) if len(steps) > 1 else None
    lse_rows = row_lse(lse)
    run_backward(
        dout, q, kv[0], kv[1], out, lse_rows, None, steps[0].calls, kernel, aux_iter,
        scale=scale, dq=dq, dk=dkv[0], dv=dkv[1],
    )  # fmt: skip
    for index in range(1, len(steps)):
        assert pending is not None
        requests, buffer, _ = pending
        _comm.wait_all(requests)
        pending = _post_kv(kv, steps[index + 1], setup) if index + 1 < len(steps) else None
        step = steps[index]
        send, recv = [], []
        if buffer is not None:
            dbuf = torch.zeros(buffer.shape, dtype=acc, device=q.device)
            run_backward(
                dout, q, buffer[0], buffer[1], out, lse_rows, None, step.calls, kernel, aux_iter,
                scale=scale, dq=dq, dk=dbuf[0], dv=dbuf[1],
            )  # fmt: skip
            send.append((dbuf, setup.global_ranks[step.src]))  # dK/dV go home to their owner
        incoming = None
        if step.send_index.numel():
            incoming = torch.empty(
                (2, kv.shape[1], step.send_index.numel(), *kv.shape[3:]), dtype=acc,
                device=q.device,
            )  # fmt: skip
            recv.append((incoming, setup.global_ranks[step.dst]))
        _comm.wait_all(_comm.exchange(send, recv))
        if incoming is not None:
            dkv.index_add_(2, step.send_index, incoming)
    return dq, dkv


@dataclass(frozen=True)
class BlockSparseRingRunner(FirstOrderOnly):
    """Block-sparse ring attention as a :class:`~dilated_attention.core.autograd.Runner`:
    :func:`_ring_forward` / :func:`_ring_backward` over ``steps`` on ``kernel``."""

    steps: tuple[_Step, ...]
    setup: RingSetup
    kernel: Backend
    first_order_message: ClassVar[str] = ring_message(
        "block_sparse_ring_attention", "block_sparse_attention()"
    )

    def forward(self, x: Inputs) -> Forward:
        q, k, v, _ = x  # no key padding mask here
        kv = torch.stack([k, v]).contiguous()
        out, lse, auxes = _ring_forward(q, kv, self.steps, self.setup, self.kernel)
        return finished_forward(q, out, lse, (kv,), auxes)

    def backward(self, b: Backward) -> Grads:
        dout, q, out, lse, saved, state = b
        (kv,) = saved
        dq, dkv = _ring_backward(
            dout.contiguous(), q, kv, out, lse, self.steps, self.setup, self.kernel, state
        )
        return finished_grads(q, dq, dkv)


_DILATED_SCHEDULE = "schedule (segment_lengths, dilation_rates)"


@eager_only("block_sparse_ring_attention")  # torch.compile runs it eagerly
def block_sparse_ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    pattern: Pattern,
    *,
    block_size: int = 128,
    group: dist.ProcessGroup | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    backend: str | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention over a sequence sharded across ``group``; this rank's shard.

    Equals this rank's shard of ``block_sparse_attention(gathered q, k, v, pattern, ...)``, with
    blocks counted over the whole sequence (Note [Block-sparse exchange]).

    Args:
        query: (B, n, H, D) this rank's contiguous shard (``shard_sequence(x)``, N = W * n).
        key: (B, n, Hkv, D).
        value: (B, n, Hkv, D).
        pattern: a :mod:`dilated_attention.patterns` pattern over the global blocks
            ``ceil(N / block_size)``.
        block_size: tokens per block; blocks may straddle shards and the last may be shorter.
        group: the process group (default: the world).
        is_causal: causal over global positions.
        scale: softmax scale; ``None`` means ``D ** -0.5``.
        backend: kernel name for the per-step calls, or ``None`` for the registry's choice.
        return_lse: also return the log-sum-exp (B, H, n).

    Returns:
        ``out`` (B, n, H, D), or ``(out, lse)``. A batch of 0 (or 0 heads) gives empty tensors,
        as in one process.

    Raises:
        TypeError / ValueError: on every rank, before any other communication, when inputs are
            malformed or differ between ranks (shapes, options, grad mode, pattern, block_size;
            as in ``ring_attention``).
    """

    def check_schedule() -> object:
        # Runs inside prepare_ring's summary exchange: a rejected argument on one rank becomes
        # an error on every rank instead of a hang.
        checked = check_pattern(pattern)
        size = check_block_size(block_size)
        if not isinstance(return_lse, bool):
            raise TypeError(f"return_lse must be a bool, got {return_lse!r}")
        if isinstance(query, torch.Tensor) and query.dim() == 4:
            blocks = num_blocks(query.shape[1] * _comm.group_rank_and_size(group)[1], size)
            checked.block_mask(blocks, blocks)  # a Custom mask of the wrong size fails here
        return describe_schedule(block_sparse_schedule(checked, size))  # readable, exact

    try:
        q, k, v, setup, kernel = prepare_ring(
            query, key, value, group=group, is_causal=is_causal, scale=scale,
            layout="contiguous", backend=backend, comm="ring", check_schedule=check_schedule,
        )  # fmt: skip
    except ValueError as exc:
        # prepare_ring names its schedule field after dilated attention's; say what it holds here.
        text = str(exc).replace(_DILATED_SCHEDULE, "schedule (pattern, block_size)")
        if text != str(exc):
            raise ValueError(text) from exc
        raise
    if q.numel() == 0:  # batch 0 or 0 heads, agreed on every rank: as in one process
        out, lse = empty_attention(q, k, v)
        return (out, lse) if return_lse else out
    n = q.shape[1]
    steps = _schedule(
        pattern, int(block_size), n, setup.world_size, setup.rank, is_causal, q.device,
        max(n, block_plan.MIN_KV_ROWS_PER_CALL),
    )  # fmt: skip
    out, lse = run_attention(q, k, v, None, BlockSparseRingRunner(steps, setup, kernel.backend))
    return (out, lse) if return_lse else out


class BlockSparseRingAttention(BlockSparseScheduleState, nn.Module):
    """Block-sparse attention over a sharded sequence; see :func:`block_sparse_ring_attention`.

    ``BlockSparseRingDilatedAttention``, the earlier package's name, is an alias. Dilation is
    expressed at block level by the pattern (``patterns.DilatedBlocks(rates)``, or any
    composition); there are no ``segment_lengths`` / ``dilation_rates`` arguments: for
    token-level LongNet branches use ``RingDilatedAttention``.

    Args:
        pattern: a :mod:`dilated_attention.patterns` pattern over the global blocks.
        block_size: tokens per block.
        group: process group (default: the world).
        scale: softmax scale (``None``: head_dim ** -0.5).
        backend: kernel name for the per-step calls, or ``None``.
    """

    def __init__(
        self,
        pattern: Pattern,
        *,
        block_size: int = 128,
        group: dist.ProcessGroup | None = None,
        scale: float | None = None,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        self.pattern = check_pattern(pattern)
        self.block_size = check_block_size(block_size)
        self.scale = V.check_scale(scale)
        backend = check_backend_name(backend)  # "auto" -> None
        self.group, self.backend = group, backend
        # Counts calls that reached the ring function's agreement (see ring.AgreedForward).
        self.ring_calls = 0

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        is_causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query (B, n, H, D), key/value (B, n, Hkv, D) local shards -> (B, n, H, D).

        ``key_padding_mask`` must be None (a mask on any rank raises on every rank).
        """
        self.ring_calls += 1
        try:
            V.check_no_key_padding_mask(key_padding_mask)
        except ValueError as exc:  # the peers wait in the ring call's agreement: join it
            reject_ring_call(exc, self.group)
        out = block_sparse_ring_attention(
            query, key, value, self.pattern, block_size=self.block_size, group=self.group,
            is_causal=is_causal, scale=self.scale, backend=self.backend,
        )  # fmt: skip
        assert isinstance(out, torch.Tensor)
        return out

    def extra_repr(self) -> str:
        return f"pattern={self.pattern!r}, block_size={self.block_size}, backend={self.backend!r}"


class BlockSparseRingMultiheadAttention(AgreedForward, BlockSparseMultiheadAttention):
    """:class:`~dilated_attention.BlockSparseMultiheadAttention` over a sharded sequence: same
    constructor (plus ``group``) and forward; each rank passes its (B, n, E) shard. Parameters
    are replicated: wrap the model in DDP/FSDP as usual for data parallelism.

    A call rejected on one rank, by the layer's own checks or by the ring call's agreement,
    raises on every rank (:class:`~dilated_attention.distributed.ring.AgreedForward`): the rank
    whose call was rejected its own error, the others ``ValueError`` naming that rank."""

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        pattern: Pattern,
        *,
        block_size: int = 128,
        group: dist.ProcessGroup | None = None,
        num_kv_heads: int | None = None,
        bias: bool = True,
        layer_norm: bool = True,
        layer_norm_eps: float = 1e-5,
        gamma_init: float = 1.0,
        scale: float | None = None,
        backend: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        attention = BlockSparseRingAttention(
            pattern, block_size=block_size, group=group, scale=scale, backend=backend
        )
        self._init_layer(
            embed_dim, num_heads, attention, num_kv_heads=num_kv_heads, bias=bias,
            layer_norm=layer_norm, layer_norm_eps=layer_norm_eps, gamma_init=gamma_init,
            device=device, dtype=dtype,
        )  # fmt: skip


def _build(cls: type[nn.Module]) -> Callable[..., nn.Module]:
    def build(**kwargs: object) -> nn.Module:
        return build_block_sparse_kind(cls, "block_sparse_ring", kwargs)

    build.__doc__ = f"Factory constructor of kind 'block_sparse_ring' ({cls.__name__})."
    return build


#: Read by the factory when kind="block_sparse_ring" is first requested (``factory._PROVIDERS``).
FACTORY_KINDS = {
    "block_sparse_ring": (
        _build(BlockSparseRingAttention),
        _build(BlockSparseRingMultiheadAttention),
    )
}


#: The earlier package's names (README, "Coming from another package"): aliases, not subclasses.
BlockSparseRingDilatedAttention = BlockSparseRingAttention
BlockSparseRingMultiheadDilatedAttention = BlockSparseRingMultiheadAttention
