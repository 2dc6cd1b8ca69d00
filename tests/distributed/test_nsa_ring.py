"""NSA-style attention over the ring on CPU/gloo (2 and 4 ranks): every rank's shard equals
one-process ``nsa_attention`` on the gathered sequence in float64 (outputs, dq/dk/dv and the
gates' gradient), causal and not, GQA, both combinations; the bytes each rank sends are
``nsa_ring_volume``'s; bad calls raise on every rank. One spawned world per test runs every
case (starting processes dominates).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from support.distributed_utils import count_exchanges, raises_on_rank, run_world

import dilated_attention.distributed.comm.collectives as comm
import dilated_attention.distributed.rings.ring as ring_module
from dilated_attention import shard_sequence
from dilated_attention.distributed import ContextParallel, nsa_ring_attention
from dilated_attention.distributed.rings.nsa_ring import compressed_needs, nsa_ring_volume
from dilated_attention.distributed.rings.template import RingSetup
from dilated_attention.sparse import nsa_attention

pytestmark = pytest.mark.distributed

B, H, D, N_LOCAL = 2, 4, 8, 8
TIGHT = {"atol": 1e-10, "rtol": 1e-7}

#: (is_causal, kv_heads, combine, sizes): windows that straddle shards (l = 2 d), windows of
#: single rows' chunks (gcd(l, d, n) = 1), side by side (l = d), and longer than a shard (the
#: first rank sees no compressed key when causal).
CASES = [
    (True, 2, "gates", dict(compress_block=4, compress_stride=2, select_block=4, topk=1,
                            window=3)),
    (True, 4, "lse", dict(compress_block=6, compress_stride=3, select_block=4, topk=2,
                          window=5)),
    (False, 2, "gates", dict(compress_block=4, compress_stride=4, select_block=8, topk=1,
                             window=3)),
    (False, 1, "lse", dict(compress_block=5, compress_stride=2, select_block=4, topk=1,
                           window=2)),
    (True, 2, "lse", dict(compress_block=12, compress_stride=4, select_block=4, topk=1,
                          window=4)),
]  # fmt: skip


def _tensors(seq_len: int, kv_heads: int, seed: int) -> list[torch.Tensor]:
    """q, k, v, gates (activated) and the output's gradient, float64."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(B, seq_len, H, D), (B, seq_len, kv_heads, D), (B, seq_len, kv_heads, D),
              (B, seq_len, H, 3), (B, seq_len, H, D)]  # fmt: skip
    q, k, v, gates, dout = (torch.randn(s, dtype=torch.float64, generator=gen) for s in shapes)
    return [q, k, v, torch.sigmoid(gates), dout]


def _check_against_one_process(rank: int, world_size: int) -> None:
    seq_len = N_LOCAL * world_size
    for index, (causal, kv_heads, combine, sizes) in enumerate(CASES):
        q, k, v, gates, dout = _tensors(seq_len, kv_heads, seed=index)
        gated = combine == "gates"
        names = "qkvg" if gated else "qkv"
        full = [q, k, v, gates][: len(names)]
        leaves = [t.clone().requires_grad_() for t in full]
        args = (*leaves[:3], leaves[3] if gated else None)
        ref = nsa_attention(*args, is_causal=causal, combine=combine, **sizes)
        ref_grads = torch.autograd.grad(ref, leaves, dout)
        local = [shard_sequence(t).requires_grad_() for t in full]
        args = (*local[:3], local[3] if gated else None)
        out = nsa_ring_attention(*args, is_causal=causal, combine=combine, **sizes)
        grads = torch.autograd.grad(out, local, shard_sequence(dout))
        case = f"rank {rank}/{world_size} causal={causal} Hkv={kv_heads} {combine} {sizes}"
        torch.testing.assert_close(out, shard_sequence(ref), **TIGHT,
                                   msg=lambda m, c=case: f"out {c}: {m}")  # fmt: skip
        for x, got, want in zip(names, grads, ref_grads, strict=True):
            torch.testing.assert_close(got, shard_sequence(want), **TIGHT,
                                       msg=lambda m, x=x, c=case: f"d{x} {c}: {m}")  # fmt: skip
        if index == 1:  # without gradients (inference): no graph, the same values
            with torch.no_grad():
                again = nsa_ring_attention(*args, is_causal=causal, combine=combine, **sizes)
            torch.testing.assert_close(again, out.detach(), **TIGHT, msg=f"no_grad {case}")
    # The last case's first rank sees no compressed key (its gather reads nothing), and still
    # receives its chunks' gradients from the ranks that read them: exercised above.
    assert compressed_needs(N_LOCAL, world_size, 12, 4, True)[0] == 0


