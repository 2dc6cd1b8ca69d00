"""Helpers shared by the optional-package backends (flash-attn 2/3/4, xformers): import-failure
reasons, calling private functions by keyword across signature changes, and stride fixes.

See Note [flash-attn 2 private signatures] in ``flash_attn2.py`` for why calls bind by name.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from .base import KernelInputs

_HALF = frozenset({torch.float16, torch.bfloat16})
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _import_failure(package: str, exc: BaseException) -> str:
    """A one-line reason for a failed import (any exception, not only ``ImportError``)."""
    first_line = (str(exc).strip().splitlines() or [""])[0][:200]
    return f"{package} import failed: {type(exc).__name__}: {first_line}"


def _release(version: str) -> tuple[int, ...]:
    """``(major, minor)`` of a package version string such as ``"3.6.0+git1234"``."""
    return tuple(int(part) for part in version.split(".")[:2] if part.isdigit())


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


@functools.lru_cache(maxsize=256)
def _parameters(func: Any) -> dict[str, str]:
    """Parameter names of ``func``, each mapped to ``"default"``, ``"optional"`` or ``"required"``
    (cached: reading a signature cost FlashAttention-4's calls ~85 us each; do not mutate).

    Reads a Python function's signature; for a ``torch.library.custom_op`` (a ``CustomOpDef``,
    whose ``__call__`` is ``(*args, **kwargs)``) the wrapped function's, ``func._init_fn``; for a
    ``torch.ops`` op, its schema, where an argument of ``Optional`` type without a default is
    ``"optional"`` (``None`` is a valid value).

    Raises:
        RuntimeError: none of these can be read.
    """
    target = getattr(func, "_init_fn", func)
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        params = None
    if params is not None and not any(p.kind in _VARIADIC for p in params):
        return {
            p.name: "required" if p.default is inspect.Parameter.empty else "default"
            for p in params
        }
    schema = getattr(getattr(func, "default", func), "_schema", None)
    if schema is not None:
        kinds = {}
        for arg in schema.arguments:
            if arg.has_default_value():
                kinds[arg.name] = "default"
            elif isinstance(arg.type, torch.OptionalType):
                kinds[arg.name] = "optional"
            else:
                kinds[arg.name] = "required"
        return kinds
    raise RuntimeError(f"cannot read the parameters of {func!r}")


def _bind(
    func: Any,
    values: dict[str, Any],
    *,
    fill: dict[str, Any] | None = None,
    none_for_unknown: bool = False,
) -> dict[str, Any]:
    """Keyword arguments for ``func`` from ``values``, by the names ``func`` actually has.

    ``values`` may name parameters that only some versions have (``window_size`` and
    ``window_size_left``): only the names ``func`` has are passed. A parameter without a default
    that ``values`` does not give takes ``fill[name]``, else ``None`` when its type is optional
    (or ``none_for_unknown``); anything else is an error, raised before any kernel runs.

    Raises:
        TypeError: a required parameter nobody knows how to fill.
    """
    kwargs: dict[str, Any] = {}
    for name, kind in _parameters(func).items():
        if name in values:
            kwargs[name] = values[name]
        elif kind == "default":
            continue
        elif fill is not None and name in fill:
            kwargs[name] = fill[name]
        elif kind == "optional" or none_for_unknown:
            kwargs[name] = None
        else:
            raise TypeError(f"{func!r} needs argument {name!r}, which this backend cannot fill")
    return kwargs


def _grads_from(
    res: Any, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` from a backward that returns them, or the buffers it wrote in place."""
    if isinstance(res, (tuple, list)) and len(res) >= 3:
        grads = tuple(res[:3])
        shapes = (dq.shape, dk.shape, dv.shape)
        if all(
            isinstance(g, torch.Tensor) and g.shape == s for g, s in zip(grads, shapes, strict=True)
        ):
            return grads[0], grads[1], grads[2]
    return dq, dk, dv


def _capability(inputs: KernelInputs) -> tuple[int, int] | None:
    if inputs.device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(inputs.device)
    return major, minor
