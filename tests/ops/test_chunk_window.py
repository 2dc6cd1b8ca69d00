"""Chunked prefill as causal forwards over each chunk's aligned windows (Note [A chunk as the
forward of its window] in ``core/decode.py``): the rows of a prompt fed in chunks through a
``DilatedKVCache`` equal the float64 oracle's full causal forward, outputs, lse and gradients,
on our fused kernels (CUDA, or Triton's interpreter on the CPU)."""

from __future__ import annotations

import itertools

import pytest
import torch
from support.oracle import oracle_dilated_attention
from support.tolerances import TOLERANCES
from support.triton import KERNEL_DEVICES, skip_without_triton

from dilated_attention import DilatedKVCache, dilated_attention
from dilated_attention.core.decode import chunk_windows
from dilated_attention.core.schedule import Schedule
from dilated_attention.resolve import strategy as strategies


def _windows(context: int, n: int, segs: tuple, rates: tuple, one: bool = False) -> dict:
    found = chunk_windows(context, n, 4, 2, Schedule(segs, rates), one=one)
    return {
        start: list(zip(s.segment_lengths, s.dilation_rates, strict=True))
        for start, s in found.items()
    }


def test_each_branch_starts_its_window_where_its_segments_start_afresh() -> None:
    assert _windows(37, 13, (8, 16), (1, 2)) == {16: [(16, 2)], 24: [(8, 1)]}
    assert _windows(37, 13, (8, 16), (1, 2), one=True) == {16: [(8, 1), (16, 2)]}
    assert _windows(45, 8, (8, 16), (1, 2)) == {32: [(8, 1), (16, 2)]}
    # Segments of 6 and 10 start afresh together every 30 positions.
    assert _windows(70, 5, (6, 10), (1, 2), one=True) == {60: [(6, 1), (10, 2)]}
    assert _windows(70, 5, (6, 10), (1, 2)) == {60: [(6, 1), (10, 2)]}
    # A segment longer than the positions so far is one segment of them, from 0.
    assert _windows(70, 5, (6, 100), (1, 2)) == {0: [(70, 2)], 60: [(6, 1)]}
    assert _windows(70, 5, (6, 100), (1, 2), one=True) == {0: [(6, 1), (70, 2)]}


@pytest.mark.parametrize("needs_grad", [True, False], ids=["one-window", "merged-windows"])
@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_a_prompt_in_chunks_equals_the_full_forward(
    device: str, dtypes: list[torch.dtype], needs_grad: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks that take windows (16..24; 24..37, whose branches start at 16 and 24: one window
    from 16 with gradients, else two merged; 37..45) and chunks that do not (0..16: the prompt,
    45..47: a window of 15 rows for 2 queries): every row, its lse and (with gradients) every
    gradient of q, k and v against the oracle, GQA, two batch rows."""
    skip_without_triton(device)
    windows: list[int] = []
    real = strategies.WindowStrategy._run

    def counted(self, *args):  # type: ignore[no-untyped-def]
        windows.append(len(self.windows))
        return real(self, *args)

    monkeypatch.setattr(strategies.WindowStrategy, "_run", counted)
    segs, rates, n = [8, 16], [1, 2], 47
    gen = torch.Generator().manual_seed(31)
    q, k, v = (torch.randn(2, n, h, 16, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    dout = torch.randn(2, n, 4, 16, generator=gen, dtype=torch.float64)
    for dtype in dtypes:
        tol = TOLERANCES[dtype]
        leaves = [x.to(device=device, dtype=dtype).requires_grad_(needs_grad) for x in (q, k, v)]
        rounded = [x.detach().double().cpu().requires_grad_() for x in leaves]
        want, want_lse = oracle_dilated_attention(*rounded, segs, rates, is_causal=True)
        cache = DilatedKVCache(segs, rates)
        parts = [
            dilated_attention(*(x[:, a:b] for x in leaves), segs, rates, is_causal=True,
                              cache=cache, backend="triton", return_lse=True)
            for a, b in itertools.pairwise([0, 16, 24, 37, 45, n])
        ]  # fmt: skip
        out, lse = torch.cat([o for o, _ in parts], dim=1), torch.cat([s for _, s in parts], 2)
        torch.testing.assert_close(out.double().cpu(), want.detach(), atol=tol.atol, rtol=tol.rtol)
        torch.testing.assert_close(lse.double().cpu(), want_lse.detach(), atol=1e-4, rtol=1e-4)
        if needs_grad:
            grads = torch.autograd.grad(out, leaves, dout.to(device=device, dtype=dtype))
            for got, expected in zip(grads, torch.autograd.grad(want, rounded, dout), strict=True):
                torch.testing.assert_close(got.double().cpu(), expected, atol=tol.grad_atol,
                                           rtol=tol.grad_rtol)  # fmt: skip
    assert windows == [1, 1 if needs_grad else 2, 1] * len(dtypes)
