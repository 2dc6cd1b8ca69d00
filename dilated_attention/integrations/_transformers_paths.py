"""The computing paths of the transformers integration (``integrations/transformers.py``):
self-attention on padded, packed and cached rows, cross-attention over an encoder's keys,
context parallel rows, and layers kept on transformers' own attention. Tensors: q (B, Nq, H,
D) and k, v (B, Nk, Hkv, D) views unless a function says it takes transformers' (B, H, N, D)
layout.

Note [Padded rows shifted to the start]
    Dilated attention cuts segments by position, so a padded row is computed on its own tokens:
    its real span ``[start, end)`` is rotated to ``[0, end - start)`` (a gather), the batch runs
    as one call whose key padding mask hides each row's tail, and the output is rotated back,
    its padding rows set to zero. Each real row then equals its sequence alone: segments start
    at the row's first real token, and a segment that reaches into the hidden tail holds the
    same real rows as the shorter last segment of the sequence alone (Note [Effective
    branches] in ``core/geometry/segment.py``: ``w`` past the end is one segment). Nothing here
    reads a tensor's values on the host, so ``torch.compile`` keeps one graph; the check that a mask
    has no gaps does read them.

    A decoding call (fewer queries than keys) cannot be rotated this way, since its queries are
    the last key positions of every row: its rows are grouped by span instead, one call per
    group on that span (which reads the spans on the host). A local layer's window is relative
    (Note [What each layer computes] in ``_transformers_layer.py``): its padded rows, prefill
    or decoding, run as they are, the key padding mask hiding the padding.

Note [Packed rows from transformers]
    transformers packs sequences into one row (``DataCollatorWithFlattening``) and says where
    they start in two ways: FlashAttention's offsets as ``cu_seq_lens_q`` / ``cu_seq_lens_k``
    (``return_flash_attn_kwargs=True``), or position ids that restart at each sequence. Either
    becomes the ``cu_seqlens`` of dilated attention (Note [Packed documents] in
    ``core/geometry/documents.py``), so each sequence gets exactly what it gets alone. Position ids
    are read on the host (where they step by anything but 1, a sequence starts; every row starts
    one) unless a padding mask hides tokens (padded rows' position ids follow the padding);
    with ``check_positions=False`` they are not read, and rows are taken as one sequence each.
    Some models (Llama 4) give the attention no position ids: their packing comes from the mask
    function (Note [What the mask function passes on] in ``_transformers_masks.py``), which
    transformers gives it without a cache only (``use_cache=False``); with a cache such a model
    mixes the sequences on its stock attention too. Offsets with a padding mask that hides
    tokens are refused. Under ``torch.compile`` every such host read is a graph break whose
    message names the read and the fix, which ``fullgraph=True`` raises.

Note [Decoding with transformers' caches]
    A decoding call of one new token per row holds in its keys every slot up to the token's
    (a dynamic cache), or the token's cache slots and unfilled ones after them (a static cache),
    and its position ids say where each row is (in a model whose attention gets none, Llama 4,
    the mask function's slots do: a row's real filled slots, minus one). A left-padded row's
    real tokens start after its padding slots, which its mask's leading ``False`` count. That
    is the static decode step's input (Note [A decode step with static shapes] in
    ``core/decoding/static_cache.py``) with buffers of as many rows as keys, position ``x`` of row
    ``b`` at slot ``x + pad_b`` (``x + pad_b - offset`` modulo the slots where a sliding cache
    dropped ``offset`` keys and rolled the rest: a chunked layer's): it computes the call from
    the position ids and the mask on the device, with no host synchronization and the same
    shapes at every position, so ``torch.compile`` of a static-cache decoding step keeps the
    attention in its one graph (the sliced keys of the general path read the positions on the
    host: a graph break per layer and a new graph per length). It is taken under
    ``torch.compile`` without gradients (the step has none) by global and chunked layers
    without soft-capping or sinks; eager calls keep the general path.

Note [Context parallel transformers]
    With ``use_dilated_attention(..., context_parallel=group)`` every self-attention call runs
    ``ring_dilated_attention`` over ``group`` (Note [Context parallel groups] in
    ``distributed/context.py``): each rank's model holds its shard of the sequence, rotated by
    the global ``position_ids`` the caller passes, and the call returns that shard of the exact
    one-process result: a global layer's schedule (or MoBA, ``moba_ring_attention`` over the
    group's ring: Note [MoBA in a pretrained model] in ``_transformers_layer.py``), a chunked
    layer's branch ``(C, 1)`` and a local layer's window (``ring_attention``, which sends only
    the window's halo) over global positions, each with its soft-cap and sinks (a rank's sinks
    gradient is its rows' share: the shares sum to the one-process gradient). Training and
    evaluation over whole sequences only: a padding mask, a cache (keys other than the call's
    own), packed rows and attention dropout raise ``ValueError``, on this rank, before the ring
    call's agreement (call them on every rank alike).

Note [Cross-attention in encoder-decoder models]
    A decoder's cross-attention reads the encoder's keys: query positions and key positions are
    of different sequences, so dilated segments (which pair rows by position) have no meaning
    there. It runs as dense attention over the encoder's keys with the encoder's padding mask,
    which is what the model computes with SDPA. A layer is taken for cross-attention when it says
    so (``is_cross_attention``), when its class is a ``CrossAttention``, or when it is a
    decoder's layer that is not causal (BART, Whisper and their copies); a layer stored under a
    cross-attention name (``encoder_attn``, ``crossattention``, ...) that none of these marks is
    refused up front, so that no cross-attention runs as dilated self-attention.

Note [Chunks after a cache]
    A chunked layer's chunks count from each row's first real token, and its call computes the
    one branch ``(C, 1)`` over keys whose position 0 is a chunk's first token. A call of as
    many queries as keys (no cache before it) is rotated so (Note [Padded rows shifted to the
    start]). A call after a cache has its queries at the last key positions, and its keys may
    start after the row's first token (a sliding cache dropped the older ones: the mask
    function passes their offset) or at different tensor positions per row (left padding):
    its rows are grouped by their span and first token, and each group's keys are cut from the
    first chunk boundary at or before its first query, the queries staying the last positions
    (keys that a chunk reaches but the call lacks are masked, as transformers' mask leaves them
    out). Under ``torch.compile`` a one-token step without gradients is the static decode
    step instead, row ``b``'s position ``x`` at slot ``x + pad_b - offset`` modulo the slots
    (Note [Decoding with transformers' caches]).

Note [Layers kept on transformers' attention]
    Local windows, chunks, soft-capping and sinks run on this library (Note [What each layer
    computes] in ``_transformers_layer.py``). What remains is a learned position bias added to
    the scores (T5's ``position_bias``), which dilated attention does not compute: such a model
    is refused, or with ``keep_unsupported_layers`` its calls run transformers' SDPA attention
    with the bias and the mask the layer would get from transformers: key ``j`` is seen by
    query ``i`` (both tensor positions, the queries being the last ones) when it is real and,
    if causal, ``j <= i``. Query rows that see no key are padding and give zeros, as on the
    dilated path. :func:`use_dilated_attention` warns which layers this concerns, from the
    model's modules (:func:`kept_layers`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..distributed import moba_ring_attention, ring_attention, ring_dilated_attention
from ..distributed.rings.moba_ring import selection_group
from ..functional import attention
from ._transformers_layer import LayerAttention, layer_name
from ._transformers_masks import host_read, is_sequence_ids, sequence_offsets

#: Names under which transformers models store cross-attention layers (Note [Cross-attention
#: in encoder-decoder models]).
CROSS_ATTENTION_NAMES = frozenset(
    {"encoder_attn", "crossattention", "cross_attn", "cross_attention", "EncDecAttention"}
)


def is_cross_attention(module: nn.Module) -> bool:
    """Whether transformers calls ``module`` with an encoder's keys (Note [Cross-attention in
    encoder-decoder models])."""
    flag = getattr(module, "is_cross_attention", None)
    if isinstance(flag, bool):
        return flag
    if "CrossAttention" in type(module).__name__:
        return True
    return bool(getattr(module, "is_decoder", False)) and not bool(
        getattr(module, "is_causal", True)
    )


def unmarked_cross_attention(model: nn.Module) -> str | None:
    """The name of a transformers layer of ``model`` (one holding a ``config``) stored under a
    cross-attention name that :func:`is_cross_attention` does not mark, or ``None``."""
    for name, module in model.named_modules():
        named_cross = name.rsplit(".", 1)[-1] in CROSS_ATTENTION_NAMES
        if named_cross and hasattr(module, "config") and not is_cross_attention(module):
            return name
    return None


def cross_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
    run: dict[str, Any],
) -> torch.Tensor:  # fmt: skip
    """Dense attention of (B, Nq, H, D) decoder queries over (B, Nk, Hkv, D) encoder keys, with
    the (B, Nk) encoder mask (``True`` = real), or None; (B, Nq, H, D)."""
    ignore = None if mask is None else ~mask
    return attention(q, k, v, key_padding_mask=ignore, **run)


def _spans(mask: torch.Tensor, check: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) start and length of each row's real keys in a (B, Nk) bool mask (``True`` = real);
    a row without real keys starts at 0. ``check``: refuse a row whose real keys have gaps (a
    host read of the mask).

    Raises:
        ValueError: with ``check``, a row's real keys are not one contiguous span.
    """
    keys = mask.shape[1]
    index = torch.arange(keys, device=mask.device)
    count = mask.sum(dim=1)
    start = torch.where(mask, index, keys).amin(dim=1) % keys
    if check:
        host_read("the attention mask (a check that each row's real tokens are one span)")
        end = torch.where(mask, index + 1, 0).amax(dim=1)
        broken = (end - start != count) & (count > 0)
        if bool(broken.any()):
            row = int(broken.nonzero()[0])
            raise ValueError(
                f"dilated attention needs each row's real tokens to be one span (left or right "
                f"padding); row {row} of the attention mask has gaps. Pad each sequence on one "
                f"side, or run packed sequences as separate rows"
            )
    return start, count


