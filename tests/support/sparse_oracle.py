"""A readable float64 re-implementation of MoBA and NSA for the tests: explicit token masks
built by loops over blocks, windows and positions, and one explicit softmax per branch (or one
over the branches' keys side by side). It shares no code with ``dilated_attention`` (it never
imports it); gradients come from autograd through these functions.

Conventions (the library's docstrings): q (B, Nq, H, D), k and v (B, Nk, Hkv, D); a causal
query shorter than the key holds the last Nq positions (row r is position Nk - Nq + r).
"""

from __future__ import annotations

import torch
from torch import Tensor

NEG_INF = float("-inf")


def heads_first(x: Tensor, heads: int) -> Tensor:
    """(B, N, Hx, D) -> (B, H, N, D), each key/value head repeated for its group of query
    heads (query head h reads key/value head h // (H // Hx))."""
    return x.transpose(1, 2).repeat_interleave(heads // x.shape[2], dim=1)


def softmax_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """Attention where query ``r`` of head ``h`` sees key ``t`` iff ``mask[b, h, r, t]``.

    Args:
        q: (B, Nq, H, D); k, v: (B, Nk, Hkv, D); mask: (B, H, Nq, Nk) bool.

    Returns:
        out (B, Nq, H, D) (0 for a row that sees nothing), lse (B, H, Nq) (-inf there).
    """
    heads = q.shape[2]
    scores = q.transpose(1, 2) @ heads_first(k, heads).transpose(-1, -2) * scale
    scores = scores.masked_fill(~mask, NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.where(mask, torch.exp(scores - safe[..., None]), torch.zeros_like(scores))
    return (probs @ heads_first(v, heads)).transpose(1, 2), lse


def block_means(x: Tensor, block: int) -> list[Tensor]:
    """Each block's mean over its real rows: a list of (B, Hx, D), one per block of ``x``
    (B, N, Hx, D), the last block maybe shorter."""
    return [x[:, s : s + block].mean(1) for s in range(0, x.shape[1], block)]


def selected_blocks(
    q: Tensor, k: Tensor, *, block: int, topk: int, is_causal: bool, per_kv_head: bool,
    documents: list[list[int]] | None = None,
) -> Tensor:  # fmt: skip
    """MoBA's choice, written out: (B, H, Mq, Mk) bool, ``True`` where query block ``i`` of
    batch row ``b`` and query head ``h`` attends key block ``j``. Causal: its own blocks (those
    holding its positions) plus the ``topk`` best of the blocks wholly before its first
    position; else the ``topk`` best of all. Best = the highest dot product of the block's mean
    query (summed over the group's query heads when ``per_kv_head``) with the key block's mean
    key. ``documents`` (a document id per position of each row, block-aligned): only blocks
    of the query block's document."""
    batch, nq, heads, _ = q.shape
    nk, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    qbar, kbar = block_means(q.detach(), block), block_means(k.detach(), block)
    chosen = torch.zeros(batch, heads, len(qbar), len(kbar), dtype=torch.bool)
    for b in range(batch):
        for h in range(heads):
            kv = h // group
            mates = range(kv * group, (kv + 1) * group) if per_kv_head else [h]
            for i in range(len(qbar)):
                first = nk - nq + i * block if is_causal else i * block
                last = min(first + block - 1, nk - 1)
                own = list(range(first // block, last // block + 1)) if is_causal else []
                candidates = list(range(first // block) if is_causal else range(len(kbar)))
                if documents is not None:
                    doc = documents[b][i * block]
                    own = [j for j in own if documents[b][j * block] == doc]
                    candidates = [j for j in candidates if documents[b][j * block] == doc]
                score = {
                    j: sum(float(qbar[i][b, m].double() @ kbar[j][b, kv].double()) for m in mates)
                    for j in candidates
                }
                best = sorted(score, key=score.__getitem__, reverse=True)[:topk]
                for j in set(own) | set(best):
                    chosen[b, h, i, j] = True
    return chosen.to(q.device)


def positions_of(nq: int, nk: int, is_causal: bool, device: torch.device) -> Tensor:
    """(Nq,) the query rows' positions: the last Nq of the Nk when causal, else 0..Nq-1."""
    start = nk - nq if is_causal else 0
    return torch.arange(start, start + nq, device=device)


def blocks_mask(
    chosen: Tensor, *, block: int, nq: int, nk: int, is_causal: bool,
    documents: list[list[int]] | None = None,
) -> Tensor:  # fmt: skip
    """(B, H, Nq, Nk) bool: query row ``r`` sees key ``t`` when ``chosen`` (B, H, Mq, Mk)
    keeps block pair ``(r // block, t // block)``, ``t`` is not after ``r``'s position (causal)
    and in the same document."""
    tokens = chosen.repeat_interleave(block, dim=2)[:, :, :nq]
    tokens = tokens.repeat_interleave(block, dim=3)[..., :nk]
    position = positions_of(nq, nk, is_causal, chosen.device)
    if is_causal:
        tokens = tokens & (torch.arange(nk, device=chosen.device) <= position[:, None])
    if documents is not None:
        ids = torch.tensor(documents, device=chosen.device)  # (B, Nk)
        same = ids[:, position][:, :, None] == ids[:, None, :]  # (B, Nq, Nk)
        tokens = tokens & same[:, None]
    return tokens


def moba_reference(
    q: Tensor, k: Tensor, v: Tensor, *, block: int, topk: int, is_causal: bool,
    documents: list[list[int]] | None = None,
) -> Tensor:  # fmt: skip
    """MoBA in float64: the chosen blocks' keys, one softmax; (B, Nq, H, D)."""
    chosen = selected_blocks(
        q, k, block=block, topk=topk, is_causal=is_causal, per_kv_head=False, documents=documents
    )
    mask = blocks_mask(chosen, block=block, nq=q.shape[1], nk=k.shape[1], is_causal=is_causal,
                       documents=documents)  # fmt: skip
    return softmax_attention(q, k, v, mask, q.shape[-1] ** -0.5)[0]


def compressed(x: Tensor, block: int, stride: int) -> Tensor:
    """(B, N, Hx, D) -> (B, Nc, Hx, D): the mean of each whole window ``[c * stride, c *
    stride + block)``."""
    starts = range(0, x.shape[1] - block + 1, stride)
    means = [x[:, s : s + block].mean(1) for s in starts]
    return torch.stack(means, 1) if means else x[:, :0]


def nsa_masks(
    q: Tensor, k: Tensor, *, compress_block: int, compress_stride: int, select_block: int,
    topk: int, window: int, is_causal: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """NSA's three token masks (B, H, Nq, Nc), (B, H, Nq, Nk), (B, H, Nq, Nk): compressed key
    ``c`` once its window ``[c * stride, c * stride + block)`` ends at or before the query's
    position (all of them, not causal); the selected blocks (one choice per key/value head);
    the window: the query and the ``window - 1`` keys before it (causal) or on either side."""
    batch, nq, heads, _ = q.shape
    nk, device = k.shape[1], q.device
    count = 0 if nk < compress_block else (nk - compress_block) // compress_stride + 1
    position = positions_of(nq, nk, is_causal, device)[:, None]  # (Nq, 1)
    ends = torch.arange(count, device=device) * compress_stride + compress_block - 1
    cmp = ends <= position if is_causal else torch.ones(nq, count, dtype=torch.bool,
                                                          device=device)  # fmt: skip
    distance = position - torch.arange(nk, device=device)  # query position - key position
    win = (distance >= 0) & (distance <= window - 1) if is_causal else distance.abs() < window
    chosen = selected_blocks(q, k, block=select_block, topk=topk, is_causal=is_causal,
                             per_kv_head=True)  # fmt: skip
    sel = blocks_mask(chosen, block=select_block, nq=nq, nk=nk, is_causal=is_causal)
    expand = (batch, heads, -1, -1)
    return cmp.expand(expand), sel, win.expand(expand)


def nsa_reference(
    q: Tensor, k: Tensor, v: Tensor, gates: Tensor | None, *, compress_block: int,
    compress_stride: int, select_block: int, topk: int, window: int, is_causal: bool,
) -> Tensor:  # fmt: skip
    """NSA in float64, (B, Nq, H, D): with ``gates`` (B, Nq, H, 3) the gated sum of the three
    branches' outputs (compressed, selected, window); without, one softmax over the three key
    sets side by side (compressed keys and values, then the keys twice: a key both the selected
    blocks and the window hold counts twice)."""
    scale = q.shape[-1] ** -0.5
    k_cmp, v_cmp = (compressed(x, compress_block, compress_stride) for x in (k, v))
    cmp, sel, win = nsa_masks(
        q, k, compress_block=compress_block, compress_stride=compress_stride,
        select_block=select_block, topk=topk, window=window, is_causal=is_causal,
    )  # fmt: skip
    if gates is not None:
        outs = [
            softmax_attention(q, k_cmp, v_cmp, cmp, scale)[0],
            softmax_attention(q, k, v, sel, scale)[0],
            softmax_attention(q, k, v, win, scale)[0],
        ]
        return sum(gates[..., c, None] * outs[c] for c in range(3))
    keys = torch.cat([k_cmp, k, k], dim=1)
    values = torch.cat([v_cmp, v, v], dim=1)
    return softmax_attention(q, keys, values, torch.cat([cmp, sel, win], dim=-1), scale)[0]


def document_ids(cu_seqlens: list[int], batch: int, seq_len: int) -> list[list[int]]:
    """The document id of every position of every row, from offsets over the flattened batch."""
    ids = [[0] * seq_len for _ in range(batch)]
    for d in range(len(cu_seqlens) - 1):
        for flat in range(cu_seqlens[d], cu_seqlens[d + 1]):
            ids[flat // seq_len][flat % seq_len] = d
    return ids

