"""The fused engine's launches replayed from CUDA graphs (Note [A call's launches from a CUDA
graph] in ``core/execution/graphs.py``), on a GPU: a call that repeats at the same addresses
replays its graph and computes the bits the launches compute, follows its tensors' contents,
never synchronises, and launches into a caller's own capture instead. The cache's rules are
checked without a GPU in ``tests/core/test_launch_graphs.py``."""

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

from dilated_attention.backends.triton_kernels import launch as L
from dilated_attention.core.execution import fused, graphs
from dilated_attention.functional import dilated_attention

pytestmark = pytest.mark.gpu


#: (id, length, heads, kv heads, head dim, segments, rates, causal, options)
CASES = [
    ("causal-gqa", 1000, 4, 2, 64, [128, 512], [1, 4], True, {}),
    ("full-mask", 777, 4, 4, 64, [128, 512], [1, 4], False, {"mask": True}),
    ("packed", 1000, 4, 2, 64, [128, 512], [1, 4], True, {"cu_seqlens": [0, 300, 1000]}),
    ("no-rate-1", 1000, 4, 4, 32, [256, 1000], [2, 4], True, {}),
    ("single-branch", 1000, 4, 2, 64, [512], [2], False, {}),
    ("softcap", 1000, 4, 2, 64, [128, 512], [1, 4], True, {"softcap": 5.0}),
    ("groups", 1000, 8, 4, 32, [128, 250, 500], [1, 2, 4], True, {"split": True}),
]


def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def _step(case: tuple[Any, ...], seed: int = 0) -> tuple[Callable[[], list[Tensor]], list[Tensor]]:
    """A forward+backward of ``case`` on fixed leaves: the step and its leaves."""
    _, n, heads, kv_heads, dim, segs, rates, causal, options = case
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, dout = (torch.randn(1, n, heads, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
               for _ in "qo")  # fmt: skip
    k, v = (torch.randn(1, n, kv_heads, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
            for _ in "kv")  # fmt: skip
    mask = torch.rand(1, n, device="cuda", generator=gen) < 0.2 if options.get("mask") else None
    leaves = [x.requires_grad_() for x in (q, k, v)]

    def step() -> list[Tensor]:
        out, lse = dilated_attention(
            *leaves, segs, rates, is_causal=causal, key_padding_mask=mask,
            cu_seqlens=options.get("cu_seqlens"), softcap=options.get("softcap"),
            backend="triton", return_lse=True,
        )  # fmt: skip
        return [out.detach(), lse, *torch.autograd.grad(out, leaves, dout)]

    return step, leaves


def _split(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many position and head groups on a small input (what very long sequences get)."""
    monkeypatch.setattr(fused, "MIN_GROUP_POSITIONS", 1)
    monkeypatch.setattr(fused, "GROUPS_PER_SEQUENCE", 1000)
    monkeypatch.setattr(fused, "SCRATCH_SHARE", 1000)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_replayed_calls_compute_the_launches_bits(
    case: tuple[Any, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six forward+backward steps on the same leaves: once their addresses repeat they replay
    graphs (forward and backward), and every step's output, lse and gradients equal those of
    the launches without graphs, bit for bit."""
    _needs_cuda()
    if case[-1].get("split"):
        _split(monkeypatch)
    step, _ = _step(case)
    expected, steps, replays = eager_then_replayed(step, monkeypatch)
    for i, got in enumerate(steps):
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"step {i}: {name}")
    assert graphs._GRAPHS, f"no call was captured ({graphs.events()})"
    assert len(replays) >= 4, f"{len(replays)} replays in six steps ({graphs.events()})"


def test_a_replay_reads_what_its_tensors_hold_now(monkeypatch: pytest.MonkeyPatch) -> None:
    """New values written into the same leaves between steps: each replay computes from them."""
    _needs_cuda()
    step, leaves = _step(CASES[0])
    contents = random_contents(leaves, 4, seed=5)
    expected, rounds, replays = replayed_with_contents(step, leaves, contents, monkeypatch)
    for stored_round in rounds:
        for stored, want in zip(stored_round, expected, strict=True):
            for a, b in zip(stored, want, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert replays


def test_steps_through_graphs_never_synchronise(monkeypatch: pytest.MonkeyPatch) -> None:
    """Capturing and replaying pass ``torch.cuda.set_sync_debug_mode("error")``."""
    _needs_cuda()
    step, _ = _step(CASES[0])
    assert_steps_never_synchronise(step, monkeypatch)


def test_a_callers_capture_takes_the_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward captured by the caller's ``torch.cuda.graph`` after our graphs of the same call
    exist launches into the caller's graph: replaying it with new inputs computes theirs."""
    _needs_cuda()
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(1, 1000, 4, 64, device="cuda", generator=gen, dtype=torch.bfloat16)
               for _ in "qkv")  # fmt: skip

    def forward() -> Tensor:
        return dilated_attention(q, k, v, [128, 512], [1, 4], is_causal=True, backend="triton")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(4):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    assert graphs._GRAPHS
    captured = torch.cuda.CUDAGraph()
    with torch.cuda.graph(captured), torch.no_grad():
        static = forward()
    new_q = torch.randn(q.shape, device="cuda", generator=gen, dtype=q.dtype)
    q.copy_(new_q)
    captured.replay()
    monkeypatch.setenv(graphs.ENV_VAR, "0")
    with torch.no_grad():
        torch.testing.assert_close(static, forward(), rtol=0, atol=0)


def test_a_replayed_step_runs_no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a step's graphs exist, its launches cost the host no launcher call. From an empty
    cache: in a worker that ran many tests, an earlier test's pair of the same key and addresses
    may have been dropped past GRAPH_LIMIT, and a dropped pair never captures again. Stepped
    until a step after a capture runs no launcher: in such a worker the allocator may hand a
    step's scratch several sets of addresses in turn, each set captured on its own second run
    (a step that captures nothing new can be a first run at new addresses)."""
    _needs_cuda()
    graphs.clear()
    step, _ = _step(CASES[0])
    launched: list[Any] = []
    real = L._Bound.__call__

    def spy(self: Any, roles: Any) -> None:
        launched.append(1)
        real(self, roles)

    monkeypatch.setattr(L._Bound, "__call__", spy)
    per_step: list[int] = []
    for _ in range(12):
        before = len(launched)
        step()
        per_step.append(len(launched) - before)
        if graphs.events()["captured"] > 0 and per_step[-1] == 0:
            break
    # A capture can also fail (a worker beside eleven others on one GPU): the events say which.
    assert graphs.events()["captured"] > 0, f"nothing captured: {graphs.events()}"
    assert per_step[-1] == 0, f"launches per step {per_step}; graph events {graphs.events()}"
