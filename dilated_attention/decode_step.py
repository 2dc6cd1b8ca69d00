"""The static decode step as a custom operator, so ``torch.compile`` keeps it in one graph.

Note [The decode step under torch.compile]
    A step on a :class:`~dilated_attention.StaticDilatedKVCache` (Note [A decode step with
    static shapes] in ``core/static_cache.py``) has three parts: writing the new keys and
    values at each row's position, the attention, and moving the positions on. The writes and
    the move are plain tensor operations on the cache's buffers, which Dynamo traces (in-place
    updates of tensors it guards). The attention chooses a kernel and builds its plan, which
    cannot be traced (Note [Custom operators for torch.compile and torch.func] in
    ``compiled/operators.py``); it runs as ``dilated_attention::decode_step``, which takes the
    query, the buffers, their mask and the positions and returns ``(out, lse)``: its
    implementation is the eager step. The operator has no gradient: a static step decodes
    without one.

    The slots of the step's branches (``token_slots``: per slot its segment, rate and stride)
    are an input of the operator, made by the traced graph. The eager step makes them once
    per schedule and device and keeps them; an operator that did so would keep tensors made
    in its first run, which under ``mode="reduce-overhead"`` (CUDA graph trees) lie in the
    graphs' memory pool, and the trees refuse any tensor of their pool they do not track.

Shape legend: B batch, H query heads, R buffer rows, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

from typing import Any

import torch

from .compiled import is_traced
from .core.autograd import Inputs
from .core.call_runs import accumulator_dtype
from .core.decode import token_slots
from .core.hidden import hide_masked_keys
from .core.schedule import Schedule
from .core.static_cache import StaticDilatedKVCache
from .resolve import DECODE, Request, dilated_operation, resolve, static_branches
from .resolve.strategy import StaticDecodeStrategy

__all__ = ["decode_at", "static_decode"]

_SCHEMA = (
    "(Tensor query, Tensor key, Tensor value, Tensor? key_padding_mask, Tensor positions, "
    "Tensor? row_offsets, Tensor[] slots, int[] segment_lengths, int[] dilation_rates, "
    "float? scale, "
    "str? backend) -> (Tensor, Tensor)"
)


def _strategy(request: Request) -> StaticDecodeStrategy:
    strategy = resolve(request)
    assert isinstance(strategy, StaticDecodeStrategy)  # a static decode request resolves so
    return strategy


def _implementation(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    positions: torch.Tensor,
    row_offsets: torch.Tensor | None,
    slots: list[torch.Tensor],
    segment_lengths: list[int],
    dilation_rates: list[int],
    scale: float | None,
    backend: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    request = Request.of(
        DECODE, q, k, v, is_causal=True, has_mask=key_padding_mask is not None, scale=scale,
        backend=backend, schedule=Schedule(tuple(segment_lengths), tuple(dilation_rates)),
        static=True, requires_grad=False,
    )  # fmt: skip
    strategy = _strategy(request)
    out, lse = strategy.run_at(q, k, v, key_padding_mask, positions, row_offsets, tuple(slots))
    return out.contiguous().clone(), lse.contiguous().clone()


def _fake(q: torch.Tensor, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    batch, length, heads, _ = q.shape
    lse = q.new_empty((batch, heads, length), dtype=accumulator_dtype(q.dtype))
    return q.new_empty(q.shape), lse


_OPERATOR = torch.library.custom_op(
    "dilated_attention::decode_step", _implementation, mutates_args=(), schema=_SCHEMA
)
_OPERATOR.register_fake(_fake)


def _traced_step(
    request: Request,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    positions: torch.Tensor,
    row_offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The operator's ``(out, lse)`` of a static decode ``request`` (Note [The decode step
    under torch.compile])."""
    schedule = request.schedule
    assert schedule is not None  # a decode request has one
    return _OPERATOR(
        q, k, v, key_padding_mask, positions, row_offsets, _traced_slots(request),
        list(schedule.segment_lengths), list(schedule.dilation_rates), request.scale,
        request.backend,
    )  # fmt: skip


def _traced_slots(request: Request) -> list[torch.Tensor]:
    """The step's slots (``token_slots`` of the branches the step reads) made in the traced
    graph, not by the operator: a graph replays them, while slots the operator made and cached
    in its first run would live in the CUDA graph pool of ``mode="reduce-overhead"``, which
    refuses allocations it does not track (Note [The decode step under torch.compile])."""
    branches = static_branches(request)
    return list(token_slots.__wrapped__(request.num_heads, *branches, request.device))


