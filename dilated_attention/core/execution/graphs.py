"""A call's kernel launches replayed from a CUDA graph once the same call has run before.

Note [A call's launches from a CUDA graph]
    Bound launches (Note [Bound launches] in ``backends/triton_kernels/launch.py``) leave one
    host cost per launch: the launcher's own. On the lent H100's host it grows from ~10 us to
    40-70 us while the GPU still runs earlier work, which is when a backward's launches are
    issued. A forward+backward of LongNet's schedule makes 11 launches at 4K tokens and 146 at
    64K, 1-7 ms of host time against 1-26 ms of GPU time, so at 4K-64K the host decides.

    A call of the fused engine launches kernels into tensors it allocated before (outputs,
    scratch) and allocates nothing while it launches; which kernels it launches, with which
    arguments, follows from its *key* (every tensor's layout and every value that shapes the
    launches) and the *addresses* of its tensors. So :func:`run_launches` keeps, per (key,
    addresses), a CUDA graph of the call's launches: the ``CAPTURE_AFTER``-th run of a pair
    captures them on a side stream and replays the graph; later runs only replay it, one graph
    launch for the whole call. The replay runs the same kernels on the same memory as the
    launches would: the same bits.

    Addresses repeat wherever the caching allocator's sequence does: in the steady state of a
    training or benchmark loop every layer's call finds its graph (each layer its own). Calls
    whose addresses never repeat pay only the key (a few microseconds) and launch as usual.

    Nothing is captured while the current stream is being captured (the caller's own graph,
    ``torch.cuda.graph`` or ``torch.compile(mode="reduce-overhead")``, takes the launches), or
    with ``DILATED_ATTENTION_CUDA_GRAPHS=0`` in the environment; the backend decides the rest
    (``FusedBackend.run_launches``: CUDA tensors, no profiler's launch hook). A graph keeps
    alive what its launches read that the key does not name (``keep``: segment tables). A
    capture that fails runs the launches as usual, and its key is not captured again. At most
    :data:`GRAPH_LIMIT` graphs are kept, the least recently used dropped (a graph dropped while
    it runs is freed when it finishes); a dropped pair launches as usual from then on, so a
    loop of more pairs than the limit does not capture again and again.

Note [Graphs share one memory pool per stream]
    Launches may allocate what they free before they return (a kernel's own workspace:
    FlashAttention-4's backward allocates a float32 dQ accumulator, twice q's bytes, per call).
    Inside a capture that memory comes from the graph's pool and stays reserved as long as the
    graph lives: with a pool per graph, every layer's backward would hold its own workspace for
    good. So every graph replayed on one stream of one device is captured into one shared pool:
    a capture reuses what earlier captures freed, and the pool holds about the largest
    workspace of any one call. Sharing is sound because nothing allocated inside the launches
    outlives them (what a call returns is allocated before its launches run), so a graph's
    workspace is dead between its replays, and replays on one stream never overlap. The
    stream a call runs on is therefore part of its key: a call on another stream finds other
    graphs, in another pool, and two streams never replay graphs of one pool at once.

    The cost: what the pool holds (the largest transient memory of any one call: for
    FlashAttention-4 in branch slots, its float32 workspace and, for a plan cut into position
    groups, one group's slots and the slots that span groups) stays reserved for the graphs
    while they live, where an eager call's would go back to the caching allocator for other
    work. The fused Triton engine's launches allocate nothing, so its graphs add nothing to
    the pool; a MoBA block choice's hold its key parts, a chunk's float32 affinities (at most
    ``AFFINITY_BYTES``) and its top-k scratch (Note [A choice's launches in one graph] in
    ``sparse/device_choice.py``). ``DILATED_ATTENTION_CUDA_GRAPHS=0`` trades the replays for
    that memory.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .streams import ThreadStreams, cuda_index

__all__ = ["CAPTURE_AFTER", "GRAPH_LIMIT", "clear", "enabled", "events", "run_launches"]

#: The environment variable that turns the graphs off (``0``).
ENV_VAR = "DILATED_ATTENTION_CUDA_GRAPHS"
#: Graphs kept at most (a layer's forward and backward are two).
GRAPH_LIMIT = 256
#: Runs of one (key, addresses) before its launches are captured: the first run of a key may
#: compile and bind its kernels, and a pair seen once may never come back.
CAPTURE_AFTER = 2
#: (key, addresses) pairs counted at most.
_COUNTED_LIMIT = 4096
#: What a pair whose capture failed, or whose graph was dropped, counts as: never captured.
_NEVER = -1

_GRAPHS: OrderedDict[tuple[Any, ...], tuple[Any, object]] = OrderedDict()
_RUNS: OrderedDict[tuple[Any, ...], int] = OrderedDict()
#: Each thread's side streams to capture on (two threads never capture on one stream).
_STREAMS = ThreadStreams()
#: The memory pool of the graphs replayed on each (device index, stream).
_POOLS: dict[tuple[int | None, int | None], Any] = {}
#: Graphs captured, captures that failed, graphs dropped past GRAPH_LIMIT, and calls launched
#: as usual because their pair's capture failed or its graph was dropped (:func:`events`).
_EVENTS: Counter[str] = Counter()


def enabled() -> bool:
    """Whether calls may replay their launches from CUDA graphs (the environment's say)."""
    return os.environ.get(ENV_VAR, "1").strip() != "0"


def events() -> dict[str, int]:
    """Since the process started (or :func:`clear`): how many graphs were ``captured``, how
    many captures ``failed``, how many graphs were ``dropped`` past :data:`GRAPH_LIMIT`, and how
    many calls launched as usual because their pair's capture had failed or its graph had been
    dropped (``uncaptured``: such a pair never captures again). A benchmark reads them around a
    measurement to tell a replayed call from one that is not; the counts are the process's,
    so that reading assumes no other thread runs calls meanwhile."""
    return {name: _EVENTS[name] for name in ("captured", "failed", "dropped", "uncaptured")}


def addresses(tensors: Sequence[torch.Tensor | None]) -> tuple[Any, ...]:
    """Each tensor's address, shape, strides and dtype (None stays None)."""
    return tuple(
        None if x is None else (x.data_ptr(), x.shape, x.stride(), x.dtype) for x in tensors
    )


def run_launches(
    key: tuple[Any, ...],
    tensors: Sequence[torch.Tensor | None],
    launches: Callable[[], None],
    keep: object = None,
) -> None:
    """Run ``launches``, or replay them from the CUDA graph of ``key`` at these ``tensors``'
    addresses (Note [A call's launches from a CUDA graph]).

    Args:
        key: hashable; with the tensors' addresses and layouts it decides every launch.
        tensors: every tensor the launches read or write, on one CUDA device (q, k, v, outputs,
            scratch; None where absent); the first is not None.
        launches: launches kernels and runs in-place ops on ``tensors`` (and views of them),
            allocating nothing that outlives them.
        keep: what a graph must keep alive besides ``tensors`` (tensors its launches read).
    """
    if not enabled() or torch.cuda.is_current_stream_capturing():
        launches()
        return
    first = tensors[0]
    device = (first if first is not None else next(x for x in tensors if x is not None)).device
    stream = _stream_of(device)
    pair = (key, stream, addresses(tensors))
    found = _GRAPHS.get(pair)
    if found is not None:
        with contextlib.suppress(KeyError):  # another thread dropped it meanwhile
            _GRAPHS.move_to_end(pair)
        found[0].replay()
        return
    runs = _RUNS.pop(pair, 0)
    if runs == _NEVER or runs + 1 < CAPTURE_AFTER:
        _count(pair, runs if runs == _NEVER else runs + 1)
        if runs == _NEVER:
            _EVENTS["uncaptured"] += 1
        launches()
        return
    graph = _capture(launches, device, stream)
    if graph is None:
        _EVENTS["failed"] += 1
        _count(pair, _NEVER)
        launches()
        return
    _EVENTS["captured"] += 1
    _GRAPHS[pair] = (graph, keep)
    if len(_GRAPHS) > GRAPH_LIMIT:  # a dropped pair launches as usual from now on: a loop of
        dropped, _ = _GRAPHS.popitem(last=False)  # more pairs than the limit never recaptures
        _EVENTS["dropped"] += 1
        _count(dropped, _NEVER)
    graph.replay()


def _count(pair: tuple[Any, ...], runs: int) -> None:
    _RUNS[pair] = runs
    if len(_RUNS) > _COUNTED_LIMIT:
        _RUNS.popitem(last=False)


def _stream_of(device: torch.device) -> int | None:
    """The handle of the stream a call on ``device`` runs on (None off CUDA): graphs replay
    there, and share its pool (Note [Graphs share one memory pool per stream])."""
    if device.type != "cuda":
        return None
    # The raw handle: ``torch.cuda.current_stream`` builds a Stream object under a device guard,
    # ~20 us of a replayed call's host time on the lent H200's host.
    return torch._C._cuda_getCurrentRawStream(cuda_index(device))


def _pool(device: torch.device, stream: int | None) -> Any:
    """The memory pool of every graph replayed on ``stream`` of ``device`` (Note [Graphs share
    one memory pool per stream])."""
    pool = _POOLS.get((device.index, stream))
    if pool is None:
        pool = _POOLS[device.index, stream] = torch.cuda.graph_pool_handle()
    return pool


def _capture(launches: Callable[[], None], device: torch.device, stream: int | None) -> Any | None:
    """A CUDA graph of ``launches`` captured on a side stream of ``device`` (nothing runs) into
    the pool of the graphs replayed on ``stream``, or None where the capture failed."""
    index = cuda_index(device)
    device = torch.device("cuda", index)
    side = _STREAMS.get(index)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(side):
            graph.capture_begin(pool=_pool(device, stream), capture_error_mode="thread_local")
            try:
                launches()
            finally:
                graph.capture_end()
    except Exception:  # a launch that cannot be captured: run as usual from now on
        with contextlib.suppress(Exception):
            graph.reset()  # its memory pool, where the capture got that far
        return None
    return graph


def clear() -> None:
    """Forget every graph and count (tests that change kernel settings between calls)."""
    _GRAPHS.clear()
    _RUNS.clear()
    _POOLS.clear()
    _EVENTS.clear()
