"""Dilated attention inside Hugging Face ``transformers`` models (optional: needs
``transformers``, imported only when these functions run).

    from dilated_attention.integrations.transformers import use_dilated_attention

    use_dilated_attention(model, segment_lengths=[2048, 4096], dilation_rates=[1, 2])
    # or MoBA in the global layers, with the model's own weights:
    # use_dilated_attention(model, sparse=BlockSelectedConfig(block_size=512, topk=2))
    model.save_pretrained(path)
    model = load_dilated_pretrained(AutoModelForCausalLM, path)  # reloads it dilated

Note [Hugging Face attention]
    transformers calls an attention function per layer with (B, H, Nq, D) queries and
    (B, Hkv, Nk, D) keys and values (in decoding, the cache's), and the mask that the mask
    function registered under the same name built. :func:`register` adds
    :func:`attention_forward` with :func:`padding_mask`, which passes on what transformers tells
    it of the call (Note [What the mask function passes on] in ``_transformers_masks.py``): a
    causal layer's mask arrives as (B, n) bool, ``True`` for a real token, covering every
    position up to the last query, or ``None``; packed rows as their sequence indices. The
    (B, H, N, D) tensors are read as (B, N, H, D) views, without a copy.

    Each layer computes what the model does: a local window, a chunk, or (a global layer) the
    dilated schedule, with the call's soft-cap and sinks (Note [What each layer computes] in
    ``_transformers_layer.py``). A dilated or chunked layer cuts segments by position, so a
    padded row is computed on its own tokens (Note [Padded rows shifted to the start] in
    ``_transformers_paths.py``; left padding would otherwise shift every segment: logits off
    by 20 in a first attempt). The queries are the last ``Nq`` key positions (prefill: all of
    them; decoding: the new tokens); query rows outside their span are padding and give zeros.
    A mask whose real keys do not form one span raises ``ValueError``; packed sequences run as
    packed documents (Note [Packed rows from transformers] in ``_transformers_paths.py``). A
    static cache's slots past the last query are unfilled and are left out. A decoder's
    cross-attention runs dense over the encoder's keys (Note [Cross-attention in encoder-decoder
    models]); a learned position bias (T5) raises, or with ``keep_unsupported_layers`` runs
    transformers' attention (Note [Layers kept on transformers' attention]).

    The schedule lives in the model's config (every config object its modules hold: an
    encoder-decoder model may give each half a copy): ``dilated_segment_lengths`` and
    ``dilated_dilation_rates``, one list for every layer or one list per layer (read at
    ``module.layer_idx``), or ``dilated_block_selected`` (MoBA's settings, a dict), so a saved
    model keeps it. :func:`use_dilated_attention` gives the model and its modules their own
    copies of the config objects, so that another model built from the same config stays as it
    was. The saved config also names this implementation
    (``attn_implementation``, :data:`SAVED_NAME`), so that ``from_pretrained`` of a saved model
    asks for it instead of running SDPA silently: transformers' ``ValueError`` for an
    unregistered name quotes it, and the name says to load with
    :func:`load_dilated_pretrained`, which registers the implementation and loads.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import _validation as V
from ..config import BlockSelectedConfig
from ..core.geometry.schedule import Schedule
from ..decode_step import decode_at
from ..distributed import ContextParallel
from ..distributed.context import check_group
from . import _transformers_layer as L
from . import _transformers_masks as M
from . import _transformers_paths as P
from ._transformers_masks import CHECK_POSITIONS_ATTR, padding_mask

#: The attention implementation name under which :func:`register` adds the functions.
NAME = "dilated"
#: The implementation a saved config names (Note [Hugging Face attention]): never registered,
#: so that transformers' error for it, which quotes it, says how to load the model.
SAVED_NAME = (
    f"{NAME} (load with dilated_attention.integrations.transformers.load_dilated_pretrained)"
)
#: Config attributes holding the schedule (Note [Hugging Face attention]).
SEGMENTS_ATTR, RATES_ATTR = "dilated_segment_lengths", "dilated_dilation_rates"
#: Config attribute holding MoBA's settings instead of a schedule (Note [MoBA in a pretrained
#: model] in ``_transformers_layer.py``): a dict of :class:`BlockSelectedConfig`'s fields.
SELECTED_ATTR = L.SELECTED_ATTR
#: Config attribute: whether layers dilated attention cannot compute run transformers' attention.
KEEP_ATTR = "dilated_keep_unsupported_layers"
#: Config attribute naming the implementation in a saved config (Note [Hugging Face attention]).
IMPLEMENTATION_ATTR = "attn_implementation"
#: Attention module attribute: the group its calls run over (Note [Context parallel
#: transformers]); a module attribute, not config: a process group is not saved with a model.
CONTEXT_ATTR = "dilated_context_parallel"
#: Attention module attribute: what messages offer to keep the model on instead (sdpa, or the
#: model's own attention where it has no sdpa).
OWN_ATTR = "dilated_own_attention"


def register(name: str = NAME) -> str:
    """Register :func:`attention_forward` and :func:`padding_mask` with transformers'
    ``AttentionInterface`` / ``AttentionMaskInterface`` under ``name``; returns ``name``.

    Raises:
        ImportError: transformers is not installed (``pip install transformers``).
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as exc:
        raise ImportError(
            f"dilated_attention.integrations.transformers needs transformers: pip install "
            f"transformers ({exc})"
        ) from exc
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, padding_mask)
    return name


