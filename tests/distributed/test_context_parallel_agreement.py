"""Calls rejected on some ranks of a context-parallel group raise on every rank, quickly,
instead of leaving the others waiting (or aborting them): packed documents, grad mode, shards
of unequal length, ``LongNetLM.generate``; on gloo worlds of 2 ranks and on a 2 x 2 mesh
(Note [Context parallel groups] in ``distributed/context.py``).

Every world runs with a short process-group timeout: a collective left waiting by a rank that
skipped it raises within seconds, so a regression fails here instead of hanging the suite. Each
worker batches its cases into one world and ends with valid calls (the group is still in step).
Workers assert with messages (pytest does not rewrite them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.distributed_utils import raises_on_rank, run_world

from dilated_attention import LongNetConfig, LongNetLM, MultiheadDilatedAttention, patterns
from dilated_attention.distributed import (
    ContextParallel,
    block_sparse_ring_attention,
    context_parallel,
    ring_attention,
    ring_dilated_attention,
    sequence_positions,
    shard_sequence,
    unshard_sequence,
)

pytestmark = pytest.mark.distributed

#: Process-group timeouts: far above these tiny calls, far below gloo's default (30 minutes).
TIMEOUT_S, MESH_TIMEOUT_S = 5.0, 8.0
HEADS, DIM, LOCAL, VOCAB = 4, 8, 8, 32
REJECTED = r"rank\(s\) \[[0-9, ]+\] rejected"
REFUSED = r"generate and stream .*context parallel.*local model"


def _raises(what: str, match: str, within_s: float = TIMEOUT_S / 2) -> Any:
    return raises_on_rank(what, match, within_s=within_s)


def _qkv(requires_grad: bool = False) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randn(1, LOCAL, HEADS, DIM, generator=gen, dtype=torch.float64)
        .requires_grad_(requires_grad)
        for _ in range(3)
    ]  # fmt: skip


def _calls(cp: ContextParallel) -> list[tuple[str, Callable[..., torch.Tensor]]]:
    """(name, call(q, k, v, **kwargs)) for every ring function over ``cp``."""
    return [
        ("ring_attention", lambda q, k, v, **kw: ring_attention(q, k, v, group=cp, **kw)),
        ("ring_dilated_attention",
         lambda q, k, v, **kw: ring_dilated_attention(q, k, v, [4, 16], [1, 2], group=cp, **kw)),
        ("block_sparse_ring_attention",
         lambda q, k, v, **kw: block_sparse_ring_attention(
             q, k, v, patterns.LocalWindow(1), block_size=4, group=cp, **kw)),
    ]  # fmt: skip


def _model(cp: ContextParallel) -> LongNetLM:
    """A tiny LongNetLM made context parallel over ``cp`` (the same weights on every rank)."""
    torch.manual_seed(0)
    config = LongNetConfig(
        vocab_size=VOCAB, embed_dim=16, num_heads=2, num_layers=1, ffn_dim=32,
        segment_lengths=(4, 16), dilation_rates=(1, 2), kind="dilated",
    )  # fmt: skip
    model = context_parallel(LongNetLM(config).double(), cp)
    assert isinstance(model, LongNetLM)
    return model


def _layer(cp: ContextParallel) -> torch.nn.Module:
    """A multihead dilated layer with rotary positions, made context parallel over ``cp``."""
    torch.manual_seed(0)
    layer = MultiheadDilatedAttention(16, 2, [4, 16], [1, 2], dtype=torch.float64).use_rotary()
    return context_parallel(layer, cp)


def _embedded() -> torch.Tensor:
    return torch.randn(1, LOCAL, 16, dtype=torch.float64)


def _tokens(length: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(1))


def _one_rank_cases(rank: int, world_size: int) -> list[tuple[str, str, Callable[[], object]]]:
    """(what, the error expected on this rank, call) of faults on rank 1 only."""
    r1 = rank == 1
    mine = r"cu_seqlens \(packed documents\) with a ContextParallel group is not supported"
    row = [0, LOCAL * world_size] if r1 else None
    cases: list[tuple[str, str, Callable[[], object]]] = []
    for cp in (ContextParallel(ring=dist.group.WORLD), ContextParallel(heads=dist.group.WORLD)):
        # Before: rank 1 raised, rank 0 waited in the agreement until the timeout.
        cases += [
            (f"{name} over {cp}, cu_seqlens on rank 1", mine if r1 else REJECTED,
             lambda call=call: call(*_qkv(), cu_seqlens=row))
            for name, call in _calls(cp)
        ]  # fmt: skip
        cases.append((f"LongNetLM over {cp}, cu_seqlens on rank 1", mine if r1 else REJECTED,
                      lambda cp=cp: _model(cp)(_tokens(LOCAL), cu_seqlens=row)))  # fmt: skip
        cases.append((f"a rotary layer over {cp}, cu_seqlens on rank 1", mine if r1 else REJECTED,
                      lambda cp=cp: _layer(cp)(_embedded(), is_causal=True, cu_seqlens=row)))
    heads = ContextParallel(heads=dist.group.WORLD)
    # Before: rank 0 finished its forward and backward, rank 1 hung in the backward.
    cases += [
        (f"{name} over {heads}, no_grad on rank 1", r"grad mode .*differs across ranks",
         lambda call=call: _forward_backward(call, no_grad=r1))
        for name, call in _calls(heads)
    ]  # fmt: skip
    # Before: rank 1 rejected the layout before the agreement; rank 0 waited for it.
    cases.append((f"ring_attention over {heads}, layout 'striped' on rank 1",
                  "layout must be one of" if r1 else REJECTED,
                  lambda: _calls(heads)[0][1](*_qkv(), layout="striped" if r1 else "contiguous")))
    cases.append(("stream on a context-parallel LongNetLM", REFUSED,
                  lambda: _model(heads).stream(_tokens(5), 2)))  # fmt: skip
    return cases


def _forward_backward(call: Callable[..., torch.Tensor], no_grad: bool) -> None:
    with torch.no_grad() if no_grad else contextlib.nullcontext():
        out = call(*_qkv(requires_grad=True))
    if out.requires_grad:
        out.sum().backward()


def _generate_alone(rank: int) -> None:
    """generate on a context-parallel model is refused before any collective, so a rank that
    calls it alone raises instead of waiting for the others (before: rank 1 waited alone)."""
    if rank == 1:
        with _raises("rank 1: generate on a context-parallel LongNetLM, alone", REFUSED):
            _model(ContextParallel(heads=dist.group.WORLD)).generate(_tokens(5), 2)


def _one_rank_faults(rank: int, world_size: int) -> None:
    """Two ranks: a fault on rank 1 only raises on both."""
    assert world_size == 2, world_size
    for what, match, call in _one_rank_cases(rank, world_size):
        with _raises(f"rank {rank}: {what}", match):
            call()
    _generate_alone(rank)
    # Still in step.
    heads = ContextParallel(heads=dist.group.WORLD)
    for name, call in _calls(heads):
        q, k, v = _qkv(requires_grad=True)
        call(q, k, v).sum().backward()
        assert q.grad is not None, f"rank {rank}: {name} gradients"
    logits = _model(heads)(_tokens(LOCAL))
    assert logits.shape == (1, LOCAL, VOCAB), f"rank {rank}: LongNetLM logits"


def test_one_ranks_fault_raises_on_both_ranks(tmp_path: Path) -> None:
    run_world(_one_rank_faults, 2, tmp_path, timeout_s=TIMEOUT_S)


def _mesh_cases(rank: int, world_size: int) -> list[tuple[str, str, Callable[[], object]]]:
    """(what, the error expected on this rank, call) of faults on one rank of the 2 x 2 mesh
    (ring groups {0, 2} and {1, 3}, head groups {0, 1} and {2, 3})."""
    cp = _mesh_groups()
    short = 4 if rank == 3 else 6  # rank 3's shard is shorter
    unequal = r"(local seq_len|local_len).* differs across ranks|" + REJECTED
    x = torch.arange(2 * 6 * 3, dtype=torch.float64).reshape(2, 6, 3)
    row = [0, 4 * LOCAL] if rank == 3 else None
    return [
        # Before: ranks 2 and 3 raised, ranks 0 and 1 waited in the ring group's check.
        ("sequence_positions, a shorter shard on rank 3", unequal,
         lambda: sequence_positions(short, group=cp)),
        ("unshard_sequence, a shorter shard on rank 3", unequal,
         lambda: unshard_sequence(x[:, :short], group=cp)),
        ("context-parallel LongNetLM, a shorter shard on rank 3", unequal,
         lambda: _model(cp)(_tokens(short))),
        # Before: two ranks raised in the ring's check, two hung in the backward.
        ("ring_attention, no_grad on rank 0", r"grad mode .*differs across ranks|" + REJECTED,
         lambda: _forward_backward(_calls(cp)[0][1], no_grad=rank == 0)),
        ("ring_dilated_attention, cu_seqlens on rank 3", r"cu_seqlens|" + REJECTED,
         lambda: _calls(cp)[1][1](*_qkv(), cu_seqlens=row)),
    ]  # fmt: skip


def _mesh_groups() -> ContextParallel:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "heads"))
    return ContextParallel.from_mesh(mesh, ring="ring", heads="heads")


def _mesh_faults(rank: int, world_size: int) -> None:
    """A 2 x 2 mesh: a fault on one rank raises on all four, whichever group sees it first."""
    assert world_size == 4, world_size
    for what, match, call in _mesh_cases(rank, world_size):
        with _raises(f"rank {rank}: {what}", match, MESH_TIMEOUT_S / 2):
            call()
    # Still in step.
    cp = _mesh_groups()
    positions = sequence_positions(6, group=cp)
    whole = torch.arange(24, dtype=torch.float64)[None, :, None]
    assert torch.equal(unshard_sequence(whole[:, positions], group=cp), whole), f"rank {rank}"
    tokens = _tokens(4 * LOCAL)
    logits = _model(cp)(shard_sequence(tokens, group=cp))
    assert logits.shape == (1, LOCAL, VOCAB), f"rank {rank}: {tuple(logits.shape)}"


def test_a_fault_on_one_rank_of_a_2x2_mesh_raises_on_all_four(tmp_path: Path) -> None:
    run_world(_mesh_faults, 4, tmp_path, timeout_s=MESH_TIMEOUT_S)
