"""The backend registry: names, per-device priority, and selection with reasons.

Selection walks the priority list for the device (by compute capability, never GPU names; the
measurements behind it sit next to ``_CUDA_PRIORITY``) and takes the first backend with no reason to
refuse the inputs. ``choose`` also records why each other backend was not taken. A backend whose
``verified_on_hardware`` is false (its kernel has not run in this project's GPU tests: flash-attn
2/3 and xformers, tested against fakes of their packages) is taken only by name.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from .. import _validation as V
from .base import Backend, KernelInputs
from .flash_attn2 import FlashAttn2Backend
from .flash_attn3 import FlashAttn3Backend
from .flash_attn4 import FlashAttn4Backend
from .flex import FlexBackend
from .math import MathBackend
from .sdpa import CpuFlashBackend, SdpaCudnnBackend, SdpaEfficientBackend, SdpaFlashBackend
from .triton import TritonBackend
from .xformers import XformersBackend

ENV_VAR = "DILATED_ATTENTION_BACKEND"
#: The name that means "choose automatically", accepted wherever ``None`` is.
AUTO = "auto"

# Tried in this order; the first backend with no reason to refuse the inputs wins. Keys are compute
# capability majors. sm90/sm100: FlashAttention-3/4 when installed (FA3: 740 TFLOP/s fwd published
# on H100), then cuDNN (600-650 fwd / 540-570 fwd+bwd measured on our H100, bf16, D=128), then FA2
# (flash-attn package, then PyTorch's copy: 350 / 315), then the memory-efficient kernel (180/150).
# sm80-89: FA2-class first; cuDNN measured 0.8-1.0x of FA2 there (transformers#48163). sm75: the
# memory-efficient kernel or xformers. Older GPUs, CPU and other devices: what runs, then math.
# FlexAttention compiles per shape (seconds), so it is never chosen for dense attention
# automatically; it runs block-sparse masks and whenever asked for by name.
_CUDA_PRIORITY: dict[int, list[str]] = {
    10: [
        "flash_attn4",
        "sdpa_cudnn",
        "flash_attn2",
        "sdpa_flash",
        "sdpa_efficient",
        "triton",
        "math",
    ],
    9: [
        "flash_attn3",
        "flash_attn4",
        "sdpa_cudnn",
        "flash_attn2",
        "sdpa_flash",
        "sdpa_efficient",
        "triton",
        "math",
    ],
    8: ["flash_attn2", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "xformers", "triton", "math"],
    7: ["sdpa_efficient", "xformers", "math"],
}
_HOST_PRIORITY = ["cpu_flash", "math"]
# Dilated calls: our Triton kernels (no gathers, branches merged in place) ahead of gather + the
# dense kernel where benchmarks/bench_dilated.py measured them faster (H100, bf16, LongNet
# schedule, N = 64K and 1M, 64a341b; benchmarks/results/dilated_gather_h100.json): D = 64 forward
# 1.9-2.7x / forward+backward 1.3-2.0x; D = 128 forward 2.0-2.9x, forward+backward 1.4-1.8x with
# the backward tiles of benchmarks/results/tune_triton_h100.json. The fused kernels' latest run
# is benchmarks/results/dilated_h100.json. Training with head dims above 128 has not been
# measured and keeps gather + the dense kernel.
_CUDA_DILATED_FIRST: dict[int, list[str]] = {9: ["triton"]}
# Key padding masks: cuDNN and FlashAttention take none, so 16-bit masked calls would fall to the
# memory-efficient kernel. Our Triton kernels take masks and measured 2.5-3.3x its speed on the
# H100 (benchmarks/results/kernels_masked_h100.md: bf16, the last 1/8 of the keys masked,
# N = 4K-64K, D = 64 and 128, forward+backward 258-340 against 90-132 TFLOP/s). float32 and
# other devices have not been measured and keep the list's order.
_CUDA_MASKED_FIRST: dict[int, list[str]] = {9: ["triton"]}
_FUSED_MAX_TRAINING_HEAD_DIM = 128


def _unverified_reason(name: str) -> str:
    return (
        f"never chosen automatically: not yet run on real hardware in this project's GPU tests; "
        f"available by name (backend={name!r})"
    )


def _automatic_reasons(name: str, inputs: KernelInputs) -> list[str]:
    """Why the automatic choice does not take ``name`` for ``inputs`` (empty: it may): what the
    backend cannot run, and whether it was never verified on hardware."""
    backend = _BACKENDS[name]
    reasons = backend.not_supported_reasons(inputs)
    if not backend.verified_on_hardware:
        reasons = [*reasons, _unverified_reason(name)]
    return reasons


def _order(inputs: KernelInputs) -> list[str]:
    """The priority walked for ``inputs``: dilated calls (see _CUDA_DILATED_FIRST) and 16-bit calls
    with a key padding mask (see _CUDA_MASKED_FIRST) try our Triton kernels first, unless they
    train with a head dim above ``_FUSED_MAX_TRAINING_HEAD_DIM``."""
    tiles_measured = not inputs.requires_grad or inputs.head_dim <= _FUSED_MAX_TRAINING_HEAD_DIM
    masked_16bit = inputs.has_mask and inputs.dtype in (torch.float16, torch.bfloat16)
    return priority(
        inputs.device,
        dilated=inputs.dilated and tiles_measured,
        masked=masked_16bit and tiles_measured,
    )


_BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> None:
    """Add a backend instance under ``backend.name`` (replacing one of the same name).

    Raises:
        TypeError: ``backend`` is not an instance of ``dilated_attention.backends.base.Backend``.
        ValueError: its ``name`` is not a non-empty string, or is ``"auto"`` (reserved for the
            automatic choice).
    """
    if not isinstance(backend, Backend):
        what = "a class" if isinstance(backend, type) else type(backend).__name__
        raise TypeError(
            f"backend must be an instance of dilated_attention.backends.base.Backend, got "
            f"{backend!r} ({what}); subclass Backend, set its name, and pass an instance, e.g. "
            f"register_backend(MyBackend())"
        )
    name = getattr(backend, "name", None)
    if not isinstance(name, str) or not name.strip() or name == AUTO:
        raise ValueError(
            f"backend.name must be a non-empty string other than {AUTO!r} (which means the "
            f"automatic choice), got name={name!r} on {type(backend).__name__}; set the class "
            f"attribute name = 'my_kernel'"
        )
    _BACKENDS[name] = backend


for _backend in (
    MathBackend(),
    CpuFlashBackend(),
    SdpaFlashBackend(),
    SdpaEfficientBackend(),
    SdpaCudnnBackend(),
    FlashAttn2Backend(),
    FlashAttn3Backend(),
    FlashAttn4Backend(),
    XformersBackend(),
    FlexBackend(),
    TritonBackend(),
):
    register_backend(_backend)


def list_backends() -> list[str]:
    """Names of every registered backend, available here or not."""
    return list(_BACKENDS)


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``; ``ValueError`` listing the valid names otherwise."""
    if not isinstance(name, str) or name not in _BACKENDS:
        raise ValueError(
            f"backend must be one of {list_backends()}, {AUTO!r} or None (automatic choice), got "
            f"{name!r}"
        )
    return _BACKENDS[name]


