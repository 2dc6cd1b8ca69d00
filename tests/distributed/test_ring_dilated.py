"""Ring dilated attention on CPU/gloo against the float64 oracle, with byte accounting per branch.

Each spawned world runs many cases, since starting processes dominates the cost on 2 cores.
"""

from __future__ import annotations

import functools
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.distributed_utils import count_exchanges, run_world
from support.grouping import cut_small
from support.oracle import oracle_dilated_attention
from support.tolerances import assert_close_to_oracle
from support.writing_kernel import write_into_buffers

import dilated_attention.distributed.comm.collectives as comm
import dilated_attention.distributed.rings.ring_dilated as ring_dilated_mod
from dilated_attention import (
    MultiheadDilatedAttention,
    RingMultiheadDilatedAttention,
    ring_dilated_attention,
    shard_sequence,
)
from dilated_attention.backends import get_backend
from dilated_attention.backends.base import KernelInputs
from dilated_attention.core.geometry.schedule import Schedule
from dilated_attention.resolve import Request, resolve

pytestmark = pytest.mark.distributed

N, B, H, D = 24, 2, 4, 8
#: (segment_lengths, dilation_rates): branches local to a chunk, spanning ranks, ragged (r does not
#: divide w, partial last segments), r = 6 as in LongNet's schedule, and w > N.
SCHEDULES = [
    ((4, 8, 24), (1, 2, 4)),
    ((6, 12), (1, 3)),
    ((16, 5), (6, 1)),
    ((24,), (1,)),
    ((100, 7), (4, 2)),
    ((10, 24), (3, 6)),
]


def _tensors(kv_heads: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(B, N, H, D), (B, N, kv_heads, D), (B, N, kv_heads, D), (B, N, H, D)]
    return [torch.randn(s, dtype=torch.float64, generator=gen) for s in shapes]


def _padding_mask() -> torch.Tensor:
    """A (B, N) key padding mask: random keys in batch 0; in batch 1 the first 7 keys (causal rows
    before them, and in some branches rows after them, see no key) and every third key."""
    mask = torch.rand(B, N, generator=torch.Generator().manual_seed(5)) < 0.3
    mask[1] = torch.arange(N) % 3 == 0
    mask[1, :7] = True
    return mask


def _check_against_oracle(rank: int, world_size: int) -> None:
    for (segs, rates), causal, layout, kv_heads, masked in itertools.product(
        SCHEDULES, [False, True], ["contiguous", "zigzag"], [4, 2, 1], [False, True]
    ):
        if layout == "zigzag" and (not causal or N % (2 * world_size)):
            continue
        if masked and kv_heads == 4:  # masks with GQA and MQA; plain heads run unmasked
            continue
        q, k, v, dout = _tensors(kv_heads)
        mask = _padding_mask() if masked else None
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref, ref_lse = oracle_dilated_attention(
            *leaves, segs, rates, is_causal=causal, key_padding_mask=mask
        )
        ref_grads = torch.autograd.grad(ref, leaves, dout)
        local = [shard_sequence(t, layout=layout).requires_grad_() for t in (q, k, v)]
        out, lse = ring_dilated_attention(
            *local, segs, rates, is_causal=causal, layout=layout, return_lse=True,
            key_padding_mask=None if mask is None else shard_sequence(mask, layout=layout),
        )  # fmt: skip
        grads = torch.autograd.grad(out, local, shard_sequence(dout, layout=layout))
        case = (
            f"rank {rank}/{world_size} {segs} {rates} causal={causal} {layout} Hkv={kv_heads}"
            f"{' masked' if masked else ''}"
        )
        tight = {"atol": 1e-10, "rtol": 1e-7}
        torch.testing.assert_close(
            out,
            shard_sequence(ref, layout=layout),
            **tight,
            msg=lambda m, case=case: f"out {case}: {m}",
        )
        torch.testing.assert_close(
            lse, shard_sequence(ref_lse, layout=layout, seq_dim=2), **tight,
            msg=lambda m, case=case: f"lse {case}: {m}",
        )  # fmt: skip
        for name, got, want in zip("qkv", grads, ref_grads, strict=True):
            torch.testing.assert_close(
                got, shard_sequence(want, layout=layout), **tight,
                msg=lambda m, name=name, case=case: f"d{name} {case}: {m}",
            )  # fmt: skip


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ring_dilated_matches_oracle(world_size: int, tmp_path: Path) -> None:
    """Outputs, lse and dq/dk/dv shards equal the single-process float64 oracle on every rank."""
    run_world(_check_against_oracle, world_size, tmp_path, timeout_s=120)