def static_decode(
    cache: StaticDilatedKVCache,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    fields: dict[str, Any],
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A checked causal dilated call on new tokens with this layer's static cache: q
    (B, n, H, D), k and v (B, n, Hkv, D), key_padding_mask (B, n) over the new keys, sinks
    (H,) or None -> ``(out, lse)``. One token per row into filled buffers is the static step;
    a prompt or a chunk runs eagerly (Note [A decode step with static shapes]). Resolved
    before the cache changes: a refused call leaves it as it was.

    Raises:
        ValueError: dropout, a prompt or chunk under a tracer, a step that needs gradients,
            rows at different positions given several tokens, positions past ``max_length``.
    """
    if fields["dropout_p"]:
        raise ValueError(
            f"a StaticDilatedKVCache decodes without dropout, got dropout_p="
            f"{fields['dropout_p']}; decode in eval mode (dropout_p=0)"
        )
    new = Inputs(q, k, v, key_padding_mask)
    if cache.key is not None and q.shape[1] == 1:
        return _token_step(cache, new, fields, sinks)
    if is_traced(q, k, v, key_padding_mask):
        raise ValueError(
            "a prompt or a chunk of several tokens into a StaticDilatedKVCache runs eagerly "
            "(it reads positions on the host): run the prompt before torch.compile or CUDA "
            "graph capture, and compile or capture the one-token step"
        )
    return _rows(cache, new, fields, sinks)


def _token_step(
    cache: StaticDilatedKVCache, new: Inputs, fields: dict[str, Any], sinks: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The static step: one token per row at each row's position (no host synchronization);
    ``new``: the tokens' q (B, 1, H, D), k and v (B, 1, Hkv, D) and mask (B, 1) or None."""
    assert cache.key is not None and cache.value is not None and cache.lengths is not None
    q, k, v, key_padding_mask = new
    has_mask = key_padding_mask is not None or cache.key_padding_mask is not None
    # Sinks that need a gradient are refused with the rest (the step runs without autograd).
    grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, cache.key, cache.value, sinks)
    )
    request = Request.of(
        DECODE, q, cache.key, cache.value, static=True, requires_grad=grad,
        **{**fields, "has_mask": has_mask},
    )  # fmt: skip
    traced = is_traced(q, k, v, key_padding_mask, sinks)
    if traced and (sinks is not None or fields.get("softcap") is not None):
        raise ValueError(
            "softcap and sinks are not supported in a compiled static decode step yet: decode "
            "eagerly (the eager step reads no host state either, so a CUDA graph can capture it)"
        )
    strategy = None if traced else _strategy(request)  # refused before the cache changes
    cache.check_capacity(1)
    k, v = hide_masked_keys(k, v, key_padding_mask)
    cache.write_token(k, v, key_padding_mask)
    tensors = (q, cache.key, cache.value, cache.key_padding_mask, cache.lengths)
    result = (
        strategy.run_at(*tensors, sinks=sinks) if strategy else _traced_step(request, *tensors)
    )
    cache.lengths.add_(1)
    return result


def _rows(
    cache: StaticDilatedKVCache, new: Inputs, fields: dict[str, Any], sinks: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt (an empty cache) or a chunk of tokens, every row at one position: the keys the
    new tokens (``new``: q (B, n, H, D), k and v (B, n, Hkv, D), mask (B, n) or None) read from
    the buffers joined with theirs, through the decoding plan (a prompt: the causal forward),
    then their rows into the buffers. Eager."""
    q, k, v, key_padding_mask = new
    n = q.shape[1]
    first = cache.chunk_start(n)
    k, v = hide_masked_keys(k, v, key_padding_mask)
    keys, values, mask, start = cache.with_held(k, v, key_padding_mask, first)
    fields = {**fields, "has_mask": mask is not None}
    request = Request.of(
        dilated_operation(n, keys.shape[1], first), q, keys, values, key_start=start,
        context_len=first + n, **fields,
    )  # fmt: skip
    strategy = resolve(request)
    cache.write_rows(k, v, key_padding_mask, first)
    return strategy.run(q, keys, values, mask, sinks)


def decode_at(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    schedule: Schedule,
    *,
    row_offsets: torch.Tensor | None = None,
    scale: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """The static step's attention over buffers someone else keeps (a transformers cache):
    one token per batch row, q (B, 1, H, D) at ``positions`` (B,) int, against k and v
    (B, R, Hkv, D) holding key position ``x`` of row ``b`` at row ``(x + row_offsets[b]) mod
    R`` (the token's own already written; ``row_offsets``: a left-padded row's padding slots,
    None: 0) -> out (B, 1, H, D). No host synchronization; under a tracer the operator (Note
    [The decode step under torch.compile])."""
    fields: dict[str, Any] = dict(
        is_causal=True, scale=scale, backend=backend, schedule=schedule, static=True
    )
    request = Request.of(DECODE, q, k, v, **fields)
    positions = positions.long()
    shift = None if row_offsets is None else row_offsets.long()
    if is_traced(q, k, v, positions):
        return _traced_step(request, q, k, v, None, positions, shift)[0]
    return _strategy(request).run_at(q, k, v, None, positions, shift)[0]
