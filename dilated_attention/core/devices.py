"""Which device a user-facing argument names, checked to exist on this machine (``explain``,
the demo and command line, checkpoints, ``find_max_seq_len``).
"""

from __future__ import annotations

import torch

__all__ = ["default_device", "resolve_device"]


def default_device() -> str:
    """CUDA when available, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _cuda_answers(device: torch.device) -> bool:
    """Whether ``device``'s compute capability can be read although CUDA reports no device: only
    where ``torch.cuda.get_device_capability`` is stubbed (kernel-selection tests that pretend to
    be on a GPU); on a real machine without a GPU it raises and this is False."""
    try:
        torch.cuda.get_device_capability(device)
    except Exception:  # AssertionError (CPU-only build), RuntimeError (no GPU), ...
        return False
    return True


def _accelerator_available(device: torch.device) -> bool | None:
    """Whether ``device``'s type exists here; ``None`` where torch offers no check."""
    device_type = device.type
    if device_type == "cuda":
        return torch.cuda.is_available() or _cuda_answers(device)
    if device_type == "mps":
        return torch.backends.mps.is_available()
    module = getattr(torch, device_type, None)
    is_available = getattr(module, "is_available", None)
    return bool(is_available()) if callable(is_available) else None


def resolve_device(device: object, *, name: str = "device") -> torch.device:
    """``device`` as a ``torch.device``, checked to exist on this machine.

    Args:
        device: a ``torch.device``, a string such as ``"cpu"``, ``"cuda"`` or ``"cuda:1"``, a CUDA
            device index, or ``None`` for CUDA when available, else CPU.
        name: the argument's name, for the error messages.

    Returns:
        The ``torch.device``.

    Raises:
        ValueError: not a device string, or a device this machine does not have (``"cuda"``
            without a GPU or a CUDA build of torch, ``"cuda:3"`` with two GPUs).
        TypeError: ``device`` is not a ``torch.device``, str, int or None.
    """
    if device is None:
        return torch.device(default_device())
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(
            f"{name} must be a torch.device, a string such as 'cpu' or 'cuda:0', a CUDA index or "
            f"None, got {name}={device!r} ({type(device).__name__})"
        )
    if isinstance(device, int):
        device = f"cuda:{device}"
    cli = name.startswith("--")  # a command-line flag: say "--device cpu", not "device='cpu'"
    shown = f"{name} {device}" if cli else f"{name}={device!r}"
    use_cpu = f"{name} cpu" if cli else f"{name}='cpu' (or None: CUDA when available, else CPU)"
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(
            f"{shown} is not a device; use cpu, cuda or cuda:N (N = GPU index)"
            f"{'' if cli else ', or a torch.device'}"
        ) from None
    available = _accelerator_available(dev)
    if available is False:
        if dev.type == "cuda":
            why = (
                f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but finds no "
                f"GPU (check nvidia-smi and CUDA_VISIBLE_DEVICES)"
                if torch.version.cuda
                else f"torch {torch.__version__} is a CPU-only build"
            )
            raise ValueError(
                f"{shown}: no CUDA device is available here: {why}. Use {use_cpu}, or run on a "
                f"machine with an NVIDIA GPU and a CUDA build of torch "
                f"(https://pytorch.org/get-started)"
            )
        raise ValueError(f"{shown}: no {dev.type} device is available here; use {use_cpu}")
    if (
        dev.type == "cuda"
        and dev.index is not None
        and torch.cuda.is_available()
        and dev.index >= torch.cuda.device_count()
    ):
        count = torch.cuda.device_count()
        raise ValueError(
            f"{shown}: this machine has {count} CUDA device(s), indices 0 to {count - 1}; use "
            f"one of those (or cuda for the current one)"
        )
    return dev
