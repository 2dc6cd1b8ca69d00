"""MoBA-style attention: each query block attends the key blocks MoBA's gate selects (its own
block, when causal, and the ``topk`` best others), on the block-sparse engine with the
selection as a run-time block mask.

Shape legend: B batch, Nq query rows, Nk key rows, H query heads, Hkv key/value heads, D head
dim, bs block size.
"""

from __future__ import annotations

import torch

from .. import _validation as V
from ..backends.registry import check_backend_name
from ..block_sparse.runtime import CHOSEN_BLOCKS_FIX
from ..core.higher_order import no_higher_order_message, raising_as
from ..functional import block_sparse_attention
from .selection import select_blocks

__all__ = ["moba_attention"]

#: Its double-backward error (Note [Double backward] in ``core/higher_order.py``).
FIRST_ORDER_MESSAGE = no_higher_order_message(
    "moba_attention",
    "the attention over its chosen blocks (a run-time block mask) computes its gradients "
    "without a graph",
    CHOSEN_BLOCKS_FIX,
)


@raising_as(FIRST_ORDER_MESSAGE)
def moba_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    block_size: int,
    topk: int,
    is_causal: bool = True,
    cu_seqlens: torch.Tensor | list[int] | None = None,
    scale: float | None = None,
    backend: str | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """MoBA (Mixture of Block Attention): each query block attends its own key block (causal,
    with the causal mask inside it) and the ``topk`` key blocks of highest affinity with its
    queries, chosen by :func:`~dilated_attention.sparse.select_blocks` (Note [MoBA's gate for a
    block of queries] in ``selection.py``; one choice per query head, as MoBA's) and run by
    :func:`~dilated_attention.block_sparse_attention` on that run-time block mask. Example, 4
    blocks, ``topk=1``, causal (``o`` own, ``x`` chosen)::

        key block    0 1 2 3
        query 0      o . . .
        query 1      x o . .
        query 2      . x o .
        query 3      x . . o

    Gradients reach ``query``, ``key`` and ``value`` through the attention over the chosen
    blocks, not through the choice (a discrete top-k, made under ``torch.no_grad()``, as in
    MoBA). The selection and the attention run on the inputs' device without host
    synchronisation.

    Args:
        query: (B, Nq, H, D).
        key: (B, Nk, Hkv, D), H % Hkv == 0 (GQA).
        value: (B, Nk, Hkv, D).
        block_size: positions per block (MoBA's ``moba_chunk_size``); the last block may be
            shorter.
        topk: key blocks chosen per query block besides its own (MoBA's ``moba_topk`` counts
            the own block: ``topk = moba_topk - 1``); fewer where fewer blocks are visible. 0
            keeps the own block alone (causal only).
        is_causal: query position ``p`` sees keys ``t <= p`` (end-aligned when the query is
            shorter than the key).
        cu_seqlens: packed documents, as in :func:`~dilated_attention.attention`: blocks are
            chosen within each document only; every document must start at a multiple of
            ``block_size`` within its row.
        scale: softmax scale; ``None`` means ``D ** -0.5``.
        backend: the attention's kernel, as in
            :func:`~dilated_attention.block_sparse_attention`; ``None``: the automatic choice.
        softcap: the attention's scores soft-capped, as in
            :func:`~dilated_attention.block_sparse_attention` (Gemma 2); the choice of blocks
            is made on the plain affinities.
        sinks: (H,) logits, one per query head, as in
            :func:`~dilated_attention.block_sparse_attention` (gpt-oss); the choice is
            unaffected.

    Returns:
        (B, Nq, H, D) in the input dtype.

    Raises:
        TypeError / ValueError: as :func:`~dilated_attention.sparse.select_blocks` and
            :func:`~dilated_attention.block_sparse_attention` (tensors, ``block_size``,
            ``topk``, ``is_causal``, ``cu_seqlens``, ``scale``, ``backend``, ``softcap``,
            ``sinks``), before any work.
    """
    V.check_qkv(query, key, value, same_length=False)
    scale = V.check_scale(scale)
    backend = check_backend_name(backend)
    softcap = V.check_softcap(softcap)  # the attention's own checks, before the selection
    V.check_sinks(sinks, query)
    mask = select_blocks(  # block indices: the kernels' lists K wide, not Mk
        query, key, block_size=block_size, topk=topk, is_causal=is_causal,
        cu_seqlens=cu_seqlens, return_indices=True,
    )  # fmt: skip
    out = block_sparse_attention(
        query, key, value, mask, block_size=block_size, is_causal=is_causal, scale=scale,
        backend=backend, cu_seqlens=cu_seqlens, softcap=softcap, sinks=sinks,
    )  # fmt: skip
    assert isinstance(out, torch.Tensor)  # return_lse=False: for the type checker
    return out
