"""MoBA's choice of key blocks on the GPU: the query means launched and the result allocated
first, then the other launches (and what only they use) in one closure, replayed from a CUDA
graph once the same call has run (Note [A choice's launches in one graph]).

Note [A choice's launches in one graph]
    On the GPU a choice is three or four launches: the bfloat16 parts of the query and key
    block means (``mean_parts``), then, query blocks a chunk at a time, either the affinities'
    product (``parts_product``) and the top-k kernel (``top_blocks``), or, from as many key
    blocks as ``affinity_tiles.MIN_COLUMNS`` gives for the row's slots (up to 32), on the
    kernel that makes the affinities a tile at a time (``affinity_tiles``;
    where its program asks more shared memory than the device has, its first launch raises
    before the kernel runs, and that choice and every later one with as many slots on the
    device at that head dim take the product).
    Each launch costs the host 20-40 us on the lent H100's, about what the GPU spends on the key
    means, the product or the top-k at 64K tokens. So the choice launches the query means (the
    longest kernel: the query is the largest operand) as soon as their parts are allocated, then
    allocates the result while the GPU runs them, and runs the other launches in one closure
    through ``backends.triton.run_launches``: once the same call (the same addresses) has run,
    that closure replays as one CUDA graph (Note [A call's launches from a CUDA graph] in
    ``core/execution/graphs.py``). The closure allocates what only its launches use (the key
    parts, the affinities of a chunk, the kernels' scratch): a replay skips those allocations
    (H200, side by side: a call's host time at 64K 0.153 -> 0.079 ms, back to back 0.136 ->
    0.069; at 16K a call 0.168 -> 0.098 ms) and its graph takes them from the graphs' shared
    pool (Note [Graphs share one memory pool per stream] there), beside FA4's backward workspace
    where a model trains on FA4. Everything in one graph would start the GPU only after all of
    the host's work: at 64K an eager call then took the host's 0.18-0.28 ms plus the GPU's 0.19.
    Every chunk's product and top-k reuse the same buffer and scratch, as the launches run in
    order on one stream. The product is a Triton kernel rather than cuBLAS's ``bmm``, whose
    graphs would each keep a cuBLAS workspace (Note [The parts' product in Triton]).

Shape legend: B batch, Nq query rows, Nk key positions, H query heads, Hkv key/value heads,
Hs the heads chosen for (H, or Hkv with ``per="kv_head"``), D head dim, Mq and Mk the query
and key blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..backends.triton import kernel_module, run_launches
from ..block_sparse.plan import num_blocks

__all__ = ["AFFINITY_BYTES", "ChoiceKernels", "choose_on_device", "device_modules",
           "on_tensor_cores"]  # fmt: skip

#: The float32 affinities (or the tiles kernel's scratch) a choice holds at once: query blocks
#: a chunk at a time.
AFFINITY_BYTES = 256 * 2**20


def on_tensor_cores(x: torch.Tensor) -> bool:
    """Whether the block means of ``x`` (rows or means) are float32 on the GPU, where the
    affinities are products of their bfloat16 parts (float64 stays a float64 product)."""
    return x.is_cuda and torch.promote_types(x.dtype, torch.float32) == torch.float32


class ChoiceKernels(NamedTuple):
    """The Triton choice's modules: the means' parts, the top-k kernel, the parts' product."""

    parts: Any
    top: Any
    product: Any


def device_modules(q: torch.Tensor, mk: int) -> ChoiceKernels | None:
    """The Triton choice's modules where they take the blocks of ``q``
    (:func:`on_tensor_cores`) and ``mk`` key blocks (rows the top-k kernel can hold), else
    None (the torch choice)."""
    if not on_tensor_cores(q):
        return None
    names = ("mean_parts", "top_blocks", "parts_product")
    kernels = ChoiceKernels(*(kernel_module(f"selection.{name}") for name in names))
    if any(module is None for module in kernels) or mk > kernels.top.MAX_COLUMNS:
        return None
    return kernels


