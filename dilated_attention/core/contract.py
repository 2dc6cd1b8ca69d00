"""The one contract between the engines and the kernel backends.

Note [The backend contract]
    A backend is a :class:`KernelBackend`: attention over the query, key and value rows it is
    given, returning ``out`` and the log-sum-exp (:class:`KernelOutput`), and a backward that
    accepts the *merged* ``out`` and ``lse`` of a whole plan instead of its own (Note [Backward
    with external statistics] in ``reference.py``). That is all the executor (``executor.py``)
    calls, for every plan: dense, dilated through gathers, block-sparse and the ring steps.
    ``backends.base.Backend`` implements it and turns declared capabilities into rejection
    reasons.

    ``into`` hands a kernel buffers to write its result into: ``out`` and ``lse`` views of a
    larger buffer forward, views for ``(dq, dk, dv)`` backward, shaped like the result, with the
    last dim contiguous and any other strides. A backend whose kernel writes there
    (``writes_into``) returns those tensors; any other may ignore them and return its own, which
    the caller then copies in. The executor's branch slots use it (Note [Branch slots merged
    once] in ``slots.py``).

    A backend that can also run whole dilated branches in place (reading rows through strides,
    merging into a running ``(out, lse)``, adding gradients into dq, dk, dv) is a
    :class:`FusedBackend`, the same contract with those methods added; the fused engine
    (``fused.py``) drives it over a :class:`BranchSpan` at a time, with the call's ``softcap``
    (its branches take no window: a window is a call of its own). The registries
    (``backends/registry.py``) say which backend serves which operation; nothing else tests what
    a backend is.

    The contract lives in ``core`` so that the engines depend on it and not on ``backends``
    (imports flow core <- backends).

Shape legend: B batch, Nq/Nk query/key rows, H query heads, Hkv key/value heads, D head dim.
``key_mask`` is (B, Hm, Nk) bool with Hm in {1, H}, ``True`` = ignore the key.

Note [Scores a kernel call transforms]
    Besides causality and the key mask, a call may ask two things of its scores (Note [Local
    windows, soft-capping and sinks] in ``core/sinks.py`` for the public semantics):
    ``softcap=c`` (every scaled score ``s`` becomes ``c * tanh(s / c)`` before the softmax; its
    backward multiplies ``dS`` by ``1 - tanh(s / c) ** 2``), and a :class:`Window` over the
    call's rows. Both are keyword arguments of ``forward`` and ``backward``, ``None`` when not
    asked; a backend that cannot apply one says so among its reasons (``supports_softcap``,
    ``supports_window`` in ``backends/base.py``) and never receives it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch


@dataclass(frozen=True)
class Window:
    """The key rows each query row of a kernel call sees (Note [Scores a kernel call
    transforms]): the call's ``Nq`` query rows stand at its last ``Nq`` key rows (bottom-right,
    as in FlashAttention), so query row ``i``, at key row ``p = i + Nk - Nq``, sees the key rows
    ``j`` with ``p - left <= j <= p + right``; ``-1`` leaves that side unbounded. Intersected
    with causality (top-left, ``j <= i``, on square calls) and the key mask."""

    left: int
    right: int

    def hides(self, query_rows: torch.Tensor, key_rows: torch.Tensor, shift: int) -> torch.Tensor:
        """Bool, broadcast of (Lq, 1) query row indices and (1, Lk) key row indices, ``shift``
        = ``Nk - Nq`` of the call: ``True`` where the key lies outside the window."""
        at = query_rows + shift
        outside = torch.zeros_like(at < key_rows)
        if self.left >= 0:
            outside = outside | (key_rows < at - self.left)
        if self.right >= 0:
            outside = outside | (key_rows > at + self.right)
        return outside


@dataclass
class KernelOutput:
    """A backend's forward result: ``out`` (B, Nq, H, D) in the input dtype, ``lse`` (B, H, Nq)
    float32 (float64 for float64 inputs, ``-inf`` on rows with no visible key), and ``aux``,
    whatever the backend's backward needs besides the tensors (dropout RNG state, metadata).
    """

    out: torch.Tensor
    lse: torch.Tensor
    aux: Any = None


class KernelBackend(Protocol):
    """A kernel backend: attention over the rows it is given, and its backward with external
    statistics. What the executor calls (``backends.base.Backend`` provides it)."""

    @property
    def aux_only_for_dropout(self) -> bool:
        """Whether :meth:`forward` returns ``aux`` None whenever ``dropout_p`` is 0, so that a
        backward without dropout needs nothing of its forward but the merged statistics."""
        ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float,
        is_causal: bool = ...,
        key_mask: torch.Tensor | None = ...,
        dropout_p: float = ...,
        into: KernelOutput | None = ...,
        softcap: float | None = ...,
        window: Window | None = ...,
    ) -> KernelOutput: ...

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        aux: Any,
        *,
        scale: float,
        is_causal: bool = ...,
        key_mask: torch.Tensor | None = ...,
        dropout_p: float = ...,
        into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = ...,
        softcap: float | None = ...,
        window: Window | None = ...,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def run_launches(
        self,
        key: tuple[Any, ...] | None,
        tensors: Sequence[torch.Tensor | None],
        launches: Callable[[], None],
        keep: object = None,
    ) -> None:
        """Run ``launches`` (kernel calls and in-place ops on ``tensors``; what they allocate
        they free before returning), replayed from a CUDA graph where the backend can (Note [A
        call's launches from a CUDA graph] in ``execution/graphs.py``); ``key`` None: run them
        as they are."""
        ...


@dataclass(frozen=True)
class BranchSpan:
    """Branch ``(segment_len, rate)`` over the positions [start, end); ``start`` is a segment
    boundary and the last segment is clipped at ``end``.

    ``bounds`` (packed documents): the segments are instead ``[bounds[i], bounds[i + 1])``, an
    int32 tensor on the inputs' device from ``start`` to ``end``, and ``segment_len`` is the
    longest of them (Note [Segments from a table] in ``backends/triton_kernels/device.py``).
    """

    start: int
    end: int
    segment_len: int
    rate: int
    bounds: torch.Tensor | None = None


#: Which of a branch's backward kernels to launch: both, dK/dV only, or dQ only.
BackwardPart = Literal["both", "keys", "queries"]


class FusedBackend(KernelBackend, Protocol):
    """A kernel backend that also runs whole dilated branches in place: what the fused engine
    (``fused.py``) needs (``backends.triton.TritonBackend`` provides it)."""

    def forward_branch(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        key_mask: torch.Tensor | None,
        span: BranchSpan,
        *,
        out_row0: int,
        scale: float,
        is_causal: bool,
        merge: bool,
        head0: int = 0,
        merge_from: torch.Tensor | None = None,
        merge_row0: int = 0,
        q_row0: int = 0,
        softcap: float | None = None,
    ) -> None: ...

    def row_delta(
        self, out: torch.Tensor, dout: torch.Tensor, start: int, end: int, delta: torch.Tensor
    ) -> None:
        """``delta`` (B, H, end - start) float32 := ``rowsum(out * dout)`` of rows
        ``[start, end)``."""
        ...

    def backward_branch(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        lse: torch.Tensor,
        delta: torch.Tensor,
        key_mask: torch.Tensor | None,
        dq: torch.Tensor,
        dk: torch.Tensor,
        dv: torch.Tensor,
        span: BranchSpan,
        *,
        delta_row0: int,
        grad_row0: int,
        scale: float,
        is_causal: bool,
        accumulate: bool,
        head0: int = 0,
        softcap: float | None = None,
        part: BackwardPart = "both",
    ) -> None:
        """One branch's gradients into ``dq, dk, dv``; ``part``: launch only the dK/dV kernel
        (``"keys"``) or only the dQ kernel (``"queries"``), which write nothing the other reads
        (Note [Two chains side by side] in ``core/execution/streams.py``)."""
        ...

    def begin_compile(self, family: tuple[Any, ...]) -> AbstractContextManager[None] | None:
        """A context inside which the branch calls compile their kernels instead of running
        them, or ``None`` when ``family``'s kernels are ready (Note [Compiling a shape family
        ahead])."""
        ...
