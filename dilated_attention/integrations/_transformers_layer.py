"""What one call of a transformers attention layer computes on this library
(``integrations/transformers.py``): a local window, a chunk, the dilated schedule or MoBA,
with the call's soft-cap and sinks. Tensors: q (B, Nq, H, D) and k, v (B, Nk, Hkv, D).

Note [What each layer computes]
    A layer runs what the model computes, read from the call's arguments and the module:

    - A local layer (the call passes ``sliding_window=W``; Mistral, Qwen2, the sliding layers of
      Gemma 2/3 and gpt-oss) keeps its window: :func:`~dilated_attention.attention` with
      ``window_size=(W - 1, 0)`` and ``is_causal=True``, each query seeing the W keys that end
      at itself, as transformers' mask does (``kv_idx > q_idx - W``). A window is relative, so
      padding needs only the key padding mask, and keys a sliding cache dropped lie outside
      every window of the call.
    - A chunked layer (Llama 4: ``config.layer_types[layer_idx] == "chunked_attention"``,
      chunks of ``config.attention_chunk_size = C`` tokens counted from each row's first real
      token) keeps its chunks: dilated attention's one branch ``(C, 1)``, whose segments are the
      chunks wherever position 0 of the call is a chunk's first token (Note [Padded rows shifted
      to the start] and Note [Chunks after a cache] in ``_transformers_paths.py``).
    - Every other layer (a global one) runs the dilated schedule of the config, or, where the
      config holds a :class:`~dilated_attention.config.BlockSelectedConfig` instead, MoBA
      (Note [MoBA in a pretrained model]). A model whose layers are all local (Mistral with a
      window) runs its windows and no schedule.

    Each takes the call's soft-cap (``softcap=``, Gemma 2) and attention sinks (``s_aux=`` or
    ``sinks=``, one logit per query head: gpt-oss), with their gradients (Note [Local windows,
    soft-capping and sinks] in ``core/sinks.py``). A bidirectional window (whose width each
    model defines in its own mask) and sinks of another shape (one per query) are refused.

    Under ``torch.compile`` the library's operators do not carry a window, a soft-cap or sinks
    yet, so such a layer's call runs eagerly (``torch.compiler.disable`` around all of it in
    ``transformers.py``): a graph break, which ``fullgraph=True`` reports as an error naming it
    and the fix. Other calls stay in the graph (the static decode step of a global or chunked
    layer included). A one-token call's mask then covers a static cache's slots, and is cut
    after the query's (Note [What the mask function passes on] in ``_transformers_masks.py``).

Note [MoBA in a pretrained model]
    MoBA (:func:`~dilated_attention.sparse.moba_attention`) has no weights of its own: a global
    layer runs it on the q, k, v the model's own projections made, with the model's softmax
    scale, each query block attending its own block and the ``topk`` key blocks its queries
    choose. The choice is made per block of queries over the call's whole rows, so only calls
    whose rows are the whole causal sequence run it exactly: causal self-attention with as many
    queries as keys, no padding and no packed rows. Everything else is refused before any work
    with the fix: a non-causal or cross-attention layer (MoBA here is a decoder's), a call after
    a cache (its query block would hold only the new tokens and choose other blocks than the
    whole sequence's; ``use_cache=False``), padding or packed rows (the pads would join a
    block's gate; one sequence per call) and dropout (``moba_attention`` takes none). The
    call's soft-cap and sinks are computed (they change the scores of the chosen blocks, not
    the choice). Local and chunked layers keep their window or chunk. Over a context-parallel
    group each rank's shard runs :func:`~dilated_attention.distributed.moba_ring_attention`
    (Note [Context parallel transformers] in ``_transformers_paths.py``): shards of whole
    blocks, over a process group or a ``ContextParallel``'s ring (no head all-to-all: block
    masks made at run time travel a ring only, Note [Run-time masks over the ring]).
    NSA is not offered: its gates and compressed branch are weights a pretrained model lacks (a
    ``LongNetLM`` with the factory's ``kind="nsa"`` trains them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..config import BlockSelectedConfig, CompressedSelectedWindowConfig
from ..distributed.rings.moba_ring import selection_group
from ..functional import attention, dilated_attention
from ..sparse import moba_attention

#: Config attribute holding MoBA's settings instead of a schedule (Note [MoBA in a pretrained
#: model]): a dict of :class:`BlockSelectedConfig`'s fields.
SELECTED_ATTR = "dilated_block_selected"


def layer_name(module: nn.Module) -> str:
    """``module``'s class and layer index, for messages."""
    layer = getattr(module, "layer_idx", None)
    return type(module).__name__ + ("" if layer is None else f" (layer {layer})")


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


