"""Strategies: what the resolve step returns. A strategy knows which kernel runs a request, how
the work is cut (one dense call, a plan of branch calls gathered, read as views or written into
slots, our fused kernels, decoding rows, a block-sparse kernel), why every other kernel was not
taken, and runs it under the one autograd Function. A packed batch's or a cache call's
strategy wraps the one that runs the kernels (:class:`WrappedStrategy`: ``packed.py``,
``caches.py``).

Shape legend: B batch, Nq query rows, Nk key rows, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TypeVar

import torch

from ..backends.base import KernelInputs
from ..backends.registry import BackendChoice, Selection, registry_for
from ..block_sparse.fa4 import FlashAttn4BlockSparseRunner, fa4_tiles
from ..block_sparse.flex import _flex_forward
from ..block_sparse.triton_autograd import TritonBlockSparseRunner, _triton_lists
from ..core.autograd import (
    Inputs,
    Record,
    Runner,
    run_attention,
    run_recorded,
    saved_tensor_hooks_active,
)
from ..core.decoding.decode import static_token_plan, token_slots
from ..core.execution.executor import PlanRunner, empty_attention
from ..core.execution.fused import ChunkQueries
from ..core.execution.fused_runner import FusedRunner
from ..core.geometry.plan import Plan
from ..core.hidden import hide_masked_keys
from .request import Request

__all__ = [
    "BlockSparseKernelStrategy",
    "EmptyStrategy",
    "FusedStrategy",
    "KernelOnlyStrategy",
    "PlanStrategy",
    "Prepared",
    "StaticDecodeStrategy",
    "Strategy",
    "WrappedStrategy",
]

Tensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Result = tuple[torch.Tensor, torch.Tensor]
#: What runs a call: the runner, and the inputs as it reads them (q, k, v laid out for its
#: kernels, the key padding mask).
Prepared = tuple[Runner, Inputs]


def contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the executor's gathers and most kernels take it: contiguous."""
    return x.contiguous()


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself where its last dim is contiguous (kernels that read rows through strides:
    a (B, N, H, D) view of (B, H, N, D) tensors, the transformers layout, runs as it is)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def rows_in_place(x: torch.Tensor) -> torch.Tensor:
    """``x`` (B, N, H, D) itself where its (position, head) rows are evenly strided, as the
    decoding calls gather them (a cache's rows: a view of its buffers, which must not be copied
    whole for every token); else a contiguous copy."""
    _, rows, heads, dim = x.shape
    even = x.stride(3) == 1 and x.stride(2) == dim and x.stride(1) == heads * dim
    return x if even or rows * heads * dim == 0 else x.contiguous()