def check_backend_name(backend: object, *, argument: str = "backend") -> str | None:
    """The one check of a ``backend=`` argument: a registered name, or the automatic choice.

    Every public function and module that takes a backend name calls this (and the selection in
    :func:`choose` resolves names through it), so ``"auto"`` means ``None`` everywhere.

    Args:
        backend: a name from :func:`list_backends`, ``"auto"`` or ``None``.
        argument: how the argument is named in the error message.

    Returns:
        The name, or ``None`` for ``None`` and ``"auto"``.

    Raises:
        TypeError: not a string or None.
        ValueError: a string that names no registered backend (the message lists them).
    """
    if backend is None:
        return None
    if not isinstance(backend, str):
        raise TypeError(
            f"{argument} must be a backend name (one of {list_backends()}), {AUTO!r} or None "
            f"(automatic choice), got {backend!r} ({type(backend).__name__})"
        )
    if backend == AUTO:
        return None
    if backend not in _BACKENDS:
        raise ValueError(
            f"{argument} must be one of {list_backends()}, {AUTO!r} or None (automatic choice), "
            f"got {backend!r}"
        )
    return backend


def priority(device: torch.device, *, dilated: bool = False, masked: bool = False) -> list[str]:
    """Backend names in the order they are tried on ``device`` (see the module docstring);
    ``dilated`` / ``masked`` put the backends measured faster on that device for dilated calls /
    calls with a key padding mask first."""
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        order = _CUDA_PRIORITY.get(major, _CUDA_PRIORITY[8] if major > 10 else _CUDA_PRIORITY[7])
        first = _CUDA_DILATED_FIRST.get(major, []) if dilated else []
        if masked:
            first = first + [n for n in _CUDA_MASKED_FIRST.get(major, []) if n not in first]
        order = first + [name for name in order if name not in first]
    else:
        order = _HOST_PRIORITY
    known = [name for name in order if name in _BACKENDS]
    return known + [name for name in _BACKENDS if name not in known]


@dataclass(frozen=True)
class BackendChoice:
    """The kernel chosen for some inputs, and why every other kernel was not.

    Attributes:
        backend: the chosen backend's name.
        reasons: for every other registered backend, at least one reason it was not chosen (it
            cannot run the inputs, or it can but ranks lower).
        order: the priority order that was walked.
        source: what decided: ``"auto"``, ``"argument"``, ``"use_backend"`` or ``"environment"``.
    """

    backend: str
    reasons: dict[str, list[str]]
    order: list[str]
    source: str


