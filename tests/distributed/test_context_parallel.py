"""Context parallelism over a mesh (Note [Context parallel groups] in
``distributed/context.py``): the head all-to-all alone (Ulysses), a ring alone and both (a 2 x 2
mesh), for dense, dilated and block-sparse attention, on gloo worlds of 2 and 4 processes.

Every rank builds the same full float64 tensors, runs the ring function on its shard
(``shard_sequence(x, group=cp)``) and checks its output, lse and gradient shards against the
float64 oracle of the whole sequence. Dilated schedules whose rates do not divide a rank's heads
exercise the shifted head offsets (Note [Heads from a later layer head]); GQA with fewer
key/value heads than ranks, the repeat (Note [Calls under a head all-to-all]). Workers assert
with messages (pytest does not rewrite them).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.distributed_utils import raises_on_rank, run_world
from support.oracle import oracle_attention, oracle_dilated_attention

from dilated_attention import patterns
from dilated_attention.core.geometry.schedule import Schedule
from dilated_attention.distributed import (
    ContextParallel,
    block_sparse_ring_attention,
    context_parallel,
    plan_context_parallel,
    ring_attention,
    ring_dilated_attention,
    sequence_positions,
    shard_sequence,
    unshard_sequence,
)
from dilated_attention.distributed.comm.collectives import count_traffic
from dilated_attention.distributed.layout.cost import Shape, split_volume
from dilated_attention.functional import block_sparse_attention

pytestmark = pytest.mark.distributed

BATCH, HEADS, DIM, LOCAL = 2, 8, 8, 6
TIGHT = {"atol": 1e-10, "rtol": 1e-7}


@dataclass(frozen=True)
class Case:
    operation: str  # "dense", "dilated", "block_sparse"
    causal: bool = False
    kv_heads: int = HEADS
    layout: str = "contiguous"
    masked: bool = False
    schedule: tuple = ((4, 8), (1, 2))


def _full(case: Case, seq_len: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    shapes = [(BATCH, seq_len, HEADS, DIM)] + [(BATCH, seq_len, case.kv_heads, DIM)] * 2
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]


def _mask(seq_len: int) -> torch.Tensor:
    mask = torch.zeros(BATCH, seq_len, dtype=torch.bool)
    mask[1, :3] = True
    mask[0, seq_len // 2] = True
    return mask


def _oracle(case: Case, q, k, v, mask):  # type: ignore[no-untyped-def]
    if case.operation == "dilated":
        return oracle_dilated_attention(
            q, k, v, *case.schedule, is_causal=case.causal, key_padding_mask=mask
        )
    if case.operation == "block_sparse":
        pattern = patterns.LocalWindow(1)
        return block_sparse_attention(q, k, v, pattern, block_size=4, is_causal=case.causal,
                                      backend="math", return_lse=True)  # fmt: skip
    return oracle_attention(q, k, v, is_causal=case.causal, key_padding_mask=mask)


def _ring(case: Case, cp: ContextParallel, q, k, v, mask):  # type: ignore[no-untyped-def]
    options: dict[str, Any] = dict(group=cp, is_causal=case.causal, return_lse=True)
    if case.operation == "block_sparse":
        return block_sparse_ring_attention(q, k, v, patterns.LocalWindow(1), block_size=4,
                                           backend="math", **options)  # fmt: skip
    options.update(layout=case.layout, key_padding_mask=mask, backend="math")
    if case.operation == "dilated":
        return ring_dilated_attention(q, k, v, *case.schedule, **options)
    return ring_attention(q, k, v, **options)


def _check(case: Case, cp: ContextParallel, world: int) -> None:
    seq_len = LOCAL * world
    full = [x.requires_grad_() for x in _full(case, seq_len)]
    mask = _mask(seq_len) if case.masked else None
    want, want_lse = _oracle(case, *full, mask)
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(3),
                          dtype=torch.float64)  # fmt: skip
    want_grads = torch.autograd.grad((want * weights).sum(), full)
    shard = {"group": cp, "layout": case.layout}
    mine = [shard_sequence(x.detach(), **shard).requires_grad_() for x in full]
    my_mask = None if mask is None else shard_sequence(mask, **shard)
    out, lse = _ring(case, cp, *mine, my_mask)
    grads = torch.autograd.grad((out * shard_sequence(weights, **shard)).sum(), mine)
    positions = sequence_positions(LOCAL, group=cp, layout=case.layout)
    name = f"{case} over {cp}"
    torch.testing.assert_close(out, want[:, positions].detach(), **TIGHT,
                               msg=lambda m: f"{name} out: {m}")  # fmt: skip
    torch.testing.assert_close(lse, want_lse[:, :, positions].detach(), **TIGHT,
                               msg=lambda m: f"{name} lse: {m}")  # fmt: skip
    for got, expected, label in zip(grads, want_grads, "qkv", strict=True):
        torch.testing.assert_close(got, expected[:, positions], **TIGHT,
                                   msg=lambda m, label=label: f"{name} d{label}: {m}")  # fmt: skip
    joined = unshard_sequence(out.detach(), **shard)
    torch.testing.assert_close(joined, want.detach(), **TIGHT,
                               msg=lambda m: f"{name} unshard: {m}")  # fmt: skip


CASES = [
    Case("dense"),
    Case("dense", causal=True, kv_heads=2, masked=True),
    Case("dense", causal=True, layout="zigzag"),
    Case("dilated", causal=True, schedule=((4, 8, 24), (1, 2, 8)), masked=True),
    Case("dilated", kv_heads=2, schedule=((6, 12), (3, 4))),
    Case("dilated", causal=True, layout="zigzag", kv_heads=4),
    Case("block_sparse", causal=True),
    Case("block_sparse", kv_heads=2),
]


def _heads_alone(rank: int, world: int) -> None:
    cp = ContextParallel(heads=dist.group.WORLD)
    for case in CASES:
        _check(case, cp, world)
    for case in (CASES[1], CASES[3]):
        _second_order(case, cp, world)


def _second_order(case: Case, cp: ContextParallel, world: int) -> None:
    """Gradients of gradients through the head all-to-all (differentiable to any order) and the
    local call: the oracle's, shard by shard."""
    seq_len = LOCAL * world
    full = [x.requires_grad_() for x in _full(case, seq_len)]
    mask = _mask(seq_len) if case.masked else None
    want, _ = _oracle(case, *full, mask)
    first = torch.autograd.grad(want.square().sum(), full[0], create_graph=True)[0]
    want_second = torch.autograd.grad(first.square().sum(), full)
    shard = {"group": cp, "layout": case.layout}
    mine = [shard_sequence(x.detach(), **shard).requires_grad_() for x in full]
    my_mask = None if mask is None else shard_sequence(mask, **shard)
    out, _ = _ring(case, cp, *mine, my_mask)
    grad = torch.autograd.grad(out.square().sum(), mine[0], create_graph=True)[0]
    second = torch.autograd.grad(grad.square().sum(), mine)
    positions = sequence_positions(LOCAL, group=cp, layout=case.layout)
    for got, expected, label in zip(second, want_second, "qkv", strict=True):
        torch.testing.assert_close(got, expected[:, positions], **TIGHT,
                                   msg=lambda m, label=label: f"{case} d2{label}: {m}")  # fmt: skip


