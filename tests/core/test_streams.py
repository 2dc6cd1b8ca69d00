"""Two chains of launches side by side (Note [Two chains side by side] in
``core/execution/streams.py``): the helper's order and streams, and the fused engine's backward
split into its dK/dV chain and its dQ chain."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.graphs import eager_then_replayed

from dilated_attention import attention, dilated_attention
from dilated_attention.backends import triton as triton_backend
from dilated_attention.core.execution import fused, fused_heads, graphs, streams

CUDA = torch.device("cuda")


def test_off_cuda_the_chains_run_one_after_the_other() -> None:
    order: list[str] = []
    streams.side_by_side(torch.device("cpu"), lambda: order.append("a"), lambda: order.append("b"))
    assert order == ["a", "b"]


class _Recording:
    """A fused backend that records each branch launch: (rate, part, accumulate, stream)."""

    def __init__(self) -> None:
        self.launches: list[tuple[int, str, bool, int | None]] = []

    def row_delta(self, *args: Any) -> None:
        pass

    def run_launches(self, key: Any, tensors: Any, launches: Any, keep: object = None) -> None:
        launches()

    def backward_branch(self, *args: Any, **kwargs: Any) -> None:
        stream = torch.cuda.current_stream().cuda_stream if args[1].is_cuda else None
        span = args[10]
        self.launches.append((span.rate, kwargs["part"], kwargs["accumulate"], stream))


def _backward(backend: _Recording, device: torch.device, kv_heads: int, branches: Any) -> None:
    q = torch.zeros(1, 64, 4, 8, device=device)
    kv = torch.zeros(1, 64, kv_heads, 8, device=device)
    lse = torch.zeros(1, 4, 64, device=device)
    fused.fused_backward(
        q, q, kv, kv, q, lse, None, branches, backend, is_causal=True, scale=1.0  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("branches", [((16, 1), (32, 2), (64, 4)), ((32, 2),), ((16, 1),)])
def test_the_backward_runs_every_branch_dkdv_then_every_branch_dq(branches: Any) -> None:
    """Per head range, the dK/dV chain launches every branch (a rate-1 branch first, which
    writes where it covers every row), then the dQ chain the same branches with the same
    accumulate flags: neither chain reads what the other writes. A single branch writes the
    gradients themselves (zeroed first where it does not cover every row)."""
    backend = _Recording()
    _backward(backend, torch.device("cpu"), 2, branches)
    per_range = len(branches)
    assert len(backend.launches) % (2 * per_range) == 0
    for start in range(0, len(backend.launches), 2 * per_range):
        keys = backend.launches[start : start + per_range]
        queries = backend.launches[start + per_range : start + 2 * per_range]
        assert [part for _, part, _, _ in keys] == ["keys"] * per_range
        assert [part for _, part, _, _ in queries] == ["queries"] * per_range
        assert [(r, a) for r, _, a, _ in keys] == [(r, a) for r, _, a, _ in queries]
        rates = [r for r, _, _, _ in keys]
        first = 1 not in rates and per_range > 1
        assert [a for _, _, a, _ in keys] == [first] + [True] * (per_range - 1)
        if 1 in rates:
            assert rates[0] == 1


@pytest.mark.gpu
def test_the_dq_chain_runs_on_a_side_stream_after_and_before_the_callers_work() -> None:
    """On CUDA the dK/dV chain stays on the caller's stream and the dQ chain runs on another,
    which starts after what the caller issued before and ends before what it issues after."""
    backend = _Recording()
    _backward(backend, CUDA, 4, ((16, 1), (32, 2)))
    current = torch.cuda.current_stream().cuda_stream
    assert {s for _, part, _, s in backend.launches if part == "keys"} == {current}
    side = {s for _, part, _, s in backend.launches if part == "queries"}
    assert len(side) == 1 and current not in side

    x = torch.zeros(1 << 20, device=CUDA)
    y = torch.zeros_like(x)
    torch.cuda._sleep(50_000_000)  # tens of milliseconds: a missing fork reads zeros
    x.fill_(1.0)
    streams.side_by_side(CUDA, lambda: None, lambda: y.copy_(x))
    assert y.sum().item() == y.numel()

    def late_fill() -> None:
        torch.cuda._sleep(50_000_000)  # a missing join reads zeros
        x.fill_(2.0)

    streams.side_by_side(CUDA, lambda: None, late_fill)
    assert x.sum().item() == 2 * x.numel()


@pytest.mark.gpu
def test_a_failing_chain_still_joins() -> None:
    """A launch that raises leaves the side stream joined: the caller's later work waits."""
    x = torch.zeros(1 << 20, device=CUDA)

    def fill_then_fail() -> None:
        torch.cuda._sleep(50_000_000)
        x.fill_(1.0)
        raise RuntimeError("launch failed")

    with pytest.raises(RuntimeError, match="launch failed"):
        streams.side_by_side(CUDA, lambda: None, fill_then_fail)
    assert x.sum().item() == x.numel()


@pytest.mark.gpu
def test_side_by_side_inside_a_graph_capture() -> None:
    """Captured, the side stream joins the graph and the replay runs both chains."""
    a = torch.zeros(1024, device=CUDA)
    b = torch.zeros(1024, device=CUDA)
    src = torch.arange(1024.0, device=CUDA)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        streams.side_by_side(CUDA, lambda: a.copy_(src * 2), lambda: b.copy_(src + 1))
    torch.cuda.current_stream().wait_stream(side)
    src.add_(1.0)
    graph.replay()
    expected = torch.arange(1024.0, device=CUDA) + 1
    assert torch.equal(a, expected * 2) and torch.equal(b, expected + 1)


def _one_stream(device: torch.device, first: Any, second: Any) -> None:
    first()
    second()


@pytest.mark.gpu
@pytest.mark.parametrize("kv_heads", [16, 4])
def test_the_backwards_side_by_side_give_the_bits_of_one_stream(
    monkeypatch: pytest.MonkeyPatch, kv_heads: int
) -> None:
    """The chains write disjoint scratch, so running them side by side gives the gradients the
    same launches give on one stream, bit for bit: the fused engine (causal branches, GQA)
    eagerly and replayed from its captured graphs, and the dense Triton backward."""
    pytest.importorskip("triton")
    torch.manual_seed(0)
    n = 1000
    q = torch.randn(1, n, 16, 64, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    k, v = (
        torch.randn(1, n, kv_heads, 64, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
        for _ in range(2)
    )
    dout = torch.randn_like(q)

    def step() -> list[torch.Tensor]:
        out = dilated_attention(q, k, v, (256, 512, 1000), (1, 2, 4), is_causal=True,
                                backend="triton")  # fmt: skip
        dense = attention(q, k, v, is_causal=True, backend="triton")
        return list(torch.autograd.grad((out, dense), (q, k, v), (dout, dout)))

    with monkeypatch.context() as one:
        one.setattr(fused_heads, "side_by_side", _one_stream)
        one.setattr(triton_backend, "side_by_side", _one_stream)
        one.setenv(graphs.ENV_VAR, "0")
        one_stream = step()
    eager, replayed, replays = eager_then_replayed(step, monkeypatch)
    assert replays and graphs.events()["failed"] == 0
    for run in [eager, *replayed]:
        for got, want in zip(run, one_stream, strict=True):
            assert torch.equal(got, want)
