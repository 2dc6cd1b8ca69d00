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

Note [Bound launches]
    Keying a launch by its ~50 arguments still costs host time on every launch, and so does
    everything that computes those arguments (tiles, strides, descriptors, offsets). A call
    site that knows what determines its launches (its tensors' shapes, strides, dtypes and
    16-byte alignment, and its own options) keys them once: the first call of a site key runs
    as usual while :func:`binding` records each launch's compiled kernel, grid and arguments,
    with every tensor argument replaced by the *role* it was (which of the site's tensors, or a
    view of it at the same address); a later call of that key only puts its own tensors in
    those roles and launches (:func:`replay`): the plan/run split of flashinfer, per site.
    A launch whose tensor argument is none of the site's tensors (and not a constant the site
    keeps alive, such as a segment table), or is two of them at once, is not bound: that site
    key keeps running as usual.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from triton import knobs
from triton.runtime import driver

__all__ = [
    "Binding", "binding", "clear_bound", "launch", "launch_recorded", "replay", "run_site",
    "site_key",
]  # fmt: skip

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


#: What :func:`launch` returns where it knows the compiled kernel: it and the constexprs'
#: values that follow the leading arguments.
Compiled = tuple[Any, tuple[Any, ...]]


def launch(
    kernel: Any, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Compiled | None:
    """``kernel[grid](*args, **kwargs)``, through the compiled kernel's launcher when an
    earlier launch had the same key (Note [Launches without the JIT's dispatch]).

    Args:
        kernel: a ``triton.jit`` function; ``args`` its leading parameters, ``kwargs`` the rest
            (constexprs) and the launch options (``num_warps``, ``num_stages``).

    Returns:
        The compiled kernel and its constexprs' values, or None where the JIT launched it
        (interpreted, hooked, or nothing to key).
    """
    if _hooked() or not hasattr(kernel, "device_caches"):  # a profiler's hook, or interpreted
        kernel[grid](*args, **kwargs)
        return None
    if _constexpr_among(kernel, len(args)):  # a constexpr passed by position: keyed by type
        kernel[grid](*args, **kwargs)
        return None
    device = driver.active.get_current_device()
    try:
        values = tuple([x if type(x) in _BY_VALUE else _value_key(x) for x in args])
        key = (kernel, grid, device, values, tuple(kwargs.items()))
        known = _COMPILED.get(key)
    except TypeError:  # an unhashable argument: nothing to keep
        kernel[grid](*args, **kwargs)
        return None
    if known is None:
        compiled = kernel[grid](*args, **kwargs)
        if hasattr(compiled, "result"):
            compiled = compiled.result()
        if compiled is None:
            return None
        names = kernel.arg_names[len(args) :]
        defaults = {p.name: p.default for p in kernel.params}
        constants = tuple(kwargs.get(name, defaults[name]) for name in names)
        if len(_COMPILED) >= COMPILED_LIMIT:
            del _COMPILED[next(iter(_COMPILED))]
        known = _COMPILED[key] = (compiled, constants)
        return known
    compiled, constants = known
    stream = driver.active.get_current_stream(device)
    compiled.run(
        *_grid3(grid), stream, compiled.function, compiled.packed_metadata, None, None, None,
        *args, *constants,
    )  # fmt: skip
    return known


def _grid3(grid: tuple[int, ...]) -> tuple[int, int, int]:
    return (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)


# -- bound launches (Note [Bound launches]) ------------------------------------------------------
class _Descriptor(NamedTuple):
    """What the launcher reads of a host tensor descriptor, with the base put in at replay."""

    base: Any
    shape: list[int]
    strides: list[int]
    block_shape: list[int]
    padding: str


@dataclass(frozen=True)
class _Bound:
    """One launch of a site with its tensors as roles: ``tensors`` (argument index, role) and
    ``descriptors`` (argument index, role, the descriptor with its base left out)."""

    compiled: Any
    grid: tuple[int, int, int]
    device: int
    args: tuple[Any, ...]
    tensors: tuple[tuple[int, int], ...]
    descriptors: tuple[tuple[int, int, _Descriptor], ...]
    constants: tuple[Any, ...]

    def __call__(self, roles: Sequence[Any]) -> None:
        args = list(self.args)
        for index, role in self.tensors:
            args[index] = roles[role]
        for index, role, descriptor in self.descriptors:
            args[index] = descriptor._replace(base=roles[role])
        compiled = self.compiled
        compiled.run(
            *self.grid, driver.active.get_current_stream(self.device), compiled.function,
            compiled.packed_metadata, None, None, None, *args, *self.constants,
        )  # fmt: skip


def _role(x: torch.Tensor, roles: Sequence[Any]) -> int | None:
    """Which role ``x`` is: the role itself, or else the one role at its address."""
    for i, role in enumerate(roles):
        if x is role:
            return i
    ptr = x.data_ptr()
    found = [i for i, role in enumerate(roles) if role is not None and role.data_ptr() == ptr]
    return found[0] if len(found) == 1 else None


class Binding:
    """The launches of one site key being recorded (:func:`binding`)."""

    def __init__(self, roles: Sequence[Any], constants: Sequence[torch.Tensor]) -> None:
        self.roles = roles
        self.constants = constants
        self.bound: list[_Bound] | None = []
        pointers = [r.data_ptr() for r in roles if r is not None]
        if len(set(pointers)) < len(pointers):  # two roles at one address: ambiguous
            self.bound = None

    def add(self, compiled: Compiled | None, grid: tuple[int, ...], args: tuple[Any, ...]) -> None:
        """Record one launch, or give the site key up (Note [Bound launches])."""
        if self.bound is None:
            return
        if compiled is None:
            self.bound = None
            return
        template, tensors, descriptors = list(args), [], []
        for index, arg in enumerate(args):
            base = getattr(arg, "base", None) if hasattr(arg, "block_shape") else None
            x = base if isinstance(base, torch.Tensor) else arg
            if not isinstance(x, torch.Tensor) or any(x is c for c in self.constants):
                continue
            role = _role(x, self.roles)
            if role is None:
                self.bound = None
                return
            template[index] = None
            if x is arg:
                tensors.append((index, role))
            else:
                fields = (list(arg.shape), list(arg.strides), list(arg.block_shape), arg.padding)
                descriptors.append((index, role, _Descriptor(None, *fields)))
        device = driver.active.get_current_device()
        self.bound.append(_Bound(
            compiled[0], _grid3(grid), device, tuple(template), tuple(tensors),
            tuple(descriptors), compiled[1],
        ))  # fmt: skip


#: site key -> its bound launches.
_BOUND: dict[tuple[Any, ...], tuple[_Bound, ...]] = {}
_BINDING: contextvars.ContextVar[Binding | None] = contextvars.ContextVar(
    "dilated_attention_triton_binding", default=None
)


def current_binding() -> Binding | None:
    """The :class:`Binding` recording launches now, if any."""
    return _BINDING.get()


def site_key(name: str, tensors: Sequence[torch.Tensor | None], *values: Any) -> tuple[Any, ...]:
    """A site's key: its name, each tensor's shape, strides, dtype and 16-byte alignment, the
    first tensor's device, and the site's other ``values`` (hashable)."""
    layouts = tuple(
        None if x is None else (x.shape, x.stride(), x.dtype, x.data_ptr() % 16 == 0)
        for x in tensors
    )
    first = tensors[0]
    return (name, layouts, None if first is None else first.get_device(), values)


def replay(site: tuple[Any, ...], roles: Sequence[Any]) -> bool:
    """Run ``site``'s bound launches with ``roles`` in their roles; False where it has none (or
    a launch hook is installed: then every launch goes through the JIT)."""
    bound = _BOUND.get(site)
    if bound is None or _hooked():
        return False
    for one in bound:
        one(roles)
    return True


@contextlib.contextmanager
def binding(
    site: tuple[Any, ...], roles: Sequence[Any], constants: Sequence[torch.Tensor] = ()
) -> Iterator[None]:
    """Record the launches made inside as ``site``'s (Note [Bound launches]); ``constants``:
    tensors the launches may take that outlive the key (kept by the bound launches)."""
    record = Binding(roles, constants)
    token = _BINDING.set(record)
    try:
        yield
    finally:
        _BINDING.reset(token)
    if record.bound:
        if len(_BOUND) >= COMPILED_LIMIT:
            del _BOUND[next(iter(_BOUND))]
        _BOUND[site] = tuple(record.bound)


def launch_recorded(
    kernel: Any, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """:func:`launch`, recorded into the :func:`binding` being made, if any."""
    compiled = launch(kernel, grid, args, kwargs)
    record = _BINDING.get()
    if record is not None:
        record.add(compiled, grid, args)


def run_site(
    site: tuple[Any, ...],
    roles: Sequence[Any],
    body: Callable[[], None],
    constants: Sequence[torch.Tensor] = (),
) -> None:
    """The launches ``body`` makes (through :func:`launch_recorded`), or where ``site`` ran
    before, their bound copies with ``roles`` in their roles (Note [Bound launches])."""
    if replay(site, roles):
        return
    with binding(site, roles, constants):
        body()


def clear_bound() -> None:
    """Forget every bound launch (tests that change module settings between calls)."""
    _BOUND.clear()