_OVERRIDE: ContextVar[str | None] = ContextVar("dilated_attention_backend", default=None)


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Run every attention call inside the block on backend ``name`` (``None`` or ``"auto"``:
    automatic).

    An explicit ``backend=`` argument still wins. Raises ``ValueError`` for an unknown name,
    ``TypeError`` for a name that is not a string.
    """
    token = _OVERRIDE.set(check_backend_name(name, argument="use_backend(name)"))
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


def _requested(name: str | None) -> tuple[str | None, str]:
    name = check_backend_name(name)
    if name is not None:
        return name, "argument"
    override = _OVERRIDE.get()
    if override is not None:
        return override, "use_backend"
    env = os.environ.get(ENV_VAR, "").strip()
    if env and env != AUTO:
        if env not in _BACKENDS:
            raise ValueError(
                f"environment variable {ENV_VAR}={env!r} names no backend; valid names: "
                f"{list_backends()} (or unset it / set it to 'auto')"
            )
        return env, "environment"
    return None, "auto"


def choose(inputs: KernelInputs, name: str | None = None) -> BackendChoice:
    """Choose a backend for ``inputs`` and record why every other one was not chosen.

    Precedence: the ``name`` argument, then :func:`use_backend`, then the environment variable
    ``DILATED_ATTENTION_BACKEND``, then the priority list for the device.

    Raises:
        ValueError: a requested backend is unknown or cannot run the inputs, or none can; the
            message lists every rejected backend with its reasons.
    """
    requested, source = _requested(name)
    order = _order(inputs)
    if requested is not None:
        get_backend(requested)
        reasons = {c: _BACKENDS[c].not_supported_reasons(inputs) for c in order}
        if reasons[requested]:
            able = [n for n, r in reasons.items() if not r]
            raise ValueError(
                f"backend {requested!r} (from {source}) cannot run these inputs: "
                f"{'; '.join(reasons[requested])}. Backends that can: {able}; or let the library "
                f"choose (backend=None)"
            )
        chosen = requested
    else:
        reasons = {c: _automatic_reasons(c, inputs) for c in order}
        chosen = next((n for n in order if not reasons[n]), None)
        if chosen is None:
            detail = "; ".join(f"{n}: {', '.join(r)}" for n, r in reasons.items())
            raise ValueError(f"no backend can run these inputs ({inputs}). Rejected: {detail}")
    why_not = {}
    for candidate in order:
        if candidate == chosen:
            continue
        why_not[candidate] = reasons[candidate] or (
            [f"{chosen!r} was requested ({source})"]
            if requested is not None
            else [f"able, but ranks after {chosen!r} on this device"]
        )
    return BackendChoice(backend=chosen, reasons=why_not, order=order, source=source)


def select_backend(inputs: KernelInputs, name: str | None = None) -> Backend:
    """The backend instance :func:`choose` picks for ``inputs``, probing only as far as needed.

    The same choice as :func:`choose`, which probes every backend to say why each one is not
    chosen; this stops at the requested backend or at the first one of the priority list that
    can run the inputs, so the backends ranked after it are never imported or launched (a
    FlexAttention probe alone imports TorchInductor: seconds of a first call on a GPU). When none
    can, :func:`choose` raises its error with every backend's reasons.
    """
    requested, _ = _requested(name)
    if requested is not None:
        if not get_backend(requested).not_supported_reasons(inputs):
            return _BACKENDS[requested]
    else:
        for candidate in _order(inputs):
            backend = _BACKENDS[candidate]  # an unverified backend is not even probed
            if backend.verified_on_hardware and not backend.not_supported_reasons(inputs):
                return backend
    return _BACKENDS[choose(inputs, name).backend]


def reasons_for(inputs: KernelInputs) -> dict[str, list[str]]:
    """For every registered backend, why it cannot run ``inputs`` (empty list: it can)."""
    order = _order(inputs)
    return {name: _BACKENDS[name].not_supported_reasons(inputs) for name in order}


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

    Raises:
        ValueError / TypeError: malformed tensors, mask, flag or ``dropout_p``, as in
            :func:`dilated_attention.attention`.
    """
    q, k, _ = V.check_qkv(query, key, value, same_length=False)
    V.check_bool("is_causal", is_causal)
    V.check_key_padding_mask(key_padding_mask, k.shape[0], k.shape[1], q.device)
    dropout_p = V.check_dropout("dropout_p", dropout_p)
    inputs = KernelInputs.from_tensors(
        q, k, is_causal=is_causal, has_mask=key_padding_mask is not None, dropout_p=dropout_p
    )
    return reasons_for(inputs)
