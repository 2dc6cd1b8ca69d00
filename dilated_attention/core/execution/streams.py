"""Two chains of launches that share no output, run side by side on one GPU.

Note [Two chains side by side]
    A branch's backward is two kernels that read the same inputs and write different
    gradients: dK/dV, one program per key tile, and dQ, one program per query tile. The fused
    engine runs every branch of a head range into the same float32 scratch, so the dK/dV
    launches of its branches form one chain (each adds into what the last wrote) and the dQ
    launches another, and nothing in one chain reads what the other writes. Issued on one
    stream the two chains alternate, and each launch ends in a tail where its heaviest
    programs (causal tiles near a segment's start, a GQA group's walk over its query heads)
    keep a few SMs busy while the rest wait: at 64K tokens with 4 key/value heads the dK/dV
    launches of rates 2-32 took 1.2-3.4x their share of the work (which halves with each
    doubling of the rate). Smaller tiles do not help there (each program walks as many steps,
    of less work; the table's tiles were fastest for every rate, ``findings_h200.json``, "dK/dV
    tiles per rate").

    So :func:`side_by_side` issues the first chain on the current stream and the second on a
    side stream that first waits for the current one, and the current stream then waits for
    the side one: the second chain's programs fill the SMs that the first chain's tails leave
    idle. Both chains write what they wrote before, so the results are the same bits. Inside
    a CUDA graph capture (ours, or the caller's) the wait forks the capture onto the side
    stream and the join brings it back, so a replayed graph runs the chains side by side too.
    Nothing is allocated on the side stream, and the current stream's later work waits for it,
    so the caching allocator's per-stream reuse stays sound. The side stream comes from
    PyTorch's pool, as the capture streams do; the join happens even when a launch fails. Off
    CUDA the chains run one after the other.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

__all__ = ["ThreadStreams", "cuda_index", "side_by_side"]


def cuda_index(device: torch.device) -> int:
    """The index of CUDA ``device`` (the current device where it names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


class ThreadStreams:
    """A CUDA stream per thread and device index, made from PyTorch's pool on first use: each
    thread and each table asks for its own (the pool cycles through 32 streams per device, so
    past 32 asked on one device two may coincide)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, index: int) -> torch.cuda.Stream:
        """This thread's stream of this table on device ``index``."""
        streams = getattr(self._local, "by_device", None)
        if streams is None:
            streams = self._local.by_device = {}
        stream = streams.get(index)
        if stream is None:
            stream = streams[index] = torch.cuda.Stream(index)
        return stream


#: The side streams (apart from the capture streams of ``graphs.py``).
_SIDE = ThreadStreams()


def side_by_side(
    device: torch.device, first: Callable[[], None], second: Callable[[], None]
) -> None:
    """Run ``first`` on the current stream and ``second`` beside it on a side stream, both
    after everything issued before and before everything issued after (Note [Two chains side
    by side]); on a device other than CUDA, ``first`` then ``second``.

    The two must not write what the other reads or writes, nor allocate memory that outlives
    them. Both launch on ``device`` whatever the current device is.
    """
    if device.type != "cuda":
        first()
        second()
        return
    index = cuda_index(device)
    with torch.cuda.device(index):
        current = torch.cuda.current_stream()
        side = _SIDE.get(index)
        side.wait_stream(current)
        try:
            first()
            with torch.cuda.stream(side):
                second()
        finally:  # joined even when a launch fails (a capture must end with its fork joined)
            current.wait_stream(side)