def _check_low_precision(rank: int, world_size: int) -> None:
    for segs, rates in [((4, 12), (1, 2)), ((6, 24), (1, 3))]:  # every branch local; one spans
        q, k, v, dout = (t.to(torch.bfloat16) for t in _tensors(2))
        leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
        want, _ = oracle_dilated_attention(*leaves64, segs, rates, is_causal=True)
        want_grads = torch.autograd.grad(want, leaves64, dout.double())
        leaves_low = [t.clone().requires_grad_() for t in (q, k, v)]
        naive, _ = oracle_dilated_attention(
            *leaves_low, segs, rates, is_causal=True, compute_dtype=torch.bfloat16
        )
        naive_grads = torch.autograd.grad(naive, leaves_low, dout)
        local = [shard_sequence(t).requires_grad_() for t in (q, k, v)]
        out = ring_dilated_attention(*local, segs, rates, is_causal=True)
        grads = torch.autograd.grad(out, local, shard_sequence(dout))
        case = f"rank {rank}/{world_size} {segs} {rates}"
        assert out.dtype == torch.bfloat16, (case, out.dtype)
        assert_close_to_oracle(out, shard_sequence(want), shard_sequence(naive), name=f"out {case}")
        for name, got, exact, same in zip("qkv", grads, want_grads, naive_grads, strict=True):
            assert got.dtype == torch.bfloat16, (case, name, got.dtype)
            assert_close_to_oracle(
                got, shard_sequence(exact), shard_sequence(same), name=f"d{name} {case}",
                grad=True,
            )  # fmt: skip


def test_ring_dilated_low_precision(tmp_path: Path) -> None:
    """bfloat16 shards give bfloat16 outputs and gradients within the bfloat16 tolerances of the
    float64 oracle, both where every branch is local (the engines' own dtypes, no float32 round
    trip) and where a branch spans ranks (float32 running values)."""
    run_world(_check_low_precision, 2, tmp_path, timeout_s=120)


def _check_fused_engine(rank: int, world_size: int) -> None:
    n = 48
    gen = torch.Generator().manual_seed(0)
    mask = torch.rand(1, n, generator=gen) < 0.3
    mask[0, :7] = True  # the first causal rows see no key
    for (segs, rates), (causal, layout), (kv_heads, masked) in itertools.product(
        [((12, 48), (1, 4)), ((24, 96), (2, 3)), ((96,), (2,))],
        [(False, "contiguous"), (True, "contiguous"), (True, "zigzag")],
        [(4, False), (2, False), (2, True)],
    ):  # local rate-1 + spanning; local strided + spanning; spanning only
        shapes = [(1, n, h, 16) for h in (4, kv_heads, kv_heads, 4)]
        q, k, v, dout = (torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes)
        key_padding_mask = mask if masked else None
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        want, want_lse = oracle_dilated_attention(
            *leaves, segs, rates, is_causal=causal, key_padding_mask=key_padding_mask
        )
        want_grads = torch.autograd.grad(want, leaves, dout)
        shard = functools.partial(shard_sequence, layout=layout)
        local = [shard(t).float().requires_grad_() for t in (q, k, v)]
        out, lse = ring_dilated_attention(
            *local, segs, rates, is_causal=causal, layout=layout, backend="triton",
            return_lse=True, key_padding_mask=None if not masked else shard(mask),
        )  # fmt: skip
        grads = torch.autograd.grad(out, local, shard(dout).float())
        case = (
            f"rank {rank}/{world_size} {segs} {rates} causal={causal} {layout} Hkv={kv_heads}"
            f"{' masked' if masked else ''}"
        )
        fp32 = {"atol": 1e-5, "rtol": 1e-5}
        torch.testing.assert_close(out.double(), shard(want), **fp32, msg=case)
        torch.testing.assert_close(lse.double(), shard(want_lse, seq_dim=2), **fp32, msg=case)
        for name, got, exact in zip("qkv", grads, want_grads, strict=True):
            torch.testing.assert_close(
                got.double(), shard(exact), atol=2e-5, rtol=2e-5, msg=f"d{name} {case}"
            )