def _rotate(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[b, index[b, p]]`` for (B, N, H, D) ``x`` and (B, N) ``index``."""
    return x.gather(1, index[:, :, None, None].expand(-1, -1, x.shape[2], x.shape[3]))


def padded_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
    layer: LayerAttention, run: dict[str, Any], check: bool, first: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """A layer's attention over a padded batch, each row on its own tokens (Note [Padded rows
    shifted to the start]; a local layer: Note [What each layer computes]).

    Args:
        q: (B, Nq, H, D); k, v: (B, Nk, Hkv, D), Nq <= Nk (the queries are the last positions).
        mask: (B, Nk) bool, ``True`` for a real token.
        layer: what the layer computes.
        run: the call's ``is_causal``, ``scale`` and ``dropout_p``.
        check: refuse masks with gaps.
        first: (B,) the key index of each row's first real token (negative where a sliding
            cache dropped it), from which a chunked layer's chunks count; None: the mask's.

    Returns:
        (B, Nq, H, D), zeros at padding query rows.
    """
    if layer.schedule is None:  # a window is relative: the mask alone is exact
        out = layer(q, k, v, key_padding_mask=~mask, **run)
        real = mask[:, k.shape[1] - q.shape[1] :, None, None]
        return torch.where(real, out, out.new_zeros(()))
    if q.shape[1] != k.shape[1]:
        return _grouped_rows(q, k, v, mask, layer, run, check, first)
    start, count = _spans(mask, check)
    n = mask.shape[1]
    index = torch.arange(n, device=mask.device)
    real = index[None] < count[:, None]  # (B, N) after the rotation
    src = (index[None] + start[:, None]) % n
    q, k, v = (_rotate(x, src) for x in (q, k, v))
    out = layer(q, k, v, key_padding_mask=~real, **run)
    out = torch.where(real[:, :, None, None], out, out.new_zeros(()))
    return _rotate(out, (index[None] - start[:, None]) % n)


def _grouped_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
    layer: LayerAttention, run: dict[str, Any], check: bool, first: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """Decoding rows grouped by the span of their real keys (and their first token), one call
    per group on that span (Note [Padded rows shifted to the start], Note [Chunks after a
    cache]); arguments as :func:`padded_rows`."""
    start, count = _spans(mask, check)
    first_query = k.shape[1] - q.shape[1]
    out = q.new_zeros(q.shape)
    spans = torch.stack([start, start + count, start if first is None else first], dim=1)
    host_read(
        "the spans of padded rows (a call of several new tokens per row after a cache)",
        "decode one new token per row, or call the model eagerly",
    )
    for span in torch.unique(spans, dim=0).tolist():
        s, e, head = span
        rows = (spans == spans.new_tensor(span)).all(dim=1).nonzero().flatten()
        q_lo = max(first_query, s)
        if q_lo >= e:
            continue  # every query of these rows is padding
        lo = s if layer.chunk is None else q_lo - (q_lo - head) % layer.chunk
        keys = [x[rows, max(lo, 0) : e] for x in (k, v)]
        hidden = None
        if lo < 0:  # keys of the chunk that the call lacks: masked, as transformers does
            keys = [torch.nn.functional.pad(x, (0, 0, 0, 0, -lo, 0)) for x in keys]
            hidden = torch.arange(e - lo, device=k.device).expand(len(rows), -1) < -lo
        part = layer(
            q[rows, q_lo - first_query : e - first_query], *keys, key_padding_mask=hidden, **run
        )
        out[rows, q_lo - first_query : e - first_query] = part
    return out


def packed_documents(
    kwargs: dict[str, Any],
    query: torch.Tensor,
    keys: int,
    mask: torch.Tensor | None,
    check: bool,
) -> list[int] | None:
    """The packed sequences' offsets over the batch's ``B * N`` positions (Note [Packed rows
    from transformers]) for q (B, Nq, H, D) and ``keys`` keys, or None for rows of one sequence.
    ``mask``: the call's (B, Nk) padding mask (where it hides tokens, position ids follow the
    padding and say nothing of packing), or the (B, N) sequence indices the mask function found
    (Note [What the mask function passes on] in ``_transformers_masks.py``).

    Raises:
        ValueError: ``cu_seq_lens_q`` and ``cu_seq_lens_k`` differ (or one is missing).
    """
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        host_read("cu_seq_lens_q / cu_seq_lens_k", "run packed batches eagerly")
        if cu_q is None or cu_k is None or cu_q.tolist() != cu_k.tolist():
            raise ValueError(
                "cu_seq_lens_q and cu_seq_lens_k must both be given and equal (self-attention "
                f"over packed sequences), got {cu_q!r} and {cu_k!r}"
            )
        return [int(x) for x in cu_q.tolist()]
    if mask is not None and is_sequence_ids(mask):
        host_read("the packed rows' sequence indices")
        return sequence_offsets(mask)
    positions = kwargs.get("position_ids")
    batch, n = query.shape[:2]
    if not check or positions is None or n != keys or n < 2:
        return None
    host_read("position_ids (a check for packed sequences)")
    if mask is not None and not bool(mask.all()):
        return None
    flat = positions.expand(batch, n).reshape(-1)
    starts = set(((flat.diff() != 1).nonzero().flatten() + 1).tolist())
    rows = {row * n for row in range(batch)}
    if starts <= rows:
        return None
    return sorted(starts | rows | {batch * n})


def packed_rows(
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    mask: torch.Tensor | None,
    documents: list[int],
    layer: LayerAttention,
    run: dict[str, Any],
) -> torch.Tensor:
    """Packed sequences (Note [Packed rows from transformers]): ``qkv`` q (B, N, H, D), k, v
    (B, N, Hkv, D) -> (B, N, H, D), each sequence as alone (its window, chunks and segments
    from its first token); ``mask``: the call's (B, N) padding mask or None; ``run``: the
    call's options.

    Raises:
        ValueError: a padding mask that hides tokens.
    """
    if mask is not None and not bool(mask.all()):
        raise ValueError(
            "packed sequences (cu_seq_lens or restarting position_ids) with a padding mask "
            "that hides tokens: pack without padding (DataCollatorWithFlattening does), or "
            "give each sequence its own row"
        )
    return layer(*qkv, cu_seqlens=documents, **run)


def in_place_positions(
    q: torch.Tensor,
    kwargs: dict[str, Any],
    mask: torch.Tensor | None,
    causal: bool,
    dropout: float,
) -> torch.Tensor | None:
    """The (B,) positions of a call that is one new token per row, which the static decode step
    computes over the cache's keys as they are, a left-padded row's padding slots skipped (Note
    [Decoding with transformers' caches]), or None: q (B, 1, H, D), ``mask`` the call's (B, Nk)
    padding mask (its real keys up to the query: the positions when no position ids came)."""
    if q.shape[1] != 1 or not causal or dropout:
        return None
    if not torch.compiler.is_compiling() or (torch.is_grad_enabled() and q.requires_grad):
        return None
    positions = kwargs.get("position_ids")
    if positions is None:
        return None if mask is None else mask.sum(dim=1) - 1
    if positions.dim() != 2 or positions.shape[-1] != 1:
        return None
    if positions.shape[0] not in (1, q.shape[0]):
        return None
    return positions[:, -1].expand(q.shape[0])


def kept_reason(module: nn.Module, kwargs: dict[str, Any]) -> str | None:
    """Why dilated attention cannot compute this call of ``module`` (Note [Layers kept on
    transformers' attention]), or ``None``: the one place that decides it. ``kwargs``: the
    call's keyword arguments (``position_bias``)."""
    if kwargs.get("position_bias") is not None:
        return (
            f"{layer_name(module)} adds a learned position bias (position_bias) to its scores, "
            f"which dilated attention does not compute"
        )
    return None


def kept_attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    mask: torch.Tensor | None, *, causal: bool, dropout: float, scaling: float | None,
    kwargs: dict[str, Any],
) -> torch.Tensor:  # fmt: skip
    """A call of a kept layer on transformers' SDPA attention (Note [Layers kept on
    transformers' attention]).

    Args:
        query: (B, H, Nq, D); key, value: (B, Hkv, Nk, D) (transformers' layout), Nq <= Nk.
        mask: (B, Nk) bool, ``True`` for a real token, or None.
        kwargs: the call's keyword arguments (``position_bias`` (1 or B, H, Nq, >= Nk)).

    Returns:
        (B, Nq, H, D), zeros at query rows that see no key.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    nq, nk = query.shape[2], key.shape[2]
    q_pos = torch.arange(nq, device=query.device)[:, None] + (nk - nq)
    k_pos = torch.arange(nk, device=query.device)[None]
    visible = (k_pos <= q_pos if causal else torch.ones_like(k_pos, dtype=torch.bool))[None]
    visible = visible.expand(query.shape[0], nq, nk)
    if mask is not None:
        visible = visible & mask[:, None, :]
    seen = visible.any(dim=-1)[:, None, :, None]  # (B, 1, Nq, 1)
    visible = visible[:, None] | ~seen  # a row that sees nothing is padding: zero below
    bias = kwargs.get("position_bias")
    bias = None if bias is None else bias[..., :nk]  # a static cache's unfilled slots
    out, _ = sdpa_attention_forward(
        module, query, key, value, visible, dropout=dropout, scaling=scaling, is_causal=False,
        position_bias=bias,
    )  # fmt: skip
    return torch.where(seen[:, 0, :, :, None], out, out.new_zeros(()))


def kept_layers(model: nn.Module) -> tuple[list[str], int]:
    """The attention layers of ``model`` that ``keep_unsupported_layers`` runs on transformers'
    attention (every one of a model that adds a learned position bias, as
    :func:`kept_reason` finds it in each call's arguments), and the number of attention
    layers."""
    layers = [
        name for name, module in model.named_modules()
        if getattr(module, "layer_idx", None) is not None and "Attention" in type(module).__name__
    ]  # fmt: skip
    biased = any(isinstance(getattr(m, "relative_attention_bias", None), nn.Module)
                 for m in model.modules())  # fmt: skip
    return (layers if biased else []), len(layers)


def context_parallel_rows(
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    kwargs: dict[str, Any],
    group: Any,
    layer: LayerAttention,
    run: dict[str, Any],
) -> torch.Tensor:
    """A self-attention call over a sequence sharded across ``group`` (Note [Context parallel
    transformers]): q (B, n, H, D), k and v (B, n, Hkv, D) this rank's shard -> (B, n, H, D).

    Raises:
        ValueError: a padding mask, a cache, packed rows, or dropout.
    """
    q, k, v = qkv
    refused = None
    if attention_mask is not None:
        refused = "a padding mask (context parallel layers take whole, unpadded sequences)"
    elif k.shape[1] != q.shape[1]:
        refused = "cached keys (context parallel layers train and evaluate, they do not decode)"
    elif kwargs.get("cu_seq_lens_q") is not None:
        refused = "packed sequences"
    elif run.get("dropout_p"):
        refused = f"attention dropout {run['dropout_p']} (the ring functions have none)"
    if refused is not None:
        raise ValueError(
            f"{refused}: a layer made context parallel (use_dilated_attention(..., "
            f"context_parallel=...)) runs every rank's shard of whole sequences; call it so, "
            f"or use the model without context_parallel"
        )
    options = {
        "group": group, "is_causal": run["is_causal"], "scale": run.get("scale"),
        "softcap": layer.softcap, "sinks": layer.sinks,
    }  # fmt: skip
    moba = layer.moba
    if moba is not None:  # causal (layer_attention checked it): Note [MoBA in a pretrained model]
        options["group"] = selection_group(group, layer.name)
        return moba_ring_attention(q, k, v, block_size=moba.block_size, topk=moba.topk,
                                   backend=moba.backend, **options)  # fmt: skip
    if layer.schedule is None:
        assert layer.window is not None  # a local layer
        out = ring_attention(q, k, v, window_size=(layer.window - 1, 0), **options)
    else:
        out = ring_dilated_attention(q, k, v, *layer.schedule, **options)
    assert isinstance(out, torch.Tensor)  # return_lse=False
    return out
