"""``torch.compile``, ``torch.export`` and ``torch.func`` support: the public functions as custom
operators.

Note [Custom operators for torch.compile and torch.func]
    An eager call chooses a kernel (selection probes kernels and caches its answers), builds a
    plan of kernel calls (pure Python, cached) and runs it under one ``torch.autograd.Function``
    whose context holds Python objects (the plan, the kernel, each call's ``aux``). None of that
    can be traced: Dynamo stops at the choice, and torch.func needs Functions with
    ``setup_context``. So when Dynamo traces a call (``torch.compile``, ``torch.export``) or an
    input is wrapped by a torch.func transform (:func:`is_traced`), the public function checks
    its arguments as usual (plain Python on shapes, dtypes and devices: it traces without graph
    breaks) and then calls one of these operators, which the tracers keep opaque:

        dilated_attention::dense          attention()
        dilated_attention::dilated        dilated_attention()
        dilated_attention::block_sparse   block_sparse_attention()

    Each takes ``query, key, value, key_padding_mask`` and the call's options as ints, floats,
    bools and strings (a block-sparse pattern as an int key: Note [Patterns as operator arguments]
    in :mod:`dilated_attention.pattern_keys`), and returns ``(out, lse, rng_state)``: ``out`` (B,
    Nq, H, D) in the input dtype and ``lse`` (B, H, Nq) float32 (float64 for float64 inputs), both
    contiguous, as the fake implementation promises, and ``rng_state`` (below). The real
    implementation is the eager function itself, run with gradients enabled exactly when the
    traced call needed them, so the same kernel is chosen and the result is the eager result.

    Gradients: each operator has a backward operator that recomputes the forward in eager mode on
    detached inputs and differentiates it with ``torch.autograd.grad``. The gradients are the
    eager ones (the library's exact gradients, Note [Exact gradients through the branch mix]);
    the price is one more forward per backward (the kernels' backward needs each call's ``aux``
    and plan, which cannot cross an operator boundary). Operator implementations run beneath
    autograd's dispatch keys; the recompute turns them back on (:func:`_autograd_dispatch`), as
    ``torch.utils.checkpoint`` does for its views. With dropout the forward returns the RNG
    states (CPU, then the inputs' device) from before its draw (``rng_state``; empty without
    dropout) and the backward replays them inside ``torch.random.fork_rng``, so the recompute
    draws the same mask and the caller's RNG stream is left as the forward left it: compiled
    and eager calls from one seed give the same output and gradients. The dense and dilated
    operators are tagged ``nondeterministic_seeded`` with a ``dropout_p`` argument, so the
    compiler neither merges two calls nor recomputes one when ``dropout_p > 0``.

    Not supported, with an error that says so: gradients of gradients through the operators
    (torch.func.grad of torch.func.grad, or a double backward of a torch.func.vjp; eager
    autograd supports them, Note [Double backward]), forward-mode AD (torch.func.jvp), dropout
    under ``torch.func.vmap`` unless ``randomness="different"``, ``torch.jit.trace`` (use
    ``torch.compile`` or ``torch.export``), and block-sparse attention under ``torch.export``
    (its pattern does not survive serialization). The ring functions communicate between ranks
    from Python: ``torch.compile`` runs them eagerly between graphs (so ``fullgraph=True``
    raises, with the reason), and torch.func and ``torch.jit.trace`` raise (:func:`eager_only`).

    ``torch.func.vmap`` folds the mapped dimension into the batch dimension (dim 0 of every input
    is the batch), runs the operator once, and unfolds the results.

Shape legend: B batch, Nq/Nk query/key tokens (N when equal), H query heads, Hkv key/value heads,
D head dim, V the size of a vmapped dimension.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from .core.call_runs import accumulator_dtype
from .core.higher_order import RaiseOnBackward
from .core.schedule import Schedule
from .pattern_keys import pattern_key, pattern_of
from .resolve import BLOCK_SPARSE, DECODE, DENSE, DILATED, Request, dilated_operation, execute

__all__ = ["eager_only", "is_traced", "pattern_key", "reject_traced", "route", "run"]

_NAMESPACE = "dilated_attention"
_TENSORS = "Tensor query, Tensor key, Tensor value, Tensor? key_padding_mask"
#: Each operator's options after the tensors, in the eager function's terms. ``requires_grad``
#: (last) is whether the traced call needed gradients: the eager kernel choice depends on it.
_OPTIONS = {
    "dense": "bool is_causal, float? scale, float dropout_p, str? backend, bool requires_grad",
    "dilated": (
        "int[] segment_lengths, int[] dilation_rates, bool is_causal, float? scale, "
        "float dropout_p, str? backend, bool requires_grad"
    ),
    "block_sparse": (
        "int pattern, int block_size, bool is_causal, float? scale, str? backend, "
        "bool requires_grad"
    ),
}
#: Where ``dropout_p`` sits among an operator's options (None: the operator has no dropout).
_DROPOUT_INDEX = {"dense": 2, "dilated": 4, "block_sparse": None}
_PUBLIC_NAME = {
    "dense": "attention",
    "dilated": "dilated_attention",
    "block_sparse": "block_sparse_attention",
}


# -- when to use the operators --------------------------------------------------------------------
_LOCAL = threading.local()


@contextlib.contextmanager
def _eager_calls() -> Iterator[None]:
    """Inside an operator's implementation: the public functions run eagerly (no re-routing)."""
    previous = getattr(_LOCAL, "eager", False)
    _LOCAL.eager = True
    try:
        yield
    finally:
        _LOCAL.eager = previous


