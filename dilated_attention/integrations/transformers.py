"""Dilated attention inside Hugging Face ``transformers`` models (optional: needs
``transformers``, imported only when these functions run).

    from dilated_attention.integrations.transformers import use_dilated_attention

    use_dilated_attention(model, segment_lengths=[2048, 4096], dilation_rates=[1, 2])

Note [Hugging Face attention]
    transformers calls an attention function per layer with (B, H, Nq, D) queries and
    (B, Hkv, Nk, D) keys and values (in decoding, the cache's), and the mask that the mask
    function registered under the same name built. :func:`register` adds
    :func:`attention_forward` with transformers' 2-D padding mask function (the one of its flash
    attention): the mask arrives as (B, Nk) bool, ``True`` for a real token, or ``None`` when
    nothing is padded. The (B, H, N, D) tensors are read as (B, N, H, D) views, without a copy.

    A dilated layer cuts segments by position, so a padded row must be computed on its own
    tokens, not on the padded tensor (left padding would shift every segment: logits off by 20
    in a first attempt). Rows are grouped by the span ``[start, end)`` of their real keys; each
    group is one call on that span, which is exactly that sequence alone. The queries are the
    last ``Nq`` key positions (prefill: all of them; decoding: the new tokens); query rows outside
    their span are padding and give zeros. A mask whose real keys do not form one span (packed
    sequences) raises ``ValueError``. A static cache's slots past the mask's length are unfilled
    and are left out.

    The schedule lives in the model's config: ``dilated_segment_lengths`` and
    ``dilated_dilation_rates``, one list for every layer or one list per layer (read at
    ``module.layer_idx``), so a saved model keeps it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .. import _validation as V
from ..functional import dilated_attention

#: The attention implementation name under which :func:`register` adds the functions.
NAME = "dilated"
#: Config attributes holding the schedule (Note [Hugging Face attention]).
SEGMENTS_ATTR, RATES_ATTR = "dilated_segment_lengths", "dilated_dilation_rates"
#: Config attribute: whether position ids are checked for packed sequences (default True).
CHECK_POSITIONS_ATTR = "dilated_check_positions"


def register(name: str = NAME) -> str:
    """Register :func:`attention_forward` and its 2-D padding mask function with transformers'
    ``AttentionInterface`` / ``AttentionMaskInterface`` under ``name``; returns ``name``.

    Raises:
        ImportError: transformers is not installed (``pip install transformers``).
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    except ImportError as exc:
        raise ImportError(
            f"dilated_attention.integrations.transformers needs transformers: pip install "
            f"transformers ({exc})"
        ) from exc
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name


def use_dilated_attention(
    model: nn.Module,
    segment_lengths: Sequence[int] | Sequence[Sequence[int]],
    dilation_rates: Sequence[int] | Sequence[Sequence[int]],
    *,
    check_positions: bool = True,
) -> nn.Module:
    """Run every attention layer of a transformers ``model`` as dilated attention; returns the
    model.

    Args:
        model: a transformers ``PreTrainedModel``.
        segment_lengths: ``w`` per branch for every layer, or one such list per layer.
        dilation_rates: ``r`` per branch, likewise.
        check_positions: refuse position ids that restart within a row (packed sequences,
            which dilated attention would segment wrongly). The check reads the ids, so under
            ``torch.compile`` it breaks the graph in every layer; pass False, only for models
            that never see packed rows, for one graph (``fullgraph=True``).

    Raises:
        ValueError: a bad schedule (per layer: the layer is named), or a per-layer schedule
            whose length is not the model's number of layers.
        TypeError: ``model`` is not a transformers model.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise TypeError(
            f"model must be a transformers PreTrainedModel, got {type(model).__name__}; for "
            f"this library's own layers use dilated_attention.create_multihead_dilated_attention"
        )
    segs, rates = _schedule_lists(segment_lengths, dilation_rates)
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(segs[0], list) and layers is not None and len(segs) != layers:
        raise ValueError(
            f"a per-layer schedule needs one list per layer: the model has {layers} layers, got "
            f"{len(segs)} lists of segment_lengths; or pass one list for every layer"
        )
    if not isinstance(check_positions, bool):
        raise TypeError(f"check_positions must be a bool, got {check_positions!r}")
    setattr(config, SEGMENTS_ATTR, segs)
    setattr(config, RATES_ATTR, rates)
    setattr(config, CHECK_POSITIONS_ATTR, check_positions)
    model.set_attn_implementation(register())
    return model


def _schedule_lists(segment_lengths: Any, dilation_rates: Any) -> tuple[list, list]:
    """Checked ``(segments, rates)``: two lists of ints, or two lists of per-layer lists."""
    per_layer = isinstance(segment_lengths, Sequence) and all(
        isinstance(s, Sequence) for s in segment_lengths
    )
    if not per_layer:
        segs, rates = V.check_branches(segment_lengths, dilation_rates)
        return list(segs), list(rates)
    if not isinstance(dilation_rates, Sequence) or len(dilation_rates) != len(segment_lengths):
        raise ValueError(
            f"per-layer schedules need as many dilation_rates lists as segment_lengths lists, "
            f"got {len(segment_lengths)} and {dilation_rates!r}"
        )
    checked = []
    for layer, (s, r) in enumerate(zip(segment_lengths, dilation_rates, strict=True)):
        try:
            checked.append(V.check_branches(s, r))
        except ValueError as exc:
            raise ValueError(f"layer {layer}'s schedule: {exc}") from exc
    return [list(s) for s, _ in checked], [list(r) for _, r in checked]


def _layer_schedule(module: nn.Module) -> tuple[list[int], list[int]]:
    """The schedule of ``module``'s layer from its config (Note [Hugging Face attention])."""
    config = getattr(module, "config", None)
    segs, rates = getattr(config, SEGMENTS_ATTR, None), getattr(config, RATES_ATTR, None)
    if segs is None or rates is None:
        raise ValueError(
            f"{type(module).__name__} runs dilated attention but its config has no "
            f"{SEGMENTS_ATTR} / {RATES_ATTR}; set them with use_dilated_attention(model, "
            f"segment_lengths, dilation_rates)"
        )
    if segs and isinstance(segs[0], list):
        layer = getattr(module, "layer_idx", None)
        if layer is None:
            raise ValueError(
                f"{type(module).__name__} has no layer_idx to pick its per-layer schedule; pass "
                f"one schedule for every layer"
            )
        return segs[layer], rates[layer]
    return segs, rates


