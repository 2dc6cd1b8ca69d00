"""What a dense call derives from its metadata is derived once and kept: its checks and request
(Note [Checked once per call signature], Note [One request per description] in
``resolve/request.py``) and its runner (Note [Resolved once per request]). A call that takes
what was kept computes what a fresh call computes, and a bad call still raises its error.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from support.backend_params import CPU_BACKENDS, backend_id, skip_unless_runnable
from support.oracle import oracle_attention, oracle_dilated_attention
from support.tolerances import assert_close_to_oracle

import dilated_attention as da
from dilated_attention.resolve import Request, resolve
from dilated_attention.resolve.resolver import clear_resolved

B, N, H, HKV, D = 2, 9, 4, 2, 8


def _qkv(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = ((B, N, H, D), (B, N, HKV, D), (B, N, HKV, D))
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]


def test_an_equal_description_is_the_same_request() -> None:
    """Describing the same call again gives the request already made, not an equal copy; a
    description that differs (a flag, grad mode, a dtype) gives its own. Packed documents are
    described anew each time (their offsets change from call to call)."""
    q, k, v = (x.requires_grad_() for x in _qkv())
    first = Request.of("dense", q, k, v, is_causal=True)
    again = Request.of("dense", *(x.detach().clone().requires_grad_() for x in (q, k, v)),
                       is_causal=True)  # fmt: skip
    assert again is first
    with torch.no_grad():
        inference = Request.of("dense", q, k, v, is_causal=True)
    assert inference == replace(first, requires_grad=False)
    assert Request.of("dense", q, k, v, is_causal=False) != first
    doubles = [x.double() for x in (q, k, v)]
    assert Request.of("dense", *doubles, is_causal=True).dtype == torch.float64
    packed = [Request.of("dense", q, k, v, documents=(0, 4, 18)) for _ in range(2)]
    assert packed[0] == packed[1] and packed[0] is not packed[1]


def test_a_dense_strategy_makes_its_runner_once() -> None:
    """The dense strategy's runner depends on the request alone: every call of the request
    runs the same runner object (plan once, run many)."""
    q, k, v = _qkv()
    strategy = resolve(Request.of("dense", q, k, v, is_causal=True))
    first, _ = strategy.prepare(q, k, v, None)  # type: ignore[misc]
    again, _ = strategy.prepare(*_qkv(seed=1), None)  # type: ignore[misc]
    assert again is first


#: Arguments equal (``==``) to a valid one that the checks still refuse.
BAD_EQUALS: dict[str, tuple[dict[str, Any], dict[str, Any], type[Exception]]] = {
    "is_causal=1": ({"is_causal": True}, {"is_causal": 1}, TypeError),
    "return_lse=0": ({"return_lse": False}, {"return_lse": 0}, TypeError),
    "scale=True": ({"scale": 1.0}, {"scale": True}, TypeError),
    "dropout_p=False": ({"dropout_p": 0.0}, {"dropout_p": False}, TypeError),
    "window_size=(True, 0)": ({"window_size": (1, 0)}, {"window_size": (True, 0)}, TypeError),
}


#: Dilated calls' own: schedules equal to a valid one that the checks still refuse.
BAD_SCHEDULES: dict[str, tuple[list[Any], list[Any], type[Exception]]] = {
    "segment_lengths=[4.0, 8]": ([4, 8], [4.0, 8], ValueError),
    "dilation_rates=[True, 2]": ([1, 2], [True, 2], ValueError),
}


def _dilated(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
    return da.dilated_attention(q, k, v, [4, 8], [1, 2], **kw)


@pytest.mark.parametrize("call", [da.attention, _dilated], ids=["dense", "dilated"])
@pytest.mark.parametrize("case", list(BAD_EQUALS))
def test_a_checked_signature_never_passes_a_bad_call(case: str, call: Any) -> None:
    """A call whose arguments equal those of a call already checked but would fail a check
    (``1 == True``, and only the bool passes) still raises the check's error."""
    good, bad, error = BAD_EQUALS[case]
    q, k, v = _qkv()
    call(q, k, v, **good)
    with pytest.raises(error, match=next(iter(bad))):
        call(q, k, v, **bad)


