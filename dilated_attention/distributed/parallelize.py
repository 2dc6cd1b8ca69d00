"""Turn a model's attention layers into context-parallel ones, in place (torchtitan's
``parallelize`` style: the model is built as for one process, then parallelized from outside).

Note [Parallelizing a model]
    The library's local layers and their ring counterparts share constructors, state and
    forwards: a ring layer is the local one with a ``group`` and a sequence ``layout`` (Note
    [One ring template] in ``template.py``; ``RingModule``). So a local layer becomes a ring
    layer by taking the ring class and those two attributes, with its parameters and schedule
    state untouched (the way ``fully_shard`` re-classes a module), and a ring layer just takes
    the new group; a local window, soft-cap and learnable sinks go with the layer (the ring
    layer passes them on; each rank's sinks gradient is its shard's share). Layers that cannot
    run over ranks raise before anything changes: dropout (the ring functions have none) and
    decoding caches. After it, each rank passes its shard (``shard_sequence(x, group=group)``);
    rotary positions follow the group (``sequence_positions``), and ``LongNetLM`` finds them
    itself.

Shape legend: B batch, n a rank's positions, E embed_dim.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from ..modules import (
    BlockSelectedAttention,
    BlockSparseAttention,
    BlockSparseMultiheadAttention,
    CompressedSelectedWindowAttention,
    DilatedAttention,
    LocalAttention,
    MultiheadDilatedAttention,
)
from .block_sparse_ring import BlockSparseRingAttention, BlockSparseRingMultiheadAttention
from .context import ContextParallel, check_group
from .modules import RingDilatedAttention, RingModule, RingMultiheadDilatedAttention
from .sharding import check_layout

__all__ = ["context_parallel"]

#: Local layer class -> its ring class (Note [Parallelizing a model]).
_RING_CLASSES: dict[type, type] = {
    DilatedAttention: RingDilatedAttention,
    MultiheadDilatedAttention: RingMultiheadDilatedAttention,
    BlockSparseAttention: BlockSparseRingAttention,
    BlockSparseMultiheadAttention: BlockSparseRingMultiheadAttention,
}


def context_parallel(
    model: nn.Module,
    group: ContextParallel | dist.ProcessGroup | None,
    *,
    layout: str = "contiguous",
) -> nn.Module:
    """Make every attention layer of ``model`` run over ``group`` (Note [Parallelizing a
    model]): local dilated and block-sparse layers become their ring layers, ring layers take
    ``group``; other modules are left as they are. Returns ``model``.

    Args:
        model: any module; ``LongNetLM`` and models built from the library's layers included.
        group: a :class:`ContextParallel` (a ring and/or a head all-to-all, e.g. from a
            ``DeviceMesh``), a process group, or None (the world).
        layout: the sequence layout the shards are made with (``"zigzag"``: causal models).

    Raises:
        ValueError: a layer with dropout (the ring functions have none), a local
            (sliding-window) or selected-block (MoBA- or NSA-style) layer, which has no ring
            layer yet, or a bad ``layout``; nothing is changed then.
        TypeError: ``group`` is not a group.
    """
    check_group(group)
    layout = check_layout(layout)
    changes = []
    for name, module in model.named_modules():
        if isinstance(module, LocalAttention):
            raise ValueError(
                f"{name or 'model'} is a local (sliding-window) layer, which has no ring layer "
                f"yet: run the model in one process, or use the ring functions' window "
                f"(RingAttention(window_size=...), ring_attention(..., window_size=...)); "
                f"nothing was changed"
            )
        if isinstance(module, BlockSelectedAttention | CompressedSelectedWindowAttention):
            raise ValueError(
                f"{name or 'model'} ({type(module).__name__}) selects blocks from the content, "
                f"which has no ring layer yet (each rank would select within its shard alone): "
                f"run the model in one process; nothing was changed"
            )
        ring_class = _RING_CLASSES.get(type(module))
        if ring_class is None and not isinstance(module, RingModule):
            continue
        dropout = getattr(module, "dropout", 0.0)
        if isinstance(dropout, float) and dropout > 0:
            raise ValueError(
                f"{name or 'model'} ({type(module).__name__}) has dropout={dropout}: context "
                f"parallel layers have no dropout; build the model with dropout=0"
            )
        sparse = isinstance(module, BlockSparseAttention | BlockSparseMultiheadAttention)
        if sparse and layout != "contiguous":
            raise ValueError(
                f"{name or 'model'} ({type(module).__name__}) is block-sparse, which runs over "
                f"contiguous shards only; pass layout='contiguous'"
            )
        changes.append((module, ring_class))
    for module, ring_class in changes:
        if ring_class is not None:
            module.__class__ = ring_class
        if isinstance(module, RingModule):
            module.layout = layout
            module._init_ring(group)  # type: ignore[arg-type]
    return model
