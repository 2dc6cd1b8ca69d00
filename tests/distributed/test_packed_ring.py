"""Packed documents over ranks (Note [Packed documents across ranks] in
``distributed/rings/packed_ring.py``) on CPU/gloo, 2 and 4 ranks: ``ring_attention`` and
``block_sparse_ring_attention`` with ``cu_seqlens`` against the float64 block-diagonal oracle
(outputs, lse, dq, dk, dv), for documents of 1 token, inside one shard, spanning two or every
shard, of lengths that divide nothing; pairs of ranks that share no document exchange nothing.

One spawned world per world size runs every case. Workers assert with messages.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from support.block_sparse import token_mask
from support.distributed_utils import count_exchanges, run_world
from support.oracle import masked_attention

import dilated_attention.distributed.comm.collectives as comm
from dilated_attention import (
    MultiheadDilatedAttention,
    RingMultiheadDilatedAttention,
    block_sparse_ring_attention,
    dilated_attention,
    ring_attention,
    ring_dilated_attention,
    shard_sequence,
)
from dilated_attention import patterns as P
from dilated_attention.distributed import ring_load
from dilated_attention.models import LongNetConfig, LongNetLM

pytestmark = pytest.mark.distributed

H, D = 4, 8
TIGHT = {"atol": 1e-10, "rtol": 1e-7}


def _layouts(world_size: int) -> list[list[int]]:
    """Document lengths of one row of ``12 * world_size`` positions."""
    total = 12 * world_size
    return [
        [1, 5, 17, total - 23],  # a 1-token document; documents spanning shards
        [total],  # one document over every shard
        [12] * world_size,  # one document per shard: nothing crosses
        [7] * (total // 7) + [total % 7] if total % 7 else [7] * (total // 7),
    ]


def _offsets(lengths: list[int]) -> list[int]:
    return [0, *itertools.accumulate(lengths)]


def _document_mask(lengths: list[int], causal: bool, inner: torch.Tensor | None) -> torch.Tensor:
    """(H, N, N) bool: within each document (and ``inner``'s pattern inside it), causal."""
    n = sum(lengths)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for a, b in itertools.pairwise(_offsets(lengths)):
        block = torch.ones(b - a, b - a, dtype=torch.bool) if inner is None else inner[: b - a]
        mask[a:b, a:b] = block[:, : b - a]
    if causal:
        mask = mask.tril()
    return mask.expand(H, -1, -1)


def _row(n: int, kv_heads: int, gen: torch.Generator) -> list[torch.Tensor]:
    """q, k, v and dout of one packed row of ``n`` positions, float64."""
    shapes = [(1, n, H, D), (1, n, kv_heads, D), (1, n, kv_heads, D), (1, n, H, D)]
    return [torch.randn(shape, dtype=torch.float64, generator=gen) for shape in shapes]


def _assert_shards(
    case: str, got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]
) -> None:
    """This rank's out, lse, dq, dk, dv equal its shards of the whole row's."""
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        shard = shard_sequence(w, seq_dim=2 if name == "lse" else 1)
        torch.testing.assert_close(g, shard, **TIGHT, msg=lambda m, x=name: f"{x} {case}: {m}")


def _check(rank: int, world_size: int) -> None:
    gen = torch.Generator().manual_seed(world_size)
    for index, (lengths, causal, kv_heads, pattern) in enumerate(itertools.product(
        _layouts(world_size), [False, True], [4, 1], [None, P.LocalWindow(1)]
    )):  # fmt: skip
        n = sum(lengths)
        q, k, v, dout = _row(n, kv_heads, gen)
        if pattern is None:
            mask = _document_mask(lengths, causal, None)
        else:  # blocks of 4 counted from each document's first token
            inner = token_mask(pattern, 4, n, n, False)
            mask = _document_mask(lengths, causal, inner)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref, ref_lse = masked_attention(*leaves, mask)
        ref_grads = torch.autograd.grad(ref, leaves, dout)
        local = [shard_sequence(t).requires_grad_() for t in (q, k, v)]
        cu = _offsets(lengths)
        if pattern is None:
            out, lse = ring_attention(*local, is_causal=causal, cu_seqlens=cu, return_lse=True)
        else:
            out, lse = block_sparse_ring_attention(
                *local, pattern, block_size=4, is_causal=causal, cu_seqlens=cu, return_lse=True
            )
        grads = torch.autograd.grad(out, local, shard_sequence(dout))
        case = f"rank {rank}/{world_size} #{index} {lengths} {causal=} Hkv={kv_heads} {pattern}"
        _assert_shards(case, (out, lse, *grads), (ref, ref_lse, *ref_grads))


#: Schedules whose segments cross shards of 12 (and one whose rate 3 does not divide the
#: grouped-query group of 2, so calls repeat key/value heads).
SCHEDULES = [((8, 16, 32), (1, 2, 4)), ((6, 30), (1, 3))]


