"""Compressed keys and values (NSA's compressed branch): windows of positions pooled into one
key and one value each, and the rule for which of them a query may see.

Note [Compressed keys]
    Native Sparse Attention (DeepSeek, arXiv 2502.11089) summarises the keys and values by
    windows of ``block`` (the paper's ``l``) consecutive positions taken every ``stride`` (its
    ``d``) positions: window ``c`` covers positions ``[c * stride, c * stride + block)``. Only
    whole windows are made, ``Nc = (N - block) // stride + 1`` of them (0 when ``N < block``),
    so no compressed key stands for positions past the sequence. ``stride <= block``: every
    position lies in some window (windows overlap when ``stride < block``, as in the paper's
    ``d < l``).

    NSA maps each window through a learned MLP (with a position encoding inside the window);
    :func:`compress_kv` takes the mean, the choice without parameters. A model with a
    compression of its own computes its pooled ``(B, Nc, Hkv, D)`` tensors itself and uses them
    the same way: the visibility rule does not depend on how a window was pooled. Gradients
    flow through the pooling to ``key`` and ``value``.

    A query at position ``p`` sees compressed key ``c`` only once the whole window lies at or
    before it: ``c * stride + block - 1 <= p`` (:func:`compressed_key_mask`); a window that
    reaches past ``p`` would carry later keys into it. A causal query shorter than the key is
    end-aligned (its row ``i`` is position ``Nk - Nq + i``), as everywhere in the library. A
    query before the end of the first window sees no compressed key: its row of the mask is
    empty, and an attention over that branch gives it nothing (``lse = -inf``), which the other
    branches (selected blocks, the sliding window) make up for.

Shape legend: B batch, N positions, Nq query rows, Nk key positions, Nc compressed keys,
Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .. import _validation as V

__all__ = ["compress_kv", "compressed_key_mask", "num_windows", "window_means"]


def num_windows(length: int, block: int, stride: int) -> int:
    """How many whole windows of ``block`` positions, every ``stride``, fit in ``length``
    positions (Note [Compressed keys])."""
    return 0 if length < block else (length - block) // stride + 1


def window_means(x: torch.Tensor, block: int, stride: int) -> torch.Tensor:
    """The mean of every whole window of ``block`` positions, every ``stride`` positions
    (Note [Windows as sums of pieces]).

    Accumulated in float32 (float64 for float64 input) and returned so; differentiable in
    ``x``, with a gradient that writes ``x``'s size once (and supports double backward).

    Args:
        x: (B, N, H, D).

    Returns:
        (B, num_windows(N, block, stride), H, D) in float32 or float64.
    """
    if x.shape[1] < block:
        return x[:, :0].to(torch.promote_types(x.dtype, torch.float32))
    return _WindowMeans.apply(x, _Pieces.of(x.shape[1], block, stride))  # type: ignore[no-any-return]


@dataclass(frozen=True)
class _Pieces:
    """Windows of ``block`` positions every ``stride`` cut into pieces of ``size = gcd(block,
    stride)`` positions: window ``c`` is pieces ``c * step ... c * step + per - 1``.

    Note [Windows as sums of pieces]
        With ``g = gcd(block, stride)``, every window is ``block / g`` whole pieces of ``g``
        positions, and consecutive windows start ``stride / g`` pieces apart. The means are
        made from the pieces' sums (one read of ``x``, then ``block / g`` strided adds of
        ``Nc`` rows), and the gradient the other way round: each window's gradient added to
        its pieces' (``Nc`` rows, ``block / g`` times), then every piece's written over its
        ``g`` positions in one pass. A strided ``unfold`` of ``x`` would do the same sums, but
        its gradient (``unfold_backward``, a ``block``-wide view expanded to float32) costs
        ~20x more at NSA's ``block=32, stride=16`` (1.6 ms per 64K-token tensor on an H200).

    Attributes:
        size: positions per piece, ``gcd(block, stride)``.
        per: pieces per window, ``block / size``.
        step: pieces between the starts of consecutive windows, ``stride / size``.
        windows: whole windows ``Nc``.
    """

    size: int
    per: int
    step: int
    windows: int

    @classmethod
    def of(cls, length: int, block: int, stride: int) -> _Pieces:
        size = math.gcd(block, stride)
        return cls(size, block // size, stride // size, num_windows(length, block, stride))

    @property
    def count(self) -> int:
        """The pieces the windows cover (those of the positions ``[0, count * size)``)."""
        return (self.windows - 1) * self.step + self.per

    def _starts(self, first: int) -> slice:
        """The pieces at offset ``first`` of every window, along the pieces' dimension."""
        return slice(first, first + (self.windows - 1) * self.step + 1, self.step)

    def means(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, N, ...) -> the windows' means (B, Nc, ...) in float32 (float64)."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        pieces = x[:, : self.count * self.size].unflatten(1, (self.count, self.size))
        sums = pieces.sum(2, dtype=dtype)
        total = sums[:, self._starts(0)]
        for first in range(1, self.per):
            total = total + sums[:, self._starts(first)]
        return total / (self.per * self.size)

    def spread(
        self, grad: torch.Tensor, shape: torch.Size, dtype: torch.dtype
    ) -> torch.Tensor:
        """The gradient of :meth:`means` at ``grad`` (B, Nc, ...): (B, N, ...) = ``shape`` in
        ``dtype``, each window's ``grad / block`` added on each of its positions. Out of place
        throughout (``torch.func``'s transforms run it too)."""
        grad = grad / (self.per * self.size)
        if self.step > 1:  # the windows' gradients every `step` pieces, zeros between
            gaps = grad.new_zeros(grad.shape[0], self.windows, self.step - 1, *grad.shape[2:])
            grad = torch.cat([grad.unsqueeze(2), gaps], 2).flatten(1, 2)
            grad = grad[:, : (self.windows - 1) * self.step + 1]
        pieces = -(-shape[1] // self.size)  # the last one may reach past the positions
        rest = grad.shape[2:]
        terms = [  # each window's gradient on its offset-`first` pieces
            torch.cat([grad.new_zeros(grad.shape[0], first, *rest), grad,
                       grad.new_zeros(grad.shape[0], pieces - first - grad.shape[1], *rest)], 1)
            for first in range(self.per)
        ]  # fmt: skip
        sums = sum(terms[1:], terms[0])
        spread = sums.to(dtype).unsqueeze(2).expand(*sums.shape[:2], self.size, *sums.shape[2:])
        return spread.reshape(sums.shape[0], pieces * self.size, *sums.shape[2:])[:, : shape[1]]


class _WindowMeans(torch.autograd.Function):
    """:meth:`_Pieces.means` with :meth:`_Pieces.spread` as its gradient (made of
    differentiable operations, so twice differentiable), its own forward derivative and a
    generated vmap rule (``torch.func``'s transforms)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, pieces: _Pieces) -> torch.Tensor:
        return pieces.means(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[torch.Tensor, _Pieces], output: Any) -> None:
        x, pieces = inputs
        ctx.pieces, ctx.shape, ctx.dtype = pieces, x.shape, x.dtype

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.pieces.spread(grad, ctx.shape, ctx.dtype), None

    @staticmethod
    def jvp(ctx: Any, x_tangent: torch.Tensor, _: None) -> torch.Tensor:
        return ctx.pieces.means(x_tangent)  # the means are linear in x


def _check_window(block: object, stride: object) -> tuple[int, int]:
    block = V.check_positive_int("block", block)
    stride = V.check_positive_int("stride", stride)
    if stride > block:
        raise ValueError(
            f"stride must be at most block (windows of block={block} positions every stride "
            f"positions, so that every position lies in a window), got stride={stride}; pass "
            f"stride <= block, e.g. NSA's block=32, stride=16"
        )
    return block, stride


def compress_kv(
    key: torch.Tensor, value: torch.Tensor, *, block: int, stride: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values mean-pooled over windows of ``block`` positions every ``stride``
    positions: NSA's compressed keys with mean pooling (Note [Compressed keys]).

    NSA pools each window with a learned MLP; a model that does so computes its own pooled
    tensors and uses them in place of these (with the same :func:`compressed_key_mask`).
    Gradients flow through the pooling to ``key`` and ``value``. A window covers positions
    ``[c * stride, c * stride + block)``; only whole windows are made. Example, 10 positions,
    ``block=4, stride=2``: windows ``[0, 4), [2, 6), [4, 8), [6, 10)``, so ``Nc = 4``.

    Args:
        key: (B, N, Hkv, D).
        value: (B, N, Hkv, D).
        block: positions per window (NSA's ``l``).
        stride: positions between the starts of consecutive windows (NSA's ``d``), at most
            ``block``.

    Returns:
        ``(k_cmp, v_cmp)``, each (B, Nc, Hkv, D) in the input dtype (averaged in float32, or
        float64 for float64 input), ``Nc = (N - block) // stride + 1`` (0 when ``N < block``).

    Raises:
        TypeError: not floating tensors, or of different dtypes.
        ValueError: not 4-D, shapes or devices that differ, ``block`` or ``stride`` not a
            positive int, ``stride > block``.
    """
    k = V.check_tensor("key", key)
    v = V.check_tensor("value", value)
    if v.dtype != k.dtype:
        raise TypeError(
            f"value must have the same dtype as key, got value.dtype={v.dtype} and "
            f"key.dtype={k.dtype}; cast with .to(key.dtype)"
        )
    if v.device != k.device:
        raise ValueError(
            f"value must be on the same device as key, got value.device={v.device} and "
            f"key.device={k.device}; move it with .to(key.device)"
        )
    if v.shape != k.shape:
        raise ValueError(
            f"key and value must have the same shape (batch, seq_len, num_kv_heads, head_dim), "
            f"got key.shape={tuple(k.shape)}, value.shape={tuple(v.shape)}"
        )
    block, stride = _check_window(block, stride)
    return (
        window_means(k, block, stride).to(k.dtype),
        window_means(v, block, stride).to(v.dtype),
    )


def compressed_key_mask(
    query_len: int,
    key_len: int,
    *,
    block: int,
    stride: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Which compressed keys each query sees (Note [Compressed keys]): compressed key ``c``
    (window ``[c * stride, c * stride + block)``) is visible to the query at position ``p``
    once its whole window lies at or before ``p``. The query rows are the last ``query_len``
    of the ``key_len`` positions (end-aligned): row ``i`` is position
    ``key_len - query_len + i``. Example, ``block=4, stride=2``, 10 positions::

        position    0 1 2 3 4 5 6 7 8 9
        window 0    x x x x . . . . . .   visible from position 3
        window 1    . . x x x x . . . .   visible from position 5

    Args:
        query_len: query rows ``Nq``, at most ``key_len``.
        key_len: key positions ``Nk`` the windows were taken over.
        block, stride: as in :func:`compress_kv`.
        device: where to make the mask (None: the CPU).

    Returns:
        (Nq, Nc) bool, ``True`` = visible; ``Nc = (key_len - block) // stride + 1`` (0 when
        ``key_len < block``). Rows before the end of the first window are all ``False``.

    Raises:
        ValueError: a length, ``block`` or ``stride`` not a positive int, ``stride > block``,
            ``query_len > key_len``.
        TypeError: ``device`` neither a ``torch.device``, a str nor None.
    """
    nq = V.check_positive_int("query_len", query_len)
    nk = V.check_positive_int("key_len", key_len)
    block, stride = _check_window(block, stride)
    if nq > key_len:
        raise ValueError(
            f"query_len must be at most key_len (the query rows are the last query_len of the "
            f"key_len positions, end-aligned), got query_len={nq}, key_len={nk}; pass the key "
            f"length the compressed keys were pooled over"
        )
    if device is not None and not isinstance(device, (torch.device, str)):
        raise TypeError(
            f"device must be a torch.device, a str or None, got {type(device).__name__}; "
            f"e.g. device=query.device"
        )
    positions = torch.arange(nk - nq, nk, device=device)
    ends = torch.arange(num_windows(nk, block, stride), device=device) * stride + (block - 1)
    return ends[None, :] <= positions[:, None]
