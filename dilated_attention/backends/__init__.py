"""Kernel backends: one file per kernel family, and the registry that chooses among them."""

from .base import Backend, KernelInputs, KernelOutput
from .registry import (
    backend_reasons,
    get_backend,
    list_backends,
    priority,
    reasons_for,
    register_backend,
    select_backend,
)

__all__ = [
    "Backend",
    "KernelInputs",
    "KernelOutput",
    "backend_reasons",
    "get_backend",
    "list_backends",
    "priority",
    "reasons_for",
    "register_backend",
    "select_backend",
]
