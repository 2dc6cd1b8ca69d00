"""The static decode step as a custom operator, so ``torch.compile`` keeps it in one graph.

Note [The decode step under torch.compile]
    A step on a :class:`~dilated_attention.StaticDilatedKVCache` (Note [A decode step with
    static shapes] in ``core/decoding/static_cache.py``) has three parts: writing the new keys and
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

from .compiled.tracing import is_traced
from .core.decoding.decode import token_slots
from .core.execution.call_runs import accumulator_dtype
from .core.geometry.schedule import Schedule
from .resolve import DECODE, Request, resolve, static_branches
from .resolve.strategy import StaticDecodeStrategy

__all__ = ["decode_at", "traced_step"]

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


def traced_step(
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
        return traced_step(request, q, k, v, None, positions, shift)[0]
    return _strategy(request).run_at(q, k, v, None, positions, shift)[0]
