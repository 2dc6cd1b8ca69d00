"""The decoding caches of a layer of local windowed attention: they hold only its window.

Note [A window cache]
    A causal layer with ``window_size=(left, right)`` gives the token at position ``p`` the keys
    ``p - left .. p`` (the right side reaches no later key under causality; Note [Local windows,
    soft-capping and sinks] in ``sinks.py``). So once the sequence has ``N`` tokens no later
    token reads a key before ``N - left``: a cache keeps the last ``left`` keys and values
    (with their padding mask), whatever ``N`` is, and its memory is the window's. The layer
    kind is :class:`WindowLayer` (``first_read``: ``N - left``; ``reach``: ``left + 1``
    positions per token); the rows are kept by the same machinery as the dilated layer's:

    * :class:`WindowKVCache`: buffers that grow with what they hold, up to the window plus
      spare rows, new rows written in place (Note [Bounded dilated cache] in ``kv_cache.py``).
      A call of ``n`` new tokens reads the held rows and its own, its queries at the last
      ``n`` positions (end-aligned), each seeing its window there: exactly the rows of the full
      causal forward, for a prompt, a chunk or one token.
    * :class:`StaticWindowKVCache`: a ring of ``R = left + 1`` fixed rows holding position ``x``
      at row ``x mod R`` (Note [A decode step with static shapes] in ``static_cache.py``). The
      token at ``p`` overwrites position ``p - R``, which it does not read, so after its write
      the ring holds exactly its window once ``p >= left``; before that the rows past ``p`` are
      not written yet (or hold a sequence from before ``reset()``) and are hidden
      (:meth:`StaticWindowKVCache.hidden_slots`, with the padding mask). A softmax does not
      depend on the order of its keys, so the one-token step is one call of the token against
      the whole ring, not causal, with that mask: static shapes, the rows' positions on the
      device, nothing read on the host, capturable in a CUDA graph. A prompt or a chunk runs
      eagerly: the held rows from ``first - left`` joined with the new ones, end-aligned.

    Soft-capping and sinks act on the scores and the denominator of each row, whatever keys it
    reads, so the cached rows with them equal the full forward's too.

Shape legend: B batch, R ring rows, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import torch

from ... import _validation as V
from .kv_cache import GrowingKVCache, LayerCache
from .static_cache import StaticKVCache

__all__ = ["StaticWindowKVCache", "WindowKVCache", "WindowLayer", "check_layer_window"]


def check_layer_window(window_size: object, what: str = "window_size") -> tuple[int, int]:
    """A local layer's ``(left, right)`` window, checked: a pair of ints (``-1`` = unbounded on
    that side) with a bounded left side (a layer whose tokens read every earlier key is dense
    attention, with nothing local to cache).

    Raises:
        TypeError: not a pair of ints.
        ValueError: a side below -1, or an unbounded left side.
    """
    window = V.check_window_size(window_size)
    if window is None or window[0] < 0:
        raise ValueError(
            f"{what} must bound the left side, (left >= 0, right), got {what}="
            f"{window_size!r}; a sliding window of W tokens is (W - 1, 0), and a layer that "
            f"reads every earlier key is dense attention (DilatedAttention([N], [1]))"
        )
    return window


class WindowLayer(LayerCache):
    """The reads of a causal layer of local windowed attention (Note [A window cache]): a token
    at ``p`` reads the keys ``p - left .. p``.

    Args:
        window_size: the layer's ``(left, right)`` (``left >= 0``); a sliding window of ``W``
            tokens is ``(W - 1, 0)``.
        max_length: the most tokens this cache will take (``None``: no limit).

    Raises:
        TypeError / ValueError: a bad ``window_size`` or ``max_length``.
    """

    _reach_words = "the window's rows"
    _shorter = "use a shorter window"

    def __init__(self, window_size: tuple[int, int], *, max_length: int | None = None) -> None:
        self.window_size = check_layer_window(window_size)
        super().__init__(max_length=max_length)

    @property
    def layer(self) -> tuple[object, ...]:
        return ("window", self.window_size)

    @property
    def reach(self) -> int:
        return self.window_size[0] + 1

    def first_read(self, length: int) -> int:
        """``length - left``: the first key the token at ``length`` reads."""
        return max(0, length - self.window_size[0])

    def describe(self) -> str:
        return f"window_size={self.window_size}"

    def check_window(self, window: tuple[int, int] | None) -> None:
        """Raise ``ValueError`` unless ``window`` (a call's ``window_size``) is this cache's
        layer's."""
        if window != self.window_size:
            raise ValueError(
                f"cache holds a layer with window_size={self.window_size}, got window_size="
                f"{window}; pass the layer's window_size with its cache (one cache per layer)"
            )


class WindowKVCache(WindowLayer, GrowingKVCache):
    """Keys and values of one causal layer of local windowed attention, for decoding: at most
    its window's rows (Note [A window cache]).

    Pass it as ``cache=`` to :func:`dilated_attention.attention` with the layer's
    ``window_size``, ``is_causal=True`` and the new tokens' queries, keys and values (or to a
    local layer, ``create_multihead_dilated_attention("local", ...)``): the call appends the
    keys and values, attends the new queries to their windows (exactly the rows of the full
    causal forward) and drops the rows no later token reads. One cache per layer.

    Args:
        window_size: the layer's ``(left, right)``, ``left >= 0``.
        max_length: the most tokens this cache will take (``None``: no limit).

    Attributes:
        length, start, headroom: as in
        :class:`~dilated_attention.core.decoding.kv_cache.GrowingKVCache`.

    Raises:
        TypeError / ValueError: a bad ``window_size`` or ``max_length``.
    """


class StaticWindowKVCache(WindowLayer, StaticKVCache):
    """Keys and values of one causal layer of local windowed attention in a ring of
    ``left + 1`` fixed rows, for decoding with static shapes (Note [A window cache]).

    Pass it as ``cache=`` exactly like a :class:`WindowKVCache`: the first call (the prompt)
    allocates the buffers; each later call of one token per row is one static step (no host
    synchronization), which can be captured in a CUDA graph. One cache per layer.

    Args:
        window_size: the layer's ``(left, right)``, ``left >= 0``.
        max_length: the most tokens a row will take (``None``: no limit).

    Attributes:
        ring_rows, key, value, key_padding_mask, lengths: as in
            :class:`~dilated_attention.core.decoding.static_cache.StaticKVCache`.

    Raises:
        TypeError / ValueError: a bad ``window_size`` or ``max_length``.
    """

    def hidden_slots(self) -> torch.Tensor:
        """(B, R) bool, ``True`` where a one-token step must not read the ring (Note [A window
        cache]): rows past each row's position, which its tokens have not written, and padded
        keys. The new token's key is already written at row ``lengths mod R``. Device
        arithmetic only."""
        assert self.key is not None and self.lengths is not None
        slots = torch.arange(self.ring_rows, device=self.key.device)
        hidden = slots.view(1, -1) > self.lengths.view(-1, 1)
        if self.key_padding_mask is not None:
            hidden = hidden | self.key_padding_mask
        return hidden
