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
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["CAPTURE_AFTER", "GRAPH_LIMIT", "clear", "enabled", "run_launches"]

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
_STREAMS = threading.local()


def enabled() -> bool:
    """Whether calls may replay their launches from CUDA graphs (the environment's say)."""
    return os.environ.get(ENV_VAR, "1").strip() != "0"


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
            allocating nothing.
        keep: what a graph must keep alive besides ``tensors`` (tensors its launches read).
    """
    if not enabled() or torch.cuda.is_current_stream_capturing():
        launches()
        return
    pair = (key, addresses(tensors))
    found = _GRAPHS.get(pair)
    if found is not None:
        with contextlib.suppress(KeyError):  # another thread dropped it meanwhile
            _GRAPHS.move_to_end(pair)
        found[0].replay()
        return
    runs = _RUNS.pop(pair, 0)
    if runs == _NEVER or runs + 1 < CAPTURE_AFTER:
        _count(pair, runs if runs == _NEVER else runs + 1)
        launches()
        return
    device = next(x for x in tensors if x is not None).device
    graph = _capture(launches, device)
    if graph is None:
        _count(pair, _NEVER)
        launches()
        return
    _GRAPHS[pair] = (graph, keep)
    if len(_GRAPHS) > GRAPH_LIMIT:  # a dropped pair launches as usual from now on: a loop of
        dropped, _ = _GRAPHS.popitem(last=False)  # more pairs than the limit never recaptures
        _count(dropped, _NEVER)
    graph.replay()


def _count(pair: tuple[Any, ...], runs: int) -> None:
    _RUNS[pair] = runs
    if len(_RUNS) > _COUNTED_LIMIT:
        _RUNS.popitem(last=False)


def _capture(launches: Callable[[], None], device: torch.device) -> Any | None:
    """A CUDA graph of ``launches`` captured on a side stream of ``device`` (nothing runs), or
    None where the capture failed."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    streams = getattr(_STREAMS, "by_device", None)  # this thread's, per device
    if streams is None:
        streams = _STREAMS.by_device = {}
    stream = streams.get(index)
    if stream is None:
        stream = streams[index] = torch.cuda.Stream(index)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(stream):
            graph.capture_begin(capture_error_mode="thread_local")
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
