"""What a call with ``cache=`` must be, for every kind of decoding cache: a dilated layer's
(:class:`~dilated_attention.DilatedKVCache`, buffers that grow with what they hold, or
:class:`~dilated_attention.StaticDilatedKVCache`, fixed buffers and a static decode step) or a
local window's (:class:`~dilated_attention.WindowKVCache`,
:class:`~dilated_attention.StaticWindowKVCache`); and a model's list of them, one per layer.

Shape legend: B batch, n new positions, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ... import _validation as V
from .kv_cache import DilatedKVCache, GrowingKVCache, LayerCache
from .static_cache import StaticDilatedKVCache, StaticKVCache
from .window_cache import StaticWindowKVCache, WindowKVCache

#: The decoding caches ``cache=`` takes.
Cache = DilatedKVCache | StaticDilatedKVCache | WindowKVCache | StaticWindowKVCache
CACHE_TYPES = (DilatedKVCache, StaticDilatedKVCache, WindowKVCache, StaticWindowKVCache)
#: Per layer kind (``LayerCache.layer[0]``): its growing and its static cache.
CACHE_KINDS: dict[str, tuple[type[GrowingKVCache], type[StaticKVCache]]] = {
    "dilated": (DilatedKVCache, StaticDilatedKVCache),
    "window": (WindowKVCache, StaticWindowKVCache),
}


def check_cache_type(cache: object) -> None:
    """Raise ``TypeError`` unless ``cache`` is a decoding cache or None."""
    if cache is not None and not isinstance(cache, CACHE_TYPES):
        raise TypeError(
            f"cache must be a DilatedKVCache, a StaticDilatedKVCache, a WindowKVCache, a "
            f"StaticWindowKVCache or None, got {type(cache).__name__}; build one per layer: "
            f"DilatedKVCache(segment_lengths, dilation_rates), WindowKVCache(window_size)"
        )


def _check_new_tokens(
    cache: object, kind: str, q: torch.Tensor, k: torch.Tensor, is_causal: bool, function: str
) -> LayerCache:
    """``cache=`` of a call of ``function`` is a cache of the layer ``kind`` (``"dilated"``,
    ``"window"``) for causal calls on new tokens of one length; returns it."""
    check_cache_type(cache)
    growing, static = CACHE_KINDS[kind]
    if not isinstance(cache, growing | static):
        raise TypeError(
            f"cache= of {function} must be a {growing.__name__} or a {static.__name__}, got "
            f"{type(cache).__name__}; each layer takes the cache of its kind"
        )
    if not is_causal:
        raise ValueError("cache= is for decoding and needs is_causal=True, got is_causal=False")
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"with cache=, pass the new tokens' query, key and value (the same length), got "
            f"query.shape={tuple(q.shape)}, key.shape={tuple(k.shape)}; the cache holds the rest"
        )
    cache.check(k)
    return cache


def check_cache_call(
    cache: object,
    segments: tuple[int, ...],
    rates: tuple[int, ...],
    q: torch.Tensor,
    k: torch.Tensor,
    is_causal: bool,
) -> DilatedKVCache | StaticDilatedKVCache:
    """``cache=`` of a dilated call is this layer's decoding cache, for causal calls on new
    tokens: q (B, n, H, D) and k (B, n, Hkv, D) the new tokens' (Note [One cache per layer] in
    ``kv_cache.py``). Returns the cache.

    Raises:
        TypeError: not a dilated layer's decoding cache.
        ValueError: not causal, q and k of different lengths, or keys or a schedule the cache
            cannot take (the cache's ``check``).
    """
    if isinstance(cache, DilatedKVCache | StaticDilatedKVCache):
        cache.check_schedule(segments, rates)
    found = _check_new_tokens(cache, "dilated", q, k, is_causal, "dilated_attention")
    assert isinstance(found, DilatedKVCache | StaticDilatedKVCache)
    return found


def check_window_cache_call(
    cache: object,
    window: tuple[int, int] | None,
    q: torch.Tensor,
    k: torch.Tensor,
    is_causal: bool,
) -> WindowKVCache | StaticWindowKVCache:
    """``cache=`` of a windowed dense call is this layer's window cache (Note [A window cache]
    in ``window_cache.py``), for causal calls on new tokens with the cache's ``window``
    (``window_size``): q (B, n, H, D) and k (B, n, Hkv, D) the new tokens'. Returns the cache.

    Raises:
        TypeError: not a window cache.
        ValueError: not causal, another window (or none), q and k of different lengths, or keys
            the cache cannot take.
    """
    if isinstance(cache, WindowKVCache | StaticWindowKVCache):
        cache.check_window(window)
    found = _check_new_tokens(cache, "window", q, k, is_causal, "attention")
    assert isinstance(found, WindowKVCache | StaticWindowKVCache)
    return found


def check_caches(
    caches: object,
    layers: Sequence[tuple[object, ...]],
    tokens: torch.Tensor,
    positions: object,
) -> torch.Tensor | None:
    """Check a model's ``caches`` for a forward over the new ``tokens`` (B, N) and return the
    tokens' (N,) positions on their device (``positions`` if given, else the caches' next ones);
    None for a static step (static caches, one token per row: each row's position is on the
    device, and the caches check it without synchronizing).

    ``caches`` must be a list of distinct caches, one per layer, each of its layer's kind
    (``layers``: each layer's ``LayerCache.layer``, e.g. ``("dilated", segment_lengths,
    dilation_rates)`` or ``("window", window_size)``), all growing or all static, all at one
    length (not compared for static caches, whose lengths live on the device) and, where they
    hold keys, of one batch (``B``), heads, head dim, dtype and device; ``positions`` must be
    their next ones (Note [One cache per layer] in ``kv_cache.py``). Raises ``ValueError``
    naming ``caches`` or ``positions``.
    """
    fix = "caches=model.new_caches() (one per layer, for one sequence)"
    if not isinstance(caches, list) or len(caches) != len(layers):
        kinds = " / ".join(sorted({CACHE_KINDS[str(layer[0])][0].__name__ for layer in layers}))
        raise ValueError(
            f"caches must be a list of {len(layers)} {kinds}, as in {fix}, got "
            f"{type(caches).__name__}{f' of {len(caches)}' if isinstance(caches, list) else ''}"
        )
    static = isinstance(caches[0], StaticKVCache)
    _check_each(caches, layers, static, fix)
    held = {(c.key.shape[0], *c.key.shape[2:], c.key.dtype, c.key.device)
            for c in caches if c.key is not None}  # fmt: skip
    if len(held) > 1:
        raise ValueError(
            f"caches hold keys of different (batch, kv heads, head_dim, dtype, device): "
            f"{sorted(held, key=str)}; pass {fix}"
        )
    if held and next(iter(held))[0] != tokens.shape[0]:
        raise ValueError(
            f"caches hold keys of a batch of {next(iter(held))[0]}, got tokens of a batch of "
            f"{tokens.shape[0]}; pass {fix}"
        )
    n = tokens.shape[1]
    if static and positions is not None:
        raise ValueError(
            f"with {type(caches[0]).__name__} caches the new tokens' positions are the caches' "
            f"(each row's next one, kept on the device); pass positions=None"
        )
    if static and n == 1 and held:
        return None
    length = caches[0].length
    if positions is None:
        return torch.arange(length, length + n, device=tokens.device)
    if not isinstance(positions, torch.Tensor) or positions.shape != (n,):
        got = tuple(positions.shape) if isinstance(positions, torch.Tensor) else positions
        raise ValueError(f"positions must be a ({n},) int tensor, got {got}")
    positions = positions.to(tokens.device)
    caches[0].check_positions(positions, "caches=")
    return positions


def _check_each(
    caches: list, layers: Sequence[tuple[object, ...]], static: bool, fix: str
) -> None:
    """Each of ``caches`` a cache of its layer's kind (static where ``static``, else growing)
    and of its layer, none repeated, and (for growing caches) all at one length."""
    seen: dict[int, int] = {}
    for i, (cache, layer) in enumerate(zip(caches, layers, strict=True)):
        kind = CACHE_KINDS[str(layer[0])]
        want = kind[1] if static else kind[0]
        if not isinstance(cache, want):
            how = " (static, as caches[0])" if static and i else ""
            raise ValueError(
                f"caches[{i}] must be a {want.__name__}{how}, got {type(cache).__name__}; "
                f"pass {fix}"
            )
        if id(cache) in seen:
            raise ValueError(
                f"caches[{i}] is caches[{seen[id(cache)]}]: a cache shared by two layers takes "
                f"one layer's keys as more tokens of the other; pass {fix}"
            )
        seen[id(cache)] = i
        if cache.layer != layer:
            expected = kind[0](*layer[1:]).describe()  # type: ignore[arg-type]
            raise ValueError(
                f"caches[{i}] holds a layer with {cache.describe()}, but the model's layer {i} "
                f"has {expected}; pass {fix}"
            )
        if not static and cache.length != caches[0].length:
            raise ValueError(
                f"caches must all have seen the same tokens, but caches[{i}] has seen "
                f"{V.counted(cache.length, 'token')} and caches[0] {caches[0].length} (a cache "
                f"another model, layer or sequence has advanced); pass {fix}"
            )
