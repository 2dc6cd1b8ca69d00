"""Decoding caches in the resolve step: a call with ``cache=`` as one request
(:func:`cache_fields`), resolved to the strategy of the keys it reads inside one that joins
them with the cache and writes the new rows (:func:`cache_call`).

Note [A cache call is one request]
    A call with ``cache=`` is described by one request, as every call is: the new tokens'
    shapes and flags, the cache's kind, and what the call reads with what the cache holds,
    from the cache's state on the host (:func:`cache_fields`): ``key_len`` the keys it reads,
    ``key_start`` and ``context_len`` their first position and the positions so far (a
    growing cache's held positions; for a static cache's prompt or chunk the position every
    row is at, one synchronization), ``static`` a static cache's one-token step (its buffer
    rows). The cache itself travels beside the tensors, as the key padding mask does.

    The resolve step resolves the request of the keys the call reads (decoding rows, the
    static step's slots, a window's end-aligned calls, a packed prompt's documents) and wraps
    its strategy in one that joins them with the cache: appended to a growing cache
    (:class:`AppendStrategy`), written into a static cache's ring (:class:`StaticStepStrategy`)
    or rows (:class:`HeldRowsStrategy`), or a packed prompt's last documents taken
    (:class:`PackedPromptStrategy`, Note [A packed prompt] in ``core/geometry/documents.py``). What
    can refuse the call (the checks, a static cache's rows at different positions or past
    ``max_length``, the kernel choice) comes before the cache changes: a refused call leaves
    it as it was. Under a tracer a static cache's step runs through the custom operators and
    every other cache call is refused (``decode_step.py``).

Shape legend: B batch, n new positions, H query heads, R ring rows, Hkv key/value heads,
D head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..core.autograd import Inputs
from ..core.decoding.caches import CACHE_TYPES, Cache
from ..core.decoding.kv_cache import GrowingKVCache
from ..core.decoding.static_cache import StaticKVCache
from ..core.decoding.window_cache import StaticWindowKVCache, WindowKVCache
from ..core.geometry.documents import last_document
from ..core.geometry.segment import effective_branches
from ..core.hidden import hide_masked_keys
from .request import DECODE, Request, dilated_operation
from .strategy import StaticDecodeStrategy, Strategy, WrappedStrategy

__all__ = [
    "GROWING", "WINDOW", "AppendStrategy", "HeldRowsStrategy", "PackedPromptStrategy",
    "StaticStepStrategy", "cache_call", "cache_fields", "cache_kind", "static_branches",
    "window_step",
]  # fmt: skip

Result = tuple[torch.Tensor, torch.Tensor]
#: The kinds of growing caches, and of a local window's caches (``Request.cache``).
GROWING = frozenset(t.__name__ for t in CACHE_TYPES if issubclass(t, GrowingKVCache))
WINDOW = frozenset((WindowKVCache.__name__, StaticWindowKVCache.__name__))


def cache_kind(cache: Cache) -> str:
    """``Request.cache`` of a checked decoding cache: the name of its class among ``cache=``'s."""
    return next(t.__name__ for t in CACHE_TYPES if isinstance(cache, t))


