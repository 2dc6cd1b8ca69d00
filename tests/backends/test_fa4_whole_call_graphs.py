"""Whole FlashAttention-4 calls (dense ``attention()``) replayed from CUDA graphs (Note [A whole
call's launches from a CUDA graph] in ``backends/flash_attn4/__init__.py``), on a GPU with FA4:
once a call repeats at the same addresses its forward and its backward replay a graph each, with
the results of the launches; a replay reads what its tensors hold now; a step never
synchronises; a backward in chunks of heads replays below the pool's bound and launches as
usual past it. The route itself is checked without a GPU in
``tests/backends/test_optional_backends.py``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

pytest.importorskip("triton")

from support.graphs import (
    assert_same_results,
    assert_steps_never_synchronise,
    eager_then_replayed,
    random_contents,
    replayed_with_contents,
)

import dilated_attention.backends.flash_attn4.chunks as chunk_rule
from dilated_attention import attention, backend_reasons
from dilated_attention.core.execution import graphs

pytestmark = pytest.mark.gpu

#: (id, length, heads, kv heads, head dim, causal, window_size, softcap, key padding)
CASES = [
    ("causal", 1024, 4, 4, 128, True, None, None, False),
    ("gqa-full-odd", 1000, 8, 2, 64, False, None, None, False),
    ("window-softcap-gqa", 1024, 4, 2, 128, True, (255, 0), 30.0, False),
    ("key-padding", 777, 4, 4, 64, False, None, None, True),
]


def _step(case: tuple[Any, ...], seed: int = 0) -> tuple[Callable[[], list[Tensor]], list[Tensor]]:
    """A forward+backward of ``case`` through ``attention(backend="flash_attn4")`` on fixed
    leaves: the step and its leaves (skipped where FA4 cannot run the call)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _, n, heads, kv_heads, dim, causal, window, softcap, padded = case
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, dout = (torch.randn(1, n, heads, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
               for _ in "qo")  # fmt: skip
    k, v = (torch.randn(1, n, kv_heads, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
            for _ in "kv")  # fmt: skip
    leaves = [x.requires_grad_() for x in (q, k, v)]
    mask = None
    if padded:
        mask = torch.zeros(1, n, dtype=torch.bool, device="cuda")
        mask[:, n - 100 :] = True
    options: dict[str, Any] = {"is_causal": causal, "window_size": window, "softcap": softcap,
                               "key_padding_mask": mask}  # fmt: skip
    reasons = backend_reasons(*leaves, is_causal=causal, key_padding_mask=mask)["flash_attn4"]
    if reasons:
        pytest.skip(f"flash_attn4 cannot run here: {'; '.join(reasons)}")

    def step() -> list[Tensor]:
        out, lse = attention(*leaves, backend="flash_attn4", return_lse=True, **options)
        return [out.detach(), lse, *torch.autograd.grad(out, leaves, dout)]

    return step, leaves


def _captured() -> set[str]:
    return {pair[0][0] for pair in graphs._GRAPHS}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_replayed_whole_calls_compute_the_launches_results(
    case: tuple[Any, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ten forward+backward steps on the same leaves: once their addresses repeat, the forward
    and the backward replay a graph each, and every step's out, lse and gradients equal those of
    the launches without graphs. (A key padding mask's calls allocate more besides, so their
    addresses take a few steps longer to settle: six steps gave 4-8 replays.)"""
    step, _ = _step(case)
    expected, steps, replays = eager_then_replayed(step, monkeypatch, steps=10)
    for i, got in enumerate(steps):
        assert_same_results(got, expected, f"step {i}: ")
    assert _captured() == {"fa4 forward", "fa4 backward"}, _captured()
    assert len(replays) >= 8, f"{len(replays)} replays in ten steps"


def test_a_whole_call_replay_reads_what_its_tensors_hold_now(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """New values written into the same leaves between steps: each replay computes from them."""
    step, leaves = _step(CASES[0])
    contents = random_contents(leaves, 3, seed=5)
    expected, rounds, replays = replayed_with_contents(step, leaves, contents, monkeypatch)
    for stored, want in zip(rounds[-1], expected, strict=True):
        assert_same_results(stored, want)
    assert replays


def test_whole_call_steps_never_synchronise(monkeypatch: pytest.MonkeyPatch) -> None:
    step, _ = _step(CASES[1])
    assert_steps_never_synchronise(step, monkeypatch)


@pytest.mark.parametrize("large", [False, True], ids=["replayed", "past-the-bound"])
def test_a_chunked_backward_replays_below_the_pool_bound(
    large: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backward in chunks of heads (forced here: one per query head, the later heads of each
    group adding their dk and dv from buffers of their own) replays its chunks from one graph
    where each adds less than MAX_REPLAYED_CHUNK_BYTES, and runs them eagerly past that bound
    (forced to 0); its forward replays either way, and every step gives the results of the
    launches."""
    monkeypatch.setattr(chunk_rule, "MIN_CHUNKED_ACCUMULATOR_BYTES", 0)
    monkeypatch.setattr(chunk_rule, "accumulator_chunks", lambda q, k, *rule: q.shape[2])
    if large:
        monkeypatch.setattr(chunk_rule, "MAX_REPLAYED_CHUNK_BYTES", 0)
    step, _ = _step(CASES[1])
    expected, steps, replays = eager_then_replayed(step, monkeypatch)
    for i, got in enumerate(steps):
        assert_same_results(got, expected, f"step {i}: ")
    want = {"fa4 forward"} if large else {"fa4 forward", "fa4 backward"}
    assert _captured() == want, _captured()
    assert len(replays) >= 4, f"{len(replays)} replays in six steps"
