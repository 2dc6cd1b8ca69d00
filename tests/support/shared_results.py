"""Oracle results computed once per process and shared by every test that compares with them.

A GPU suite checks several kernels (and dtypes of the kernel's own arithmetic) against the same
float64 oracle of the same inputs; recomputing that dense oracle per test cost seconds each (an
(B, H, N, N) float64 softmax and its backward at N = 1024). :func:`shared_result` memoises a
function of hashable arguments (a case's name, a dtype, a flag) whose result is a tensor or a
tuple / list of them: results are kept detached (no autograd graph held), and every call returns
fresh clones, so a test that writes into what it got cannot change what the next test sees.

Under pytest-xdist each worker process has its own cache; tests that share a result share it
only when they run in one worker (``--dist loadgroup`` with the ``xdist_group`` marks the GPU
suites put on such tests; docs/architecture.md "Tests").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from torch import Tensor

__all__ = ["detached", "fresh", "shared_result"]

F = TypeVar("F", bound=Callable[..., Any])

#: Results kept per memoised function (the oldest go first): enough for every case of a file.
MAX_KEPT = 32


def detached(result: Any) -> Any:
    """``result`` with every tensor detached (tuples and lists rebuilt, anything else kept)."""
    if isinstance(result, Tensor):
        return result.detach()
    if isinstance(result, (tuple, list)):
        return type(result)(detached(x) for x in result)
    return result


def fresh(result: Any) -> Any:
    """A copy of ``result`` in which every tensor is a clone (tuples and lists rebuilt)."""
    if isinstance(result, Tensor):
        return result.clone()
    if isinstance(result, (tuple, list)):
        return type(result)(fresh(x) for x in result)
    return result


def shared_result(fn: F) -> F:
    """Memoise ``fn`` (hashable positional or keyword arguments) per process; each call returns
    clones of the kept, detached result. ``wrapper.cache_info()`` / ``cache_clear()`` as
    ``functools.lru_cache``."""
    kept = functools.lru_cache(maxsize=MAX_KEPT)(lambda *a, **kw: detached(fn(*a, **kw)))

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fresh(kept(*args, **kwargs))

    wrapper.cache_info = kept.cache_info  # type: ignore[attr-defined]
    wrapper.cache_clear = kept.cache_clear  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]