def cache_fields(
    cache: Cache,
    new: Inputs,
    sinks: torch.Tensor | None,
    fields: dict[str, Any],
    *,
    packed: bool,
) -> dict[str, Any]:
    """The request fields of a checked call with ``cache`` (Note [A cache call is one request]):
    ``new`` the new tokens' q (B, n, H, D), k and v (B, n, Hkv, D) and mask (B, n) or None,
    ``sinks`` (H,) or None, ``fields`` the call's; ``packed``: a packed prompt (nothing read
    from the cache, which is checked empty).

    Raises:
        ValueError: a static cache with dropout, or a static window cache with gradients; a
            static cache's rows at different positions, or past ``max_length``, for several
            tokens.
    """
    kind = cache_kind(cache)
    if packed:
        return {"cache": kind}
    n = new.q.shape[1]
    if isinstance(cache, GrowingKVCache):
        if isinstance(cache, WindowKVCache):
            has_mask = new.key_padding_mask is not None or cache.key_padding_mask is not None
            return {"cache": kind, "has_mask": has_mask, "key_len": cache.length - cache.start + n}
        return {"cache": kind, "key_start": cache.start, "context_len": cache.length + n}
    assert isinstance(cache, StaticKVCache)
    _check_static(cache, new, sinks, fields)
    if cache.key is not None and n == 1:  # the step: one call against the buffers
        grad = torch.is_grad_enabled() and any(
            x is not None and x.requires_grad for x in (new.q, cache.key, cache.value, sinks)
        )
        window = isinstance(cache, StaticWindowKVCache)
        has_mask = window or new.key_padding_mask is not None or cache.key_padding_mask is not None
        return {"cache": kind, "static": True, "key_len": cache.key.shape[1],
                "has_mask": has_mask, "requires_grad": grad and not window}  # fmt: skip
    if torch.compiler.is_compiling():  # positions are on the device: refused while traced
        return {"cache": kind}
    first = cache.chunk_start(n)
    start = cache.first_read(first)
    held = max(first - start, 0)
    has_mask = new.key_padding_mask is not None or (held > 0 and cache.key_padding_mask is not None)
    return {"cache": kind, "key_len": held + n, "key_start": start, "context_len": first + n,
            "has_mask": has_mask}  # fmt: skip


def _check_static(
    cache: StaticKVCache, new: Inputs, sinks: torch.Tensor | None, fields: dict[str, Any]
) -> None:
    """A static cache decodes without dropout, and a static window cache without gradients
    (its buffers are written in place)."""
    name = type(cache).__name__
    if fields["dropout_p"]:
        raise ValueError(
            f"a {name} decodes without dropout, got dropout_p={fields['dropout_p']}; decode in "
            f"eval mode (dropout_p=0)"
        )
    if isinstance(cache, StaticWindowKVCache) and torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (*new[:3], sinks)
    ):
        raise ValueError(
            "a StaticWindowKVCache decodes without gradients (its buffers are written in "
            "place); run the step under torch.no_grad(), or decode with a WindowKVCache to "
            "differentiate through decoding"
        )