def _wrapped(tensors: Sequence[torch.Tensor | None]) -> bool:
    is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    return any(t is not None and is_wrapped(t) for t in tensors)


def is_traced(*tensors: torch.Tensor | None) -> bool:
    """Whether a public function must run through the custom operators.

    True while Dynamo traces the call (``torch.compile``, ``torch.export``) and when a torch.func
    transform wraps one of ``tensors``, except inside an operator's own implementation.

    Raises:
        RuntimeError: under ``torch.jit.trace``, which cannot record the library's Python
            control flow; the message names ``torch.compile`` and ``torch.export``.
    """
    if torch.compiler.is_compiling():
        return True
    if getattr(_LOCAL, "eager", False):
        return False
    if torch.jit.is_tracing():
        raise RuntimeError(
            "dilated_attention's attention functions do not support torch.jit.trace: kernel "
            "selection, planning and the branch merge are Python control flow that a trace "
            "would freeze to the example inputs' shapes and kernel. Use torch.compile(model) "
            "(fullgraph=True works), or torch.export.export(model, args) for an exported "
            "graph; both keep the attention as one custom operator"
        )
    return _wrapped(tensors)


def _ring_reason(what: str) -> str:
    return (
        f"{what} communicates between ranks from Python (an agreement on every call, then the "
        "ring steps), which cannot be captured in a graph: compile without fullgraph=True, and "
        "Dynamo runs the ring call eagerly between the compiled graphs"
    )


def reject_traced(what: str, *tensors: object) -> None:
    """Raise a clear error when the ring function ``what`` runs under a torch.func transform or
    ``torch.jit.trace`` (``torch.compile`` never traces it: :func:`eager_only`).

    Raises:
        RuntimeError: a tensor among ``tensors`` is wrapped by a torch.func transform, or
            ``torch.jit.trace`` is tracing.
    """
    if torch.jit.is_tracing():
        raise RuntimeError(f"{what} does not support torch.jit.trace: {_ring_reason(what)}")
    if _wrapped([t for t in tensors if isinstance(t, torch.Tensor)]):
        raise RuntimeError(
            f"{what} does not support torch.func transforms (grad, vjp, vmap, jacrev, ...): its "
            "calls communicate between ranks from Python and its backward exchanges gradients "
            "around the ring, which the transforms cannot capture. Use torch.autograd "
            "(loss.backward() or torch.autograd.grad) for the local shards' gradients"
        )


_F = TypeVar("_F", bound=Callable[..., Any])


def eager_only(what: str) -> Callable[[_F], _F]:
    """Decorate a ring function: ``torch.compile`` runs it eagerly between graphs (with
    ``fullgraph=True`` Dynamo raises, naming the reason), and torch.func transforms and
    ``torch.jit.trace`` raise :func:`reject_traced`'s error."""

    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def checked(*args: Any, **kwargs: Any) -> Any:
            reject_traced(what, *args, *kwargs.values())
            return fn(*args, **kwargs)

        return torch.compiler.disable(checked, reason=_ring_reason(what))  # type: ignore[return-value]

    return decorate


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