@pytest.mark.parametrize("case", list(BAD_SCHEDULES))
def test_a_checked_schedule_never_passes_a_bad_one(case: str) -> None:
    """Segment lengths and rates are part of a dilated call's signature by type and value: a
    schedule equal to a checked one but of other item types raises, and so does a list changed
    in place after a call."""
    good, bad, error = BAD_SCHEDULES[case]
    q, k, v = _qkv()
    argument = case.split("=")[0]
    schedule = {"segment_lengths": [4, 8], "dilation_rates": [1, 2]}
    da.dilated_attention(q, k, v, **{**schedule, argument: good})
    with pytest.raises(error, match=argument):
        da.dilated_attention(q, k, v, **{**schedule, argument: bad})
    segments = [4, 8]
    da.dilated_attention(q, k, v, segments, [1, 2])
    segments[1] = 0
    with pytest.raises(ValueError, match="segment_lengths"):
        da.dilated_attention(q, k, v, segments, [1, 2])


def test_calls_differing_only_in_metadata_are_checked_anew() -> None:
    """Metadata the checks read is part of the signature: the same shapes on another dtype, or
    a key padding mask of another shape, are checked again (and a bad one raises)."""
    q, k, v = _qkv()
    mask = torch.zeros(B, N, dtype=torch.bool)
    da.attention(q, k, v, key_padding_mask=mask)
    with pytest.raises(ValueError, match="key_padding_mask must have shape"):
        da.attention(q, k, v, key_padding_mask=mask[:, :-1])
    with pytest.raises(TypeError, match="same dtype as query"):
        da.attention(q, k.double(), v)
    window = da.attention(q, k, v, window_size=[2, 0])  # a list: kept by its items' values
    torch.testing.assert_close(da.attention(q, k, v, window_size=[2, 0]), window)


#: Each public function kept per signature, with its float64 oracle: (call, oracle).
KEPT_CALLS: dict[str, tuple[Any, Any]] = {
    "dense": (da.attention, oracle_attention),
    "dilated": (
        lambda q, k, v, **kw: da.dilated_attention(q, k, v, [4, 8], [1, 2], **kw),
        lambda q, k, v, **kw: oracle_dilated_attention(q, k, v, [4, 8], [1, 2], **kw),
    ),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("backend", CPU_BACKENDS, ids=backend_id)
@pytest.mark.parametrize("operation", list(KEPT_CALLS))
def test_a_kept_call_matches_the_oracle(
    operation: str, backend: str | None, is_causal: bool, dtype: torch.dtype
) -> None:
    """The second call of a signature (checks, request, strategy and runner all kept) gives
    the float64 oracle's output and gradients, as the first does, on new inputs; dense and
    dilated (an odd length: a partial last segment), with GQA."""
    call, oracle = KEPT_CALLS[operation]
    for seed in (0, 1):  # the second call takes what the first kept
        q64, k64, v64 = (x.requires_grad_() for x in _qkv(torch.float64, seed))
        q, k, v = (x.detach().to(dtype).requires_grad_() for x in (q64, k64, v64))
        skip_unless_runnable(backend, q, k, v, is_causal=is_causal, key_padding_mask=None)
        out = call(q, k, v, is_causal=is_causal, backend=backend)
        want, _ = oracle(q64, k64, v64, is_causal=is_causal)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 7))
        grads = torch.autograd.grad(out, (q, k, v), dout.to(dtype))
        want_grads = torch.autograd.grad(want, (q64, k64, v64), dout.double())
        assert_close_to_oracle(out.detach(), want.detach(), name="out", dtype=dtype)
        for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads, strict=True):
            assert_close_to_oracle(g, w, name=name, dtype=dtype, grad=True)


def _fresh(call: Any) -> Any:
    """``call()`` with nothing kept: every check, request and strategy made anew."""
    clear_resolved()
    return call()


