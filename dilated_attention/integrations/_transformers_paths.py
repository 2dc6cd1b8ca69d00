"""The computing paths of the transformers integration (``integrations/transformers.py``):
self-attention on padded rows, cross-attention over an encoder's keys, and layers kept on
transformers' own attention. Tensors: q (B, Nq, H, D) and k, v (B, Nk, Hkv, D) views unless a
function says it takes transformers' (B, H, N, D) layout.

Note [Padded rows shifted to the start]
    Dilated attention cuts segments by position, so a padded row is computed on its own tokens:
    its real span ``[start, end)`` is rotated to ``[0, end - start)`` (a gather), the batch runs
    as one call whose key padding mask hides each row's tail, and the output is rotated back,
    its padding rows set to zero. Each real row then equals its sequence alone: segments start
    at the row's first real token, and a segment that reaches into the hidden tail holds the
    same real rows as the shorter last segment of the sequence alone (Note [Effective
    branches] in ``core/segment.py``: ``w`` past the end is one segment). Nothing here reads a
    tensor's values on the host, so ``torch.compile`` keeps one graph; the check that a mask
    has no gaps does read them.

    A decoding call (fewer queries than keys) cannot be rotated this way, since its queries are
    the last key positions of every row: its rows are grouped by span instead, one call per
    group on that span (which reads the spans on the host).

Note [Packed rows from transformers]
    transformers packs sequences into one row (``DataCollatorWithFlattening``) and says where
    they start in two ways: FlashAttention's offsets as ``cu_seq_lens_q`` / ``cu_seq_lens_k``
    (``return_flash_attn_kwargs=True``), or position ids that restart at each sequence. Either
    becomes the ``cu_seqlens`` of dilated attention (Note [Packed documents] in
    ``core/documents.py``), so each sequence gets exactly what it gets alone. Position ids are
    read on the host (where they step by anything but 1, a sequence starts; every row starts
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
    real tokens start after
    its padding slots, which its mask's leading ``False`` count. That is the static decode
    step's input (Note [A decode step with static shapes] in ``core/static_cache.py``) with
    buffers of as many rows as keys, position ``x`` of row ``b`` at slot ``x + pad_b``: it
    computes the call from the position ids and the mask on the device, with no host
    synchronization and the same shapes at every position, so
    ``torch.compile`` of a static-cache decoding step keeps the attention in its one graph (the
    sliced keys of the general path read the positions on the host: a graph break per layer
    and a new graph per length). It is taken under ``torch.compile`` without gradients (the
    step has none); eager calls keep the general path.

Note [Context parallel transformers]
    With ``use_dilated_attention(..., context_parallel=group)`` every self-attention call runs
    ``ring_dilated_attention`` over ``group`` (Note [Context parallel groups] in
    ``distributed/context.py``): each rank's model holds its shard of the sequence, rotated by
    the global ``position_ids`` the caller passes, and the call returns that shard of the exact
    one-process result. Training and evaluation over whole sequences only: a padding mask, a
    cache (keys other than the call's own), packed rows and attention dropout raise
    ``ValueError``, on this rank, before the ring call's agreement (call them on every rank
    alike).

Note [Cross-attention in encoder-decoder models]
    A decoder's cross-attention reads the encoder's keys: query positions and key positions are
    of different sequences, so dilated segments (which pair rows by position) have no meaning
    there. It runs as dense attention over the encoder's keys with the encoder's padding mask,
    which is what the model computes with SDPA. A layer is taken for cross-attention when it says
    so (``is_cross_attention``), when its class is a ``CrossAttention``, or when it is a
    decoder's layer that is not causal (BART, Whisper and their copies); a layer stored under a
    cross-attention name (``encoder_attn``, ``crossattention``, ...) that none of these marks is
    refused up front, so that no cross-attention runs as dilated self-attention.

Note [Layers kept on transformers' attention]
    transformers' ``sliding_window=W`` lets a query see the W keys ending at itself, so a window
    covers the whole call when the call has at most W keys, and the layer is then plain causal
    attention: it runs dilated. A chunked layer (Llama 4: ``config.layer_types[layer_idx] ==
    "chunked_attention"``, chunks of ``config.attention_chunk_size`` tokens counted from each
    row's first real token) is plain causal attention when its keys start at the sequence's
    first position (no cache dropped any) and fit in one chunk. A longer call, soft-capped
    scores (Gemma 2) or attention sinks (gpt-oss: ``s_aux``, the layer's ``sinks``) cannot be
    computed by dilated attention (:func:`unsupported_reason` decides it, in one place); with
    ``keep_unsupported_layers`` such a call runs transformers' SDPA attention (the model's own
    eager attention for soft-capping and sinks) with the mask the layer would get from
    transformers: key ``j`` is seen by query ``i`` (both tensor positions, the queries being the
    last ones) when it is real, ``j <= i`` if causal, ``i - j < window``, and both lie in one
    chunk (counted from the row's first real token, whose tensor position is negative where a
    cache dropped it). Query rows that see no key are padding and give zeros, as on the dilated
    path. :func:`use_dilated_attention` warns which layers this concerns, from the layers'
    attributes (:func:`kept_layers`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from ..distributed import ring_dilated_attention
from ..functional import attention, dilated_attention
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
    schedule: tuple[list[int], list[int]], run: dict[str, Any], check: bool,
) -> torch.Tensor:  # fmt: skip
    """Dilated attention of a padded batch, each row on its own tokens (Note [Padded rows
    shifted to the start]).

    Args:
        q: (B, Nq, H, D); k, v: (B, Nk, Hkv, D), Nq <= Nk (the queries are the last positions).
        mask: (B, Nk) bool, ``True`` for a real token.
        schedule: ``(segment_lengths, dilation_rates)``.
        run: keyword arguments of :func:`~dilated_attention.dilated_attention`.
        check: refuse masks with gaps.

    Returns:
        (B, Nq, H, D), zeros at padding query rows.
    """
    if q.shape[1] != k.shape[1]:
        return _grouped_rows(q, k, v, mask, schedule, run, check)
    start, count = _spans(mask, check)
    n = mask.shape[1]
    index = torch.arange(n, device=mask.device)
    real = index[None] < count[:, None]  # (B, N) after the rotation
    src = (index[None] + start[:, None]) % n
    q, k, v = (_rotate(x, src) for x in (q, k, v))
    out = dilated_attention(q, k, v, *schedule, key_padding_mask=~real, **run)
    out = torch.where(real[:, :, None, None], out, out.new_zeros(()))
    return _rotate(out, (index[None] - start[:, None]) % n)


def _grouped_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
    schedule: tuple[list[int], list[int]], run: dict[str, Any], check: bool,
) -> torch.Tensor:  # fmt: skip
    """Decoding rows grouped by the span of their real keys, one call per group on that span
    (Note [Padded rows shifted to the start]); arguments as :func:`padded_rows`."""
    start, count = _spans(mask, check)
    first_query = k.shape[1] - q.shape[1]
    out = q.new_zeros(q.shape)
    spans = torch.stack([start, start + count], dim=1)
    host_read(
        "the spans of padded rows (a call of several new tokens per row after a cache)",
        "decode one new token per row, or call the model eagerly",
    )
    for span in torch.unique(spans, dim=0).tolist():
        s, e = span
        rows = (spans == spans.new_tensor(span)).all(dim=1).nonzero().flatten()
        q_lo = max(first_query, s)
        if q_lo >= e:
            continue  # every query of these rows is padding
        part = dilated_attention(
            q[rows, q_lo - first_query : e - first_query], k[rows, s:e], v[rows, s:e],
            *schedule, **run,
        )  # fmt: skip
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


def chunk_size(module: nn.Module) -> int | None:
    """The chunk of ``module``'s layer when it attends within chunks (Llama 4's chunked
    attention: ``config.layer_types[layer_idx] == "chunked_attention"``), else None."""
    config = getattr(module, "config", None)
    layer = getattr(module, "layer_idx", None)
    types = getattr(config, "layer_types", None)
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk is None or layer is None or not types or layer >= len(types):
        return None
    return int(chunk) if types[layer] == "chunked_attention" else None


def layer_name(module: nn.Module) -> str:
    """``module``'s class and layer index, for messages."""
    layer = getattr(module, "layer_idx", None)
    return type(module).__name__ + ("" if layer is None else f" (layer {layer})")


