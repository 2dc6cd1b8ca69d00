"""Where a checked request runs: eagerly (``resolve.execute``), or through its custom operator
where a tracer or a torch.func transform sees the call (Note [Custom operators for
torch.compile and torch.func] in ``operators.py``).

Shape legend: B batch, Nq/Nk query/key tokens, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import torch

from ..resolve import Request, execute
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
        q: (B, Nq, H, D); k, v: (B, Nk, Hkv, D); key_padding_mask: (B, Nk) bool or None.

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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Run a checked request: through its operator where a tracer or a torch.func transform
    sees the call (:func:`is_traced`), else resolved and run eagerly (``resolve.execute``).

    Args:
        request: the call, as the public function described it.
        q: (B, Nq, H, D); k, v: (B, Nk, Hkv, D); key_padding_mask: (B, Nk) bool or None.
        return_lse: also return the merged log-sum-exp; sinks: (H,) attention sinks, or None.

    Returns:
        ``out`` (B, Nq, H, D), or ``(out, lse)`` with ``lse`` (B, H, Nq) detached.
    """
    if is_traced(q, k, v, key_padding_mask, sinks):
        request.check_traceable()
        out, lse = run(request, q, k, v, key_padding_mask)
    else:
        out, lse = execute(request, q, k, v, key_padding_mask, sinks)
    return (out, lse) if return_lse else out
