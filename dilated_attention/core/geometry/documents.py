"""Packed documents: documents back to back in the rows of a batch, each attending only within
itself and segmented from its own first token.

Note [Packed documents]
    ``cu_seqlens`` (FlashAttention's varlen convention) holds the documents' offsets among the
    batch's ``B * N`` positions read row after row: 0, then where each document ends, the last
    being ``B * N``. Every row starts a document (no document crosses rows); with ``B = 1`` it is
    FlashAttention's ``(total_tokens, H, D)`` batch seen as ``(1, total_tokens, H, D)``.

    A packed call equals the call of each document alone: branch ``(w, r)`` cuts a document into
    segments of ``w`` from the document's first token (its last segment shorter, ``w`` above
    the document's length one segment), the head offsets and causality count from there, and
    no key of another document is seen. Rows of a batch hold their documents independently, so
    the batch is one row of ``B * N`` positions (:func:`flatten`), and the executor's plan is
    every document's row groups (``plan_branches`` of its length) moved to where it starts
    (:func:`document_groups`). A row group is consecutive segments of one document, so the
    gathers, the kernel calls and the exact log-sum-exp merge are those of one sequence; dense
    attention is the one branch ``(N, 1)``. Documents of one length share their groups'
    indices (``plan_branches`` is cached by length).

Shape legend: B batch, N positions per row, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import numbers
from collections.abc import Sequence
from dataclasses import replace

import torch

from ... import _validation as V
from .segment import RowGroup, effective_branches, plan_branches

__all__ = [
    "check_cu_seqlens", "check_offsets", "document_groups", "document_positions", "flatten",
    "last_document", "unflatten",
]  # fmt: skip

_FORM = (
    "cu_seqlens holds the documents' offsets in the batch's B * N positions read row after row: "
    "0, then where each document ends, ending at B * N, e.g. cu_seqlens=[0, 3, 10] for documents "
    "of 3 and 7 tokens in one row of 10"
)


def _values(cu_seqlens: object, device: torch.device) -> list[int]:
    """The offsets as Python ints, or a TypeError / ValueError naming the form."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or (
            cu_seqlens.dtype == torch.bool
        ):
            raise TypeError(
                f"cu_seqlens must hold ints, got a {cu_seqlens.dtype} tensor; pass "
                f"cu_seqlens.to(torch.int32). {_FORM}"
            )
        if cu_seqlens.dim() != 1:
            raise ValueError(
                f"cu_seqlens must be 1-D, got shape {tuple(cu_seqlens.shape)}. {_FORM}"
            )
        if cu_seqlens.device.type != "cpu" and cu_seqlens.device != device:
            raise ValueError(
                f"cu_seqlens is on {cu_seqlens.device} and the tensors on {device}: pass it on "
                f"{device} or the CPU (it is read once to plan the calls)"
            )
        return [int(x) for x in cu_seqlens.tolist()]
    if isinstance(cu_seqlens, (str, bytes)) or not isinstance(cu_seqlens, Sequence):
        raise TypeError(
            f"cu_seqlens must be a 1-D int tensor or a sequence of ints, got "
            f"{type(cu_seqlens).__name__}. {_FORM}"
        )
    bad = [x for x in cu_seqlens if isinstance(x, bool) or not isinstance(x, numbers.Integral)]
    if bad:
        raise TypeError(f"cu_seqlens must hold ints, got {bad[0]!r}. {_FORM}")
    return [int(x) for x in cu_seqlens]


def _shown(offsets: list[int]) -> str:
    return str(offsets) if len(offsets) <= 12 else f"{offsets[:12]} ... ({len(offsets)} offsets)"