def unsupported_reason(
    module: nn.Module, keys: int, kwargs: dict[str, Any], offset: int = 0
) -> str | None:
    """Why dilated attention cannot compute this call of ``module`` exactly (Note [Layers kept on
    transformers' attention]), or ``None``. The one place that decides it.

    Args:
        keys: the call's filled keys.
        kwargs: the call's keyword arguments (``softcap``, ``s_aux``, ``sliding_window``).
        offset: the absolute position of the first key (a sliding cache dropped the ones
            before it).
    """
    name = layer_name(module)
    if kwargs.get("softcap") is not None:
        return f"{name} soft-caps its attention scores (softcap={kwargs['softcap']})"
    if kwargs.get("s_aux") is not None:
        return (
            f"{name} adds attention sinks to its softmax (s_aux, the layer's sinks: one logit "
            f"per head in every row's denominator)"
        )
    window = kwargs.get("sliding_window")
    if window is not None and keys > window:
        return (
            f"{name} attends within a sliding window of {window} tokens, and this call has "
            f"{keys} keys (a window as long as the keys or longer is plain causal attention, "
            f"which runs dilated)"
        )
    chunk = chunk_size(module)
    if chunk is not None and (offset != 0 or keys > chunk):
        return (
            f"{name} attends within chunks of {chunk} tokens (attention_chunk_size), and this "
            f"call's {keys} keys are not all in its first chunk (keys within one chunk are "
            f"plain causal attention, which runs dilated)"
        )
    return None