@dataclass(frozen=True)
class Strategy:
    """How one request runs (Note [One resolve step] in ``resolve.py``).

    Attributes:
        request: what was asked.
        kernel: the kernel that runs it (None where nothing needs one).
        operation: the registry that chose it (``"dense"``, ``"dilated"``, ``"block_sparse"``).
        inputs: what the kernel was judged by (a kernel call's shape and flags).
        how: one line on how the work is cut into kernel calls.
        notes: one line per branch, row group or other detail, for :meth:`describe`.
    """

    request: Request
    kernel: Selection | None
    operation: str
    inputs: KernelInputs | None
    how: str
    notes: tuple[str, ...] = field(default=())

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        sinks: torch.Tensor | None = None,
    ) -> Result:
        """``(out, lse)`` of the request on these tensors: q (B, Nq, H, D), k and v
        (B, Nk, Hkv, D), key_padding_mask (B, Nk) bool or None, sinks (H,) or None; out
        (B, Nq, H, D), lse (B, H, Nq) detached. Differentiable through the one autograd
        Function (the sinks joined there: Note [Local windows, soft-capping and sinks]), or a
        plain dense call through its op's node as torch's autograd records it (Note [Dense
        calls on torch's autograd] in ``core/higher_order.py``)."""
        if q.numel() == 0:
            out, lse = empty_attention(q, k, v)
            if sinks is not None:  # the link to sinks gives it an (empty) gradient too
                out = out + sinks.sum() * 0
            return out, lse
        return self._run(q, k, v, key_padding_mask, sinks)

    def call(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        sinks: torch.Tensor | None = None,
        cache: object = None,
    ) -> Result:
        """``(out, lse)`` of the request on a checked call's tensors as the public function got
        them (shapes as in :meth:`run`; ``mask`` the call's mask tensor, Note [The call's mask
        tensor] in ``request.py``): the keys a key padding mask hides zeroed (Note [Hidden keys
        cannot poison rows] in ``core/hidden.py``), then :meth:`run`. ``cache``: the decoding
        cache beside the tensors, which the strategies of cache calls take
        (``resolve/caches.py``); None here."""
        assert cache is None, "a request without a cache resolves to a strategy without one"
        if mask is not None:
            k, v = hide_masked_keys(k, v, self.request.key_padding_mask(mask))
        return self.run(q, k, v, mask, sinks)

    def _run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        sinks: torch.Tensor | None,
    ) -> Result:
        prepared = self.prepare(q, k, v, key_padding_mask)
        if prepared is None:
            raise NotImplementedError(f"{type(self).__name__} runs nothing: {self.how}")
        runner, x = prepared
        return run_attention(*x, runner, sinks)

    def prepare(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
    ) -> Prepared | None:
        """The runner of the request on these tensors (q (B, Nq, H, D) with query rows, k and v
        (B, Nk, Hkv, D), key_padding_mask (B, Nk) bool or None) and the inputs as it reads
        them, without running it: what :meth:`run` runs under the one autograd Function, and
        what the custom operators' backward differentiates from saved results (Note [Backward
        without the forward] in ``core/autograd.py``). None where no runner runs the call."""
        return None

    def choice(self) -> BackendChoice:
        """The kernel and, for every other kernel of its registry, why it was not taken (every
        kernel probed: slower than the choice :meth:`run` makes), with :meth:`describe`'s text.

        Raises:
            ValueError: nothing runs a kernel here (no query rows).
        """
        if self.kernel is None or self.inputs is None:
            raise ValueError(f"no kernel runs this {self.request.operation} call: {self.how}")
        choice = registry_for(self.operation).choose(self.inputs, self.request.backend)
        choice = replace(choice, branches=self.notes)
        return replace(choice, description=self._text(choice, reasons=True))

    def describe(self, *, reasons: bool = True) -> str:
        """The strategy in words: the call, the kernel and how it runs, one line per branch
        and, with ``reasons``, why every other kernel was not taken."""
        if self.kernel is None or self.inputs is None:
            return self._text(None, reasons=False)
        return self.choice().description if reasons else self._text(None, reasons=False)

    def _text(self, choice: BackendChoice | None, *, reasons: bool) -> str:
        r = self.request
        flags = [name for name, on in (("causal", r.is_causal), ("key padding mask", r.has_mask),
                                       ("training", r.requires_grad),
                                       (f"window {r.window}", r.window is not None),
                                       (f"softcap {r.softcap}", r.softcap is not None),
                                       ("sinks", r.sinks)) if on]  # fmt: skip
        lines = [
            f"{r.operation} attention: B={r.batch} Nq={r.query_len} Nk={r.key_len} "
            f"H={r.num_heads} Hkv={r.num_kv_heads} D={r.head_dim} "
            f"{str(r.dtype).removeprefix('torch.')} on {r.device}"
            + (f" ({', '.join(flags)})" if flags else "")
        ]
        if r.schedule is not None:
            lines.append(f"  schedule: {r.schedule}")
        if r.block_mask is not None:
            lines.append(f"  blocks: a {r.block_mask.describe()}, block_size {r.block_size}")
        if self.kernel is None:
            return "\n".join([*lines, f"  {self.how}"])
        source = f" ({choice.source})" if choice is not None else ""
        lines.append(f"  kernel: {self.kernel.backend.name}{source}: {self.how}")
        lines += [f"    {note}" for note in self.notes]
        if reasons and choice is not None:
            why_not = choice.reasons.items()
            lines += [f"  {name}: not used ({'; '.join(why)})" for name, why in why_not]
        return "\n".join(lines)


_W = TypeVar("_W", bound="WrappedStrategy")


@dataclass(frozen=True)
class WrappedStrategy(Strategy):
    """A strategy around the one that runs the kernels (``inner``): it lays a call's inputs out
    for it (packed documents as one row) or joins them with a decoding cache. The kernel, its
    registry, what it was judged by and the notes are ``inner``'s."""

    inner: Strategy | None = None

    @classmethod
    def around(cls: type[_W], request: Request, inner: Strategy, how: str) -> _W:
        """``request`` run around ``inner``, ``how`` saying what this strategy adds."""
        return cls(
            request, inner.kernel, inner.operation, inner.inputs, f"{how}: {inner.how}",
            inner.notes, inner=inner,
        )  # fmt: skip


