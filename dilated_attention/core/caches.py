"""What a call with ``cache=`` must be, for either kind of decoding cache: a
:class:`~dilated_attention.DilatedKVCache` (buffers that grow with what they hold) or a
:class:`~dilated_attention.StaticDilatedKVCache` (fixed buffers, a static decode step).

Shape legend: B batch, n new positions, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import torch

from .. import _validation as V
from .kv_cache import DilatedKVCache
from .static_cache import StaticDilatedKVCache

#: The decoding caches ``cache=`` takes.
Cache = DilatedKVCache | StaticDilatedKVCache
CACHE_TYPES = (DilatedKVCache, StaticDilatedKVCache)


def check_cache_type(cache: object) -> None:
    """Raise ``TypeError`` unless ``cache`` is a decoding cache or None."""
    if cache is not None and not isinstance(cache, CACHE_TYPES):
        raise TypeError(
            f"cache must be a DilatedKVCache, a StaticDilatedKVCache or None, got "
            f"{type(cache).__name__}; build one per layer: DilatedKVCache(segment_lengths, "
            f"dilation_rates)"
        )


def check_cache_call(
    cache: object,
    segments: tuple[int, ...],
    rates: tuple[int, ...],
    q: torch.Tensor,
    k: torch.Tensor,
    is_causal: bool,
) -> Cache:
    """``cache=`` of a dilated call is this layer's decoding cache, for causal calls on new
    tokens: q (B, n, H, D) and k (B, n, Hkv, D) the new tokens' (Note [One cache per layer] in
    ``kv_cache.py``). Returns the cache.

    Raises:
        TypeError: not a decoding cache.
        ValueError: not causal, q and k of different lengths, or keys or a schedule the cache
            cannot take (the cache's ``check``).
    """
    check_cache_type(cache)
    assert cache is not None  # a call with cache= has one
    if not is_causal:
        raise ValueError("cache= is for decoding and needs is_causal=True, got is_causal=False")
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"with cache=, pass the new tokens' query, key and value (the same length), got "
            f"query.shape={tuple(q.shape)}, key.shape={tuple(k.shape)}; the cache holds the rest"
        )
    cache.check(segments, rates, k)  # type: ignore[union-attr]
    return cache  # type: ignore[return-value]


def check_caches(
    caches: object,
    num_layers: int,
    schedule: tuple[tuple[int, ...], tuple[int, ...]],
    tokens: torch.Tensor,
    positions: object,
) -> torch.Tensor | None:
    """Check a model's ``caches`` for a forward over the new ``tokens`` (B, N) and return the
    tokens' (N,) positions on their device (``positions`` if given, else the caches' next ones);
    None for a static step (:class:`StaticDilatedKVCache`, one token per row: each row's
    position is on the device, and the caches check it without synchronizing).

    ``caches`` must be a list of ``num_layers`` distinct caches of one kind and the layers'
    ``schedule`` (segment lengths, dilation rates), all at one length (not compared for static
    caches, whose lengths live on the device) and, where they hold keys, of one batch (``B``),
    heads, head dim, dtype and device; ``positions`` must be their next ones (Note [One cache
    per layer] in ``kv_cache.py``). Raises ``ValueError`` naming ``caches`` or ``positions``.
    """
    fix = "caches=model.new_caches() (one per layer, for one sequence)"
    if not isinstance(caches, list) or len(caches) != num_layers:
        raise ValueError(
            f"caches must be a list of {num_layers} DilatedKVCache, as in {fix}, got "
            f"{type(caches).__name__}{f' of {len(caches)}' if isinstance(caches, list) else ''}"
        )
    _check_each(caches, schedule, fix)
    static = isinstance(caches[0], StaticDilatedKVCache)
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
            "with StaticDilatedKVCache caches the new tokens' positions are the caches' (each "
            "row's next one, kept on the device); pass positions=None"
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


def _check_each(caches: list, schedule: tuple[tuple[int, ...], tuple[int, ...]], fix: str) -> None:
    """Each of ``caches`` a cache of the first one's kind and of ``schedule``, none repeated,
    and (for growing caches) all at one length."""
    kind = type(caches[0]) if isinstance(caches[0], CACHE_TYPES) else DilatedKVCache
    seen: dict[int, int] = {}
    for i, cache in enumerate(caches):
        if not isinstance(cache, kind):
            want = f"{kind.__name__} (as caches[0])" if i else "DilatedKVCache"
            raise ValueError(
                f"caches[{i}] must be a {want}, got {type(cache).__name__}; pass {fix}"
            )
        if id(cache) in seen:
            raise ValueError(
                f"caches[{i}] is caches[{seen[id(cache)]}]: a cache shared by two layers takes "
                f"one layer's keys as more tokens of the other; pass {fix}"
            )
        seen[id(cache)] = i
        if (cache.segment_lengths, cache.dilation_rates) != schedule:
            raise ValueError(
                f"caches[{i}] holds a layer with segment_lengths={list(cache.segment_lengths)}, "
                f"dilation_rates={list(cache.dilation_rates)}, but the model's layers have "
                f"segment_lengths={list(schedule[0])}, dilation_rates={list(schedule[1])}; "
                f"pass {fix}"
            )
        if kind is DilatedKVCache and cache.length != caches[0].length:
            raise ValueError(
                f"caches must all have seen the same tokens, but caches[{i}] has seen "
                f"{V.counted(cache.length, 'token')} and caches[0] {caches[0].length} (a cache "
                f"another "
                f"model, layer or sequence has advanced); pass {fix}"
            )