def _visible(
    module: nn.Module, batch: int, nq: int, nk: int, mask: torch.Tensor | None,
    first: torch.Tensor | None, causal: bool, window: int | None, device: torch.device,
) -> torch.Tensor:  # fmt: skip
    """(B, 1, Nq, Nk) bool: key ``j`` seen by query ``i`` (Note [Layers kept on transformers'
    attention]); ``first``: (B,) each row's first real token's key index."""
    q_pos = torch.arange(nq, device=device)[:, None] + (nk - nq)
    k_pos = torch.arange(nk, device=device)[None]
    visible = k_pos <= q_pos if causal else torch.ones(nq, nk, dtype=torch.bool, device=device)
    if window is not None:
        visible = visible & (k_pos > q_pos - window)
    visible = visible[None].expand(batch, nq, nk)
    chunk = chunk_size(module)
    if chunk is not None:
        start = torch.zeros(batch, dtype=torch.long, device=device) if first is None else first
        start = start[:, None, None]
        visible = visible & ((k_pos[None] - start) // chunk == (q_pos[None] - start) // chunk)
    if mask is not None:
        visible = visible & mask[:, None, :]
    return visible[:, None]


def kept_attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    mask: torch.Tensor | None, *, causal: bool, dropout: float, scaling: float | None,
    kwargs: dict[str, Any], first: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """A call of a kept layer on transformers' attention (Note [Layers kept on transformers'
    attention]).

    Args:
        query: (B, H, Nq, D); key, value: (B, Hkv, Nk, D) (transformers' layout), Nq <= Nk.
        mask: (B, Nk) bool, ``True`` for a real token, or None.
        kwargs: the call's keyword arguments (``sliding_window``, ``softcap``, ``s_aux``).
        first: (B,) int, the key index of each row's first real token (negative where a
            sliding cache dropped it), from which chunks count; None: 0.

    Returns:
        (B, Nq, H, D), zeros at query rows that see no key.

    Raises:
        ValueError: soft-capped scores or sinks in a model whose module has no
            ``eager_attention_forward``.
    """
    nq, nk = query.shape[2], key.shape[2]
    visible = _visible(
        module, query.shape[0], nq, nk, mask, first, causal, kwargs.get("sliding_window"),
        query.device,
    )  # fmt: skip
    seen = visible.any(dim=-1, keepdim=True)  # (B, 1, Nq, 1)
    visible = visible | ~seen  # a row that sees nothing is padding: finite here, zero below
    softcap = kwargs.get("softcap")
    if softcap is None and kwargs.get("s_aux") is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        out, _ = sdpa_attention_forward(
            module, query, key, value, visible, dropout=dropout, scaling=scaling, is_causal=False
        )
    else:  # the model's eager attention, which soft-caps and adds its sinks
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if eager is None:
            raise ValueError(
                f"{layer_name(module)} soft-caps its scores or adds sinks, and its module has no "
                f"eager_attention_forward to run it on; keep this model on its own attention"
            )
        bias = torch.zeros(visible.shape, dtype=query.dtype, device=query.device)
        bias = bias.masked_fill(~visible, torch.finfo(query.dtype).min)
        extra = {} if softcap is None else {"softcap": softcap}
        out, _ = eager(module, query, key, value, bias, dropout=dropout, scaling=scaling, **extra)
    return torch.where(seen[:, 0, :, :, None], out, out.new_zeros(()))


def kept_layers(model: nn.Module) -> tuple[list[tuple[str, str, bool]], int]:
    """The self-attention layers of ``model`` that ``keep_unsupported_layers`` runs on
    transformers' attention, as ``(name, which calls, every call)``, and the number of
    self-attention layers; from the layers' attributes, as :func:`unsupported_reason` finds them
    in each call's arguments."""
    kept: list[tuple[str, str, bool]] = []
    layers = 0
    for name, module in model.named_modules():
        if getattr(module, "layer_idx", None) is None or "Attention" not in type(module).__name__:
            continue
        if is_cross_attention(module):
            continue
        layers += 1
        config = getattr(module, "config", None)
        softcap = getattr(module, "attn_logit_softcapping", None)
        window = getattr(module, "sliding_window", getattr(config, "sliding_window", None))
        chunk = chunk_size(module)
        if softcap is not None:
            kept.append((name, f"every call: soft-capped scores, softcap={softcap}", True))
        elif isinstance(getattr(module, "sinks", None), torch.Tensor):
            kept.append((name, "every call: attention sinks", True))
        elif isinstance(window, int):
            kept.append((name, f"calls of more than {window} keys: a sliding window", False))
        elif chunk is not None:
            kept.append((name, f"calls beyond its first {chunk}-token chunk", False))
    return kept, layers


def context_parallel_rows(
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    kwargs: dict[str, Any],
    group: Any,
    schedule: tuple[list[int], list[int]],
    run: dict[str, Any],
    reason: str | None,
) -> torch.Tensor:
    """A self-attention call over a sequence sharded across ``group`` (Note [Context parallel
    transformers]): q (B, n, H, D), k and v (B, n, Hkv, D) this rank's shard -> (B, n, H, D).

    Raises:
        ValueError: a call dilated attention cannot compute, a padding mask, a cache, packed
            rows, or dropout.
    """
    q, k, v = qkv
    refused = reason
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
    out = ring_dilated_attention(
        q, k, v, *schedule, group=group, is_causal=run["is_causal"], scale=run.get("scale")
    )
    assert isinstance(out, torch.Tensor)  # return_lse=False
    return out
