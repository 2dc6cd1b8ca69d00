"""Helpers of the tests that run our Triton kernels: the devices they run on (the GPU; the CPU
through Triton's interpreter when ``TRITON_INTERPRET=1``), NaN-poisoned buffers, and the skip
where Triton cannot run."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import Tensor

from dilated_attention.backends import base, get_backend
from dilated_attention.backends import triton as triton_backend

INTERPRETING = triton_backend.interpreting()
# (device, dtypes): the GPU always, one test per dtype (each compiles its own kernels, so a test
# pays for one dtype's); the CPU through Triton's interpreter when it is switched on.
KERNEL_DEVICES = [
    pytest.param("cuda", [dtype], marks=pytest.mark.gpu, id=f"cuda-{name}")
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16"))
]
if INTERPRETING:
    KERNEL_DEVICES.append(pytest.param("cpu", [torch.float32, torch.float16], id="cpu-interpret"))


def poison_new_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every floating-point ``torch.empty`` / ``torch.empty_like`` buffer starts NaN-filled, so
    a row read before it is written shows."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poisoned(x: Tensor) -> Tensor:
        return x.fill_(float("nan")) if x.is_floating_point() else x

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poisoned(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poisoned(real_empty_like(*a, **kw)))


#: Appended to the skip reason where the ``triton`` package is missing: CUDA builds of PyTorch
#: ship it, CPU wheels do not.
INSTALL_TRITON = "pip install triton to run these tests (on a CPU with TRITON_INTERPRET=1)"


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def require_triton() -> None:
    """Skip, saying how to install it, where the ``triton`` package is missing."""
    if not triton_installed():
        pytest.skip(f"triton is not installed: {INSTALL_TRITON}")


def skip_without_triton(device: str) -> None:
    """Skip where our Triton kernels cannot run on ``device``, with the backend's reasons (and
    how to install Triton where it is missing)."""
    require_triton()
    reasons = get_backend("triton").not_supported_reasons(
        base.KernelInputs(
            device=torch.device(device),
            dtype=torch.float16,
            head_dim=64,
            num_heads=2,
            num_kv_heads=2,
            query_len=8,
            key_len=8,
        )
    )
    if reasons:
        pytest.skip("triton: " + "; ".join(reasons))
