"""Block masks chosen from the content at run time: each query block keeps the key blocks its
queries match best (MoBA's gate), as a bool tensor on the inputs' device.

Note [MoBA's gate for a block of queries]
    MoBA (Moonshot, "MoBA: Mixture of Block Attention for Long-Context LLMs", arXiv 2502.13189)
    gates each query token: its affinity with key block ``j`` is ``q_t . kbar_j``, ``kbar_j``
    the mean of the block's keys, and the token keeps its top-k blocks. Block-sparse kernels
    (FlashAttention-4's ``block_sparse_tensors``, FlexAttention's ``BlockMask``, ours) take one
    set of key blocks per query *block*, so the gate is aggregated over the block's queries,
    here by the mean over its real rows ``I``::

        affinity(I, j) = mean_{t in I} q_t . kbar_j = qbar_I . kbar_j

    By linearity it is one product of mean-pooled queries with mean-pooled keys: (B, H, Mq, Mk)
    from (Mq + Mk) pooled vectors, never the (Nq, Mk) gate of every token, so the selection
    stays a small part of the attention it prunes. (The max over the block's queries would
    favour a block that one query wants strongly, closer to MoBA's per-token choice, but needs
    that (Nq, Mk) gate.) A block shorter than ``block_size`` (the last one) is the mean of its
    real rows; nothing is padded. The ranking does not depend on the softmax scale. An affinity
    that is not a number (NaN input) ranks below every real one; ties go either way.

    What is kept, for query block ``i`` (query rows ``[i * bs, (i + 1) * bs)``):

    - causal: its *own* blocks, the key blocks that hold its positions (the diagonal: MoBA
      always keeps the query's current block, with the causal mask inside it), plus the
      ``topk`` key blocks with the highest affinity among the blocks before its first position
      (every one of its queries sees those whole). Key blocks after its last position are never
      kept. ``topk`` does not count the own block: MoBA's ``moba_topk = k`` is ``topk = k - 1``.
    - not causal: the ``topk`` key blocks with the highest affinity.

    Only blocks of the query block's document are candidates (packed documents). Exactly
    ``min(topk, candidates)`` blocks are chosen besides the own ones.

    With GQA the choice is per query head (``per="head"``, MoBA's: it repeats K/V for every
    query head), or per key/value head (``per="kv_head"``, NSA's: the query heads of a group
    share one choice, ranked by the sum of their affinities, so a kernel loads each K/V block
    once for the group). The sum over the group's heads is again linear:
    ``(sum_h qbar_h) . kbar``.

    Gradients do not flow through the choice (as in MoBA and NSA, the selection is a discrete
    top-k): the function runs under ``torch.no_grad()`` and returns a bool tensor. The gate's
    inputs learn through the attention over the chosen blocks.

Note [Own blocks of an end-aligned query]
    A causal query shorter than the key holds the last ``Nq`` of the ``Nk`` positions (row
    ``i`` is position ``Nk - Nq + i``), as in ``attention`` and ``block_sparse_attention``; the
    mask has ``Mq = ceil(Nq / bs)`` rows over the query's rows. When ``Nk - Nq`` is a multiple
    of ``bs`` each query block lies in one key block, its diagonal. Otherwise a query block's
    positions span two key blocks and both are its own: each of its queries then sees at least
    the keys of its own key block up to itself (a query never attends nothing).

Note [Selection without host synchronisation]
    The mask is made by tensor operations on the inputs' device (pooling, one einsum, top-k,
    scatter), with no value read on the host: no ``.item()``, no data-dependent shape, no Python
    loop over blocks or rows, so it runs under ``torch.cuda.set_sync_debug_mode("error")`` and
    on tensors without data (the meta device). The arguments' checks read metadata only.
    Packed documents are the exception the library makes everywhere: ``cu_seqlens`` is checked
    on the host (``check_cu_seqlens``), free as a list or a CPU tensor, one read of a device
    tensor; its offsets reach the device by a non-blocking copy from pinned memory (a copy
    from pageable memory may wait for the stream).

Shape legend: B batch, Nq query rows, Nk key positions, H query heads, Hkv key/value heads,
D head dim, bs block size, Mq = ceil(Nq / bs), Mk = ceil(Nk / bs).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import torch

from .. import _validation as V
from ..backends.triton import kernel_module
from ..block_sparse.lists import compact_rows
from ..block_sparse.plan import check_block_size, num_blocks
from ..block_sparse.runtime import check_documents_aligned, same_document
from ..core.geometry.documents import check_cu_seqlens
from .compression import window_means
from .device_choice import choose_on_device, device_modules, on_tensor_cores

__all__ = ["PER", "CandidateRanges", "block_means", "candidate_blocks", "check_selection",
           "chosen_blocks", "own_blocks_width", "select_blocks"]  # fmt: skip

#: The values of ``select_blocks(per=...)``: a choice per query head or per key/value head.
PER = ("head", "kv_head")

@torch.no_grad()
def select_blocks(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    block_size: int,
    topk: int,
    is_causal: bool,
    cu_seqlens: torch.Tensor | list[int] | None = None,
    per: str = "head",
    return_indices: bool = False,
) -> torch.Tensor:
    """The key blocks each query block attends, chosen by MoBA's gate (Note [MoBA's gate for a
    block of queries]): a bool block mask for block-sparse attention.

    Each query block keeps, when causal, its own (diagonal) block, and the ``topk`` key blocks
    it sees whole with the highest affinity: the mean over its queries of their dot product
    with the block's mean key. Nothing after a causal query is kept; without ``is_causal``
    the ``topk`` best of all key blocks are. For example, 4 blocks, ``topk=1``, causal
    (``o`` own, ``x`` chosen)::

        key block    0 1 2 3
        query 0      o . . .
        query 1      x o . .
        query 2      . x o .
        query 3      x . . o

    Gradients do not flow through the choice (as in MoBA and NSA): it runs under
    ``torch.no_grad()``. No host synchronisation (Note [Selection without host
    synchronisation]).

    Args:
        query: (B, Nq, H, D).
        key: (B, Nk, Hkv, D), H % Hkv == 0 (GQA).
        block_size: positions per block ``bs``, for queries and keys; the last block may be
            shorter (its mean is over its real rows).
        topk: key blocks chosen per query block besides the own block (MoBA's ``moba_topk``
            minus 1); fewer where fewer are candidates. 0 keeps the own block alone (causal).
        is_causal: query position ``p`` sees keys ``t <= p``; a query shorter than the key
            holds the last ``Nq`` of the ``Nk`` positions (end-aligned, Note [Own blocks of an
            end-aligned query]).
        cu_seqlens: packed documents as in ``attention`` (offsets over the ``B * N``
            positions, Note [Packed documents] in ``core/geometry/documents.py``): a key block is a
            candidate only in the query block's document. Every document must start at a
            multiple of ``block_size`` within its row, so that no block crosses documents.
        per: ``"head"`` (default): a choice per query head, (B, H, Mq, Mk); ``"kv_head"``: one
            per key/value head, shared by its group of query heads and ranked by the sum of
            their affinities (NSA), (B, Hkv, Mq, Mk).
        return_indices: return the chosen blocks as int32 block indices instead of a bool
            mask: (B, H or Hkv, Mq, K), ``K = min(topk, Mk)`` plus the own blocks' 1 (2 when
            ``Nk - Nq`` is not a multiple of ``block_size``, 0 without ``is_causal``), ``-1``
            where a row has fewer, in no order. ``block_sparse_attention`` takes either; from
            indices its kernels' lists are ``K`` wide rather than ``Mk`` (less memory and
            work at long lengths: Note [Chosen blocks as indices]).

    Returns:
        (B, H, Mq, Mk) bool (``per="head"``) or (B, Hkv, Mq, Mk) (``per="kv_head"``) on the
        inputs' device, ``True`` = the block pair attends; ``Mq = ceil(Nq / block_size)``,
        ``Mk = ceil(Nk / block_size)``. With ``return_indices``, (B, H or Hkv, Mq, K) int32.

    Raises:
        TypeError: not tensors, not floating, different dtypes; ``block_size``, ``topk``,
            ``is_causal`` or ``per`` of the wrong type.
        ValueError: malformed shapes or devices, ``block_size < 1``, ``topk < 0`` (or 0
            without ``is_causal``), an unknown ``per``, a causal query longer than the key,
            malformed ``cu_seqlens`` or a document that does not start at a multiple of
            ``block_size``.
    """
    q, k = V.check_query_key(query, key)
    block_size, topk = check_selection(block_size, topk, is_causal, per)
    V.check_causal_lengths(q, k, is_causal, "select_blocks")
    V.check_bool("return_indices", return_indices)
    documents = None
    if cu_seqlens is not None:
        documents = check_cu_seqlens(cu_seqlens, q, k)
        check_documents_aligned(documents, q.shape[1], block_size, "select_blocks")
    own_width = own_blocks_width(q.shape[1], k.shape[1], block_size, is_causal)
    return _select(q, k, block_size, topk, is_causal, documents, per,
                   own_width if return_indices else None)  # fmt: skip


def own_blocks_width(nq: int, nk: int, block_size: int, is_causal: bool) -> int:
    """The most own blocks a query block has (Note [Own blocks of an end-aligned query]): 0
    without ``is_causal``, 1 where every query block lies in one key block, else 2."""
    if not is_causal:
        return 0
    return 1 if (nk - nq) % block_size == 0 else 2


def _select(
    q: torch.Tensor,
    k: torch.Tensor,
    block_size: int,
    topk: int,
    is_causal: bool,
    documents: tuple[int, ...] | None,
    per: str,
    own_width: int | None,
) -> torch.Tensor:
    """:func:`select_blocks` of checked arguments (``documents``: the offsets, or None;
    ``own_width``: None for a bool mask, else the indices' own blocks)."""
    batch, nq, heads, _ = q.shape
    nk, kv_heads = k.shape[1], k.shape[2]
    mk = num_blocks(nk, block_size)
    shape = (batch, heads if per == "head" else kv_heads, num_blocks(nq, block_size), mk)
    if q.numel() == 0 or k.numel() == 0:  # a batch of 0, or 0 heads: nothing to choose
        if own_width is None:
            return torch.zeros(shape, dtype=torch.bool, device=q.device)
        width = min(topk, mk) + own_width
        return torch.full((*shape[:3], width), -1, dtype=torch.int32, device=q.device)
    candidates: Candidates = CandidateRanges(nq, nk, block_size, is_causal)
    if documents is not None:
        same = same_document(documents, batch, nq, block_size, q.device)
        cand, own = candidate_blocks(nq, nk, block_size, is_causal, q.device)
        candidates = (cand & same, own & same)
    return chosen_blocks(q, k, candidates, topk, per, own_width, block_size)


@dataclass(frozen=True)
class CandidateRanges:
    """Which key blocks query blocks may choose, and which are their own, from positions alone
    (no packed documents): as :func:`candidate_blocks` gives them, for the query blocks from
    ``first_row`` on (Note [Candidates by position] in ``triton_kernels/selection/top_blocks.py``).

    Attributes:
        query_len, key_len, block_size, is_causal: the whole call's.
        first_row: the first query block of the rows chosen (a ring rank's own).
    """

    query_len: int
    key_len: int
    block_size: int
    is_causal: bool
    first_row: int = 0

    def masks(self, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The candidates and own blocks of ``rows`` query blocks from ``first_row``: two
        (rows, Mk) bool."""
        candidates, own = candidate_blocks(self.query_len, self.key_len, self.block_size,
                                           self.is_causal, device)  # fmt: skip
        chosen = slice(self.first_row, self.first_row + rows)
        return candidates[chosen], own[chosen]

    def kernel_rows(self, start: int, row_ranges: Any) -> Any:
        """The rows from ``start`` on (counted from ``first_row``) as the top-blocks kernel's
        ``row_ranges`` (its ``RowRanges`` class: first row, query shift, block size, key
        length, causal)."""
        return row_ranges(self.first_row + start, self.key_len - self.query_len, self.block_size,
                          self.key_len, self.is_causal)  # fmt: skip


#: A choice's candidates: by position, or as (candidates, own) bool masks broadcastable to
#: (B, 1, Mq, Mk).
Candidates = CandidateRanges | tuple[torch.Tensor, torch.Tensor]


def check_selection(block_size: object, topk: object, is_causal: object, per: object) -> tuple[
    int, int
]:
    """:func:`select_blocks`' options checked (the tensors are the caller's): ``(block_size,
    topk)``.

    Raises:
        TypeError / ValueError: as :func:`select_blocks` says.
    """
    size = check_block_size(block_size)
    V.check_bool("is_causal", is_causal)
    count = _check_topk(topk, bool(is_causal))
    _check_per(per)
    return size, count


def chosen_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    candidates: Candidates,
    topk: int,
    per: str,
    own_width: int | None = None,
    block_size: int = 1,
) -> torch.Tensor:
    """MoBA's rule (Note [MoBA's gate for a block of queries]) on the means of blocks of
    ``block_size`` rows: each query block's own blocks and its ``topk`` candidates of highest
    affinity. One process passes the rows themselves (on the GPU their means are made on the
    way to the product's parts: Note [Block means in the parts' launch] in
    ``triton_kernels/selection/mean_parts.py``); a ring rank the block means of its own query
    blocks and of every rank's key blocks (gathered), blocks of one.

    Args:
        q: (B, Nq, H, D) and k (B, Nk, Hkv, D): rows, or with ``block_size=1`` block means
            from :func:`block_means`, (B, Mq, H, D) and (B, Mk, Hkv, D).
        candidates: the rows' :class:`CandidateRanges`, or ``(candidates, own)`` bool masks
            broadcastable to (B, 1, Mq, Mk) (:func:`candidate_blocks`, packed documents').
        topk, per: checked, as :func:`select_blocks` takes them.
        own_width: None for a bool mask; else block indices, every row's own blocks a run of
            at most ``own_width`` (:func:`own_blocks_width`).
        block_size: rows per block, ``Mq = ceil(Nq / block_size)``; the last block may be
            shorter (its mean is over its real rows).

    Returns:
        (B, H or Hkv, Mq, Mk) bool, or (B, H or Hkv, Mq, min(topk, Mk) + own_width) int32
        block indices, ``-1`` = none.
    """
    mq, mk = num_blocks(q.shape[1], block_size), num_blocks(k.shape[1], block_size)
    topk = min(topk, mk)
    modules = device_modules(q, mk)
    if modules is not None:
        return choose_on_device(modules, q, k, candidates, topk, per, own_width, block_size)
    cand, own = _masks(candidates, mq, q.device)
    chosen = _top_blocks(_affinity(q, k, per, block_size), cand, topk) | own
    return chosen if own_width is None else _as_indices(chosen, topk + own_width)


def _masks(
    candidates: Candidates, rows: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``candidates`` as (candidates, own) bool masks of ``rows`` query blocks."""
    if isinstance(candidates, CandidateRanges):
        return candidates.masks(rows, device)
    return candidates


def _as_indices(chosen: torch.Tensor, width: int) -> torch.Tensor:
    """(..., Mk) bool with at most ``width`` per row -> (..., width) int32 block indices,
    increasing, ``-1`` after a row's last."""
    count, index = compact_rows(chosen)
    index = torch.nn.functional.pad(index, (0, max(0, width - index.shape[-1])))[..., :width]
    slot = torch.arange(width, device=chosen.device)
    return index.masked_fill(slot >= count.unsqueeze(-1), -1)


def _check_topk(topk: object, is_causal: bool) -> int:
    if isinstance(topk, bool) or not isinstance(topk, numbers.Integral):
        raise TypeError(
            f"topk must be an int (key blocks chosen per query block besides its own), got "
            f"topk={topk!r} ({type(topk).__name__}); e.g. topk=3"
        )
    if topk < 0 or (topk == 0 and not is_causal):
        what = "selects no block" if topk == 0 else "is negative"
        raise ValueError(
            f"topk must be >= 1 (>= 0 with is_causal=True, which keeps each query block's own "
            f"block), got topk={topk}, is_causal={is_causal}, which {what}; e.g. topk=3"
        )
    return int(topk)


def _check_per(per: object) -> None:
    if not isinstance(per, str):
        raise TypeError(f"per must be one of {PER}, got {per!r} ({type(per).__name__})")
    if per not in PER:
        raise ValueError(
            f"per must be one of {PER}, got per={per!r}: 'head' chooses per query head "
            f"(MoBA), 'kv_head' once per key/value head for its group of query heads (NSA)"
        )


def _affinity(q: torch.Tensor, k: torch.Tensor, per: str, block_size: int = 1) -> torch.Tensor:
    """MoBA's gate per block pair (Note [MoBA's gate for a block of queries]): q (B, Nq, H, D)
    and k (B, Nk, Hkv, D) rows pooled by blocks of ``block_size`` (1: block means) -> (B, H or
    Hkv, Mq, Mk) float32 (float64 for float64 input)."""
    left, right = _operands(q, k, per, block_size)  # (B Hkv, g, Mq, D'), (B Hkv, Mk, D')
    shape = (q.shape[0], -1, left.shape[2], right.shape[1])
    return _products(left.flatten(1, 2), right).view(shape)


def _operands(
    q: torch.Tensor, k: torch.Tensor, per: str, block_size: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """The affinities' operands per key/value head from the rows q (B, Nq, H, D) and k (B, Nk,
    Hkv, D) pooled by blocks of ``block_size`` (1: block means): the query means (B Hkv, g,
    Mq, D'), g the group's heads (1 for ``per="kv_head"``, their sum), and the key means (B
    Hkv, Mk, D'); on the GPU as bfloat16 parts of the float32 means (Note [Affinities on
    tensor cores]), ``D' = 3 D``, made from the rows in one launch each where Triton runs
    (Note [Parts in one launch] and Note [Block means in the parts' launch] in
    ``triton_kernels/selection/mean_parts.py``): the means are not stored there."""
    batch, _, heads, dim = q.shape
    kv_heads = k.shape[2]
    summed = heads // kv_heads if per == "kv_head" else 1
    module = kernel_module("selection.mean_parts") if on_tensor_cores(q) else None
    if module is not None:
        left = module.mean_parts(q, summed, 2, block_size)
        right = module.mean_parts(k, 1, 1, block_size)
        return left.view(batch * kv_heads, -1, *left.shape[2:]), right.flatten(0, 1)
    q_mean, k_mean = block_means(q, block_size), block_means(k, block_size)
    mq, mk = q_mean.shape[1], k_mean.shape[1]
    q_grouped = q_mean.view(batch, mq, kv_heads, heads // kv_heads, dim)
    if per == "kv_head":
        q_grouped = q_grouped.sum(3, keepdim=True)
    left = q_grouped.permute(0, 2, 3, 1, 4).flatten(0, 1)
    right = k_mean.permute(0, 2, 1, 3).reshape(batch * kv_heads, mk, dim)
    if not on_tensor_cores(left):
        return left, right
    return _parts(left, (0, 0, 1)), _parts(right, (0, 1, 0))


def _means_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of the block means of ``x``: float32, float64 for float64 input."""
    return torch.promote_types(x.dtype, torch.float32)


def _parts(x: torch.Tensor, order: tuple[int, int, int]) -> torch.Tensor:
    """x (..., D) float32 as bfloat16 parts ``hi = bf16(x)``, ``lo = bf16(x - hi)`` laid side
    by side in ``order`` (0 = hi, 1 = lo): (..., 3 D)."""
    high = x.bfloat16()
    parts = (high, (x - high.float()).bfloat16())
    return torch.cat([parts[i] for i in order], dim=-1)


def _products(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """(N, R, D') x (N, C, D') -> (N, R, C) dot products (Note [Affinities on tensor cores]).

    Note [Affinities on tensor cores]
        The affinities are one batched product of block means, (Mq x D) by (D x Mk) per head:
        at 1M tokens, 16 heads and blocks of 128, 275 GFLOP, 6.7 ms in float32 on an H100's
        CUDA cores, half the selection. On the GPU each float32 operand is split into
        bfloat16 parts, ``x = hi + lo`` with ``lo = bf16(x - hi)`` (16 of float32's 24
        significand bits), and ``a . b ~ hi_a . hi_b + hi_a . lo_b + lo_a . hi_b`` is one
        bfloat16 product over ``3 D`` (the parts laid ``[hi, hi, lo]`` against ``[hi, lo,
        hi]``) with float32 accumulation and output on the tensor cores: 2 ms. The dropped
        ``lo_a . lo_b`` is ``2^-16`` of the product, under the rounding of the block means
        themselves. Elsewhere (the CPU, float64) it is a plain ``matmul`` of the means.
    """
    if rows.dtype == torch.bfloat16 and rows.is_cuda:  # the parts of _operands
        return torch.bmm(rows, cols.transpose(-1, -2), out_dtype=torch.float32)
    return rows @ cols.transpose(-1, -2)


def block_means(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """x (B, N, H, D) -> (B, ceil(N / bs), H, D): each block's mean over its real rows, in
    float32 (float64 for float64 input); blocks of one row are the rows (means already made
    stay as they are, no copy)."""
    if block_size == 1:
        return x.to(_means_dtype(x))
    n = x.shape[1]
    full = n // block_size * block_size
    means = window_means(x[:, :full], block_size, block_size)
    if full == n:
        return means
    return torch.cat([means, x[:, full:].mean(1, keepdim=True, dtype=means.dtype)], dim=1)


def candidate_blocks(
    nq: int, nk: int, block_size: int, is_causal: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The key blocks each query block may choose among, and its own blocks (Note [MoBA's gate
    for a block of queries], Note [Own blocks of an end-aligned query]): two (Mq, Mk) bool."""
    mq, mk = num_blocks(nq, block_size), num_blocks(nk, block_size)
    if not is_causal:
        return (torch.ones(mq, mk, dtype=torch.bool, device=device),
                torch.zeros(mq, mk, dtype=torch.bool, device=device))  # fmt: skip
    first = torch.arange(mq, device=device) * block_size + (nk - nq)  # each block's first position
    last = (first + block_size - 1).clamp(max=nk - 1)
    lo, hi = (first // block_size)[:, None], (last // block_size)[:, None]
    key_blocks = torch.arange(mk, device=device)[None, :]
    return key_blocks < lo, (key_blocks >= lo) & (key_blocks <= hi)


def _top_blocks(affinity: torch.Tensor, candidates: torch.Tensor, topk: int) -> torch.Tensor:
    """The ``min(topk, candidates)`` candidate key blocks of highest affinity in every row.

    Args:
        affinity: (B, Hs, Mq, Mk) float.
        candidates: bool, broadcastable to ``affinity``.

    Returns:
        (B, Hs, Mq, Mk) bool.
    """
    count = min(topk, affinity.shape[-1])
    chosen = torch.zeros(affinity.shape, dtype=torch.bool, device=affinity.device)
    if count == 0:
        return chosen
    # Every candidate's score is finite and above every other block's -inf, so the top
    # ``count`` holds all the candidates a row has, up to ``count`` (the rest are not).
    info = torch.finfo(affinity.dtype)
    score = torch.nan_to_num(affinity, nan=info.min, posinf=info.max, neginf=info.min)
    score = score.masked_fill(~candidates, -torch.inf)
    index = score.topk(count, dim=-1, sorted=False).indices
    return chosen.scatter_(-1, index, candidates.expand(affinity.shape).gather(-1, index))
