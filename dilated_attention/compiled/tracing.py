"""When a public function runs through the custom operators (:func:`is_traced`), and the ring
functions' refusals of what cannot trace them (:func:`eager_only`, :func:`reject_traced`).

Note [Custom operators for torch.compile and torch.func] in ``operators.py`` says why.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

__all__ = ["eager_calls", "eager_only", "is_traced", "reject_traced", "wrapped"]


class _Local(threading.local):
    """This thread's state: inside an operator's implementation (:func:`eager_calls`)."""

    #: Read on every public call: a class default, so reading it never misses an attribute.
    eager = False


_LOCAL = _Local()


@contextlib.contextmanager
def eager_calls() -> Iterator[None]:
    """Inside an operator's implementation: the public functions run eagerly (no re-routing)."""
    previous = _LOCAL.eager
    _LOCAL.eager = True
    try:
        yield
    finally:
        _LOCAL.eager = previous


def wrapped(tensors: Sequence[torch.Tensor | None]) -> bool:
    """Whether a torch.func transform wraps one of ``tensors``."""
    is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    for t in tensors:  # noqa: SIM110 (a loop, not any() over a generator: every call asks)
        if t is not None and is_wrapped(t):
            return True
    return False


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
    if _LOCAL.eager:
        return False
    if torch.jit.is_tracing():
        raise RuntimeError(
            "dilated_attention's attention functions do not support torch.jit.trace: kernel "
            "selection, planning and the branch merge are Python control flow that a trace "
            "would freeze to the example inputs' shapes and kernel. Use torch.compile(model) "
            "(fullgraph=True works), or torch.export.export(model, args) for an exported "
            "graph; both keep the attention as one custom operator"
        )
    return wrapped(tensors)


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
    if wrapped([t for t in tensors if isinstance(t, torch.Tensor)]):
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