def use_dilated_attention(
    model: nn.Module,
    segment_lengths: Sequence[int] | Sequence[Sequence[int]] | None = None,
    dilation_rates: Sequence[int] | Sequence[Sequence[int]] | None = None,
    *,
    check_positions: bool = True,
    keep_unsupported_layers: bool = False,
    context_parallel: ContextParallel | dist.ProcessGroup | None = None,
    sparse: BlockSelectedConfig | None = None,
) -> nn.Module:
    """Run every attention layer of a transformers ``model`` on this library; returns the
    model. Global layers take the dilated schedule, or with ``sparse`` MoBA (Note [MoBA in a
    pretrained model] in ``_transformers_layer.py``); local (sliding-window) and chunked layers
    keep their window or chunk; soft-capping and sinks are computed with their gradients (Note
    [What each layer computes] in ``_transformers_layer.py``). A decoder's cross-attention runs
    dense over the encoder's keys (Note [Cross-attention in encoder-decoder models]).

    Args:
        model: a transformers ``PreTrainedModel``.
        segment_lengths: ``w`` per branch for every layer, or one such list per layer.
        dilation_rates: ``r`` per branch, likewise.
        check_positions: refuse packed sequences (position ids that restart within a row,
            masks whose real tokens have gaps), which dilated attention would segment wrongly.
            The checks read the ids and masks, so under ``torch.compile`` they break the graph
            in every layer (``fullgraph=True`` raises an error naming this flag); pass False,
            only for models that never see packed rows, for one graph, padded batches
            included. Eager calls check masks anyway.
        keep_unsupported_layers: calls that dilated attention cannot compute (a learned
            position bias: T5) run transformers' SDPA attention instead of raising; a warning
            lists the layers this concerns. Local windows, chunks, soft-capping and sinks run
            on this library (Note [What each layer computes] in ``_transformers_layer.py``).
        context_parallel: run the self-attention layers over a sequence sharded across ranks
            (a :class:`~dilated_attention.distributed.ContextParallel` or a process group;
            Note [Context parallel transformers]): each rank passes its shard of the tokens
            and their global ``position_ids`` (``sequence_positions(n, group=...)``).
        sparse: a :class:`~dilated_attention.config.BlockSelectedConfig` instead of a schedule:
            the global layers run :func:`~dilated_attention.sparse.moba_attention` on the
            model's own q, k, v and softmax scale (so ``sparse.scale`` stays None). Causal
            decoders only, called on unpadded, unpacked rows without a cache; other calls
            raise before any work. With ``context_parallel`` (a process group, or a
            ``ContextParallel`` with a ring alone) each rank's shard, whole blocks, runs
            :func:`~dilated_attention.distributed.moba_ring_attention`. NSA
            (``CompressedSelectedWindowConfig``) is refused: its gates and compressed branch
            are weights a pretrained model lacks.

    Raises:
        ValueError: a bad schedule (per layer: the layer is named), a per-layer schedule whose
            length is not the model's number of layers or in an encoder-decoder model, a model
            whose attention adds a relative position bias (T5) without
            ``keep_unsupported_layers``, or a cross-attention layer this integration cannot
            recognize; with ``sparse``: a schedule as well, NSA's config, a ``scale``, an
            encoder-decoder model or a ``context_parallel`` with a head all-to-all; without
            it: no schedule.
        TypeError: ``model`` is not a transformers model, a flag is not a bool,
            ``context_parallel`` is not a group, or ``sparse`` is not a BlockSelectedConfig.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise TypeError(
            f"model must be a transformers PreTrainedModel, got {type(model).__name__}; for "
            f"this library's own layers use dilated_attention.create_multihead_dilated_attention"
        )
    selected = L.check_sparse(model, sparse, segment_lengths, dilation_rates, context_parallel)
    segs, rates = (
        (None, None) if selected is not None else _schedule_lists(segment_lengths, dilation_rates)
    )
    for flag, value in (("check_positions", check_positions),
                        ("keep_unsupported_layers", keep_unsupported_layers)):  # fmt: skip
        if not isinstance(value, bool):
            raise TypeError(f"{flag} must be a bool, got {value!r}")
    check_group(context_parallel, "context_parallel")
    per_layer = segs is not None and isinstance(segs[0], list)
    _check_model(model, config, per_layer, len(segs or ()), keep_unsupported_layers)
    if keep_unsupported_layers:
        _warn_kept_layers(model)
    settings = {
        SEGMENTS_ATTR: segs, RATES_ATTR: rates, CHECK_POSITIONS_ATTR: check_positions,
        KEEP_ATTR: keep_unsupported_layers, IMPLEMENTATION_ATTR: SAVED_NAME,
        SELECTED_ATTR: selected,
    }  # fmt: skip
    for held in _own_configs(model):
        for attr, value in settings.items():
            setattr(held, attr, value)
    model.set_attn_implementation(register())
    own = _own_attention(model)
    for module in model.modules():  # the attention layers (and their blocks) know their index
        if hasattr(module, "layer_idx"):
            setattr(module, CONTEXT_ATTR, context_parallel)
            setattr(module, OWN_ATTR, own)
    return model


#: ``from_pretrained`` arguments that say where the config is, passed on to read it first.
_CONFIG_LOCATION_KWARGS = (
    "cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder",
    "trust_remote_code",
)  # fmt: skip


def load_dilated_pretrained(cls: Any, path: Any, **kwargs: Any) -> nn.Module:
    """``cls.from_pretrained(path, **kwargs)`` of a model saved after
    :func:`use_dilated_attention`, running dilated attention with its saved schedule and flags.

    Args:
        cls: a transformers model class (``AutoModelForCausalLM``, ``LlamaForCausalLM``, ...).
        path: what ``from_pretrained`` takes (a directory or a hub name).
        kwargs: ``from_pretrained``'s keyword arguments, except ``attn_implementation``.

    Raises:
        TypeError: ``attn_implementation`` is given.
        ValueError: the saved config holds no dilated schedule (before any weights load).
    """
    if "attn_implementation" in kwargs:
        raise TypeError(
            f"load_dilated_pretrained sets attn_implementation itself, got "
            f"attn_implementation={kwargs['attn_implementation']!r}; for another implementation "
            f"call {getattr(cls, '__name__', 'cls')}.from_pretrained directly"
        )
    from transformers import AutoConfig

    # The schedule is read from the saved config before any weights load.
    where = {key: kwargs[key] for key in _CONFIG_LOCATION_KWARGS if key in kwargs}
    config = AutoConfig.from_pretrained(path, **where)
    segs, rates = getattr(config, SEGMENTS_ATTR, None), getattr(config, RATES_ATTR, None)
    selected = getattr(config, SELECTED_ATTR, None)
    if (segs is None or rates is None) and selected is None:
        raise ValueError(
            f"{path} holds no {SEGMENTS_ATTR} / {RATES_ATTR} in its config: save a model "
            f"prepared with use_dilated_attention, or call use_dilated_attention(model, "
            f"segment_lengths, dilation_rates) after loading"
        )
    model = cls.from_pretrained(path, attn_implementation=register(), **kwargs)
    return use_dilated_attention(
        model, segs, rates, check_positions=getattr(config, CHECK_POSITIONS_ATTR, True),
        keep_unsupported_layers=getattr(config, KEEP_ATTR, False),
        sparse=None if selected is None else BlockSelectedConfig(**selected),
    )  # fmt: skip


def _configs(model: nn.Module) -> list[Any]:
    """Every distinct config object of ``model`` and its modules (encoder-decoder models may
    give each half a copy)."""
    found = {id(model.config): model.config}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            found.setdefault(id(config), config)
    return list(found.values())


def _own_configs(model: nn.Module) -> list[Any]:
    """Give ``model`` and its modules their own copies of its config objects (one deep copy,
    so that a config and its sub-configs stay linked), so that changing them leaves any other
    model built from the same config as it was; returns the copies."""
    originals = _configs(model)
    copies = copy.deepcopy(originals)
    swap = {id(held): mine for held, mine in zip(originals, copies, strict=True)}
    for module in model.modules():  # the model itself included
        held = getattr(module, "config", None)
        if id(held) in swap:
            module.config = swap[id(held)]
    return copies


def _own_attention(model: nn.Module) -> str:
    """What messages offer to keep ``model`` on when dilated attention cannot run it."""
    if getattr(model, "_supports_sdpa", False):
        return "sdpa"
    return "its own attention (attn_implementation='eager'; it has no sdpa)"


def _warn_kept_layers(model: nn.Module) -> None:
    """Warn once that ``keep_unsupported_layers`` runs layers of ``model`` on transformers'
    attention (Note [Layers kept on transformers' attention]), naming them."""
    kept, layers = P.kept_layers(model)
    if not kept:
        return
    none = ", so none runs on dilated attention" if len(kept) == layers else ""
    warnings.warn(
        f"keep_unsupported_layers=True: {len(kept)} of {layers} attention layers of "
        f"{type(model).__name__} add a learned position bias to their scores and run on "
        f"transformers' attention for every call{none}: {', '.join(kept)}",
        UserWarning, stacklevel=3,
    )  # fmt: skip


def _check_model(model: nn.Module, config: Any, per_layer: bool, lists: int, keep: bool) -> None:
    """Refuse what :func:`use_dilated_attention` cannot run, before any change."""
    name = type(model).__name__
    own = _own_attention(model)
    if not keep and P.kept_layers(model)[0]:
        raise ValueError(
            f"{name}'s attention adds a learned relative position bias to its scores "
            f"(T5-style position_bias), which dilated attention does not compute; no layer of "
            f"it can run dilated exactly: keep this model on {own} (keep_unsupported_layers="
            f"True runs every layer there)"
        )
    unmarked = P.unmarked_cross_attention(model)
    if unmarked is not None:
        raise ValueError(
            f"{name}'s layer {unmarked} looks like cross-attention but does not say so "
            f"(is_cross_attention, or is_decoder without is_causal): it would run as dilated "
            f"self-attention; keep this model on {own}"
        )
    if per_layer and getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"{name} is an encoder-decoder model, whose encoder and decoder both count layers "
            f"from 0: pass one schedule for every layer, not one list per layer"
        )
    layers = getattr(config, "num_hidden_layers", None)
    if per_layer and layers is not None and lists != layers:
        raise ValueError(
            f"a per-layer schedule needs one list per layer: the model has "
            f"{V.counted(layers, 'layer')}, got {V.counted(lists, 'list')} of segment_lengths; "
            f"or pass one list for every layer"
        )


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


def _layer_schedule(module: nn.Module) -> tuple[list[int], list[int]] | None:
    """The schedule of ``module``'s layer from its config (Note [Hugging Face attention]), or
    None where its global layers run MoBA."""
    config = getattr(module, "config", None)
    if L.layer_selected(module) is not None:
        return None
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


def _refuse_call(module: nn.Module, attention_mask: torch.Tensor | None, kwargs: Any) -> None:
    """What no layer runs: attention weights, a 4-D mask."""
    name = type(module).__name__
    if kwargs.get("output_attentions"):
        raise ValueError(
            f"output_attentions=True: {name} runs dilated attention, which computes no "
            f"attention weights to return; call without output_attentions, or load the model "
            f"with attn_implementation='eager' for dense attention's weights"
        )
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f"dilated attention takes a 2-D padding mask, got a {attention_mask.dim()}-D mask; "
            f"enable it with use_dilated_attention(...) (which registers the mask function "
            f"too), not by setting the attention implementation alone"
        )


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
    """transformers' attention function contract, computed on this library (Note [Hugging
    Face attention]).

    Args:
        module: the calling attention module (its ``config`` holds the schedule; ``is_causal``
            and ``layer_idx`` are read when present).
        query: (B, H, Nq, D); key, value: (B, Hkv, Nk, D), Nq <= Nk (the queries are the last
            positions; for cross-attention, the encoder's keys).
        attention_mask: what :func:`padding_mask` passes on (Note [What the mask function
            passes on]): (B, n) bool, ``True`` for real tokens, covering the positions up to
            the last query (the keys are the last of them that the call holds; a static
            cache's slots after them are unfilled), (B, N) int64 sequence indices of packed
            rows, or None.
        dropout, scaling: attention-probability dropout and softmax scale.
        is_causal: overrides ``module.is_causal`` (default True).
        kwargs: transformers' further arguments; ``sliding_window``, ``softcap`` and ``s_aux``
            / ``sinks`` (H,) are computed (Note [What each layer computes] in
            ``_transformers_layer.py``), ``position_bias`` is not (Note [Layers kept on
            transformers' attention] in ``_transformers_paths.py``).

    Returns:
        ``(out, None)`` with out (B, Nq, H, D).

    Raises:
        ValueError: ``output_attentions=True``, a 4-D mask, a position bias unless the model
            keeps such layers, a bidirectional window, sinks other than (H,), a padding mask
            with gaps, or (from :func:`~dilated_attention.dilated_attention`) non-causal
            queries shorter than the keys.
    """
    _refuse_call(module, attention_mask, kwargs)
    run: dict[str, Any] = {"scale": scaling, "dropout_p": dropout}
    if P.is_cross_attention(module):
        if L.layer_selected(module) is not None:
            raise ValueError(
                f"{L.layer_name(module)} is cross-attention, and use_dilated_attention(sparse="
                f"...) runs MoBA in a decoder's causal self-attention only; keep this model on "
                f"{_kept_on(module)}"
            )
        filled = M.filled_keys(attention_mask, None, key.shape[2])
        key, value = key[:, :, :filled], value[:, :, :filled]
        reason = P.kept_reason(module, kwargs)
        if reason is not None:
            return _kept(module, (query, key, value), attention_mask, reason, run, kwargs), None
        q, k, v = (x.transpose(1, 2) for x in (query, key, value))
        return P.cross_attention(q, k, v, attention_mask, run), None
    run["is_causal"] = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    return _self_attention(module, (query, key, value), attention_mask, run, kwargs), None


