"""Empty ring calls on gloo: a batch of 0 or 0 heads on every rank gives what one process gives
(empty outputs and log-sum-exps, empty gradients); a local seq_len of 0 raises the
single-process ``ValueError``; an empty input on one rank only raises on every rank, quickly.

Workers run in spawned processes where pytest does not rewrite ``assert``: every check names its
case.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from support.distributed_utils import raises_on_rank, run_world

from dilated_attention import (
    BlockSparseMultiheadAttention,
    BlockSparseRingAttention,
    BlockSparseRingMultiheadAttention,
    MultiheadDilatedAttention,
    RingAttention,
    RingDilatedAttention,
    RingMultiheadDilatedAttention,
    attention,
    block_sparse_attention,
    block_sparse_ring_attention,
    dilated_attention,
    patterns,
    ring_attention,
    ring_dilated_attention,
)

pytestmark = pytest.mark.distributed

TIMEOUT_S = 5.0
LOCAL_LEN, HEAD_DIM, EMBED = 8, 4, 8
SEGS, RATES = (4, 16), (1, 2)
PATTERN, BLOCK = patterns.LocalWindow(1), 4

Call = Callable[..., Any]


def _pairs() -> list[tuple[str, Call, Call]]:
    """(name, ring call, single-process call) with the same options, each ``(q, k, v, **kw)``."""
    return [
        ("ring_attention", lambda *x, **kw: ring_attention(*x, is_causal=True, **kw),
         lambda *x, **kw: attention(*x, is_causal=True, **kw)),
        ("ring_attention allgather",
         lambda *x, **kw: ring_attention(*x, comm="allgather", **kw),
         lambda *x, **kw: attention(*x, **kw)),
        ("ring_attention zigzag",
         lambda *x, **kw: ring_attention(*x, is_causal=True, layout="zigzag", **kw),
         lambda *x, **kw: attention(*x, is_causal=True, **kw)),
        ("ring_dilated_attention",
         lambda *x, **kw: ring_dilated_attention(*x, SEGS, RATES, is_causal=True, **kw),
         lambda *x, **kw: dilated_attention(*x, SEGS, RATES, is_causal=True, **kw)),
        ("block_sparse_ring_attention",
         lambda *x, **kw: block_sparse_ring_attention(*x, PATTERN, block_size=BLOCK, **kw),
         lambda *x, **kw: block_sparse_attention(*x, PATTERN, block_size=BLOCK, **kw)),
    ]  # fmt: skip


def _qkv(batch: int, heads: int, kv_heads: int, n: int = LOCAL_LEN) -> list[torch.Tensor]:
    shapes = [(batch, n, h, HEAD_DIM) for h in (heads, kv_heads, kv_heads)]
    return [torch.randn(s, dtype=torch.float64, requires_grad=True) for s in shapes]


def _same(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (
        f"{what}: got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}"
    )
    torch.testing.assert_close(got, want, msg=lambda m: f"{what}: {m}")


def _check_empty_like_one_process(rank: int, name: str, ring: Call, single: Call) -> None:
    """Batch 0, 0 heads (with and without key/value heads): out, lse and gradients as one
    process gives them on the gathered (equally empty) sequence."""
    for batch, heads, kv_heads in ((0, 4, 2), (2, 0, 0), (2, 0, 2)):
        what = f"rank {rank}: {name}, batch {batch}, heads {heads}/{kv_heads}"
        q, k, v = _qkv(batch, heads, kv_heads)
        out, lse = ring(q, k, v, return_lse=True)
        out.sum().backward()
        full = [t.detach().repeat(1, 2, 1, 1).requires_grad_() for t in (q, k, v)]
        want_out, want_lse = single(*full, return_lse=True)
        want_out.sum().backward()
        _same(f"{what}: out", out, want_out[:, :LOCAL_LEN])
        _same(f"{what}: lse", lse, want_lse[:, :, :LOCAL_LEN])
        for t, f in zip((q, k, v), full, strict=True):
            assert t.grad is not None and f.grad is not None, f"{what}: no gradient"
            _same(f"{what}: grad", t.grad, f.grad[:, :LOCAL_LEN])
    if "block_sparse" not in name:  # (block-sparse attention takes no key padding mask)
        q, k, v = _qkv(0, 4, 2)
        mask = torch.zeros(0, LOCAL_LEN, dtype=torch.bool)
        out = ring(q, k, v, key_padding_mask=mask)
        assert out.shape == q.shape, f"rank {rank}: {name} batch 0 with a mask: {out.shape}"


def _check_modules(rank: int) -> None:
    """The ring modules on batch 0: the local modules' empty outputs and (zero) gradients."""
    torch.manual_seed(0)
    x = torch.randn(0, LOCAL_LEN, EMBED, dtype=torch.float64, requires_grad=True)
    layers = [
        (RingMultiheadDilatedAttention(EMBED, 2, SEGS, RATES, dtype=torch.float64),
         MultiheadDilatedAttention(EMBED, 2, SEGS, RATES, dtype=torch.float64)),
        (BlockSparseRingMultiheadAttention(EMBED, 2, PATTERN, block_size=BLOCK,
                                           dtype=torch.float64),
         BlockSparseMultiheadAttention(EMBED, 2, PATTERN, block_size=BLOCK, dtype=torch.float64)),
    ]  # fmt: skip
    for ring, local in layers:
        what = f"rank {rank}: {type(ring).__name__} on batch 0"
        local.load_state_dict(ring.state_dict())
        out, _ = ring(x, is_causal=True)
        want, _ = local(x, is_causal=True)
        _same(what, out, want)
        out.sum().backward()
        want.sum().backward()
        for (pname, p), w in zip(ring.named_parameters(), local.parameters(), strict=True):
            assert p.grad is not None and w.grad is not None, f"{what}: no grad for {pname}"
            _same(f"{what}: grad of {pname}", p.grad, w.grad)
    q, k, v = _qkv(0, 2, 2)
    inner = [RingAttention(), RingDilatedAttention(SEGS, RATES),
             BlockSparseRingAttention(PATTERN, block_size=BLOCK)]  # fmt: skip
    for module in inner:
        out = module(q, k, v, is_causal=True)
        assert out.shape == q.shape, f"rank {rank}: {type(module).__name__}: {out.shape}"


