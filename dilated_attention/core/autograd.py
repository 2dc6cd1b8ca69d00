"""The one autograd Function of every attention path, and the runner contract it drives.

Note [One autograd Function]
    Every path computes ``(q, k, v) -> (out, lse)`` with ``lse`` not differentiable and an
    exact backward from the merged statistics; they differ only in what runs the calls: the
    executor over a plan (``executor.py``), the fused dilated kernels (``fused.py``), our
    block-sparse Triton kernels, or a ring schedule that also moves key/value blocks and their
    gradients between ranks (``distributed/``). Each is a :class:`Runner`;
    :class:`AttentionFunction` is the autograd around any of them: it saves ``q``, ``out``,
    ``lse`` and what the runner asks for, replays the runner's backward, and under
    ``create_graph=True`` takes the runner's differentiable recompute
    (Note [Double backward] in ``higher_order.py``) or, where there is none (dropout, ring
    collectives), gradients that raise the runner's message when differentiated. Attention
    sinks join the runner's result here, once per row, and the runner's backward gets the
    joined ``out`` and ``lse`` (Note [Local windows, soft-capping and sinks] in ``sinks.py``).

Note [Backward without the forward]
    A runner's backward reads ``q``, its forward's ``out`` and ``lse``, and the forward's
    ``saved`` and ``state``. Where the state is empty (no kernel ``aux``, no plan made from the
    call's tensors) and ``saved`` are among the forward's inputs, the backward can run from the
    inputs, ``out`` and ``lse`` alone, with no graph kept from a forward: the runner says so
    with :meth:`Runner.saved_without_forward`. The custom operators of ``compiled/operators.py``
    rely on it: their forward runs without autograd and returns ``out`` and ``lse``, which the
    compiled graph keeps, and their backward calls the runner's backward on them, as
    :class:`AttentionFunction` does. A runner that needs its forward's state (a dropout RNG
    state, a ring's per-step values) says None, and the operators repeat the forward there.

Shape legend: B batch, Nq/Nk query/key rows, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from .higher_order import first_order_only, no_higher_order_message, outer_message
from .sinks import fold_sinks, sink_gradient

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Saved = tuple[torch.Tensor | None, ...]


@dataclass
class Forward:
    """A runner's forward result.

    Attributes:
        out: (B, Nq, H, D) in q's dtype.
        lse: (B, H, Nq), float32 (float64 for float64 inputs).
        saved: the tensors its backward needs besides ``q``, ``out`` and ``lse`` (None allowed),
            saved through autograd (so saved-tensor hooks see them).
        state: anything else its backward needs (kernel auxiliaries, plans).
    """

    out: torch.Tensor
    lse: torch.Tensor
    saved: Saved = ()
    state: Any = None


class Inputs(NamedTuple):
    """One call's inputs: q (B, Nq, H, D), k and v (B, Nk, Hkv, D), mask (B, Nk) bool or None."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    key_padding_mask: torch.Tensor | None


class Backward(NamedTuple):
    """What a runner's backward gets: the upstream gradient ``dout`` (B, Nq, H, D), ``q``, the
    merged ``out`` and ``lse`` of its forward, and its :class:`Forward`'s ``saved`` and
    ``state``."""

    dout: torch.Tensor
    q: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    saved: Sequence[Any]
    state: Any


class Runner(Protocol):
    """What runs one attention call's kernels, forward and backward."""

    #: The error when a gradient from :meth:`backward` is differentiated (only read where
    #: :meth:`differentiable_backward` returns None).
    first_order_message: str

    def forward(self, x: Inputs) -> Forward:
        """The call's merged ``out`` and ``lse``, and what its backward needs."""
        ...

    def backward(self, b: Backward) -> Grads:
        """dq, dk, dv, typed like q, k, v, from the merged ``out`` and ``lse`` (run without a
        graph)."""
        ...

    def differentiable_backward(self, b: Backward) -> Grads | None:
        """dq, dk, dv as differentiable functions of the inputs (``create_graph=True``), or
        None where the runner has no such recompute. It reads no ``b.out`` (the recompute
        makes its own: Note [Double backward] in ``higher_order.py``)."""
        ...

    def saved_without_forward(self, x: Inputs) -> Saved | None:
        """The ``saved`` that :meth:`forward` on ``x`` returns, where :meth:`backward` needs
        nothing else of the forward (it then takes ``state`` None): a backward from the inputs,
        ``out`` and ``lse`` alone, with no forward run before it (Note [Backward without the
        forward]); None where it needs the forward's state (a kernel's dropout RNG state)."""
        ...


class FirstOrderOnly:
    """Mixin for runners without a differentiable recompute (their backward communicates):
    their gradients raise ``first_order_message`` when differentiated, and their backward
    needs their forward's state."""

    def differentiable_backward(self, b: Backward) -> None:
        return None

    def saved_without_forward(self, x: Inputs) -> None:
        return None


_SINKS_MESSAGE = no_higher_order_message(
    "attention with sinks",
    "the sinks' gradient is computed without a graph",
    "Call it without sinks for a gradient penalty or other double backward.",
)


def _forward(runner: Runner, x: Inputs, sinks: torch.Tensor | None) -> Forward:
    """The runner's forward, the sinks joined to its result when given."""
    result = runner.forward(x)
    if sinks is not None:
        result.out, result.lse = fold_sinks(result.out, result.lse, sinks)
    return result


