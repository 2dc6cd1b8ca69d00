"""A call's launches replayed from a CUDA graph (Note [A call's launches from a CUDA graph] in
``core/execution/graphs.py``): when a (key, addresses) pair is captured, replayed or run as it
is, checked here with a stand-in graph (no GPU); the GPU tests in
``tests/backends/test_triton_graphs.py`` run the fused engine through real graphs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dilated_attention.core.execution import graphs


class _Graph:
    """A stand-in for a captured CUDA graph: counts its replays."""

    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


class _Calls:
    """What happened to the launches: run as they are, or captured."""

    def __init__(self) -> None:
        self.runs = 0
        self.captures = 0
        self.fail = False
        self.streams: list[int | None] = []

    def launches(self) -> None:
        self.runs += 1

    def capture(self, launches: Any, device: torch.device, stream: int | None) -> _Graph | None:
        self.captures += 1
        self.streams.append(stream)
        return None if self.fail else _Graph()


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> _Calls:
    record = _Calls()
    monkeypatch.setattr(graphs, "_capture", record.capture)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.delenv(graphs.ENV_VAR, raising=False)
    graphs.clear()
    return record


def _graph(key: tuple[Any, ...], tensors: list[torch.Tensor], stream: int | None = None) -> _Graph:
    return graphs._GRAPHS[(key, stream, graphs.addresses(tensors))][0]


def test_the_second_run_captures_and_later_runs_replay(calls: _Calls) -> None:
    x, y = torch.zeros(4), torch.zeros(2, 3)
    for _ in range(4):
        graphs.run_launches(("call",), [x, y], calls.launches)
    assert calls.runs == 1 and calls.captures == 1
    assert _graph(("call",), [x, y]).replays == 3  # captured (and run) once, then replayed


def test_other_addresses_layouts_or_keys_are_other_graphs(calls: _Calls) -> None:
    """The key and every tensor's address, shape, strides and dtype decide the graph."""
    x, y = torch.zeros(4), torch.zeros(2, 3)
    variants: list[tuple[tuple[Any, ...], list[Any]]] = [
        (("call",), [x, y]),
        (("call", 1), [x, y]),  # another key
        (("call",), [x.clone(), y]),  # another address
        (("call",), [x, y.t()]),  # another layout at the same address
        (("call",), [x, y.view(torch.int32)]),  # another dtype
        (("call",), [x, None]),
    ]
    for key, tensors in variants:
        graphs.run_launches(key, tensors, calls.launches)
    assert calls.runs == len(variants) and calls.captures == 0
    for key, tensors in variants:
        graphs.run_launches(key, tensors, calls.launches)
    assert calls.captures == len(variants) and len(graphs._GRAPHS) == len(variants)


def test_a_failed_capture_runs_the_launches_and_never_captures_again(calls: _Calls) -> None:
    calls.fail = True
    x = torch.zeros(4)
    for _ in range(5):
        graphs.run_launches(("call",), [x], calls.launches)
    assert calls.captures == 1 and calls.runs == 5 and not graphs._GRAPHS
    assert graphs.events() == {"captured": 0, "failed": 1, "dropped": 0, "uncaptured": 3}


@pytest.mark.parametrize("why", ["environment", "capturing"])
def test_no_graph_where_turned_off_or_inside_a_capture(
    calls: _Calls, monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    """``DILATED_ATTENTION_CUDA_GRAPHS=0`` turns graphs off; a call inside the caller's own
    capture launches into it."""
    if why == "environment":
        monkeypatch.setenv(graphs.ENV_VAR, "0")
    else:
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    x = torch.zeros(4)
    for _ in range(4):
        graphs.run_launches(("call",), [x], calls.launches)
    assert calls.runs == 4 and calls.captures == 0


def test_the_least_recently_used_graph_goes_first(
    calls: _Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(graphs, "GRAPH_LIMIT", 2)
    x = torch.zeros(4)
    for key in ("a", "b", "a", "b"):
        graphs.run_launches((key,), [x], calls.launches)
    graphs.run_launches(("a",), [x], calls.launches)  # "a" used last: "b" goes
    for _ in range(2):
        graphs.run_launches(("c",), [x], calls.launches)
    assert {pair[0] for pair in graphs._GRAPHS} == {("a",), ("c",)}
    captures = calls.captures
    for _ in range(3):  # a dropped pair launches as it is: no capture every other loop
        graphs.run_launches(("b",), [x], calls.launches)
    assert calls.captures == captures and ("b",) not in {pair[0] for pair in graphs._GRAPHS}
    assert graphs.events() == {"captured": 3, "failed": 0, "dropped": 1, "uncaptured": 3}
    graphs.clear()
    assert graphs.events() == {"captured": 0, "failed": 0, "dropped": 0, "uncaptured": 0}


def test_a_graph_keeps_what_its_launches_read(calls: _Calls) -> None:
    """Tensors the key does not name (a segment table) live as long as the graph."""
    x, table = torch.zeros(4), torch.arange(3)
    for _ in range(2):
        graphs.run_launches(("call",), [x], calls.launches, keep=table)
    assert graphs._GRAPHS[(("call",), None, graphs.addresses([x]))][1] is table
    graphs.clear()
    assert not graphs._GRAPHS and not graphs._RUNS


def test_a_call_on_another_stream_finds_another_graph(
    calls: _Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stream a call runs on is part of its key (Note [Graphs share one memory pool per
    stream]): graphs of one pool are only replayed on the stream they share."""
    stream = [7]
    monkeypatch.setattr(graphs, "_stream_of", lambda device: stream[0])
    x = torch.zeros(4)
    for _ in range(3):
        graphs.run_launches(("call",), [x], calls.launches)
    stream[0] = 9
    for _ in range(3):
        graphs.run_launches(("call",), [x], calls.launches)
    assert calls.streams == [7, 9] and calls.runs == 2
    assert _graph(("call",), [x], 7).replays == 2 and _graph(("call",), [x], 9).replays == 2
