"""Extreme inputs (issue 21, items 1 and 3): huge logits through the merge, NaN and inf rows.

Every number is compared with the float64 oracle (``tests/support/oracle.py``, which shares no
code with the library) computed from the same, already rounded inputs.

Note [Tolerances at extreme logits]
    At logit magnitude L no kernel that keeps a float32 log-sum-exp can be exact. A branch's lse
    is rounded to float32's spacing at ``|lse|``, a relative error of up to ``2**-24 |lse|`` in
    the weight the merge gives the branch (``exp(lse_i - top)``) and in every probability a
    backward recomputes as ``exp(s - lse)``; the merged lse is rounded once more. Dense attention
    has the same error: its one lse is rounded, and SDPA's log-multiplicity mask adds ``log m``
    to scores of size L. So an output or gradient ``g`` may be off by

        floor(g) = atol + rtol * max|g|               (the dtype's row of ``TOLERANCES``)
                   + 2 * 2**-24 * max|lse| * max|g|   (two lse roundings: a branch's, the merge's)

    and beyond that by at most ``RATIO`` (2) times the error of dense SDPA on the same inputs
    (``F.scaled_dot_product_attention`` with the branch multiplicities as a log mask, in the same
    dtype on the same device: torch's CPU flash kernel, or CUDA's memory-efficient one). That
    term covers what the library inherits from torch's fused kernels, which its backends call:
    the CPU kernel's backward recomputes scores with other rounding than its forward, relative
    errors of a few ``2**-24 L`` in P on top of the lse rounding. torch's fused kernels also
    differ among themselves: on dense causal attention in bfloat16 at L = 1e6 (H100), dq / dk
    were off by 45 / 98 with cuDNN, 6.6 / 186 with flash and 31 / 133 with the memory-efficient
    kernel. So a backend built on cuDNN's or flash's kernels gets ``KERNEL_SPREAD`` (1.5) times
    the ratio against the memory-efficient reference (the ``sdpa_cudnn`` path was 2.3 times it,
    dq 85 against 37, on the causal ragged schedule). dq and dk share one reference error, the
    larger of the two: both are the same rounded probabilities times keys (dq) or queries (dk),
    which the inputs scale alike, and which of the two a kernel's rounding happens to cancel
    depends on the CPU: torch's CPU flash kernel gave dq / dk errors of 9.8 / 97 on one machine
    with AMX (bfloat16, L = 1e6, the spread rows of the ragged GQA schedule) where the library,
    like dense SDPA's other kernels, was near 50 / 100. At L = 1e4 the floor's second
    term is ~1e-3 max|g|. Before the fix the merge was off by 2.7 on outputs of size 3.4 at
    L = 1e4 (weights summing to 1.8, not 1), and its gradients by 0.3 to 2 where the true dq is
    ~1e-48.

Note [Which rows a NaN reaches]
    A NaN (or inf) query element makes that query row's scores NaN: only that (row, head) turns
    NaN. A NaN key or value at position t reaches every (row, head) that attends t in some
    branch, the nonzero entries of the oracle's multiplicity matrix. Nothing else may change: a
    NaN that spreads is as wrong as one that vanishes. On the CPU that holds for hidden keys too
    (Note [Hidden keys cannot poison rows] in ``core/hidden.py``; ``test_hidden_keys.py``). The
    CUDA kernels keep one exception (torch's SDPA too): a NaN value also reaches rows of its
    segment that a causal mask hides it from, since their weight 0 times NaN is NaN (README
    "Known limits"); under a run-time block mask a NaN key or value may reach any row of the
    heads that read it (the dense kernels' calls hide the unkept blocks by a key mask, and an
    additive -inf on a NaN score stays NaN). An infinite key element gives its score +inf (NaN
    rows) or -inf (the key drops out, a finite and correct row), by the query's sign.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from support.backend_params import CPU_BACKENDS, backend_id, skip_unless_runnable
from support.oracle import dilated_multiplicity, masked_attention
from support.tolerances import RATIO, TOLERANCES, max_abs_error, rounding_floor
from support.triton import KERNEL_DEVICES, skip_without_triton
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from dilated_attention import attention, block_sparse_attention, dilated_attention, list_backends
from dilated_attention.backends import get_backend
from dilated_attention.backends.registry import BLOCK_SPARSE, KernelInputs, registry_for
from dilated_attention.core.merge import merge_partial
from dilated_attention.patterns import DilatedBlocks, LocalWindow
from dilated_attention.sparse import moba_attention, nsa_attention

# -- inputs ----------------------------------------------------------------------------------------
BATCH, SEQ, HEADS, DIM = 1, 64, 4, 8

#: (dtype, largest |logit|): float32 up to 1e6; float16 just below its largest finite value
#: (65504); bfloat16 at 1e6 (its range is float32's, its inputs carry 8 bits).
EXTREMES = [
    pytest.param(torch.float32, 1e2, id="float32-1e2"),
    pytest.param(torch.float32, 1e4, id="float32-1e4"),
    pytest.param(torch.float32, 1e6, id="float32-1e6"),
    pytest.param(torch.float16, 6e4, id="float16-6e4"),
    pytest.param(torch.bfloat16, 1e6, id="bfloat16-1e6"),
]
#: (segment_lengths, dilation_rates): identical branches; different lengths and rates; ragged
#: (w = 40 not a multiple of r = 3: rows of 13 and 14 keys, below the CPU flash kernel's vector
#: width on AVX-512, and a short last segment of the w = 24 branch).
SCHEDULES = [
    pytest.param((64, 64), (1, 1), id="identical"),
    pytest.param((16, 32, 64), (1, 2, 4), id="different"),
    pytest.param((24, 40), (1, 3), id="ragged"),
]
#: Every CUDA backend of the registry (FlexAttention aside: it compiles per shape, seconds each),
#: collected everywhere and skipped without CUDA; those that cannot run skip with their reasons.
GPU_BACKENDS = [
    pytest.param(name, marks=pytest.mark.gpu, id=f"cuda-{name}")
    for name in ("auto", *list_backends())
    if name == "auto" or ("cuda" in get_backend(name).devices and name != "flex")
]


def _inputs(
    logit: float, dtype: torch.dtype, *, kv_heads: int = HEADS, shifted: bool = False, seed: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """q, k, v, dout (B, N, H or Hkv, D) in ``dtype`` whose largest |logit| (default scale) is
    about ``logit``.

    ``shifted``: every logit is ``logit`` plus an O(1) part (a shared first component of q and
    k), so the lse is huge while the softmax stays spread; otherwise q and k are scaled normals
    and the softmax is nearly one-hot.
    """
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, SEQ, HEADS, DIM, generator=gen, dtype=torch.float64)
    k = torch.randn(BATCH, SEQ, kv_heads, DIM, generator=gen, dtype=torch.float64)
    v = torch.randn(BATCH, SEQ, kv_heads, DIM, generator=gen, dtype=torch.float64)
    dout = torch.randn(BATCH, SEQ, HEADS, DIM, generator=gen, dtype=torch.float64)
    if shifted:
        q[..., 0] = k[..., 0] = math.sqrt(logit * math.sqrt(DIM))
    else:
        keys = k.repeat_interleave(HEADS // kv_heads, dim=2)
        unit = float(torch.einsum("bphd,bthd->bhpt", q, keys).abs().max()) * DIM**-0.5
        factor = math.sqrt(logit / unit)
        q, k = q * factor, k * factor
    return q.to(dtype), k.to(dtype), v.to(dtype), dout.to(dtype)


# -- references ------------------------------------------------------------------------------------
def _grads(
    fn: Callable[[Tensor, Tensor, Tensor], Tensor], q: Tensor, k: Tensor, v: Tensor, dout: Tensor
) -> list[Tensor]:
    """``[out, dq, dk, dv]`` of ``fn`` on fresh leaves of q, k, v."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves)
    out.backward(dout.to(device=out.device, dtype=out.dtype))
    return [out.detach(), *(x.grad for x in leaves)]


