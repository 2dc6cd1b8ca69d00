"""Block-sparse patterns as int keys, so that a pattern can cross a custom operator's boundary.

Note [Patterns as operator arguments]
    A pattern is a Python object, and operators take tensors and scalars. :func:`pattern_key`
    gives each pattern an int key in a process-wide table (equal patterns share one; a ``Custom``
    pattern compares by identity), and the operator looks the pattern up when it runs, so the
    eager caches (plans, masks, FlexAttention block masks) keep working. Dynamo computes the key
    while tracing (``torch._dynamo.assume_constant_result``: a constant in the graph). A pattern
    object from outside the compiled code is passed as it is, guarded on its identity (another
    object recompiles); one built inside it reaches that function as a placeholder whose fields
    only Dynamo knows, so it is described by its class and field values (read in traced code:
    constants) and rebuilt from them (:func:`_describe`, :func:`_rebuild`). A ``Custom`` pattern
    holds a tensor and must come from outside. The table keeps every pattern that reached an
    operator for the life of the process (compiled graphs refer to them by key).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import torch

from .patterns import Custom, Pattern

__all__ = ["pattern_key", "pattern_of"]

_PATTERNS: list[Pattern] = []
_PATTERN_KEYS: dict[Pattern, int] = {}
_PATTERN_LOCK = threading.Lock()
#: Tags a nested pattern's description, and a pattern known by its key, in a description.
_NESTED, _KEYED = "dilated_attention.pattern", "dilated_attention.pattern_key"


def _constant_when_traced(fn: Callable[..., Any]) -> Callable[..., Any]:
    mark = getattr(torch._dynamo, "assume_constant_result", None)
    return mark(fn) if mark is not None else fn


def _register(pattern: Pattern) -> int:
    with _PATTERN_LOCK:
        key = _PATTERN_KEYS.get(pattern)
        if key is None:
            key = len(_PATTERNS)
            _PATTERNS.append(pattern)
            _PATTERN_KEYS[pattern] = key
        return key


@_constant_when_traced
def _object_key(pattern: Pattern) -> int:
    """``pattern``'s key, or -1 for a pattern built inside the traced code (Dynamo hands over a
    placeholder whose fields live in its own records)."""
    if not dataclasses.is_dataclass(pattern) or all(
        f.name in vars(pattern) for f in dataclasses.fields(pattern)
    ):
        return _register(pattern)
    if isinstance(pattern, Custom):
        raise RuntimeError(
            "block_sparse_attention under torch.compile needs a patterns.Custom built outside "
            "the compiled function (it holds a tensor): build it once, e.g. as a module attribute"
        )
    return -1


def _describe(value: Any) -> Any:
    """A pattern (or a field value) as Python constants: ``(_KEYED, key)`` for a pattern object
    from outside the traced code, ``(_NESTED, class, field values)`` for one built inside it.
    Traced by Dynamo."""
    if isinstance(value, Pattern):
        key = _object_key(value)
        if key >= 0:
            return (_KEYED, key)
        fields = dataclasses.fields(value)  # type: ignore[arg-type]
        return (_NESTED, type(value), tuple(_describe(getattr(value, f.name)) for f in fields))
    if isinstance(value, tuple):
        return tuple(_describe(x) for x in value)
    return value


def _rebuild(value: Any) -> Any:
    """The inverse of :func:`_describe` (the fields were checked when the pattern was built)."""
    if isinstance(value, tuple) and value and value[0] == _KEYED:
        return _PATTERNS[value[1]]
    if isinstance(value, tuple) and value and value[0] == _NESTED:
        _, cls, values = value
        pattern = cls.__new__(cls)
        for field, field_value in zip(dataclasses.fields(cls), values, strict=True):
            object.__setattr__(pattern, field.name, _rebuild(field_value))
        return pattern
    if isinstance(value, tuple):
        return tuple(_rebuild(x) for x in value)
    return value


@_constant_when_traced
def _described_key(description: Any) -> int:
    return _register(_rebuild(description))


def pattern_key(pattern: Pattern) -> int:
    """The int key of ``pattern`` (or of an equal one) in the process-wide table the
    block-sparse operator reads (Note [Patterns as operator arguments])."""
    description = _describe(pattern)
    if description[0] == _KEYED:
        return int(description[1])
    return _described_key(description)


def pattern_of(key: int) -> Pattern:
    """The pattern registered under ``key`` by :func:`pattern_key`."""
    return _PATTERNS[key]