def test_ring_dilated_through_the_fused_engine(tmp_path: Path) -> None:
    """The ``triton`` backend (the fused engine, Note [Spanning results stay compact]): the
    spanning branches' compact results join its float32 scratch. Runs where Triton runs on CPU
    tensors (its interpreter); on GPUs, ``benchmarks/bench_ring.py`` checks it on NCCL."""
    inputs = KernelInputs(
        device=torch.device("cpu"), dtype=torch.float32, head_dim=16, num_heads=4,
        num_kv_heads=2, query_len=24, key_len=24, dilated=True,
    )  # fmt: skip
    reasons = get_backend("triton").not_supported_reasons(inputs)
    if reasons:
        pytest.skip("triton on CPU tensors: " + "; ".join(reasons))
    run_world(_check_fused_engine, 2, tmp_path, timeout_s=900)


def _check_fused_engine_softcap(rank: int, world_size: int) -> None:
    """Soft-capped scores on the fused engine beside spanning branches: every local launch
    capped (the engine is asked with the cap), the spanning calls too, against the oracle."""
    caps: list[float | None] = []
    real = ring_dilated_mod.fused_forward

    def spy(*args: Any, **kwargs: Any) -> Any:
        caps.append(kwargs.get("softcap"))
        return real(*args, **kwargs)

    ring_dilated_mod.fused_forward = spy  # this rank's process only
    n, gen = 48, torch.Generator().manual_seed(1)
    mask = torch.rand(1, n, generator=gen) < 0.3
    for causal, layout in [(False, "contiguous"), (True, "zigzag")]:
        shapes = [(1, n, h, 16) for h in (4, 2, 2, 4)]
        q, k, v, dout = (torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        options = {"is_causal": causal, "softcap": 1.5}
        want, want_lse = oracle_dilated_attention(
            *leaves, (12, 48), (1, 4), key_padding_mask=mask, **options
        )
        want_grads = torch.autograd.grad(want, leaves, dout)
        shard = functools.partial(shard_sequence, layout=layout)
        local = [shard(t).float().requires_grad_() for t in (q, k, v)]
        caps.clear()
        out, lse = ring_dilated_attention(
            *local, (12, 48), (1, 4), layout=layout, backend="triton", return_lse=True,
            key_padding_mask=shard(mask), **options,
        )  # fmt: skip
        grads = torch.autograd.grad(out, local, shard(dout).float())
        assert caps == [1.5], caps
        case = f"rank {rank}/{world_size} causal={causal} {layout}"
        fp32 = {"atol": 1e-5, "rtol": 1e-5}
        torch.testing.assert_close(out.double(), shard(want), **fp32, msg=case)
        torch.testing.assert_close(lse.double(), shard(want_lse, seq_dim=2), **fp32, msg=case)
        for name, got, exact in zip("qkv", grads, want_grads, strict=True):
            torch.testing.assert_close(
                got.double(), shard(exact), atol=2e-5, rtol=2e-5, msg=f"d{name} {case}"
            )


def test_ring_dilated_softcap_through_the_fused_engine(tmp_path: Path) -> None:
    """With a soft-cap the local branches still run on the fused engine (its launches cap the
    scores), the spanning ones on its backend's capped calls: equal to the float64 oracle.
    Runs where Triton runs on CPU tensors (its interpreter)."""
    inputs = KernelInputs(
        device=torch.device("cpu"), dtype=torch.float32, head_dim=16, num_heads=4,
        num_kv_heads=2, query_len=24, key_len=24, dilated=True, softcap=True,
    )  # fmt: skip
    reasons = get_backend("triton").not_supported_reasons(inputs)
    if reasons:
        pytest.skip("triton on CPU tensors: " + "; ".join(reasons))
    run_world(_check_fused_engine_softcap, 2, tmp_path, timeout_s=600)


def _check_slots(rank: int, world_size: int, grouped: bool = False) -> None:
    """The local branches in slots merged once, beside spanning branches (Note [Branch slots
    merged once] in ``core/geometry/slots.py``): the math backend writing into the buffers it is
    handed, as FlashAttention-4 does; the spanning results and gradients read as one more slot where
    their cells are one slot's, else merged into float32 (Note [Spanning results stay compact]
    in ``distributed/rings/ring_dilated.py``). ``grouped``: the backward's plan cut into position
    groups as on a GPU (no float32 gradients of the whole shard either way)."""
    writes = write_into_buffers()
    extras: list[tuple[str, int]] = []
    if grouped:
        _cut_in_this_process(extras)
    in_slots: list[bool] = []  # per forward with spanning branches: merged as a slot
    real = ring_dilated_mod.spanning_results

    def counted(*args: Any) -> Any:
        views = real(*args)
        in_slots.append(views is not None)
        return views

    ring_dilated_mod.spanning_results = counted
    # (segments, rates, whether the spanning cells are one slot's): no branch spans; one
    # spanning rate equal to the heads; one below them (slot rows m * H + h interleave); two
    # spanning rates that do not divide each other (merged into float32 instead)
    schedules = [
        ((4, 12), (1, 2), False),
        ((4, 12, 24), (1, 2, 4), True),
        ((4, 24), (1, 2), True),
        ((4, 16, 24), (1, 2, 3), False),
    ]
    for (segs, rates, one_slot), causal, kv_heads in itertools.product(
        schedules, [False, True], [H, 2]
    ):
        q, k, v, dout = _tensors(kv_heads)
        mask = _padding_mask()
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref, ref_lse = oracle_dilated_attention(*leaves, segs, rates, is_causal=causal,
                                                key_padding_mask=mask)  # fmt: skip
        ref_grads = torch.autograd.grad(ref, leaves, dout)
        local = [shard_sequence(t).requires_grad_() for t in (q, k, v)]
        writes.clear()
        out, lse = ring_dilated_attention(
            *local, segs, rates, is_causal=causal, return_lse=True, backend="math",
            key_padding_mask=shard_sequence(mask),
        )  # fmt: skip
        grads = torch.autograd.grad(out, local, shard_sequence(dout))
        case = f"rank {rank}/{world_size} {segs} {rates} causal={causal} Hkv={kv_heads}"
        assert {"forward", "backward"} <= set(writes), (case, writes)
        spans = max(segs) > N // world_size
        assert in_slots == ([one_slot] if spans else []), (case, in_slots)
        in_slots.clear()
        if grouped and spans:  # a branch spans: each group got its part
            # as slots the sums read (without GQA, where the cells are one slot's), else added
            kind = "slots" if kv_heads == H and one_slot else "added"
            assert len(extras) >= B and {k for k, _ in extras} == {kind}, (case, extras)
            extras.clear()
        for name, got, want in (
            ("out", out, shard_sequence(ref)), ("lse", lse, shard_sequence(ref_lse, seq_dim=2)),
            *((f"d{x}", g, shard_sequence(w)) for x, g, w in zip("qkv", grads, ref_grads,
                                                                  strict=True)),
        ):  # fmt: skip
            torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-7,
                                       msg=lambda m, n=name, c=case: f"{n} {c}: {m}")  # fmt: skip


