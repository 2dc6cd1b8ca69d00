"""A slotted dilated call on FlashAttention-4 replayed from CUDA graphs (Note [A slotted call's
launches from a CUDA graph] in ``core/execution/executor.py``), on a GPU with FA4: once a call
repeats at the same addresses its forward's calls and merge, and its backward's calls and sums,
replay as one graph each, with the bits of the launches; a replay reads what its tensors hold
now; a step never synchronises; every graph of a stream is captured into one memory pool (Note
[Graphs share one memory pool per stream] in ``core/execution/graphs.py``). The route itself is
checked without a GPU in ``tests/core/test_slots.py``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

pytest.importorskip("triton")

from support.graphs import (
    assert_steps_never_synchronise,
    eager_then_replayed,
    random_contents,
    replayed_with_contents,
)

from dilated_attention import backend_reasons
from dilated_attention.core.execution import graphs
from dilated_attention.functional import dilated_attention

pytestmark = pytest.mark.gpu

#: (id, length, heads, kv heads, head dim, segments, rates, causal)
CASES = [
    ("causal", 1024, 4, 4, 64, [128, 512], [1, 4], True),
    ("gqa-full", 1000, 8, 2, 64, [128, 500], [1, 2], False),
    ("no-rate-1-causal", 1000, 4, 4, 128, [256, 1000], [2, 4], True),
]


def _step(case: tuple[Any, ...], seed: int = 0) -> tuple[Callable[[], list[Tensor]], list[Tensor]]:
    """A forward+backward of ``case`` on FlashAttention-4 on fixed leaves: the step and its
    leaves (skipped where FA4 cannot run the call)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _, n, heads, kv_heads, dim, segs, rates, causal = case
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, dout = (torch.randn(1, n, heads, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
               for _ in "qo")  # fmt: skip
    k, v = (torch.randn(1, n, kv_heads, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
            for _ in "kv")  # fmt: skip
    leaves = [x.requires_grad_() for x in (q, k, v)]
    reasons = backend_reasons(*leaves, is_causal=causal)["flash_attn4"]
    if reasons:
        pytest.skip(f"flash_attn4 cannot run here: {'; '.join(reasons)}")

    def step() -> list[Tensor]:
        out, lse = dilated_attention(*leaves, segs, rates, is_causal=causal,
                                     backend="flash_attn4", return_lse=True)  # fmt: skip
        return [out.detach(), lse, *torch.autograd.grad(out, leaves, dout)]

    return step, leaves


def _captured_steps() -> set[str]:
    return {pair[0][0] for pair in graphs._GRAPHS}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_replayed_slot_calls_compute_the_launches_bits(
    case: tuple[Any, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six forward+backward steps on the same leaves: once their addresses repeat, the forward
    and the backward each replay one graph, and every step's output, lse and gradients equal
    those of the launches without graphs, bit for bit; with GQA, dk and dv within bf16's
    rounding, as FA4's backward adds a key/value head's query heads in float32 atomically (in
    no fixed order, graphs or not)."""
    step, _ = _step(case)
    expected, steps, replays = eager_then_replayed(step, monkeypatch)
    shared = case[3] < case[2]
    for i, got in enumerate(steps):
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, expected, strict=True):
            exact = {} if shared and name in ("dk", "dv") else {"rtol": 0, "atol": 0}
            torch.testing.assert_close(a, b, **exact, msg=f"step {i}: {name}")
    assert {"slot_forward", "slot_backward"} <= _captured_steps(), _captured_steps()
    assert len(replays) >= 6, f"{len(replays)} replays in six steps"


def test_a_slot_replay_reads_what_its_tensors_hold_now(monkeypatch: pytest.MonkeyPatch) -> None:
    """New values written into the same leaves between steps: each replay computes from them."""
    step, leaves = _step(CASES[0])
    contents = random_contents(leaves, 3, seed=5)
    expected, rounds, replays = replayed_with_contents(step, leaves, contents, monkeypatch)
    for stored, want in zip(rounds[-1], expected, strict=True):
        for a, b in zip(stored, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert replays


def test_slot_steps_never_synchronise(monkeypatch: pytest.MonkeyPatch) -> None:
    step, _ = _step(CASES[0])
    assert_steps_never_synchronise(step, monkeypatch)


def test_graphs_of_one_stream_share_one_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two layers' calls (other leaves, other addresses) capture four graphs, all into the one
    pool of the current stream; a call on another stream captures into another pool."""
    pools: list[Any] = []
    real = torch.cuda.CUDAGraph.capture_begin

    def capture_begin(graph: torch.cuda.CUDAGraph, pool: Any = None, **kw: Any) -> None:
        pools.append(pool)
        real(graph, pool=pool, **kw)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", capture_begin)
    layers = [_step(CASES[0], seed)[0] for seed in (0, 1)]
    for _ in range(3):
        for layer in layers:
            layer()
    assert len(pools) == 4 and pools[0] is not None and len(set(pools)) == 1, pools
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            layers[0]()
    torch.cuda.current_stream().wait_stream(side)
    assert len(pools) == 6 and len(set(pools)) == 2, pools