def _eager(
    kind: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    options: Sequence[Any],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager ``(out, lse)`` of operator ``kind``'s call: its request, resolved and run as
    the public function runs it; q: (B, Nq, H, D), k, v: (B, Nk, Hkv, D)."""
    with _eager_calls():
        return execute(_request(kind, q, k, v, mask, options), q, k, v, mask)


def _request(
    kind: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    options: Sequence[Any],
) -> Request:
    """The request an operator's options describe (the inverse of :func:`_options`)."""
    if kind == "dense":
        is_causal, scale, dropout_p, backend, _ = options
        return Request.of(
            DENSE, q, k, v, is_causal=is_causal, has_mask=mask is not None,
            dropout_p=dropout_p, scale=scale, backend=backend,
        )  # fmt: skip
    if kind == "dilated":
        segs, rates, is_causal, scale, dropout_p, backend, _ = options
        return Request.of(
            dilated_operation(q.shape[1], k.shape[1]), q, k, v, is_causal=is_causal,
            has_mask=mask is not None, dropout_p=dropout_p, scale=scale, backend=backend,
            schedule=Schedule(tuple(segs), tuple(rates)),
        )  # fmt: skip
    key, block_size, is_causal, scale, backend, _ = options
    return Request.of(
        BLOCK_SPARSE, q, k, v, pattern=pattern_of(key), block_size=block_size,
        is_causal=is_causal, scale=scale, backend=backend,
    )  # fmt: skip


def _fresh(x: torch.Tensor, others: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """``x`` contiguous and sharing memory with none of ``others`` (an operator's outputs may not
    alias its inputs or each other; empty results, e.g. of a batch of 0, are always copied)."""
    x = x.contiguous()
    memory = x.untyped_storage().data_ptr()
    if x.numel() == 0 or any(
        t is not None and t.numel() and t.untyped_storage().data_ptr() == memory for t in others
    ):
        x = x.clone()
    return x


def _dropout_p(kind: str, options: Sequence[Any]) -> float:
    index = _DROPOUT_INDEX[kind]
    return 0.0 if index is None else float(options[index])


def _forward_impl(kind: str, *args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v, mask, *options = args
    requires_grad = bool(options[-1])
    if _dropout_p(kind, options) > 0:
        rng_state = _get_rng_state(q.device)
    else:
        rng_state = torch.empty(0, dtype=torch.uint8, device="cpu")
    # Gradients on exactly when the traced call needed them: the eager choice of kernel depends
    # on it (and with dropout the backward's recompute must draw from the same kernel).
    grad_mode = _autograd_dispatch() if requires_grad else contextlib.nullcontext()
    with grad_mode, torch.set_grad_enabled(requires_grad):
        leaves = [x.detach().requires_grad_(requires_grad) for x in (q, k, v)]
        out, lse = _eager(kind, *leaves, mask, options)
    out = _fresh(out.detach(), (q, k, v, mask))
    return out, _fresh(lse.detach().to(accumulator_dtype(q.dtype)), (q, k, v, mask, out)), rng_state


def _forward_fake(kind: str, *args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, _, _, _, *options = args
    batch, length, heads, _ = q.shape
    out = q.new_empty(q.shape)
    lse = q.new_empty((batch, heads, length), dtype=accumulator_dtype(q.dtype))
    numel = _rng_state_numel(q.device) if _dropout_p(kind, options) > 0 else 0
    return out, lse, torch.empty(numel, dtype=torch.uint8, device="cpu")


def _backward_impl(kind: str, *args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grad_out, q, k, v, mask, rng_state, *options = args
    with _autograd_dispatch(), torch.enable_grad(), _replayed_rng(rng_state, q.device):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out, _ = _eager(kind, *leaves, mask, options)
        grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
    results: list[torch.Tensor] = []
    for grad, x in zip(grads, (q, k, v), strict=True):
        if grad is None:  # an input the call did not use (a kernel skipping empty work)
            results.append(torch.zeros_like(x, memory_format=torch.contiguous_format))
        else:
            results.append(_fresh(grad, (grad_out, q, k, v, mask, *results)))
    dq, dk, dv = results
    return dq, dk, dv


def _backward_fake(kind: str, *args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _, q, k, v, *_ = args
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# -- vmap: fold the mapped dimension into the batch ------------------------------------------------
def _fold(x: torch.Tensor | None, dim: int | None, size: int) -> torch.Tensor | None:
    """(..V at dim.., B, ...) or unmapped (B, ...) -> (V * B, ...)."""
    if x is None:
        return None
    x = x.movedim(dim, 0) if dim is not None else x.unsqueeze(0).expand(size, *x.shape)
    return x.reshape(size * x.shape[1], *x.shape[2:])


def _unfold(x: torch.Tensor, size: int) -> torch.Tensor:
    """(V * B, ...) -> (V, B, ...)."""
    return x.view(size, x.shape[0] // size, *x.shape[1:])


def _check_vmap(kind: str, info: Any, options: Sequence[Any]) -> None:
    if _dropout_p(kind, options) > 0 and info.randomness != "different":
        raise RuntimeError(
            f"{_PUBLIC_NAME[kind]} with dropout_p > 0 under torch.func.vmap needs "
            f"randomness='different' (each mapped element draws its own dropout mask), got "
            f"randomness={info.randomness!r}; pass torch.func.vmap(..., randomness='different'), "
            "or dropout_p=0 (module.eval())"
        )


def _forward_vmap(op: Any, kind: str) -> Callable[..., Any]:
    def rule(info: Any, in_dims: Sequence[int | None], *args: Any) -> tuple[Any, Any]:
        _check_vmap(kind, info, args[4:])
        size = info.batch_size
        tensors = [_fold(x, d, size) for x, d in zip(args[:4], in_dims[:4], strict=True)]
        out, lse, rng_state = op(*tensors, *args[4:])
        return (_unfold(out, size), _unfold(lse, size), rng_state), (0, 0, None)

    return rule


def _backward_vmap(op: Any, kind: str) -> Callable[..., Any]:
    def rule(info: Any, in_dims: Sequence[int | None], *args: Any) -> tuple[Any, Any]:
        if in_dims[5] is not None:
            raise RuntimeError(
                f"torch.func.vmap over the backward of {_PUBLIC_NAME[kind]}: the dropout RNG "
                "state cannot be mapped; map over the forward too"
            )
        _check_vmap(kind, info, args[6:])
        size = info.batch_size
        tensors = [_fold(x, d, size) for x, d in zip(args[:5], in_dims[:5], strict=True)]
        grads = op(*tensors, args[5], *args[6:])
        return tuple(_unfold(g, size) for g in grads), (0, 0, 0)

    return rule


# -- the operators ------------------------------------------------------------------------------
def _second_order_message(kind: str) -> str:
    return (
        f"{_PUBLIC_NAME[kind]} under torch.compile / torch.export / torch.func has first-order "
        "gradients only: its custom operator's backward is not differentiable again. For a "
        "gradient penalty, Hessian or other higher-order gradient, run it in eager mode with "
        "torch.autograd.grad(..., create_graph=True), which supports double backward"
    )


def _define(kind: str) -> tuple[Any, Any]:
    """Define, implement and differentiate ``dilated_attention::{kind}`` and its backward."""
    options = _OPTIONS[kind]
    tags = (torch.Tag.nondeterministic_seeded,) if _DROPOUT_INDEX[kind] is not None else ()

    def forward_impl(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _forward_impl(kind, *args)

    def backward_impl(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _backward_impl(kind, *args)

    forward = torch.library.custom_op(
        f"{_NAMESPACE}::{kind}",
        forward_impl,
        mutates_args=(),
        schema=f"({_TENSORS}, {options}) -> (Tensor, Tensor, Tensor)",
        tags=tags,
    )
    backward = torch.library.custom_op(
        f"{_NAMESPACE}::{kind}_backward",
        backward_impl,
        mutates_args=(),
        schema=(
            f"(Tensor grad_out, {_TENSORS}, Tensor rng_state, {options}) -> "
            "(Tensor, Tensor, Tensor)"
        ),
        tags=tags,
    )
    forward.register_fake(lambda *args: _forward_fake(kind, *args))
    backward.register_fake(lambda *args: _backward_fake(kind, *args))

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
        q, k, v, mask, *opts = inputs
        ctx.save_for_backward(q, k, v, mask, output[2])
        ctx.options = opts
        ctx.mark_non_differentiable(output[1], output[2])

    def differentiate(ctx: Any, grad_out: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        q, k, v, mask, rng_state = ctx.saved_tensors
        dq, dk, dv = backward(grad_out, q, k, v, mask, rng_state, *ctx.options)
        return (dq, dk, dv) + (None,) * (1 + len(ctx.options))

    def no_second_order(ctx: Any, *_: Any) -> tuple[Any, ...]:
        raise RuntimeError(_second_order_message(kind))

    def no_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    forward.register_autograd(differentiate, setup_context=setup_context)
    backward.register_autograd(no_second_order, setup_context=no_context)
    torch.library.register_vmap(forward, _forward_vmap(forward, kind))
    torch.library.register_vmap(backward, _backward_vmap(backward, kind))
    return forward, backward


_OPS = {kind: _define(kind) for kind in _OPTIONS}


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
        ctx.save_for_backward(q, k, v, mask, output[2])
        ctx.kind, ctx.options = kind, options
        ctx.mark_non_differentiable(output[1], output[2])

    @staticmethod
    def jvp(ctx: Any, *_: Any) -> Any:
        raise RuntimeError(
            f"{_PUBLIC_NAME[ctx.kind]} does not support forward-mode AD (torch.func.jvp, "
            "torch.func.jacfwd, torch.autograd.forward_ad): its kernels have no forward "
            "derivative. Use reverse mode: torch.func.vjp, torch.func.jacrev or torch.func.grad"
        )

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, *_: Any) -> tuple[Any, ...]:  # type: ignore[override]
        q, k, v, mask, rng_state = ctx.saved_tensors
        # Differentiating these gradients raises the second-order error (Note [Custom operators
        # for torch.compile and torch.func]).
        dq, dk, dv = RaiseOnBackward.apply(
            _second_order_message(ctx.kind), _OPS[ctx.kind][1], grad_out, q, k, v, mask,
            rng_state, *ctx.options,
        )  # fmt: skip
        return (None, dq, dk, dv) + (None,) * (1 + len(ctx.options))


def _call(kind: str, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of operator ``kind`` on ``(q, k, v, key_padding_mask, *options)``."""
    if not torch.compiler.is_compiling() and _wrapped(args[:4]):
        out, lse, _ = _TransformedCall.apply(kind, *args)
    else:
        out, lse, _ = _OPS[kind][0](*args)
    return out, lse


def _options(request: Request) -> tuple[str, list[Any]]:
    """Operator and options of a request (the inverse of :func:`_request`); the last option is
    whether the call needs gradients (the eager kernel choice depends on it)."""
    r = request
    if r.operation == DENSE:
        return "dense", [r.is_causal, r.scale, r.dropout_p, r.backend, r.requires_grad]
    if r.operation in (DILATED, DECODE):
        assert r.schedule is not None
        return "dilated", [
            list(r.schedule.segment_lengths), list(r.schedule.dilation_rates), r.is_causal,
            r.scale, r.dropout_p, r.backend, r.requires_grad,
        ]  # fmt: skip
    assert r.pattern is not None
    if torch.compiler.is_exporting():
        raise RuntimeError(
            "block_sparse_attention cannot be exported (torch.export): its pattern is a Python "
            "object that reaches the compiled operator as a key into this process's table, "
            "which a saved program cannot carry. Use torch.compile in the process that runs the "
            "model, or export dense or dilated attention"
        )
    return "block_sparse", [
        pattern_key(r.pattern),
        r.block_size,
        r.is_causal,
        r.scale,
        r.backend,
        r.requires_grad,
    ]


def run(
    request: Request,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A checked request through its operator (Note [Custom operators for torch.compile and
    torch.func]).

    Args:
        request: the call, as the public function described it.
        q: (B, Nq, H, D); k, v: (B, Nk, Hkv, D); key_padding_mask: (B, Nk) bool or None.

    Returns:
        ``out`` (B, Nq, H, D) and ``lse`` (B, H, Nq), not differentiable.

    Raises:
        RuntimeError: block-sparse attention under ``torch.export``: its pattern is a key into
            this process's table (Note [Patterns as operator arguments]).
    """
    kind, options = _options(request)
    return _call(kind, q, k, v, key_padding_mask, *options)


def route(
    request: Request,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    return_lse: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Run a checked request: through its operator where a tracer or a torch.func transform
    sees the call (:func:`is_traced`), else resolved and run eagerly (``resolve.execute``).

    Args:
        request: the call, as the public function described it.
        q: (B, Nq, H, D); k, v: (B, Nk, Hkv, D); key_padding_mask: (B, Nk) bool or None.
        return_lse: also return the merged log-sum-exp; sinks: (H,) attention sinks, or None.

    Returns:
        ``out`` (B, Nq, H, D), or ``(out, lse)`` with ``lse`` (B, H, Nq) detached.
    """
    if is_traced(q, k, v, key_padding_mask, sinks):
        request.check_traceable()
        out, lse = run(request, q, k, v, key_padding_mask)
    else:
        out, lse = execute(request, q, k, v, key_padding_mask, sinks)
    return (out, lse) if return_lse else out
