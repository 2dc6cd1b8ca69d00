"""The backend registry: names, per-device priority, and selection with reasons.

Selection walks the priority list for the device and takes the first backend with no reason to
refuse the inputs. Priorities come from compute capability, never GPU names:

- sm90 / sm100 (Hopper, Blackwell): cuDNN first; on one H100 (torch 2.11, bf16, D=128) it ran at
  600-650 TFLOP/s forward against 350 for SDPA flash (FA2) and 180 for SDPA efficient
  (``shared/anchors.md``).
- sm80 / sm86 / sm89: FA2-class first; cuDNN measured slower there (0.8-1.0x, transformers#48163).
- below sm80: the memory-efficient kernel.
- CPU: PyTorch's flash CPU kernel, then ``math``.
"""

from __future__ import annotations

import torch

from .base import Backend, KernelInputs
from .math import MathBackend
from .sdpa import CpuFlashBackend, SdpaCudnnBackend, SdpaEfficientBackend, SdpaFlashBackend

_BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> None:
    """Add a backend instance under ``backend.name`` (replacing one of the same name)."""
    _BACKENDS[backend.name] = backend


for _backend in (
    MathBackend(),
    CpuFlashBackend(),
    SdpaFlashBackend(),
    SdpaEfficientBackend(),
    SdpaCudnnBackend(),
):
    register_backend(_backend)


def list_backends() -> list[str]:
    """Names of every registered backend, available here or not."""
    return list(_BACKENDS)


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``; ``ValueError`` listing the valid names otherwise."""
    if not isinstance(name, str) or name not in _BACKENDS:
        raise ValueError(
            f"backend must be one of {list_backends()} or None (automatic choice), got {name!r}"
        )
    return _BACKENDS[name]


def priority(device: torch.device) -> list[str]:
    """Backend names in the order they are tried on ``device``."""
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        if major >= 9:
            order = ["sdpa_cudnn", "sdpa_flash", "sdpa_efficient"]
        elif major == 8:
            order = ["sdpa_flash", "sdpa_cudnn", "sdpa_efficient"]
        else:
            order = ["sdpa_efficient"]
    elif device.type == "cpu":
        order = ["cpu_flash"]
    else:
        order = []
    order.append("math")
    return [name for name in order if name in _BACKENDS] + [
        name for name in _BACKENDS if name not in order
    ]


def reasons_for(inputs: KernelInputs) -> dict[str, list[str]]:
    """For every registered backend, why it cannot run ``inputs`` (empty list: it can)."""
    return {name: _BACKENDS[name].not_supported_reasons(inputs) for name in priority(inputs.device)}


def select_backend(inputs: KernelInputs, name: str | None = None) -> Backend:
    """The backend to run ``inputs``: ``name`` if given and able, else the first able by priority.

    Raises:
        ValueError: ``name`` is unknown or cannot run the inputs, or no backend can; the
            message lists every rejected backend with its reasons.
    """
    if name is not None:
        backend = get_backend(name)
        reasons = backend.not_supported_reasons(inputs)
        if reasons:
            raise ValueError(
                f"backend={name!r} cannot run these inputs: {'; '.join(reasons)}. "
                f"Pass backend=None to choose automatically, or one of: "
                f"{[n for n, r in reasons_for(inputs).items() if not r]}"
            )
        return backend
    all_reasons = {}
    for candidate in priority(inputs.device):
        reasons = _BACKENDS[candidate].not_supported_reasons(inputs)
        if not reasons:
            return _BACKENDS[candidate]
        all_reasons[candidate] = reasons
    detail = "; ".join(f"{n}: {', '.join(r)}" for n, r in all_reasons.items())
    raise ValueError(f"no backend can run these inputs ({inputs}). Rejected: {detail}")


def backend_reasons(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    is_causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> dict[str, list[str]]:
    """For every registered backend, why it cannot run attention on these tensors.

    Args:
        query: (B, Nq, H, D).
        key: (B, Nk, Hkv, D).
        value: (B, Nk, Hkv, D).

    Returns:
        ``{name: reasons}``; an empty list means the backend can run these inputs.
    """
    del value
    inputs = KernelInputs.from_tensors(
        query, key, is_causal=is_causal, has_mask=key_padding_mask is not None, dropout_p=dropout_p
    )
    return reasons_for(inputs)
