"""The keys and values causal dilated attention still needs while decoding: a bounded cache.

Note [Bounded dilated cache]
    A token at position ``p`` reads, in branch ``(w, r)``, only keys of its own segment, from
    ``(p // w) * w`` to ``p`` (Note [Decoding rows] in ``decode.py``). So once the sequence has
    ``N`` tokens, no later token reads a key before ``min over branches of (N // w) * w``, which
    is less than the longest segment ``W`` behind ``N``: after each call the cache keeps the rows
    from there on, fewer than ``W`` of them, whatever ``N`` is. (Segments of different lengths
    need not nest: with ``w = 10`` and ``16`` the token at 17 reads from 10.)

    Decoding appends a few rows per call, so the rows live in a buffer with ``headroom`` spare
    rows (an eighth of ``W``, at least 64) and new rows are written in place: the rows a call
    reads are a view of the buffer, not a concatenation (which would copy up to ``W`` rows per
    token: 134 MB at ``W`` = 32K, 16 heads of 128 in bf16). When the headroom is used up the held
    rows move to the buffer's start, one copy per ``headroom`` tokens. A call with more rows than
    the headroom (a prompt, a chunk) reads a concatenation made for it, and the buffer is then
    rebuilt around the rows later tokens read. Where autograd records (grad mode on), every call
    concatenates instead, so no tensor a backward saved is ever written in place. ``nbytes`` is
    the buffers' size: at most ``W + headroom`` rows of keys, values and mask.

Shape legend: B batch, n new positions, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import torch

from .. import _validation as V


class DilatedKVCache:
    """Keys and values of one causal dilated attention layer, for decoding.

    Pass it as ``cache=`` to :func:`dilated_attention.dilated_attention` with the new tokens'
    queries, keys and values: the call appends the keys and values, attends the new queries to
    every key they can read (exactly the rows of the full causal forward), and drops the rows no
    later token can read (Note [Bounded dilated cache]).

    Args:
        segment_lengths: the layer's ``w`` per branch.
        dilation_rates: the layer's ``r`` per branch.

    Attributes:
        length: tokens seen so far (the position of the next token).
        start: position of the first row still held.
        headroom: spare rows of the buffers (Note [Bounded dilated cache]).
    """

    def __init__(
        self,
        segment_lengths: list[int] | tuple[int, ...],
        dilation_rates: list[int] | tuple[int, ...],
    ) -> None:
        segs, rates = V.check_branches(segment_lengths, dilation_rates)
        self.segment_lengths, self.dilation_rates = segs, rates
        self.headroom = max(64, max(segs) // 8)
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

    def check(
        self,
        segments: tuple[int, ...],
        rates: tuple[int, ...],
        key: torch.Tensor,
    ) -> None:
        """Raise ``ValueError`` if ``key`` (B, n, Hkv, D) or the schedule cannot extend this
        cache: another layer's schedule, batch size, key/value heads, head dim, dtype or
        device."""
        if (segments, rates) != (self.segment_lengths, self.dilation_rates):
            raise ValueError(
                f"cache holds a layer with segment_lengths={list(self.segment_lengths)}, "
                f"dilation_rates={list(self.dilation_rates)}, got segment_lengths="
                f"{list(segments)}, dilation_rates={list(rates)}; use one cache per layer"
            )
        if self.key is None:
            return
        held = (self.key.shape[0], *self.key.shape[2:], self.key.dtype, self.key.device)
        new = (key.shape[0], *key.shape[2:], key.dtype, key.device)
        if held != new:
            raise ValueError(
                f"cache holds keys of (batch, kv heads, head_dim, dtype, device) = {held}, got "
                f"{new}; use a new DilatedKVCache for another batch or model"
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
        if torch.is_grad_enabled() or rows > self.headroom or self._buffers[0] is None:
            read = [self._joined(i, x) for i, x in enumerate(new)]
            self.length += rows
            self._keep(read)
        else:
            read = self._write_in_place(new)
            self.length += rows
            keep_from = self._keep_from()
            self._lo += keep_from - self.start
            self.start = keep_from
        return read[0], read[1], read[2], start

    def _keep_from(self) -> int:
        """The first position a token after the ``length`` seen so far can read."""
        return min((self.length // w) * w for w in self.segment_lengths)

    def _joined(self, index: int, new: torch.Tensor | None) -> torch.Tensor | None:
        """The held rows of buffer ``index`` followed by ``new``, as a new tensor (``new``
        itself when nothing is held)."""
        held = self._held(index)
        if new is None:
            return held
        return new if held is None or held.shape[1] == 0 else torch.cat([held, new], dim=1)

    def _keep(self, read: list[torch.Tensor | None]) -> None:
        """Rebuild the buffers from a call's rows ``read`` (positions ``start`` to ``length``):
        the rows later tokens read, plus headroom; under grad mode, views of ``read``."""
        keep_from = self._keep_from()
        first = keep_from - self.start
        if torch.is_grad_enabled():
            self._buffers = [None if x is None else x[:, first:] for x in read]
        else:
            self._buffers = [None if x is None else _with_headroom(x[:, first:], self.headroom)
                             for x in read]  # fmt: skip
        self._owned = not torch.is_grad_enabled()
        self._lo, self._hi = 0, self.length - keep_from
        self.start = keep_from

    def _write_in_place(self, new: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Write ``new`` after the held rows (moving them to the buffers' start, or into larger
        buffers, when the headroom is used up); the held rows and ``new`` as views."""
        rows, held = new[0].shape[1], self._hi - self._lo
        capacity = self._buffers[0].shape[1]
        # Buffers made under torch.inference_mode cannot be written outside it.
        frozen = self._buffers[0].is_inference() and not torch.is_inference_mode_enabled()
        if not self._owned or frozen or held + rows > capacity:
            self._buffers = [None if b is None else _with_headroom(b[:, self._lo : self._hi],
                                                                   self.headroom + rows)
                             for b in self._buffers]  # fmt: skip
            self._owned, self._lo, self._hi = True, 0, held
        elif self._hi + rows > capacity:
            for b in self._buffers:
                if b is not None:
                    b[:, :held] = b[:, self._lo : self._hi].clone()
            self._lo, self._hi = 0, held
        for b, x in zip(self._buffers, new, strict=True):
            if b is not None and x is not None:
                b[:, self._hi : self._hi + rows] = x
        self._hi += rows
        return [self._held(i) for i in range(3)]


def _with_headroom(rows: torch.Tensor, headroom: int) -> torch.Tensor:
    """A new buffer holding ``rows`` (B, n, ...) followed by ``headroom`` unwritten rows."""
    buffer = rows.new_empty(rows.shape[0], rows.shape[1] + headroom, *rows.shape[2:])
    buffer[:, : rows.shape[1]] = rows
    return buffer
