"""Decoding a layer of local windowed attention with its window cache (Note [A window cache] in
``core/window_cache.py``): ``attention(..., window_size=..., cache=...)`` on new tokens.

A :class:`~dilated_attention.WindowKVCache` takes a prompt, chunks and single tokens alike:
the held rows and the new ones, the queries end-aligned in their windows. A
:class:`~dilated_attention.StaticWindowKVCache` runs a prompt or a chunk the same way, eagerly,
and one token per row as the static step: one call of the token against the whole ring with the
rows it must not read hidden, no host synchronization (under ``torch.compile`` the dense
operator runs it; a CUDA graph captures the eager step, soft-capping and sinks included).

Shape legend: B batch, n new positions, H query heads, R ring rows, Hkv key/value heads,
D head dim.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from . import compiled
from .compiled import is_traced
from .core.autograd import Inputs
from .core.hidden import hide_masked_keys
from .core.window_cache import StaticWindowKVCache, WindowKVCache
from .resolve import DENSE, Request, resolve

__all__ = ["window_decode"]

Result = tuple[torch.Tensor, torch.Tensor]


def window_decode(
    cache: WindowKVCache | StaticWindowKVCache,
    new: Inputs,
    fields: dict[str, Any],
    sinks: torch.Tensor | None = None,
) -> Result:
    """A checked causal windowed call on new tokens with this layer's cache (the cache and its
    window checked by ``check_window_cache_call``): ``new`` holds q (B, n, H, D), k and v
    (B, n, Hkv, D) and the mask (B, n) over the new keys; ``fields``: the dense request's
    (``window``, ``softcap``, ...); sinks (H,) or None -> ``(out, lse)``, out (B, n, H, D), lse
    (B, H, n). Resolved before the cache changes: a refused call leaves it as it was.

    Raises:
        ValueError: a growing cache or a prompt under a tracer; with a static cache: dropout,
            gradients, rows at different positions given several tokens, positions past
            ``max_length``.
    """
    if isinstance(cache, StaticWindowKVCache):
        return _static(cache, new, fields, sinks)
    if is_traced(*new, sinks):
        raise ValueError(
            "cache= is not supported under torch.compile, torch.export or torch.func with a "
            "WindowKVCache: decode eagerly, or compile the one-token step of a "
            "StaticWindowKVCache"
        )
    q, k, v, key_padding_mask = new
    has_mask = key_padding_mask is not None or cache.key_padding_mask is not None
    request = Request.of(DENSE, q, k, v, **{**fields, "has_mask": has_mask})
    held = cache.length - cache.start
    strategy = resolve(replace(request, key_len=held + k.shape[1]))
    k, v = hide_masked_keys(k, v, key_padding_mask)  # the cache keeps them so
    keys, values, mask, _ = cache.append(k, v, key_padding_mask)
    return strategy.run(q, keys, values, mask, sinks)


def _static(
    cache: StaticWindowKVCache, new: Inputs, fields: dict[str, Any], sinks: torch.Tensor | None
) -> Result:
    """A static cache: the one-token step into filled buffers, else a prompt or a chunk."""
    if fields["dropout_p"]:
        raise ValueError(
            f"a StaticWindowKVCache decodes without dropout, got dropout_p="
            f"{fields['dropout_p']}; decode in eval mode (dropout_p=0)"
        )
    if torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (*new[:3], sinks)
    ):
        raise ValueError(
            "a StaticWindowKVCache decodes without gradients (its buffers are written in "
            "place); run the step under torch.no_grad(), or decode with a WindowKVCache to "
            "differentiate through decoding"
        )
    if cache.key is not None and new.q.shape[1] == 1:
        return _step(cache, new, fields, sinks)
    if is_traced(*new, sinks):
        raise ValueError(
            "a prompt or a chunk of several tokens into a StaticWindowKVCache runs eagerly "
            "(it reads positions on the host): run the prompt before torch.compile or CUDA "
            "graph capture, and compile or capture the one-token step"
        )
    q, k, v, key_padding_mask = new
    first = cache.chunk_start(q.shape[1])
    k, v = hide_masked_keys(k, v, key_padding_mask)
    keys, values, mask, _ = cache.with_held(k, v, key_padding_mask, first)
    request = Request.of(DENSE, q, keys, values, **{**fields, "has_mask": mask is not None})
    strategy = resolve(request)
    cache.write_rows(k, v, key_padding_mask, first)
    return strategy.run(q, keys, values, mask, sinks)


def _step(
    cache: StaticWindowKVCache, new: Inputs, fields: dict[str, Any], sinks: torch.Tensor | None
) -> Result:
    """The static step (Note [A window cache]): one token per row at each row's position, its
    key and value written into the ring, then one call of the token against every ring row
    with the rows it must not read hidden; no host synchronization. ``new``: q (B, 1, H, D),
    k and v (B, 1, Hkv, D), mask (B, 1) or None."""
    assert cache.key is not None and cache.value is not None and cache.lengths is not None
    q, k, v, key_padding_mask = new
    step = {**fields, "is_causal": False, "window": None, "has_mask": True}
    request = Request.of(DENSE, q, cache.key, cache.value, **step, requires_grad=False)
    traced = is_traced(q, k, v, key_padding_mask, sinks)
    if traced:
        request.check_traceable()  # refused before the cache changes
    strategy = None if traced else resolve(request)
    cache.check_capacity(1)
    k, v = hide_masked_keys(k, v, key_padding_mask)
    cache.write_token(k, v, key_padding_mask)
    hidden = cache.hidden_slots()
    if strategy is None:
        result = compiled.run(request, q, cache.key, cache.value, hidden)
    else:
        result = strategy.run(q, cache.key, cache.value, hidden, sinks)
    cache.lengths.add_(1)
    return result
