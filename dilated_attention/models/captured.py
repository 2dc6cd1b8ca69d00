"""A model's decoding step captured in a CUDA graph: one launch of the recorded kernels per
token instead of the Python of every layer.

Note [A captured decoding step]
    With :class:`~dilated_attention.StaticDilatedKVCache` caches a step of one token per row
    has the same shapes, kernels and buffers at every position and reads nothing on the host
    (Note [A decode step with static shapes] in ``core/static_cache.py``), so the whole model
    step (embedding, every layer's projections, rotary, cache writes and attention, the head)
    is recorded once in a CUDA graph and replayed per token: the host then costs one replay,
    not one pass over the model's Python. Recording needs every kernel chosen, compiled and
    its memory pool settled beforehand, so the step first runs twice on a side stream (writing
    the rows at each row's current position, which the first real step overwrites, and putting
    the positions back). Sampling stays outside the graph: it reads the step's logits.

Shape legend: B batch, V vocab_size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..core.static_cache import StaticDilatedKVCache

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
        caches: list[StaticDilatedKVCache],
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