def _mesh_2x2(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "heads"))
    hybrid = ContextParallel.from_mesh(mesh, ring="ring", heads="heads")
    for case in CASES:  # dilated: rates above a rank's 4 heads shift its layer heads' offsets
        _check(case, hybrid, world)
    _check(Case("dilated", causal=True, schedule=((4, 8), (1, 4))), hybrid, world)
    q = torch.randn(1, 4 + (rank == 3), 8, 8, dtype=torch.float64)  # one rank's shard longer
    with raises_on_rank("one rank's shard longer", "local seq_len", within_s=30):
        ring_dilated_attention(q, q, q, [4], [1], group=hybrid)
    q = torch.randn(1, 4, 8, 8, dtype=torch.float64)
    with raises_on_rank("one rank's schedule", "options and schedule", within_s=30):
        ring_dilated_attention(q, q, q, [4], [1 + (rank == 2)], group=hybrid)
    ring_only = ContextParallel.from_mesh(mesh, ring="ring")  # a ring of 2 per head rank
    ring_world = ContextParallel(ring=dist.group.WORLD)
    for case in CASES[:4]:
        _check(case, ring_world, world)
    assert ring_only.sizes() == (2, 1)


@pytest.mark.parametrize("world", [1, 2, 4])  # 1: a head group of one rank exchanges nothing
def test_head_all_to_all_alone_equals_one_process(world: int, tmp_path) -> None:  # type: ignore[no-untyped-def]
    run_world(_heads_alone, world, tmp_path)


