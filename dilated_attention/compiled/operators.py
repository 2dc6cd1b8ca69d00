"""The public functions as custom operators: their definitions, implementations, fake
functions and gradients, and torch.func's autograd around them.

Note [Custom operators for torch.compile and torch.func]
    An eager call chooses a kernel (selection probes kernels and caches its answers), builds a
    plan of kernel calls (pure Python, cached) and runs it under one ``torch.autograd.Function``
    whose context holds Python objects (the plan, the kernel, each call's ``aux``). None of that
    can be traced: Dynamo stops at the choice, and torch.func needs Functions with
    ``setup_context``. So when Dynamo traces a call (``torch.compile``, ``torch.export``) or an
    input is wrapped by a torch.func transform (``tracing.is_traced``), the public function checks
    its arguments as usual (plain Python on shapes, dtypes and devices: it traces without graph
    breaks) and then calls one of these operators, which the tracers keep opaque:

        dilated_attention::dense          attention()
        dilated_attention::dilated        dilated_attention()
        dilated_attention::block_sparse   block_sparse_attention()

    Each takes ``query, key, value`` and the call's mask tensor (a key padding mask, or the
    block-sparse operator's ``block_mask``, a run-time block mask: Note [The call's mask
    tensor] in ``resolve/request.py``), and the call's options as ints, floats, bools and
    strings (a block-sparse pattern as an int key: Note [Patterns as operator arguments] in
    :mod:`dilated_attention.pattern_keys`; ``-1`` where the run-time mask gives the blocks),
    and returns ``(out, lse, rng_state)``: ``out`` (B,
    Nq, H, D) in the input dtype and ``lse`` (B, H, Nq) float32 (float64 for float64 inputs), both
    contiguous, as the fake implementation promises, and ``rng_state`` (below). The real
    implementation is the eager function itself, run without autograd (no graph, nothing kept
    beyond its results) on the request the traced call made, which says whether it needs
    gradients, so the same kernel is chosen and the result is the eager result.

    Gradients: each operator has a backward operator, which takes the upstream gradient, the
    inputs and the forward's ``out``, ``lse`` and ``rng_state`` (saved by the compiled graph, as
    SDPA's are). Where the call's runner can run its backward from those alone (Note [Backward
    without the forward] in ``core/autograd.py``: our fused dilated and block-sparse kernels, and
    plans on kernels that keep no ``aux`` without dropout), it builds the runner the eager call
    builds (``Strategy.prepare``) and calls its backward, as eager autograd does: the same
    gradients, no forward again. Otherwise (dropout, a kernel whose backward needs its forward's
    ``aux``, FlexAttention's block sparsity) it runs the forward again in eager mode on detached
    inputs and differentiates it with ``torch.autograd.grad``; the gradients are still the eager
    ones, for one more forward. Operator implementations run beneath autograd's dispatch keys;
    that recompute turns them back on (:func:`_autograd_dispatch`), as ``torch.utils.checkpoint``
    does for its views. With dropout the forward returns the RNG states (CPU, then the inputs'
    device) from before its draw (``rng_state``) and the recompute replays them inside
    ``torch.random.fork_rng``, so it draws the same mask and the caller's RNG stream is left as
    the forward left it: compiled and eager calls from one seed give the same output and
    gradients. The dense and dilated operators are tagged ``nondeterministic_seeded`` with a
    ``dropout_p`` argument, so the compiler neither merges two calls nor recomputes one when
    ``dropout_p > 0``.

    CUDA graphs (``torch.compile(mode="reduce-overhead")``): without dropout both operators
    read and write the inputs' device only (``rng_state`` is then an empty tensor there; Inductor
    leaves an operator touching two devices out of its graphs), and nothing of a call outlives
    it but its results (the trees refuse a tensor of their memory pool that no output tracks).

    Not supported, with an error that says so: gradients of gradients through the operators
    (torch.func.grad of torch.func.grad, or a double backward of a torch.func.vjp; eager
    autograd supports them, Note [Double backward]), forward-mode AD (torch.func.jvp), dropout
    under ``torch.func.vmap`` unless ``randomness="different"``, ``torch.jit.trace`` (use
    ``torch.compile`` or ``torch.export``), and block-sparse attention on a pattern under
    ``torch.export`` (the pattern does not survive serialization; a run-time mask, a tensor
    input, does). The ring functions communicate between ranks
    from Python: ``torch.compile`` runs them eagerly between graphs (so ``fullgraph=True``
    raises, with the reason), and torch.func and ``torch.jit.trace`` raise
    (``tracing.eager_only``).

    ``torch.func.vmap`` folds the mapped dimension into the batch dimension (dim 0 of every input
    is the batch), runs the operator once, and unfolds the results (``vmap.py``).

Shape legend: B batch, Nq/Nk query/key tokens (N when equal), H query heads, Hkv key/value heads,
D head dim.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..core.autograd import Backward
from ..core.execution.call_runs import accumulator_dtype
from ..core.hidden import hide_masked_keys
from ..core.higher_order import RaiseOnBackward
from ..resolve import execute, kept_or_resolved
from .options import DROPOUT_INDEX, MASK_NAME, OPTIONS, PUBLIC_NAME, dropout_p, request_of
from .tracing import eager_calls, wrapped
from .vmap import backward_rule, forward_rule

__all__ = ["call"]

_NAMESPACE = "dilated_attention"
_TENSORS = "Tensor query, Tensor key, Tensor value, Tensor? {mask}"


# -- running the eager functions inside the operators -------------------------------------------
def _get_rng_state(device: torch.device) -> torch.Tensor:
    """The CPU generator's state, then ``device``'s (uint8): kernels on ``device`` draw from its
    generator, and the ``math`` kernel draws its dropout seed from the CPU one."""
    cpu = torch.get_rng_state()
    if device.type == "cpu":
        return cpu
    return torch.cat([cpu, getattr(torch, device.type).get_rng_state(device)])


def _rng_state_numel(device: torch.device) -> int:
    """The size of :func:`_get_rng_state` (no tensor op: it runs under fake tensors too)."""
    numel = torch.get_rng_state().numel()
    if device.type != "cpu":
        numel += getattr(torch, device.type).get_rng_state(device).numel()
    return numel


@contextlib.contextmanager
def _replayed_rng(state: torch.Tensor, device: torch.device) -> Iterator[None]:
    """Run with the generators set to ``state`` (from :func:`_get_rng_state`); restore the
    caller's states after."""
    if state.numel() == 0:
        yield
        return
    cpu_numel = torch.get_rng_state().numel()
    if device.type == "cpu":
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(state)
            yield
        return
    module = getattr(torch, device.type)
    index = device.index if device.index is not None else module.current_device()
    with torch.random.fork_rng(devices=[index], device_type=device.type):
        torch.set_rng_state(state[:cpu_numel].clone())
        module.set_rng_state(state[cpu_numel:].clone(), index)
        yield