def choose_on_device(
    kernels: ChoiceKernels,
    q: torch.Tensor,
    k: torch.Tensor,
    candidates: Any,
    topk: int,
    per: str,
    own_width: int | None,
    block_size: int,
) -> torch.Tensor:
    """MoBA's rule on the GPU (Note [A choice's launches in one graph]).

    Args:
        kernels: :func:`device_modules` of ``q``.
        q: (B, Nq, H, D) and k (B, Nk, Hkv, D): rows, or block means with ``block_size=1``.
        candidates: the rows' ``CandidateRanges`` (``sparse/selection.py``), or ``(candidates,
            own)`` bool masks broadcastable to (B, 1, Mq, Mk).
        topk: picks per row, at most Mk; ``per``: ``"head"`` or ``"kv_head"``.
        own_width: None for a bool mask, else block indices with own runs this wide.
        block_size: rows per block (the last may be shorter).

    Returns:
        (B, Hs, Mq, Mk) bool, or (B, Hs, Mq, topk + own_width) int32 block indices.
    """
    parts = kernels.parts
    heads, kv_heads = q.shape[2], k.shape[2]
    summed = heads // kv_heads if per == "kv_head" else 1
    left = parts.empty_parts(q, summed, block_size)  # (B, Hs, Mq, 3 D)
    parts.mean_parts(q, summed, 2, block_size, out=left)  # the GPU starts on the longest
    mq, mk = left.shape[2], num_blocks(k.shape[1], block_size)
    width, dtype = (mk, torch.bool) if own_width is None else (topk + own_width, torch.int32)
    chosen = torch.empty(*left.shape[:3], width, dtype=dtype, device=q.device)
    ranges = None if isinstance(candidates, tuple) else candidates
    masks = () if ranges is not None else candidates
    key = ("select_blocks", block_size, topk, per, own_width, ranges)
    tensors = (q, k, left, chosen, *masks)
    tiles = _tiles_module(ranges, mk, topk, q)
    if tiles is not None:
        try:
            step, chunks = _tile_chunks(tiles, left, ranges, topk, chosen, own_width)
            _run_chunks(parts, k, block_size, mq, step, chunks, (*key, step, True), tensors)
            return chosen
        except tiles.OutOfResources:  # the tiles kernel did not run, and refuses it from now
            pass
    step, chunks = _stored_chunks(kernels, left, mk, candidates, topk, chosen, own_width)
    _run_chunks(parts, k, block_size, mq, step, chunks, (*key, step, False), tensors)
    return chosen


Chunk = Callable[[int, slice], None]
#: A choice's chunks, given the key parts (B, Hkv, Mk, 3 D): their scratch allocated, the
#: launch of a chunk.
Chunks = Callable[[torch.Tensor], Chunk]


def _run_chunks(
    parts: Any,
    k: torch.Tensor,
    block_size: int,
    mq: int,
    step: int,
    chunks: Chunks,
    key: tuple[Any, ...],
    tensors: tuple[torch.Tensor, ...],
) -> None:
    """The key parts' launch and every chunk's, ``step`` query blocks of ``mq`` at a time, in
    one closure replayed from a CUDA graph once the same call (``key``, ``tensors``) has run."""

    def launches() -> None:
        right = parts.empty_parts(k, 1, block_size)  # (B, Hkv, Mk, 3 D)
        parts.mean_parts(k, 1, 1, block_size, out=right)
        chunk = chunks(right)
        for start in range(0, mq, step):
            chunk(start, slice(start, start + step))

    run_launches(key, tensors, launches)


def _tiles_module(ranges: Any, mk: int, topk: int, q: torch.Tensor) -> Any:
    """The choice from the means' parts a tile at a time (``affinity_tiles``, Note
    [Affinities a tile at a time] there) where it takes the call: candidates by position,
    ``Mk`` key blocks and ``topk`` picks it runs on the device and head dim of ``q`` (B, Nq,
    H, D); else None."""
    if ranges is None:
        return None
    module = kernel_module("selection.affinity_tiles")
    takes = module is not None and module.takes(mk, topk, q.device, q.shape[-1])
    return module if takes else None


