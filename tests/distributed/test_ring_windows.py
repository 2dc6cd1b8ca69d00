"""Local windows, soft-capping and attention sinks over ranks, on CPU/gloo worlds of 2, 3 and 4
processes: every ring function (dense, dilated, block-sparse; contiguous and zigzag shards,
packed documents, key padding, GQA) and every context-parallel split (a ring, a head
all-to-all, both) against the one-process float64 call: outputs, lse, dq, dk, dv, and the
sinks' gradient summed over the ranks. A windowed ring sends only its halo (Note [Halo
exchange] in ``distributed/rings/halo.py``), counted by a spy on the exchange and by the cost model;
a call that differs between ranks raises on every rank.

One spawned world per world size runs every case. Workers assert with messages.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.distributed_utils import count_exchanges, raises_on_rank, run_world
from support.oracle import oracle_attention

import dilated_attention.distributed.comm.collectives as comm_mod
from dilated_attention import (
    BlockSparseMultiheadAttention,
    BlockSparseRingAttention,
    MultiheadDilatedAttention,
    attention,
    block_sparse_attention,
    dilated_attention,
)
from dilated_attention.distributed import (
    ContextParallel,
    RingAttention,
    RingDilatedAttention,
    RingMultiheadDilatedAttention,
    block_sparse_ring_attention,
    context_parallel,
    ring_attention,
    ring_dilated_attention,
    sequence_positions,
    shard_sequence,
)
from dilated_attention.distributed.layout.cost import Shape, Volume, halo_volumes, split_volume
from dilated_attention.patterns import LocalWindow

pytestmark = pytest.mark.distributed

BATCH, HEADS, DIM, LOCAL = 2, 4, 8, 6  # zigzag chunks of 3
TIGHT = {"atol": 1e-10, "rtol": 1e-7}
SCHEDULE = ((4, 8), (1, 2))  # segments of 4 span the shards of 6


@dataclass(frozen=True)
class Case:
    op: str = "dense"  # "dense", "dilated", "block_sparse"
    causal: bool = False
    layout: str = "contiguous"
    kv_heads: int = HEADS
    window: tuple[int, int] | None = None
    softcap: float | None = None
    sinks: bool = True
    masked: bool = False
    documents: bool = False
    comm: str = "ring"


CASES = [
    Case(window=(2, 1), kv_heads=2, softcap=1.5, masked=True),
    Case(causal=True, window=(8, 0)),  # the halo spans two earlier ranks
    Case(causal=True, layout="zigzag", window=(4, 3), kv_heads=2, softcap=1.5, masked=True),
    Case(window=(-1, 2), sinks=False),  # every earlier row: unbounded on the left
    Case(window=(0, 0), softcap=2.0),
    Case(causal=True, layout="zigzag", softcap=1.5),  # no window: the whole ring
    Case(kv_heads=1, softcap=1.5, comm="allgather", masked=True),
    Case(window=(3, 3), softcap=1.5, documents=True),
    Case(causal=True, window=(2, 0), kv_heads=2, documents=True),
    Case(causal=True, softcap=1.5, documents=True),
    Case("dilated", causal=True, kv_heads=2, softcap=1.5, masked=True),
    Case("dilated", causal=True, layout="zigzag", window=(3, 0)),
    Case("dilated", window=(2, 2), kv_heads=2, softcap=1.5, masked=True),
    Case("dilated", causal=True, window=(2, 0), softcap=1.5, documents=True),
    Case("block_sparse", causal=True, kv_heads=2, softcap=1.5),
    Case("block_sparse", softcap=1.5, documents=True),
    Case(window=(1, -1), kv_heads=2),  # every later row: unbounded on the right
]


def _inputs(case: Case, seq_len: int) -> list[torch.Tensor]:
    """q, k, v, the output's gradient (B, N, ., D) and sinks (H,), float64, alike on every rank."""
    gen = torch.Generator().manual_seed(seq_len + case.kv_heads)
    batch = 1 if case.documents else BATCH
    heads = (HEADS, case.kv_heads, case.kv_heads, HEADS)
    xs = [torch.randn(batch, seq_len, h, DIM, generator=gen, dtype=torch.float64) for h in heads]
    return [*xs, torch.randn(HEADS, generator=gen, dtype=torch.float64)]


