"""The resolve step: a :class:`Request` describes one attention call, :func:`resolve` returns
the :class:`Strategy` that runs it (Note [One resolve step] in ``resolve/resolver.py``)."""

from .caches import static_branches
from .request import (
    BLOCK_SPARSE,
    DECODE,
    DENSE,
    DILATED,
    OPERATIONS,
    CheckedCalls,
    Request,
    dilated_operation,
)
from .resolver import execute, keeps_every_pair, kept_or_resolved, resolve
from .strategy import Strategy

__all__ = [
    "BLOCK_SPARSE",
    "DECODE",
    "DENSE",
    "DILATED",
    "OPERATIONS",
    "CheckedCalls",
    "Request",
    "Strategy",
    "dilated_operation",
    "execute",
    "keeps_every_pair",
    "kept_or_resolved",
    "resolve",
    "static_branches",
]
