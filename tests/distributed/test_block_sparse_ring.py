"""Block-sparse ring attention on CPU/gloo (2 and 4 ranks) against the float64 dense masked oracle,
with byte accounting: pairs of ranks that share no block pair exchange nothing.

One spawned world per world size runs every case, since starting processes dominates the cost.
Workers assert with messages (pytest does not rewrite asserts in spawned processes).
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
    BlockSparseMultiheadAttention,
    BlockSparseRingAttention,
    BlockSparseRingMultiheadAttention,
    block_sparse_ring_attention,
    shard_sequence,
)
from dilated_attention import patterns as P

pytestmark = pytest.mark.distributed

B, H, D = 2, 4, 8
TIGHT = {"atol": 1e-10, "rtol": 1e-7}


def _tensors(n: int, kv_heads: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(B, n, H, D), (B, n, kv_heads, D), (B, n, kv_heads, D), (B, n, H, D)]
    return [torch.randn(s, dtype=torch.float64, generator=gen) for s in shapes]


def _cases(world_size: int) -> list[tuple]:
    """(local_len, block_size, pattern, is_causal, kv_heads): aligned and straddling blocks,
    ragged last block, empty rows, GQA/MQA."""
    mask = torch.rand(8, 8, generator=torch.Generator().manual_seed(world_size)) < 0.3
    mask[2] = False  # an empty query block
    shapes = [(8, 4), (6, 4), (5, 3)]  # aligned; blocks straddle shards; ragged last block
    patterns = [
        P.LocalWindow(1),
        P.GlobalLocal(1, 0),
        P.DilatedBlocks((2, 3)),
        P.Random(0.3, seed=4),
        P.Custom(mask),
    ]
    cases = []
    for (n, bs), pattern, causal in itertools.product(shapes, patterns, [False, True]):
        blocks = -(-n * world_size // bs)
        if isinstance(pattern, P.Custom):
            if blocks > 8:
                continue
            pattern = P.Custom(pattern.mask[:blocks, :blocks])
        kv_heads = (4, 2, 1)[len(cases) % 3]
        cases.append((n, bs, pattern, causal, kv_heads))
    return cases


def _check_against_oracle(rank: int, world_size: int) -> None:
    for index, (n, bs, pattern, causal, kv_heads) in enumerate(_cases(world_size)):
        seq_len = n * world_size
        q, k, v, dout = _tensors(seq_len, kv_heads, seed=index)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        mask = token_mask(pattern, bs, seq_len, seq_len, causal).expand(H, -1, -1)
        ref, ref_lse = masked_attention(*leaves, mask)
        ref_grads = torch.autograd.grad(ref, leaves, dout)
        local = [shard_sequence(t).requires_grad_() for t in (q, k, v)]
        out, lse = block_sparse_ring_attention(
            *local, pattern, block_size=bs, is_causal=causal, return_lse=True
        )
        grads = torch.autograd.grad(out, local, shard_sequence(dout))
        case = f"rank {rank}/{world_size} n={n} bs={bs} {pattern} causal={causal} Hkv={kv_heads}"
        for name, got in [("out", out), ("lse", lse), *zip(("dq", "dk", "dv"), grads, strict=True)]:
            assert not bool(torch.isnan(got).any()), f"{name} has NaN: {case}"
        torch.testing.assert_close(
            out, shard_sequence(ref), **TIGHT, msg=lambda m, c=case: f"out {c}: {m}"
        )
        want_lse = shard_sequence(ref_lse, seq_dim=2)
        assert torch.equal(torch.isinf(lse), torch.isinf(want_lse)), f"lse -inf rows: {case}"
        torch.testing.assert_close(lse, want_lse, **TIGHT, msg=lambda m, c=case: f"lse {c}: {m}")
        for name, got, want in zip("qkv", grads, ref_grads, strict=True):
            torch.testing.assert_close(
                got, shard_sequence(want), **TIGHT,
                msg=lambda m, name=name, c=case: f"d{name} {c}: {m}",
            )  # fmt: skip


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_matches_oracle(world_size: int, tmp_path: Path) -> None:
    """Outputs, lse and dq/dk/dv shards equal the single-process float64 oracle on every rank."""
    run_world(_check_against_oracle, world_size, tmp_path, timeout_s=120)


def _check_bytes(rank: int, world_size: int) -> None:
    with count_exchanges(comm=comm) as log:
        n, bs = 8, 4
        q, k, v, dout = _tensors(n * world_size, H, seed=1)
        local = [shard_sequence(t).requires_grad_() for t in (q, k, v)]
        token = 2 * B * H * D * 8  # one token's K and V, float64

        def run(pattern: P.Pattern, causal: bool) -> tuple[int, int]:
            for values in log.values():
                values.clear()
            out = block_sparse_ring_attention(*local, pattern, block_size=bs, is_causal=causal)
            forward = sum(log["comm_sent"])
            out.backward(shard_sequence(dout))
            return forward, sum(log["comm_sent"]) - forward

        for causal in (False, True):  # no block pair crosses a shard: nothing moves at all
            forward, backward = run(P.LocalWindow(0), causal)
            calls = sum(log["comm_calls"])
            assert forward == backward == 0 and calls == 0, (
                f"rank {rank}: LocalWindow(0) causal={causal} sent {forward}+{backward} bytes in "
                f"{calls} exchanges"
            )
        # Neighbouring blocks only: one block to each neighbour (to the next rank when causal),
        # never a whole shard; the backward sends the same keys again plus their gradients.
        for causal in (False, True):
            forward, backward = run(P.LocalWindow(1), causal)
            neighbours = int(rank < world_size - 1) + int(not causal and rank > 0)
            assert forward == neighbours * bs * token, (
                f"rank {rank}: LocalWindow(1) causal={causal} forward sent {forward} bytes, "
                f"expected {neighbours} block(s) = {neighbours * bs * token}"
            )
            received = int(rank > 0) + int(not causal and rank < world_size - 1)
            expected_backward = (neighbours + received) * bs * token
            assert backward == expected_backward, (
                f"rank {rank}: LocalWindow(1) causal={causal} backward sent {backward} bytes, "
                f"expected {expected_backward}"
            )
        # Causal and dense: a rank never sends to an earlier rank.
        forward, _ = run(P.LocalWindow(10**6), True)
        assert forward == (world_size - 1 - rank) * n * token, (rank, forward)


@pytest.mark.parametrize("world_size", [2, 4])
def test_skipped_steps_send_nothing(world_size: int, tmp_path: Path) -> None:
    run_world(_check_bytes, world_size, tmp_path)


def _check_modules(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    pattern = P.GlobalLocal(1, 1)
    ring = BlockSparseRingMultiheadAttention(
        32, 4, pattern, block_size=4, num_kv_heads=2, dtype=torch.float64
    )
    local_layer = BlockSparseMultiheadAttention(
        32, 4, pattern, block_size=4, num_kv_heads=2, dtype=torch.float64
    )
    local_layer.load_state_dict(ring.state_dict())
    n = 6
    x = torch.randn(2, n * world_size, 32, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(1))  # fmt: skip
    full, _ = local_layer(x, is_causal=True)
    full.square().sum().backward()
    x_local = shard_sequence(x).requires_grad_()
    out, weights = ring(x_local, is_causal=True)
    assert weights is None and out.shape == x_local.shape, f"rank {rank}: {out.shape}"
    torch.testing.assert_close(out, shard_sequence(full), **TIGHT)
    out.square().sum().backward()
    x_grad = x.clone().requires_grad_()
    local_layer.zero_grad()
    full2, _ = local_layer(x_grad, is_causal=True)
    full2.square().sum().backward()
    assert x_local.grad is not None
    torch.testing.assert_close(x_local.grad, shard_sequence(x_grad.grad), **TIGHT)
    for (name, p_ring), p_local in zip(
        ring.named_parameters(), local_layer.parameters(), strict=True
    ):
        grad = p_ring.grad.clone()
        dist.all_reduce(grad)  # each rank holds its shard's share of the parameter gradient
        torch.testing.assert_close(
            grad, p_local.grad, **TIGHT, msg=lambda m, name=name: f"rank {rank} {name}: {m}"
        )
    # With rotary positions: each rank's shard rotates at its global positions (before: at
    # 0..n-1 on every rank, so every rank but the first got another result).
    ring.use_rotary(100.0)
    local_layer.use_rotary(100.0)
    with torch.no_grad():
        out, _ = ring(shard_sequence(x), is_causal=True)
        full, _ = local_layer(x, is_causal=True)
    torch.testing.assert_close(out, shard_sequence(full), **TIGHT,
                               msg=lambda m: f"rank {rank} rotary: {m}")  # fmt: skip
    # The (B, n, H, D) module equals the functional.
    module = BlockSparseRingAttention(pattern, block_size=4, scale=0.5)
    q, k, v, _ = _tensors(n * world_size, 2, seed=3)
    local = [shard_sequence(t) for t in (q, k, v)]
    want = block_sparse_ring_attention(*local, pattern, block_size=4, scale=0.5, is_causal=True)
    torch.testing.assert_close(module(*local, is_causal=True), want, atol=0, rtol=0)


@pytest.mark.parametrize("world_size", [2])
def test_ring_modules(world_size: int, tmp_path: Path) -> None:
    """The ring multihead layer equals the local layer on the gathered sequence (outputs, input
    and parameter gradients)."""
    run_world(_check_modules, world_size, tmp_path)


def _check_mismatch(rank: int, world_size: int) -> None:
    q, k, v, _ = _tensors(8 * world_size, H, seed=0)
    local = [shard_sequence(t) for t in (q, k, v)]
    # Different patterns on different ranks: every rank raises, none hangs.
    pattern = P.LocalWindow(1) if rank == 0 else P.LocalWindow(2)
    with pytest.raises(ValueError, match="schedule"):
        block_sparse_ring_attention(*local, pattern, block_size=4)
    with pytest.raises(ValueError, match="schedule"):
        block_sparse_ring_attention(*local, P.LocalWindow(1), block_size=4 if rank else 8)
    # A bad argument on one rank only: that rank raises its error, the others name it.
    bad = P.Custom(torch.ones(3, 3, dtype=torch.bool)) if rank == 0 else P.LocalWindow(1)
    with pytest.raises(ValueError, match=r"Custom mask|rank"):
        block_sparse_ring_attention(*local, bad, block_size=4)
    bad_pattern = "local" if rank == 1 else P.LocalWindow(1)
    with pytest.raises((TypeError, ValueError), match=r"Pattern|rank"):
        block_sparse_ring_attention(*local, bad_pattern, block_size=4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"block_size|rank"):
        block_sparse_ring_attention(*local, P.LocalWindow(1), block_size=0 if rank else 4)


@pytest.mark.parametrize("world_size", [2])
def test_mismatched_or_bad_arguments_raise_on_every_rank(world_size: int, tmp_path: Path) -> None:
    run_world(_check_mismatch, world_size, tmp_path)


def test_single_process_without_process_group() -> None:
    """Without torch.distributed the ring function is the local block-sparse attention."""
    from dilated_attention import block_sparse_attention

    q, k, v, _ = _tensors(20, 2, seed=5)
    pattern = P.Random(0.4, seed=1)
    for causal in (False, True):
        got = block_sparse_ring_attention(q, k, v, pattern, block_size=3, is_causal=causal)
        want = block_sparse_attention(q, k, v, pattern, block_size=3, is_causal=causal)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_ring_module_bad_input() -> None:
    with pytest.raises(TypeError, match="Pattern"):
        BlockSparseRingAttention("local")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_size"):
        BlockSparseRingAttention(P.LocalWindow(1), block_size=0)
    module = BlockSparseRingAttention(P.LocalWindow(1), block_size=4)
    q, k, v, _ = _tensors(8, 4, seed=0)
    with pytest.raises(ValueError, match="key_padding_mask"):
        module(q, k, v, key_padding_mask=torch.zeros(B, 8, dtype=torch.bool))


def test_earlier_names_are_aliases() -> None:
    """The names the migration table promises (docs/migration.md) are the
    renamed classes themselves, at the top level and in their module."""
    import dilated_attention
    import dilated_attention.distributed.rings.block_sparse_ring as bsr

    assert dilated_attention.BlockSparseRingDilatedAttention is BlockSparseRingAttention
    assert dilated_attention.BlockSparseRingMultiheadDilatedAttention is (
        bsr.BlockSparseRingMultiheadAttention
    )
