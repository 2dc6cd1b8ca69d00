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
    of the positions it received go back to their owner while the next step computes, where
    they add into the owner's float32 accumulators. The loop is the one ring template's (Note
    [One ring template] in ``template.py``); what travels is :class:`SparseSteps`.

    Unlike the dense ring (``ring.py``), blocks are not forwarded around the ring: each step is a
    direct exchange between ranks ``s`` apart, which is what lets steps be skipped.

Shape legend: B batch, n local tokens, H query heads, Hkv key/value heads, D head dim, W ranks,
m positions exchanged by a pair of ranks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ... import _validation as V
from ...backends.registry import check_backend_name
from ...block_sparse import plan as block_plan
from ...block_sparse.plan import (
    SparseCall,
    call_positions,
    causal_block_mask,
    check_block_size,
    num_blocks,
    plan_calls,
)
from ...compiled import eager_only
from ...core.autograd import Runner, run_attention
from ...core.geometry.schedule_state import block_sparse_schedule, describe_schedule
from ...core.higher_order import ring_message
from ...functional import block_sparse_attention
from ...modules import (
    BlockSparseAttention,
    BlockSparseMultiheadAttention,
    build_block_sparse_kind,
)
from ...patterns import Pattern, check_pattern
from ..comm import collectives as _comm
from ..comm.agreement import (
    AgreedForward,
    PreparedRing,
    RingArgs,
    RingOperation,
    prepare_ring,
    refuse_documents,
    reject_ring_call,
)
from ..comm.exchange import ExchangeStep, SparseSteps, exchange_steps
from ..context import ContextParallel
from ..modules import RingModule
from .masked_ring import MaskedSteps, check_ring_mask, local_rows
from .packed_ring import packed_runner
from .template import RingRunner, StepKernel
from .ulysses import heads_sinks, score_options, split_call

__all__ = [
    "BlockSparseRingAttention",
    "BlockSparseRingDilatedAttention",
    "BlockSparseRingMultiheadAttention",
    "BlockSparseRingMultiheadDilatedAttention",
    "block_sparse_ring_attention",
]


def _needs(
    mask: torch.Tensor,
    block_size: int,
    n: int,
    world_size: int,
    dst: int,
    src: int,
    *,
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
) -> tuple[ExchangeStep, ...]:
    """This rank's steps of Note [Block-sparse exchange] (pure: the same on every call)."""
    blocks = num_blocks(n * world_size, block_size)
    mask = causal_block_mask(pattern.block_mask(blocks, blocks), is_causal)
    needs = functools.partial(_needs, mask, block_size, n, world_size, is_causal=is_causal,
                              budget=budget)  # fmt: skip
    return exchange_steps(needs, n, world_size, rank, device)