def _cut_in_this_process(extras: list[tuple[str, int]]) -> None:
    """Cut executor plans on the CPU into the smallest groups (``support.grouping.cut_small``,
    in a spawned rank) and count in ``extras`` the groups whose gradients got ``extra`` ones:
    ``("slots", start)`` where the sums read them as slots, ``("added", start)`` where a
    callback added them into float32 scratch."""
    import dilated_attention.core.execution.executor as executor
    from dilated_attention.core.geometry.slots import ExtraSlotGradients

    class Counted(ExtraSlotGradients):
        def views(self, batch: slice, start: int, end: int) -> Any:
            extras.append(("slots", start))
            return super().views(batch, start, end)

    cut_small(None)
    real = executor.grouped_backward

    def counted(*args: Any, extra: Any = None, **kwargs: Any) -> Any:
        def added(*grads: Any) -> None:
            extras.append(("added", grads[-3]))
            extra(*grads)

        if isinstance(extra, ExtraSlotGradients):
            return real(*args, extra=Counted(extra.make, extra.rate), **kwargs)
        return real(*args, extra=None if extra is None else added, **kwargs)

    executor.grouped_backward = counted  # type: ignore[assignment]


@pytest.mark.parametrize("grouped", [False, True], ids=["whole", "grouped"])
def test_ring_dilated_local_branches_in_slots(grouped: bool, tmp_path: Path) -> None:
    """On a kernel that writes into given buffers the local branches run in branch slots, the
    spanning branches' results and gradients joining them (as one more slot, or in float32)
    before the single rounding: equal to the float64 oracle, with a key padding mask, causal
    and not, GQA; the backward's plan whole, or cut into position groups."""
    run_world(_check_slots, 2, tmp_path, grouped, timeout_s=120)


