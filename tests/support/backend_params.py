"""Backend x device x dtype parametrization shared by the correctness suites.

Backends come from the registry (``list_backends()``), so a new backend is covered by every suite
that uses these lists. A backend that cannot run particular inputs is skipped with its own reasons.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from dilated_attention import list_backends
from dilated_attention.backends import backend_reasons, get_backend

from . import required_backends

BACKENDS: list[str | None] = [None, *list_backends()]
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def runs_on(backend: str | None, device: str) -> bool:
    """Automatic choice, or a backend that declares this device type and is installed and working
    there (others are not collected: ``info`` and the selection tests cover why), or one the run
    requires (``--require-backends``: collected, so that its tests fail where it is missing)."""
    if backend is None:
        return True
    if backend == "flex":
        # Compiles a kernel per configuration (seconds each): covered by test_gpu_backends.py.
        return False
    kernel = get_backend(backend)
    if device not in kernel.devices:
        return False
    required = backend in required_backends.REQUIRED
    return required or not kernel.availability_reasons(torch.device(device))


DEVICE_BACKENDS = [
    pytest.param(
        device,
        backend,
        marks=[pytest.mark.gpu] if device == "cuda" else [],
        id=f"{device}-{'auto' if backend is None else backend}",
    )
    # CUDA cases are collected only where CUDA exists (``gpu`` tests run on the GPU machine).
    for device in (("cpu", "cuda") if torch.cuda.is_available() else ("cpu",))
    for backend in BACKENDS
    if runs_on(backend, device)
]
CPU_BACKENDS = [backend for backend in BACKENDS if runs_on(backend, "cpu")]
#: Backends that JIT-compile a kernel per configuration in each process (FlashAttention-4's CuTe
#: DSL kernels, FlexAttention through torch.compile).
COMPILING = ("flash_attn4", "flex")


def compiling_in_one_worker(params: list[Any], name: str) -> list[Any]:
    """``(device, backend)`` params with a compiling backend's tests of one file put in one
    pytest-xdist worker (``--dist loadgroup``): the first compiles each kernel, the rest reuse
    it, instead of several workers compiling the same kernels at once."""
    return [
        pytest.param(
            *p.values, id=p.id, marks=[*p.marks, pytest.mark.xdist_group(f"{name}-{p.values[1]}")]
        )
        if p.values[1] in COMPILING
        else p
        for p in params
    ]


def backend_id(backend: str | None) -> str:
    return "auto" if backend is None else backend


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def leaves(
    *xs: Tensor, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> list[Tensor]:
    """Fresh leaf copies (requires_grad) of ``xs``, optionally cast and moved."""
    return [
        x.detach().to(device=device, dtype=dtype or x.dtype).clone().requires_grad_() for x in xs
    ]


def to(x: Tensor | None, device: str | torch.device) -> Tensor | None:
    return None if x is None else x.to(device)


def skip_unless_runnable(
    backend: str | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    is_causal: bool,
    key_padding_mask: Tensor | None,
) -> None:
    """Skip (with the backend's own reasons) when an explicit backend cannot run these inputs."""
    if backend is None:
        return
    reasons = backend_reasons(
        q, k, v, is_causal=is_causal, key_padding_mask=key_padding_mask, dropout_p=0.0
    )
    assert set(reasons) == set(list_backends()), "backend_reasons must cover every backend"
    if reasons[backend]:
        pytest.skip(f"{backend}: " + "; ".join(reasons[backend]))