def _tile_chunks(
    module: Any,
    left: torch.Tensor,
    ranges: Any,
    topk: int,
    chosen: torch.Tensor,
    own_width: int | None,
) -> tuple[int, Chunks]:
    """The tiles kernel's chunks of query blocks, ``(rows a chunk, the chunks)``: their scratch
    (the values of the groups each row holds, their parts' maxima and two lists) stays near
    :data:`AFFINITY_BYTES`. ``left`` (B, Hs, Mq, 3 D) are the query parts, ``chosen`` (B, Hs,
    Mq, width) the result."""
    batch, heads, mq = chosen.shape[:3]
    step = max(1, AFFINITY_BYTES // (4 * batch * heads * module.scratch_per_row(topk)))
    rows_of_heads = left.flatten(0, 1)

    def chunks(right: torch.Tensor) -> Chunk:
        scratch = module.empty_scratch(batch * heads * min(step, mq), topk, left.device)
        keys = right.flatten(0, 1)

        def chunk(start: int, rows: slice) -> None:
            module.top_blocks_from_parts(rows_of_heads[:, rows], keys,
                                         ranges.kernel_rows(start, module.RowRanges), topk,
                                         chosen[:, :, rows], own_width=own_width,
                                         scratch=scratch)  # fmt: skip

        return chunk

    return step, chunks


def _stored_chunks(
    kernels: ChoiceKernels,
    left: torch.Tensor,
    mk: int,
    candidates: Any,
    topk: int,
    chosen: torch.Tensor,
    own_width: int | None,
) -> tuple[int, Chunks]:
    """The stored product's chunks of query blocks, ``(rows a chunk, the chunks)``: a chunk's
    float32 affinities (B, Hs, rows, Mk) stay near :data:`AFFINITY_BYTES`; the product of the
    parts (Note [The parts' product in Triton] in ``triton_kernels/selection/parts_product.py``),
    then the top-k kernel (``top_blocks``). ``left`` (B, Hs, Mq, 3 D) are the query parts,
    ``mk`` key blocks, ``chosen`` (B, Hs, Mq, width) the result."""
    batch, heads, mq = chosen.shape[:3]
    step = max(1, AFFINITY_BYTES // max(1, 4 * heads * mk * batch))
    most = min(step, mq)
    top = kernels.top

    def chunks(right: torch.Tensor) -> Chunk:
        kv_heads = right.shape[1]
        affinity = torch.empty(batch * heads * most * mk, dtype=torch.float32,
                               device=left.device)  # fmt: skip
        maxima = torch.empty(top.scratch_shape(batch * heads * most, mk, topk),
                             dtype=torch.float32, device=left.device)  # fmt: skip
        grouped = left.view(batch * kv_heads, heads // kv_heads, mq, left.shape[-1])
        keys = right.flatten(0, 1)  # (B Hkv, Mk, 3 D)

        def chunk(start: int, rows: slice) -> None:
            count = len(range(mq)[rows])
            product = affinity[: batch * heads * count * mk].view(batch * kv_heads, -1, mk)
            kernels.product.parts_product(grouped[:, :, rows], keys, product)
            if isinstance(candidates, tuple):
                row_args = (_rows(candidates[0], rows), _rows(candidates[1], rows))
            else:
                row_args = (candidates.kernel_rows(start, top.RowRanges), None)
            top.top_blocks(product.view(batch, heads, count, mk), *row_args, topk,
                           out=chosen[:, :, rows], own_width=own_width,
                           scratch=maxima[: batch * heads * count])  # fmt: skip

        return chunk

    return step, chunks


def _rows(mask: torch.Tensor, rows: slice) -> torch.Tensor:
    """Query blocks ``rows`` of a mask broadcastable to (B, 1, Mq, Mk) (itself where it has
    one row for all)."""
    return mask if mask.shape[-2] == 1 else mask[..., rows, :]