def _oracle(
    q: Tensor, k: Tensor, v: Tensor, dout: Tensor, M: Tensor
) -> tuple[list[Tensor], Tensor]:
    """Float64 ``[out, dq, dk, dv]`` and lse of the multiplicity-weighted softmax."""
    lse = masked_attention(q.cpu().double(), k.cpu().double(), v.cpu().double(), M)[1]

    def fn(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
        return masked_attention(a, b, c, M)[0]

    return _grads(fn, q.cpu().double(), k.cpu().double(), v.cpu().double(), dout.double()), lse


def _dense_sdpa(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, M: Tensor) -> list[Tensor]:
    """Dense SDPA in the inputs' dtype on their device, multiplicities as a log mask: torch's
    fused kernel that takes a mask (CPU flash; CUDA memory-efficient, else its math kernel)."""
    group = q.shape[2] // k.shape[2]
    mask = torch.log(M.double()).to(device=q.device, dtype=q.dtype).unsqueeze(0)  # -inf: M = 0
    kernels = (
        [SDPBackend.FLASH_ATTENTION]
        if q.device.type == "cpu"
        else [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    )

    def fn(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
        b, c = (x.repeat_interleave(group, dim=2).transpose(1, 2) for x in (b, c))
        with sdpa_kernel(kernels):
            out = F.scaled_dot_product_attention(a.transpose(1, 2), b, c, attn_mask=mask)
        return out.transpose(1, 2)

    return [x.cpu() for x in _grads(fn, q, k, v, dout)]


#: Kernels whose backward is known to miss the bound at the 16-bit extremes (fp16 6e4, bf16 1e6):
#: measured on an H100, where every such case failed, so the mark is strict and says when a
#: release fixes it. The library cannot correct a package's kernel; README "Known limits".
INACCURATE_AT_EXTREMES = {
    "flash_attn4": (
        "flash-attn-4 4.0.0b36: dq off by 0.2-12 where the true dq is ~0 and dense SDPA's error "
        "is 1e-4 (one-hot rows at |lse| 4e4-9e5), the symptom our Triton kernels had while "
        "they formed exponents from large rounded terms"
    ),
}

#: Backends that run torch's cuDNN or flash kernels (Note [Tolerances at extreme logits]).
KERNEL_SPREAD = {"sdpa_cudnn": 1.5, "sdpa_flash": 1.5}


def _check_extreme(
    actual: list[Tensor], q: Tensor, k: Tensor, v: Tensor, dout: Tensor, M: Tensor,
    backend: str | None = None,
) -> None:  # fmt: skip
    """Outputs and gradients against the oracle within Note [Tolerances at extreme logits]."""
    ratio = RATIO * KERNEL_SPREAD.get(backend or "", 1.0)
    expected, lse = _oracle(q, k, v, dout, M)
    dense = _dense_sdpa(q, k, v, dout, M)
    tol = TOLERANCES[q.dtype]
    lse_rounding = 2 * 2.0**-24 * float(lse[torch.isfinite(lse)].abs().max())
    names = ("out", "dq", "dk", "dv")
    dense_error = {n: max_abs_error(r, w) for n, r, w in zip(names, dense, expected, strict=True)}
    # dq and dk share one reference error (Note [Tolerances at extreme logits]).
    dense_error["dq"] = dense_error["dk"] = max(dense_error["dq"], dense_error["dk"])
    for name, got, want in zip(names, actual, expected, strict=True):
        atol, rtol = (tol.atol, tol.rtol) if name == "out" else (tol.grad_atol, tol.grad_rtol)
        size = float(want.abs().max())
        floor = atol + (rtol + lse_rounding) * size
        if q.dtype in (torch.float16, torch.bfloat16):
            floor += rounding_floor(want, q.dtype)
        bound = ratio * dense_error[name] + floor
        got = got.cpu()
        assert bool(torch.isfinite(got).all()), f"{name}: {int((~got.isfinite()).sum())} non-finite"
        err = max_abs_error(got, want)
        assert err <= bound, (
            f"{name}: max error {err:.3e} vs the float64 oracle exceeds {bound:.3e} (dense SDPA's "
            f"{dense_error[name]:.3e} x {ratio} + floor {floor:.3e}; max|{name}| {size:.2e}"
            f", max|lse| {float(lse[torch.isfinite(lse)].abs().max()):.2e})"
        )


def _dilated_fn(
    segs: tuple[int, ...], rates: tuple[int, ...], backend: str | None, causal: bool
) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    def fn(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
        return dilated_attention(a, b, c, segs, rates, is_causal=causal, backend=backend)

    return fn


def _backend(name: str) -> str | None:
    return None if name == "auto" else name


# -- large logits through the merge (item 1) -------------------------------------------------------
@pytest.mark.parametrize("backend", CPU_BACKENDS, ids=backend_id)
@pytest.mark.parametrize(("segs", "rates"), SCHEDULES)
@pytest.mark.parametrize(("dtype", "logit"), EXTREMES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv_heads", [HEADS, 2], ids=["mha", "gqa"])
def test_dilated_large_logits_match_oracle(
    backend: str | None,
    segs: tuple[int, ...],
    rates: tuple[int, ...],
    dtype: torch.dtype,
    logit: float,
    causal: bool,
    kv_heads: int,
) -> None:
    """Outputs and dq, dk, dv of merged branches stay within Note [Tolerances at extreme
    logits] of the float64 oracle, nearly one-hot rows and spread rows alike."""
    for seed, shifted in ((0, False), (1, True)):
        q, k, v, dout = _inputs(logit, dtype, kv_heads=kv_heads, shifted=shifted, seed=seed)
        skip_unless_runnable(backend, q, k, v, is_causal=causal, key_padding_mask=None)
        actual = _grads(_dilated_fn(segs, rates, backend, causal), q, k, v, dout)
        M = dilated_multiplicity(SEQ, HEADS, segs, rates, is_causal=causal)
        _check_extreme(actual, q, k, v, dout, M)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize(("segs", "rates"), SCHEDULES)
@pytest.mark.parametrize(("dtype", "logit"), EXTREMES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dilated_large_logits_match_oracle_cuda(
    backend: str, segs: tuple[int, ...], rates: tuple[int, ...], dtype: torch.dtype,
    logit: float, causal: bool, request: pytest.FixtureRequest,
) -> None:  # fmt: skip
    """The same on CUDA backends (the fused Triton path merges in its own kernel)."""
    for seed, shifted in ((0, False), (1, True)):
        q, k, v, dout = (x.cuda() for x in _inputs(logit, dtype, shifted=shifted, seed=seed))
        skip_unless_runnable(_backend(backend), q, k, v, is_causal=causal, key_padding_mask=None)
        if backend in INACCURATE_AT_EXTREMES and dtype != torch.float32:
            reason = INACCURATE_AT_EXTREMES[backend]
            request.applymarker(pytest.mark.xfail(strict=True, reason=reason))
        fn = _dilated_fn(segs, rates, _backend(backend), causal)
        actual = _grads(fn, q, k, v, dout)
        M = dilated_multiplicity(SEQ, HEADS, segs, rates, is_causal=causal)
        _check_extreme(actual, q, k, v, dout, M, _backend(backend))


#: (backend, form) of the run-time block tests: every CPU backend with a bool mask, the
#: automatic choice with block indices too.
RUNTIME_CASES = [
    *(pytest.param(b, "mask", id=f"{backend_id(b)}-mask") for b in CPU_BACKENDS),
    pytest.param(None, "indices", id="auto-indices"),
]


@pytest.mark.parametrize(("backend", "form"), RUNTIME_CASES)
@pytest.mark.parametrize(("dtype", "logit"), EXTREMES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv_heads", [HEADS, 2], ids=["mha", "gqa"])
def test_block_sparse_runtime_large_logits_match_oracle(
    backend: str | None, form: str, dtype: torch.dtype, logit: float, causal: bool,
    kv_heads: int,
) -> None:  # fmt: skip
    """Run-time blocks (MoBA's attention: per head, chosen by the model) at huge logits: outputs
    and dq, dk, dv within Note [Tolerances at extreme logits] of the float64 oracle on the
    blocks' token visibility, nearly one-hot rows and spread rows alike."""
    mask = _runtime_mask(SEQ, BATCH, seed=11)
    blocks = mask if form == "mask" else _as_indices(mask)
    M = _block_tokens(mask[0], SEQ, causal)

    def fn(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
        return block_sparse_attention(
            a, b, c, blocks, block_size=SPARSE_BLOCK, is_causal=causal, backend=backend
        )

    for seed, shifted in ((0, False), (1, True)):
        q, k, v, dout = _inputs(logit, dtype, kv_heads=kv_heads, shifted=shifted, seed=seed)
        _check_extreme(_grads(fn, q, k, v, dout), q, k, v, dout, M, backend)


def _identical_branches(device: str, backend: str | None) -> None:
    for dtype, logit in ((torch.float32, 1e4), (torch.float32, 1e6), (torch.float16, 6e4)):
        q, k, v, _ = (x.to(device) for x in _inputs(logit, dtype, seed=2))
        one = dilated_attention(q, k, v, [SEQ], [1], backend=backend)
        two, lse = dilated_attention(q, k, v, [SEQ, SEQ], [1, 1], backend=backend, return_lse=True)
        # Two equal branches mix with weights exactly 1/2 each: the same numbers, not 1.8x.
        torch.testing.assert_close(two, one, atol=0, rtol=0)
        _, one_lse = dilated_attention(q, k, v, [SEQ], [1], backend=backend, return_lse=True)
        spacing = 2.0 ** math.floor(math.log2(float(one_lse.abs().max()))) * 2.0**-23
        torch.testing.assert_close(lse, one_lse + math.log(2), atol=spacing, rtol=0)


@pytest.mark.parametrize("backend", CPU_BACKENDS, ids=backend_id)
def test_identical_branches_equal_one_branch(backend: str | None) -> None:
    """``[w, w], [1, 1]`` is ``[w], [1]`` with every key counted twice: the same output exactly
    and an lse larger by log 2 (to the lse's own spacing), at any logit size (issue 21: they
    differed by 2.73 at logits 1e4)."""
    _identical_branches("cpu", backend)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_identical_branches_equal_one_branch_cuda(backend: str) -> None:
    """The same on CUDA backends."""
    q = torch.zeros(1, SEQ, HEADS, DIM, device="cuda")
    skip_unless_runnable(_backend(backend), q, q, q, is_causal=False, key_padding_mask=None)
    _identical_branches("cuda", _backend(backend))


@pytest.mark.parametrize("backend", CPU_BACKENDS, ids=backend_id)
@pytest.mark.parametrize(("segs", "rates"), SCHEDULES)
@pytest.mark.parametrize("logit", [1e4, 1e6, 1e8])
@pytest.mark.parametrize("shifted", [False, True], ids=["peaked", "shifted"])
def test_output_in_convex_hull_of_values(
    backend: str | None, segs: tuple[int, ...], rates: tuple[int, ...], logit: float,
    shifted: bool,
) -> None:  # fmt: skip
    """Every output element lies between the smallest and largest value element of its kv head
    (a softmax average cannot leave the hull), however large the logits: issue 21 saw 5.47 with
    values of at most 3.39."""
    q, k, v, _ = _inputs(logit, torch.float32, shifted=shifted, seed=3)
    out = dilated_attention(q, k, v, segs, rates, backend=backend)
    low, high = v.amin(dim=1, keepdim=True), v.amax(dim=1, keepdim=True)
    slack = 4 * torch.finfo(torch.float32).eps * v.abs().amax()
    inside = bool((out >= low - slack).all()) and bool((out <= high + slack).all())
    assert inside, (
        f"output range [{float(out.min()):.3f}, {float(out.max()):.3f}] leaves the values' "
        f"[{float(low.min()):.3f}, {float(high.max()):.3f}]"
    )


def _content_selected(method: str, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """MoBA, or NSA with its branches in one softmax (``combine="lse"``), causal."""
    if method == "moba":
        return moba_attention(q, k, v, block_size=8, topk=2, is_causal=True)
    return nsa_attention(
        q, k, v, None, compress_block=8, compress_stride=4, select_block=8, topk=2, window=16,
        combine="lse",
    )  # fmt: skip


@pytest.mark.parametrize("method", ["moba", "nsa"])
@pytest.mark.parametrize("logit", [1e4, 1e6, 1e8])
@pytest.mark.parametrize("shifted", [False, True], ids=["peaked", "shifted"])
def test_content_selected_outputs_in_convex_hull_of_values(
    method: str, logit: float, shifted: bool
) -> None:
    """MoBA's and NSA's outputs at huge logits (the blocks chosen from the same logits) stay
    between the smallest and largest value element of their key/value head, and every
    gradient is finite."""
    q, k, v, dout = _inputs(logit, torch.float32, kv_heads=2, shifted=shifted, seed=3)
    out, *grads = _grads(functools.partial(_content_selected, method), q, k, v, dout)
    low, high = (x.repeat_interleave(HEADS // 2, dim=2) for x in (v.amin(1, True), v.amax(1, True)))
    slack = 4 * torch.finfo(torch.float32).eps * v.abs().amax()
    assert bool((out >= low - slack).all()) and bool((out <= high + slack).all()), (
        f"{method}: output range [{float(out.min()):.3f}, {float(out.max()):.3f}] leaves the "
        f"values' [{float(low.min()):.3f}, {float(high.max()):.3f}]"
    )
    for name, grad in zip(("dq", "dk", "dv"), grads, strict=True):
        assert bool(torch.isfinite(grad).all()), f"{method} {name}: non-finite"


# -- the merge itself ------------------------------------------------------------------------------
def _merge_cases(device: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out_a, lse_a, out_b, lse_b) over 8 rows: huge equal lse, huge unequal lse, one side empty,
    both empty, NaN on either side, +inf on one side, moderate values."""
    inf, nan = float("inf"), float("nan")
    lse_a = torch.tensor([1e8, 1e8, -inf, -inf, nan, 0.5, inf, 1.0], dtype=torch.float64)
    lse_b = torch.tensor([1e8, 1e8 + 16, 3e7, -inf, 2.0, nan, 1.0, -2.0], dtype=torch.float64)
    gen = torch.Generator().manual_seed(4)
    out_a = torch.randn(8, DIM, generator=gen, dtype=torch.float64)
    out_b = torch.randn(8, DIM, generator=gen, dtype=torch.float64)
    return tuple(x.to(device) for x in (out_a, lse_a, out_b, lse_b))  # type: ignore[return-value]


def _expected_merge(
    out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor
) -> tuple[Tensor, Tensor]:
    """Row by row in Python floats (float64), from the definition."""
    outs, lses = [], []
    rows = zip(out_a.tolist(), lse_a.tolist(), out_b.tolist(), lse_b.tolist(), strict=True)
    for oa, la, ob, lb in rows:
        if math.isnan(la) or math.isnan(lb) or math.inf in (la, lb):
            outs.append([math.nan] * len(oa))
            lses.append(math.nan)
        elif la == lb == -math.inf:
            outs.append([0.0] * len(oa))
            lses.append(-math.inf)
        else:
            top = max(la, lb)
            wa, wb = math.exp(la - top), math.exp(lb - top)
            outs.append([(x * wa + y * wb) / (wa + wb) for x, y in zip(oa, ob, strict=True)])
            lses.append(top + math.log(wa + wb))
    return torch.tensor(outs, dtype=torch.float64), torch.tensor(lses, dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_merge_partial_exact_and_propagates_nan(dtype: torch.dtype) -> None:
    """``merge_partial`` against the definition: weights normalized at |lse| = 1e8, (0, -inf) for
    two empty sides, NaN for a NaN or +inf lse (never a finite stand-in)."""
    out_a, lse_a, out_b, lse_b = (x.to(dtype) for x in _merge_cases("cpu"))
    out, lse = merge_partial(out_a, lse_a, out_b, lse_b)
    want_out, want_lse = _expected_merge(out_a.double(), lse_a.double(), out_b.double(), lse_b)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out.double(), want_out, atol=4 * eps, rtol=0, equal_nan=True)
    torch.testing.assert_close(lse.double(), want_lse, atol=0, rtol=eps, equal_nan=True)


@pytest.mark.gpu
def test_triton_merge_kernel_matches_definition() -> None:
    """The ring's fused CUDA merge (``backends/triton_kernels/merge.py``) on the same rows."""
    from dilated_attention.backends.triton_kernels.merge import merge_into

    out_a, lse_a, out_b, lse_b = _merge_cases("cuda")
    out = out_a.float().view(1, 8, 1, DIM).contiguous()
    lse = lse_a.float().view(1, 8, 1).contiguous()
    part, part_lse = out_b.to(torch.bfloat16).view(1, 8, 1, DIM), lse_b.float().view(1, 8, 1)
    merge_into(out, lse, part, part_lse)
    want_out, want_lse = _expected_merge(
        out_a.float().double(), lse_a.float().double(), part.double().view(8, DIM),
        part_lse.double().view(8),
    )  # fmt: skip
    torch.testing.assert_close(
        out.view(8, DIM).double().cpu(), want_out, atol=1e-6, rtol=0, equal_nan=True
    )
    torch.testing.assert_close(
        lse.view(8).double().cpu(), want_lse, atol=0, rtol=2e-7, equal_nan=True
    )


@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_triton_split_merge_matches_definition(device: str, dtypes: list[torch.dtype]) -> None:
    """The split merge (``merge_splits``: a decoded token's or a short call's key runs) over 70
    splits, two tiles of them: each (position, head) row's splits against the definition in
    float64 (weights normalized at |lse| = 1e8, every split empty, a NaN or +inf split in the
    second tile), written in each tested dtype."""
    from dilated_attention.backends.triton_kernels.merge import merge_splits

    skip_without_triton(device)
    inf, nan = float("inf"), float("nan")
    splits, n, heads = 70, 3, 2
    gen = torch.Generator().manual_seed(8)
    part = torch.randn(1, splits * n, heads, DIM, generator=gen, dtype=torch.float64)
    part_lse = torch.randn(1, heads, splits * n, generator=gen, dtype=torch.float64) * 4
    part_lse[0, 0, 0::n] = 1e8 + torch.arange(splits, dtype=torch.float64)  # row (0, 0): huge
    part_lse[0, 1, 0::n] = -inf  # row (0, 1): every split empty
    part_lse[0, 0, 1::n][::3] = -inf  # row (1, 0): a third empty
    part_lse[0, 1, 1 + 66 * n] = nan  # row (1, 1): NaN in the second tile
    part_lse[0, 0, 2 + 65 * n] = inf  # row (2, 0): +inf in the second tile
    for dtype in dtypes:
        out = torch.empty(1, n, heads, DIM, dtype=dtype, device=device)
        lse = torch.empty(1, heads, n, dtype=torch.float32, device=device)
        merge_splits(part.float().to(device), part_lse.float().to(device), out, lse)
        for i in range(n):
            for h in range(heads):
                rows = part[0, i::n, h].float().double()  # (S, D): split s at row s * n + i
                lses = part_lse[0, h, i::n].float().double()
                if lses.isnan().any() or (lses == inf).any():
                    want, want_lse = torch.full((DIM,), nan), torch.tensor(nan)
                elif (lses == -inf).all():
                    want, want_lse = torch.zeros(DIM), torch.tensor(-inf)
                else:
                    weights = torch.softmax(lses, 0)
                    want, want_lse = weights @ rows, torch.logsumexp(lses, 0)
                tol = TOLERANCES[dtype]
                got, got_lse = out[0, i, h].double().cpu(), lse[0, h, i].double().cpu()
                torch.testing.assert_close(
                    got, want.double(), equal_nan=True, atol=tol.atol, rtol=tol.rtol
                )
                torch.testing.assert_close(
                    got_lse, want_lse.double(), atol=0, rtol=2e-7, equal_nan=True
                )


# -- NaN and inf rows (item 3) ---------------------------------------------------------------------
#: Sequence with a short last segment (3 keys) for w = 16, and a branch of 32 / 4 = 8 keys per
#: segment: both below torch's CPU flash kernel's vector width.
NAN_SEQ = 35
NAN_SCHEDULE = ((16, 32), (1, 4))


def _nan_inputs(kv_heads: int, dtype: torch.dtype = torch.float32) -> list[Tensor]:
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, NAN_SEQ, HEADS, DIM, generator=gen)
    k = torch.randn(2, NAN_SEQ, kv_heads, DIM, generator=gen)
    v = torch.randn(2, NAN_SEQ, kv_heads, DIM, generator=gen)
    return [x.to(dtype) for x in (q, k, v)]


def _poison(
    q: Tensor, k: Tensor, v: Tensor, where: str, value: float, pos: int, head: int
) -> tuple[Tensor, Tensor, Tensor]:
    """A copy of q, k, v with ``value`` in batch 1 at position ``pos`` of head ``head``: the whole
    query row for ``where == "q"``, one element of the key or value otherwise."""
    q, k, v = q.clone(), k.clone(), v.clone()
    if where == "q":
        q[1, pos, head] = value
    else:
        {"k": k, "v": v}[where][1, pos, head, 0] = value
    return q, k, v


def _reached(M: Tensor, where: str, pos: int, head: int, group: int) -> Tensor:
    """(B, N, H) bool: the (row, head) cells a poisoned element reaches (Note [Which rows a NaN
    reaches]); ``M`` is (H, N, N) or (N, N) visibility."""
    M = M.expand(HEADS, *M.shape[-2:]) if M.dim() == 2 else M
    cells = torch.zeros(2, M.shape[1], HEADS, dtype=torch.bool)
    if where == "q":
        cells[1, pos, head] = bool(M[head, pos].any())
    else:
        for h in range(head * group, (head + 1) * group):
            cells[1, :, h] = M[h, :, pos] > 0
    return cells


# Each (function, visibility) takes (q, k, v, backend, causal) and returns (out, lse).
def _run_dilated(q: Tensor, k: Tensor, v: Tensor, backend: str | None, causal: bool) -> tuple:
    segs, rates = NAN_SCHEDULE
    return dilated_attention(
        q, k, v, segs, rates, is_causal=causal, backend=backend, return_lse=True
    )


def _run_dense(q: Tensor, k: Tensor, v: Tensor, backend: str | None, causal: bool) -> tuple:
    # Keys in chunks below the vector width: a cross-attention call with 5 keys.
    k, v = k[:, :5], v[:, :5]
    if not causal:
        return attention(q, k, v, backend=backend, return_lse=True)
    # Causal: the first 5 rows against the 5 keys, the later rows see all 5 (a causal query
    # longer than the key is refused: causal queries are end-aligned).
    head = attention(q[:, :5], k, v, is_causal=True, backend=backend, return_lse=True)
    tail = attention(q[:, 5:], k, v, backend=backend, return_lse=True)
    return torch.cat([head[0], tail[0]], dim=1), torch.cat([head[1], tail[1]], dim=2)


SPARSE_PATTERN = LocalWindow(1) | DilatedBlocks(2)
SPARSE_BLOCK = 4


def _run_sparse(q: Tensor, k: Tensor, v: Tensor, backend: str | None, causal: bool) -> tuple:
    return block_sparse_attention(
        q, k, v, SPARSE_PATTERN, block_size=SPARSE_BLOCK, is_causal=causal, backend=backend,
        return_lse=True,
    )


def _runtime_mask(seq: int, batch: int, seed: int = 9) -> Tensor:
    """(batch, H, M, M) bool, M = ceil(seq / SPARSE_BLOCK): a run-time block mask that differs
    per batch row and head, each query block keeping its own block (no empty rows)."""
    blocks = -(-seq // SPARSE_BLOCK)
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, HEADS, blocks, blocks, generator=gen) < 0.4
    return mask | torch.eye(blocks, dtype=torch.bool)


def _as_indices(mask: Tensor) -> Tensor:
    """The same blocks as int64 indices (B, H, M, K), K the most a row keeps, -1 = none."""
    width = int(mask.sum(-1).max())
    order = torch.arange(mask.shape[-1]).expand(mask.shape)
    ranked = torch.where(mask, order, mask.shape[-1]).sort(dim=-1).values[..., :width]
    return torch.where(ranked < mask.shape[-1], ranked, -1)


def _block_tokens(mask: Tensor, seq: int, causal: bool) -> Tensor:
    """(..., seq, seq) 0/1 visibility of a block mask (..., M, M) at SPARSE_BLOCK tokens."""
    tokens = mask.repeat_interleave(SPARSE_BLOCK, -2).repeat_interleave(SPARSE_BLOCK, -1)
    M = tokens[..., :seq, :seq].to(torch.int64)
    return torch.tril(M) if causal else M


#: The NaN tests' run-time blocks (batch 1 is the one poisoned), as a mask and as indices.
RUNTIME_MASK = _runtime_mask(NAN_SEQ, 2)
RUNTIME_BLOCKS = {
    "block_sparse_mask": RUNTIME_MASK, "block_sparse_indices": _as_indices(RUNTIME_MASK),
}  # fmt: skip


def _run_runtime(kind: str) -> Callable[..., tuple]:
    def run(q: Tensor, k: Tensor, v: Tensor, backend: str | None, causal: bool) -> tuple:
        return block_sparse_attention(
            q, k, v, RUNTIME_BLOCKS[kind].to(q.device), block_size=SPARSE_BLOCK,
            is_causal=causal, backend=backend, return_lse=True,
        )  # fmt: skip

    return run


def _visibility(kind: str, causal: bool) -> Tensor:
    """(H, N, Nk) multiplicity (or visibility) of each NaN-test call."""
    if kind in RUNTIME_BLOCKS:
        return _block_tokens(RUNTIME_MASK[1], NAN_SEQ, causal)
    if kind == "dilated":
        return dilated_multiplicity(NAN_SEQ, HEADS, *NAN_SCHEDULE, is_causal=causal)
    if kind == "dense":
        M = torch.ones(NAN_SEQ, 5, dtype=torch.int64)
        return torch.tril(M) if causal else M
    blocks = -(-NAN_SEQ // SPARSE_BLOCK)
    return _block_tokens(SPARSE_PATTERN.block_mask(blocks, blocks), NAN_SEQ, causal)


def _unmasked(kind: str) -> Tensor:
    """The visibility a CUDA kernel's hidden keys may still reach (Note [Which rows a NaN
    reaches]): the causal rows of the same call, or for a run-time mask every row, since its
    dense-kernel calls hide the unkept blocks by a key mask (``block_sparse/rows.py``) and its
    block-sparse kernels compute whole tiles."""
    if kind in RUNTIME_BLOCKS:
        return torch.ones(NAN_SEQ, NAN_SEQ, dtype=torch.int64)
    return _visibility(kind, False)


RUNS = {
    "dilated": _run_dilated, "dense": _run_dense, "block_sparse": _run_sparse,
    **{kind: _run_runtime(kind) for kind in RUNTIME_BLOCKS},
}  # fmt: skip
#: The kinds the CUDA NaN test runs: every kind.
CUDA_KINDS = list(RUNS)
#: (where, position, head): the last query row (in the short last segment), a query row inside
#: the dilated branch, a key and a value the last segment holds.
POISON = [("q", NAN_SEQ - 1, 1), ("q", 18, 2), ("k", NAN_SEQ - 2, 0), ("v", 33, 1), ("k", 2, 1)]


def _check_poisoned(
    kind: str, backend: str | None, causal: bool, kv_heads: int, value: float, device: str
) -> None:
    q, k, v = (x.to(device) for x in _nan_inputs(kv_heads))
    group = HEADS // kv_heads
    M = _visibility(kind, causal)
    for where, pos, head in POISON:
        if where != "q" and kind == "dense" and pos >= 5:
            continue  # the dense call reads only the first 5 keys
        kv_head = head if where == "q" else head % kv_heads
        pq, pk, pv = _poison(q, k, v, where, value, pos, kv_head)
        out, lse = RUNS[kind](pq, pk, pv, backend, causal)
        expected = _reached(M, where, pos, kv_head, group)
        untouched = ~expected
        if where == "k" and value == math.inf:  # q_0 * inf is -inf for q_0 < 0: key dropped
            expected &= q[:, :, :, 0].cpu() > 0
        bad = ~torch.isfinite(out).all(dim=-1).cpu()
        cuda_hidden = device == "cuda" and (
            (where == "v" and causal) or (where != "q" and kind in RUNTIME_BLOCKS)
        )
        if cuda_hidden:  # Note [Which rows a NaN reaches]
            unmasked = _reached(_unmasked(kind), where, pos, kv_head, group)
            assert bool((bad >= expected).all()) and bool((bad <= unmasked).all()), (
                f"{where}[1, {pos}, head {kv_head}] = {value}: non-finite cells "
                f"{bad.nonzero().tolist()}, reached {expected.nonzero().tolist()}"
            )
            reached, expected, untouched = expected, bad, ~bad
        else:
            reached = expected
        assert torch.equal(bad, expected), (
            f"{where}[1, {pos}, head {kv_head}] = {value}: non-finite cells "
            f"{bad.nonzero().tolist()} but it reaches {expected.nonzero().tolist()}"
        )
        if where != "v" and math.isnan(value):  # the lse of a row that sees it is NaN too
            assert bool(torch.isnan(lse.transpose(1, 2).cpu()[reached]).all())
        clean_out, _ = RUNS[kind](q, k, v, backend, causal)
        torch.testing.assert_close(out.cpu()[untouched], clean_out.cpu()[untouched])


@pytest.mark.parametrize("backend", CPU_BACKENDS, ids=backend_id)
@pytest.mark.parametrize("kind", list(RUNS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv_heads", [HEADS, 2], ids=["mha", "gqa"])
def test_nan_rows_stay_nan(backend: str | None, kind: str, causal: bool, kv_heads: int) -> None:
    """A NaN query, key or value element turns exactly the (row, head) cells it reaches NaN, on
    every CPU backend, including calls with fewer keys than torch's CPU flash kernel's vector
    width (issue 21: such a NaN query row came out as zeros)."""
    _check_poisoned(kind, backend, causal, kv_heads, float("nan"), "cpu")


@pytest.mark.parametrize("backend", CPU_BACKENDS, ids=backend_id)
@pytest.mark.parametrize("kind", list(RUNS))
def test_inf_inputs_give_nan_not_finite_garbage(backend: str | None, kind: str) -> None:
    """An infinite query row has no defined softmax (scores inf - inf): NaN for exactly that
    row, as for an inf key or value element in the cells that attend it."""
    _check_poisoned(kind, backend, False, HEADS, float("inf"), "cpu")


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("kind", CUDA_KINDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_nan_rows_stay_nan_cuda(backend: str, kind: str, causal: bool) -> None:
    """The same on CUDA backends."""
    q = torch.zeros(1, NAN_SEQ, HEADS, DIM, device="cuda")
    k = q[:, :5] if kind == "dense" else q
    if kind in ("block_sparse", *RUNTIME_BLOCKS) and backend != "auto":
        # The block-sparse registry answers for its own kernels (block size, dtype), for a
        # pattern and a run-time mask alike (Note [Run-time block masks]).
        kv = q[:, :, :2]  # the two key/value heads _check_poisoned runs
        inputs = KernelInputs.from_tensors(q, kv, is_causal=causal, block_size=SPARSE_BLOCK)
        reasons = registry_for(BLOCK_SPARSE).reasons(backend, inputs)
        if reasons:
            pytest.skip(f"{backend}: " + "; ".join(reasons))
    else:
        # A causal dense run is a square causal call and a non-causal one (_run_dense).
        rows = k if causal else q
        skip_unless_runnable(_backend(backend), rows, k, k, is_causal=causal, key_padding_mask=None)
    _check_poisoned(kind, _backend(backend), causal, 2, float("nan"), "cuda")


@pytest.mark.parametrize("backend", CPU_BACKENDS, ids=backend_id)
def test_nan_query_row_gradient_is_nan(backend: str | None) -> None:
    """Backward through a NaN query row in a short segment: that row's dq is NaN, the other
    rows' dq stay finite."""
    q, k, v = _nan_inputs(HEADS)
    q, k, v = _poison(q, k, v, "q", float("nan"), NAN_SEQ - 1, 1)
    q.requires_grad_()
    dilated_attention(q, k, v, [16], [1], backend=backend).sum().backward()
    bad = ~torch.isfinite(q.grad).all(dim=-1)
    expected = torch.zeros_like(bad)
    expected[1, NAN_SEQ - 1, 1] = True
    assert torch.equal(bad, expected), bad.nonzero().tolist()
