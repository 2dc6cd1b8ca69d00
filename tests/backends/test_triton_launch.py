"""Launches through the compiled kernel's launcher (Note [Launches without the JIT's dispatch] in
``backends/triton_kernels/launch.py``): a known key launches the kernel Triton would have chosen,
and every property Triton specializes on gives a key of its own (CUDA only: the interpreter has no
compiled kernels)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

pytestmark = pytest.mark.gpu


@triton.jit
def _scaled_copy(src, dst, n, step, factor, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offsets < n
    values = tl.load(src + offsets * step, mask=keep)
    tl.store(dst + offsets, values * factor, mask=keep)


def _launch_copy(src: torch.Tensor, dst: torch.Tensor, step: int, factor: float) -> None:
    from dilated_attention.backends.triton_kernels.launch import launch

    n = dst.numel()
    launch(_scaled_copy, (triton.cdiv(n, 64),), (src, dst, n, step, factor), {"BLOCK": 64})


@pytest.fixture
def fresh_cache(monkeypatch: pytest.MonkeyPatch) -> dict:
    from dilated_attention.backends.triton_kernels import launch as _triton_launch

    cache: dict = {}
    monkeypatch.setattr(_triton_launch, "_COMPILED", cache)
    return cache


def test_known_keys_launch_what_the_jit_would(fresh_cache: dict) -> None:
    """The first launch of a key compiles and keeps the kernel; later launches with new tensors
    and values run through it and compute what the JIT computes."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    src = torch.arange(300, device="cuda", dtype=torch.float32)
    for factor in (1.0, 2.5):
        dst = torch.full((300,), -1.0, device="cuda")
        _launch_copy(src, dst, 1, factor)
        torch.testing.assert_close(dst, src * factor)
    assert len(fresh_cache) == 2  # the factor is kept by value
    other = torch.randn(300, device="cuda")
    dst = torch.empty(300, device="cuda")
    _launch_copy(other, dst, 1, 2.5)
    assert len(fresh_cache) == 2  # same key: launched through the kept kernel
    torch.testing.assert_close(dst, other * 2.5)


def test_alignment_and_dtype_get_keys_of_their_own(fresh_cache: dict) -> None:
    """A pointer that is not 16-byte aligned, another dtype or a stride of 1 against one
    divisible by 16 (what Triton specializes on) never reuse a kernel compiled for another."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    base = torch.randn(4096, device="cuda")
    dst = torch.empty(100, device="cuda")
    _launch_copy(base, dst, 1, 1.0)
    torch.testing.assert_close(dst, base[:100])
    shifted = base[1:]  # 4 bytes past an aligned start
    _launch_copy(shifted, dst, 1, 1.0)
    torch.testing.assert_close(dst, shifted[:100])
    _launch_copy(base, dst, 16, 1.0)
    torch.testing.assert_close(dst, base[::16][:100])
    half = torch.empty(100, device="cuda", dtype=torch.float16)
    _launch_copy(base, half, 1, 1.0)
    torch.testing.assert_close(half, base[:100].half())
    assert len(fresh_cache) == 4
