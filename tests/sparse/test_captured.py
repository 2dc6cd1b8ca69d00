"""MoBA and NSA training steps captured in one CUDA graph: the selection, the forward and the
backward recorded once (``torch.cuda.graph``), then replayed on new inputs copied into the
captured ones, give the outputs of eager calls on those inputs, bit for bit, and their
gradients to a rounding (the backward kernels accumulate in float32 atomically). Both choose
their blocks on the device from the inputs' values, so a replay chooses anew."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from support.graphs import captured
from torch import Tensor

from dilated_attention.sparse import moba_attention, nsa_attention

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
#: (B, N, H, Hkv, D): GQA, a length that leaves a partial last block.
SHAPE = (2, 1000, 4, 2, 64)


def _moba(q: Tensor, k: Tensor, v: Tensor, gates: Tensor) -> Tensor:
    return moba_attention(q, k, v, block_size=128, topk=2)


def _nsa(q: Tensor, k: Tensor, v: Tensor, gates: Tensor) -> Tensor:
    return nsa_attention(q, k, v, gates, compress_block=32, compress_stride=16,
                         select_block=128, topk=2, window=128)  # fmt: skip


def _nsa_recomputed(q: Tensor, k: Tensor, v: Tensor, gates: Tensor) -> Tensor:
    return nsa_attention(q, k, v, gates, compress_block=32, compress_stride=16,
                         select_block=128, topk=2, window=128, recompute=True)  # fmt: skip


def _inputs(seed: int) -> list[Tensor]:
    """q, k, v, gates and the upstream gradient, on CUDA in bf16."""
    batch, n, heads, kv_heads, dim = SHAPE
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch, n, heads, dim), (batch, n, kv_heads, dim), (batch, n, kv_heads, dim),
              (batch, n, heads, 3), (batch, n, heads, dim)]  # fmt: skip
    made = [torch.randn(*shape, generator=g) for shape in shapes]
    made[3] = made[3].sigmoid()
    return [x.to("cuda", BF16) for x in made]


def _eager(attend: Callable[..., Tensor], inputs: list[Tensor], count: int) -> list[Tensor]:
    """The output and the gradients of the first ``count`` of q, k, v and the gates, eagerly."""
    leaves = [x.clone().requires_grad_(i < count) for i, x in enumerate(inputs[:4])]
    out = attend(*leaves)
    return [out.detach(), *torch.autograd.grad(out, leaves[:count], inputs[4])]


@pytest.mark.parametrize(("attend", "count"), [(_moba, 3), (_nsa, 4), (_nsa_recomputed, 4)],
                         ids=["moba", "nsa", "nsa-recomputed"])  # fmt: skip
def test_a_captured_training_step_replays_as_eager_calls_run(
    attend: Callable[..., Tensor], count: int
) -> None:
    """``count``: the inputs with gradients (MoBA takes no gates)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    static = _inputs(0)
    leaves = [x.clone().requires_grad_(i < count) for i, x in enumerate(static[:4])]
    dout = static[4].clone()
    results: list[Tensor] = []

    def step() -> None:
        for leaf in leaves:
            leaf.grad = None
        out = attend(*leaves)
        out.backward(dout)
        results[:] = [out.detach(), *(leaf.grad for leaf in leaves[:count])]

    graph = captured(step)
    for seed in (1, 2):
        fresh = _inputs(seed)
        with torch.no_grad():
            for leaf, value in zip(leaves, fresh[:4], strict=True):
                leaf.copy_(value)
            dout.copy_(fresh[4])
        graph.replay()
        torch.cuda.synchronize()
        want = _eager(attend, fresh, count)
        assert len(results) == len(want) == count + 1
        for name, got, expected in zip(("out", "dq", "dk", "dv", "dgates"), results, want,
                                       strict=False):  # fmt: skip
            if name == "out":  # the forward's kernels are deterministic
                assert torch.equal(got, expected), f"{name} after replay {seed}"
            else:  # the backwards add in float32 atomically, in any order: two eager calls
                # differ by up to a unit of bf16 in entries near the largest
                limit = 2 * torch.finfo(BF16).eps * float(expected.abs().max())
                torch.testing.assert_close(got, expected, rtol=0, atol=limit,
                                           msg=f"{name} after replay {seed}")  # fmt: skip
