"""What torch's Transformer layers pass to their attention module and read from it.

:class:`~dilated_attention.modules.MultiheadAttention` stands in for ``nn.MultiheadAttention``
inside ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer``: this module holds the
placeholder for the packed projection those layers read (Note [torch fast paths]) and the
readers of the masks they pass (a causal ``attn_mask``, a float ``key_padding_mask``).

Shape legend: B batch, L = N seq_len.
"""

from __future__ import annotations

import torch

__all__ = ["NO_PACKED_PROJECTION", "NoPackedProjection", "bool_key_padding_mask", "is_causal_mask"]


# Note [torch fast paths]
# ~~~~~~~~~~~~~~~~~~~~~~~
# nn.TransformerEncoderLayer (and nn.TransformerEncoder) in eval mode may skip ``self_attn``
# altogether: they call torch's fused kernels (``torch._transformer_encoder_layer_fwd``, or turn
# padded input into nested tensors) with ``self_attn.in_proj_weight`` / ``in_proj_bias``, which
# would silently compute dense attention. They decide from attributes of ``self_attn``
# (``why_not_sparsity_fast_path`` in torch/nn/modules/transformer.py):
#   * ``_qkv_same_embed_dim = False`` (true here: q/k/v are separate ``nn.Linear``s, nothing is
#     packed) stops the layer's fast path, and makes an ``nn.TransformerEncoder`` built around
#     such a layer turn off its nested-tensor path (torch warns that it does).
#   * An encoder built around stock ``nn.MultiheadAttention`` and swapped afterwards keeps its
#     nested-tensor path switched on; it then reads ``in_proj_weight`` and bails out only when
#     some argument "has_torch_function" or requires grad. ``None`` (what
#     ``nn.MultiheadAttention`` holds when nothing is packed) crashes there under grad
#     (``None.requires_grad``) and lets nested tensors through under ``no_grad``. So
#     ``in_proj_weight`` and ``in_proj_bias`` are a placeholder that defines
#     ``__torch_function__``: torch then always takes the ordinary path, which calls this
#     module's forward; any other use of the placeholder raises an error naming q/k/v_proj.


class NoPackedProjection:
    """Placeholder for ``nn.MultiheadAttention``'s packed ``in_proj_weight``/``in_proj_bias``.

    See Note [torch fast paths]. Any torch function given it, and any attribute read from it,
    raises an error that points to the separate ``q_proj``, ``k_proj`` and ``v_proj``.
    """

    __slots__ = ()
    _WHY = (
        "this layer has no packed in_proj_weight / in_proj_bias (nn.MultiheadAttention's "
        "(3 * embed_dim, embed_dim) projection): its query/key/value projections are the separate "
        "nn.Linear modules q_proj, k_proj and v_proj; use those"
    )

    @classmethod
    def __torch_function__(
        cls,
        func: object,
        types: object,
        args: object = (),
        kwargs: object = None,
    ) -> object:
        raise TypeError(f"{getattr(func, '__name__', func)} got a placeholder: {cls._WHY}")

    def __getattr__(self, name: str) -> object:
        raise AttributeError(f"in_proj_weight/in_proj_bias has no attribute {name!r}: {self._WHY}")

    def __repr__(self) -> str:
        return "<no packed in_proj: see q_proj, k_proj, v_proj>"


NO_PACKED_PROJECTION = NoPackedProjection()


def is_causal_mask(mask: torch.Tensor) -> bool:
    """Whether a checked (L, L) ``attn_mask`` is exactly the causal mask.

    Bool: ``True`` (masked) exactly above the diagonal. Float: ``-inf`` exactly above the diagonal
    and ``0`` elsewhere (``nn.Transformer.generate_square_subsequent_mask``; also what torch's
    layers turn a bool mask into). One O(L^2) comparison and one host sync.
    """
    n = mask.shape[-1]
    future = torch.ones(n, n, dtype=torch.bool, device=mask.device).triu_(1)
    if mask.dtype == torch.bool:
        return torch.equal(mask, future)
    causal = torch.zeros(n, n, dtype=mask.dtype, device=mask.device)
    return torch.equal(mask, causal.masked_fill_(future, float("-inf")))


def bool_key_padding_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A float ``key_padding_mask`` as torch's layers pass it (``F._canonical_mask``: ``-inf`` =
    ignore, ``0`` = keep) turned into the bool form; anything else is returned unchanged for
    :func:`_validation.check_key_padding_mask` to judge."""
    if not isinstance(mask, torch.Tensor) or not mask.is_floating_point():
        return mask
    ignore = torch.isneginf(mask)
    if not bool((ignore | (mask == 0)).all()):
        raise ValueError(
            "key_padding_mask as a float tensor must hold only 0 (keep) and -inf (ignore that "
            "key), as torch's layers pass it; other additive biases are not supported, got values "
            f"in [{mask.min().item()}, {mask.max().item()}]; pass a bool mask (True = ignore)"
        )
    return ignore