def check_cu_seqlens(
    cu_seqlens: object, q: torch.Tensor, k: torch.Tensor, cache: object = None
) -> tuple[int, ...]:
    """Check document offsets over the batch of q (B, N, H, D) and k (B, N, Hkv, D)
    (Note [Packed documents]).

    Args:
        cu_seqlens: a 1-D int tensor (on the CPU or the tensors' device) or a sequence of ints.
        cache: the decoding cache (or a model's list of them) a packed prompt fills (Note
            [A packed prompt]), or None.

    Returns:
        The offsets as a tuple of ints: 0, each document's end, ``B * N``; ``(0,)`` for a batch
        of 0 sequences (Note [An empty packed batch]).

    Raises:
        TypeError: not ints, or not a tensor or a sequence.
        ValueError: not 1-D, on another device, not starting at 0, not increasing, not
            ending at ``B * N`` (other than ``[0]`` for a batch of 0), a document crossing
            from one row into the next, or a query of another length than the key; with a
            ``cache``, one that holds positions already, or rows whose last documents differ
            in length.
    """
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"packed documents (cu_seqlens) need a query of the key's length (each document's "
            f"queries are its own positions), got query.shape={tuple(q.shape)}, "
            f"key.shape={tuple(k.shape)}; decode each document in its own row with its own cache"
        )
    batch, seq_len = q.shape[:2]
    offsets = check_offsets(cu_seqlens, batch, seq_len, q.device)
    if cache is not None:
        _check_prompt_cache(cache, offsets, batch, seq_len)
    return offsets


def check_offsets(
    cu_seqlens: object, batch: int, seq_len: int, device: torch.device
) -> tuple[int, ...]:
    """:func:`check_cu_seqlens` over ``batch`` rows of ``seq_len`` positions on ``device``
    (a ring checks the offsets of the whole sharded row)."""
    offsets = _values(cu_seqlens, device)
    total = batch * seq_len
    if batch == 0:  # Note [An empty packed batch]
        if offsets != [0]:
            raise ValueError(
                f"a batch of 0 sequences holds no documents, so its cu_seqlens is [0] (the "
                f"offsets start and end at B * N = 0), got {_shown(offsets)}; pass "
                f"cu_seqlens=[0] (the result is empty, as for any batch of 0), or skip the call"
            )
        return (0,)
    if len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != total:
        raise ValueError(
            f"cu_seqlens must start at 0 and end at B * N = {batch} * {seq_len} = {total} (the "
            f"tensors' positions), got {_shown(offsets)}. {_FORM}"
        )
    steps = [(a, b) for a, b in itertools.pairwise(offsets) if b <= a]
    if steps:
        a, b = steps[0]
        raise ValueError(
            f"cu_seqlens must be strictly increasing (every document holds a token), got {a} "
            f"then {b}. {_FORM}"
        )
    known = set(offsets)
    crossing = [row * seq_len for row in range(1, batch) if row * seq_len not in known]
    if crossing:
        raise ValueError(
            f"a document crosses from row {crossing[0] // seq_len - 1} into row "
            f"{crossing[0] // seq_len}: cu_seqlens must hold every row start (multiples of N = "
            f"{seq_len}), missing {crossing[0]}; end each row's last document there, or pack "
            f"the batch into one row of {total}"
        )
    return tuple(offsets)


# Note [An empty packed batch]
#     A batch of 0 sequences gives empty results everywhere in the library, and so it does
#     packed: its offsets start and end at B * N = 0, which is ``[0]``, no document at all (a
#     document of 0 tokens, ``[0, 0]``, is refused as anywhere else). The call then runs as the
#     same empty batch unpacked (there is nothing a document could change), and a packed prompt
#     into caches is the empty prompt of each row's whole length.


# Note [A packed prompt]
#     A packed batch given with decoding caches is a prompt: every document is computed as
#     alone, and each row's cache takes the keys and values of the row's *last* document, from
#     its first token, so that the next tokens continue that document (generation continues one
#     sequence per row; earlier documents are context of their own and end where the next
#     begins). A cache holds one length for all rows, so the rows' last documents must be of
#     one length (always so with one row, FlashAttention's ``(total_tokens, H, D)`` batch), and
#     the caches must be empty: a prompt starts its documents.