@dataclass(frozen=True)
class LayerAttention:
    """What a call of one layer computes (Note [What each layer computes]).

    Attributes:
        name: the layer, for messages.
        dilated: the config's ``(segment_lengths, dilation_rates)`` for this layer, or None
            where its global layers run MoBA.
        window: a local layer's ``sliding_window`` W (keys ``p - W + 1`` to ``p``), or None.
        chunk: a chunked layer's chunk C, or None.
        softcap: the scores' soft-cap, or None.
        sinks: (H,) logits, or None.
        selected: the config's MoBA settings (Note [MoBA in a pretrained model]), or None.
    """

    name: str
    dilated: tuple[list[int], list[int]] | None
    window: int | None = None
    chunk: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None
    selected: BlockSelectedConfig | None = None

    @property
    def moba(self) -> BlockSelectedConfig | None:
        """The MoBA settings when this call is a global layer's that runs MoBA, else None."""
        return self.selected if self.window is None and self.chunk is None else None

    @property
    def schedule(self) -> tuple[list[int], list[int]] | None:
        """The branches of the call: ``([C], [1])`` for a chunked layer, the config's schedule
        for a global one, None for a local one or one that runs MoBA."""
        if self.window is not None or self.moba is not None:
            return None
        return ([self.chunk], [1]) if self.chunk is not None else self.dilated

    @property
    def traceable(self) -> bool:
        """Whether the library's compiled operators carry this call (no window, soft-cap,
        sinks or MoBA)."""
        plain = self.window is None and self.moba is None
        return plain and self.softcap is None and self.sinks is None

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **run: Any
    ) -> torch.Tensor:
        """This layer's attention of q (B, Nq, H, D) over k, v (B, Nk, Hkv, D) -> (B, Nq, H,
        D); ``run``: the keyword arguments every kind shares (``is_causal``, ``scale``,
        ``dropout_p``, ``key_padding_mask``, ``cu_seqlens``)."""
        extra = {"softcap": self.softcap, "sinks": self.sinks}
        moba = self.moba
        if moba is not None:  # the call was checked: check_moba_call
            return moba_attention(
                q, k, v, block_size=moba.block_size, topk=moba.topk, is_causal=True,
                scale=run.get("scale"), backend=moba.backend, **extra,
            )  # fmt: skip
        schedule = self.schedule
        if schedule is None:
            assert self.window is not None  # a local layer
            return attention(q, k, v, window_size=(self.window - 1, 0), **extra, **run)
        return dilated_attention(q, k, v, *schedule, **extra, **run)


def layer_attention(
    module: nn.Module,
    heads: int,
    causal: bool,
    kwargs: dict[str, Any],
    dilated: tuple[list[int], list[int]] | None,
    selected: BlockSelectedConfig | None = None,
) -> LayerAttention:
    """What this call of ``module`` computes (Note [What each layer computes]), from the call's
    ``kwargs`` (``sliding_window``, ``softcap``, ``s_aux`` / ``sinks``); ``heads``: the query
    heads; ``dilated``: the layer's schedule from the config, or None with ``selected``, its
    MoBA settings.

    Raises:
        ValueError: a bidirectional sliding window, sinks that are not one logit per query
            head, or a MoBA layer that is not causal.
    """
    name = layer_name(module)
    window = kwargs.get("sliding_window")
    if window is not None and not causal:
        raise ValueError(
            f"{name} attends within a bidirectional sliding window of {window} tokens, whose "
            f"width each model defines in its own mask; dilated attention runs causal windows "
            f"only: keep this model on its own attention"
        )
    sinks = kwargs.get("s_aux")
    sinks = kwargs.get("sinks") if sinks is None else sinks
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.shape != (heads,)):
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(
            f"{name} adds attention sinks of shape {shape}; dilated attention takes one logit "
            f"per query head, shape ({heads},): keep this model on its own attention"
        )
    layer = LayerAttention(
        name, dilated, window=None if window is None else int(window), chunk=chunk_size(module),
        softcap=kwargs.get("softcap") or None, sinks=sinks, selected=selected,
    )  # fmt: skip
    if layer.moba is not None:
        _check_moba_layer(layer, causal)
    return layer


_MOBA_FIX = "keep the model on its own attention, or use a dilated schedule"