def _options(case: Case, seq_len: int) -> dict[str, Any]:
    options: dict[str, Any] = {"is_causal": case.causal, "softcap": case.softcap,
                               "return_lse": True}  # fmt: skip
    if case.op != "block_sparse":
        options["window_size"] = case.window
    if case.masked:
        mask = torch.zeros(BATCH, seq_len, dtype=torch.bool)
        mask[0, seq_len // 2] = True
        mask[1, :4] = True  # causal rows before position 4 see no key but the sinks
        options["key_padding_mask"] = mask
    if case.documents:
        options["cu_seqlens"] = [0, 5, seq_len - 4, seq_len]
    return options


def _call(case: Case, q, k, v, sinks, *, ring: bool, group=None, **options):  # type: ignore[no-untyped-def]
    if ring:
        options["group"] = group
        if case.op != "block_sparse":
            options["layout"] = case.layout
        if case.op == "dense":
            options["comm"] = case.comm
    else:
        options["backend"] = "math"
    if case.op == "block_sparse":
        fn = block_sparse_ring_attention if ring else block_sparse_attention
        return fn(q, k, v, LocalWindow(1), block_size=4, sinks=sinks, **options)
    if case.op == "dilated":
        fn = ring_dilated_attention if ring else dilated_attention
        return fn(q, k, v, *SCHEDULE, sinks=sinks, **options)
    return (ring_attention if ring else attention)(q, k, v, sinks=sinks, **options)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, **TIGHT, msg=lambda m: f"{what}: {m}")


def _check(case: Case, world: int, group: Any = None) -> None:
    """This rank's shard of ``case`` over ``group`` against the one-process call."""
    seq_len = LOCAL * world
    *full, dout, sinks = _inputs(case, seq_len)
    options = _options(case, seq_len)
    leaves = [x.clone().requires_grad_() for x in (*full, sinks)]
    given = leaves[3] if case.sinks else None
    want, want_lse = _call(case, *leaves[:3], given, ring=False, **options)
    want_grads = torch.autograd.grad(want, leaves, dout, allow_unused=True)
    if case.op == "dense" and not case.documents:  # the library's one-process call is exact
        oracle = oracle_attention(*leaves[:3], is_causal=case.causal, window_size=case.window,
                                  softcap=case.softcap, sinks=given,
                                  key_padding_mask=options.get("key_padding_mask"))  # fmt: skip
        _close(want, oracle[0], f"{case}: one process vs the oracle")
    shard = {"group": group, "layout": case.layout}
    mine = [shard_sequence(x, **shard).requires_grad_() for x in full]
    if case.masked:
        options["key_padding_mask"] = shard_sequence(options["key_padding_mask"], **shard)
    my_sinks = sinks.clone().requires_grad_() if case.sinks else None
    out, lse = _call(case, *mine, my_sinks, ring=True, group=group, **options)
    inputs = [*mine, my_sinks] if case.sinks else mine
    grads = torch.autograd.grad(out, inputs, shard_sequence(dout, **shard))
    at = sequence_positions(LOCAL, group=group, layout=case.layout)
    name = f"{case} over {group if isinstance(group, ContextParallel) else 'the world'}"
    _close(out, want[:, at].detach(), f"{name} out")
    _close(lse, want_lse[:, :, at], f"{name} lse")
    for label, got, expected in zip(("dq", "dk", "dv"), grads, want_grads, strict=False):
        _close(got, expected[:, at], f"{name} {label}")
    if case.sinks:
        total = grads[3].clone()
        dist.all_reduce(total)  # each rank's share: the rows (and heads) it holds
        _close(total, want_grads[3], f"{name} dsinks summed over the ranks")


def _run(cases: list[Case], world: int, group: Any = None) -> None:
    failures = []
    for case in cases:
        try:
            _check(case, world, group)
        except AssertionError as exc:  # every rank ran the case to its end: go on together
            failures.append(str(exc))
    assert not failures, f"{len(failures)}/{len(cases)} failed:\n" + "\n\n".join(failures)


def _halo(
    world: int, layout: str, window: tuple[int, int], causal: bool, src: int, dst: int
) -> int:
    """The rows of ``src``'s shard that ``dst``'s queries' windows reach, counted by hand."""
    left, right = window
    right = 0 if causal else right
    seq_len, chunks = LOCAL * world, 1 if layout == "contiguous" else 2
    size = seq_len // (world * chunks)

    def held(r: int) -> set[int]:
        parts = [r] if chunks == 1 else [r, 2 * world - 1 - r]
        return {c * size + i for c in parts for i in range(size)}

    reach: set[int] = set()
    for p in held(dst):
        lo = 0 if left < 0 else max(0, p - left)
        hi = seq_len - 1 if right < 0 else min(seq_len - 1, p + right)
        reach |= set(range(lo, hi + 1))
    return len(held(src) & reach)