@pytest.mark.parametrize("world_size", [2, 4])
def test_nsa_over_the_ring_equals_one_process(world_size: int, tmp_path: Path) -> None:
    run_world(_check_against_one_process, world_size, tmp_path, timeout_s=120)


def test_compressed_keys_read_only_the_ranks_before_the_last_window_seen() -> None:
    """Rank ``a`` gathers the chunks of the ranks before the end of the last window its
    queries see: causal, itself and the ranks before it (none before the first window's end);
    not causal, every rank holding a window (not the last rank, past the last whole window)."""
    assert compressed_needs(8, 4, 4, 2, is_causal=True) == (1, 2, 3, 4)
    assert compressed_needs(8, 4, 12, 4, is_causal=True) == (0, 2, 3, 4)
    assert compressed_needs(8, 4, 4, 2, is_causal=False) == (4, 4, 4, 4)
    assert compressed_needs(4, 4, 6, 6, is_causal=False) == (3, 3, 3, 3)  # windows end at 12
    assert compressed_needs(4, 4, 6, 6, is_causal=True) == (0, 2, 3, 3)


def _check_bytes(rank: int, world_size: int) -> None:
    for causal, kv_heads, combine, sizes in CASES:
        q, k, v, gates, dout = _tensors(N_LOCAL * world_size, kv_heads, seed=0)
        local = [shard_sequence(t).requires_grad_() for t in (q, k, v, gates)]
        g = local[3] if combine == "gates" else None
        with count_exchanges(comm=comm, ring=ring_module) as log:
            out = nsa_ring_attention(*local[:3], g, is_causal=causal, combine=combine, **sizes)
            forward = sum(log["comm_sent"]) + sum(log["ring_sent"])
            out.backward(shard_sequence(dout))
            backward = sum(log["comm_sent"]) + sum(log["ring_sent"]) - forward
        setup = RingSetup(rank, world_size, tuple(range(world_size)), "contiguous", N_LOCAL,
                          causal, 1.0, "ring")  # fmt: skip
        sizes = {name: value for name, value in sizes.items() if name != "topk"}
        model = nsa_ring_volume(local[1], setup, combine=combine, **sizes)
        case = f"rank {rank}/{world_size} causal={causal} {combine} {sizes}"
        assert (forward, backward) == (model.forward, model.backward), (
            f"{case}: sent {forward}+{backward} bytes, the volume says {model}"
        )


@pytest.mark.parametrize("world_size", [2, 4])
def test_bytes_sent_are_the_reported_volume(world_size: int, tmp_path: Path) -> None:
    """The compressed keys' chunks to the ranks that read them (and their gradients home), the
    key blocks' means, the masked ring's shards, the window's halo; lse: each ring twice."""
    run_world(_check_bytes, world_size, tmp_path, timeout_s=60)


def _check_bad_calls(rank: int, world_size: int) -> None:
    q, k, v, gates, _ = _tensors(N_LOCAL * world_size, 2, seed=0)
    local = [shard_sequence(t) for t in (q, k, v, gates)]
    sizes = dict(compress_block=4, compress_stride=2, select_block=4, topk=1, window=3)

    def call(*tensors: torch.Tensor | None, **change: object) -> None:
        nsa_ring_attention(*(tensors or local), **{**sizes, **change})  # type: ignore[arg-type]

    with raises_on_rank("topk=0 without causal on rank 1", r"topk|rank 1", within_s=10):
        call(is_causal=False, topk=0 if rank == 1 else 1)
    with raises_on_rank("shards not whole selected blocks", r"whole selected blocks"):
        call(select_block=3)
    bad_gates = local[3][..., :2] if rank == 0 else local[3]
    with raises_on_rank("gates of the wrong shape on rank 0", r"gates must have shape|rank 0"):
        call(*local[:3], bad_gates)
    with raises_on_rank("gates with combine='lse'", r"gates are not used"):
        call(combine="lse")
    with raises_on_rank("combine differs", r"combine.*differs"):
        call(*local[:3], local[3] if rank == 0 else None,
             combine="gates" if rank == 0 else "lse")  # fmt: skip
    leaves = [t.clone().requires_grad_(rank == 1) for t in local]
    with raises_on_rank("grad mode differs", r"grad mode.*differs"):
        call(*leaves)
    rows = 4 if rank == 1 else N_LOCAL  # a query shorter than its keys (one process: decoding)
    with raises_on_rank("query shard shorter on rank 1", r"same local seq_len|rank 1"):
        call(local[0][:, :rows], *local[1:3], local[3][:, :rows])
    with raises_on_rank("a ContextParallel", r"ContextParallel"):
        call(group=ContextParallel(ring=dist.group.WORLD))


