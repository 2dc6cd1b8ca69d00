"""What one call of a transformers attention layer computes on this library
(``integrations/transformers.py``): a local window, a chunk or the dilated schedule, with the
call's soft-cap and sinks. Tensors: q (B, Nq, H, D) and k, v (B, Nk, Hkv, D).

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
    - Every other layer (a global one) runs the dilated schedule of the config. A model whose
      layers are all local (Mistral with a window) runs its windows and no schedule.

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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..functional import attention, dilated_attention


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
        dilated: the config's ``(segment_lengths, dilation_rates)`` for this layer.
        window: a local layer's ``sliding_window`` W (keys ``p - W + 1`` to ``p``), or None.
        chunk: a chunked layer's chunk C, or None.
        softcap: the scores' soft-cap, or None.
        sinks: (H,) logits, or None.
    """

    name: str
    dilated: tuple[list[int], list[int]]
    window: int | None = None
    chunk: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None

    @property
    def schedule(self) -> tuple[list[int], list[int]] | None:
        """The branches of the call: ``([C], [1])`` for a chunked layer, the config's schedule
        for a global one, None for a local one."""
        if self.window is not None:
            return None
        return ([self.chunk], [1]) if self.chunk is not None else self.dilated

    @property
    def traceable(self) -> bool:
        """Whether the library's compiled operators carry this call (no window, soft-cap or
        sinks)."""
        return self.window is None and self.softcap is None and self.sinks is None

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **run: Any
    ) -> torch.Tensor:
        """This layer's attention of q (B, Nq, H, D) over k, v (B, Nk, Hkv, D) -> (B, Nq, H,
        D); ``run``: the keyword arguments every kind shares (``is_causal``, ``scale``,
        ``dropout_p``, ``key_padding_mask``, ``cu_seqlens``)."""
        extra = {"softcap": self.softcap, "sinks": self.sinks}
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
    dilated: tuple[list[int], list[int]],
) -> LayerAttention:
    """What this call of ``module`` computes (Note [What each layer computes]), from the call's
    ``kwargs`` (``sliding_window``, ``softcap``, ``s_aux`` / ``sinks``); ``heads``: the query
    heads; ``dilated``: the layer's schedule from the config.

    Raises:
        ValueError: a bidirectional sliding window, or sinks that are not one logit per query
            head.
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
    return LayerAttention(
        name, dilated, window=None if window is None else int(window), chunk=chunk_size(module),
        softcap=kwargs.get("softcap") or None, sinks=sinks,
    )  # fmt: skip