def test_a_kept_strategy_follows_the_kernel_asked_for(
    kernel_calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The eager route takes a kept strategy by the request and the kernel asked for from
    outside the call (``use_backend``, the environment): a call of a kept request under another
    kernel runs that kernel, and the automatic choice again after it."""
    q, k, v = _qkv()
    want = da.attention(q, k, v, is_causal=True)
    assert kernel_calls == ["cpu_flash"]
    with da.use_backend("math"):
        by_name = da.attention(q, k, v, is_causal=True)
    monkeypatch.setenv("DILATED_ATTENTION_BACKEND", "math")
    by_env = da.attention(q, k, v, is_causal=True)
    monkeypatch.delenv("DILATED_ATTENTION_BACKEND")
    again = da.attention(q, k, v, is_causal=True)
    assert kernel_calls == ["cpu_flash", "math", "math", "cpu_flash"]
    torch.testing.assert_close(by_name, want)
    torch.testing.assert_close(by_env, want)
    assert torch.equal(again, want)
    monkeypatch.setenv("DILATED_ATTENTION_BACKEND", "no_such_kernel")
    with pytest.raises(ValueError, match="names no backend"):
        da.attention(q, k, v, is_causal=True)


def test_kept_or_resolved_takes_the_kept_strategy_without_resolving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A custom operator's implementation takes a kept strategy by the request and the kernel
    asked for, as the eager route does, resolving only where none is kept."""
    import dilated_attention.resolve.resolver as resolver

    q, k, v = _qkv()
    clear_resolved()
    request = Request.of("dense", q, k, v, is_causal=True)
    resolved = []
    real = resolver.resolve
    monkeypatch.setattr(resolver, "resolve", lambda r: resolved.append(r) or real(r))
    first = resolver.kept_or_resolved(request)
    assert resolved == [request] and first is real(request)
    assert resolver.kept_or_resolved(request) is first and len(resolved) == 1
    with da.use_backend("math"):
        by_name = resolver.kept_or_resolved(request)
    assert by_name is not first and by_name.kernel.backend.name == "math" and len(resolved) == 2


#: Calls that differ from a kept one only in what the kept checks, request and strategy must
#: not mix up: strides, dtype, whether the inputs require gradients, grad mode.
VARIANTS: dict[str, Any] = {
    "strided": lambda q, k, v: [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v)],
    "float64": lambda q, k, v: [x.double() for x in (q, k, v)],
    "no grad inputs": lambda q, k, v: [x.detach() for x in (q, k, v)],
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_a_call_after_a_kept_one_matches_a_fresh_call(variant: str, is_causal: bool) -> None:
    """After a call whose checks, request, strategy and runner were kept, a call that differs
    in strides, dtype or gradient needs gives bit for bit what the same call gives with nothing
    kept: its output and, where it has them, its gradients."""
    q, k, v = (x.requires_grad_() for x in _qkv())
    dout = torch.randn(B, N, H, D, generator=torch.Generator().manual_seed(3))

    def run() -> list[torch.Tensor]:
        x = [t.detach().requires_grad_(t.requires_grad) for t in VARIANTS[variant](q, k, v)]
        out = da.attention(*x, is_causal=is_causal)
        if not out.requires_grad:
            return [out]
        return [out, *torch.autograd.grad(out, x, dout.to(out.dtype))]

    # The kept call: contiguous float32 inputs that require gradients, differentiated.
    da.attention(q, k, v, is_causal=is_causal).sum().backward()
    kept = run()
    fresh = _fresh(run)
    assert len(kept) == len(fresh)
    for got, want in zip(kept, fresh, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_a_bad_call_after_a_kept_one_still_raises() -> None:
    """A call that fails a check raises its error before any work, though a good call of the
    same function was kept, and the good call runs again after it."""
    q, k, v = _qkv()
    want = da.attention(q, k, v)
    with pytest.raises(ValueError, match="must be a multiple of key/value heads"):
        da.attention(q, k[:, :, :1].expand(B, N, 3, D), v[:, :, :1].expand(B, N, 3, D))
    with pytest.raises(ValueError, match="must have the same shape"):
        da.attention(q, k[:, :-1], v)
    with pytest.raises(TypeError, match="is_causal"):
        da.attention(q, k, v, is_causal="yes")  # type: ignore[arg-type]
    assert torch.equal(da.attention(q, k, v), want)


def test_a_runner_makes_its_kernel_arguments_once() -> None:
    """A plan runner's kernel arguments (kernel, scale, dropout, soft-cap) are made once and
    are the request's."""
    q, k, v = _qkv()
    strategy = resolve(Request.of("dense", q, k, v, scale=0.25, softcap=3.0))
    runner, _ = strategy.prepare(q, k, v, None)  # type: ignore[misc]
    assert runner.kernel is runner.kernel
    assert (runner.kernel.scale, runner.kernel.softcap) == (0.25, 3.0)
    assert runner.kernel.backend is strategy.kernel.backend  # type: ignore[union-attr]
