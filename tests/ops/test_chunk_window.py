"""Chunked prefill as the causal forward of each chunk's aligned window (Note [A chunk as the
forward of its window] in ``core/decode.py``): the rows of a prompt fed in chunks through a
``DilatedKVCache`` equal the float64 oracle's full causal forward, outputs and gradients, on
our fused kernels (CUDA, or Triton's interpreter on the CPU)."""

from __future__ import annotations

import itertools

import pytest
import torch
from support.oracle import oracle_dilated_attention
from support.tolerances import TOLERANCES
from support.triton import KERNEL_DEVICES, skip_without_triton

from dilated_attention import DilatedKVCache, dilated_attention
from dilated_attention.core.decode import window_start
from dilated_attention.core.schedule import Schedule
from dilated_attention.resolve import strategy as strategies


def test_the_window_starts_where_every_segment_starts_afresh() -> None:
    schedule = Schedule((8, 16), (1, 2))
    assert window_start(37, 13, 4, 2, schedule) == 16  # the chunk 24..36
    assert window_start(45, 8, 4, 2, schedule) == 32
    assert window_start(12, 12, 4, 2, schedule) == 0
    # Segments of 6 and 10 start afresh every 30 positions; a segment longer than the
    # positions so far is clipped to them (one segment from 0).
    assert window_start(70, 5, 4, 2, Schedule((6, 10), (1, 2))) == 60
    assert window_start(70, 5, 4, 2, Schedule((6, 100), (1, 2))) == 0


@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_a_prompt_in_chunks_equals_the_full_forward(
    device: str, dtypes: list[torch.dtype], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks that take their window (16..24, 24..37, 37..45) and chunks that do not (0..16:
    no fused choice needed, 45..47: a window of 15 rows for 2 queries): every row and every
    gradient of q, k and v against the oracle, GQA, two batch rows."""
    skip_without_triton(device)
    windows: list[int] = []
    real = strategies.WindowStrategy._run
    monkeypatch.setattr(strategies.WindowStrategy, "_run",
                        lambda self, *a: windows.append(1) or real(self, *a))  # fmt: skip
    segs, rates, n = [8, 16], [1, 2], 47
    gen = torch.Generator().manual_seed(31)
    q, k, v = (torch.randn(2, n, h, 16, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    dout = torch.randn(2, n, 4, 16, generator=gen, dtype=torch.float64)
    cuts = [0, 16, 24, 37, 45, n]
    for dtype in dtypes:
        tol = TOLERANCES[dtype]
        leaves = [x.to(device=device, dtype=dtype).requires_grad_() for x in (q, k, v)]
        rounded = [x.detach().double().cpu().requires_grad_() for x in leaves]
        want, _ = oracle_dilated_attention(*rounded, segs, rates, is_causal=True)
        want_grads = torch.autograd.grad(want, rounded, dout)
        cache = DilatedKVCache(segs, rates)
        outs = [
            dilated_attention(*(x[:, a:b] for x in leaves), segs, rates, is_causal=True,
                              cache=cache, backend="triton")
            for a, b in itertools.pairwise(cuts)
        ]  # fmt: skip
        out = torch.cat(outs, dim=1)
        grads = torch.autograd.grad(out, leaves, dout.to(device=device, dtype=dtype))
        torch.testing.assert_close(out.double().cpu(), want, atol=tol.atol, rtol=tol.rtol)
        for got, expected in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(got.double().cpu(), expected, atol=tol.grad_atol,
                                       rtol=tol.grad_rtol)  # fmt: skip
    assert len(windows) == 3 * len(dtypes)
