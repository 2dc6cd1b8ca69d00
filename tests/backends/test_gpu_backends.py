"""Every CUDA kernel backend against the float64 oracle, in bf16 and fp16 (run on a GPU machine).

The oracle runs on the CPU in float64 from the same rounded inputs; a naive oracle replica in the
same low dtype sets the error budget (``tolerances.assert_close_to_oracle``).
"""

from __future__ import annotations

import pytest
import torch
from support.oracle import oracle_attention, oracle_dilated_attention
from support.tolerances import assert_close_to_oracle

from dilated_attention import attention, backend_reasons, dilated_attention

pytestmark = pytest.mark.gpu

# The optional kernel packages skip with their reason where they are not installed.
CUDA_BACKENDS = [
    "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "flex", "math", "flash_attn4", "flash_attn3",
    "flash_attn2", "xformers",
]  # fmt: skip

CASES = {
    # name: (seq_len, heads, kv_heads, segment_lengths, dilation_rates, is_causal, masked)
    "longnet-causal": (300, 4, 4, [64, 128, 256], [1, 2, 4], True, False),
    "longnet": (300, 4, 4, [64, 128, 256], [1, 2, 4], False, False),
    "ragged-r6": (200, 6, 2, [96, 40], [6, 3], True, False),
    "gqa-mqa": (160, 8, 1, [32, 160], [1, 4], False, False),
    "key-padding": (150, 4, 2, [50, 100], [1, 2], True, True),
}


def _inputs(case: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    seq_len, heads, kv_heads, *_ = CASES[case]
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, seq_len, heads, 64, generator=gen).to(dtype)
    k = torch.randn(2, seq_len, kv_heads, 64, generator=gen).to(dtype)
    v = torch.randn(2, seq_len, kv_heads, 64, generator=gen).to(dtype)
    dout = torch.randn(2, seq_len, heads, 64, generator=gen).to(dtype)
    return q, k, v, dout


def _mask(case: str) -> torch.Tensor | None:
    seq_len, *_, masked = CASES[case]
    if not masked:
        return None
    mask = torch.rand(2, seq_len, generator=torch.Generator().manual_seed(2)) < 0.25
    mask[1, :60] = True  # whole segments padded: rows with no visible key
    return mask