@dataclass(frozen=True)
class KernelOnlyStrategy(Strategy):
    """A kernel chosen for a call's shape alone (``explain`` without a schedule): nothing to run."""


@dataclass(frozen=True)
class EmptyStrategy(Strategy):
    """No query rows (a batch of 0 or 0 heads): empty outputs, no kernel."""


#: Plans a :class:`PlanStrategy` keeps, one per query size and device.
PLANS_PER_REQUEST = 8


@dataclass(frozen=True)
class PlanStrategy(Strategy):
    """The executor runs a plan of kernel calls on ``kernel.backend`` (Note [One executor]).

    Attributes:
        plan: the plan of kernel calls, when it is known before the call's tensors are.
        plan_of: else the plan for this call's query (B, Nq, H, D): position groups depend on
            its size and device (Note [Position-grouped plans]); made once per size and
            device, so that every call of the request runs one plan object (what a slotted
            call's graph is keyed by: Note [A slotted call's launches from a CUDA graph] in
            ``core/execution/executor.py``).
        layout: how q, k and v are laid out for the plan's calls.
        what: the public function's name, for the double-backward error under dropout.
        recorded: the plan is one plain call on a kernel whose op torch's autograd
            differentiates: a call that autograd records runs that op as torch records it
            (Note [Dense calls on torch's autograd] in ``core/higher_order.py``).
    """

    plan: Plan | None = None
    plan_of: Callable[[torch.Tensor], Plan] | None = None
    layout: Callable[[torch.Tensor], torch.Tensor] = contiguous
    what: str = "attention"
    recorded: bool = False
    _runners: dict[tuple[torch.Size, torch.device], PlanRunner] = field(
        default_factory=dict, compare=False, repr=False
    )

    def prepare(self, q, k, v, key_padding_mask):  # type: ignore[no-untyped-def]
        layout = self.layout
        q, k, v = layout(q), layout(k), layout(v)
        if self.plan_of is None:
            return self._runner, Inputs(q, k, v, key_padding_mask)
        return self._runner_for(q), Inputs(q, k, v, key_padding_mask)

    def _run(self, q, k, v, key_padding_mask, sinks):  # type: ignore[no-untyped-def]
        recorded = (
            self.recorded and sinks is None and key_padding_mask is None
            and torch.is_grad_enabled() and not saved_tensor_hooks_active()
        )  # fmt: skip
        if not recorded:
            return super()._run(q, k, v, key_padding_mask, sinks)
        runner, x = self.prepare(q, k, v, key_padding_mask)
        return run_recorded(runner, self._record, x)

    @functools.cached_property
    def _record(self) -> Record:
        """The kernel's recorded op with the request's scale and causality."""
        assert self.kernel is not None
        r = self.request
        return functools.partial(
            self.kernel.backend.recorded_forward, scale=r.softmax_scale, is_causal=r.is_causal
        )

    def _runner_for(self, q: torch.Tensor) -> PlanRunner:
        """The runner of ``plan_of(q)``, made once per query size and device (all the plan
        depends on)."""
        key = (q.shape, q.device)
        runner = self._runners.get(key)
        if runner is None:
            if len(self._runners) >= PLANS_PER_REQUEST:
                self._runners.clear()
            assert self.plan_of is not None
            runner = self._runners[key] = self._runner_of(self.plan_of(q))
        return runner

    @functools.cached_property
    def _runner(self) -> PlanRunner:
        """The runner of a plan known before the call's tensors: made once, for every call of
        the request (Note [Resolved once per request] in ``resolver.py``)."""
        assert self.plan is not None  # resolve gives every plan strategy a plan or its rule
        return self._runner_of(self.plan)

    def _runner_of(self, plan: Plan) -> PlanRunner:
        assert self.kernel is not None  # resolve gives every plan a kernel
        return PlanRunner(
            plan, self.kernel.backend, self.request.softmax_scale,
            self.request.dropout_p, self.what, self.request.softcap,
        )  # fmt: skip