def _check_bytes(rank: int, world_size: int) -> None:
    n = N // world_size
    kv_block = 2 * B * n * H * D * 8  # one rank's K and V (float64, H kv heads)
    dense_ring = (world_size - 1) * kv_block  # what a dense ring forward sends per rank
    with count_exchanges(ring_dilated=ring_dilated_mod, comm=comm) as log:

        def sent() -> int:
            """Bytes sent since the last call."""
            total = sum(sum(v) for k, v in log.items() if k.endswith("_sent"))
            for values in log.values():
                values.clear()
            return total

        mask = shard_sequence(_padding_mask())
        for segs, rates in [((n,), (1,)), ((n // 2, n), (1, 2))]:  # local branches only
            q, k, v, _ = _tensors(H)
            local = [shard_sequence(t) for t in (q, k, v)]
            for key_padding_mask in (None, mask):
                ring_dilated_attention(
                    *local, segs, rates, is_causal=True, key_padding_mask=key_padding_mask
                )
                local_bytes = sent()
                assert local_bytes == 0, f"local branches {segs} sent {local_bytes} bytes"
        for rate in (1, 2, 3, 4, 6):  # one branch spanning every rank
            q, k, v, _ = _tensors(H)
            local = [shard_sequence(t) for t in (q, k, v)]
            ring_dilated_attention(*local, (N,), (rate,), is_causal=True)
            spanning = sent()
            bound = dense_ring * (1 / rate + 1 / n)  # 1/r of K/V, plus padding of ragged rows
            assert spanning <= bound, (
                f"spanning branch r={rate} sent {spanning} bytes > {bound:.0f} "
                f"(1/r of the dense ring's {dense_ring})"
            )
            assert spanning > 0
            # A key padding mask adds one byte per sent row: 1 / (2 D * 8) of the K/V bytes.
            ring_dilated_attention(*local, (N,), (rate,), is_causal=True, key_padding_mask=mask)
            masked = sent()
            assert masked == spanning * (1 + 1 / (2 * D * 8)), (
                f"spanning branch r={rate} with a mask sent {masked} bytes, without {spanning}"
            )
        # Segments of two ranks' tokens: each rank sends its rows to its segment's other rank
        # only, not around the whole group. The backward keeps the forward's rows and sends only
        # their gradients back.
        q, k, v, _ = _tensors(H)
        local = [shard_sequence(t).requires_grad_() for t in (q, k, v)]
        out = ring_dilated_attention(*local, (2 * n,), (1,))
        forward_bytes = sent()
        assert forward_bytes == kv_block, (rank, forward_bytes, kv_block)
        out.sum().backward()
        backward_bytes = sent()
        assert backward_bytes == kv_block, (rank, backward_bytes, kv_block)


@pytest.mark.parametrize("world_size", [2, 4])
def test_bytes_per_branch(world_size: int, tmp_path: Path) -> None:
    """Local branches send nothing; a spanning branch sends at most ~1/r of the K/V bytes, and
    only to the ranks that share its segments."""
    run_world(_check_bytes, world_size, tmp_path)


def _check_module(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    segs, rates = (4, 8, 24), (1, 2, 4)
    ring = RingMultiheadDilatedAttention(32, 4, segs, rates, num_kv_heads=2, dtype=torch.float64)
    local_layer = MultiheadDilatedAttention(32, 4, segs, rates, num_kv_heads=2, dtype=torch.float64)
    local_layer.load_state_dict(ring.state_dict())
    x = torch.randn(2, N, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    full, _ = local_layer(x, is_causal=True)
    full.square().sum().backward()
    x_local = shard_sequence(x).requires_grad_()
    out, none = ring(x_local, is_causal=True)
    assert none is None
    torch.testing.assert_close(out, shard_sequence(full), atol=1e-10, rtol=1e-7)
    out.square().sum().backward()
    for (name, p_ring), p_full in zip(
        ring.named_parameters(), local_layer.parameters(), strict=True
    ):
        grad = p_ring.grad.clone()
        dist.all_reduce(grad)  # parameters are replicated: their gradients add over ranks
        torch.testing.assert_close(grad, p_full.grad, atol=1e-9, rtol=1e-7, msg=name)
    # With a key padding mask: the same as the local layer on the whole sequence.
    mask = _padding_mask()
    full_masked, _ = local_layer(x, is_causal=True, key_padding_mask=mask)
    out_masked, _ = ring(x_local, is_causal=True, key_padding_mask=shard_sequence(mask))
    torch.testing.assert_close(out_masked, shard_sequence(full_masked), atol=1e-10, rtol=1e-7)
    # Rotary inside the layer: by default each rank rotates its shard at its global positions.
    ring.use_rotary(100.0)
    local_layer.use_rotary(100.0)
    full_rotary, _ = local_layer(x, is_causal=True)
    out_rotary, _ = ring(x_local, is_causal=True)
    torch.testing.assert_close(out_rotary, shard_sequence(full_rotary), atol=1e-10, rtol=1e-7)
    assert not torch.allclose(out_rotary, out.detach())
    # A mask of the wrong shape on one rank raises on every rank (checked by the ring call).
    bad = torch.zeros(2, N // world_size - (rank == 1), dtype=torch.bool)
    with pytest.raises(
        ValueError, match=r"rejected their ring attention inputs|key_padding_mask must have shape"
    ):
        ring(x_local, key_padding_mask=bad)


def test_ring_multihead_module_matches_local_module(tmp_path: Path) -> None:
    run_world(_check_module, 2, tmp_path)


def _check_mismatched_schedule(rank: int, world_size: int) -> None:
    q, k, v, _ = _tensors(H)
    local = [shard_sequence(t) for t in (q, k, v)]
    segs = (8, 16) if rank == 0 else (8, 12)
    with pytest.raises(
        ValueError, match=r"schedule \(segment_lengths, dilation_rates\) differs across ranks"
    ):
        ring_dilated_attention(*local, segs, (1, 2))


def test_schedule_mismatch_raises_on_every_rank(tmp_path: Path) -> None:
    run_world(_check_mismatched_schedule, 2, tmp_path, timeout_s=30)


def test_ring_module_refuses_dropout() -> None:
    with pytest.raises(ValueError, match="dropout"):
        RingMultiheadDilatedAttention(16, 2, [8], [1], dropout=0.1)


@pytest.mark.parametrize(
    ("schedule", "heads", "kv_heads", "world_size", "slotted"),
    [
        (((16, 64), (1, 2)), 4, 4, 2, True),  # w = 16 local, w = 64 spans both ranks
        (((64,), (2,)), 4, 4, 2, False),  # no local branch
        (((12,), (3,)), 6, 3, 1, False),  # GQA, r = 3 over groups of 2: not a strided slice
        (((12,), (3,)), 6, 6, 1, True),
    ],
)
def test_local_branches_in_slots(schedule, heads: int, kv_heads: int, world_size: int,
                                 slotted: bool) -> None:  # fmt: skip
    """What ring dilated attention tells the dilated registry (``KernelInputs.branch_slots``,
    the condition of its FlashAttention-4 rule): whether this rank's local branches write into
    branch slots, from the branches a rank's chunk holds: the schedule's split, and the resolve
    step's inputs for a request of one rank's shard."""
    n = 32 if world_size == 2 else 24
    q, k = torch.empty(1, n, heads, 8), torch.empty(1, n, kv_heads, 8)
    split = Schedule(*schedule).at(world_size * n, heads, kv_heads).sharded(world_size, n)
    assert split.in_slots is slotted
    request = Request.of("dilated", q, k, k, schedule=Schedule(*schedule), shard=(world_size, n))
    strategy = resolve(request)
    assert strategy.inputs is not None and strategy.inputs.branch_slots is slotted
    assert strategy.kernel is not None


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("chunks", [1, 2])  # chunks per rank: contiguous, zigzag
@pytest.mark.parametrize("schedule", [*SCHEDULES, ((8, 32, 96), (1, 3, 7))])
def test_sharded_split_is_the_chunk_rule(schedule, world_size: int, chunks: int) -> None:
    """``ScheduleLayout.sharded`` splits the effective branches (``w > N`` clipped, huge rates
    reduced) into the local ones, whose segment length divides the chunk, and the spanning
    ones, each in schedule order; the local ones' row groups are over a rank's positions."""
    from dilated_attention.core.geometry.segment import effective_branches, plan_branches

    n, heads, kv_heads = 24, 6, 3
    seq_len, chunk = world_size * n, n // chunks
    layout = Schedule(*schedule).at(seq_len, heads, kv_heads)
    split = layout.sharded(world_size, chunk)
    segs, rates = effective_branches(seq_len, heads, *schedule)
    branches = list(zip(segs, rates, strict=True))
    local = [b for b in branches if chunk % min(b[0], seq_len) == 0]
    assert list(split.local) == local
    assert list(split.spanning) == [b for b in branches if b not in local]
    assert (split.local_len, split.chunk_len, split.world_size) == (n, chunk, world_size)
    if local:
        want = plan_branches(n, heads, tuple(w for w, _ in local), tuple(r for _, r in local))
        assert split.groups == want
    else:
        assert split.groups == () and not split.in_slots
    assert layout.sharded(world_size, chunk) is split  # cached: one answer per geometry


def _spy_ring_registry(monkeypatch: pytest.MonkeyPatch) -> list[tuple[KernelInputs, Any]]:
    """Record every ``(inputs, selection)`` the registries make for the resolve step, which
    the ring asks for its kernel (``prepare_ring``)."""
    import dilated_attention.resolve.resolver as resolver

    seen: list[tuple[KernelInputs, Any]] = []
    real = resolver.registry_for

    class Spy:
        def __init__(self, operation: str) -> None:
            self.registry = real(operation)

        def select(self, inputs: KernelInputs, backend: str | None = None) -> Any:
            selection = self.registry.select(inputs, backend)
            seen.append((inputs, selection))
            return selection

        def __getattr__(self, name: str) -> Any:  # everything else is the registry's
            return getattr(self.registry, name)

    monkeypatch.setattr(resolver, "registry_for", Spy)
    return seen


def test_registry_hears_whether_local_branches_run_in_slots(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One rank (no process group): the registry's inputs say the local branches run in slots,
    and the call matches the float64 oracle."""
    seen = _spy_ring_registry(monkeypatch)
    q, k, v, _ = _tensors(H)
    segs, rates = (4, 12), (1, 2)
    out = ring_dilated_attention(q, k, v, segs, rates, is_causal=True)
    ref, _ = oracle_dilated_attention(q, k, v, segs, rates, is_causal=True)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-7)
    assert [inputs.branch_slots for inputs, _ in seen] == [True]


@pytest.mark.gpu
def test_cuda_ring_dilated_chooses_like_one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank on CUDA at the length from which one GPU's automatic choice takes
    FlashAttention-4 slots for this call's cell (``slots_thresholds``; every branch local):
    ring dilated attention's automatic choice is one GPU's, and its output and gradients are
    that backend's on one GPU."""
    from dilated_attention.backends import slots_thresholds
    from dilated_attention.backends.priority_rules import FA4_DILATED_MIN_LEN
    from dilated_attention.backends.registry import choose
    from dilated_attention.core.geometry.segment import runs_in_slots
    from dilated_attention.functional import dilated_attention

    heads, segs, rates = 4, (2048, 4096), (1, 2)
    cell = KernelInputs(
        device=torch.device("cuda"), dtype=torch.bfloat16, head_dim=64, num_heads=heads,
        num_kv_heads=heads, query_len=1, key_len=1, is_causal=True, requires_grad=True,
        dilated=True, branch_slots=True,
    )  # fmt: skip
    n = slots_thresholds.min_query_len(9, cell) or FA4_DILATED_MIN_LEN or 1 << 18
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v, dout = (torch.randn(1, n, heads, 64, device="cuda", dtype=torch.bfloat16,
                                 generator=gen) for _ in range(4))  # fmt: skip
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    slots = runs_in_slots(n, heads, heads, segs, rates)
    inputs = KernelInputs.from_tensors(
        leaves[0], leaves[1], is_causal=True, dilated=True, branch_slots=slots
    )
    one_gpu = choose(inputs).backend
    seen = _spy_ring_registry(monkeypatch)
    out = ring_dilated_attention(*leaves, segs, rates, is_causal=True)
    grads = torch.autograd.grad(out, leaves, dout)
    chosen = [selection.backend.name for _, selection in seen]
    assert chosen == [one_gpu], (chosen, one_gpu)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = dilated_attention(*ref_leaves, segs, rates, is_causal=True, backend=one_gpu)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout)
    torch.testing.assert_close(out, ref)
    # FlashAttention-4's backward adds dq up with atomics (in any order): a few bf16 roundings
    # of 67M elements differ between two runs of one call, so gradients agree to bf16's step.
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-3, rtol=2e-2)