class AttentionFunction(torch.autograd.Function):
    """``(q, k, v, key_padding_mask, sinks, runner) -> (out, lse)`` for any :class:`Runner`,
    ``sinks`` (H,) or None; ``lse`` not differentiable (Note [One autograd Function])."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        sinks: torch.Tensor | None,
        runner: Runner,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        result = _forward(runner, Inputs(q, k, v, key_padding_mask), sinks)
        ctx.save_for_backward(q, result.out, result.lse, sinks, *result.saved)
        ctx.runner, ctx.state = runner, result.state
        ctx.outer_message = outer_message()  # Note [Double backward]: a composite's own error
        ctx.mark_non_differentiable(result.lse)
        # No zero-filled gradient of the lse per backward: a launch and its host time.
        ctx.set_materialize_grads(False)
        return result.out, result.lse

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, dout: torch.Tensor, _dlse: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        if dout is None:  # the loss does not use ``out`` (gradients are not materialized)
            return None, None, None, None, None, None
        q, out, lse, sinks, *saved = ctx.saved_tensors
        runner: Runner = ctx.runner
        b = Backward(dout, q, out, lse, saved, ctx.state)
        wants_sinks = sinks is not None and ctx.needs_input_grad[4]
        if not torch.is_grad_enabled():  # a plain backward: no graph to record
            dsinks = sink_gradient(dout, out, lse, sinks) if wants_sinks else None
            return *runner.backward(b), None, dsinks, None
        if sinks is None:  # create_graph=True (Note [Double backward])
            grads = runner.differentiable_backward(b)
            if grads is not None:
                return *grads, None, None, None
        with torch.no_grad():
            grads = runner.backward(b)
            dsinks = sink_gradient(dout, out, lse, sinks) if wants_sinks else None
        # The saved ``out`` leads back to q, k, v (and ``dout`` to the loss): the error node
        # must lie on those paths (Note [Double backward]).
        message = runner.first_order_message if sinks is None else _SINKS_MESSAGE
        message = ctx.outer_message or message
        grads = first_order_only((*grads, dsinks), message, anchors=(out, dout))
        return *grads[:3], None, grads[3], None


def run_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    runner: Runner,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of ``runner`` on these inputs, the ``sinks`` (H,) joined when given,
    differentiable through :class:`AttentionFunction`: out (B, Nq, H, D), lse (B, H, Nq)
    detached. Where autograd records nothing (grad mode off, or no input needs a gradient) the
    runner's forward is called as it is: the Function adds host time (decoding and chunks are
    host-bound) and would keep nothing."""
    recorded = q.requires_grad or k.requires_grad or v.requires_grad  # not any(): every call asks
    if sinks is not None:
        recorded = recorded or sinks.requires_grad
    if not (recorded and torch.is_grad_enabled()):
        result = _forward(runner, Inputs(q, k, v, key_padding_mask), sinks)
        return result.out, result.lse
    out, lse = AttentionFunction.apply(q, k, v, key_padding_mask, sinks, runner)
    return out, lse


#: ``record(q, k, v, grads)``: one kernel op on the inputs, recorded by torch's autograd, with
#: ``grads`` (the upstream gradient -> dq, dk, dv, differentiable) hung on its node for
#: ``create_graph=True`` -> ``(out, lse)`` (Note [Dense calls on torch's autograd]).
Record = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, Callable[[torch.Tensor], Grads]],
    tuple[torch.Tensor, torch.Tensor],
]


#: torch's query for the saved-tensor hooks in force (None where this torch has none).
_TOP_SAVED_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks are in force (non-reentrant activation checkpointing,
    ``torch.autograd.graph.save_on_cpu``, any ``saved_tensors_hooks``): a recorded call's node
    hook reaches its inputs through weak references that such hooks would free or move (Note
    [Dense calls on torch's autograd] in ``higher_order.py``), so such calls keep
    :class:`AttentionFunction`, whose saved tensors go through the hooks. True where torch
    cannot say."""
    if _TOP_SAVED_HOOKS is None:
        return True
    try:
        return _TOP_SAVED_HOOKS(False) is not None
    except (RuntimeError, TypeError):  # a torch whose query takes other arguments, or refuses
        return True


def run_recorded(runner: Runner, record: Record, x: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of a call whose one kernel op torch's autograd records instead of
    :class:`AttentionFunction` (Note [Dense calls on torch's autograd] in ``higher_order.py``):
    out (B, Nq, H, D), lse (B, H, Nq) not differentiable. Under ``create_graph=True`` the node's
    hook takes the runner's differentiable recompute, which reads no ``out``: none is held (the
    output holds the node, which would hold it back through the hook). q, k and v are held
    weakly: the node's saved tensors keep them alive while its graph can run backward, and no
    longer."""
    refs = [weakref.ref(t) for t in (x.q, x.k, x.v)]
    key_padding_mask = x.key_padding_mask
    held: list[torch.Tensor] = []

    def grads(dout: torch.Tensor) -> Grads:
        q, k, v = (ref() for ref in refs)
        if q is None or k is None or v is None:
            raise RuntimeError(
                "dense attention: its gradients cannot be differentiated (create_graph=True): "
                "the inputs of the call were freed (saved-tensor hooks or a released graph). "
                "Run the create_graph=True backward on a graph whose saved tensors are kept"
            )
        b = Backward(dout, q, None, held[0], (k, v, key_padding_mask), None)  # type: ignore[arg-type]
        recomputed = runner.differentiable_backward(b)
        assert recomputed is not None, "a recorded call's runner has a recompute"
        return recomputed

    out, lse = record(x.q, x.k, x.v, grads)
    held.append(lse)
    return out, lse
