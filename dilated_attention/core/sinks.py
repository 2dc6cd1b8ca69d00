"""Attention sinks: one learned logit per query head, a virtual key with zero value.

Note [Local windows, soft-capping and sinks]
    The public semantics (every path: dense, dilated, block-sparse, decoding):

    * ``window_size=(left, right)`` (FlashAttention's convention, ``-1`` = unbounded on that
      side): position ``p`` sees key ``t`` iff ``p - left <= t <= p + right``, intersected with
      causality and every other mask. Hugging Face's ``sliding_window = W`` is ``(W - 1, 0)``
      with causal attention. Kernels apply it to their rows (``contract.Window``).
    * ``softcap=c``: every scaled score ``s`` becomes ``c * tanh(s / c)`` before the softmax
      (Gemma 2), in the kernels (Note [Scores a kernel call transforms] in ``contract.py``).
    * ``sinks`` (H,): per query head a logit ``z_h`` that joins every row's denominator as a key
      whose value is zero (gpt-oss): ``out_p = sum_t e^{s_pt} v_t / (e^{z_h} + sum_t e^{s_pt})``.

    A sink is a branch of its own: a "key" every row sees, whose partial result is ``(o, lse) =
    (0, z_h)``. So it joins the result of a whole call exactly like any branch joins the merge
    (LongNet Eq. 10), once per row whatever the branches, segments or ring steps before it:
    ``lse' = logaddexp(lse, z)``, ``out' = out * exp(lse - lse')`` (:func:`fold_sinks`). The
    reported ``lse`` includes it. The backward of every kernel takes the merged statistics
    (Note [Backward with external statistics] in ``reference.py``): given ``out'`` and
    ``lse'`` it yields the exact gradients of q, k and v with the sink in the denominator (the
    sink's value is zero, so it adds nothing to ``rowsum(dout * out')``). The sink's own
    gradient is ``dz_h = -sum_{b,p} exp(z_h - lse'_{b,h,p}) * (dout . out')_{b,p,h}``
    (:func:`sink_gradient`). Rows that see no key give ``out' = 0`` and ``lse' = z_h``.

Shape legend: B batch, Nq query rows, H query heads, D head dim.
"""

from __future__ import annotations

import torch


def fold_sinks(
    out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sinks joined to a call's result (Note [Local windows, soft-capping and sinks]).

    Args:
        out: (B, Nq, H, D) merged output of every key the rows see.
        lse: (B, H, Nq) float32 (float64 for float64 inputs) merged log-sum-exp.
        sinks: (H,) logits.

    Returns:
        ``out'`` (B, Nq, H, D) in ``out``'s dtype and ``lse'`` (B, H, Nq) in ``lse``'s.
    """
    z = sinks.detach().to(lse.dtype)[None, :, None]
    joined = torch.logaddexp(lse, z)
    # exp(-inf - finite) = 0 for rows without keys; a NaN lse stays NaN.
    weight = torch.exp(lse - joined).transpose(1, 2).unsqueeze(-1)
    # One pass, computed in the weight's precision and rounded once to out's dtype (a float32
    # copy of out would cost three more passes over the largest tensor of the call).
    scaled = torch.empty_like(out)
    torch.mul(out, weight, out=scaled)
    return scaled, joined


def sink_gradient(
    dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """``d loss / d sinks`` (H,) in ``sinks``' dtype, from the upstream gradient ``dout`` and
    the sink-joined ``out`` (B, Nq, H, D) and ``lse`` (B, H, Nq) of :func:`fold_sinks`."""
    delta = torch.einsum(  # (B, H, Nq), accumulated in lse's precision
        "bnhd,bnhd->bhn", dout.to(lse.dtype), out.to(lse.dtype)
    )
    share = torch.exp(sinks.detach().to(lse.dtype)[None, :, None] - lse)
    return -(share * delta).sum(dim=(0, 2)).to(sinks.dtype)