def static_branches(request: Request) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The effective branches every step of a static decode ``request`` reads: the schedule's
    over the buffers' ``key_len`` rows (Note [Effective branches]). Plain integers, so the
    traced step computes them too (``decode_step._traced_slots``)."""
    schedule = request.schedule
    assert schedule is not None  # a decode request has one
    return effective_branches(
        request.key_len, request.num_heads, schedule.segment_lengths, schedule.dilation_rates
    )


def window_step(request: Request) -> Request:
    """The request of a static window cache's one-token step (Note [A window cache] in
    ``core/decoding/window_cache.py``): the token against every ring row, not causal, no window, the
    rows it must not read hidden by a key mask."""
    return replace(
        request, cache=None, static=False, is_causal=False, window=None, has_mask=True,
        requires_grad=False,
    )  # fmt: skip


def cache_call(request: Request, resolve_keys: Callable[[Request], Strategy]) -> Strategy:
    """The strategy of a cache call (Note [A cache call is one request]): the strategy of the
    keys it reads, resolved by ``resolve_keys``, inside the one that joins them with the
    cache."""
    kind, n = request.cache, request.query_len
    keys = replace(request, cache=None)
    if request.documents is not None:
        how = f"a packed prompt into a {kind}"
        return PackedPromptStrategy.around(request, resolve_keys(keys), how)
    dilated = kind not in WINDOW
    if request.static:
        step = replace(keys, operation=DECODE) if dilated else window_step(request)
        how = f"a {kind}'s one-token step"
        return StaticStepStrategy.around(request, resolve_keys(step), how)
    if dilated:  # decoding rows after the held positions, or a prompt
        assert request.context_len is not None  # cache_fields gives it, where not refused
        operation = dilated_operation(n, request.key_len, request.context_len - n)
        keys = replace(keys, operation=operation)
    else:  # end-aligned dense calls: where the rows start is the cache's business only
        keys = replace(keys, key_start=0, context_len=None)
    if kind in GROWING:
        return AppendStrategy.around(request, resolve_keys(keys), f"appended to a {kind}")
    how = f"the rows a {kind} holds joined with the new ones"
    return HeldRowsStrategy.around(request, resolve_keys(keys), how)


@dataclass(frozen=True)
class CacheStrategy(WrappedStrategy):
    """A call with its decoding cache: :meth:`call` takes the cache beside the tensors."""

    def run(self, *args: object, **kwargs: object) -> Result:
        raise NotImplementedError(f"{type(self).__name__} runs with its cache: call(...)")


@dataclass(frozen=True)
class AppendStrategy(CacheStrategy):
    """A growing cache (``DilatedKVCache``, ``WindowKVCache``): the new rows appended, the
    queries run against every row the cache returns."""

    def call(self, q, k, v, key_padding_mask, sinks=None, cache=None):  # type: ignore[no-untyped-def]
        assert self.inner is not None and isinstance(cache, GrowingKVCache)
        k, v = hide_masked_keys(k, v, key_padding_mask)  # the cache keeps them so: no copy later
        keys, values, mask, _ = cache.append(k, v, key_padding_mask)
        return self.inner.run(q, keys, values, mask, sinks)


@dataclass(frozen=True)
class HeldRowsStrategy(CacheStrategy):
    """A static cache's prompt or chunk: the held rows it reads joined with the new ones, the
    new rows written into the buffers, then the call (eager: it read the position on the
    host)."""

    def call(self, q, k, v, key_padding_mask, sinks=None, cache=None):  # type: ignore[no-untyped-def]
        assert self.inner is not None and isinstance(cache, StaticKVCache)
        assert self.request.context_len is not None
        first = self.request.context_len - self.request.query_len
        k, v = hide_masked_keys(k, v, key_padding_mask)
        keys, values, mask, _ = cache.with_held(k, v, key_padding_mask, first)
        cache.write_rows(k, v, key_padding_mask, first)
        return self.inner.run(q, keys, values, mask, sinks)


@dataclass(frozen=True)
class StaticStepStrategy(CacheStrategy):
    """A static cache's one-token step (Note [A decode step with static shapes] in
    ``core/decoding/static_cache.py``): the token written at each row's position, one call against
    the buffers, the positions moved on; no host synchronization."""

    def call(self, q, k, v, key_padding_mask, sinks=None, cache=None):  # type: ignore[no-untyped-def]
        assert self.inner is not None and isinstance(cache, StaticKVCache)
        cache.take_token(k, v, key_padding_mask)
        assert cache.key is not None and cache.value is not None and cache.lengths is not None
        if isinstance(self.inner, StaticDecodeStrategy):
            tensors = (q, cache.key, cache.value, cache.key_padding_mask, cache.lengths)
            result = self.inner.run_at(*tensors, sinks=sinks)
        else:  # a window's step: every ring row, the ones it must not read hidden
            assert isinstance(cache, StaticWindowKVCache)
            result = self.inner.run(q, cache.key, cache.value, cache.hidden_slots(), sinks)
        cache.lengths.add_(1)
        return result


@dataclass(frozen=True)
class PackedPromptStrategy(CacheStrategy):
    """A packed prompt (Note [A packed prompt] in ``core/geometry/documents.py``): the packed call,
    then each row's last document's keys and values into the cache."""

    def call(self, q, k, v, key_padding_mask, sinks=None, cache=None):  # type: ignore[no-untyped-def]
        assert self.inner is not None and self.request.documents is not None
        assert isinstance(cache, GrowingKVCache | StaticKVCache)
        result = self.inner.call(q, k, v, key_padding_mask, sinks)
        tail = slice(k.shape[1] - last_document(self.request.documents, *k.shape[:2]), None)
        mask = None if key_padding_mask is None else key_padding_mask[:, tail]
        cache.take_prompt(*hide_masked_keys(k[:, tail], v[:, tail], mask), mask)
        return result
