"""Helpers of the tests of calls replayed from CUDA graphs (Note [A call's launches from a CUDA
graph] in ``core/execution/graphs.py``). Every test starts with no graph (``tests/conftest.py``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from dilated_attention.core.execution import graphs


def captured(step: Callable[[], object], warmups: int = 1) -> torch.cuda.CUDAGraph:
    """``step`` recorded in a CUDA graph (``graph.replay()`` runs it again), after ``warmups``
    runs on a side stream, where its kernels are chosen and compiled outside the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


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


def assert_same_results(got: list[Tensor], want: list[Tensor], what: str = "") -> None:
    """A replayed FA4 step's ``[out, lse, dq, dk, dv]`` against the launches': out and lse bit
    for bit, the gradients to bf16's rounding (FA4's backward adds dq, and with GQA dk and dv,
    in float32 with atomics, in an order that varies from run to run, graphs or not)."""
    for i, (name, a, b) in enumerate(zip(("out", "lse", "dq", "dk", "dv"), got, want,
                                         strict=True)):  # fmt: skip
        tol = 0.0 if i < 2 else 1e-2
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=f"{what}{name}")


def assert_steps_never_synchronise(step: Callable[[], object], monkeypatch: pytest.MonkeyPatch,
                                   steps: int = 4) -> None:  # fmt: skip
    """``steps`` calls of ``step``, after a first one that compiles and binds, pass
    ``torch.cuda.set_sync_debug_mode("error")``, and at least one replays a graph."""
    step()  # compiled and bound first: the first call of a shape family may synchronise
    replays = count_replays(monkeypatch)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert replays


def eager_then_replayed(
    step: Callable[[], list[Tensor]], monkeypatch: pytest.MonkeyPatch, steps: int = 6
) -> tuple[list[Tensor], list[list[Tensor]], list[int]]:
    """``step``'s results with the graphs turned off, then ``steps`` runs with them, each run's
    results kept in buffers made before the runs (nothing else allocates between them, so
    their addresses repeat), and the list of replays seen during those runs."""
    monkeypatch.setenv(graphs.ENV_VAR, "0")
    expected = step()
    monkeypatch.delenv(graphs.ENV_VAR)
    replays = count_replays(monkeypatch)
    runs = [[torch.empty_like(t) for t in expected] for _ in range(steps)]
    # The cached blocks an earlier test of this worker left fragmented can hand each step new
    # addresses (no pair seen twice, none captured): the steps start from an empty cache.
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    for stored in runs:
        keep(step(), stored)
    return expected, runs, replays


def random_contents(tensors: list[Tensor], count: int, seed: int) -> list[list[Tensor]]:
    """``count`` sets of standard-normal values shaped and typed like ``tensors``, on CUDA."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [[torch.randn(x.shape, device="cuda", generator=gen).to(x.dtype) for x in tensors]
            for _ in range(count)]  # fmt: skip


def replayed_with_contents(
    step: Callable[[], list[Tensor]],
    tensors: list[Tensor],
    contents: list[list[Tensor]],
    monkeypatch: pytest.MonkeyPatch,
    rounds: int = 3,
) -> tuple[list[list[Tensor]], list[list[list[Tensor]]], list[int]]:
    """``step``'s results for each set of ``contents`` written into ``tensors`` with the graphs
    off, then ``rounds`` rounds of the same with them (the later rounds replay), each step's
    results kept in buffers made before the rounds, and the list of replays seen meanwhile.

    Returns:
        (expected per set, stored per round and set, replays)."""

    def load(values: list[Tensor]) -> None:
        with torch.no_grad():
            for into, value in zip(tensors, values, strict=True):
                into.copy_(value)

    monkeypatch.setenv(graphs.ENV_VAR, "0")
    expected = []
    for values in contents:
        load(values)
        expected.append([t.clone() for t in step()])
    monkeypatch.delenv(graphs.ENV_VAR)
    replays = count_replays(monkeypatch)
    stored = [[[torch.empty_like(t) for t in want] for want in expected] for _ in range(rounds)]
    for stored_round in stored:
        for values, results in zip(contents, stored_round, strict=True):
            load(values)
            keep(step(), results)
    return expected, stored, replays
