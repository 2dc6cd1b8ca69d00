"""Where a checked request runs: eagerly (``resolve.execute``), or through its custom operator
where a tracer or a torch.func transform sees the call (Note [Custom operators for
torch.compile and torch.func] in ``operators.py``).

Shape legend: B batch, Nq/Nk query/key tokens, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.autograd import Inputs
from ..decode_step import traced_step
from ..resolve import Request, execute
from ..resolve.caches import window_step
from .operators import call
from .options import options_of
from .tracing import is_traced

__all__ = ["route", "run"]


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
        q: (B, Nq, H, D); k, v: (B, Nk, Hkv, D); key_padding_mask: the call's mask tensor
            (Note [The call's mask tensor] in ``resolve/request.py``): (B, Nk) bool, a
            run-time block mask, or None.

    Returns:
        ``out`` (B, Nq, H, D) and ``lse`` (B, H, Nq), not differentiable.

    Raises:
        RuntimeError: block-sparse attention under ``torch.export``: its pattern is a key into
            this process's table (Note [Patterns as operator arguments]).
    """
    kind, options = options_of(request)
    return call(kind, q, k, v, key_padding_mask, *options)


def route(
    request: Request,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    return_lse: bool = False,
    sinks: torch.Tensor | None = None,
    cache: Any = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Run a checked request: through its operator where a tracer or a torch.func transform
    sees the call (:func:`is_traced`), else resolved and run eagerly (``resolve.execute``).

    Args:
        request: the call, as the public function described it.
        q: (B, Nq, H, D); k, v: (B, Nk, Hkv, D); key_padding_mask: the call's mask tensor
            (Note [The call's mask tensor] in ``resolve/request.py``): (B, Nk) bool, a
            run-time block mask, or None.
        return_lse: also return the merged log-sum-exp; sinks: (H,) attention sinks, or None.
        cache: the decoding cache ``request.cache`` names (Note [A cache call is one request]
            in ``resolve/caches.py``), or None.

    Returns:
        ``out`` (B, Nq, H, D), or ``(out, lse)`` with ``lse`` (B, H, Nq) detached.

    Raises:
        ValueError: under a tracer, what its operators cannot run (packed documents, a window,
            soft-capping or sinks, a cache call other than a static cache's step), before any
            work.
    """
    if is_traced(q, k, v, key_padding_mask, sinks):
        out, lse = _traced(request, Inputs(q, k, v, key_padding_mask), sinks, cache)
    else:
        out, lse = execute(request, q, k, v, key_padding_mask, sinks, cache)
    return (out, lse) if return_lse else out


def _traced(
    request: Request, new: Inputs, sinks: torch.Tensor | None, cache: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """A checked call seen by a tracer: through its operator; packed documents refused, a
    cache call as :func:`_traced_cache_call` runs it."""
    if request.documents is not None:
        raise ValueError(
            "cu_seqlens is not supported under torch.compile, torch.export or torch.func yet: "
            "call the packed batch eagerly, or give each document its own row"
        )
    if request.cache is not None:
        return _traced_cache_call(request, new, sinks, cache)
    request.check_traceable()
    return run(request, *new)


def _traced_cache_call(
    request: Request, new: Inputs, sinks: torch.Tensor | None, cache: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """A checked cache call (``request.cache``: Note [A cache call is one request] in
    ``resolve/caches.py``) seen by a tracer: a static cache's one-token step, its attention
    through a custom operator (``dilated_attention::decode_step`` for a dilated layer, Note
    [The decode step under torch.compile]; the dense operator for a local window's, which
    reads its ring through a key mask); ``new``: the token's q (B, 1, H, D), k and v
    (B, 1, Hkv, D), mask (B, 1) or None -> ``(out, lse)``.

    Raises:
        ValueError: a growing cache, a static cache's prompt or chunk (they read positions on
            the host), soft-capping or sinks in the step; before the cache changes.
    """
    kind = request.cache
    if kind == "DilatedKVCache":
        raise ValueError(
            "cache= is not supported under torch.compile, torch.export or torch.func yet: "
            "decode eagerly (the cache is Python state the compiled operator cannot update)"
        )
    if kind == "WindowKVCache":
        raise ValueError(
            "cache= is not supported under torch.compile, torch.export or torch.func with a "
            "WindowKVCache: decode eagerly, or compile the one-token step of a "
            "StaticWindowKVCache"
        )
    if not request.static:
        raise ValueError(
            f"a prompt or a chunk of several tokens into a {kind} runs eagerly (it reads "
            f"positions on the host): run the prompt before torch.compile or CUDA graph "
            f"capture, and compile or capture the one-token step"
        )
    step = None if kind == "StaticDilatedKVCache" else window_step(request)
    if step is not None:
        step.check_traceable()
    elif sinks is not None or request.softcap is not None:
        raise ValueError(
            "softcap and sinks are not supported in a compiled static decode step yet: decode "
            "eagerly (the eager step reads no host state either, so a CUDA graph can capture it)"
        )
    q, k, v, key_padding_mask = new
    cache.take_token(k, v, key_padding_mask)
    if step is None:
        tensors = (q, cache.key, cache.value, cache.key_padding_mask, cache.lengths)
        result = traced_step(request, *tensors)
    else:
        result = run(step, q, cache.key, cache.value, cache.hidden_slots())
    cache.lengths.add_(1)
    return result