def test_bad_calls_raise_on_every_rank(tmp_path: Path) -> None:
    run_world(_check_bad_calls, 2, tmp_path, timeout_s=20)


def _check_models(rank: int, world_size: int) -> None:
    """``context_parallel`` of a LongNetLM whose layers are MoBA- or NSA-style (both
    combinations): each rank's logits are its shard of the one-process logits, and the
    parameters' gradients summed over the ranks are the one-process ones. A layer's call
    rejected on one rank raises on every rank; a head all-to-all is refused, nothing changed."""
    import copy

    from dilated_attention import LongNetConfig, LongNetLM, create_multihead_dilated_attention
    from dilated_attention.config import BlockSelectedConfig, CompressedSelectedWindowConfig
    from dilated_attention.distributed import context_parallel

    nsa = dict(compress_block=4, compress_stride=2, select_block=4, topk=1, window=3)
    models = (("moba", BlockSelectedConfig(block_size=4, topk=1)),
              ("nsa", CompressedSelectedWindowConfig(**nsa)),
              ("nsa", CompressedSelectedWindowConfig(**nsa, combine="lse")))  # fmt: skip
    for kind, sparse in models:
        torch.manual_seed(0)
        config = LongNetConfig(vocab_size=32, embed_dim=32, num_heads=4, num_kv_heads=2,
                               num_layers=2, segment_lengths=(16,), dilation_rates=(1,),
                               ffn_dim=64, kind=kind, sparse=sparse)  # fmt: skip
        model = LongNetLM(config).double()
        tokens = torch.randint(0, 32, (2, N_LOCAL * world_size),
                               generator=torch.Generator().manual_seed(1))  # fmt: skip
        want = model(tokens)
        want_grads = torch.autograd.grad(want.square().sum(), list(model.parameters()))
        parallel = context_parallel(copy.deepcopy(model), None)
        logits = parallel(shard_sequence(tokens))
        case = f"rank {rank}/{world_size} {kind} {sparse}"
        torch.testing.assert_close(logits, shard_sequence(want).detach(), **TIGHT,
                                   msg=lambda m, c=case: f"logits {c}: {m}")  # fmt: skip
        grads = torch.autograd.grad(logits.square().sum(), list(parallel.parameters()))
        for got, expected in zip(grads, want_grads, strict=True):
            total = got.clone()
            dist.all_reduce(total)
            torch.testing.assert_close(total, expected, **TIGHT,
                                       msg=lambda m, c=case: f"grads {c}: {m}")  # fmt: skip
    layer = create_multihead_dilated_attention("nsa", embed_dim=32, num_heads=4, **nsa).double()
    with raises_on_rank("a head all-to-all", r"no head all-to-all"):
        context_parallel(layer, ContextParallel(heads=dist.group.WORLD))
    assert type(layer.attention).__name__ == "CompressedSelectedWindowAttention"
    context_parallel(layer, ContextParallel(ring=dist.group.WORLD))
    x = torch.randn(2, N_LOCAL, 32, dtype=torch.float64)
    mask = torch.zeros(2, N_LOCAL, dtype=torch.bool) if rank == 0 else None
    with raises_on_rank("a key padding mask on rank 0", r"key_padding_mask|rank 0", within_s=10):
        layer(x, key_padding_mask=mask, is_causal=True)
    wide = torch.randn(2, N_LOCAL, 16 if rank == 1 else 32, dtype=torch.float64)
    with raises_on_rank("a wrong embed_dim on rank 1", r"embed_dim|rank 1", within_s=10):
        layer(wide, is_causal=True)


def test_context_parallel_models_of_selected_layers_equal_one_process(tmp_path: Path) -> None:
    run_world(_check_models, 2, tmp_path, timeout_s=60)
