"""Launching our Triton kernels with the compiled kernel looked up by the arguments' values.

Note [Launches without the JIT's dispatch]
    ``kernel[grid](*args)`` binds every argument, computes Triton's specialization key (each
    pointer's 16-byte alignment, each integer's width and divisibility by 16), looks the
    compiled kernel up and launches it: about 50 us of host time per launch of our forward
    kernel (50 arguments) on the lent H100's host, against 10 us through the compiled kernel's
    own launcher. A forward+backward of a dilated call makes
    7 to 150 launches, which at 4K-64K tokens cost more host time than the GPU's work.

    So :func:`launch` keeps, per kernel, the compiled kernel under a key of its own that
    determines Triton's specialization and more: every tensor's dtype and 16-byte alignment,
    every integer's width class and whether it is 1 or divisible by 16, every float's type,
    a tensor descriptor's dtype, alignment, shape, strides and block, the constexpr and launch
    options by value, the grid and the device. Two launches with equal keys compile to the
    same kernel, so a known key launches through the compiled kernel's launcher directly.
    The first launch of a key goes through ``kernel[grid]`` (which compiles where needed) and
    returns the compiled kernel to keep. Under Triton's interpreter, or while a launch hook
    is installed (a profiler's), every launch goes through ``kernel[grid]``.
"""

from __future__ import annotations

from typing import Any

import torch
from triton import knobs
from triton.runtime import driver

__all__ = ["launch"]

#: (kernel, grid, device, argument key, options) -> (compiled kernel, constexpr values).
_COMPILED: dict[tuple[Any, ...], tuple[Any, tuple[Any, ...]]] = {}
#: Keys kept at most; the oldest is dropped first.
COMPILED_LIMIT = 4096
#: Arguments kept in the key by value: more than Triton specializes on, and cheaper to take.
_BY_VALUE = frozenset({int, float, bool, type(None), str})


def _value_key(x: Any) -> Any:
    """What of one argument (other than the :data:`_BY_VALUE` types) decides Triton's
    specialization, or more of it."""
    if isinstance(x, torch.Tensor):
        return (x.dtype, x.data_ptr() % 16 == 0)
    base = getattr(x, "base", None)  # a host tensor descriptor
    if isinstance(base, torch.Tensor):
        return (
            base.dtype, base.data_ptr() % 16 == 0, tuple(x.shape), tuple(x.strides),
            tuple(x.block_shape), x.padding,
        )  # fmt: skip
    return x  # anything else by value (hashable, or the key raises and the JIT launches)


def _hooked() -> bool:
    """Whether a launch hook is installed (Triton >= 3.5 keeps them in chains, empty when
    none is; earlier versions hold None)."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(hook is not None and getattr(hook, "calls", True) for hook in hooks)


#: kernel -> how many leading parameters are not constexprs.
_LEADING: dict[Any, int] = {}


def _constexpr_among(kernel: Any, count: int) -> bool:
    """Whether one of ``kernel``'s first ``count`` parameters is a constexpr."""
    leading = _LEADING.get(kernel)
    if leading is None:
        flags = [p.is_constexpr for p in kernel.params] + [True]
        leading = _LEADING[kernel] = flags.index(True)
    return count > leading


def launch(
    kernel: Any, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """``kernel[grid](*args, **kwargs)``, through the compiled kernel's launcher when an
    earlier launch had the same key (Note [Launches without the JIT's dispatch]).

    Args:
        kernel: a ``triton.jit`` function; ``args`` its leading parameters, ``kwargs`` the rest
            (constexprs) and the launch options (``num_warps``, ``num_stages``).
    """
    if _hooked() or not hasattr(kernel, "device_caches"):  # a profiler's hook, or interpreted
        kernel[grid](*args, **kwargs)
        return
    if _constexpr_among(kernel, len(args)):  # a constexpr passed by position: keyed by type
        kernel[grid](*args, **kwargs)
        return
    device = driver.active.get_current_device()
    try:
        values = tuple([x if type(x) in _BY_VALUE else _value_key(x) for x in args])
        key = (kernel, grid, device, values, tuple(kwargs.items()))
        known = _COMPILED.get(key)
    except TypeError:  # an unhashable argument: nothing to keep
        kernel[grid](*args, **kwargs)
        return
    if known is None:
        compiled = kernel[grid](*args, **kwargs)
        if hasattr(compiled, "result"):
            compiled = compiled.result()
        if compiled is not None:
            names = kernel.arg_names[len(args) :]
            defaults = {p.name: p.default for p in kernel.params}
            constants = tuple(kwargs.get(name, defaults[name]) for name in names)
            if len(_COMPILED) >= COMPILED_LIMIT:
                del _COMPILED[next(iter(_COMPILED))]
            _COMPILED[key] = (compiled, constants)
        return
    compiled, constants = known
    stream = driver.active.get_current_stream(device)
    compiled.run(
        grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
        compiled.function, compiled.packed_metadata, None, None, None, *args, *constants,
    )  # fmt: skip