def _check_moba_layer(layer: LayerAttention, causal: bool) -> None:
    """Refuse what a MoBA layer does not compute (Note [MoBA in a pretrained model])."""
    if not causal:
        raise ValueError(
            f"{layer.name} is non-causal (an encoder's), and use_dilated_attention(sparse=...) "
            f"runs MoBA in a decoder's causal self-attention only: {_MOBA_FIX}"
        )


def check_moba_call(
    layer: LayerAttention, queries: int, keys: int, whole: bool, packed: bool, dropout: float
) -> None:
    """Refuse a call that a MoBA layer cannot compute exactly, before any work (Note [MoBA in
    a pretrained model]): ``queries`` and ``keys`` the call's Nq and filled Nk, ``whole``: no
    padding, ``packed``: packed rows, ``dropout``: attention dropout.

    Raises:
        ValueError: fewer queries than keys (a cache), padding, packed rows, or dropout.
    """
    if queries != keys:
        raise ValueError(
            f"{layer.name} runs MoBA, which chooses key blocks per block of queries; this call "
            f"has {queries} queries after a cache of {keys} keys, whose block would choose "
            f"other blocks than the whole sequence's: call the model without a cache "
            f"(use_cache=False, also in generate)"
        )
    if packed or not whole:
        what = "packed sequences" if packed else "a padding mask with padded positions"
        raise ValueError(
            f"{layer.name} runs MoBA, whose choice of key blocks is made over whole rows; this "
            f"call has {what}, which would join the blocks' gates: give each call one "
            f"unpadded sequence per row (batch sequences of equal length)"
        )
    if dropout:
        raise ValueError(
            f"{layer.name} runs MoBA, which has no attention dropout, got dropout={dropout}: "
            f"set the model's attention_dropout to 0 or call it in eval mode"
        )


def layer_selected(module: nn.Module) -> BlockSelectedConfig | None:
    """MoBA's settings from ``module``'s config, or None (Note [MoBA in a pretrained
    model])."""
    selected = getattr(getattr(module, "config", None), SELECTED_ATTR, None)
    return None if selected is None else BlockSelectedConfig(**selected)


def check_sparse(
    model: nn.Module, sparse: Any, segment_lengths: Any, dilation_rates: Any, group: Any
) -> dict[str, Any] | None:
    """MoBA's settings (a dict) for the config of ``model`` (Note [MoBA in a pretrained
    model]), or None without ``sparse``, in which case the schedule must be given.

    Raises:
        ValueError: no schedule and no ``sparse``; NSA's config; with ``sparse``, a schedule
            as well, a ``scale``, an encoder-decoder model, or a ``ContextParallel`` with a
            head all-to-all (MoBA runs over a ring).
        TypeError: ``sparse`` is not a :class:`BlockSelectedConfig`.
    """
    if sparse is None:
        if segment_lengths is None or dilation_rates is None:
            raise ValueError(
                "use_dilated_attention needs segment_lengths and dilation_rates (a dilated "
                "schedule), or sparse=BlockSelectedConfig(block_size=..., topk=...) for MoBA"
            )
        return None
    if isinstance(sparse, CompressedSelectedWindowConfig):
        raise ValueError(
            "sparse=CompressedSelectedWindowConfig (NSA) needs gate projections and a "
            "compressed branch that a pretrained model does not have; pass "
            "sparse=BlockSelectedConfig(...) for MoBA, which has no weights of its own, or "
            "train NSA in a LongNetLM built with kind='nsa'"
        )
    if not isinstance(sparse, BlockSelectedConfig):
        raise TypeError(
            f"sparse must be a dilated_attention.config.BlockSelectedConfig, got "
            f"{type(sparse).__name__}"
        )
    problem = None
    if segment_lengths is not None or dilation_rates is not None:
        problem = "a dilated schedule as well: pass sparse= alone, or the schedule alone"
    elif sparse.scale is not None:
        problem = (f"scale={sparse.scale}: the layers keep the model's own softmax scale; "
                   f"leave scale=None")  # fmt: skip
    elif getattr(model.config, "is_encoder_decoder", False):
        problem = (f"an encoder-decoder model ({type(model).__name__}): MoBA runs in a "
                   f"decoder's causal self-attention only; {_MOBA_FIX}")  # fmt: skip
    if problem is not None:
        raise ValueError(f"use_dilated_attention(sparse=BlockSelectedConfig) got {problem}")
    selection_group(group, "use_dilated_attention(sparse=BlockSelectedConfig) (MoBA)")
    return sparse.kwargs()