@contextlib.contextmanager
def _autograd_dispatch() -> Iterator[None]:
    """Autograd's dispatch keys back on, inside an operator implementation (which runs beneath
    them), so that the eager recompute records a graph (Note [Custom operators for
    torch.compile and torch.func])."""
    with contextlib.ExitStack() as stack:
        for key in (
            torch._C.DispatchKey.AutogradFunctionality,
            torch._C.DispatchKey.AutogradOther,
            torch._C.DispatchKey.ADInplaceOrView,
        ):
            stack.enter_context(torch._C._SetExcludeDispatchKeyGuard(key, False))
        yield


def _fresh(
    results: Sequence[torch.Tensor], others: Sequence[torch.Tensor | None]
) -> list[torch.Tensor]:
    """Each of ``results`` contiguous and sharing memory with none of ``others`` nor with each
    other (an operator's outputs may not alias its inputs or each other; empty results, e.g. of
    a batch of 0, are always copied). The memory of ``others`` is read once for all of them."""
    taken = {t.untyped_storage().data_ptr() for t in others if t is not None and t.numel()}
    fresh: list[torch.Tensor] = []
    for x in results:
        x = x.contiguous()
        if x.numel() == 0 or x.untyped_storage().data_ptr() in taken:
            x = x.clone()
        if x.numel():
            taken.add(x.untyped_storage().data_ptr())
        fresh.append(x)
    return fresh


