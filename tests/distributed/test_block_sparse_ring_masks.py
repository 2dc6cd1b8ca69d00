"""Block-sparse ring attention with a run-time block mask on CPU/gloo (2 and 4 ranks): every rank's
shard equals one-process ``block_sparse_attention`` on the gathered sequence in float64 (outputs,
lse, dq/dk/dv), the bytes each rank sends are the volume the module reports, and bad calls raise
on every rank. One spawned world per test runs every case (starting processes dominates).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from support.distributed_utils import count_exchanges, raises_on_rank, run_world

import dilated_attention.distributed.comm.collectives as comm
import dilated_attention.distributed.rings.ring as ring_module
from dilated_attention import block_sparse_attention, block_sparse_ring_attention, shard_sequence
from dilated_attention.distributed import ContextParallel
from dilated_attention.distributed.rings.masked_ring import masked_ring_volume
from dilated_attention.distributed.rings.template import RingSetup

pytestmark = pytest.mark.distributed

B, H, D, BS, N_LOCAL = 2, 4, 8, 4, 8
TIGHT = {"atol": 1e-10, "rtol": 1e-7}


def _tensors(seq_len: int, kv_heads: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(B, seq_len, H, D), (B, seq_len, kv_heads, D), (B, seq_len, kv_heads, D),
              (B, seq_len, H, D)]  # fmt: skip
    return [torch.randn(s, dtype=torch.float64, generator=gen) for s in shapes]


def _masks(world_size: int, seed: int) -> list[tuple[str, torch.Tensor, int]]:
    """(name, mask over the whole sequence's blocks, kv_heads): per batch row and head, per
    key/value head (GQA), shared, with empty query blocks, and int indices with -1."""
    m = N_LOCAL * world_size // BS
    gen = torch.Generator().manual_seed(seed)
    per_head = torch.rand(B, H, m, m, generator=gen) < 0.4
    per_head[0, 1, 1] = False  # an empty query block (its rows give zeros)
    per_head[1, :, m - 1] = False
    per_kv_head = torch.rand(1, 2, m, m, generator=gen) < 0.5
    shared = torch.rand(1, 1, m, m, generator=gen) < 0.3
    shared[0, 0, 0] = False
    indices = torch.randint(-1, m, (B, 1, m, 3), generator=gen)
    indices[0, 0, 0] = -1  # a row of "none"
    return [("per head", per_head, 2), ("per kv head", per_kv_head, 2),
            ("shared", shared, 1), ("indices", indices, 4)]  # fmt: skip


def _check_against_one_process(rank: int, world_size: int) -> None:
    seq_len = N_LOCAL * world_size
    for index, (name, mask, kv_heads) in enumerate(_masks(world_size, seed=world_size)):
        for causal in (False, True):
            q, k, v, dout = _tensors(seq_len, kv_heads, seed=index)
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            ref, ref_lse = block_sparse_attention(
                *leaves, mask, block_size=BS, is_causal=causal, return_lse=True
            )
            ref_grads = torch.autograd.grad(ref, leaves, dout)
            # The whole mask on every rank, or this rank's rows of it.
            rows = mask if index % 2 else shard_sequence(mask, seq_dim=2)
            local = [shard_sequence(t).requires_grad_() for t in (q, k, v)]
            out, lse = block_sparse_ring_attention(
                *local, rows, block_size=BS, is_causal=causal, return_lse=True
            )
            grads = torch.autograd.grad(out, local, shard_sequence(dout))
            case = f"rank {rank}/{world_size} {name} causal={causal}"
            torch.testing.assert_close(
                out, shard_sequence(ref), **TIGHT, msg=lambda m, c=case: f"out {c}: {m}"
            )
            want_lse = shard_sequence(ref_lse, seq_dim=2)
            torch.testing.assert_close(lse, want_lse, **TIGHT,
                                       msg=lambda m, c=case: f"lse {c}: {m}")  # fmt: skip
            for x, got, want in zip("qkv", grads, ref_grads, strict=True):
                torch.testing.assert_close(
                    got, shard_sequence(want), **TIGHT,
                    msg=lambda m, x=x, c=case: f"d{x} {c}: {m}",
                )  # fmt: skip


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_with_a_run_time_mask_equals_one_process(world_size: int, tmp_path: Path) -> None:
    run_world(_check_against_one_process, world_size, tmp_path, timeout_s=120)


def _check_bytes(rank: int, world_size: int) -> None:
    q, k, v, dout = _tensors(N_LOCAL * world_size, 2, seed=0)
    mask = _masks(world_size, seed=0)[0][1]
    local = [shard_sequence(t).requires_grad_() for t in (q, k, v)]
    for causal in (False, True):
        with count_exchanges(comm=comm, ring=ring_module) as log:
            out = block_sparse_ring_attention(*local, mask, block_size=BS, is_causal=causal)
            forward = sum(log["comm_sent"]) + sum(log["ring_sent"])
            out.backward(shard_sequence(dout))
            backward = sum(log["comm_sent"]) + sum(log["ring_sent"]) - forward
        setup = RingSetup(rank, world_size, tuple(range(world_size)), "contiguous", N_LOCAL,
                          causal, 1.0, "ring")  # fmt: skip
        model = masked_ring_volume(local[1], setup, torch.float64)
        assert (forward, backward) == (model.forward, model.backward), (
            f"rank {rank}/{world_size} causal={causal}: sent {forward}+{backward} bytes, the "
            f"volume says {model}"
        )
        shard = 2 * B * N_LOCAL * 2 * D * 8  # K and V of one shard, float64
        homes = world_size - 1 if not causal else rank
        assert model.forward == (world_size - 1) * shard, model
        assert model.backward == (world_size - 1 + homes) * shard, model
        if rank == 0:
            print(f"W={world_size} causal={causal}: rank 0 sent {forward} B forward, "
                  f"{backward} B backward")  # fmt: skip


@pytest.mark.parametrize("world_size", [2, 4])
def test_bytes_sent_are_the_reported_volume(world_size: int, tmp_path: Path) -> None:
    """Shards travel as in the dense ring; key gradients go home only from the shards a rank
    computed against (causal: earlier ranks'), one float64 accumulator each."""
    run_world(_check_bytes, world_size, tmp_path)


def _check_bad_calls(rank: int, world_size: int) -> None:
    q, k, v, _ = _tensors(N_LOCAL * world_size, 2, seed=0)
    local = [shard_sequence(t) for t in (q, k, v)]
    m = N_LOCAL * world_size // BS
    mask = torch.ones(1, 1, m, m, dtype=torch.bool)
    with raises_on_rank("shards not whole blocks", r"whole blocks.*multiple of block_size=3"):
        block_sparse_ring_attention(*local, torch.ones(1, 1, 6, 6, dtype=torch.bool),
                                    block_size=3)  # fmt: skip
    bad = torch.ones(1, 1, m + 1, m, dtype=torch.bool) if rank == 0 else mask
    with raises_on_rank("a wrong mask on rank 0", r"dim 2 is|rank 0"):
        block_sparse_ring_attention(*local, bad, block_size=BS)
    other = mask if rank == 0 else mask.expand(1, 2, m, m)  # (1, 1, ...) against (1, 2, ...)
    with raises_on_rank("masks of another layout", r"schedule"):
        block_sparse_ring_attention(*local, other, block_size=BS)
    float_mask = mask.double() if rank == 1 else mask
    error = TypeError if rank == 1 else ValueError
    with raises_on_rank("a float mask on rank 1", r"bool|rank 1", error=error):
        block_sparse_ring_attention(*local, float_mask, block_size=BS)
    with raises_on_rank("cu_seqlens", r"cu_seqlens"):
        block_sparse_ring_attention(*(t[:1] for t in local), mask[:1], block_size=BS,
                                    cu_seqlens=[0, N_LOCAL * world_size])  # fmt: skip
    with raises_on_rank("a ContextParallel", r"ContextParallel"):
        block_sparse_ring_attention(*local, mask, block_size=BS,
                                    group=ContextParallel(ring=dist.group.WORLD))  # fmt: skip


def test_bad_calls_raise_on_every_rank(tmp_path: Path) -> None:
    run_world(_check_bad_calls, 2, tmp_path, timeout_s=20)


def _check_moba(rank: int, world_size: int) -> None:
    from dilated_attention.distributed import moba_ring_attention
    from dilated_attention.sparse import moba_attention

    seq_len = N_LOCAL * world_size
    for causal, kv_heads, topk in ((True, 2, 1), (False, 4, 2), (True, 1, 2)):
        q, k, v, dout = _tensors(seq_len, kv_heads, seed=kv_heads)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = moba_attention(*leaves, block_size=BS, topk=topk, is_causal=causal)
        ref_grads = torch.autograd.grad(ref, leaves, dout)
        local = [shard_sequence(t).requires_grad_() for t in (q, k, v)]
        with count_exchanges(comm=comm, ring=ring_module) as log:
            out = moba_ring_attention(*local, block_size=BS, topk=topk, is_causal=causal)
        grads = torch.autograd.grad(out, local, shard_sequence(dout))
        case = f"rank {rank}/{world_size} causal={causal} Hkv={kv_heads} topk={topk}"
        torch.testing.assert_close(out, shard_sequence(ref), **TIGHT,
                                   msg=lambda m, c=case: f"out {c}: {m}")  # fmt: skip
        for x, got, want in zip("qkv", grads, ref_grads, strict=True):
            torch.testing.assert_close(got, shard_sequence(want), **TIGHT,
                                       msg=lambda m, x=x, c=case: f"d{x} {c}: {m}")  # fmt: skip
        # The all-gather of the key blocks' means (one (B, n / bs, Hkv, D) per step), then the
        # shards of the masked ring.
        means = B * (N_LOCAL // BS) * kv_heads * D * 8
        setup = RingSetup(rank, world_size, tuple(range(world_size)), "contiguous", N_LOCAL,
                          causal, 1.0, "ring")  # fmt: skip
        shards = masked_ring_volume(local[1], setup, torch.float64).forward
        assert log["comm_sent"][: world_size - 1] == [means] * (world_size - 1), (case, log)
        sent = sum(log["comm_sent"]) + sum(log["ring_sent"])
        assert sent == (world_size - 1) * means + shards, (case, sent, means, shards)
    # Soft-capped scores and sinks (the choice unaffected): the sinks' gradient is each rank's
    # rows' share of the one-process one.
    q, k, v, dout = _tensors(seq_len, 2, seed=5)
    sinks = torch.randn(H, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    ref = moba_attention(*leaves[:3], block_size=BS, topk=1, softcap=2.0, sinks=leaves[3])
    ref_grads = torch.autograd.grad(ref, leaves, dout)
    mine = [shard_sequence(t).requires_grad_() for t in (q, k, v)] + [sinks.clone()]
    mine[3].requires_grad_()
    out = moba_ring_attention(*mine[:3], block_size=BS, topk=1, softcap=2.0, sinks=mine[3])
    grads = list(torch.autograd.grad(out, mine, shard_sequence(dout)))
    dist.all_reduce(grads[3])
    torch.testing.assert_close(out, shard_sequence(ref), **TIGHT, msg="out, softcap and sinks")
    for x, got, want in zip(["q", "k", "v", "sinks"], grads, ref_grads, strict=True):
        want = want if x == "sinks" else shard_sequence(want)
        torch.testing.assert_close(got, want, **TIGHT, msg=lambda m, x=x: f"d{x}, sinks: {m}")
    bad_topk = 0 if rank == 1 else 1
    with raises_on_rank("topk=0 without causal on rank 1", r"topk|rank 1"):
        moba_ring_attention(*local, block_size=BS, topk=bad_topk, is_causal=False)
    with raises_on_rank("shards not whole blocks", r"whole blocks"):
        moba_ring_attention(*local, block_size=3, topk=1)


def test_moba_over_the_ring_equals_one_process(tmp_path: Path) -> None:
    """Each rank's shard of ``moba_attention`` (outputs, dq/dk/dv) with the means all-gathered:
    the bytes it adds are (W - 1) key-block means per rank."""
    run_world(_check_moba, 2, tmp_path, timeout_s=30)