def _check_halo_bytes(rank: int, world: int) -> None:
    """A windowed ring sends each peer only the rows its window reaches, once (forward), and
    their float32 (here float64) dK/dV back (backward); the cost model says the same."""
    kv_heads = 2
    for layout, causal, window, masked in (("contiguous", False, (2, 1), True),
                                           ("contiguous", True, (8, 0), False),
                                           ("zigzag", True, (4, 0), False)):  # fmt: skip
        others = [r for r in range(world) if r != rank]
        sent = sum(_halo(world, layout, window, causal, rank, dst) for dst in others)
        received = sum(_halo(world, layout, window, causal, src, rank) for src in others)
        q, k, v = (shard_sequence(torch.randn(BATCH, LOCAL * world, h, DIM, dtype=torch.float64),
                                  layout=layout).requires_grad_()
                   for h in (HEADS, kv_heads, kv_heads))  # fmt: skip
        mask = torch.zeros(BATCH, LOCAL, dtype=torch.bool) if masked else None
        with count_exchanges(comm=comm_mod) as log:
            with comm_mod.count_traffic() as forward:
                out = ring_attention(q, k, v, is_causal=causal, layout=layout, window_size=window,
                                     key_padding_mask=mask)  # fmt: skip
            calls = len(log["comm_sent"])
            with comm_mod.count_traffic() as backward:
                out.sum().backward()
        row = 2 * BATCH * kv_heads * DIM * 8
        tag = f"[rank {rank}/{world} {layout} causal={causal} window={window}]"
        expected = sent * (row + BATCH * masked)
        assert sum(log["comm_sent"][:calls]) == forward.bytes == expected, (
            f"{tag} forward sent {forward.bytes} bytes ({log}), expected the halo's "
            f"{sent} rows = {expected}"
        )
        assert backward.bytes == received * row, (
            f"{tag} backward sent {backward.bytes} bytes, expected dK/dV of the {received} "
            f"rows received = {received * row}"
        )
        dense = (world - 1) * LOCAL * (row + BATCH * masked)
        assert forward.bytes <= dense, f"{tag} halo {forward.bytes} > whole blocks {dense}"
        shape = Shape(BATCH, LOCAL * world, HEADS, kv_heads, DIM, torch.float64, causal, layout,
                      masked, None, window)  # fmt: skip
        mine = Volume(forward.bytes, backward.bytes)
        assert halo_volumes(shape, world)[rank] == mine, (
            f"{tag} sent {mine}, the cost model says {halo_volumes(shape, world)[rank]}"
        )
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, mine)
        busiest = max(everyone, key=lambda v: v.forward + v.backward)
        assert split_volume(shape, world, 1) == busiest, f"{tag} {everyone}"


