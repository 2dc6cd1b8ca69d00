"""Block-sparse attention through FlashAttention-4's block sparsity (Note [FlashAttention-4
block sparsity] in ``backends/flash_attn4/__init__.py``): the tile lists of a pattern (on the
host, once) or of a run-time mask (per batch row and query head, on the device, per call), and
their runner.

Rows whose block row keeps no key block are left out of every tile list; the runner gives them
``out = 0`` and ``lse = -inf``, and zero gradients to them and to keys no query reads, whatever
the kernel leaves there.

Note [A run-time mask's forward in one graph]
    FA4's entry point spends ~0.3 ms of Python per call on the host, and a run-time mask's
    lists take a launch of their own before it: at 64K tokens the forward's kernel started
    ~0.85 ms after the call did (H100), a third of the call. So the forward allocates
    everything first (out, lse, the lists, the empty rows and unread keys) and then runs one
    closure that only launches into them: the lists' kernel (:class:`ListLaunches`), FA4's
    kernel, and the fills of the empty rows. That closure goes through
    ``backends.triton.run_launches``, which replays it from a CUDA graph once the same call
    (the same addresses) has run before (Note [A call's launches from a CUDA graph] in
    ``core/execution/graphs.py``): the host then only checks, allocates and replays. A backward
    that runs without this forward (``saved_without_forward``) runs the lists' launch itself.

Note [A block-sparse backward in one graph]
    The backward likewise allocates dq, dk and dv first and runs one closure into them: the
    lists' launch where its forward did not run it, the backward lists of each chunk of heads
    and FA4's backward call for it, and the zero fills of rows and keys no block reaches. The
    closure replays from a CUDA graph once the same call repeats at the same addresses; the
    key holds every tensor it reads (the run-time mask, or a pattern's backward lists, and the
    unreached rows and keys). What the closure allocates besides (FA4's float32 accumulators,
    a chunk's lists, the sums of later parts of a group) dies inside it, in the graphs' shared
    pool (Note [Graphs share one memory pool per stream] in ``core/execution/graphs.py``),
    which keeps one chunk's worth reserved. The chunks follow the eager rule (Note
    [FlashAttention-4's accumulators by head chunks] in ``backends/flash_attn4/chunks.py``):
    replayed, a chunk costs no Python of FA4's, but chunking below the eager floor still costs
    GPU time (H200, MoBA at 16K / 32K, 16 / 4 heads: single query heads took its training peak
    from 1.61x to 1.05x but its forward+backward from 2.2 to 5.4 ms and 4.2 to 7.1 ms; members
    of groups to 1.21x / 1.11x at 2.3 -> 2.8 and 4.3 -> 5.5 ms).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..backends.flash_attn4 import FlashAttn4Backend, SparseTiles, tiles_of_heads
from ..backends.flash_attn4.chunks import ListBytes, no_lists
from ..backends.triton import kernel_module, run_launches
from ..core.autograd import Backward, Forward, Grads, Inputs, Saved
from ..core.contract import KernelOutput
from ..patterns import Pattern
from .lists import kept_mask, planned_narrow_lists, runtime_tile_lists, tiles_aligned
from .plan import causal_block_mask, num_blocks, recomputed_grads
from .runtime import FIRST_ORDER_MESSAGE, BlockIndices, per_query_head, token_rows
from .tiles import KERNEL_TILE, kernel_tiles, tile_lists


class ListLaunches:
    """The launches that fill a run-time mask's list buffers in place (allocating nothing):
    run inside the forward's launches, or inside the backward's where that forward did not run
    (Note [A run-time mask's forward in one graph]).

    Attributes:
        tensors: what the launches read and write (for the graph keys).
        done: whether they have run for this call.
    """

    def __init__(self, launches: Callable[[], None], tensors: tuple[torch.Tensor | None, ...]):
        self.launches = launches
        self.tensors = tensors
        self.done = False


@dataclass(frozen=True)
class FlashAttn4Tiles:
    """The tiles of a pattern, or of a run-time mask, at one shape, for FA4.

    Attributes:
        forward: per query tile, its key tiles; backward: per key tile, its query tiles, or
            None where ``make_backward`` makes them when the backward runs (a run-time mask:
            a forward without gradients never holds them).
        mask: a pattern's (ceil(Nq / block_size), ceil(Nk / block_size)) bool on the CPU,
            causal applied; None for a run-time mask (no differentiable recompute).
        empty_rows: (1 or B, 1, Hkv or H, Mq) bool on the device, the query blocks that see
            no key (a key/value head's flag serves its group), or None if none.
        unread_keys: (1 or B, 1 or Hkv, Mk) bool on the device, the key blocks no query reads,
            or None if none.
        pending: where the lists, ``empty_rows`` and ``unread_keys`` are buffers still to be
            filled, the launches that fill them; else None.
        made_bytes: the bytes of the backward lists made for a chunk of so many query and
            key/value heads (``make_backward``'s; they count against a backward call's share of
            memory): none where the lists are held whole.
        reads: the tensors ``make_backward`` reads (a run-time mask's kept blocks): with
            ``backward``, ``empty_rows`` and ``unread_keys``, what the backward reads beside its
            inputs (Note [A block-sparse backward in one graph]).
    """

    forward: SparseTiles
    backward: SparseTiles | None
    mask: torch.Tensor | None
    empty_rows: torch.Tensor | None
    unread_keys: torch.Tensor | None
    make_backward: Callable[[slice, slice], SparseTiles] | None = None
    pending: ListLaunches | None = None
    made_bytes: ListBytes = no_lists
    reads: tuple[torch.Tensor | None, ...] = ()

    def backward_lists(self, heads: slice, kv_heads: slice) -> SparseTiles:
        """The backward's tile lists of query heads ``heads`` (of key/value heads ``kv_heads``),
        made now where they were left for the backward (then one chunk of heads at a time:
        Note [FlashAttention-4's accumulators by head chunks] in
        ``backends/flash_attn4/chunks.py``)."""
        if self.backward is not None:
            return tiles_of_heads(self.backward, heads)
        assert self.make_backward is not None  # one of the two is always set
        return self.make_backward(heads, kv_heads)


def _lists(tiles: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> SparseTiles:
    full, partial = tiles
    lists = (*tile_lists(partial, compact=True), *tile_lists(full, compact=True))
    return SparseTiles(*(t.to(device) for t in lists))


def _unreached(kept: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """(1, 1, M) bool on ``device``: the blocks ``kept`` (M,) marks False, or None when every
    block is kept."""
    if bool(kept.all()):
        return None
    return (~kept).to(device).view(1, 1, -1)


def fill_blocks(x: torch.Tensor, flags: torch.Tensor | None, block_size: int, value: float) -> None:
    """Set, in place, the rows of ``x`` (B, N, H, D) in the blocks ``flags`` (1 or B, 1 or a
    divisor of H, ceil(N / block_size)) marks to ``value``: one Triton launch on the GPU
    writing the flagged blocks only (Note [Filling flagged blocks]), a masked fill
    elsewhere."""
    if flags is None:
        return
    module = kernel_module("fill") if x.is_cuda else None
    if module is not None:
        module.fill_blocks(x, flags, block_size, value)
        return
    rows = token_rows(per_query_head(flags, x.shape[2]), block_size, x.shape[1])
    x.masked_fill_(rows.transpose(1, 2).unsqueeze(-1), value)


@torch.compiler.disable
@functools.lru_cache(maxsize=32)
def fa4_tiles(
    pattern: Pattern,
    block_size: int,
    query_len: int,
    key_len: int,
    is_causal: bool,
    device: torch.device,
) -> FlashAttn4Tiles:
    """The pattern's FA4 tile lists at this shape, built once (a few ms on the CPU at 64K)."""
    nq, nk = num_blocks(query_len, block_size), num_blocks(key_len, block_size)
    mask = causal_block_mask(pattern.block_mask(nq, nk), is_causal)
    full, partial = kernel_tiles(
        mask, block_size=block_size, query_len=query_len, key_len=key_len, is_causal=is_causal
    )
    return FlashAttn4Tiles(
        forward=_lists((full, partial), device),
        backward=_lists((full.T, partial.T), device),
        mask=mask,
        empty_rows=_unreached(mask.any(1), device),
        unread_keys=_unreached(mask.any(0), device),
    )


def runtime_fa4_tiles(
    kept: torch.Tensor | BlockIndices,
    block_size: int,
    query_len: int,
    key_len: int,
    is_causal: bool,
    num_kv_heads: int,
    num_heads: int,
) -> FlashAttn4Tiles:
    """The FA4 tile lists of a run-time mask's kept blocks, causal applied (Note [Run-time block
    masks] in ``runtime.py``), made on their device: per batch row and query head (FA4 takes 1
    or H heads; :func:`~.lists.runtime_tile_lists`). From a bool (Bm, Hm, Mq, Mk) every list
    is as wide as its tile count; from block indices (where :func:`~.lists.tiles_aligned`) the
    forward's are ``K`` blocks wide (Note [Narrow lists of block indices])."""
    fill = None
    if isinstance(kept, BlockIndices):
        (forward, empty, read), fill = planned_narrow_lists(kept, num_heads)
    else:
        forward = runtime_tile_lists(kept, block_size=block_size, query_len=query_len,
                                     key_len=key_len, is_causal=is_causal, num_heads=num_heads)
        empty, read = ~kept.any(-1), kept.any(-2)
    pending = None
    if fill is None:
        unread = ~_by_kv_head(read, num_kv_heads, num_heads)
    else:
        assert isinstance(kept, BlockIndices)  # only block indices' lists are left to fill
        read_by = (kept.indices, kept.documents, *forward, empty)
        pending, unread = _list_launches(fill, read_by, read, num_kv_heads, num_heads)

    def backward(heads: slice, kv_heads: slice) -> SparseTiles:
        chunk = _of_heads(kept, heads, kv_heads, num_heads)
        mask = kept_mask(chunk) if isinstance(chunk, BlockIndices) else chunk
        return SparseTiles(*runtime_tile_lists(
            mask, block_size=block_size, query_len=query_len, key_len=key_len,
            is_causal=is_causal, num_heads=len(range(num_heads)[heads]), backward=True,
        ))  # fmt: skip

    rows = kept.indices if isinstance(kept, BlockIndices) else kept
    key_tiles, query_tiles = num_blocks(key_len, KERNEL_TILE), num_blocks(query_len, KERNEL_TILE)
    aligned = tiles_aligned(block_size, query_len, key_len, is_causal)
    per_key_tile = query_tiles + 3 if aligned else 2 * query_tiles + 2  # int32 counts, indices

    def made_bytes(heads: int, kv_heads: int) -> int:  # (Bm, 1 or heads, Tk, per_key_tile) int32
        read = _mask_rows(rows.shape[1], slice(0, heads), slice(0, kv_heads), num_heads)
        one = read.stop - read.start == 1
        return 4 * rows.shape[0] * (1 if one else heads) * key_tiles * per_key_tile

    reads = (kept.indices, kept.documents) if isinstance(kept, BlockIndices) else (kept,)
    return FlashAttn4Tiles(
        SparseTiles(*forward), None, None, empty, unread, backward, pending, made_bytes, reads
    )


def _of_heads(
    kept: torch.Tensor | BlockIndices, heads: slice, kv_heads: slice, num_heads: int
) -> torch.Tensor | BlockIndices:
    """The rows of a run-time mask's kept blocks (Bm, Hm, Mq, Mk or K) that query heads
    ``heads`` of key/value heads ``kv_heads`` read: whole where Hm is 1, else the rows of the
    query heads (Hm = H) or of their key/value heads (Hm = Hkv), contiguous."""
    rows = kept.indices if isinstance(kept, BlockIndices) else kept
    if rows.shape[1] > 1:  # a copy only with several batch rows, as the lists' kernels read
        rows = rows[:, _mask_rows(rows.shape[1], heads, kv_heads, num_heads)].contiguous()
    return replace(kept, indices=rows) if isinstance(kept, BlockIndices) else rows


def _mask_rows(mask_heads: int, heads: slice, kv_heads: slice, num_heads: int) -> slice:
    """The heads of a mask of ``mask_heads`` heads that query heads ``heads`` of key/value heads
    ``kv_heads`` read: its one head, else those query heads' (``mask_heads`` = H) or their
    key/value heads' (``mask_heads`` = Hkv)."""
    if mask_heads == 1:
        return slice(0, 1)
    return heads if mask_heads == num_heads else kv_heads


def _by_kv_head(read: torch.Tensor, num_kv_heads: int, num_heads: int) -> torch.Tensor:
    """(B, Hm, Mk) key blocks read per mask head -> per key/value head where Hm is H: a key is
    read by its group's heads."""
    if read.shape[1] == num_heads != num_kv_heads:
        return read.view(read.shape[0], num_kv_heads, -1, read.shape[-1]).any(2)
    return read


def _list_launches(
    fill: Callable[[], None],
    lists: tuple[torch.Tensor | None, ...],
    read: torch.Tensor,
    num_kv_heads: int,
    num_heads: int,
) -> tuple[ListLaunches, torch.Tensor]:
    """The launches of the lists' ``fill`` (which reads and writes ``lists`` and ``read``), then
    of the unread key blocks from ``read``, and the unread blocks' buffer (1 or B, 1 or Hkv, Mk)
    bool they write; nothing runs yet."""
    grouped = read.shape[1] == num_heads != num_kv_heads
    shape = (read.shape[0], num_kv_heads if grouped else read.shape[1], read.shape[-1])
    any_read = torch.empty(shape, dtype=torch.bool, device=read.device) if grouped else read
    unread = torch.empty(shape, dtype=torch.bool, device=read.device)

    def launches() -> None:
        fill()
        if grouped:  # a key is read by its group's heads
            torch.any(read.view(shape[0], shape[1], -1, shape[2]), dim=2, out=any_read)
        torch.logical_not(any_read, out=unread)

    return ListLaunches(launches, (*lists, read, any_read, unread)), unread


@dataclass(frozen=True)
class FlashAttn4BlockSparseRunner:
    """FA4's block sparsity as a :class:`~dilated_attention.core.autograd.Runner` over the
    ``tiles``; under ``create_graph=True`` a pattern's calls take the recompute over the
    fallback's calls for the same block pairs (Note [Double backward]), a run-time mask's
    gradients are first order only."""

    backend: FlashAttn4Backend
    tiles: FlashAttn4Tiles
    block_size: int
    is_causal: bool
    scale: float

    @property
    def first_order_message(self) -> str:
        # A pattern's calls have their differentiable recompute.
        return FIRST_ORDER_MESSAGE if self.tiles.mask is None else ""

    def forward(self, x: Inputs) -> Forward:
        # FA4 reads strided rows; a copy here, not inside the launches. No key padding mask.
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in x[:3])
        batch, length, heads = q.shape[:3]
        out = q.new_empty(batch, length, heads, v.shape[-1])
        lse_dtype = torch.promote_types(q.dtype, torch.float32)  # as KernelOutput's lse
        lse = torch.empty(batch, heads, length, dtype=lse_dtype, device=q.device)
        tiles = self.tiles

        def launches() -> None:  # into the buffers, allocating nothing
            if tiles.pending is not None:
                tiles.pending.launches()
            self.backend.block_sparse_forward(
                q, k, v, tiles.forward, scale=self.scale, is_causal=self.is_causal,
                into=KernelOutput(out, lse),
            )  # fmt: skip
            empty = tiles.empty_rows
            fill_blocks(out, empty, self.block_size, 0.0)
            fill_blocks(lse.transpose(1, 2).unsqueeze(-1), empty, self.block_size, float("-inf"))

        key = None  # a release without ``out=`` would allocate inside a graph: no graph
        if self.backend.forward_takes_outputs():
            key = ("fa4 block-sparse forward", self.block_size, self.is_causal, self.scale,
                   tiles.pending is not None)  # fmt: skip
        pending = tiles.pending.tensors if tiles.pending is not None else ()
        run_launches(key, (q, k, v, out, lse, *tiles.forward, tiles.empty_rows, *pending),
                     launches)  # fmt: skip
        if tiles.pending is not None:
            tiles.pending.done = True
        return Forward(out, lse, saved=(x.k, x.v))  # the backward makes its own copies

    def backward(self, b: Backward) -> Grads:
        dout, q, out, lse, saved, _ = b
        k, v = saved
        tiles = self.tiles
        grads = tuple(torch.empty(x.shape, dtype=q.dtype, device=q.device) for x in (q, k, v))
        pending = tiles.pending if tiles.pending is not None and not tiles.pending.done else None
        unreached = (tiles.empty_rows, tiles.unread_keys, tiles.unread_keys)

        def launches() -> None:  # into the gradients; what else it allocates dies inside
            if pending is not None:
                pending.launches()
            written = self.backend.block_sparse_backward(
                dout, q, k, v, out, lse, tiles.backward_lists, scale=self.scale,
                is_causal=self.is_causal, list_bytes=tiles.made_bytes, into=grads,
            )  # fmt: skip
            for grad, got, flags in zip(grads, written, unreached, strict=True):
                if got is not grad:  # a release that returns gradients of its own
                    grad.copy_(got)
                fill_blocks(grad, flags, self.block_size, 0.0)

        key = ("fa4 block-sparse backward", self.block_size, self.is_causal, self.scale,
               pending is not None)  # fmt: skip
        reads = (*tiles.reads, *(tiles.backward or ()), *unreached[:2],
                 *(pending.tensors if pending is not None else ()))  # fmt: skip
        run_launches(key, (dout, q, k, v, out, lse, *grads, *reads), launches)
        if pending is not None:
            pending.done = True
        return grads

    def saved_without_forward(self, x: Inputs) -> Saved:
        return x.k, x.v

    def differentiable_backward(self, b: Backward) -> Grads | None:
        if self.tiles.mask is None:
            return None  # a run-time mask: first order only
        return recomputed_grads(b, self.tiles.mask, self.block_size, self.is_causal, self.scale)