def _forward_impl(kind: str, *args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v, mask, *options = args
    if dropout_p(kind, options) > 0:
        rng_state = _get_rng_state(q.device)
    else:  # on the inputs' device: an operator on one device is one CUDA graphs capture
        rng_state = torch.empty(0, dtype=torch.uint8, device=q.device)
    # No graph, nothing kept but the results: the backward starts from them. The request needs
    # gradients exactly when the traced call did (the eager kernel choice depends on it).
    with torch.no_grad(), eager_calls():
        out, lse = execute(request_of(kind, q, k, v, mask, options), q, k, v, mask)
    out, lse = _fresh((out, lse.to(accumulator_dtype(q.dtype))), (q, k, v, mask))
    return out, lse, rng_state


def _forward_fake(kind: str, *args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, _, _, _, *options = args
    batch, length, heads, _ = q.shape
    out = q.new_empty(q.shape)
    lse = q.new_empty((batch, heads, length), dtype=accumulator_dtype(q.dtype))
    if dropout_p(kind, options) > 0:
        rng_state = torch.empty(_rng_state_numel(q.device), dtype=torch.uint8, device="cpu")
    else:
        rng_state = q.new_empty(0, dtype=torch.uint8)
    return out, lse, rng_state


_Grads = tuple[torch.Tensor | None, ...]


def _runner_backward(
    kind: str,
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    options: Sequence[Any],
) -> _Grads | None:
    """dq, dk, dv from the runner's backward on the forward's ``out`` and ``lse``, as eager
    autograd takes them (Note [Backward without the forward] in ``core/autograd.py``); None
    where the runner needs its forward's state."""
    request = request_of(kind, q, k, v, mask, options)
    if request.empty:
        return None
    strategy = kept_or_resolved(request)
    padding = request.key_padding_mask(mask)  # Note [The call's mask tensor]
    hidden_k, hidden_v = hide_masked_keys(k, v, padding)  # as resolve.execute runs the call
    prepared = strategy.prepare(q, hidden_k, hidden_v, mask)
    if prepared is None:
        return None
    runner, x = prepared
    saved = runner.saved_without_forward(x)
    if saved is None:
        return None
    dq, dk, dv = runner.backward(Backward(grad_out, x.q, out, lse, saved, None))
    # Through hide_masked_keys, a masked_fill: its gradient is the same fill of the gradient.
    dk, dv = hide_masked_keys(dk, dv, padding)
    return dq, dk, dv


def _recomputed_backward(
    kind: str,
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    rng_state: torch.Tensor,
    options: Sequence[Any],
) -> _Grads:
    """dq, dk, dv from the forward run again, its RNG state replayed, and differentiated."""
    with _autograd_dispatch(), torch.enable_grad(), _replayed_rng(rng_state, q.device):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        with eager_calls():
            out, _ = execute(request_of(kind, *leaves, mask, options), *leaves, mask)
        return torch.autograd.grad(out, leaves, grad_out, allow_unused=True)


def _backward_impl(kind: str, *args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grad_out, q, k, v, mask, out, lse, rng_state, *options = args
    grads = None
    if options[-1]:  # the forward ran the request that needs gradients: its runner's
        with torch.no_grad(), eager_calls():
            grads = _runner_backward(kind, grad_out, q, k, v, mask, out, lse, options)
    if grads is None:
        needs_grad = [*options[:-1], True]
        grads = _recomputed_backward(kind, grad_out, q, k, v, mask, rng_state, needs_grad)
    # An input the call did not use (a kernel skipping empty work) has a gradient of zeros.
    results = [
        torch.zeros_like(x, memory_format=torch.contiguous_format) if grad is None else grad
        for grad, x in zip(grads, (q, k, v), strict=True)
    ]
    dq, dk, dv = _fresh(results, (grad_out, q, k, v, mask, out, lse))
    return dq, dk, dv


def _backward_fake(kind: str, *args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _, q, k, v, *_ = args
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# -- the operators ------------------------------------------------------------------------------
def _second_order_message(kind: str) -> str:
    return (
        f"{PUBLIC_NAME[kind]} under torch.compile / torch.export / torch.func has first-order "
        "gradients only: its custom operator's backward is not differentiable again. For a "
        "gradient penalty, Hessian or other higher-order gradient, run it in eager mode with "
        "torch.autograd.grad(..., create_graph=True), which supports double backward"
    )


def _define(kind: str) -> tuple[Any, Any]:
    """Define, implement and differentiate ``dilated_attention::{kind}`` and its backward."""
    options, tensors = OPTIONS[kind], _TENSORS.format(mask=MASK_NAME[kind])
    tags = (torch.Tag.nondeterministic_seeded,) if DROPOUT_INDEX[kind] is not None else ()

    def forward_impl(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _forward_impl(kind, *args)

    def backward_impl(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _backward_impl(kind, *args)

    forward = torch.library.custom_op(
        f"{_NAMESPACE}::{kind}",
        forward_impl,
        mutates_args=(),
        schema=f"({tensors}, {options}) -> (Tensor, Tensor, Tensor)",
        tags=tags,
    )
    backward = torch.library.custom_op(
        f"{_NAMESPACE}::{kind}_backward",
        backward_impl,
        mutates_args=(),
        schema=(
            f"(Tensor grad_out, {tensors}, Tensor out, Tensor lse, Tensor rng_state, "
            f"{options}) -> (Tensor, Tensor, Tensor)"
        ),
        tags=tags,
    )
    forward.register_fake(lambda *args: _forward_fake(kind, *args))
    backward.register_fake(lambda *args: _backward_fake(kind, *args))

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
        q, k, v, mask, *opts = inputs
        ctx.save_for_backward(q, k, v, mask, *output)  # output: out, lse, rng_state
        ctx.options = opts
        ctx.mark_non_differentiable(output[1], output[2])

    def differentiate(ctx: Any, grad_out: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        dq, dk, dv = backward(grad_out, *ctx.saved_tensors, *ctx.options)
        return (dq, dk, dv) + (None,) * (1 + len(ctx.options))

    def no_second_order(ctx: Any, *_: Any) -> tuple[Any, ...]:
        raise RuntimeError(_second_order_message(kind))

    def no_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    forward.register_autograd(differentiate, setup_context=setup_context)
    backward.register_autograd(no_second_order, setup_context=no_context)
    torch.library.register_vmap(forward, forward_rule(forward, kind))
    torch.library.register_vmap(backward, backward_rule(backward, kind))
    return forward, backward


_OPS = {kind: _define(kind) for kind in OPTIONS}


# -- torch.func ------------------------------------------------------------------------------------
class _TransformedCall(torch.autograd.Function):
    """A forward operator under torch.func transforms, whose autograd needs ``setup_context``
    (a custom operator's own ``register_autograd`` does not provide it).

    ``apply(kind, q, k, v, key_padding_mask, *options) -> (out, lse, rng_state)``, as the
    operator; q: (B, Nq, H, D), k, v: (B, Nk, Hkv, D), key_padding_mask: (B, Nk) or None.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(kind: str, *args: Any) -> Any:  # type: ignore[override]
        return _OPS[kind][0](*args)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        kind, q, k, v, mask, *options = inputs
        ctx.save_for_backward(q, k, v, mask, *output)  # output: out, lse, rng_state
        ctx.kind, ctx.options = kind, options
        ctx.mark_non_differentiable(output[1], output[2])

    @staticmethod
    def jvp(ctx: Any, *_: Any) -> Any:
        raise RuntimeError(
            f"{PUBLIC_NAME[ctx.kind]} does not support forward-mode AD (torch.func.jvp, "
            "torch.func.jacfwd, torch.autograd.forward_ad): its kernels have no forward "
            "derivative. Use reverse mode: torch.func.vjp, torch.func.jacrev or torch.func.grad"
        )

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, *_: Any) -> tuple[Any, ...]:  # type: ignore[override]
        # Differentiating these gradients raises the second-order error (Note [Custom operators
        # for torch.compile and torch.func]).
        dq, dk, dv = RaiseOnBackward.apply(
            _second_order_message(ctx.kind), _OPS[ctx.kind][1], grad_out, *ctx.saved_tensors,
            *ctx.options,
        )  # fmt: skip
        return (None, dq, dk, dv) + (None,) * (1 + len(ctx.options))


def call(kind: str, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of operator ``kind`` on ``(q, k, v, key_padding_mask, *options)``."""
    if not torch.compiler.is_compiling() and wrapped(args[:4]):
        out, lse, _ = _TransformedCall.apply(kind, *args)
    else:
        out, lse, _ = _OPS[kind][0](*args)
    return out, lse