@eager_only("block_sparse_ring_attention")  # torch.compile runs it eagerly
def block_sparse_ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    pattern: Pattern | torch.Tensor,
    *,
    block_size: int = 128,
    group: dist.ProcessGroup | ContextParallel | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    backend: str | None = None,
    return_lse: bool = False,
    cu_seqlens: torch.Tensor | list[int] | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention over a sequence sharded across ``group``; this rank's shard.

    Equals this rank's shard of ``block_sparse_attention(gathered q, k, v, pattern, ...)``, with
    blocks counted over the whole sequence (Note [Block-sparse exchange]).

    Args:
        query: (B, n, H, D) this rank's contiguous shard (``shard_sequence(x)``, N = W * n).
        key: (B, n, Hkv, D).
        value: (B, n, Hkv, D).
        pattern: a :mod:`dilated_attention.patterns` pattern over the global blocks
            ``ceil(N / block_size)``; or a run-time block mask as ``block_sparse_attention``
            takes, over the ``M = N / block_size`` key blocks, its rows all ``M`` query blocks
            or this rank's (``shard_sequence(mask, seq_dim=2)``): shards must be whole blocks,
            no ``cu_seqlens`` or ContextParallel (Note [Run-time masks over the ring]).
        block_size: tokens per block; with a pattern, blocks may straddle shards and the last
            may be shorter.
        group: the process group (default: the world).
        is_causal: causal over global positions.
        scale: softmax scale; ``None`` means ``D ** -0.5``.
        backend: kernel name for the per-step calls, or ``None`` for the registry's choice.
        return_lse: also return the log-sum-exp (B, H, n).
        cu_seqlens: packed documents of the whole row (B = 1), as in ``ring_attention``: each
            document's blocks count from its own first token (Note [Packed documents across
            ranks] in ``packed_ring.py``).
        softcap, sinks: as in ``ring_attention``.

    Returns:
        ``out`` (B, n, H, D), or ``(out, lse)``. A batch of 0 (or 0 heads) gives empty tensors,
        as in one process.

    Raises:
        TypeError / ValueError: on every rank, before any other communication, when inputs are
            malformed or differ between ranks (shapes, options, grad mode, pattern, block_size;
            as in ``ring_attention``).
    """
    if isinstance(group, ContextParallel):
        refuse_documents(cu_seqlens, group)
        if isinstance(pattern, torch.Tensor):
            reject_ring_call(ValueError(
                "block_sparse_ring_attention with a run-time block mask takes a process group, "
                "not a ContextParallel: pass group=cp.ring (no head all-to-all), or a pattern"
            ), group)  # fmt: skip
        out, lse = _over_context(group, query, key, value, pattern, block_size, is_causal,
                                 scale, backend, softcap, sinks)  # fmt: skip
        return (out, lse) if return_lse else out
    args = RingArgs(query, key, value, group=group, is_causal=is_causal, scale=scale,
                    backend=backend, cu_seqlens=cu_seqlens, softcap=softcap,
                    sinks=sinks)  # fmt: skip
    masked = isinstance(pattern, torch.Tensor)
    check = functools.partial(_check_schedule, query, pattern, block_size, return_lse, group)
    if masked:
        check = functools.partial(_check_masked, query, key, pattern, block_size, return_lse,
                                  group, cu_seqlens)  # fmt: skip
    operation = RingOperation(check_schedule=check, schedule_name="schedule (pattern, block_size)",
                              key_masks=masked)  # fmt: skip
    ring = prepare_ring(args, operation)
    q, k, v = ring.q, ring.k, ring.v
    if ring.empty:  # batch 0 or 0 heads, agreed on every rank: as in one process
        out, lse = ring.empty_result()
        return (out, lse) if return_lse else out
    out, lse = run_attention(q, k, v, None, _runner(ring, pattern, int(block_size)), ring.sinks)
    return (out, lse) if return_lse else out


_FIRST_ORDER = ring_message("block_sparse_ring_attention", "block_sparse_attention()")


def _runner(ring: PreparedRing, pattern: Pattern | torch.Tensor, block_size: int) -> Runner:
    """What runs an agreed call: a run-time mask's masked ring (Note [Run-time masks over
    the ring]), packed documents' exchange, or a pattern's (Note [Block-sparse exchange])."""
    q, setup = ring.q, ring.setup
    kernel = StepKernel(ring.kernel.backend, setup.scale, softcap=ring.softcap)
    if isinstance(pattern, torch.Tensor):
        kept = local_rows(pattern, q, setup, block_size)
        return RingRunner(MaskedSteps(setup, kept, block_size), kernel, _FIRST_ORDER)
    if ring.documents is not None:
        return packed_runner(ring, pattern=pattern, block_size=block_size)
    n = q.shape[1]
    steps = _schedule(
        pattern, block_size, n, setup.world_size, setup.rank, setup.is_causal, q.device,
        max(n, block_plan.MIN_KV_ROWS_PER_CALL),
    )  # fmt: skip
    return RingRunner(SparseSteps(steps, setup), kernel, _FIRST_ORDER)


def _over_context(
    cp: ContextParallel,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    pattern: Pattern,
    block_size: int,
    is_causal: bool,
    scale: float | None,
    backend: str | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`block_sparse_ring_attention` under a :class:`ContextParallel` (Note [Calls under
    a head all-to-all] in ``ulysses.py``, each rank with the sinks of its heads): ``(out,
    lse)``."""
    options = dict(block_size=block_size, is_causal=is_causal, scale=scale, backend=backend,
                   return_lse=True, softcap=softcap)  # fmt: skip

    def local(q, k, v, mask, first):  # type: ignore[no-untyped-def]
        return block_sparse_attention(q, k, v, pattern, sinks=heads_sinks(sinks, first, q),
                                      **options)  # fmt: skip

    def ring(group, q, k, v, mask, first):  # type: ignore[no-untyped-def]
        own = heads_sinks(sinks, first, q)
        return block_sparse_ring_attention(q, k, v, pattern, group=group, sinks=own, **options)

    def agreed() -> object:
        described = _check_schedule(None, pattern, block_size, True, None)
        ring_size, heads = cp.sizes()
        blocks = num_blocks(query.shape[1] * heads * ring_size, check_block_size(block_size))
        check_pattern(pattern).block_mask(blocks, blocks)  # a Custom mask of the wrong size
        return (described, is_causal, V.check_scale(scale), check_backend_name(backend),
                *score_options(None, softcap, sinks, query))  # fmt: skip

    return split_call(cp, "contiguous", query, key, value, None, local=local, ring=ring,
                      what="block_sparse_ring_attention", options=agreed)  # fmt: skip


