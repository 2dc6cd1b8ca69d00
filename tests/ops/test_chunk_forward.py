"""Chunked prefill as one forward of our fused kernels per chunk (Note [A chunk in one fused
forward] in ``core/execution/fused.py``): the rows of a prompt fed in chunks through a
``DilatedKVCache`` equal the float64 oracle's full causal forward, outputs and lse, on our fused
kernels (CUDA, or Triton's interpreter on the CPU); with gradients the chunks run decoding rows, and
every gradient matches too."""

from __future__ import annotations

import itertools

import pytest
import torch
from support.oracle import oracle_dilated_attention
from support.tolerances import TOLERANCES
from support.triton import KERNEL_DEVICES, poison_new_buffers, skip_without_triton

from dilated_attention import DilatedKVCache, dilated_attention
from dilated_attention.core.execution.fused import ChunkQueries
from dilated_attention.resolve import strategy as strategies


def test_each_branch_starts_where_the_first_querys_segment_starts() -> None:
    # k's row 0 is position 10; the chunk's first query is position 10 + 27 = 37.
    chunk = ChunkQueries(first=27, origin=10)
    assert [chunk.segment_start(w) for w in (8, 16, 37, 40)] == [22, 22, 27, -10]


def _chunk_runs(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Records, per run of a fused strategy, whether it ran a chunk."""
    runs: list[bool] = []
    real = strategies.FusedStrategy._run

    def counted(self, *args):  # type: ignore[no-untyped-def]
        runs.append(self.chunk is not None)
        return real(self, *args)

    monkeypatch.setattr(strategies.FusedStrategy, "_run", counted)
    return runs


CASES = {
    # segments that nest; chunks from mid-segment, across segments, of one row
    "nested": ([8, 16], [1, 2], [0, 16, 24, 37, 45, 46, 47]),
    # segments that do not nest (the cache keeps rows from min over w of (N // w) * w), rate 3
    "not-nested": ([6, 10], [1, 3], [0, 13, 21, 29, 40, 47]),
    # a segment longer than the prompt so far: one segment of it, from position 0
    "long": ([4, 64], [1, 2], [0, 5, 19, 33, 47]),
}


# Every case as the fused chunk forward; with gradients (decoding rows, whose dense calls
# compile their own kernels: 15-29 s a case on an H100 with the mask's kernels too) the nested
# case without a mask; the CPU tests of the cache run every schedule with gradients, and masks,
# on the math kernels (tests/ops/test_decoding.py).
RUNS = [*((case, False) for case in CASES), ("nested", True)]


@pytest.mark.parametrize(
    ("case", "needs_grad"), RUNS, ids=[f"{c}-{'decoding-rows' if g else 'fused'}" for c, g in RUNS]
)
@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_a_prompt_in_chunks_equals_the_full_forward(
    device: str,
    dtypes: list[torch.dtype],
    case: str,
    needs_grad: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every row, its lse and (with gradients) every gradient of q, k and v against the oracle,
    GQA, two batch rows, a key padding mask (without gradients); new buffers start NaN-filled,
    so a row the chunk forward leaves unwritten shows."""
    skip_without_triton(device)
    poison_new_buffers(monkeypatch)
    runs = _chunk_runs(monkeypatch)
    segs, rates, cuts = CASES[case]
    if needs_grad:  # the prompt, an aligned chunk, one from mid-segment (each call compiles)
        cuts = cuts[:4]
    n = cuts[-1]
    gen = torch.Generator().manual_seed(31)
    q, k, v = (torch.randn(2, n, h, 16, generator=gen, dtype=torch.float64) for h in (6, 3, 3))
    dout = torch.randn(2, n, 6, 16, generator=gen, dtype=torch.float64)
    mask = None if needs_grad else torch.rand(2, n, generator=gen) < 0.2
    for dtype in dtypes:
        tol = TOLERANCES[dtype]
        leaves = [x.to(device=device, dtype=dtype).requires_grad_(needs_grad) for x in (q, k, v)]
        rounded = [x.detach().double().cpu().requires_grad_() for x in leaves]
        want, want_lse = oracle_dilated_attention(
            *rounded, segs, rates, is_causal=True, key_padding_mask=mask
        )
        cache = DilatedKVCache(segs, rates)
        masks = [None if mask is None else mask[:, a:b].to(device)
                 for a, b in itertools.pairwise(cuts)]  # fmt: skip
        parts = [
            dilated_attention(*(x[:, a:b] for x in leaves), segs, rates, is_causal=True,
                              cache=cache, backend="triton", return_lse=True,
                              key_padding_mask=part_mask)
            for (a, b), part_mask in zip(itertools.pairwise(cuts), masks, strict=True)
        ]  # fmt: skip
        out, lse = torch.cat([o for o, _ in parts], dim=1), torch.cat([s for _, s in parts], 2)
        torch.testing.assert_close(out.double().cpu(), want.detach(), atol=tol.atol, rtol=tol.rtol)
        torch.testing.assert_close(lse.double().cpu(), want_lse.detach(), atol=1e-4, rtol=1e-4)
        if needs_grad:
            grads = torch.autograd.grad(out, leaves, dout.to(device=device, dtype=dtype))
            for got, expected in zip(grads, torch.autograd.grad(want, rounded, dout), strict=True):
                torch.testing.assert_close(got.double().cpu(), expected, atol=tol.grad_atol,
                                           rtol=tol.grad_rtol)  # fmt: skip
    # the first part is the prompt itself (a whole forward); a single new token is one call
    chunks = sum(b - a > 1 for a, b in itertools.pairwise(cuts[1:]))
    expected = [False] + ([] if needs_grad else [True] * chunks)
    assert runs == expected * len(dtypes)


@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_queries_shorter_than_the_keys_without_a_cache(
    device: str, dtypes: list[torch.dtype], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last 19 of 53 positions, given the keys of all of them: one chunk forward, equal to
    the oracle's last rows."""
    skip_without_triton(device)
    runs = _chunk_runs(monkeypatch)
    segs, rates, n, tail = [8, 32], [1, 4], 53, 19
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, n, 4, 32, generator=gen, dtype=torch.float64) for _ in "qkv")
    for dtype in dtypes:
        tol = TOLERANCES[dtype]
        q, k, v = (t.to(dtype).double() for t in (q, k, v))  # the inputs the kernels see
        want, want_lse = oracle_dilated_attention(q, k, v, segs, rates, is_causal=True)
        x = [t.to(device=device, dtype=dtype) for t in (q[:, -tail:], k, v)]
        out, lse = dilated_attention(*x, segs, rates, is_causal=True, backend="triton",
                                     return_lse=True)  # fmt: skip
        torch.testing.assert_close(out.double().cpu(), want[:, -tail:], atol=tol.atol,
                                   rtol=tol.rtol)  # fmt: skip
        torch.testing.assert_close(lse.double().cpu(), want_lse[..., -tail:], atol=1e-4,
                                   rtol=1e-4)  # fmt: skip
    assert runs == [True] * len(dtypes)
