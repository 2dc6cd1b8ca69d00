"""A checked call as a custom operator's arguments, and back: each operator's options (ints,
floats, bools and strings after the tensors) and the :class:`Request` they describe.

Shape legend: B batch, Nq/Nk query/key tokens, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from ..block_sparse.runtime import MaskLayout
from ..core.geometry.schedule import Schedule
from ..pattern_keys import pattern_key, pattern_of
from ..resolve import BLOCK_SPARSE, DECODE, DENSE, DILATED, Request, dilated_operation

__all__ = [
    "DROPOUT_INDEX", "MASK_NAME", "OPTIONS", "PUBLIC_NAME", "RUN_TIME_MASK", "dropout_p",
    "options_of", "request_of",
]  # fmt: skip

#: Each operator's options after the tensors, in the eager function's terms. ``requires_grad``
#: (last) is whether the traced call needed gradients: the eager kernel choice depends on it.
OPTIONS = {
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
#: The name of each operator's fourth tensor, the call's mask tensor (Note [The call's mask
#: tensor] in ``resolve/request.py``).
MASK_NAME = {"dense": "key_padding_mask", "dilated": "key_padding_mask",
             "block_sparse": "block_mask"}  # fmt: skip
#: The ``pattern`` option of a block-sparse call whose blocks its run-time mask gives.
RUN_TIME_MASK = -1
#: Where ``dropout_p`` sits among an operator's options (None: the operator has no dropout).
DROPOUT_INDEX = {"dense": 2, "dilated": 4, "block_sparse": None}
PUBLIC_NAME = {
    "dense": "attention",
    "dilated": "dilated_attention",
    "block_sparse": "block_sparse_attention",
}


def dropout_p(kind: str, options: Sequence[Any]) -> float:
    """The ``dropout_p`` among operator ``kind``'s ``options`` (0 where it has none)."""
    index = DROPOUT_INDEX[kind]
    return 0.0 if index is None else float(options[index])


def request_of(
    kind: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    options: Sequence[Any],
) -> Request:
    """The request an operator's options describe (the inverse of :func:`options_of`), needing
    gradients as the last option says."""
    if kind == "dense":
        is_causal, scale, dropout_p, backend, grad = options
        return Request.of(
            DENSE, q, k, v, is_causal=is_causal, has_mask=mask is not None,
            dropout_p=dropout_p, scale=scale, backend=backend, requires_grad=bool(grad),
        )  # fmt: skip
    if kind == "dilated":
        segs, rates, is_causal, scale, dropout_p, backend, grad = options
        return Request.of(
            dilated_operation(q.shape[1], k.shape[1]), q, k, v, is_causal=is_causal,
            has_mask=mask is not None, dropout_p=dropout_p, scale=scale, backend=backend,
            schedule=_schedule(tuple(segs), tuple(rates)), requires_grad=bool(grad),
        )  # fmt: skip
    key, block_size, is_causal, scale, backend, grad = options
    if key == RUN_TIME_MASK:  # its layout from the mask tensor's metadata
        assert mask is not None  # the operator was called with the call's mask
        batch, heads, _, width = mask.shape
        blocks = {"block_mask": MaskLayout(mask.dtype != torch.bool, batch, heads, width)}
    else:
        blocks = {"pattern": pattern_of(key)}
    return Request.of(
        BLOCK_SPARSE, q, k, v, block_size=block_size, is_causal=is_causal, scale=scale,
        backend=backend, requires_grad=bool(grad), **blocks,
    )  # fmt: skip


@functools.lru_cache(maxsize=256)
def _schedule(segment_lengths: tuple[int, ...], dilation_rates: tuple[int, ...]) -> Schedule:
    """The schedule an operator's options name, checked once per pair of tuples: its checks
    took most of a request's host time, twice a training step (forward and backward)."""
    return Schedule(segment_lengths, dilation_rates)


def options_of(request: Request) -> tuple[str, list[Any]]:
    """Operator and options of a request (the inverse of :func:`request_of`); the last option
    is whether the call needs gradients (the eager kernel choice depends on it).

    Raises:
        RuntimeError: block-sparse attention under ``torch.export``: its pattern is a key into
            this process's table (Note [Patterns as operator arguments]).
    """
    r = request
    if r.operation == DENSE:
        return "dense", [r.is_causal, r.scale, r.dropout_p, r.backend, r.requires_grad]
    if r.operation in (DILATED, DECODE):
        assert r.schedule is not None
        return "dilated", [
            list(r.schedule.segment_lengths), list(r.schedule.dilation_rates), r.is_causal,
            r.scale, r.dropout_p, r.backend, r.requires_grad,
        ]  # fmt: skip
    if r.block_mask is not None:  # a tensor input of the operator: it exports too
        return "block_sparse", [
            RUN_TIME_MASK, r.block_size, r.is_causal, r.scale, r.backend, r.requires_grad,
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
