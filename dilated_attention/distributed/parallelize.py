"""Turn a model's attention layers into context-parallel ones, in place (torchtitan's
``parallelize`` style: the model is built as for one process, then parallelized from outside).

Note [Parallelizing a model]
    The library's local layers and their ring counterparts share constructors, state and
    forwards: a ring layer is the local one with a ``group`` and a sequence ``layout`` (Note
    [One ring template] in ``template.py``; ``RingModule``). So a local layer becomes a ring
    layer by taking the ring class and those two attributes, with its parameters and schedule
    state untouched (the way ``fully_shard`` re-classes a module), and a ring layer just takes
    the new group; a local window, soft-cap and learnable sinks go with the layer (the ring
    layer passes them on; each rank's sinks gradient is its shard's share). The library's
    multihead layer around an inner module that becomes a ring module (the factory's MoBA- and
    NSA-style layers) becomes a ``RingMultiheadAttention``: its checks agree across ranks and
    its rotary positions are the shard's. Selected-block layers run over a ring alone (their
    selection and pooled keys need every rank's key blocks, no head all-to-all). Layers that cannot
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
    MultiheadAttention,
    MultiheadDilatedAttention,
)
from .context import ContextParallel, check_group
from .layout.sharding import check_layout
from .modules import (
    RingDilatedAttention,
    RingModule,
    RingMultiheadAttention,
    RingMultiheadDilatedAttention,
)
from .rings.block_sparse_ring import BlockSparseRingAttention, BlockSparseRingMultiheadAttention
from .rings.moba_ring import BlockSelectedRingAttention, selection_group
from .rings.nsa_ring import CompressedSelectedWindowRingAttention, check_not_recomputed

__all__ = ["context_parallel"]

#: Local layer class -> its ring class (Note [Parallelizing a model]).
_RING_CLASSES: dict[type, type] = {
    DilatedAttention: RingDilatedAttention,
    MultiheadDilatedAttention: RingMultiheadDilatedAttention,
    BlockSparseAttention: BlockSparseRingAttention,
    BlockSparseMultiheadAttention: BlockSparseRingMultiheadAttention,
    BlockSelectedAttention: BlockSelectedRingAttention,
    CompressedSelectedWindowAttention: CompressedSelectedWindowRingAttention,
}

#: The selected-block layers (MoBA- and NSA-style): local, and their ring layers.
_SELECTED_LOCAL = (BlockSelectedAttention, CompressedSelectedWindowAttention)
_SELECTED = (BlockSelectedRingAttention, CompressedSelectedWindowRingAttention)


def context_parallel(
    model: nn.Module,
    group: ContextParallel | dist.ProcessGroup | None,
    *,
    layout: str = "contiguous",
) -> nn.Module:
    """Make every attention layer of ``model`` run over ``group`` (Note [Parallelizing a
    model]): local dilated, block-sparse and selected-block (MoBA- and NSA-style) layers become
    their ring layers, the library's multihead layer around one of them a
    :class:`~.modules.RingMultiheadAttention`, ring layers take ``group``; other modules are
    left as they are. Returns ``model``.

    Args:
        model: any module; ``LongNetLM`` and models built from the library's layers included.
        group: a :class:`ContextParallel` (a ring and/or a head all-to-all, e.g. from a
            ``DeviceMesh``), a process group, or None (the world). Selected-block layers run
            over a ring only: a ``ContextParallel`` with a head all-to-all is refused for them.
        layout: the sequence layout the shards are made with (``"zigzag"``: causal models;
            block-sparse and selected-block layers take contiguous shards only).

    Raises:
        ValueError: a layer with dropout (the ring functions have none), a local
            (sliding-window) layer, which has no ring layer yet, a block-sparse or
            selected-block layer with ``layout="zigzag"``, a selected-block layer under a
            head all-to-all, or a bad ``layout``; nothing is changed then.
        TypeError: ``group`` is not a group.
    """
    check_group(group)
    layout = check_layout(layout)
    changes = []
    for name, module in model.named_modules():
        ring_class = _ring_class(name or "model", module, layout, group)
        if ring_class is not None or isinstance(module, RingModule):
            changes.append((module, ring_class))
    for module, ring_class in changes:
        if ring_class is not None:
            module.__class__ = ring_class
        if isinstance(module, RingModule):
            module.layout = layout
            selected = isinstance(module, _SELECTED)
            ring = selection_group(group, type(module).__name__) if selected else group
            module._init_ring(ring)  # type: ignore[arg-type]
    return model


def _ring_class(
    name: str, module: nn.Module, layout: str, group: ContextParallel | dist.ProcessGroup | None
) -> type | None:
    """The ring class ``module`` becomes (None: it stays as it is; a ring layer only takes the
    group), checked.

    Raises:
        ValueError: as :func:`context_parallel` says.
    """
    if isinstance(module, LocalAttention):
        raise ValueError(
            f"{name} is a local (sliding-window) layer, which has no ring layer yet: run the "
            f"model in one process, or use the ring functions' window "
            f"(RingAttention(window_size=...), ring_attention(..., window_size=...)); nothing "
            f"was changed"
        )
    if type(module) is MultiheadAttention:  # the library's layer around an inner module
        inner = module.attention
        ring = isinstance(inner, RingModule) or type(inner) in _RING_CLASSES
        return RingMultiheadAttention if ring else None
    ring_class = _RING_CLASSES.get(type(module))
    if ring_class is None and not isinstance(module, RingModule):
        return None
    dropout = getattr(module, "dropout", 0.0)
    if isinstance(dropout, float) and dropout > 0:
        raise ValueError(
            f"{name} ({type(module).__name__}) has dropout={dropout}: context parallel layers "
            f"have no dropout; build the model with dropout=0"
        )
    sparse = isinstance(module, BlockSparseAttention | BlockSparseMultiheadAttention)
    selected = isinstance(module, _SELECTED_LOCAL)
    if (sparse or selected) and layout != "contiguous":
        what = "block-sparse" if sparse else "a selected-block (MoBA- or NSA-style) layer"
        raise ValueError(
            f"{name} ({type(module).__name__}) is {what}, which runs over contiguous shards "
            f"only; pass layout='contiguous'"
        )
    if selected:  # their ring layers too, before any change
        what = f"{name} ({type(module).__name__})"
        check_not_recomputed(getattr(module.config, "recompute", False), what)
        selection_group(group, what)
    return ring_class
