"""A decoding cache of fixed device buffers: a decode step with static shapes, no host
synchronization, capturable in a CUDA graph or one ``torch.compile`` graph.

Note [A decode step with static shapes]
    A token at position ``p`` reads, in branch ``(w, r)``, keys of its own segment only, from
    ``t0 = (p // w) * w > p - w`` to ``p`` (Note [Decoding rows] in ``decode.py``). So with
    ``R`` the longest segment, a buffer of ``R`` rows holding key position ``x`` at row
    ``x mod R`` (a ring) holds every key any later token reads: the token at ``p`` overwrites
    position ``p - R``, which no token from ``p`` on reads. A segment longer than every position
    the cache will take (``max_length``) is one segment of them (Note [Effective branches]), so
    ``R`` is at most ``max_length``. The ring serves any layer whose tokens read a bounded
    span of positions back: ``R`` is the layer kind's ``reach`` (a local window's ``left + 1``
    rows in ``StaticWindowKVCache``, Note [A window cache] in ``window_cache.py``).

    One step (one new token per batch row) then writes the row's key and value at row
    ``p mod R`` of the buffers, runs the one call of Note [One call per decoded token] with the
    slots' positions computed on the device from the rows' positions (a (B,) int64 tensor:
    each batch row at its own position), and adds 1 to the positions. Its shapes, kernels and
    arguments are the same at every position, and nothing in it reads a tensor on the host:
    the step can be captured in a CUDA graph and replayed, or compiled into one graph by
    ``torch.compile`` (the buffers and positions are marked as static addresses, so
    ``mode="reduce-overhead"`` captures them as they are). The price of static shapes is that
    a short context reads as many slots as a long one, the ones past the token masked: the sum
    over branches of ``ceil(w / r)``.

    What needs the host stays out of the step. A call with several tokens (a prompt into an
    empty cache, or a chunk after earlier tokens) runs eagerly: the keys it reads from the
    buffers (from the first position any of its tokens reads) joined with its own, through the
    decoding plan (Note [Decoding rows]) or, for a prompt, the causal forward; then its rows
    are written into the buffers. A step checks shapes, dtype and device against the buffers'
    (plain Python, no synchronization); positions past ``max_length`` raise ``ValueError`` in
    eager calls (one synchronization, only where a bound is set) and fail a device assertion
    in a traced one. A step runs without gradients (``DilatedKVCache`` decodes with them).

Shape legend: B batch, n new positions, R buffer rows, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import torch

from ... import _validation as V
from ..hidden import hide_masked_keys
from .kv_cache import DilatedLayer, LayerCache, device_memory


class StaticKVCache(LayerCache):
    """Keys and values of one causal decoding layer in fixed buffers, a ring of the rows one
    token reads at most (the layer kind's ``reach``; Note [A decode step with static shapes]):
    the machinery of :class:`StaticDilatedKVCache` and ``StaticWindowKVCache``.

    Attributes:
        ring_rows: R, the rows of the buffers.
        key, value: (B, R, Hkv, D) buffers (None before the first call).
        key_padding_mask: (B, R) bool, ``True`` = ignore (None while no call passed a mask).
        lengths: (B,) int64 tokens each row has seen, on the buffers' device.
    """

    def _start_empty(self) -> None:
        """An empty cache: no buffers yet (the first call allocates them)."""
        reach, most = self.reach, self.max_length
        self.ring_rows = reach if most is None else min(reach, most)
        self.key: torch.Tensor | None = None
        self.value: torch.Tensor | None = None
        self.key_padding_mask: torch.Tensor | None = None
        self.lengths: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers."""
        held = (self.key, self.value, self.key_padding_mask, self.lengths)
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def check(self, key: torch.Tensor) -> None:
        """Raise ``ValueError`` if ``key`` (B, n, Hkv, D) cannot extend this cache: (once the
        buffers exist) another batch size, key/value heads, head dim, dtype or device; or
        buffers no memory of the device holds (the layer is checked by its kind). Shapes only:
        no synchronization."""
        if self.key is None:
            if not torch.compiler.is_compiling():  # a traced prompt is refused after this
                self._check_memory(key)
            return
        held = (self.key.shape[0], *self.key.shape[2:], self.key.dtype, self.key.device)
        new = (key.shape[0], *key.shape[2:], key.dtype, key.device)
        if held != new:
            name = type(self).__name__
            raise ValueError(
                f"the {name}'s buffers hold keys of (batch, kv heads, head_dim, dtype, device) "
                f"= {held}, got {new}: a static step keeps its shapes; use a new {name} for "
                f"another batch or model, or cache.reset(drop=True) first"
            )

    def _check_memory(self, key: torch.Tensor) -> None:
        batch, _, heads, dim = key.shape
        needed = self.ring_rows * batch * (2 * heads * dim * key.element_size() + 1)
        memory = device_memory(key.device)
        if memory is None or needed <= memory:
            return
        raise ValueError(
            f"{self.describe()}: a {type(self).__name__} holds {self.ring_rows:,} rows "
            f"({self._reach_words}) for these keys (batch {batch}, {heads} key/value heads of "
            f"{dim}, {key.dtype}): {needed:,} bytes, more than the {memory:,} bytes of "
            f"{key.device}; pass max_length=the most tokens you decode, or {self._shorter}"
        )

    def allocate(self, key: torch.Tensor) -> None:
        """Buffers for keys like ``key`` (B, n, Hkv, D), all rows at position 0, marked as
        static addresses for ``torch.compile``'s CUDA graphs."""
        batch, _, heads, dim = key.shape
        shape = (batch, self.ring_rows, heads, dim)
        self.key = key.new_zeros(shape)
        self.value = key.new_zeros(shape)
        self.lengths = torch.zeros(batch, dtype=torch.int64, device=key.device)
        self.key_padding_mask = None
        for buffer in (self.key, self.value, self.lengths):
            _mark_static(buffer)

    def reset(self, *, drop: bool = False) -> None:
        """Forget every token (positions back to 0), keeping the buffers (a captured step stays
        valid); ``drop``: free the buffers too (the next call allocates new ones)."""
        if drop or self.lengths is None:
            self.key = self.value = self.key_padding_mask = self.lengths = None
            return
        self.lengths.zero_()
        if self.key_padding_mask is not None:
            self.key_padding_mask.zero_()

    @property
    def length(self) -> int:
        """Tokens seen so far, every row at one position (0 before the first call; one
        synchronization: :meth:`host_length`)."""
        return 0 if self.lengths is None else self.host_length()

    def host_length(self) -> int:
        """The tokens every row has seen (one synchronization).

        Raises:
            ValueError: rows at different positions (batched decoding of different lengths),
                which only one token per row at a time can extend.
        """
        assert self.lengths is not None
        low, high = (int(x) for x in torch.aminmax(self.lengths))
        if low != high:
            raise ValueError(
                f"the {type(self).__name__}'s rows are at different positions ({low} to {high}): "
                f"extend them one token per row per call, or give the rows of one length a "
                f"cache of their own"
            )
        return low

    def check_capacity(self, new_tokens: int) -> None:
        """Refuse positions past ``max_length``: ``ValueError`` in an eager call (one
        synchronization), a device assertion in a traced or captured one; nothing without a
        bound."""
        if self.max_length is None or self.lengths is None:
            return
        if V.values_unreadable():
            torch._assert_async(
                (self.lengths + new_tokens <= self.max_length).all(),
                f"a {type(self).__name__} of max_length={self.max_length} got more tokens",
            )
            return
        most = int(self.lengths.max())
        if most + new_tokens > self.max_length:
            raise ValueError(
                f"the {type(self).__name__} was made for max_length={self.max_length} tokens and "
                f"a row holds {most}, got {new_tokens} more; start a new cache (or "
                f"cache.reset()), or make it with a larger max_length"
            )

    def chunk_start(self, new_tokens: int) -> int:
        """The position of the first of ``new_tokens`` given together (a prompt or a chunk):
        the one every row is at (one synchronization).

        Raises:
            ValueError: rows at different positions, or positions past ``max_length``.
        """
        first = 0 if self.lengths is None else self.host_length()
        if self.max_length is not None and first + new_tokens > self.max_length:
            raise ValueError(
                f"the {type(self).__name__} was made for max_length={self.max_length} tokens, "
                f"got {first + new_tokens}; make it with a larger max_length"
            )
        return first

    def write_token(
        self, key: torch.Tensor, value: torch.Tensor, key_padding_mask: torch.Tensor | None
    ) -> None:
        """Write one new token per row, ``key``/``value`` (B, 1, Hkv, D) and its
        ``key_padding_mask`` (B, 1) bool, at each row's position (on the device)."""
        assert self.key is not None and self.value is not None and self.lengths is not None
        rows = self.lengths % self.ring_rows
        batch = torch.arange(rows.shape[0], device=rows.device)
        self.key[batch, rows] = key[:, 0].detach()
        self.value[batch, rows] = value[:, 0].detach()
        if key_padding_mask is not None and self.key_padding_mask is None:
            self._new_mask()
        if self.key_padding_mask is not None:
            hidden = False if key_padding_mask is None else key_padding_mask[:, 0]
            self.key_padding_mask[batch, rows] = hidden

    def take_token(
        self, key: torch.Tensor, value: torch.Tensor, key_padding_mask: torch.Tensor | None
    ) -> None:
        """A step's new token, ``key``/``value`` (B, 1, Hkv, D) and ``key_padding_mask`` (B, 1)
        bool: refused past ``max_length`` (:meth:`check_capacity`), its hidden keys zeroed
        (Note [Hidden keys cannot poison rows] in ``hidden.py``) and written at each row's
        position (:meth:`write_token`). The step's attention runs next, then
        ``lengths.add_(1)``."""
        self.check_capacity(1)
        key, value = hide_masked_keys(key, value, key_padding_mask)
        self.write_token(key, value, key_padding_mask)

    def write_rows(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        first: int,
    ) -> None:
        """Write ``key``/``value`` (B, n, Hkv, D) and ``key_padding_mask`` (B, n) of positions
        ``first .. first + n - 1`` (every row at ``first``; the buffers allocated on first use),
        keeping the last ``R``, and move every row to ``first + n``. Eager."""
        if self.key is None:
            self.allocate(key)
        assert self.key is not None and self.value is not None and self.lengths is not None
        n = key.shape[1]
        kept = min(n, self.ring_rows)
        rows = torch.arange(first + n - kept, first + n, device=key.device) % self.ring_rows
        self.key[:, rows] = key[:, n - kept :].detach()
        self.value[:, rows] = value[:, n - kept :].detach()
        if key_padding_mask is not None and self.key_padding_mask is None:
            self._new_mask()
        if self.key_padding_mask is not None:
            hidden = False if key_padding_mask is None else key_padding_mask[:, n - kept :]
            self.key_padding_mask[:, rows] = hidden
        self.lengths.fill_(first + n)

    def read_rows(self, start: int, end: int) -> tuple[torch.Tensor, ...]:
        """The held keys, values and mask (None without one) of positions ``start .. end - 1``
        (at most ``R`` of them, every row at ``end``) as new (B, end - start, ...) tensors."""
        assert self.key is not None and self.value is not None
        rows = torch.arange(start, end, device=self.key.device) % self.ring_rows
        mask = self.key_padding_mask
        return self.key[:, rows], self.value[:, rows], None if mask is None else mask[:, rows]

    def with_held(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        first: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
        """The keys, values and mask (None where neither has one) that new tokens at positions
        ``first ..`` read: the held rows from the layer's ``first_read(first)`` to ``first``
        followed by ``key``/``value`` (B, n, Hkv, D) and ``key_padding_mask`` (B, n), and the
        position of their first row. Eager (every row at ``first``)."""
        start = self.first_read(first)
        if first <= start:
            return key, value, key_padding_mask, start
        held_k, held_v, held_mask = self.read_rows(start, first)
        keys, values = torch.cat([held_k, key], dim=1), torch.cat([held_v, value], dim=1)
        mask = key_padding_mask
        if mask is not None or held_mask is not None:
            mask = torch.cat([_mask_or_none(held_mask, held_k), _mask_or_none(mask, key)], dim=1)
        return keys, values, mask, start

    def take_prompt(
        self, key: torch.Tensor, value: torch.Tensor, key_padding_mask: torch.Tensor | None
    ) -> None:
        """Hold a prompt's ``key``/``value`` (B, n, Hkv, D) and mask (B, n), computed elsewhere
        (a packed prompt's last documents), as the positions from 0. Eager."""
        self.write_rows(key, value, key_padding_mask, 0)

    def load_rows(self, rows: torch.Tensor, source: StaticKVCache, batch: int) -> None:
        """Take ``source``'s rows (each at its own position) as this cache's batch ``rows``
        (int64 indices), allocating buffers for ``batch`` rows on first use: prompts of
        different lengths, each prefilled in a cache of its own, decoded together. Both caches
        hold position ``x`` at row ``x mod R``, so the rows copy as they are. Eager (it reads
        ``rows`` on the host to check them).

        Args:
            rows: (b,) distinct integer indices in ``[0, batch)``, one per row of ``source``,
                on the CPU or the buffers' device.
            source: a prefilled cache of the same layer, (b, R, Hkv, D) buffers.
            batch: B, the rows of this cache's buffers (theirs once they exist).

        Raises:
            TypeError: ``source`` is not a cache of this kind, ``rows`` not an int tensor.
            ValueError: ``source`` of another layer or ``max_length``, or empty; ``batch``
                not a positive int or not the buffers'; ``rows`` not one distinct index in
                ``[0, batch)`` per row of ``source``; keys of other heads, head dim, dtype or
                device than the buffers'. Checked before anything is written.
        """
        self._check_load(rows, source, batch)
        assert source.key is not None and source.value is not None
        assert source.lengths is not None
        if self.key is None:
            self.allocate(source.key.new_empty(batch, 1, *source.key.shape[2:]))
        assert self.key is not None and self.value is not None and self.lengths is not None
        self.key[rows] = source.key
        self.value[rows] = source.value
        self.lengths[rows] = source.lengths
        if source.key_padding_mask is not None and self.key_padding_mask is None:
            self._new_mask()
        if self.key_padding_mask is not None:
            mask = source.key_padding_mask
            self.key_padding_mask[rows] = False if mask is None else mask

    def _check_load(self, rows: object, source: object, batch: object) -> None:
        """:meth:`load_rows`'s arguments, checked (its Raises)."""
        name = type(self).__name__
        if type(source) is not type(self):
            raise TypeError(
                f"source must be a {name} prefilled with a prompt, got "
                f"{type(source).__name__}; run the prompt into a new {name} of "
                f"this layer first"
            )
        assert isinstance(source, StaticKVCache)
        if (source.layer, source.ring_rows) != (self.layer, self.ring_rows):
            raise ValueError(
                f"source holds a layer with {source.describe()} in "
                f"{V.counted(source.ring_rows, 'row')}, this cache {self.describe()} in "
                f"{self.ring_rows}; load caches of one layer"
            )
        if source.key is None or source.lengths is None:
            raise ValueError("source holds no tokens: run the prompt into it first")
        batch = V.check_positive_int("batch", batch)
        if self.key is not None and batch != self.key.shape[0]:
            raise ValueError(
                f"batch must be the rows of this cache's buffers, {self.key.shape[0]}, got "
                f"batch={batch}; pass batch={self.key.shape[0]}, or cache.reset(drop=True) "
                f"first to allocate buffers for another batch"
            )
        self._check_rows(rows, source.key, batch)
        if self.key is not None:
            held = (*self.key.shape[2:], self.key.dtype, self.key.device)
            new = (*source.key.shape[2:], source.key.dtype, source.key.device)
            if held != new:
                raise ValueError(
                    f"source holds keys of (kv heads, head_dim, dtype, device) = {new}, this "
                    f"cache's buffers {held}; load caches of one layer of one model"
                )

    @staticmethod
    def _check_rows(rows: object, key: torch.Tensor, batch: int) -> None:
        """``rows``: one distinct index in ``[0, batch)`` per row of ``key`` (b, R, Hkv, D)."""
        form = f"a ({key.shape[0]},) int64 tensor of distinct indices in [0, batch={batch})"
        if not isinstance(rows, torch.Tensor) or rows.is_floating_point() or rows.is_complex() or (
            rows.dtype == torch.bool
        ):
            got = f"dtype {rows.dtype}" if isinstance(rows, torch.Tensor) else type(rows).__name__
            raise TypeError(f"rows must be {form}, got {got}; e.g. torch.tensor([0, 2])")
        if rows.shape != (key.shape[0],):
            raise ValueError(
                f"rows must be {form}, one per row of source, got shape {tuple(rows.shape)}; "
                f"pass {V.counted(key.shape[0], 'index', 'indices')}, one per prompt the source "
                f"holds"
            )
        if rows.device.type != "cpu" and rows.device != key.device:
            raise ValueError(
                f"rows must be on the CPU or the caches' device {key.device}, got {rows.device}"
            )
        if V.values_unreadable():
            return
        values = rows.tolist()
        bad = [x for x in values if not 0 <= x < batch]
        if bad or len(set(values)) != len(values):
            why = f"{bad[0]} is out of range" if bad else "an index repeats"
            raise ValueError(
                f"rows must be {form}, got {values[:16]} ({why}); give each prompt its own row "
                f"of the batch"
            )

    def _new_mask(self) -> None:
        assert self.key is not None
        self.key_padding_mask = torch.zeros(
            self.key.shape[:2], dtype=torch.bool, device=self.key.device
        )
        _mark_static(self.key_padding_mask)


class StaticDilatedKVCache(DilatedLayer, StaticKVCache):
    """Keys and values of one causal dilated attention layer in fixed buffers, for decoding
    with static shapes (Note [A decode step with static shapes]).

    Pass it as ``cache=`` to :func:`dilated_attention.dilated_attention` (or a layer) exactly
    like a :class:`~dilated_attention.DilatedKVCache`: the first call (the prompt) allocates the
    buffers for its batch, heads, head dim, dtype and device; each later call of one token per
    row is one static step, which can run inside ``torch.compile`` or be captured in a CUDA
    graph. One cache per layer.

    Args:
        segment_lengths: the layer's ``w`` per branch.
        dilation_rates: the layer's ``r`` per branch.
        max_length: the most tokens a row will take (``None``: no limit); segments longer than
            it need only that many rows.

    Attributes:
        ring_rows, key, value, key_padding_mask, lengths: as in :class:`StaticKVCache`.

    Raises:
        ValueError: a bad schedule or ``max_length``.
    """


def _mask_or_none(mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """``mask`` (B, n) bool, or no key hidden for ``like``'s (B, n, ...) rows."""
    if mask is not None:
        return mask
    return torch.zeros(like.shape[:2], dtype=torch.bool, device=like.device)


def _mark_static(buffer: torch.Tensor) -> None:
    """Tell ``torch.compile`` that ``buffer``'s memory never moves (its CUDA graphs then read
    and write it in place instead of copying it in at every replay)."""
    mark = getattr(torch._dynamo, "mark_static_address", None)
    if mark is not None:
        mark(buffer)
