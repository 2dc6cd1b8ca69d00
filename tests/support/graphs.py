"""Helpers of the tests of calls replayed from CUDA graphs (Note [A call's launches from a CUDA
graph] in ``core/execution/graphs.py``). Every test starts with no graph (``tests/conftest.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor


def count_replays(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one at each replay of a graph of ours."""
    seen: list[int] = []
    real = torch.cuda.CUDAGraph.replay

    def replay(graph: torch.cuda.CUDAGraph) -> None:
        seen.append(1)
        real(graph)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", replay)
    return seen


def keep(results: list[Tensor], stored: list[Tensor]) -> None:
    """Copy a step's results into buffers made before the steps (a copy allocates nothing, so
    the next step's tensors find the addresses this step's leave)."""
    for into, result in zip(stored, results, strict=True):
        into.copy_(result)
