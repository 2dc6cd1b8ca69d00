"""A run-time mask's FlashAttention-4 forward replayed from a CUDA graph (Note [A run-time
mask's forward in one graph] in ``block_sparse/fa4.py``), on a GPU with FA4: once a call repeats
at the same addresses its lists' launch, FA4's kernel and the fills replay as one graph, with the
bits of the launches; a replay reads the indices and inputs its tensors hold now; a step never
synchronises; a backward without the forward fills the lists itself."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

pytest.importorskip("triton")

from support.graphs import (
    assert_same_results,
    assert_steps_never_synchronise,
    eager_then_replayed,
    replayed_with_contents,
)

from dilated_attention import block_sparse_attention
from dilated_attention.backends.base import KernelInputs
from dilated_attention.backends.registry import Selection, get_backend
from dilated_attention.block_sparse.fa4 import FlashAttn4BlockSparseRunner
from dilated_attention.block_sparse.runtime import check_block_mask
from dilated_attention.core.autograd import Backward
from dilated_attention.core.execution import graphs
from dilated_attention.resolve import BLOCK_SPARSE, Request
from dilated_attention.resolve.block_masks import RuntimeMaskStrategy

pytestmark = pytest.mark.gpu


#: (id, length, heads, kv heads, head dim, block size, mask heads, indices, causal, documents);
#: with documents the call is one packed row of ``length`` positions.
CASES = [
    ("indices-causal-gqa", 1024, 4, 2, 64, 128, 4, True, True, None),
    ("indices-kv-heads", 1024, 4, 2, 128, 256, 2, True, False, None),
    ("indices-packed", 2048, 4, 2, 64, 128, 1, True, True, [0, 384, 1024, 1408, 2048]),
    ("bool-mask", 1000, 4, 2, 64, 128, 4, False, True, None),
]


def _needs_fa4() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    q = torch.empty(1, 256, 4, 64, device="cuda", dtype=torch.bfloat16)
    inputs = KernelInputs.from_tensors(q, q, requires_grad=True, block_size=128)
    reasons = get_backend("flash_attn4").block_sparse_reasons(inputs)
    if reasons:
        pytest.skip(f"flash_attn4 (FlashAttention-4) block sparsity cannot run here: {reasons}")


def _mask(case: tuple[Any, ...], gen: torch.Generator) -> Tensor:
    """Three block indices per query block (-1 among them), or a bool mask."""
    _, n, _, _, _, bs, mask_heads, indices, *_ = case
    m = -(-n // bs)
    if indices:
        return torch.randint(-1, m, (1, mask_heads, m, 3), device="cuda", generator=gen)
    return torch.rand(1, mask_heads, m, m, device="cuda", generator=gen) < 0.4


class _Call:
    """A forward+backward of a case on fixed leaves, mask and output gradient."""

    def __init__(self, case: tuple[Any, ...]) -> None:
        _, n, heads, kv_heads, dim, self.block_size, _, _, self.causal, self.documents = case
        gen = torch.Generator(device="cuda").manual_seed(n + heads)
        q, self.dout = (torch.randn(1, n, heads, dim, device="cuda", generator=gen,
                                    dtype=torch.bfloat16) for _ in "qo")  # fmt: skip
        k, v = (torch.randn(1, n, kv_heads, dim, device="cuda", generator=gen,
                            dtype=torch.bfloat16) for _ in "kv")  # fmt: skip
        self.mask = _mask(case, gen)
        self.leaves = [x.requires_grad_() for x in (q, k, v)]

    def forward(self, *inputs: Tensor) -> tuple[Tensor, Tensor]:
        return block_sparse_attention(  # type: ignore[return-value]
            *inputs, self.mask, block_size=self.block_size, is_causal=self.causal,
            cu_seqlens=self.documents, backend="flash_attn4", return_lse=True,
        )  # fmt: skip

    def step(self) -> list[Tensor]:
        out, lse = self.forward(*self.leaves)
        grads = torch.autograd.grad(out, self.leaves, self.dout)
        return [out.detach(), lse.detach(), *grads]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_replayed_forwards_compute_the_launches_bits(
    case: tuple[Any, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six forward+backward steps on the same leaves and mask: from the second on the forward
    and the backward replay a graph each, and every step's out, lse and gradients equal the
    launches' without graphs (out and lse bit for bit; Note [A block-sparse backward in one
    graph])."""
    _needs_fa4()
    step = _Call(case).step
    expected, steps, replays = eager_then_replayed(step, monkeypatch)
    for i, got in enumerate(steps):
        assert_same_results(got, expected, f"step {i}: ")
    captured = {pair[0][0] for pair in graphs._GRAPHS}
    assert captured == {"fa4 block-sparse forward", "fa4 block-sparse backward"}, captured
    assert len(replays) >= 8, f"{len(replays)} replays in six steps"


def test_a_replay_reads_the_indices_its_tensor_holds_now(monkeypatch: pytest.MonkeyPatch) -> None:
    """Other blocks and other inputs written into the same tensors between steps: each
    replay computes the call of what they hold, as the launches without graphs do."""
    _needs_fa4()
    case = CASES[0]
    call = _Call(case)
    step, leaves, mask = call.step, call.leaves, call.mask
    gen = torch.Generator(device="cuda").manual_seed(7)
    contents = [[*(torch.randn(x.shape, device="cuda", generator=gen).to(x.dtype)
                   for x in leaves), _mask(case, gen)] for _ in range(3)]  # fmt: skip
    expected, rounds, replays = replayed_with_contents(step, [*leaves, mask], contents,
                                                       monkeypatch)  # fmt: skip
    for stored_round in rounds:
        for stored, want in zip(stored_round, expected, strict=True):
            assert_same_results(stored, want)
    assert replays


def test_replayed_steps_never_synchronise(monkeypatch: pytest.MonkeyPatch) -> None:
    """Capturing and replaying pass ``torch.cuda.set_sync_debug_mode("error")``."""
    _needs_fa4()
    assert_steps_never_synchronise(_Call(CASES[0]).step, monkeypatch)


def test_a_backward_without_its_forward_fills_the_lists() -> None:
    """The runner's backward run straight after ``prepare`` (what the compiled operator's
    backward does without a forward) gives the gradients of a full call."""
    _needs_fa4()
    call = _Call(CASES[0])
    *_, dq, dk, dv = call.step()
    q, k, v = (x.detach() for x in call.leaves)
    with torch.no_grad():
        out, lse = call.forward(q, k, v)
    layout = check_block_mask(call.mask, q, k, call.block_size)
    request = Request.of(BLOCK_SPARSE, q, k, v, block_mask=layout, block_size=call.block_size,
                         is_causal=True, scale=q.shape[-1] ** -0.5)  # fmt: skip
    selection = Selection(get_backend("flash_attn4"), runs_plan=True)
    strategy = RuntimeMaskStrategy(request, selection, "block_sparse", None, "FA4")
    prepared = strategy.prepare(q, k, v, call.mask)
    assert prepared is not None
    runner, x = prepared
    tiles = runner.tiles
    assert isinstance(runner, FlashAttn4BlockSparseRunner) and tiles.pending is not None
    assert not tiles.pending.done
    # Buffers the allocator may hand back with an earlier call's right values: wrong values now.
    for flags in (tiles.empty_rows, tiles.unread_keys):
        assert flags is not None
        flags.fill_(True)
    saved = runner.saved_without_forward(x)
    grads = runner.backward(Backward(call.dout, x.q, out, lse, saved, None))
    assert tiles.pending.done
    for got, want in zip(grads, (dq, dk, dv), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
