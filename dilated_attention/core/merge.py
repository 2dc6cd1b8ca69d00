"""Merging partial attention results through their log-sum-exp.

Note [Merging partial softmaxes]
    Two attention results over disjoint (or multiset-disjoint) key sets, ``(o_a, lse_a)`` and
    ``(o_b, lse_b)``, combine into the result over the union. With ``top = max(lse_a, lse_b)``:

        w_a = exp(lse_a - top),  w_b = exp(lse_b - top)       (the larger one is exactly 1)
        o   = (o_a * w_a + o_b * w_b) / (w_a + w_b)
        lse = top + log(w_a + w_b)

    This is LongNet Eq. 10 for dilated branches, one ring step for ring attention and one block for
    block-sparse attention. The weights are normalized by their own sum, not by ``exp(lse_a -
    lse)`` with the rounded merged ``lse``: where ``|lse|`` is large, ``lse = logaddexp(lse_a,
    lse_b)`` loses the added ``log(1 + w)`` to rounding (at ``|lse| = 1e8`` float32's spacing is
    8, so ``log 2`` vanishes), and weights taken against it no longer sum to 1: with logits near
    1e4 two equal branches give outputs up to 1.6x outside the convex hull of ``v`` that way
    (tests/ops/test_extreme_inputs.py, ``test_output_in_convex_hull_of_values``).
    Normalized weights sum to 1 to rounding at any ``|lse|``; only ``lse`` itself keeps its
    unavoidable rounding (the same a single fused kernel's lse has).

    A side with no keys has ``lse = -inf`` and weight 0. When both sides are empty the result is
    ``(0, -inf)``: ``top`` is replaced by 0 so no ``-inf - -inf`` arises, and the zero total is
    not divided by. NaN propagates: a NaN ``lse`` (a NaN query row) makes ``top``, both weights,
    the output and the merged lse NaN, and a ``+inf`` lse (infinite logits) gives NaN too
    (``inf - inf``), never a finite stand-in.

Shapes: ``out`` is (..., D) and ``lse`` is (...) with the same leading dims.
"""

from __future__ import annotations

import torch


def merge_weights(
    lse_a: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normalized mixing weights of two partial results (Note [Merging partial softmaxes]).

    Args:
        lse_a: (...) log-sum-exp over key set A (``-inf`` where A is empty).
        lse_b: (...) log-sum-exp over key set B, same dtype.

    Returns:
        ``(p_a, p_b, lse)``, each (...): ``p_a + p_b = 1`` to rounding (both 0 where both sides
        are empty) and ``lse`` the log-sum-exp over the union.
    """
    top = torch.maximum(lse_a, lse_b)  # NaN if either is NaN
    top = torch.where(top == float("-inf"), torch.zeros_like(top), top)
    w_a = torch.exp(lse_a - top)
    w_b = torch.exp(lse_b - top)
    total = w_a + w_b  # in [1, 2], 0 where both are empty, NaN where either is NaN
    inv = torch.where(total == 0, torch.zeros_like(total), total.reciprocal())
    return w_a * inv, w_b * inv, top + torch.log(total)


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
    p_a, p_b, lse = merge_weights(lse_a, lse_b.to(lse_a.dtype))
    dtype = out_a.dtype
    out = out_a * p_a.unsqueeze(-1).to(dtype) + out_b.to(dtype) * p_b.unsqueeze(-1).to(dtype)
    return out, lse