def _check_schedule(
    query: object, pattern: object, block_size: object, return_lse: object,
    group: dist.ProcessGroup | None,
) -> str:  # fmt: skip
    """The pattern and block size checked (and ``return_lse``), as readable exact text.

    Runs inside prepare_ring's summary exchange: a rejected argument on one rank becomes an
    error on every rank instead of a hang."""
    checked = check_pattern(pattern)
    size = check_block_size(block_size)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {return_lse!r}")
    if isinstance(query, torch.Tensor) and query.dim() == 4:
        blocks = num_blocks(query.shape[1] * _comm.group_rank_and_size(group)[1], size)
        checked.block_mask(blocks, blocks)  # a Custom mask of the wrong size fails here
    return describe_schedule(block_sparse_schedule(checked, size))


def _check_masked(
    query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor, block_size: object,
    return_lse: object, group: dist.ProcessGroup | None, cu_seqlens: object,
) -> str:  # fmt: skip
    """:func:`_check_schedule` for a run-time block mask (:func:`~.masked_ring.check_ring_mask`;
    query and key already checked): the ranks compare its layout and the block size."""
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {return_lse!r}")
    layout = check_ring_mask(query, key, mask, block_size, group, cu_seqlens)
    return f"{layout.describe()}, block_size={block_size}"


def _without_mask(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    **options: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`block_sparse_ring_attention` as :class:`BlockSparseRingAttention` calls it:
    ``key_padding_mask`` must be None, and a mask on any rank raises on every rank (the peers
    wait in the ring call's agreement: this rank joins it with its error)."""
    try:
        V.check_no_key_padding_mask(key_padding_mask)
    except ValueError as exc:
        reject_ring_call(exc, group)
    return block_sparse_ring_attention(query, key, value, group=group, **options)


class BlockSparseRingAttention(RingModule, BlockSparseAttention):
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
        softcap, sinks: as in ``BlockSparseAttention`` (soft-capped scores, learnable sinks for
            this many query heads).

    Its forward takes (B, n, ...) local shards, as :class:`~.modules.RingModule`'s;
    ``key_padding_mask`` must be None (a mask on any rank raises on every rank).
    """

    ring_function = staticmethod(_without_mask)

    def __init__(
        self,
        pattern: Pattern,
        *,
        block_size: int = 128,
        group: dist.ProcessGroup | None = None,
        scale: float | None = None,
        backend: str | None = None,
        softcap: float | None = None,
        sinks: int | None = None,
    ) -> None:
        super().__init__(pattern, block_size=block_size, scale=scale, backend=backend,
                         softcap=softcap, sinks=sinks)  # fmt: skip
        self._init_ring(group)

    def ring_options(self) -> dict[str, object]:
        return {
            "pattern": self.pattern, "block_size": self.block_size, "group": self.group,
            "scale": self.scale, "backend": self.backend,
        }  # fmt: skip


class BlockSparseRingMultiheadAttention(AgreedForward, BlockSparseMultiheadAttention):
    """:class:`~dilated_attention.BlockSparseMultiheadAttention` over a sharded sequence: same
    constructor (plus ``group``) and forward; each rank passes its (B, n, E) shard. Parameters
    are replicated: wrap the model in DDP/FSDP as usual for data parallelism; ``softcap`` and
    ``sinks`` as in the local layer (``attention.sinks``).

    A call rejected on one rank, by the layer's own checks or by the ring call's agreement,
    raises on every rank (:class:`~dilated_attention.distributed.comm.agreement.AgreedForward`): the
    rank whose call was rejected its own error, the others ``ValueError`` naming that rank."""

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
        softcap: float | None = None,
        sinks: bool = False,
    ) -> None:
        attention = BlockSparseRingAttention(
            pattern, block_size=block_size, group=group, scale=scale, backend=backend,
            softcap=softcap, sinks=num_heads if V.check_bool("sinks", sinks) else None,
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


#: The earlier package's names (docs/migration.md): aliases, not subclasses.
BlockSparseRingDilatedAttention = BlockSparseRingAttention
BlockSparseRingMultiheadDilatedAttention = BlockSparseRingMultiheadAttention