def _self_attention(
    module: nn.Module,
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    passed: torch.Tensor | None,
    run: dict[str, Any],
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """A self-attention call of :func:`attention_forward`: ``qkv`` query (B, H, Nq, D), key and
    value (B, Hkv, Nk, D); ``passed``: the mask function's mask; ``run``: the call's options
    -> (B, Nq, H, D)."""
    query, key, value = qkv
    reason = P.kept_reason(module, kwargs)
    if reason is not None:
        check = getattr(getattr(module, "config", None), CHECK_POSITIONS_ATTR, True)
        mask, filled, _ = M.call_keys(passed, key.shape[2])
        filled = M.filled_keys(mask, kwargs.get("position_ids"), filled, check)
        kept = (query, key[:, :, :filled], value[:, :, :filled])
        return _kept(module, kept, mask, reason, run, kwargs)
    layer = L.layer_attention(
        module, query.shape[1], run["is_causal"], kwargs, _layer_schedule(module),
        L.layer_selected(module),
    )  # fmt: skip
    group = getattr(module, CONTEXT_ATTR, None)
    if group is not None:
        mask = M.call_keys(passed, key.shape[2])[0]
        q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # (B, N, H, D) views
        padding = None if M.is_sequence_ids(mask) else mask  # a shard's positions jump
        return P.context_parallel_rows((q, k, v), padding, kwargs, group, layer, run)
    if layer.traceable or not torch.compiler.is_compiling():
        return _rows(module, layer, qkv, passed, run, kwargs)
    slots = query.shape[2] == 1 and passed is not None  # a static cache's slots may follow
    return _eager_rows(module, layer, qkv, passed, run, kwargs, slots)


def _rows(
    module: nn.Module,
    layer: L.LayerAttention,
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    passed: torch.Tensor | None,
    run: dict[str, Any],
    kwargs: dict[str, Any],
    trim: bool = False,
) -> torch.Tensor:
    """``layer``'s rows of a self-attention call (arguments as :func:`_self_attention`);
    ``trim``: cut ``passed`` after its last filled slot (Note [What the mask function passes
    on])."""
    query, key, value = qkv
    check = getattr(getattr(module, "config", None), CHECK_POSITIONS_ATTR, True)
    if trim and not M.is_sequence_ids(passed):
        passed = M.trim_unfilled(passed)
    mask, filled, offset = M.call_keys(passed, key.shape[2])
    q, k, v = (x.transpose(1, 2) for x in (query, key[:, :, :filled], value[:, :, :filled]))
    documents = P.packed_documents(kwargs, q, filled, mask, check)
    if layer.moba is not None:  # Note [MoBA in a pretrained model] in _transformers_layer.py
        packed = documents is not None or M.is_sequence_ids(mask)
        whole = mask is None or packed or bool(mask.all())
        L.check_moba_call(layer, q.shape[1], filled, whole, packed, run["dropout_p"])
        return layer(q, k, v, **run)
    if documents is not None:
        padding = None if M.is_sequence_ids(mask) else mask
        return P.packed_rows((q, k, v), padding, documents, layer, run)
    pads = None if passed is None else (passed.cumsum(1) == 0).sum(1)
    if layer.traceable and layer.schedule is not None:
        positions = P.in_place_positions(q, kwargs, passed, run["is_causal"], run["dropout_p"])
        if positions is not None:
            shift = pads if pads is None or not offset else pads - offset
            schedule = Schedule(*layer.schedule)
            return decode_at(q, k, v, positions, schedule, row_offsets=shift, scale=run["scale"])
    filled = M.filled_keys(mask, kwargs.get("position_ids"), filled, check)
    k, v = k[:, :filled], v[:, :filled]
    compiling = torch.compiler.is_compiling()
    whole = mask is None or (not compiling and bool(mask.all()))
    if whole and (offset == 0 or layer.chunk is None):
        return layer(q, k, v, **run)
    first = None if pads is None else pads - offset  # a chunk's start: Note [Chunks after a cache]
    return P.padded_rows(q, k, v, mask, layer, run, check or not compiling, first)


#: Under torch.compile, a layer with a window, a soft-cap, sinks or MoBA runs eagerly (Note [What
#: each layer computes] in ``_transformers_layer.py``).
_eager_rows = torch.compiler.disable(
    _rows,
    reason="dilated attention runs a layer with a local window, soft-capped scores, attention "
    "sinks or MoBA eagerly under torch.compile (the library's compiled operators do not carry them "
    "yet): a graph break; compile without fullgraph=True, or leave this model eager",
)


def _kept_on(module: nn.Module) -> str:
    """What messages offer to keep ``module``'s model on (set by :func:`use_dilated_attention`)."""
    return getattr(module, OWN_ATTR, None) or "its own attention"


def _kept(
    module: nn.Module, qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    mask: torch.Tensor | None, reason: str, run: dict[str, Any], kwargs: dict[str, Any],
) -> torch.Tensor:  # fmt: skip
    """A call dilated attention cannot compute, for ``reason``: on transformers' attention if the
    model keeps such layers (Note [Layers kept on transformers' attention]), else an error.
    ``qkv`` in transformers' layout, ``mask`` (B, Nk) or None -> (B, Nq, H, D).

    Raises:
        ValueError: the model does not keep such layers, the layer is context parallel, or
            the rows are packed.
    """
    if not getattr(getattr(module, "config", None), KEEP_ATTR, False):
        raise ValueError(
            f"{reason}: dilated attention cannot compute this call exactly; pass "
            f"keep_unsupported_layers=True to use_dilated_attention to run such calls on "
            f"transformers' attention, or keep the model on {_kept_on(module)}"
        )
    packed = M.is_sequence_ids(mask) or kwargs.get("cu_seq_lens_q") is not None
    if packed or getattr(module, CONTEXT_ATTR, None) is not None:
        raise ValueError(
            f"{reason}: this layer runs on transformers' attention (keep_unsupported_layers), "
            f"which would cross {'packed sequences' if packed else 'the ranks of its group'}; "
            f"give each sequence its own row, without context_parallel"
        )
    return P.kept_attention(
        module, *qkv, mask, causal=bool(run.get("is_causal", False)), dropout=run["dropout_p"],
        scaling=run["scale"], kwargs=kwargs,
    )  # fmt: skip
