"""Every CUDA kernel backend against the float64 oracle, in bf16 and fp16 (run on a GPU machine).

The oracle runs on the CPU in float64 from the same rounded inputs; a naive oracle replica in the
same low dtype sets the error budget (``tolerances.assert_close_to_oracle``). Both are computed
once per case and dtype (``support.shared_results``) and shared by every backend's test; the
``xdist_group`` marks keep the tests that share an oracle, or a compiling backend's kernels, in
one pytest-xdist worker under ``--dist loadgroup`` (docs/architecture.md "Tests").
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from support.backend_params import COMPILING
from support.oracle import oracle_attention, oracle_dilated_attention
from support.shared_results import shared_result
from support.tolerances import assert_close_to_oracle

from dilated_attention import attention, backend_reasons, dilated_attention
from dilated_attention.backends.base import KernelInputs
from dilated_attention.backends.registry import registry_for

# The optional kernel packages skip with their reason where they are not installed.
CUDA_BACKENDS = [
    "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "flex", "math", "flash_attn4", "flash_attn3",
    "flash_attn2", "xformers",
]  # fmt: skip
DTYPES = [torch.bfloat16, torch.float16]

CASES = {
    # name: (seq_len, heads, kv_heads, segment_lengths, dilation_rates, is_causal, masked)
    "longnet-causal": (300, 4, 4, [64, 128, 256], [1, 2, 4], True, False),
    "longnet": (300, 4, 4, [64, 128, 256], [1, 2, 4], False, False),
    "ragged-r6": (200, 6, 2, [96, 40], [6, 3], True, False),
    "gqa-mqa": (160, 8, 1, [32, 160], [1, 4], False, False),
    "key-padding": (150, 4, 2, [50, 100], [1, 2], True, True),
}
DENSE_CASES = ["gqa-mqa", "key-padding"]


def _group(backend: str | None, oracle: str, dtype: torch.dtype) -> pytest.MarkDecorator:
    """Under ``--dist loadgroup``: a compiling backend's tests (``COMPILING``) of one dtype in
    one worker (its kernels compiled once), the other backends' tests of one oracle in one worker
    (computed once)."""
    shared = backend if backend in COMPILING else oracle
    return pytest.mark.xdist_group(f"gpu_backends-{shared}-{dtype}")


DILATED_PARAMS = [
    pytest.param(
        case, backend, dtype, marks=_group(backend, case, dtype), id=f"{case}-{backend}-{dtype}"
    )
    for case in CASES
    for backend in CUDA_BACKENDS
    for dtype in DTYPES
]
DENSE_PARAMS = [
    pytest.param(
        case,
        is_causal,
        backend,
        dtype,
        id=f"{case}-{is_causal}-{backend}-{dtype}",
        marks=_group(backend, f"dense-{case}-{is_causal}", dtype),
    )
    for case in DENSE_CASES
    for is_causal in (False, True)
    for backend in [*CUDA_BACKENDS, "triton", None]
    for dtype in DTYPES
]


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


@shared_result
def _dilated_oracles(case: str, dtype: torch.dtype) -> tuple[tuple, tuple]:
    """``(out, lse, grads)`` of the float64 oracle and of its naive ``dtype`` replica, on
    ``_inputs(case, dtype)``: computed once per process, shared by every backend."""
    q, k, v, dout = _inputs(case, dtype)
    return _oracle(q, k, v, dout, case, torch.float64), _oracle(q, k, v, dout, case, dtype)


@shared_result
def _dense_oracles(case: str, is_causal: bool, dtype: torch.dtype) -> list[tuple]:
    """Plain attention's ``(out, lse, grads)``, float64 and naive ``dtype``, on
    ``_inputs(case, dtype)`` with ``_mask(case)``: computed once per process."""
    q, k, v, dout = _inputs(case, dtype)
    results = []
    for cdt in (torch.float64, dtype):
        leaves = [t.detach().to(cdt).requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = oracle_attention(
            *leaves, is_causal=is_causal, key_padding_mask=_mask(case), compute_dtype=cdt
        )
        results.append((ref_out, ref_lse, torch.autograd.grad(ref_out, leaves, dout.to(cdt))))
    return results


@pytest.mark.gpu
@pytest.mark.parametrize(("case", "is_causal", "backend", "dtype"), DENSE_PARAMS)
def test_cuda_dense_attention_matches_oracle(
    backend: str | None, dtype: torch.dtype, is_causal: bool, case: str
) -> None:
    """Plain attention through each kernel and the automatic choice (``None``), with and without
    a key padding mask (rows with no visible key included). Defined before the dilated tests: a
    compiling backend's worker compiles its one-shape kernels here and its dynamic-shape ones in
    the first dilated test, instead of both there."""
    _check_dense(case, is_causal, backend, dtype)


def _check_dense(
    case: str,
    is_causal: bool,
    backend: str | None,
    dtype: torch.dtype,
    setup: Callable[[], None] = lambda: None,
) -> None:
    """Plain attention of ``case`` through ``backend`` (None: the automatic choice) against the
    float64 oracle: out, lse and every gradient; skipped where the backend cannot run it, and
    ``setup()`` run once it can."""
    q, k, v, dout = _inputs(case, dtype)
    mask = _mask(case)
    dev = [t.cuda().requires_grad_() for t in (q, k, v)]
    dev_mask = None if mask is None else mask.cuda()
    if backend is not None:
        reasons = backend_reasons(*dev, is_causal=is_causal, key_padding_mask=dev_mask)[backend]
        if reasons:
            pytest.skip(f"{backend} cannot run this case here: {'; '.join(reasons)}")
    setup()
    out, lse = attention(
        *dev, is_causal=is_causal, backend=backend, key_padding_mask=dev_mask, return_lse=True
    )
    grads = torch.autograd.grad(out, dev, dout.cuda())
    (ref_out, ref_lse, ref_grads), (low_out, low_lse, low_grads) = _dense_oracles(
        case, is_causal, dtype
    )
    assert_close_to_oracle(out.cpu(), ref_out, low_out, name="out", dtype=dtype)
    assert_close_to_oracle(lse.cpu(), ref_lse, low_lse, name="lse", dtype=dtype)
    for name, got, ref, low in zip("qkv", grads, ref_grads, low_grads, strict=True):
        assert_close_to_oracle(got.cpu(), ref, low, name=f"d{name}", dtype=dtype, grad=True)


@pytest.mark.gpu
@pytest.mark.xdist_group("gpu_backends-flash_attn4-chunks")
@pytest.mark.parametrize("per", ["kv head", "query head"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", ["longnet", *DENSE_CASES])
def test_fa4_dense_backward_in_head_chunks_matches_oracle(
    case: str, is_causal: bool, per: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FA4's dense backward forced into one call per key/value head, or per query head (a
    group's later heads' dk and dv added to its first's) (Note [FlashAttention-4's
    accumulators by head chunks]; a call this small runs whole by default), each chunk writing
    its heads' rows of the gradients, against the float64 oracle: MHA, GQA and MQA, a key
    padding mask with rows that see no key."""
    import dilated_attention.backends.flash_attn4 as fa4_module
    import dilated_attention.backends.flash_attn4.chunks as chunk_rule

    chunks: list[int] = []
    calls = fa4_module._backward_calls

    def force_chunks() -> None:
        monkeypatch.setattr(chunk_rule, "MIN_CHUNKED_ACCUMULATOR_BYTES", 0)
        if per == "kv head":
            per_kv_head = lambda q, k, *rule: k.shape[2]  # noqa: E731
            monkeypatch.setattr(chunk_rule, "accumulator_chunks", per_kv_head)
        else:
            monkeypatch.setattr(chunk_rule, "ACCUMULATOR_SHARE", 0.0)
        monkeypatch.setattr(fa4_module, "_backward_calls",
                            lambda c, *rest: chunks.append(len(c)) or calls(c, *rest))  # fmt: skip

    _check_dense(case, is_causal, "flash_attn4", torch.bfloat16, setup=force_chunks)
    heads, kv_heads = CASES[case][1:3]
    assert chunks == [kv_heads if per == "kv head" else heads]