@dataclass(frozen=True)
class StaticDecodeStrategy(Strategy):
    """One token per batch row against a static cache's buffers (Note [A decode step with
    static shapes] in ``core/decoding/static_cache.py``), run by :meth:`run_at` with the rows'
    positions.

    Attributes:
        branches: the effective segment lengths and rates every step reads.
    """

    branches: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())

    def run_at(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        positions: torch.Tensor,
        row_offsets: torch.Tensor | None = None,
        slots: tuple[torch.Tensor, ...] | None = None,
        sinks: torch.Tensor | None = None,
    ) -> Result:
        """``(out, lse)`` of the tokens q (B, 1, H, D) at ``positions`` (B,) int64, their keys
        and values already written into the buffers k, v (B, R, Hkv, D) (and their mask
        (B, R) bool or None), row ``b``'s positions ``row_offsets[b]`` (B,) rows further (None:
        0); out (B, 1, H, D), lse (B, H, 1); ``slots``: ``token_slots`` of the branches
        (None: made once per schedule and device); ``sinks`` (H,) or None. No host
        synchronization."""
        assert self.kernel is not None  # resolve gives it one
        if q.numel() == 0:
            return empty_attention(q, k, v)
        backend = self.kernel.backend
        slots = slots or token_slots(q.shape[2], *self.branches, q.device)
        if getattr(backend, "reads_decode_buffers", False):  # softcap and sinks in the kernel
            scale, shift, cap = self.request.softmax_scale, row_offsets, self.request.softcap
            return backend.decode_step(  # type: ignore[attr-defined, no-any-return]
                q, k, v, key_padding_mask, positions, slots, scale, shift, cap, sinks
            )
        plan = static_token_plan(positions, k.shape[1], slots, *self.branches, row_offsets)
        runner = PlanRunner(
            plan, self.kernel.backend, self.request.softmax_scale, 0.0, "dilated_attention",
            self.request.softcap,
        )  # fmt: skip
        return run_attention(q, k, v, key_padding_mask, runner, sinks)


@dataclass(frozen=True)
class FusedStrategy(Strategy):
    """Our fused dilated kernels run every branch themselves (Note [Fused branch engine]).

    Attributes:
        branches: the effective ``(w, r)`` pairs.
        first_head: the layer head that the call's head 0 is (Note [Heads from a later layer
            head] in ``core/geometry/schedule.py``).
        chunk: the queries are a chunk at the last positions, run without gradients (Note [A
            chunk in one fused forward] in ``core/execution/fused.py``), or None.
    """

    branches: tuple[tuple[int, int], ...] = ()
    first_head: int = 0
    chunk: ChunkQueries | None = None

    def prepare(self, q, k, v, key_padding_mask):  # type: ignore[no-untyped-def]
        runner = self._runner
        inputs = Inputs(last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v),
                        key_padding_mask)  # fmt: skip
        runner.compile_ahead(inputs, needs_grad=self.request.requires_grad)
        return runner, inputs

    @functools.cached_property
    def _runner(self) -> FusedRunner:
        """The fused kernels' runner: made once, for every call of the request (Note [Resolved
        once per request] in ``resolver.py``)."""
        assert self.kernel is not None
        r = self.request
        return FusedRunner(
            self.branches, self.kernel.backend, r.is_causal, r.softmax_scale, r.documents,  # type: ignore[arg-type]
            self.first_head, self.chunk, r.softcap,
        )  # fmt: skip


@dataclass(frozen=True)
class BlockSparseKernelStrategy(Strategy):
    """One of the block-sparse operation's own kernels walks the pattern's kept blocks: our
    Triton kernels, FlashAttention-4's block sparsity, or FlexAttention."""

    def _run(self, q, k, v, key_padding_mask, sinks):  # type: ignore[no-untyped-def]
        assert self.kernel is not None and self.request.pattern is not None
        r = self.request
        if self.kernel.backend.name == "flex":  # differentiable by itself: no runner
            return _flex_forward(
                q, k, v, r.pattern, block_size=r.block_size, is_causal=r.is_causal,
                scale=r.softmax_scale,
            )  # fmt: skip
        return super()._run(q, k, v, key_padding_mask, sinks)

    def prepare(self, q, k, v, key_padding_mask):  # type: ignore[no-untyped-def]
        assert self.kernel is not None and self.request.pattern is not None
        r = self.request
        shape = (r.pattern, r.block_size, r.query_len, r.key_len, r.is_causal, q.device)
        runner: Runner
        name = self.kernel.backend.name
        if name == "flex":
            return None
        if name == "triton":
            runner = TritonBlockSparseRunner(
                _triton_lists(*shape), r.block_size, r.is_causal, r.softmax_scale, r.softcap
            )
            q, k, v = (x.contiguous() for x in (q, k, v))
        else:  # FlashAttention-4 reads strided rows
            runner = FlashAttn4BlockSparseRunner(
                self.kernel.backend, fa4_tiles(*shape), r.block_size, r.is_causal,  # type: ignore[arg-type]
                r.softmax_scale,
            )  # fmt: skip
        return runner, Inputs(q, k, v, None)  # no key padding mask here
