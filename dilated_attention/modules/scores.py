"""What the attention modules keep for local windows, soft-capping and sinks (Note [Local
windows, soft-capping and sinks] in ``core/sinks.py``): the learnable sinks parameter and the
modules' description of them."""

from __future__ import annotations

import torch
from torch import nn

from .. import _validation as V

__all__ = ["learnable_sinks", "score_repr"]


def learnable_sinks(heads: object) -> nn.Parameter | None:
    """A (heads,) parameter of sink logits initialised to 0 (each row's denominator gains
    ``e^0 = 1``: a learned way to attend to nothing), or None for ``heads=None``.

    Raises:
        ValueError / TypeError: ``heads`` is not a positive int (nor None).
    """
    if heads is None:
        return None
    return nn.Parameter(torch.zeros(V.check_positive_int("sinks", heads)))


def score_repr(
    window_size: tuple[int, int] | None, softcap: float | None, sinks: torch.Tensor | None
) -> str:
    """The modules' ``extra_repr`` part for these options (empty when none is set)."""
    parts = [f"window_size={window_size}"] if window_size is not None else []
    parts += [f"softcap={softcap}"] if softcap is not None else []
    parts += [f"sinks={sinks.numel()}"] if sinks is not None else []
    return "".join(f", {part}" for part in parts)