@pytest.mark.gpu
@pytest.mark.parametrize(("case", "backend", "dtype"), DILATED_PARAMS)
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
    (ref_out, ref_lse, ref_grads), (low_out, low_lse, low_grads) = _dilated_oracles(case, dtype)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close_to_oracle(out.cpu(), ref_out, low_out, name="out", dtype=dtype)
    assert_close_to_oracle(lse.cpu(), ref_lse, low_lse, name="lse", dtype=dtype)
    for name, got, ref, low in zip("qkv", grads, ref_grads, low_grads, strict=True):
        assert_close_to_oracle(got.cpu(), ref, low, name=f"d{name}", dtype=dtype, grad=True)


@pytest.mark.gpu
def test_hopper_prefers_triton_for_masked_16bit_calls() -> None:
    """cuDNN takes no key padding mask; on sm90 masked bf16 calls go to our Triton kernels
    (measured 2.5-3.3x the memory-efficient kernel, ``registry._CUDA_MASKED_FIRST``)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("measured on sm90 only")
    q = torch.randn(1, 256, 4, 64, device="cuda", dtype=torch.bfloat16)
    mask = torch.zeros(1, 256, dtype=torch.bool, device="cuda")
    reasons = backend_reasons(q, q, q, is_causal=True, key_padding_mask=mask)
    assert next(name for name, why in reasons.items() if not why) == "triton", reasons


@pytest.mark.gpu
def test_hopper_dense_choice() -> None:
    """On sm90+ the device's order for plain bf16 inputs puts FlashAttention-4 first where it
    is installed and working, else cuDNN (fastest there: ``benchmarks/results/kernels_h100.json``);
    on sm90 a square bf16 call of 4K tokens takes cuDNN first (``short_dense`` in
    ``priorities.json``)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("not a Hopper-or-newer GPU")
    q = torch.randn(1, 256, 4, 64, device="cuda", dtype=torch.bfloat16)
    reasons = backend_reasons(q, q, q, is_causal=True)
    expected = "sdpa_cudnn" if reasons["flash_attn4"] else "flash_attn4"
    assert next(name for name, why in reasons.items() if not why) == expected, reasons
    if torch.cuda.get_device_capability()[0] == 9:
        q4k = torch.randn(1, 4096, 4, 64, device="cuda", dtype=torch.bfloat16)
        short = KernelInputs.from_tensors(q4k, q4k, is_causal=True)
        assert registry_for("dense").choose(short).backend == "sdpa_cudnn"


