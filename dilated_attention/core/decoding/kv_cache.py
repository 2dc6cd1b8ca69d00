"""The keys and values a causal layer still needs while decoding: bounded caches whose buffers
grow with what they hold (:class:`GrowingKVCache`), and the dilated layer's
(:class:`DilatedKVCache`); a local window's is ``WindowKVCache`` in ``window_cache.py``.

Note [Bounded dilated cache]
    A token at position ``p`` reads, in branch ``(w, r)``, only keys of its own segment, from
    ``(p // w) * w`` to ``p`` (Note [Decoding rows] in ``decode.py``). So once the sequence has
    ``N`` tokens, no later token reads a key before ``min over branches of (N // w) * w``, which
    is less than the longest segment ``W`` behind ``N``: after each call the cache keeps the rows
    from there on, fewer than ``W`` of them, whatever ``N`` is. (Segments of different lengths
    need not nest: with ``w = 10`` and ``16`` the token at 17 reads from 10.) Which rows a
    layer reads is its kind's (``first_read``, ``reach``: the longest segment here, a local
    window's ``left + 1`` for ``WindowKVCache``, Note [A window cache] in ``window_cache.py``);
    the buffers below serve every kind.

    Decoding appends a few rows per call, so the rows live in buffers with spare rows and new
    rows are written in place: the rows a call reads are a view of the buffer, not a
    concatenation (which would copy up to ``W`` rows per token: 134 MB at ``W`` = 32K, 16 heads
    of 128 in bf16). The buffers grow with what they hold: a new one has room for twice the
    rows it must take (at least 16 more), and at most ``W + headroom`` (``headroom`` an eighth
    of ``W``, at least 64; ``max_length`` rows where the cache is told the longest sequence),
    so single tokens reallocate them a logarithmic number of times, and move the held rows to
    the buffer's start (one copy) only when that leaves at least as many spare rows as held
    ones or the buffers are at their bound (then one copy per ``headroom`` tokens). A call with
    more rows than the headroom (a chunk of a prompt) is written in place too, under a bound of
    ``2 W`` plus its rows: a buffer then keeps as many spare rows as it holds (up to ``W``
    more), so the held rows (fewer than ``W``) move only once those are used up, fewer rows
    than the chunks write, rather than being copied for every chunk (a concatenation and a
    rebuild were most of the GPU time of chunked prefill); the next call under the usual bound
    that finds the buffers full moves the rows into buffers of that bound. The first call
    reads its own rows (nothing is held) and the buffers are then built around the rows later
    tokens read. Where autograd records (grad mode on), every call concatenates instead, so no
    tensor a backward saved is ever written in place. ``nbytes`` is the buffers' size.

    Buffers grow with what they hold, so a long bound costs nothing until tokens fill it. A call
    whose rows, grown into, would not fit the device's memory (the host's RAM for the CPU) is
    refused before any work rather than failing in the allocator. A segment longer than every
    sequence decoded is one segment of it (Note [Effective branches]), so ``max_length`` bounds
    such a cache at no loss.

Note [One cache per layer]
    A cache appends whatever keys it is given and takes them as the next positions, so a cache
    shared by two layers, or advanced by another model or step, would silently read one layer's
    keys as more tokens of another. What can be checked is checked before any work: the cache's
    schedule, batch, heads, head dim, dtype and device against the call's; positions a caller
    gives with the cache must be its next ones (:meth:`DilatedKVCache.check_positions`); and a
    model's list of caches must hold distinct caches at one length (:func:`check_caches`). A
    layer called without positions cannot tell a cache another layer has advanced from a longer
    sequence of its own: code that drives layers by hand passes ``positions`` to have it checked.

Shape legend: B batch, n new positions, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import functools
import os

import torch

from ... import _validation as V

#: The fewest spare rows a new buffer gets (Note [Bounded dilated cache]).
MIN_SPARE_ROWS = 16


class LayerCache:
    """What every decoding cache holds: what its layer reads (a layer kind: :class:`DilatedLayer`
    here, ``WindowLayer`` in ``window_cache.py``) and the most tokens it takes. How the rows
    are kept is the other half of a cache: :class:`GrowingKVCache` (buffers that grow with what
    they hold) or ``StaticKVCache`` in ``static_cache.py`` (a ring of fixed buffers).

    Args:
        max_length: the most tokens this cache will take (``None``: no limit).

    Raises:
        ValueError: a bad ``max_length``.
    """

    #: How the errors name the rows one token reads at most, and the fix for too many.
    _reach_words = "the rows one token reads"
    _shorter = "use a layer that reads fewer rows"

    def __init__(self, *, max_length: int | None = None) -> None:
        if max_length is not None:
            max_length = V.check_positive_int("max_length", max_length)
        self.max_length = max_length
        self._start_empty()

    def _start_empty(self) -> None:
        """Set up an empty cache (each kind sets up its own state)."""

    @property
    def layer(self) -> tuple[object, ...]:
        """What the layer reads, comparable between caches: ``("dilated", segment_lengths,
        dilation_rates)`` or ``("window", window_size)`` (``check_caches`` in ``caches.py``)."""
        raise NotImplementedError

    @property
    def reach(self) -> int:
        """The most positions one token reads, its own included (the longest segment; a
        window's left side plus one): the rows a ring of fixed buffers needs."""
        raise NotImplementedError

    def first_read(self, length: int) -> int:
        """The first position any token after the first ``length`` can read."""
        raise NotImplementedError

    def describe(self) -> str:
        """The layer in words, for error messages (``segment_lengths=[...], ...``)."""
        raise NotImplementedError


class DilatedLayer(LayerCache):
    """The reads of a causal dilated attention layer (Note [Bounded dilated cache]): a token reads
    keys of its own segments only.

    Args:
        segment_lengths: the layer's ``w`` per branch.
        dilation_rates: the layer's ``r`` per branch.
        max_length: the most tokens this cache will take (``None``: no limit).

    Raises:
        ValueError: a bad schedule or ``max_length``.
    """

    _reach_words = "the longest segment's rows"
    _shorter = "use shorter segments"

    def __init__(
        self,
        segment_lengths: list[int] | tuple[int, ...],
        dilation_rates: list[int] | tuple[int, ...],
        *,
        max_length: int | None = None,
    ) -> None:
        segs, rates = V.check_branches(segment_lengths, dilation_rates)
        self.segment_lengths, self.dilation_rates = segs, rates
        super().__init__(max_length=max_length)

    @property
    def layer(self) -> tuple[object, ...]:
        return ("dilated", self.segment_lengths, self.dilation_rates)

    @property
    def reach(self) -> int:
        return max(self.segment_lengths)

    def first_read(self, length: int) -> int:
        """The earliest start of the segments of position ``length`` (Note [Bounded dilated
        cache])."""
        return min((length // w) * w for w in self.segment_lengths)

    def describe(self) -> str:
        return (
            f"segment_lengths={list(self.segment_lengths)}, "
            f"dilation_rates={list(self.dilation_rates)}"
        )

    def check_schedule(self, segments: tuple[int, ...], rates: tuple[int, ...]) -> None:
        """Raise ``ValueError`` unless ``segments`` / ``rates`` are this cache's layer's."""
        if (segments, rates) != (self.segment_lengths, self.dilation_rates):
            raise ValueError(
                f"cache holds a layer with segment_lengths={list(self.segment_lengths)}, "
                f"dilation_rates={list(self.dilation_rates)}, got segment_lengths="
                f"{list(segments)}, dilation_rates={list(rates)}; use one cache per layer"
            )


class GrowingKVCache(LayerCache):
    """Keys and values of one causal decoding layer in buffers that grow with what they hold
    and keep only the rows later tokens read (Note [Bounded dilated cache]): the machinery of
    :class:`DilatedKVCache` and ``WindowKVCache``, whose layer kind says which rows those are
    (``first_read``, ``reach``).

    Attributes:
        length: tokens seen so far (the position of the next token).
        start: position of the first row still held.
        headroom: the most rows a call writes in place, and the buffers' spare rows at their
            bound (Note [Bounded dilated cache]).
    """

    def _start_empty(self) -> None:
        """An empty cache: no tokens, no buffers."""
        self.headroom = max(64, self.reach // 8)
        self.length = 0
        self.start = 0
        # Held rows are buffer[:, _lo:_hi] (Note [Bounded dilated cache]); _owned: the buffers
        # were allocated here (rows may be written in place).
        self._buffers: list[torch.Tensor | None] = [None, None, None]  # key, value, mask
        self._lo = self._hi = 0
        self._owned = False

    def _held(self, index: int) -> torch.Tensor | None:
        buffer = self._buffers[index]
        return None if buffer is None else buffer[:, self._lo : self._hi]

    @property
    def key(self) -> torch.Tensor | None:
        """(B, length - start, Hkv, D) held keys, or None before the first call."""
        return self._held(0)

    @property
    def value(self) -> torch.Tensor | None:
        """(B, length - start, Hkv, D) held values, or None before the first call."""
        return self._held(1)

    @property
    def key_padding_mask(self) -> torch.Tensor | None:
        """(B, length - start) bool over the held rows (``True`` = ignore), or None while no
        call has passed a mask."""
        return self._held(2)

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers holding the keys, values and mask."""
        held = [t for t in self._buffers if t is not None]
        return sum(t.numel() * t.element_size() for t in held)

    def max_rows(self, new_rows: int = 0) -> int:
        """The most rows a buffer holds while a call writes ``new_rows``: the layer's reach
        (the longest segment, the window) plus ``headroom``, twice it plus ``new_rows`` for a
        call of more rows than the headroom, or ``max_length`` when smaller (Note [Bounded
        dilated cache])."""
        reach = self.reach
        rows = reach + self.headroom if new_rows <= self.headroom else 2 * reach + new_rows
        return rows if self.max_length is None else min(rows, self.max_length)

    def check(self, key: torch.Tensor) -> None:
        """Raise ``ValueError`` if ``key`` (B, n, Hkv, D) cannot extend this cache: another
        batch size, key/value heads, head dim, dtype or device, more tokens than
        ``max_length``, or rows no memory of the device holds (the layer is checked by its
        kind: ``check_schedule``, ``check_window``)."""
        name = type(self).__name__
        if self.max_length is not None and self.length + key.shape[1] > self.max_length:
            raise ValueError(
                f"the cache was made for max_length={self.max_length} tokens and holds "
                f"{self.length}, got {key.shape[1]} more; start a new {name}, or make "
                f"it with a larger max_length"
            )
        self._check_growth(key)
        if self.key is None:
            return
        held = (self.key.shape[0], *self.key.shape[2:], self.key.dtype, self.key.device)
        new = (key.shape[0], *key.shape[2:], key.dtype, key.device)
        if held != new:
            raise ValueError(
                f"cache holds keys of (batch, kv heads, head_dim, dtype, device) = {held}, got "
                f"{new}; use a new {name} for another batch or model"
            )

    def _check_growth(self, key: torch.Tensor) -> None:
        """Raise ``ValueError`` if the buffers, grown to take the held rows and ``key``
        (B, n, Hkv, D), need more bytes than the device has (Note [Bounded dilated cache]).
        Buffers grow with what they hold, so a long bound costs nothing until tokens fill it;
        this refuses a call whose rows no memory of the device holds before the allocator is
        asked for them."""
        batch, new_rows, heads, dim = key.shape
        rows = self._capacity(self.length - self.start + new_rows, self.max_rows(new_rows))
        needed = rows * batch * (2 * heads * dim * key.element_size() + 1)  # keys, values, mask
        memory = device_memory(key.device)
        if memory is None or needed <= memory:
            return
        name = type(self).__name__
        raise ValueError(
            f"{self.describe()}: this call makes the {name} hold {rows:,} rows (it keeps up "
            f"to {self._reach_words} plus {self.headroom} spare), {needed:,} bytes "
            f"({needed / 1e9:,.1f} GB) for these keys (batch {batch}, {heads} key/value heads "
            f"of {dim}, {key.dtype}), more than the {memory:,} bytes ({memory / 1e9:,.1f} GB) "
            f"of {key.device}; decode fewer tokens per call, bound the cache with {name}(..., "
            f"max_length=the most tokens you decode), or {self._shorter}"
        )

    def check_positions(self, positions: torch.Tensor, given_with: str = "cache=") -> None:
        """Raise ``ValueError`` unless ``positions`` (n,) int are the ``n`` positions after the
        tokens this cache has seen, the ones its new rows take (Note [One cache per layer]);
        ``given_with`` names the argument that brought the cache. Reads them on the host (one
        device sync)."""
        n, length = positions.shape[0], self.length
        expected = torch.arange(length, length + n, device=positions.device)
        if torch.equal(positions.long(), expected):
            return
        shown = positions[:8].tolist()
        raise ValueError(
            f"with {given_with}, positions must be the {V.counted(n, 'position')} after the "
            f"{length} the "
            f"cache has seen ({length} to {length + n - 1}: the new tokens' positions must "
            f"increase by 1 from there), got positions={shown}{'...' if n > 8 else ''}; a "
            f"cache past them has taken these or other tokens already (one cache per layer and "
            f"sequence); pass positions=None for the cache's own"
        )

    def append(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
        """Append ``key``/``value`` (B, n, Hkv, D) and their ``key_padding_mask`` (B, n) bool
        (None: none of them ignored); return the keys, values and mask (None while no call has
        passed one) this call's tokens read, and the position of their first row. Afterwards
        only the rows later tokens can read are kept (Note [Bounded dilated cache])."""
        new = [key, value, key_padding_mask]
        if key_padding_mask is None and self._buffers[2] is not None:
            new[2] = torch.zeros(key.shape[:2], dtype=torch.bool, device=key.device)
        keys_held = self._buffers[0]
        if key_padding_mask is not None and self._buffers[2] is None and keys_held is not None:
            self._buffers[2] = torch.zeros(
                key.shape[0], keys_held.shape[1], dtype=torch.bool, device=key.device
            )
        rows, start = key.shape[1], self.start
        if torch.is_grad_enabled() or self._buffers[0] is None:
            read = [self._joined(i, x) for i, x in enumerate(new)]
            self.length += rows
            self._keep(read)
        else:
            read = self._write_in_place(new)
            self.length += rows
            keep_from = self.first_read(self.length)
            self._lo += keep_from - self.start
            self.start = keep_from
        return read[0], read[1], read[2], start

    def take_prompt(
        self, key: torch.Tensor, value: torch.Tensor, key_padding_mask: torch.Tensor | None
    ) -> None:
        """Hold a prompt's ``key``/``value`` (B, n, Hkv, D) and mask (B, n), computed elsewhere
        (a packed prompt's last documents), as the positions after those held."""
        self.append(key, value, key_padding_mask)

    def _capacity(self, rows: int, bound: int) -> int:
        """Rows of a new buffer that must take ``rows``: twice them (at least
        ``MIN_SPARE_ROWS`` more), at most ``bound`` (Note [Bounded dilated cache])."""
        return max(rows, min(bound, max(2 * rows, rows + MIN_SPARE_ROWS)))

    def _joined(self, index: int, new: torch.Tensor | None) -> torch.Tensor | None:
        """The held rows of buffer ``index`` followed by ``new``, as a new tensor (``new``
        itself when nothing is held)."""
        held = self._held(index)
        if new is None:
            return held
        return new if held is None or held.shape[1] == 0 else torch.cat([held, new], dim=1)

    def _keep(self, read: list[torch.Tensor | None]) -> None:
        """Rebuild the buffers from a call's rows ``read`` (positions ``start`` to ``length``):
        the rows later tokens read, with spare rows; under grad mode, views of ``read``."""
        keep_from = self.first_read(self.length)
        first = keep_from - self.start
        kept = self.length - keep_from
        if torch.is_grad_enabled():
            self._buffers = [None if x is None else x[:, first:] for x in read]
        else:
            capacity = self._capacity(kept, self.max_rows())
            self._buffers = [None if x is None else _in_buffer(x[:, first:], capacity)
                             for x in read]  # fmt: skip
        self._owned = not torch.is_grad_enabled()
        self._lo, self._hi = 0, kept
        self.start = keep_from

    def _write_in_place(self, new: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Write ``new`` after the held rows (into larger buffers where they are full or at
        least half held, else moving the held rows to the buffers' start when the rows after
        them are used up); the held rows and ``new`` as views."""
        rows, held = new[0].shape[1], self._hi - self._lo
        capacity, bound = self._buffers[0].shape[1], self.max_rows(rows)
        # Buffers made under torch.inference_mode cannot be written outside it.
        frozen = self._buffers[0].is_inference() and not torch.is_inference_mode_enabled()
        full = self._hi + rows > capacity
        grow = held + rows > capacity or (
            full and 2 * (held + rows) > capacity and capacity < bound
        )
        if not self._owned or frozen or grow or (full and capacity > bound):
            size = self._capacity(held + rows, bound)
            self._buffers = [None if b is None else _in_buffer(b[:, self._lo : self._hi], size)
                             for b in self._buffers]  # fmt: skip
            self._owned, self._lo, self._hi = True, 0, held
        elif full:
            for b in self._buffers:
                if b is not None:
                    rows_held = b[:, self._lo : self._hi]
                    b[:, :held] = rows_held if self._lo >= held else rows_held.clone()
            self._lo, self._hi = 0, held
        for b, x in zip(self._buffers, new, strict=True):
            if b is not None and x is not None:
                b[:, self._hi : self._hi + rows] = x
        self._hi += rows
        return [self._held(i) for i in range(3)]


class DilatedKVCache(DilatedLayer, GrowingKVCache):
    """Keys and values of one causal dilated attention layer, for decoding.

    Pass it as ``cache=`` to :func:`dilated_attention.dilated_attention` with the new tokens'
    queries, keys and values: the call appends the keys and values, attends the new queries to
    every key they can read (exactly the rows of the full causal forward), and drops the rows no
    later token can read (Note [Bounded dilated cache]). One cache per layer (Note [One cache
    per layer]).

    Args:
        segment_lengths: the layer's ``w`` per branch.
        dilation_rates: the layer's ``r`` per branch.
        max_length: the most tokens this cache will take (``None``: no limit); the buffers then
            hold at most that many rows, and a call past it raises ``ValueError``.

    Attributes:
        length, start, headroom: as in :class:`GrowingKVCache`.

    Raises:
        ValueError: a bad schedule or ``max_length``.
    """



def _in_buffer(rows: torch.Tensor, capacity: int) -> torch.Tensor:
    """A new buffer of ``capacity`` rows (>= n) starting with ``rows`` (B, n, ...)."""
    buffer = rows.new_empty(rows.shape[0], capacity, *rows.shape[2:])
    buffer[:, : rows.shape[1]] = rows
    return buffer


@functools.cache
def device_memory(device: torch.device) -> int | None:
    """Bytes of memory of ``device`` (for the CPU, the host's RAM), or None where unknown."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.get_device_properties(device).total_memory)
        if device.type == "cpu":
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError, RuntimeError):
        return None
    return None
