"""A model's decoding step captured in a CUDA graph: one launch of the recorded kernels per
token instead of the Python of every layer.

Note [A captured decoding step]
    With static caches (:class:`~dilated_attention.StaticDilatedKVCache`, and
    :class:`~dilated_attention.StaticWindowKVCache` for the local layers of a hybrid stack) a
    step of one token per row has the same shapes, kernels and buffers at every position and
    reads nothing on the host (Note [A decode step with static shapes] in
    ``core/decoding/static_cache.py``, Note [A window cache] in ``core/decoding/window_cache.py``),
    soft-capping and sinks included (the eager step's plan applies them), so the whole model step
    (embedding, every layer's projections, rotary, cache writes and attention, the head) is
    recorded once in a CUDA graph and replayed per token: the host then costs one replay,
    not one pass over the model's Python. Recording needs every kernel chosen, compiled and
    its memory pool settled beforehand, so the step first runs twice on a side stream (writing
    the rows at each row's current position, which the first real step overwrites, and putting
    the positions back). Sampling stays outside the graph: it reads the step's logits.

Note [A captured step kept across calls]
    Recording costs two eager steps and the capture, and the caches' buffers are allocated per
    call: for a short continuation, a share of the call comparable to its tokens. So the model
    keeps its last captured step with the caches it reads (:class:`KeptStep`) and the next call
    of the same batch size reuses both: the caches are reset (positions back to 0, buffers
    kept), the prompts run into them, and the step replays as it is. That is valid while every
    address the graph reads is the same: the parameters and buffers of the model (an optimizer
    updates them in place; ``to()``, ``half()`` or loading with ``assign=True`` make new ones),
    the caches' buffers after the prompts, and the schedule's slot tables (kept for the
    process: ``core.decode.token_slots``); otherwise the step is recorded anew. One call at a
    time uses it: a call takes it from the model and puts its own back when it ends, so a
    second ``stream`` running meanwhile records a step and caches of its own. The kept step
    holds the caches' memory and the graph's pool until the model's next call of another batch
    size or :meth:`~dilated_attention.models.GenerationMixin.release_captured_step`; it is never
    pickled or deep-copied with the model.

Shape legend: B batch, V vocab_size.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..core.decoding.static_cache import StaticKVCache

Step = Callable[[torch.Tensor], torch.Tensor]


class CapturedStep:
    """``step(tokens)``: the (B, V) next-token logits of one new token per row, (B, 1) ids,
    through a CUDA graph of ``model(tokens, caches=caches)`` (Note [A captured decoding step]);
    on a device without CUDA graphs the model runs as it is.

    Args:
        model: called as ``model(tokens, caches=caches)`` -> (B, 1, V) logits.
        caches: the model's static caches, holding the prompts (filled buffers).
        batch: B.
        device: the caches' device.
    """

    def __init__(
        self,
        model: Callable[..., torch.Tensor],
        caches: list[StaticKVCache],
        batch: int,
        device: torch.device,
    ) -> None:
        self.model, self.caches = model, caches
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        if device.type == "cuda":
            self._capture()

    def _eager(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens, caches=self.caches)[:, -1, :]

    def _capture(self) -> None:
        positions = [c.lengths.clone() for c in self.caches if c.lengths is not None]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # kernels chosen, compiled and their memory pool settled
                self._eager(self.tokens)
                for cache, before in zip(self.caches, positions, strict=True):
                    cache.lengths.copy_(before)  # type: ignore[union-attr]
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):  # records the kernels; runs none of them
            self.logits = self._eager(self.tokens)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.graph is None:
            return self._eager(tokens)
        self.tokens.copy_(tokens)
        self.graph.replay()
        assert self.logits is not None  # recorded with the graph
        return self.logits


def model_addresses(model: nn.Module, batch: int, device: torch.device) -> tuple[object, ...]:
    """What a kept step was recorded for (Note [A captured step kept across calls]): the batch,
    the device and the address of every parameter and buffer of ``model``."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    return (batch, str(device), *(t.data_ptr() for t in tensors))


def cache_addresses(caches: list[StaticKVCache]) -> tuple[int, ...]:
    """The addresses of the buffers a step reads from ``caches`` (0 for one not allocated)."""
    held = (t for c in caches for t in (c.key, c.value, c.lengths, c.key_padding_mask))
    return tuple(0 if t is None else t.data_ptr() for t in held)


@dataclass
class KeptStep:
    """A model's last captured step and the caches it reads (Note [A captured step kept across
    calls]).

    Attributes:
        model: :func:`model_addresses` when it was recorded.
        caches: the static caches, one per layer.
        buffers: :func:`cache_addresses` of ``caches`` when it was recorded.
        step: the captured step.
    """

    model: tuple[object, ...]
    caches: list[StaticKVCache]
    buffers: tuple[int, ...]
    step: CapturedStep
