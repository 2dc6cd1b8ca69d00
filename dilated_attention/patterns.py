"""Block-sparse attention patterns: which (query block, key block) pairs attend.

A pattern is a small, immutable description; ``pattern.block_mask(num_query_blocks,
num_key_blocks)`` turns it into a bool tensor ``(num_query_blocks, num_key_blocks)`` for a given
number of blocks (``True`` = the pair attends). The block size lives with the attention call
(``block_sparse_attention(..., block_size=128)``): block ``i`` holds tokens
``[i * block_size, (i + 1) * block_size)``, the last block possibly shorter.

Patterns compose: ``a | b`` keeps the pairs either keeps (:class:`Union`), ``a & b`` the pairs
both keep (:class:`Intersection`). Example, 6 x 6 blocks::

    LocalWindow(1)          GlobalLocal(1, 0)       DilatedBlocks([3])
    x x . . . .             x x x x x x             x . . x . .
    x x x . . .             x x . . . .             . x . . x .
    . x x x . .             x . x . . .             . . x . . x
    . . x x x .             x . . x . .             x . . x . .
    . . . x x x             x . . . x .             . x . . x .
    . . . . x x             x . . . . x             . . x . . x

A causal call additionally drops the pairs above the diagonal (and masks tokens inside the
diagonal blocks), whatever the pattern says.

Presets: :data:`PRESETS` maps ``"sparse_10"``, ``"sparse_25"`` and ``"sparse_50"`` to
:class:`Random` patterns of 10%, 25% and 50% density (the densities users of earlier block-sparse
modules know); :func:`preset` looks one up by name.
"""

from __future__ import annotations

import functools
import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ._validation import MAX_INT

__all__ = [
    "PRESETS",
    "Custom",
    "DilatedBlocks",
    "GlobalLocal",
    "Intersection",
    "LocalWindow",
    "Pattern",
    "Random",
    "Union",
    "check_pattern",
    "preset",
]


def _non_negative_int(name: str, value: object, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= 0, got {value!r} ({type(value).__name__})")
    if value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value}; {fix}")
    if value > MAX_INT:
        raise ValueError(
            f"{name} must be an int of at most 2**63 - 1 (int64), got {value}; any value of at "
            f"least the number of blocks has the same effect: pass that"
        )
    return int(value)


def _block_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(
            f"{name} must be a positive int, got {value}; it is ceil(seq_len / block_size)"
        )
    return int(value)


def check_pattern(pattern: object, name: str = "pattern") -> Pattern:
    """Return ``pattern`` if it is a :class:`Pattern`, else raise ``TypeError``."""
    if not isinstance(pattern, Pattern):
        raise TypeError(
            f"{name} must be a dilated_attention.patterns.Pattern (LocalWindow, GlobalLocal, "
            f"DilatedBlocks, Random, Custom, or a | / & of them), got {type(pattern).__name__}; "
            f"wrap a bool (q_blocks, k_blocks) tensor in patterns.Custom(mask)"
        )
    return pattern


class Pattern(ABC):
    """Base class of every block-sparse pattern.

    Subclasses implement ``_mask(num_query_blocks, num_key_blocks)``; this class validates the
    block counts and provides :meth:`density` and the ``|`` / ``&`` composition.
    """

    def block_mask(self, num_query_blocks: int, num_key_blocks: int) -> torch.Tensor:
        """Which block pairs attend.

        Args:
            num_query_blocks: ``ceil(query_len / block_size)``.
            num_key_blocks: ``ceil(key_len / block_size)``.

        Returns:
            bool tensor (num_query_blocks, num_key_blocks) on the CPU; ``[i, j]`` is ``True`` when
            query block ``i`` attends to key block ``j``.

        Raises:
            TypeError / ValueError: block counts that are not positive ints; for :class:`Custom`,
                counts that differ from its mask's shape.
        """
        nq = _block_count("num_query_blocks", num_query_blocks)
        nk = _block_count("num_key_blocks", num_key_blocks)
        return _cached_mask(self, nq, nk).clone()  # a copy: callers may modify theirs

    def density(self, num_query_blocks: int, num_key_blocks: int) -> float:
        """Fraction of block pairs kept, in [0, 1] (before any causal mask)."""
        mask = self.block_mask(num_query_blocks, num_key_blocks)
        return float(mask.sum()) / mask.numel()

    @abstractmethod
    def _mask(self, nq: int, nk: int) -> torch.Tensor: ...

    def __or__(self, other: object) -> Union:
        return Union((self, check_pattern(other, "the right operand of |")))

    def __ror__(self, other: object) -> Union:
        return Union((check_pattern(other, "the left operand of |"), self))

    def __and__(self, other: object) -> Intersection:
        return Intersection((self, check_pattern(other, "the right operand of &")))

    def __rand__(self, other: object) -> Intersection:
        return Intersection((check_pattern(other, "the left operand of &"), self))