def _real_spans(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) start and end of each row's real keys in a (B, Nk) bool mask (``True`` = real).

    Raises:
        ValueError: a row's real keys are not one contiguous span.
    """
    keys = mask.shape[1]
    index = torch.arange(keys, device=mask.device)
    count = mask.sum(dim=1)
    start = torch.where(mask, index, keys).amin(dim=1)
    end = torch.where(mask, index + 1, 0).amax(dim=1)
    broken = (end - start != count) & (count > 0)
    if bool(broken.any()):
        row = int(broken.nonzero()[0])
        raise ValueError(
            f"dilated attention needs each row's real tokens to be one span (left or right "
            f"padding); row {row} of the attention mask has gaps. Pad each sequence on one side, "
            f"or run packed sequences as separate rows"
        )
    return start, torch.maximum(end, start)


def _filled_keys(
    mask: torch.Tensor | None, positions: torch.Tensor | None, keys: int, check: bool = True
) -> int:
    """How many of the ``keys`` slots hold tokens: the mask's length, else one past the last
    query's position (a static cache has more slots than tokens and, unpadded, no mask); all of
    them when the queries are as many as the slots (no cache beyond them). ``check``: refuse
    position ids that restart within a row (a data-dependent test: ``torch.compile`` breaks the
    graph there, in every layer).

    Raises:
        ValueError: position ids that restart within a row (packed sequences), with ``check``.
    """
    if mask is not None:
        return min(mask.shape[1], keys)
    if positions is None or positions.numel() == 0:
        return keys
    if check and positions.shape[-1] > 1 and bool((positions.diff(dim=-1) != 1).any()):
        raise ValueError(
            "dilated attention cannot run packed sequences (position_ids restart within a row): "
            "segments follow each sequence's positions; give each sequence its own row"
        )
    if positions.shape[-1] == keys:  # every slot is one of these positions: no cache beyond them
        return keys
    return min(int(positions[..., -1].max()) + 1, keys)


def attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function contract, computed as dilated attention (Note [Hugging
    Face attention]).

    Args:
        module: the calling attention module (its ``config`` holds the schedule; ``is_causal``
            and ``layer_idx`` are read when present).
        query: (B, H, Nq, D); key, value: (B, Hkv, Nk, D), Nq <= Nk (the queries are the last
            positions).
        attention_mask: (B, Nk') bool, ``True`` for real tokens (Nk' <= Nk: a static cache's
            filled slots), or None.
        dropout, scaling: attention-probability dropout and softmax scale.
        is_causal: overrides ``module.is_causal`` (default True).

    Returns:
        ``(out, None)`` with out (B, Nq, H, D).

    Raises:
        ValueError: a 4-D mask, sliding-window or soft-capped layers, a padding mask with gaps,
            or (from :func:`~dilated_attention.dilated_attention`) non-causal queries shorter
            than the keys.
    """
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise ValueError(
            f"{type(module).__name__} uses a sliding window or soft-capping, which dilated "
            f"attention does not compute; give such layers a one-branch schedule of their window "
            f"with the library's own modules, or keep them on sdpa"
        )
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    segs, rates = _layer_schedule(module)
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # (B, N, H, D) views
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f"dilated attention takes transformers' 2-D padding mask, got a "
            f"{attention_mask.dim()}-D mask; enable it with use_dilated_attention(...) (which "
            f"registers the mask function too), not by setting the attention implementation alone"
        )
    check = getattr(getattr(module, "config", None), CHECK_POSITIONS_ATTR, True)
    filled = _filled_keys(attention_mask, kwargs.get("position_ids"), k.shape[1], check)
    k, v = k[:, :filled], v[:, :filled]  # a static cache's unfilled slots are left out
    run = {"is_causal": causal, "scale": scaling, "dropout_p": dropout}
    if attention_mask is None or bool(attention_mask.all()):
        return dilated_attention(q, k, v, segs, rates, **run), None
    start, end = _real_spans(attention_mask.bool())
    first_query = k.shape[1] - q.shape[1]
    out = q.new_zeros(q.shape)
    spans = torch.stack([start, end], dim=1)
    for span in torch.unique(spans, dim=0).tolist():
        s, e = span
        rows = (spans == spans.new_tensor(span)).all(dim=1).nonzero().flatten()
        q_lo = max(first_query, s)
        if q_lo >= e:
            continue  # every query of these rows is padding
        part = dilated_attention(
            q[rows, q_lo - first_query : e - first_query], k[rows, s:e], v[rows, s:e], segs,
            rates, **run,
        )  # fmt: skip
        out[rows, q_lo - first_query : e - first_query] = part
    return out, None
