"""The decode operation's resolver: queries at the last positions of a dilated layer's keys,
as rows of their branches, one call per token, a chunk in one fused forward or a static cache's
step (Note [Decoding rows] in ``core/decoding/decode.py``), and the branch notes of our fused
kernels that the dilated resolver shares.

Shape legend: B batch, Nq query rows, Nk key rows, H query heads, Hkv key/value heads.
"""

from __future__ import annotations

import functools

from .. import _validation as V
from ..backends.registry import DENSE as DENSE_REGISTRY
from ..backends.registry import DILATED as DILATED_REGISTRY
from ..backends.registry import Selection, registry_for
from ..core.decoding import decode
from ..core.execution.fused import ChunkQueries
from ..core.geometry.segment import effective_branches
from .caches import static_branches
from .request import Request
from .request import kernel_inputs as _kernel_inputs
from .strategy import FusedStrategy, PlanStrategy, StaticDecodeStrategy, Strategy, rows_in_place

__all__ = ["decode_call", "fused_notes"]


@functools.lru_cache(maxsize=256)  # every chunk of a prompt asks again
def fused_notes(name: str, branches: tuple[tuple[int, int], ...]) -> tuple[str, ...]:
    """One line per branch run by the plan kernel ``name`` (our fused kernels)."""
    return tuple(
        f"w={w} r={r}: {name}'s plan kernel runs the branch itself (one launch over its rows, "
        f"read through strides, merged in place)"
        for w, r in branches
    )


def decode_call(request: Request) -> Strategy:
    """Queries at the last positions (Note [Decoding rows] in ``core/decoding/decode.py``): one call
    per token with a per-head key mask where it can (Note [One call per decoded token]), else one
    call per branch and offset class, on the dense registry's kernel chosen for those calls'
    shapes (one query row; a chunk's square causal calls)."""
    if request.schedule is None:
        raise ValueError("a decode request needs the layer's schedule")
    if request.static:
        return _static_decode(request)
    chunk = request.query_len > 1
    fused = _chunk_forward(request) if chunk else None
    if fused is not None:
        return fused
    shape = {"query_len": 1, "key_len": 1 if chunk else request.key_len}
    registry = registry_for(DENSE_REGISTRY)
    one_call = (
        not chunk
        and not request.requires_grad
        and request.device.type in decode.ONE_CALL_DEVICE_TYPES
    )
    kernel: Selection | None = None
    if one_call:
        inputs = _kernel_inputs(request, is_causal=False, has_mask=True, **shape)
        try:
            kernel = registry.select(inputs, request.backend)
        except ValueError:  # a kernel asked for by name takes no masks: one call per branch
            one_call = False
    if kernel is None:
        inputs = _kernel_inputs(request, is_causal=chunk, **shape)
        kernel = registry.select(inputs, request.backend)
    positions, start, schedule = request.positions, request.key_start, request.schedule
    if one_call:
        plan = decode.decode_token_plan(
            positions, request.num_heads, schedule.segment_lengths, schedule.dilation_rates,
            request.device, start, request.batch,
        )  # fmt: skip
        how = "one call per token: every branch's rows against a per-head key mask"
    else:
        layout = schedule.at(positions, request.num_heads, request.num_kv_heads)
        plan = decode.decode_plan(
            request.query_len, positions, request.num_heads, request.num_kv_heads,
            layout.segment_lengths, layout.dilation_rates, request.device, start,
            kernel.backend.reads_strided_rows,
        )  # fmt: skip
        how = "decoding rows: one call per branch and offset class of the new rows"
    return PlanStrategy(
        request, kernel, DENSE_REGISTRY, inputs, how, plan=plan,
        layout=rows_in_place, what="dilated_attention",
    )  # fmt: skip


def _chunk_forward(request: Request) -> Strategy | None:
    """A chunk's queries as one forward of our fused kernels, every branch from the start of
    the first query's segment (Note [A chunk in one fused forward] in ``core/execution/fused.py``),
    where the call runs without gradients, the keys of those segments are still held and the
    automatic choice (or the kernel asked for) for a dilated call over the held keys is our
    fused kernels; else None."""
    schedule, n = request.schedule, request.query_len
    assert schedule is not None  # decode_call checked it
    if not request.is_causal or request.dropout_p or request.requires_grad:
        return None
    segs, rates = effective_branches(
        request.positions, request.num_heads, schedule.segment_lengths, schedule.dilation_rates
    )
    rows = request.positions - request.key_start  # the keys the call reads
    chunk = ChunkQueries(rows - n, request.key_start)
    if min(chunk.segment_start(w) for w in segs) < 0:
        return None
    inputs = _kernel_inputs(request, query_len=rows, key_len=rows)  # a dilated call of the keys
    try:
        kernel = registry_for(DILATED_REGISTRY).select(inputs, request.backend)
    except ValueError:  # the kernel asked for runs no dilated calls: decoding rows
        return None
    if not kernel.runs_plan:  # only our fused kernels take queries after the first key
        return None
    how = (
        f"one forward of the chunk's {V.counted(n, 'query', 'queries')} over the "
        f"{V.counted(rows, 'held key')}, every branch from the start of the first query's "
        f"segment"
    )
    branches = tuple(zip(segs, rates, strict=True))
    notes = fused_notes(kernel.backend.name, branches)
    return FusedStrategy(
        request, kernel, DILATED_REGISTRY, inputs, how, notes, branches, chunk=chunk
    )


def _static_decode(request: Request) -> Strategy:
    """One token per batch row against a static cache's buffers (Note [A decode step with
    static shapes] in ``core/decoding/static_cache.py``): the one call of every branch's slots, on
    the dense registry's kernel for one query row against them with a per-head key mask."""
    assert request.schedule is not None  # decode_call checked it
    if request.requires_grad:
        raise ValueError(
            "a StaticDilatedKVCache decodes without gradients (its buffers are written in "
            "place); run the step under torch.no_grad(), or decode with a DilatedKVCache to "
            "differentiate through decoding"
        )
    segs, rates = static_branches(request)
    slots = sum(-(-w // r) for w, r in zip(segs, rates, strict=True))
    inputs = _kernel_inputs(request, is_causal=False, has_mask=True, query_len=1, key_len=slots)
    kernel = registry_for(DENSE_REGISTRY).select(inputs, request.backend)
    how = (
        f"a static decode step: one call per token, every branch's {V.counted(slots, 'slot')} "
        f"read from the buffers at positions computed on the device, against a per-head key "
        f"mask"
    )
    if getattr(kernel.backend, "reads_decode_buffers", False):
        how = (
            f"a static decode step: one launch per token reading every branch's "
            f"{V.counted(slots, 'slot')} in place from the buffers at positions computed on the "
            f"device"
        )
    return StaticDecodeStrategy(
        request, kernel, DENSE_REGISTRY, inputs, how, branches=(segs, rates)
    )
