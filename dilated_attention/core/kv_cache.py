"""The keys and values causal dilated attention still needs while decoding: a bounded cache.

Note [Bounded dilated cache]
    A token at position ``p`` reads, in branch ``(w, r)``, only keys of its own segment, from
    ``(p // w) * w`` to ``p`` (Note [Decoding rows] in ``decode.py``). So once the sequence has
    ``N`` tokens, no later token reads a key before ``min over branches of (N // w) * w``, which
    is less than the longest segment ``W`` behind ``N``: the cache keeps the rows from there on,
    fewer than ``W`` of them (plus the chunk being appended), whatever ``N`` is. (Segments of
    different lengths need not nest: with ``w = 10`` and ``16`` the token at 17 reads from 10.)
    ``nbytes`` says what it holds.

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
        key, value: (B, length - start, Hkv, D) held rows, or None before the first call.
        key_padding_mask: (B, length - start) bool over the held rows (``True`` = ignore), or
            None while no call has passed a mask.
    """

    def __init__(
        self,
        segment_lengths: list[int] | tuple[int, ...],
        dilation_rates: list[int] | tuple[int, ...],
    ) -> None:
        segs, rates = V.check_branches(segment_lengths, dilation_rates)
        self.segment_lengths, self.dilation_rates = segs, rates
        self.length = 0
        self.start = 0
        self.key: torch.Tensor | None = None
        self.value: torch.Tensor | None = None
        self.key_padding_mask: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the held keys, values and mask."""
        held = [t for t in (self.key, self.value, self.key_padding_mask) if t is not None]
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
        """Drop the rows no new token can read, append ``key``/``value`` (B, n, Hkv, D) and their
        ``key_padding_mask`` (B, n) bool (None: none of them ignored), and return the held keys,
        values, mask (None while no call has passed one) and the position of their first
        row."""
        keep_from = min((self.length // w) * w for w in self.segment_lengths)
        drop = keep_from - self.start
        held = 0 if self.key is None else self.key.shape[1] - drop
        if key_padding_mask is not None or self.key_padding_mask is not None:
            batch, none_ignored = key.shape[0], {"dtype": torch.bool, "device": key.device}
            old = self.key_padding_mask
            old = torch.zeros(batch, held, **none_ignored) if old is None else old[:, drop:]
            new = key_padding_mask
            new = torch.zeros(batch, key.shape[1], **none_ignored) if new is None else new
            self.key_padding_mask = torch.cat([old, new], dim=1)
        if self.key is None or self.value is None:
            self.key, self.value = key, value
        else:
            self.key = torch.cat([self.key[:, drop:], key], dim=1)
            self.value = torch.cat([self.value[:, drop:], value], dim=1)
            self.start = keep_from
        self.length += key.shape[1]
        return self.key, self.value, self.key_padding_mask, self.start