@functools.lru_cache(maxsize=16)
def _cached_mask(pattern: Pattern, nq: int, nk: int) -> torch.Tensor:
    """``pattern._mask(nq, nk)``, checked, and kept for the next call with the same pattern and
    block counts: patterns are immutable, and drawing a :class:`Random` mask of 2048 x 2048
    blocks (256K tokens at block 128) takes ~50 ms on a CPU, which every attention call would
    otherwise pay. Errors (a :class:`Custom` mask of another size) are raised, never kept."""
    mask = pattern._mask(nq, nk)
    if mask.shape != (nq, nk) or mask.dtype != torch.bool:  # a subclass bug, not user input
        raise RuntimeError(
            f"{type(pattern).__name__}._mask returned {mask.dtype} {tuple(mask.shape)}, "
            f"expected bool {(nq, nk)}"
        )
    return mask


def _offsets(nq: int, nk: int) -> torch.Tensor:
    """(nq, nk) int64: ``i - j`` for query block ``i`` and key block ``j``."""
    return torch.arange(nq).view(-1, 1) - torch.arange(nk).view(1, -1)


@dataclass(frozen=True)
class LocalWindow(Pattern):
    """Blocks within ``window`` of each other: ``|i - j| <= window``.

    Args:
        window: >= 0; ``LocalWindow(0)`` is the block diagonal.
    """

    window: int

    def __post_init__(self) -> None:
        fix = "use 0 for the block diagonal only"
        object.__setattr__(self, "window", _non_negative_int("window", self.window, fix))

    def _mask(self, nq: int, nk: int) -> torch.Tensor:
        return _offsets(nq, nk).abs() <= self.window


@dataclass(frozen=True)
class GlobalLocal(Pattern):
    """A local window plus global blocks (Longformer / BigBird style).

    Query block ``i`` attends key block ``j`` when ``|i - j| <= window``, or ``j < num_global``
    (every block reads the global blocks), or ``i < num_global`` (the global blocks read
    everything).

    Args:
        num_global: number of leading global blocks, >= 0.
        window: local window, >= 0.
    """

    num_global: int
    window: int

    def __post_init__(self) -> None:
        g = _non_negative_int("num_global", self.num_global, "use 0 for no global blocks")
        w = _non_negative_int("window", self.window, "use 0 for the block diagonal only")
        object.__setattr__(self, "num_global", g)
        object.__setattr__(self, "window", w)

    def _mask(self, nq: int, nk: int) -> torch.Tensor:
        local = _offsets(nq, nk).abs() <= self.window
        rows = torch.arange(nq).view(-1, 1) < self.num_global
        cols = torch.arange(nk).view(1, -1) < self.num_global
        return local | rows | cols


@dataclass(frozen=True)
class DilatedBlocks(Pattern):
    """Block-level dilation: ``(i - j) % r == 0`` for some ``r`` in ``rates``.

    Query block ``i`` reads every ``r``-th block before and after it (itself included). With
    ``rates=(1,)`` this is dense; ``rates=(2, 3)`` keeps the pairs whose block distance is a
    multiple of 2 or of 3. Unlike token-level dilated attention, whole blocks are kept, so the
    kernels run dense tiles.

    Args:
        rates: one or more positive ints.
    """

    rates: tuple[int, ...]

    def __post_init__(self) -> None:
        rates = self.rates
        if isinstance(rates, numbers.Integral) and not isinstance(rates, bool):
            rates = (rates,)
        if isinstance(rates, (str, bytes)) or not isinstance(rates, Iterable):
            raise TypeError(f"rates must be a sequence of positive ints, got {rates!r}")
        values = tuple(rates)
        if not values:
            raise ValueError("rates must hold at least one positive int, got (); e.g. rates=(2,)")
        for i, r in enumerate(values):
            if isinstance(r, bool) or not isinstance(r, numbers.Integral):
                raise TypeError(f"rates[{i}] must be a positive int, got {r!r}")
            if r < 1:
                raise ValueError(f"rates[{i}] must be a positive int, got {r}; 1 means dense")
            if r > MAX_INT:
                raise ValueError(
                    f"rates[{i}] must be a positive int of at most 2**63 - 1 (int64), got {r}; "
                    f"any rate of at least the number of blocks keeps the block diagonal only: "
                    f"pass that"
                )
        object.__setattr__(self, "rates", tuple(int(r) for r in values))

    def _mask(self, nq: int, nk: int) -> torch.Tensor:
        diff = _offsets(nq, nk)
        mask = torch.zeros(nq, nk, dtype=torch.bool)
        for r in self.rates:
            mask |= diff % r == 0
        return mask


_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, nq, nk) over the seeds