def _check_dilated(rank: int, world_size: int) -> None:
    """Against the single-process packed call (itself checked against the float64 oracle in
    ``tests/ops/test_packed.py``), in float64."""
    gen = torch.Generator().manual_seed(10 + world_size)
    for index, (lengths, causal, kv_heads, (segs, rates)) in enumerate(itertools.product(
        _layouts(world_size), [False, True], [4, 2, 1], SCHEDULES
    )):  # fmt: skip
        n = sum(lengths)
        q, k, v, dout = _row(n, kv_heads, gen)
        cu = _offsets(lengths)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref, ref_lse = dilated_attention(*leaves, segs, rates, is_causal=causal, cu_seqlens=cu,
                                         return_lse=True)  # fmt: skip
        ref_grads = torch.autograd.grad(ref, leaves, dout)
        local = [shard_sequence(t).requires_grad_() for t in (q, k, v)]
        out, lse = ring_dilated_attention(*local, segs, rates, is_causal=causal, cu_seqlens=cu,
                                          return_lse=True)  # fmt: skip
        grads = torch.autograd.grad(out, local, shard_sequence(dout))
        case = f"rank {rank}/{world_size} #{index} {lengths} {causal=} Hkv={kv_heads} {segs}"
        _assert_shards(case, (out, lse, *grads), (ref, ref_lse, *ref_grads))


def _check_bytes(rank: int, world_size: int) -> None:
    """One document per shard: no pair of ranks shares a document, so nothing is sent; one
    document over every shard: every rank receives keys."""
    n = 12
    x = torch.randn(1, n, H, D, dtype=torch.float64).requires_grad_()
    with count_exchanges(comm=comm) as log:
        out = ring_attention(x, x, x, cu_seqlens=_offsets([n] * world_size))
        out.sum().backward()
        assert sum(log["comm_sent"]) == 0 and sum(log["comm_calls"]) == 0, (
            f"rank {rank}: documents inside their shards sent {sum(log['comm_sent'])} bytes"
        )
        ring_attention(x, x, x, cu_seqlens=[0, n * world_size])
        assert sum(log["comm_recv"]) > 0, f"rank {rank}: a document over every shard got nothing"


def _check_errors(rank: int, world_size: int) -> None:
    """Bad packed calls raise on every rank before any other communication."""
    x = torch.randn(1, 6, H, D)
    cases = [
        (dict(cu_seqlens=[0, 5]), "cu_seqlens must start at 0 and end at B \\* N = 1 \\* "),
        (dict(cu_seqlens=[0, 6 * world_size], key_padding_mask=torch.zeros(1, 6, dtype=torch.bool)),
         "no key_padding_mask"),
        (dict(cu_seqlens=[0, 4, 6 * world_size], layout="zigzag", is_causal=True),
         "layout='contiguous'"),
    ]  # fmt: skip
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            ring_attention(x, x, x, **kwargs)
    two = torch.randn(2, 6, H, D)
    with pytest.raises(ValueError, match="one packed row"):
        ring_attention(two, two, two, cu_seqlens=[0, 6 * world_size, 12 * world_size])
    # Offsets that differ between ranks: an error on every rank, not a hang.
    with pytest.raises(ValueError, match="cu_seqlens"):
        ring_attention(x, x, x, cu_seqlens=[0, 1 + rank, 6 * world_size])


@pytest.mark.parametrize("world_size", [2, 4])
def test_packed_ring_matches_the_oracle(world_size: int, tmp_path: Path) -> None:
    run_world(_check, world_size, tmp_path, timeout_s=120)


@pytest.mark.parametrize("world_size", [2, 4])
def test_packed_ring_dilated_equals_the_packed_call(world_size: int, tmp_path: Path) -> None:
    run_world(_check_dilated, world_size, tmp_path, timeout_s=120)


def test_packed_ring_sends_only_what_documents_share(tmp_path: Path) -> None:
    run_world(_check_bytes, 2, tmp_path)


def _check_layers(rank: int, world_size: int) -> None:
    """The ring multihead layer (rotary at each document's own positions, shard by shard) and a
    ring LongNetLM on a packed row equal the local ones on the whole row, gradients included."""
    torch.manual_seed(0)
    segs, rates, cu = (4, 8, 24), (1, 2, 4), [0, 3, 17, 12 * world_size]
    ring = RingMultiheadDilatedAttention(32, 4, segs, rates, num_kv_heads=2, dtype=torch.float64)
    local = MultiheadDilatedAttention(32, 4, segs, rates, num_kv_heads=2, dtype=torch.float64)
    local.load_state_dict(ring.state_dict())
    ring.use_rotary(100.0)
    local.use_rotary(100.0)
    x = torch.randn(1, 12 * world_size, 32, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(1))  # fmt: skip
    full, _ = local(x, is_causal=True, cu_seqlens=cu)
    full.square().sum().backward()
    out, _ = ring(shard_sequence(x), is_causal=True, cu_seqlens=cu)
    torch.testing.assert_close(out, shard_sequence(full), atol=1e-10, rtol=1e-7)
    out.square().sum().backward()
    for (name, p_ring), p_full in zip(ring.named_parameters(), local.parameters(), strict=True):
        grad = p_ring.grad.clone()
        dist.all_reduce(grad)  # replicated parameters: gradients add over ranks
        torch.testing.assert_close(grad, p_full.grad, atol=1e-9, rtol=1e-7, msg=name)
    config = dict(vocab_size=61, embed_dim=32, num_heads=4, num_layers=2, segment_lengths=segs,
                  dilation_rates=rates, ffn_dim=64)  # fmt: skip
    torch.manual_seed(0)
    model = LongNetLM(LongNetConfig(**config, kind="ring")).double().eval()
    torch.manual_seed(0)
    alone = LongNetLM(LongNetConfig(**config, kind="dilated")).double().eval()
    alone.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 61, (1, 12 * world_size), generator=torch.Generator().manual_seed(2))
    want = alone(tokens, cu_seqlens=cu)
    got = model(shard_sequence(tokens), cu_seqlens=cu)
    torch.testing.assert_close(got, shard_sequence(want), atol=1e-9, rtol=1e-7)