def test_a_2x2_mesh_of_ring_and_heads_equals_one_process(tmp_path) -> None:  # type: ignore[no-untyped-def]
    run_world(_mesh_2x2, 4, tmp_path)


def _bad_calls(rank: int, world: int) -> None:
    cp = ContextParallel(heads=dist.group.WORLD)
    q = torch.randn(1, 4, 6, 8, dtype=torch.float64)  # 6 heads over 4 ranks
    with raises_on_rank("6 heads over 4 ranks", "query heads \\(6\\) divisible by 4", within_s=30):
        ring_attention(q, q, q, group=cp)
    q = torch.randn(1, 4 + (rank == 1), 8, 8, dtype=torch.float64)  # one rank's shard longer
    with raises_on_rank("unequal shards", "local seq_len", within_s=30):
        ring_attention(q, q, q, group=cp)
    q = torch.randn(1, 4, 8, 8, dtype=torch.float64)
    with raises_on_rank("packed documents", "cu_seqlens .* with a ContextParallel group"):
        ring_attention(q, q, q, group=cp, cu_seqlens=[0, 16])


def test_bad_calls_raise_on_every_rank(tmp_path) -> None:  # type: ignore[no-untyped-def]
    run_world(_bad_calls, 4, tmp_path)


def _counted(case: Case, cp: ContextParallel, world: int) -> tuple[int, int]:
    """The most bytes any rank sent in the forward and in the backward of ``case``."""
    seq_len = LOCAL * world
    shard = {"group": cp, "layout": case.layout}
    mine = [shard_sequence(x, **shard).requires_grad_() for x in _full(case, seq_len)]
    mask = shard_sequence(_mask(seq_len), **shard) if case.masked else None
    with count_traffic() as forward:
        out, _ = _ring(case, cp, *mine, mask)
    with count_traffic() as backward:
        out.sum().backward()
    sent = torch.tensor([forward.bytes, backward.bytes])
    dist.all_reduce(sent, op=dist.ReduceOp.MAX)
    return int(sent[0]), int(sent[1])


def _volumes(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "heads"))
    splits = {
        (2, 2): ContextParallel.from_mesh(mesh, ring="ring", heads="heads"),
        (1, 4): ContextParallel(heads=dist.group.WORLD),
        (4, 1): ContextParallel(ring=dist.group.WORLD),
    }
    plan = plan_context_parallel(world, seq_len=1 << 15, num_heads=32, num_kv_heads=8,
                                 head_dim=128, is_causal=True)  # fmt: skip
    _, planned = plan.mesh("cpu")
    assert planned.sizes() == (plan.chosen.ring, plan.chosen.heads), str(plan)
    for case in [*CASES[:6], Case("dense", masked=True)]:
        for (ring, heads), cp in splits.items():
            counted = _counted(case, cp, world)
            schedule = Schedule(*case.schedule) if case.operation == "dilated" else None
            shape = Shape(BATCH, LOCAL * world, HEADS, case.kv_heads, DIM, torch.float64,
                          case.causal, case.layout, case.masked, schedule)  # fmt: skip
            model = split_volume(shape, ring, heads)
            assert counted == (model.forward, model.backward), (
                f"{case} over ring {ring} x heads {heads}: sent {counted}, model {model}"
            )