@dataclass(frozen=True, init=False)
class Random(Pattern):
    """Each block pair kept independently with probability ``density``.

    The mask is a pure function of ``(seed, num_query_blocks, num_key_blocks)``: the same on
    every call, process and rank (it is drawn from a seeded CPU ``torch.Generator``). The
    realised density is close to ``density`` for many blocks, exact only in expectation. Rows
    may end up with no key block (their output is 0); ``Random(p) | LocalWindow(0)`` always
    keeps the diagonal.

    Args:
        density: in (0, 1]; 1 keeps every pair. Stored as ``keep_probability`` (``density`` is
            the method every pattern has).
        seed: any int.
    """

    keep_probability: float
    seed: int

    def __init__(self, density: float, seed: int = 0) -> None:
        if isinstance(density, bool) or not isinstance(density, numbers.Real):
            raise TypeError(f"density must be a float in (0, 1], got {density!r}")
        if math.isnan(float(density)) or not 0.0 < float(density) <= 1.0:
            raise ValueError(
                f"density must be in (0, 1], got {density!r}; e.g. 0.1 keeps about 10% of the "
                "block pairs"
            )
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"seed must be an int, got {seed!r} ({type(seed).__name__})")
        object.__setattr__(self, "keep_probability", float(density))
        object.__setattr__(self, "seed", int(seed))

    def _mask(self, nq: int, nk: int) -> torch.Tensor:
        if self.keep_probability >= 1.0:
            return torch.ones(nq, nk, dtype=torch.bool)
        mixed = (self.seed * _SEED_MIX + nq * 1_000_003 + nk) % (2**63 - 1)
        gen = torch.Generator().manual_seed(mixed)
        return torch.rand(nq, nk, generator=gen, dtype=torch.float64) < self.keep_probability


@dataclass(frozen=True, eq=False)
class Custom(Pattern):
    """A user-given block mask, used as is.

    Compared and hashed by identity (it holds a tensor). The mask is copied to the CPU at
    construction, so later changes to the caller's tensor do not affect the pattern.

    Args:
        mask: bool tensor (num_query_blocks, num_key_blocks).

    Raises:
        TypeError: ``mask`` is not a bool tensor.
        ValueError: ``mask`` is not 2-D or has a zero dimension; at ``block_mask`` time, block
            counts that differ from the mask's shape.
    """

    mask: torch.Tensor

    def __post_init__(self) -> None:
        mask = self.mask
        if not isinstance(mask, torch.Tensor):
            raise TypeError(
                f"mask must be a bool tensor (num_query_blocks, num_key_blocks), got "
                f"{type(mask).__name__}"
            )
        if mask.dtype != torch.bool:
            raise TypeError(
                f"mask must have dtype torch.bool (True = the block pair attends), got "
                f"{mask.dtype}; convert with mask.bool() or (mask != 0)"
            )
        if mask.dim() != 2 or 0 in mask.shape:
            raise ValueError(
                f"mask must be a non-empty 2-D tensor (num_query_blocks, num_key_blocks), got "
                f"mask.shape={tuple(mask.shape)}"
            )
        object.__setattr__(self, "mask", mask.detach().to("cpu", copy=True))

    def __repr__(self) -> str:
        return f"Custom(mask of shape {tuple(self.mask.shape)})"

    def _mask(self, nq: int, nk: int) -> torch.Tensor:
        if tuple(self.mask.shape) != (nq, nk):
            raise ValueError(
                f"Custom mask has shape {tuple(self.mask.shape)} but the call has "
                f"{(nq, nk)} (num_query_blocks, num_key_blocks) blocks; build the mask with "
                f"shape (ceil(query_len / block_size), ceil(key_len / block_size)) for this "
                f"sequence length and block_size"
            )
        return self.mask  # block_mask hands out copies


@dataclass(frozen=True)
class Union(Pattern):
    """Pairs kept by any of ``patterns`` (``a | b``)."""

    patterns: tuple[Pattern, ...]

    def __post_init__(self) -> None:
        _check_parts(self.patterns, "Union")

    def _mask(self, nq: int, nk: int) -> torch.Tensor:
        mask = torch.zeros(nq, nk, dtype=torch.bool)
        for part in self.patterns:
            mask |= part.block_mask(nq, nk)
        return mask


@dataclass(frozen=True)
class Intersection(Pattern):
    """Pairs kept by every one of ``patterns`` (``a & b``)."""

    patterns: tuple[Pattern, ...]

    def __post_init__(self) -> None:
        _check_parts(self.patterns, "Intersection")

    def _mask(self, nq: int, nk: int) -> torch.Tensor:
        mask = torch.ones(nq, nk, dtype=torch.bool)
        for part in self.patterns:
            mask &= part.block_mask(nq, nk)
        return mask


def _check_parts(parts: object, kind: str) -> None:
    if not isinstance(parts, tuple) or not parts:
        raise TypeError(f"{kind} takes a non-empty tuple of patterns, got {parts!r}")
    for i, part in enumerate(parts):
        check_pattern(part, f"{kind} part {i}")


#: Named patterns for the densities users know: Random block masks of 10%, 25% and 50%.
PRESETS: dict[str, Pattern] = {
    "sparse_10": Random(0.10),
    "sparse_25": Random(0.25),
    "sparse_50": Random(0.50),
}


def preset(name: str) -> Pattern:
    """The pattern registered as ``name`` in :data:`PRESETS`.

    Raises:
        ValueError: unknown name (the message lists the valid ones).
    """
    if not isinstance(name, str) or name not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
    return PRESETS[name]