def _empty_worker(rank: int, world_size: int) -> None:
    assert world_size == 2, world_size
    for name, ring, single in _pairs():
        _check_empty_like_one_process(rank, name, ring, single)
        # seq_len 0 everywhere: the single-process ValueError, on every rank.
        with raises_on_rank(f"rank {rank}: {name}, seq_len 0", r"seq_len \(dim 1\) must be at"):
            ring(*_qkv(2, 4, 2, n=0))
        # Empty on one rank only: an error on every rank, not a hang.
        r0 = rank == 0
        one_rank = [
            ("batch 0 on rank 0", r"batch differs across ranks \(\[0, 2\] by rank\)",
             _qkv(0 if r0 else 2, 4, 2)),
            ("0 heads on rank 0", r"query heads differs across ranks \(\[0, 4\] by rank\)",
             _qkv(2, 0 if r0 else 4, 0 if r0 else 2)),
            ("seq_len 0 on rank 0",
             r"seq_len \(dim 1\) must be at least 1" if r0 else r"rank\(s\) \[0\] rejected",
             _qkv(2, 4, 2, n=0 if r0 else LOCAL_LEN)),
        ]  # fmt: skip
        for what, match, tensors in one_rank:
            with raises_on_rank(f"rank {rank}: {name}, {what}", match, within_s=TIMEOUT_S / 2):
                ring(*tensors)
    _check_modules(rank)
    torch.manual_seed(0)
    layer = RingMultiheadDilatedAttention(EMBED, 2, SEGS, RATES, dtype=torch.float64)
    x = torch.randn(0 if rank == 0 else 2, LOCAL_LEN, EMBED, dtype=torch.float64)
    with raises_on_rank(
        f"rank {rank}: ring layer, batch 0 on rank 0", r"batch differs", within_s=TIMEOUT_S / 2
    ):
        layer(x, is_causal=True)
    # Still in step: a real call on every rank.
    for name, ring, _ in _pairs():
        q, k, v = _qkv(2, 4, 2)
        ring(q, k, v).sum().backward()
        assert q.grad is not None, f"rank {rank}: {name} after the empty calls"


def test_empty_ring_calls_match_one_process(tmp_path: Path) -> None:
    run_world(_empty_worker, 2, tmp_path, timeout_s=TIMEOUT_S)