def _oracle(q, k, v, dout, case, compute_dtype):
    _, _, _, segs, rates, is_causal, _ = CASES[case]
    leaves = [t.detach().to(compute_dtype).requires_grad_() for t in (q, k, v)]
    out, lse = oracle_dilated_attention(
        *leaves, segs, rates, is_causal=is_causal, key_padding_mask=_mask(case),
        compute_dtype=compute_dtype,
    )  # fmt: skip
    grads = torch.autograd.grad(out, leaves, dout.to(compute_dtype))
    return out, lse, grads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_backend_matches_oracle(backend: str, dtype: torch.dtype, case: str) -> None:
    _, _, _, segs, rates, is_causal, _ = CASES[case]
    q, k, v, dout = _inputs(case, dtype)
    mask = _mask(case)
    dev = [t.cuda().requires_grad_() for t in (q, k, v)]
    dev_mask = None if mask is None else mask.cuda()
    reasons = backend_reasons(*dev, is_causal=is_causal, key_padding_mask=dev_mask)[backend]
    if reasons:
        pytest.skip(f"{backend} cannot run this case here: {'; '.join(reasons)}")
    out, lse = dilated_attention(
        *dev, segs, rates, is_causal=is_causal, key_padding_mask=dev_mask, backend=backend,
        return_lse=True,
    )  # fmt: skip
    grads = torch.autograd.grad(out, dev, dout.cuda())
    ref_out, ref_lse, ref_grads = _oracle(q, k, v, dout, case, torch.float64)
    low_out, low_lse, low_grads = _oracle(q, k, v, dout, case, dtype)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close_to_oracle(out.cpu(), ref_out, low_out, name="out", dtype=dtype)
    assert_close_to_oracle(lse.cpu(), ref_lse, low_lse, name="lse", dtype=dtype)
    for name, got, ref, low in zip("qkv", grads, ref_grads, low_grads, strict=True):
        assert_close_to_oracle(got.cpu(), ref, low, name=f"d{name}", dtype=dtype, grad=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("backend", [*CUDA_BACKENDS, "triton", None])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("case", ["gqa-mqa", "key-padding"])
def test_cuda_dense_attention_matches_oracle(
    backend: str | None, dtype: torch.dtype, is_causal: bool, case: str
) -> None:
    """Plain attention through each kernel and the automatic choice (``None``), with and without
    a key padding mask (rows with no visible key included)."""
    q, k, v, dout = _inputs(case, dtype)
    mask = _mask(case)
    dev = [t.cuda().requires_grad_() for t in (q, k, v)]
    dev_mask = None if mask is None else mask.cuda()
    if backend is not None:
        reasons = backend_reasons(*dev, is_causal=is_causal, key_padding_mask=dev_mask)[backend]
        if reasons:
            pytest.skip(f"{backend} cannot run this case here: {'; '.join(reasons)}")
    out, lse = attention(
        *dev, is_causal=is_causal, backend=backend, key_padding_mask=dev_mask, return_lse=True
    )
    grads = torch.autograd.grad(out, dev, dout.cuda())
    results = []
    for cdt in (torch.float64, dtype):
        leaves = [t.detach().to(cdt).requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = oracle_attention(
            *leaves, is_causal=is_causal, key_padding_mask=mask, compute_dtype=cdt
        )
        results.append((ref_out, ref_lse, torch.autograd.grad(ref_out, leaves, dout.to(cdt))))
    (ref_out, ref_lse, ref_grads), (low_out, low_lse, low_grads) = results
    assert_close_to_oracle(out.cpu(), ref_out, low_out, name="out", dtype=dtype)
    assert_close_to_oracle(lse.cpu(), ref_lse, low_lse, name="lse", dtype=dtype)
    for name, got, ref, low in zip("qkv", grads, ref_grads, low_grads, strict=True):
        assert_close_to_oracle(got.cpu(), ref, low, name=f"d{name}", dtype=dtype, grad=True)


def test_hopper_prefers_triton_for_masked_16bit_calls() -> None:
    """cuDNN takes no key padding mask; on sm90 masked bf16 calls go to our Triton kernels
    (measured 2.5-3.3x the memory-efficient kernel, ``registry._CUDA_MASKED_FIRST``)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("measured on sm90 only")
    q = torch.randn(1, 256, 4, 64, device="cuda", dtype=torch.bfloat16)
    mask = torch.zeros(1, 256, dtype=torch.bool, device="cuda")
    reasons = backend_reasons(q, q, q, is_causal=True, key_padding_mask=mask)
    assert next(name for name, why in reasons.items() if not why) == "triton", reasons


def test_hopper_dense_choice() -> None:
    """On sm90+ the automatic choice for plain bf16 inputs is FlashAttention-4 where it is
    installed and working, else cuDNN (fastest there: ``benchmarks/results/kernels_h100.json``)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("not a Hopper-or-newer GPU")
    q = torch.randn(1, 256, 4, 64, device="cuda", dtype=torch.bfloat16)
    reasons = backend_reasons(q, q, q, is_causal=True)
    expected = "sdpa_cudnn" if reasons["flash_attn4"] else "flash_attn4"
    assert next(name for name, why in reasons.items() if not why) == expected, reasons


@pytest.mark.parametrize("backend", ["sdpa_flash", "sdpa_efficient", "math"])
def test_cuda_dropout_trains(backend: str) -> None:
    """Dropout draws a fresh mask per call, is repeatable under a seed, and its backward runs."""
    q = torch.randn(1, 256, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    if backend_reasons(q, q, q, dropout_p=0.3)[backend]:
        pytest.skip(f"{backend} unavailable")

    def seeded(seed: int) -> None:
        torch.manual_seed(seed)
        torch.cuda.manual_seed(seed)

    seeded(3)
    a = dilated_attention(q, q, q, [64, 256], [1, 4], dropout_p=0.3, backend=backend)
    b = dilated_attention(q, q, q, [64, 256], [1, 4], dropout_p=0.3, backend=backend)
    seeded(3)
    a2 = dilated_attention(q, q, q, [64, 256], [1, 4], dropout_p=0.3, backend=backend)
    assert not torch.equal(a, b)
    assert torch.equal(a, a2)
    a2.float().sum().backward()
    assert q.grad is not None and bool(torch.isfinite(q.grad).all())