def test_the_volume_model_counts_the_bytes_sent(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The bytes the cost model gives each split (Note [Choosing the context-parallel split])
    are the bytes the most loaded rank sends, forward and backward."""
    run_world(_volumes, 4, tmp_path)


def _layers(rank: int, world: int) -> None:
    """A model of the library's local layers, made context parallel in place, gives each
    rank its shard of the one-process output and the same parameter gradients (summed)."""
    from dilated_attention import MultiheadDilatedAttention

    torch.manual_seed(0)
    layer = MultiheadDilatedAttention(32, 8, [4, 8], [1, 2], num_kv_heads=2).double()
    model = torch.nn.Sequential(layer)
    x = torch.randn(2, LOCAL * world, 32, dtype=torch.float64)
    want = layer(x, is_causal=True)[0]
    want_grads = torch.autograd.grad((want * want).sum(), list(layer.parameters()))
    for cp in (ContextParallel(heads=dist.group.WORLD), ContextParallel(ring=dist.group.WORLD)):
        parallel = context_parallel(copy.deepcopy(model), cp)
        out = parallel[0](shard_sequence(x, group=cp), is_causal=True)[0]
        grads = torch.autograd.grad((out * out).sum(), list(parallel.parameters()))
        positions = sequence_positions(LOCAL, group=cp)
        torch.testing.assert_close(out, want[:, positions].detach(), **TIGHT,
                                   msg=lambda m, cp=cp: f"{cp}: {m}")  # fmt: skip
        for got, expected in zip(grads, want_grads, strict=True):
            total = got.clone()
            dist.all_reduce(total)
            torch.testing.assert_close(total, expected, **TIGHT, msg=lambda m, cp=cp: f"{cp}: {m}")
        compiled = torch.compile(parallel[0])  # the ring call runs eagerly between graphs
        again = compiled(shard_sequence(x, group=cp), is_causal=True)[0]
        torch.testing.assert_close(again, out, **TIGHT, msg=lambda m, cp=cp: f"compiled {cp}: {m}")
    with raises_on_rank("dropout", "has dropout=0.1"):
        context_parallel(MultiheadDilatedAttention(32, 8, [4], [1], dropout=0.1), None)


def test_context_parallel_turns_local_layers_into_ring_layers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    run_world(_layers, 2, tmp_path)


def _llama(rank: int, world: int) -> None:
    """A Llama-style transformers model through ``use_dilated_attention(...,
    context_parallel=...)``: each rank's logits are its shard of the one-process logits, and the
    parameter gradients (summed over ranks) equal the one-process ones."""
    import transformers

    from dilated_attention.integrations.transformers import use_dilated_attention

    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    single = use_dilated_attention(transformers.LlamaForCausalLM(config).double(), [4, 8], [1, 2])
    ids = torch.randint(0, 97, (2, LOCAL * world), generator=torch.Generator().manual_seed(1))
    want = single(ids).logits
    want_grads = torch.autograd.grad(want.square().sum(), list(single.parameters()))
    for cp in (ContextParallel(heads=dist.group.WORLD), ContextParallel(ring=dist.group.WORLD)):
        model = copy.deepcopy(single)
        use_dilated_attention(model, [4, 8], [1, 2], context_parallel=cp)
        positions = sequence_positions(LOCAL, group=cp)
        logits = model(shard_sequence(ids, group=cp), position_ids=positions[None]).logits
        torch.testing.assert_close(logits, want[:, positions].detach(), **TIGHT,
                                   msg=lambda m, cp=cp: f"{cp}: {m}")  # fmt: skip
        grads = torch.autograd.grad(logits.square().sum(), list(model.parameters()))
        for got, expected in zip(grads, want_grads, strict=True):
            total = got.clone()
            dist.all_reduce(total)
            torch.testing.assert_close(total, expected, **TIGHT, msg=lambda m, cp=cp: f"{cp}: {m}")
        with raises_on_rank("padding", "a padding mask"):
            model(shard_sequence(ids, group=cp), attention_mask=torch.ones(2, LOCAL))


def test_a_transformers_model_runs_context_parallel(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("transformers")
    run_world(_llama, 2, tmp_path)
