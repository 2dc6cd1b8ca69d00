"""The ``flex`` backend's host-side rules (its kernels run on CUDA only: tests/backends/
test_gpu_backends.py)."""

from __future__ import annotations

import pytest
import torch
from support.oracle import masked_attention

import dilated_attention.backends.flex as flex_module
from dilated_attention.backends import get_backend


@pytest.mark.parametrize(("query_len", "key_len"), [(1, 9), (9, 1), (1, 1)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_one_row_calls_never_reach_flex_attention(
    query_len: int, key_len: int, is_causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call with one query or key row runs on the plain-PyTorch kernel, forward and backward:
    compiled FlexAttention would specialize the size 1 and compile graphs for it alone."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a one-row call reached FlexAttention")

    monkeypatch.setattr(flex_module, "_flex", refuse)
    backend = get_backend("flex")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, query_len, 4, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, key_len, 2, 16, generator=gen, dtype=torch.float64) for _ in "kv")
    k.requires_grad_()
    v.requires_grad_()
    res = backend.forward(q, k, v, scale=0.25, is_causal=is_causal)
    # The kernel contract's causal mask is top-left aligned: query i sees keys j <= i.
    allowed = torch.ones(4, query_len, key_len, dtype=torch.int64)
    allowed = allowed.tril() if is_causal else allowed
    ref_out, ref_lse = masked_attention(q, k, v, allowed, scale=0.25)
    torch.testing.assert_close(res.out, ref_out)
    torch.testing.assert_close(res.lse, ref_lse)
    dout = torch.randn_like(q)
    grads = backend.backward(dout, q, k, v, res.out, res.lse, res.aux, scale=0.25,
                             is_causal=is_causal)  # fmt: skip
    want = torch.autograd.grad(ref_out, (q, k, v), dout)
    for got, ref in zip(grads, want, strict=True):
        torch.testing.assert_close(got, ref)
