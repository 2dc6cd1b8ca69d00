"""Merging partial attention results through their log-sum-exp.

Note [Merging partial softmaxes]
    Two attention results over disjoint (or multiset-disjoint) key sets, ``(o_a, lse_a)`` and
    ``(o_b, lse_b)``, combine into the result over the union:

        lse = logaddexp(lse_a, lse_b)
        o   = o_a * exp(lse_a - lse) + o_b * exp(lse_b - lse)

    This is LongNet Eq. 10 for dilated branches, one ring step for ring attention and one block for
    block-sparse attention. A side with no keys has ``lse = -inf`` and weight 0; when both sides are
    empty, ``lse - lse`` would be ``-inf - -inf = nan``, so the weights are computed against a
    finite stand-in and the result stays ``(0, -inf)``.

Shapes: ``out`` is (..., D) and ``lse`` is (...) with the same leading dims.
"""

from __future__ import annotations

import torch


def merge_partial(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results (see Note [Merging partial softmaxes]).

    Args:
        out_a: (..., D) output over key set A, float32 or float64.
        lse_a: (...) log-sum-exp over key set A (``-inf`` where A is empty).
        out_b: (..., D) output over key set B.
        lse_b: (...) log-sum-exp over key set B.

    Returns:
        ``(out, lse)`` over the union, in the dtype of ``out_a`` / ``lse_a``.
    """
    lse = torch.logaddexp(lse_a, lse_b.to(lse_a.dtype))
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - finite).unsqueeze(-1)
    w_b = torch.exp(lse_b.to(lse_a.dtype) - finite).unsqueeze(-1)
    out = out_a * w_a.to(out_a.dtype) + out_b.to(out_a.dtype) * w_b.to(out_a.dtype)
    return out, lse