def test_packed_ring_layers_equal_the_local_ones(tmp_path: Path) -> None:
    run_world(_check_layers, 2, tmp_path, timeout_s=120)


def test_bad_packed_ring_calls_raise_on_every_rank(tmp_path: Path) -> None:
    run_world(_check_errors, 2, tmp_path)


def _visible(calls, q_lo: int, k_lo: int, heads: tuple[int, ...]) -> set[tuple[int, int, int]]:
    """Every (query position, key position, head) a list of position calls computes."""
    seen = set()
    for c in calls:
        call_heads = tuple(c.heads.tolist()) if hasattr(c, "heads") else heads
        for qs, ks in zip(c.q_index.tolist(), c.kv_index.tolist(), strict=True):
            for i, qp in enumerate(qs):
                for j, kp in enumerate(ks):
                    if not (c.causal and j > i):
                        seen.update((qp + q_lo, kp + k_lo, h) for h in call_heads)
    return seen


@pytest.mark.parametrize("dilated", [False, True], ids=["dense", "dilated"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_restricted_calls_cover_the_plan_exactly_once(dilated: bool, causal: bool) -> None:
    """Cut per rank pair, the packed plan's calls compute exactly its (query, key, head)
    triples: none lost at a shard boundary, none added, none twice."""
    from dilated_attention.core.geometry.schedule import Schedule
    from dilated_attention.distributed.rings.packed_ring import _global_calls, restricted_calls

    world, n = 3, 12
    documents = (0, 1, 7, 20, 21, 36)
    schedule = (Schedule((4, 8, 16), (1, 2, 4)), 4, 2) if dilated else None
    calls = _global_calls(documents, causal, None, 128, schedule)
    want = _visible(calls, 0, 0, (0, 1, 2, 3))
    got: set[tuple[int, int, int]] = set()
    count = 0
    for dst, src in itertools.product(range(world), repeat=2):
        part = restricted_calls(calls, (dst * n, (dst + 1) * n), (src * n, (src + 1) * n))
        triples = _visible(part, dst * n, src * n, (0, 1, 2, 3))
        count += len(triples)
        got |= triples
    assert got == want and count == len(want)


def _plan_pairs(length: int, segs: tuple[int, ...], rates: tuple[int, ...]) -> float:
    """Non-causal pairs per head of one document alone: every head's rows of every segment."""
    total = 0
    for w, r in zip(segs, rates, strict=True):
        w = min(w, length)
        for start in range(0, length, w):
            seg = min(w, length - start)
            total += sum(len(range(h % r, seg, r)) ** 2 for h in range(4))
    return total / 4


def test_ring_load_counts_each_ranks_pairs() -> None:
    even = ring_load([0, 8, 16, 24, 32], 4)  # one document of 8 per shard of 8
    assert even.pairs == (64, 64, 64, 64) and even.max_over_mean == 1.0
    causal = ring_load([0, 32], 4, is_causal=True)  # one causal document over every shard
    assert sum(causal.pairs) == 32 * 33 // 2
    assert causal.pairs == (36, 100, 164, 228), causal.pairs  # later shards see more keys
    assert causal.max_over_mean == pytest.approx(228 / (528 / 4))
    sparse = ring_load([0, 32], 4, pattern=P.LocalWindow(0), block_size=8)
    assert sparse.pairs == (64, 64, 64, 64)
    # Dilated: the ranks' pairs add up to the packed plan's, per head.
    lengths, segs, rates = [1, 5, 17, 25], (8, 16, 32), (1, 2, 4)
    dilated = ring_load(_offsets(lengths), 4, schedule=(segs, rates), num_heads=4)
    alone = sum(_plan_pairs(length, segs, rates) for length in lengths)
    assert sum(dilated.pairs) == pytest.approx(alone), (dilated.pairs, alone)
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        ring_load([0, 32], 0)
    with pytest.raises(ValueError, match="cannot be sharded over 3 ranks"):
        ring_load([0, 32], 3)
    with pytest.raises(ValueError, match="strictly increasing"):
        ring_load([0, 5, 5, 32], 4)
