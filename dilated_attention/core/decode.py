"""Queries shorter than the keys: the last positions of a causal dilated call (decoding).

Note [Decoding rows]
    In the causal forward over ``Nk`` positions, branch ``(w, r)`` gives the query at position
    ``p`` and head ``h`` the keys ``t0 + s + r*m <= p`` of its segment, where ``t0 = (p // w) * w``
    and ``s = h mod r``, provided ``p`` is itself one of the head's rows (``(p - t0) mod r == s``);
    otherwise that branch does not cover the row (Note [Row groups] in ``segment.py``). So the
    queries at the last ``Nq`` positions ``Nk - Nq .. Nk - 1`` need no other queries: each
    (position, branch) is one kernel call of the heads with offset ``(p - t0) mod r`` (a strided
    slice of the heads, read as a view) against at most ``ceil(w / r)`` keys, none after ``p``
    (so no causal mask inside the call). The executor merges the branches as in the full forward
    (Note [One executor] in ``engine.py``), so each row equals that row of the full causal
    forward over the ``Nk`` positions, whatever ``Nk`` is: the cost of one decoded token is the
    sum over branches of ``w / r`` keys. The branches are the effective ones of ``Nk`` positions
    (Note [Effective branches]): ``w > Nk`` is one segment.

Shape legend: B batch, Nq query positions (the last of the Nk key positions), H query heads,
Hkv key/value heads, D head dim, Hc heads of one call, c keys of one call.
"""

from __future__ import annotations

import functools

import torch

from .engine import Plan, _put_slice
from .higher_order import RowCall, flat_rows


class DecodeCall:
    """One query position's heads of one offset class against their keys in one branch
    (``Call`` in ``engine.py``): q rows ``q[:, q_pos, heads]`` (a view), keys and values at
    ``kv_pos`` with each query head reading its own key/value head (GQA heads repeated)."""

    causal = False  # every key of the call is at or before the query

    def __init__(
        self,
        q_pos: int,
        heads: slice,
        kv_pos: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
    ) -> None:
        self.q_pos, self.heads = q_pos, heads
        head_ids = torch.arange(num_heads, device=kv_pos.device)[heads]
        kv_heads = head_ids // (num_heads // num_kv_heads)  # (Hc,)
        self.q_flat = (q_pos * num_heads + head_ids).view(1, -1)  # (1, Hc)
        # (1, c * Hc) in (row, head) order: the rows of k.view(B, Nk * Hkv, D) the call reads.
        self.kv_flat = (kv_pos.view(-1, 1) * num_kv_heads + kv_heads.view(1, -1)).view(1, -1)
        self.kv_pos, self.call_heads = kv_pos, head_ids.numel()

    def q_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, self.q_pos : self.q_pos + 1, self.heads]

    def kv_rows(self, x: torch.Tensor) -> torch.Tensor:
        return flat_rows(x, self.kv_flat, self.call_heads)

    def key_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """(B, Nk) bool -> (B, 1, c)."""
        return None if mask is None else mask[:, self.kv_pos].unsqueeze(1)

    def put_q(self, dest: torch.Tensor, rows: torch.Tensor, *, accumulate: bool) -> None:
        block = dest[:, self.q_pos : self.q_pos + 1]
        _put_slice(block.transpose(1, 2), self.heads, rows.transpose(1, 2), accumulate)

    def put_kv(self, dest: torch.Tensor, rows: torch.Tensor, *, accumulate: bool) -> None:
        batch, _, _, dim = dest.shape
        flat = dest.view(batch, -1, dim)
        src = rows.reshape(batch, -1, dim).to(dest.dtype)
        if accumulate:
            flat.index_add_(1, self.kv_flat.view(-1), src)
        else:
            flat.index_copy_(1, self.kv_flat.view(-1), src)

    def row_call(self, q: torch.Tensor, k: torch.Tensor) -> RowCall:
        heads = self.call_heads
        return RowCall(self.q_flat, self.kv_flat, heads, heads, causal=False)


@functools.lru_cache(maxsize=64)
def decode_plan(
    query_len: int,
    key_len: int,
    num_heads: int,
    num_kv_heads: int,
    segment_lengths: tuple[int, ...],
    dilation_rates: tuple[int, ...],
    device: torch.device,
    key_start: int = 0,
) -> Plan:
    """The executor's plan for the queries at the last ``query_len`` of ``key_len`` positions
    (Note [Decoding rows]); ``segment_lengths`` / ``dilation_rates`` are the effective branches
    of ``key_len`` positions. One call per (query position, branch) that covers some head.
    ``key_start``: the position of the keys' first row (a cache holds the later rows only;
    every key a call reads is at or after it)."""
    calls = []
    first = key_len - query_len
    for i in range(query_len):
        p = first + i
        for w, r in zip(segment_lengths, dilation_rates, strict=True):
            start = (p // w) * w
            offset = (p - start) % r
            if offset >= num_heads:
                continue  # no head has this offset: the branch covers no row at p
            kv_pos = torch.arange(start + offset - key_start, p + 1 - key_start, r, device=device)
            heads = slice(offset, num_heads, r)
            calls.append(DecodeCall(i, heads, kv_pos, num_heads, num_kv_heads))
    return Plan(tuple(calls))