def _check_modules(rank: int, world: int) -> None:
    """The ring modules apply their window, cap and learnable sinks; local layers with them,
    made context parallel (a ring, a head all-to-all), give each rank its shard of the local
    output and, summed over the ranks, the local gradients (the sinks' included)."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(BATCH, LOCAL, HEADS, DIM, generator=gen, dtype=torch.float64)
               for _ in range(3))  # fmt: skip
    sinks = torch.randn(HEADS, generator=gen, dtype=torch.float64)
    modules = [
        (RingAttention(window_size=(2, 1), softcap=1.5, sinks=HEADS),
         ring_attention(q, k, v, window_size=(2, 1), softcap=1.5, sinks=sinks)),
        (RingDilatedAttention(*SCHEDULE, window_size=(3, 0), softcap=1.5, sinks=HEADS),
         ring_dilated_attention(q, k, v, *SCHEDULE, window_size=(3, 0), softcap=1.5,
                                sinks=sinks)),
        (BlockSparseRingAttention(LocalWindow(1), block_size=4, softcap=1.5, sinks=HEADS),
         block_sparse_ring_attention(q, k, v, LocalWindow(1), block_size=4, softcap=1.5,
                                     sinks=sinks)),
    ]  # fmt: skip
    for module, want in modules:
        module.double()
        with torch.no_grad():
            module.sinks.copy_(sinks)
        _close(module(q, k, v), want, type(module).__name__)
    torch.manual_seed(0)
    layers = [
        MultiheadDilatedAttention(32, HEADS, *SCHEDULE, num_kv_heads=2, window_size=(3, 0),
                                  softcap=1.5, sinks=True),
        BlockSparseMultiheadAttention(32, HEADS, LocalWindow(1), block_size=4, softcap=1.5,
                                      sinks=True),
    ]  # fmt: skip
    x = torch.randn(BATCH, LOCAL * world, 32, generator=gen, dtype=torch.float64)
    for local in layers:
        local.double()
        with torch.no_grad():
            local.attention.sinks.copy_(sinks)
        want = local(x, is_causal=True)[0]
        want_grads = torch.autograd.grad(want.square().sum(), list(local.parameters()))
        for cp in (ContextParallel(ring=dist.group.WORLD), ContextParallel(heads=dist.group.WORLD)):
            layer = context_parallel(copy.deepcopy(local), cp)
            out = layer(shard_sequence(x, group=cp), is_causal=True)[0]
            name = f"{type(local).__name__} over {cp}"
            _close(out, want[:, sequence_positions(LOCAL, group=cp)].detach(), name)
            grads = torch.autograd.grad(out.square().sum(), list(layer.parameters()))
            for (label, _), got, expected in zip(local.named_parameters(), grads, want_grads,
                                                 strict=True):  # fmt: skip
                total = got.clone()
                dist.all_reduce(total)
                _close(total, expected, f"{name} d{label} summed over the ranks")
    direct = RingMultiheadDilatedAttention(32, HEADS, *SCHEDULE, num_kv_heads=2,
                                           window_size=(3, 0), softcap=1.5, sinks=True).double()
    direct.load_state_dict(layers[0].state_dict())
    again = context_parallel(copy.deepcopy(layers[0]), None)
    mine = shard_sequence(x)
    _close(direct(mine, is_causal=True)[0], again(mine, is_causal=True)[0],
           "RingMultiheadDilatedAttention(window_size, softcap, sinks)")  # fmt: skip


def _check_errors(rank: int, world: int) -> None:
    """A window, cap or sinks on some ranks only, malformed on one, or a window with the
    all-gather: a ValueError on every rank, at once."""
    x = torch.randn(1, LOCAL, HEADS, DIM, dtype=torch.float64)
    sinks = torch.zeros(HEADS, dtype=torch.float64)
    first = rank == 0
    heads = ContextParallel(heads=dist.group.WORLD)
    cases = [
        ("window on rank 0 only", "window_size differs across ranks",
         dict(window_size=(2, 0) if first else None)),
        ("softcap differs", "softcap differs across ranks", dict(softcap=1.0 + first)),
        ("sinks on rank 0 only", r"sinks given \(0/1\) differs",
         dict(sinks=sinks if first else None)),
        ("sinks of 3 heads on rank 1", "sinks must have shape|rejected their",
         dict(sinks=sinks if first else sinks[:3])),
        ("window (-3, 0) on rank 1", "window_size sides must be >= 0|rejected their",
         dict(window_size=(2, 0) if first else (-3, 0))),
        ("a window with comm='allgather'", "comm='allgather' does not apply",
         dict(window_size=(2, 0), comm="allgather")),
        ("sinks needing grad on rank 0 only", "grad mode",
         dict(sinks=sinks.clone().requires_grad_(first))),
        ("window on rank 0 only, head all-to-all", "options and schedule",
         dict(window_size=(2, 0) if first else None, group=heads)),
        ("sinks on rank 1 only, head all-to-all", "options and schedule",
         dict(sinks=None if first else sinks, group=heads)),
    ]  # fmt: skip
    for what, match, options in cases:
        with raises_on_rank(f"rank {rank}: {what}", match, within_s=20):
            ring_attention(x, x, x, **options)
    with raises_on_rank(f"rank {rank}: dilated window differs", "window_size differs",
                        within_s=20):  # fmt: skip
        ring_dilated_attention(x, x, x, [4], [1], window_size=(1, 1) if first else (1, 2))
    with raises_on_rank(f"rank {rank}: block-sparse sinks", r"sinks given \(0/1\) differs",
                        within_s=20):  # fmt: skip
        block_sparse_ring_attention(x, x, x, LocalWindow(1), block_size=4,
                                    sinks=sinks if first else None)  # fmt: skip
    _check(Case(window=(2, 1)), world)  # the group is still in step


def _worker(rank: int, world: int) -> None:
    _run(CASES, world)
    _check_halo_bytes(rank, world)
    if world == 2:
        _check_modules(rank, world)
        _check_errors(rank, world)
    if world == 4:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "heads"))
        splits = [ContextParallel.from_mesh(mesh, ring="ring", heads="heads"),
                  ContextParallel(heads=dist.group.WORLD)]  # fmt: skip
        picked = [CASES[0], CASES[2], CASES[6], CASES[10], CASES[11], CASES[12], CASES[14],
                  replace(CASES[1], kv_heads=2)]  # fmt: skip
        for cp in splits:
            _run([c for c in picked if c.layout == "contiguous" or cp.ring is not None], world, cp)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_windows_caps_and_sinks_over_ranks_equal_one_process(world: int, tmp_path: Path) -> None:
    run_world(_worker, world, tmp_path, timeout_s=60)