@pytest.mark.gpu
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


# -- CPU: the shared oracles and the worker groups -------------------------------------------------
def test_shared_oracles_are_computed_once_and_copied() -> None:
    """The oracles the GPU tests share equal a fresh computation, are computed once per process,
    and come back as copies: a test that writes into its copy changes nothing for the next."""
    _dilated_oracles.cache_clear()
    got = _dilated_oracles("key-padding", torch.bfloat16)
    q, k, v, dout = _inputs("key-padding", torch.bfloat16)
    want = [_oracle(q, k, v, dout, "key-padding", cdt) for cdt in (torch.float64, torch.bfloat16)]
    for (out, lse, grads), (w_out, w_lse, w_grads) in zip(got, want, strict=True):
        assert not out.requires_grad and torch.equal(out, w_out) and torch.equal(lse, w_lse)
        assert all(torch.equal(g, w) for g, w in zip(grads, w_grads, strict=True))
    got[0][0].fill_(float("nan"))
    got[0][2][1].zero_()
    again = _dilated_oracles("key-padding", torch.bfloat16)
    assert torch.equal(again[0][0], want[0][0]) and torch.equal(again[0][2][1], want[0][2][1])
    info = _dilated_oracles.cache_info()
    assert (info.hits, info.misses) == (1, 1)
    dense = _dense_oracles("gqa-mqa", True, torch.float16)
    q, k, v, _ = _inputs("gqa-mqa", torch.float16)
    w_out, w_lse = oracle_attention(*(t.double() for t in (q, k, v)), is_causal=True)
    assert torch.equal(dense[0][0], w_out) and torch.equal(dense[0][1], w_lse)
    assert dense[1][0].dtype == torch.float16 and len(dense[1][2]) == 3


def test_tests_that_share_work_share_a_worker_group() -> None:
    """``--dist loadgroup``: every backend's test of one oracle in one group (one per dtype);
    a compiling backend's tests of one dtype in one group, whatever the case."""

    def group(params: list, param_id: str) -> str:
        (mark,) = next(p for p in params if p.id == param_id).marks
        return mark.args[0]

    bf16 = "torch.bfloat16"
    assert group(DILATED_PARAMS, f"longnet-math-{bf16}") == group(
        DILATED_PARAMS, f"longnet-sdpa_cudnn-{bf16}"
    )
    assert group(DILATED_PARAMS, f"longnet-math-{bf16}") != group(
        DILATED_PARAMS, "longnet-math-torch.float16"
    )
    for backend in COMPILING:
        assert group(DILATED_PARAMS, f"longnet-{backend}-{bf16}") == group(
            DENSE_PARAMS, f"gqa-mqa-True-{backend}-{bf16}"
        )
    assert group(DENSE_PARAMS, f"gqa-mqa-True-None-{bf16}") == group(
        DENSE_PARAMS, f"gqa-mqa-True-triton-{bf16}"
    )