def last_document(documents: tuple[int, ...], batch: int, seq_len: int) -> int:
    """The length of every row's last document (Note [A packed prompt]).

    Raises:
        ValueError: rows whose last documents differ in length.
    """
    if batch == 0:  # Note [An empty packed batch]
        return seq_len
    ends = [row * seq_len for row in range(1, batch + 1)]
    lengths = [end - documents[bisect.bisect_left(documents, end) - 1] for end in ends]
    if len(set(lengths)) > 1:
        raise ValueError(
            f"a packed prompt with cache= continues each row's last document, which must be of "
            f"one length in every row (the cache holds one length), got {lengths[:8]}; prompt "
            f"with one row, or rows that end in documents of one length"
        )
    return lengths[0]


def _check_prompt_cache(
    cache: object, documents: tuple[int, ...], batch: int, seq_len: int
) -> None:
    """Empty caches and one last-document length (Note [A packed prompt]); the caches
    themselves are checked where they are used."""
    held = [getattr(c, "length", 0) for c in (cache if isinstance(cache, list) else [cache])]
    if any(isinstance(n, int) and n > 0 for n in held):
        raise ValueError(
            f"a packed prompt (cu_seqlens with cache=) starts its documents, so its caches must "
            f"be empty, got one holding {V.counted(max(held), 'position')}; decode the tokens "
            f"that follow "
            f"without cu_seqlens, or start from new caches"
        )
    last_document(documents, batch, seq_len)


@functools.lru_cache(maxsize=64)
def document_groups(
    documents: tuple[int, ...],
    num_heads: int,
    segment_lengths: tuple[int, ...],
    dilation_rates: tuple[int, ...],
) -> tuple[RowGroup, ...]:
    """Every document's row groups, where the document starts (Note [Packed documents]).

    Args:
        documents: offsets from :func:`check_cu_seqlens`.
        num_heads: H.
        segment_lengths, dilation_rates: the schedule (``w`` above a document's length is one
            segment of it).

    Returns:
        Row groups over the positions ``0 .. documents[-1]``, document after document (cached:
        every layer of a packed batch, and every step over the same packing, asks again).
    """
    groups: list[RowGroup] = []
    for start, end in itertools.pairwise(documents):
        segs, rates = effective_branches(end - start, num_heads, segment_lengths, dilation_rates)
        groups.extend(replace(g, start=g.start + start)
                      for g in plan_branches(end - start, num_heads, segs, rates))  # fmt: skip
    return tuple(groups)


def document_positions(
    documents: tuple[int, ...], device: torch.device, span: tuple[int, int] | None = None
) -> torch.Tensor:
    """Each position's place in its own document (0 at every document's first token), over the
    ``documents[-1]`` positions of the flattened batch, or over ``span`` ``[lo, hi)`` of them (a
    ring rank's shard): int64 (B * N,) or (hi - lo,)."""
    lo, hi = (0, documents[-1]) if span is None else span
    positions = torch.arange(lo, hi, device=device)
    starts = torch.tensor(documents[:-1], dtype=torch.int64, device=device)
    return positions - starts[torch.searchsorted(starts, positions, right=True) - 1]


def flatten(x: torch.Tensor | None) -> torch.Tensor | None:
    """(B, N, ...) -> (1, B * N, ...): the batch's rows as one row of documents."""
    return None if x is None else x.reshape(1, x.shape[0] * x.shape[1], *x.shape[2:])


def unflatten(
    out: torch.Tensor, lse: torch.Tensor, batch: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`flatten` for a call's results: ``out`` (1, B * N, H, D) ->
    (B, N, H, D) and ``lse`` (1, H, B * N) -> (B, H, N)."""
    heads = lse.shape[1]
    out = out.reshape(batch, seq_len, *out.shape[2:])
    lse = lse.reshape(heads, batch, seq_len).transpose(0, 1)
    return out, lse
