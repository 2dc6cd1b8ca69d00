"""Local windows, soft-capping and sinks on the CUDA kernels that take them, against the float64
oracle (outputs, lse and every gradient, the sinks' too), in 16-bit: each kernel's error at most
twice a naive same-dtype reference's (``assert_close_to_oracle``)."""

from __future__ import annotations

import pytest
import torch
from support.oracle import dilated_multiplicity, masked_attention, oracle_attention
from support.tolerances import assert_close_to_oracle

from dilated_attention import attention, block_sparse_attention, dilated_attention
from dilated_attention.patterns import LocalWindow

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def _inputs(n: int, h: int = 4, hkv: int = 2, d: int = 64, nq: int | None = None, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    nq = n if nq is None else nq
    q = torch.randn(2, nq, h, d, generator=gen, dtype=torch.float64)
    k = torch.randn(2, n, hkv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(2, n, hkv, d, generator=gen, dtype=torch.float64)
    sinks = torch.randn(h, generator=gen, dtype=torch.float64)
    dout = torch.randn(2, nq, h, d, generator=gen, dtype=torch.float64)
    return q, k, v, sinks, dout


def _rounded(xs, dtype):
    """The inputs rounded once to ``dtype``: float64 leaves for the oracles and device leaves."""
    exact = [x.to(dtype).to(torch.float64).requires_grad_() for x in xs]
    low = [x.detach().to(CUDA, dtype).requires_grad_() for x in exact]
    same = [x.detach().to(dtype).requires_grad_() for x in exact]
    return exact, low, same


def _compare(got, want, same, ins, exact, same_ins, dout, dtype) -> None:
    for name, g, w, s in zip(("out", "lse"), got, want, same, strict=True):
        assert_close_to_oracle(g.cpu(), w, s, name=name, dtype=dtype)
    grads = torch.autograd.grad(got[0], ins, dout.to(CUDA, dtype))
    want_grads = torch.autograd.grad(want[0], exact, dout)
    same_grads = torch.autograd.grad(same[0], same_ins, dout.to(dtype))
    for name, g, w, s in zip(("dq", "dk", "dv", "dsinks"), grads, want_grads, same_grads,
                             strict=True):  # fmt: skip
        assert_close_to_oracle(g.cpu().float(), w, s.float(), name=name, dtype=dtype, grad=True)


@pytest.mark.parametrize("backend", [None, "flash_attn4", "triton"], ids=lambda b: b or "auto")
@pytest.mark.parametrize("window", [(64, 0), (31, 17), None], ids=str)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_dense(backend, window, is_causal, dtype) -> None:
    """Window, soft-cap and sinks together, GQA, several tiles."""
    q, k, v, sinks, dout = _inputs(333)
    exact, low, same = _rounded((q, k, v, sinks), dtype)
    options = dict(is_causal=is_causal, window_size=window, softcap=20.0)
    try:
        got = attention(*low[:3], sinks=low[3], backend=backend, return_lse=True, **options)
    except ValueError as exc:  # a kernel named that cannot run these inputs says why
        if backend is None or "cannot run these inputs" not in str(exc):
            raise
        pytest.skip(str(exc))
    want = oracle_attention(*exact[:3], sinks=exact[3], **options)
    same_ref = oracle_attention(*same[:3], sinks=same[3], compute_dtype=dtype, **options)
    _compare(got, want, same_ref, low, exact, same, dout, dtype)


def test_decoding_rows_read_their_window() -> None:
    """End-aligned queries (a chunk being decoded) with a window, on the automatic kernel."""
    q, k, v, sinks, dout = _inputs(700, nq=37)
    exact, low, same = _rounded((q, k, v, sinks), torch.bfloat16)
    options = dict(is_causal=True, window_size=(127, 0))
    got = attention(*low[:3], sinks=low[3], return_lse=True, **options)
    want = oracle_attention(*exact[:3], sinks=exact[3], **options)
    same_ref = oracle_attention(*same[:3], sinks=same[3], compute_dtype=torch.bfloat16, **options)
    _compare(got, want, same_ref, low, exact, same, dout, torch.bfloat16)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_dilated_softcap_sinks(is_causal: bool) -> None:
    """Dilated attention with soft-capping and sinks on the automatic kernel."""
    q, k, v, sinks, dout = _inputs(520)
    exact, low, same = _rounded((q, k, v, sinks), torch.bfloat16)
    segs, rates = [128, 256, 512], [1, 2, 4]
    got = dilated_attention(
        *low[:3], segs, rates, is_causal=is_causal, softcap=15.0, sinks=low[3], return_lse=True
    )
    M = dilated_multiplicity(520, 4, segs, rates, is_causal=is_causal)
    want = masked_attention(*exact[:3], M, softcap=15.0, sinks=exact[3])
    same_ref = masked_attention(
        *same[:3], M, softcap=15.0, sinks=same[3], compute_dtype=torch.bfloat16
    )
    _compare(got, want, same_ref, low, exact, same, dout, torch.bfloat16)


def test_block_sparse_softcap_sinks() -> None:
    """Block-sparse attention with soft-capping and sinks on the automatic kernel."""
    q, k, v, sinks, dout = _inputs(512)
    exact, low, same = _rounded((q, k, v, sinks), torch.bfloat16)
    got = block_sparse_attention(
        *low[:3], LocalWindow(1), block_size=128, is_causal=True, softcap=15.0, sinks=low[3],
        return_lse=True,
    )  # fmt: skip
    blocks = torch.arange(512) // 128
    keep = ((blocks[:, None] - blocks[None, :]).abs() <= 1) & torch.ones(512, 512).tril().bool()
    M = keep.long().expand(4, 512, 512)
    want = masked_attention(*exact[:3], M, softcap=15.0, sinks=exact[3])
    same_ref = masked_attention(
        *same[:3], M, softcap=15.0, sinks=same[3], compute_dtype=torch.bfloat16
    )
    _compare(got, want, same_ref, low, exact, same, dout, torch.bfloat16)
