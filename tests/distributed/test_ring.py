"""Dense ring attention on CPU: gloo worlds of 1-4 spawned processes against float64 references.

Every rank builds the same full (B, N, H, D) tensors from a seeded generator, computes the reference
on them in float64 twice (``attention(..., backend="math")`` and the independent ``oracle``), runs
:func:`ring_attention` on its shard and checks its ``out``, ``lse`` and ``dq``/``dk``/``dv`` shards
against the reference shards. One spawned world per world size runs every combination (layout,
causality, comm, GQA/MQA, backend, dtype), because starting a world costs seconds.

Workers run in separate processes where pytest does not rewrite ``assert``: every check carries its
own message (``_close`` names the case and the quantity).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.distributed_utils import count_exchanges, raises_on_rank, run_world
from support.oracle import oracle_attention, oracle_dilated_attention
from support.tolerances import assert_close_to_oracle

import dilated_attention
import dilated_attention.distributed.comm.collectives as comm_mod
import dilated_attention.distributed.rings.ring as ring_mod
from dilated_attention.backends.registry import get_backend
from dilated_attention.distributed import (
    ring_attention,
    sequence_positions,
    shard_sequence,
    unshard_sequence,
)

BATCH, HEADS, HEAD_DIM = 2, 4, 8
LOCAL_LEN = 6  # tokens per rank: zigzag chunks of 3 (odd on purpose)
F64_ATOL = 1e-10
F32 = {"atol": 1e-5, "rtol": 1.3e-6, "grad_atol": 2e-5, "grad_rtol": 1e-5}


# -- helpers (run inside the workers) -------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    layout: str = "contiguous"
    is_causal: bool = False
    kv_heads: int = HEADS
    comm: str = "ring"
    backend: str | None = "math"
    dtype: torch.dtype = torch.float64
    scale: float | None = None
    contiguous_inputs: bool = True  # False: pass q, k, v shards as strided (transposed) views
    masked: bool = False  # pass a key padding mask (:func:`_padding_mask`)

    def __str__(self) -> str:
        return (
            f"[{self.layout} causal={self.is_causal} H={HEADS} Hkv={self.kv_heads} "
            f"comm={self.comm} backend={self.backend} {str(self.dtype).removeprefix('torch.')}"
            f" scale={self.scale}{'' if self.contiguous_inputs else ' non-contiguous'}"
            f"{' masked' if self.masked else ''}]"
        )


def _matrix() -> list[Case]:
    """Every float64 combination, plus float32 and automatic-backend spot checks."""
    cases = []
    for layout, is_causal in (("contiguous", False), ("contiguous", True), ("zigzag", True)):
        for kv_heads in (HEADS, 2, 1):  # MHA, GQA, MQA
            for comm in ("ring", "allgather"):
                for backend in ("math", "cpu_flash"):
                    cases.append(Case(layout, is_causal, kv_heads, comm, backend))
    for layout, is_causal in (("contiguous", True), ("zigzag", True), ("contiguous", False)):
        for backend in ("math", "cpu_flash"):
            cases.append(Case(layout, is_causal, 2, "ring", backend, torch.float32))
    cases.append(Case("zigzag", True, 2, "allgather", None, torch.float32, scale=0.3))
    cases.append(Case("contiguous", True, 1, "ring", None, torch.float64, scale=0.7))
    cases.append(Case("zigzag", True, 2, "ring", "cpu_flash", contiguous_inputs=False))
    cases.append(Case("contiguous", False, 1, "allgather", "math", contiguous_inputs=False))
    for layout, is_causal in (("contiguous", False), ("contiguous", True), ("zigzag", True)):
        for kv_heads, comm, backend in ((HEADS, "ring", "math"), (2, "allgather", "cpu_flash"),
                                        (1, "ring", "cpu_flash")):  # fmt: skip
            cases.append(Case(layout, is_causal, kv_heads, comm, backend, masked=True))
    cases.append(Case("zigzag", True, 2, "ring", None, torch.float32, masked=True))
    return cases


def _padding_mask(seq_len: int) -> torch.Tensor:
    """A (B, N) key padding mask: random keys in batch 0; in batch 1 the first LOCAL_LEN + 1 keys
    (so causal rows of the first shard see no key and give zeros) and every third key after."""
    gen = torch.Generator().manual_seed(seq_len)
    mask = torch.rand(BATCH, seq_len, generator=gen) < 0.3
    mask[1] = torch.arange(seq_len) % 3 == 0
    mask[1, : LOCAL_LEN + 1] = True
    return mask


def _full_inputs(
    seq_len: int, kv_heads: int, seed: int = 1234
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same float64 q, k, v, dout on every rank."""
    gen = torch.Generator().manual_seed(seed + 17 * kv_heads + seq_len)

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(BATCH, seq_len, heads, HEAD_DIM, generator=gen, dtype=torch.float64)

    return rand(HEADS), rand(kv_heads), rand(kv_heads), rand(HEADS)


def _close(
    actual: torch.Tensor, expected: torch.Tensor, what: str, *, atol: float, rtol: float = 0.0
) -> None:
    assert actual.shape == expected.shape, (
        f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    )
    torch.testing.assert_close(
        actual.detach().to(torch.float64),
        expected.detach().to(torch.float64),
        atol=atol,
        rtol=rtol,
        msg=lambda m: f"{what}: {m}",
    )


def _references(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    is_causal: bool,
    scale: float | None,
    mask: torch.Tensor | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Full-sequence float64 results: from the library's math kernel and from the oracle."""
    results = []
    for name in ("math", "oracle"):
        qq, kk, vv = (t.detach().to(torch.float64).requires_grad_() for t in (q, k, v))
        if name == "math":
            out, lse = dilated_attention.attention(
                qq, kk, vv, is_causal=is_causal, scale=scale, backend="math", return_lse=True,
                key_padding_mask=mask,
            )  # fmt: skip
        else:
            out, lse = oracle_attention(
                qq, kk, vv, is_causal=is_causal, scale=scale, key_padding_mask=mask
            )
        out.backward(dout.to(torch.float64))
        results.append(
            {
                "name": name,  # type: ignore[dict-item]
                "out": out.detach(),
                "lse": lse.detach(),
                "dq": qq.grad,
                "dk": kk.grad,
                "dv": vv.grad,
            }
        )
    math_ref, oracle_ref = results
    for key in ("out", "lse", "dq", "dk", "dv"):
        _close(math_ref[key], oracle_ref[key], f"reference math vs oracle {key}", atol=1e-12)
    return results


def _run_ring_case(case: Case, world_size: int, group: dist.ProcessGroup | None = None) -> None:
    """Ring attention on this rank's shard of a seeded sequence vs the float64 references."""
    seq_len = LOCAL_LEN * world_size
    q, k, v, dout = _full_inputs(seq_len, case.kv_heads)
    q, k, v, dout = (t.to(case.dtype) for t in (q, k, v, dout))
    mask = _padding_mask(seq_len) if case.masked else None
    refs = _references(q, k, v, dout, case.is_causal, case.scale, mask)

    def shard(x: torch.Tensor, seq_dim: int = 1) -> torch.Tensor:
        return shard_sequence(x, group=group, layout=case.layout, seq_dim=seq_dim)

    local_mask = None if mask is None else shard(mask)

    ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
    args = (ql, kl, vl)
    if not case.contiguous_inputs:  # same values, (B, H, n, D) memory order
        args = tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in args)
        assert not args[0].is_contiguous()
    out, lse = ring_attention(
        *args, group=group, is_causal=case.is_causal, scale=case.scale, layout=case.layout,
        backend=case.backend, return_lse=True, comm=case.comm, key_padding_mask=local_mask,
    )  # fmt: skip
    plain = ring_attention(
        ql, kl, vl, group=group, is_causal=case.is_causal, scale=case.scale, layout=case.layout,
        backend=case.backend, comm=case.comm, key_padding_mask=local_mask,
    )  # fmt: skip
    out.backward(shard(dout))
    out_full = unshard_sequence(out.detach(), group=group, layout=case.layout)
    lse_full = unshard_sequence(lse, group=group, layout=case.layout, seq_dim=2)

    f64 = case.dtype == torch.float64
    atol, rtol = (F64_ATOL, 0.0) if f64 else (F32["atol"], F32["rtol"])
    gatol, grtol = (F64_ATOL, 0.0) if f64 else (F32["grad_atol"], F32["grad_rtol"])
    assert out.dtype == case.dtype, f"{case} out dtype {out.dtype}"
    assert isinstance(plain, torch.Tensor), f"{case} return_lse=False returned {type(plain)}"
    assert torch.equal(plain.detach(), out.detach()), f"{case} return_lse=False changed out"
    lse_dtype = torch.float64 if f64 else torch.float32
    assert lse.dtype == lse_dtype, f"{case} lse dtype {lse.dtype}, expected {lse_dtype}"
    for ref in refs:
        tag = f"{case} vs {ref['name']}"
        _close(out, shard(ref["out"]), f"{tag} out", atol=atol, rtol=rtol)
        _close(lse, shard(ref["lse"], seq_dim=2), f"{tag} lse (B,H,n)", atol=atol, rtol=rtol)
        _close(out_full, ref["out"], f"{tag} unshard_sequence(out)", atol=atol, rtol=rtol)
        _close(lse_full, ref["lse"], f"{tag} unshard_sequence(lse)", atol=atol, rtol=rtol)
        for name, leaf in (("dq", ql), ("dk", kl), ("dv", vl)):
            assert leaf.grad is not None, f"{tag}: no {name}"
            assert leaf.grad.dtype == case.dtype, f"{tag} {name} dtype {leaf.grad.dtype}"
            _close(leaf.grad, shard(ref[name]), f"{tag} {name}", atol=gatol, rtol=grtol)


def _run_matrix(world_size: int, cases: list[Case], group: dist.ProcessGroup | None = None) -> None:
    """Run every case (all ranks take part in each), then raise one error listing the failures.

    Each case finishes its communication before comparing, so a mismatch on one rank leaves the
    ranks in step; any other exception (a crash inside ring_attention) stops the world at once.
    """
    failures = []
    for case in cases:
        try:
            _run_ring_case(case, world_size, group)
        except AssertionError as exc:
            failures.append(f"{case}: {exc}")
    assert not failures, f"{len(failures)}/{len(cases)} cases failed:\n" + "\n\n".join(failures)


def _expected_positions(rank: int, world_size: int, local_len: int, layout: str) -> torch.Tensor:
    """Global positions by hand: contiguous blocks, or zigzag chunks r and 2W-1-r."""
    if layout == "contiguous":
        return torch.arange(rank * local_len, (rank + 1) * local_len)
    c = local_len // 2
    first, second = rank, 2 * world_size - 1 - rank
    return torch.cat(
        [torch.arange(first * c, (first + 1) * c), torch.arange(second * c, (second + 1) * c)]
    )


def _check_sharding(rank: int, world_size: int) -> None:
    """shard_sequence / unshard_sequence / sequence_positions on both layouts and two seq dims."""
    n = LOCAL_LEN
    seq_len = n * world_size
    tokens = torch.arange(seq_len)
    for layout in ("contiguous", "zigzag"):
        where = f"[rank {rank}/{world_size} {layout}]"
        expected = _expected_positions(rank, world_size, n, layout)
        positions = sequence_positions(n, layout=layout)
        assert positions.dtype == torch.int64, f"{where} positions dtype {positions.dtype}"
        assert torch.equal(positions, expected), f"{where} sequence_positions {positions.tolist()}"
        # The shard of a tensor whose values are the positions, along dims 1 and 2.
        x = tokens.view(1, seq_len, 1, 1).expand(2, seq_len, 3, 2).contiguous()
        local = shard_sequence(x, layout=layout)
        assert local.is_contiguous(), f"{where} shard_sequence result not contiguous"
        assert local.shape == (2, n, 3, 2), f"{where} shard shape {tuple(local.shape)}"
        assert torch.equal(local[0, :, 0, 0], expected), (
            f"{where} shard_sequence holds {local[0, :, 0, 0].tolist()}, expected "
            f"{expected.tolist()}"
        )
        back = unshard_sequence(local, layout=layout)
        assert torch.equal(back, x), f"{where} unshard(shard(x)) != x: {back[0, :, 0, 0].tolist()}"
        y = torch.randn(2, 3, seq_len, 4, generator=torch.Generator().manual_seed(5))
        local_y = shard_sequence(y, layout=layout, seq_dim=2)
        assert torch.equal(local_y, y[:, :, expected]), f"{where} shard_sequence(seq_dim=2)"
        back_y = unshard_sequence(local_y, layout=layout, seq_dim=2)
        assert torch.equal(back_y, y), f"{where} unshard_sequence(seq_dim=2) round trip"


# -- communication and work accounting -----------------------------------------------------------


@contextlib.contextmanager
def _spy_kernel(name: str) -> Iterator[dict[str, list[tuple[int, int, bool]]]]:
    """Record (query rows, key rows, causal) of every forward and backward call of a backend."""
    backend = get_backend(name)
    calls: dict[str, list[tuple[int, int, bool]]] = {"forward": [], "backward": []}
    fwd, bwd = backend.forward, backend.backward

    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> Any:
        calls["forward"].append((q.shape[1], k.shape[1], bool(kw.get("is_causal", False))))
        return fwd(q, k, v, **kw)

    def backward(
        dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, *rest: Any, **kw: Any
    ) -> Any:
        calls["backward"].append((q.shape[1], k.shape[1], bool(kw.get("is_causal", False))))
        return bwd(dout, q, k, *rest, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backend, "forward", forward)
        mp.setattr(backend, "backward", backward)
        yield calls


def _local_qkv(
    world_size: int, kv_heads: int, dtype: torch.dtype, layout: str
) -> tuple[torch.Tensor, ...]:
    q, k, v, dout = _full_inputs(LOCAL_LEN * world_size, kv_heads)
    return tuple(shard_sequence(t.to(dtype), layout=layout) for t in (q, k, v, dout))


def _check_bytes(rank: int, world_size: int) -> None:
    """Forward sends exactly W-1 K/V blocks of this rank's kv heads. The backward sends the K/V
    blocks again (ring) and this rank's dK/dV parts straight to each block's owner, in the
    kernel's gradient dtype, and only for blocks it made a call against: causal with the
    contiguous layout, rank r sends parts for the r earlier blocks only (Note [Gradients go
    home]). A key padding mask travels with its block: one byte per key."""
    n = LOCAL_LEN
    for dtype in (torch.float32, torch.float64):
        elem = torch.finfo(dtype).bits // 8
        forward_bytes: dict[int, int] = {}
        for kv_heads, comm, masked in itertools.product(
            (HEADS, 2, 1), ("ring", "allgather"), (False, True)
        ):
            kv_block = 2 * BATCH * n * kv_heads * HEAD_DIM * elem  # K and V of one rank
            block = kv_block + BATCH * n * masked  # what travels per rank: K, V (and the mask)
            parts = rank * kv_block  # math kernel: gradients in the input dtype; blocks 0..rank-1
            where = f"[rank {rank}/{world_size} {dtype} Hkv={kv_heads} comm={comm} masked={masked}]"
            q, k, v, dout = _local_qkv(world_size, kv_heads, dtype, "contiguous")
            q.requires_grad_()
            k.requires_grad_()
            v.requires_grad_()
            mask = _no_padding(n) if masked else None
            with count_exchanges(ring=ring_mod, comm=comm_mod) as log:
                out = ring_attention(
                    q, k, v, is_causal=True, backend="math", comm=comm, key_padding_mask=mask
                )
                fwd = {key: list(val) for key, val in log.items()}
                out.backward(dout)
            bwd = {key: val[len(fwd[key]) :] for key, val in log.items()}
            fwd_total = sum(fwd["ring_sent"]) + sum(fwd["comm_sent"])
            assert fwd_total == (world_size - 1) * block, (
                f"{where} forward sent {fwd_total} bytes ({fwd}); expected "
                f"(W-1)={world_size - 1} K/V blocks of 2*B*n*Hkv*D*{elem} = {block} bytes"
            )
            for prefix in ("ring", "comm"):
                assert fwd[f"{prefix}_sent"] == fwd[f"{prefix}_recv"], (
                    f"{where} {prefix}: sent {fwd[f'{prefix}_sent']} != received "
                    f"{fwd[f'{prefix}_recv']}"
                )
            # Parts for this rank's block come from the later ranks only.
            got_recv = sum(bwd["ring_recv"]) + sum(bwd["comm_recv"])
            expected_recv = (world_size - 1) * block + (world_size - 1 - rank) * kv_block
            assert got_recv == expected_recv, (
                f"{where} backward received {got_recv} bytes ({bwd}); expected (W-1) K/V "
                f"blocks + {world_size - 1 - rank} dK/dV parts = {expected_recv}"
            )
            if comm == "ring":
                assert fwd["ring_sent"] == [block] * (world_size - 1), (
                    f"{where} forward exchanges {fwd['ring_sent']}, expected W-1 of {block}"
                )
                expected_bwd = (world_size - 1) * block + parts
                got_bwd = sum(bwd["ring_sent"]) + sum(bwd["comm_sent"])
                assert got_bwd == expected_bwd, (
                    f"{where} backward sent {got_bwd} bytes ({bwd}); expected (W-1) K/V blocks"
                    f" + {rank} dK/dV parts = {expected_bwd}"
                )
                if not masked:
                    forward_bytes[kv_heads] = fwd_total
            else:
                assert not fwd["ring_sent"], f"{where} allgather used ring exchanges {fwd}"
                expected_bwd = (world_size - 1) * block + parts
                got_bwd = sum(bwd["comm_sent"]) + sum(bwd["ring_sent"])
                assert got_bwd == expected_bwd, (
                    f"{where} backward sent {got_bwd} bytes ({bwd}); expected (W-1) K/V blocks"
                    f" (all-gather) + {rank} dK/dV parts = {expected_bwd}"
                )
        # Only key/value heads travel: bytes scale with Hkv, never with H.
        assert forward_bytes[2] * 2 == forward_bytes[HEADS] == forward_bytes[1] * HEADS, (
            f"[rank {rank}] forward bytes by Hkv {forward_bytes} not proportional to Hkv"
        )


def _work(calls: list[tuple[int, int, bool]]) -> float:
    """Query rows x key rows summed over kernel calls, causal calls counted as half."""
    return sum(qr * kr * (0.5 if causal else 1.0) for qr, kr, causal in calls)


def _check_work(rank: int, world_size: int) -> None:
    """Causal ring skips empty blocks: contiguous rank r makes r+1 kernel calls (rank 0 only its
    diagonal block); zigzag gives every rank the same work, 2W chunk pairs of (n/2)^2."""
    n = LOCAL_LEN
    c = n // 2
    where = f"[rank {rank}/{world_size}]"
    cases = [("contiguous", True), ("zigzag", True), ("contiguous", False)]
    for (layout, is_causal), comm in itertools.product(cases, ("ring", "allgather")):
        q, k, v, dout = _local_qkv(world_size, 2, torch.float64, layout)
        q.requires_grad_()
        with _spy_kernel("math") as calls:
            out = ring_attention(
                q, k, v, is_causal=is_causal, layout=layout, backend="math", comm=comm
            )
            out.backward(dout)
        fwd, bwd = calls["forward"], calls["backward"]
        tag = f"{where} {layout} causal={is_causal} comm={comm}"
        assert all(qr > 0 and kr > 0 for qr, kr, _ in fwd), f"{tag} empty kernel call {fwd}"
        # Same calls in the same order: each backward call consumes its forward call's aux.
        assert bwd == fwd, f"{tag} backward calls {bwd} != forward calls {fwd} (in order)"
        work = _work(fwd)
        everyone: list[Any] = [None] * world_size
        dist.all_gather_object(everyone, work)
        if layout == "contiguous" and is_causal:
            assert len(fwd) == rank + 1, (
                f"{tag} made {len(fwd)} kernel calls {fwd}, expected {rank + 1}"
            )
            assert work == rank * n * n + n * n / 2, f"{tag} work {work} (calls {fwd})"
            assert [(qr, kr, cz) for qr, kr, cz in fwd if cz] == [(n, n, True)], (
                f"{tag} expected exactly one causal (diagonal) call, got {fwd}"
            )
        elif layout == "zigzag":
            assert len(set(everyone)) == 1, f"{tag} unbalanced zigzag work by rank: {everyone}"
            assert work == 2 * world_size * c * c, (
                f"{tag} work {work}, expected 2W*(n/2)^2 = {2 * world_size * c * c} (calls {fwd})"
            )
        else:
            assert len(fwd) == world_size, f"{tag} {len(fwd)} calls, expected W: {fwd}"
            assert work == world_size * n * n, f"{tag} work {work}"


# -- workers --------------------------------------------------------------------------------------


def _world_worker(rank: int, world_size: int) -> None:
    _check_sharding(rank, world_size)
    _run_matrix(world_size, _matrix())
    _check_bytes(rank, world_size)
    _check_work(rank, world_size)


def _subgroup_worker(rank: int, world_size: int) -> None:
    """Two rings at once over non-adjacent ranks [0, 2] and [1, 3]: group ranks != global ranks."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates every group
    mine = groups[rank % 2]
    assert dist.get_world_size(mine) == 2, f"rank {rank}: group size {dist.get_world_size(mine)}"
    cases = [
        Case("zigzag", True, 2, "ring", "math"),
        Case("contiguous", False, 1, "allgather", "cpu_flash"),
        Case("contiguous", True, HEADS, "ring", "cpu_flash"),
        Case("zigzag", True, 2, "allgather", "math"),
    ]
    _run_matrix(2, cases, group=mine)
    # sequence_positions follows the group rank, not the global rank.
    group_rank = dist.get_rank(mine)
    got = sequence_positions(LOCAL_LEN, group=mine, layout="zigzag")
    expected = _expected_positions(group_rank, 2, LOCAL_LEN, "zigzag")
    assert torch.equal(got, expected), f"rank {rank}: positions {got.tolist()} in its group"


def _qkv(
    n: int, heads: int = HEADS, kv_heads: int = 2, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(BATCH, n, heads, HEAD_DIM, generator=gen, dtype=torch.float64)
    k = torch.randn(BATCH, n, kv_heads, HEAD_DIM, generator=gen, dtype=torch.float64)
    v = torch.randn(BATCH, n, kv_heads, HEAD_DIM, generator=gen, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _no_padding(n: int) -> torch.Tensor:
    """A (BATCH, n) key padding mask that masks nothing."""
    return torch.zeros(BATCH, n, dtype=torch.bool)


def _bad_input_worker(rank: int, world_size: int) -> None:
    """Every malformed or mismatched call raises ValueError on every rank; the group stays sane."""
    assert world_size == 2, world_size
    r0 = rank == 0
    mismatched = [
        ("n=6 on rank 0, n=8 on rank 1", r"local seq_len differs across ranks \(\[6, 8\]",
         lambda: ring_attention(*_qkv(6 if r0 else 8), is_causal=True)),
        ("H=4 on rank 0, H=2 on rank 1", r"query heads differs across ranks \(\[4, 2\]",
         lambda: ring_attention(*_qkv(6, heads=4 if r0 else 2))),
        ("Hkv=2 on rank 0, Hkv=1 on rank 1", r"key/value heads differs across ranks \(\[2, 1\]",
         lambda: ring_attention(*_qkv(6, kv_heads=2 if r0 else 1))),
        ("D=8 on rank 0, D=4 on rank 1", r"head_dim differs across ranks",
         lambda: ring_attention(*(t[..., : 8 if r0 else 4] for t in _qkv(6)))),
        ("is_causal differs", r"is_causal differs across ranks",
         lambda: ring_attention(*_qkv(6), is_causal=r0)),
        ("layout differs", r"layout differs across ranks",
         lambda: ring_attention(*_qkv(6), is_causal=True, layout="zigzag" if r0 else "contiguous")),
        ("comm differs", r"comm differs across ranks",
         lambda: ring_attention(*_qkv(6), comm="ring" if r0 else "allgather")),
        ("key_padding_mask on rank 0 only", r"key_padding_mask given \(0/1\) differs",
         lambda: ring_attention(*_qkv(6), key_padding_mask=_no_padding(6) if r0 else None)),
        ("key_padding_mask (B, 5) on rank 1",
         r"rejected their ring attention inputs|key_padding_mask must have shape",
         lambda: ring_attention(*_qkv(6), key_padding_mask=_no_padding(6 if r0 else 5))),
    ]  # fmt: skip
    malformed = [
        ("zigzag with is_causal=False", r"zigzag.*is_causal=False",
         lambda: ring_attention(*_qkv(6), layout="zigzag", is_causal=False)),
        ("zigzag with odd local length 5", r"local seq_len \(5\) must be even",
         lambda: ring_attention(*_qkv(5), layout="zigzag", is_causal=True)),
        ("unknown layout", r"layout must be one of .*'striped'",
         lambda: ring_attention(*_qkv(6), layout="striped")),
        ("unknown comm", r"comm must be one of .*'alltoall'",
         lambda: ring_attention(*_qkv(6), comm="alltoall")),
        ("unknown backend", r"backend must be one of",
         lambda: ring_attention(*_qkv(6), backend="no_such_kernel")),
        # shard_sequence / sequence_positions name the length that does not divide.
        ("shard_sequence N=7, W=2", r"\(7\) must be divisible by 2 \(world size 2\)",
         lambda: shard_sequence(torch.zeros(1, 7, 1, 1))),
        ("shard_sequence zigzag N=6, W=2", r"\(6\) must be divisible by 4 \(world size 2 x 2",
         lambda: shard_sequence(torch.zeros(1, 6, 1, 1), layout="zigzag")),
        ("shard_sequence seq_dim=2 N=5", r"x.shape\[2\] \(seq_len\) \(5\)",
         lambda: shard_sequence(torch.zeros(1, 1, 5, 1), seq_dim=2)),
        ("shard_sequence unknown layout", r"layout must be one of",
         lambda: shard_sequence(torch.zeros(1, 4, 1, 1), layout="striped")),
        ("sequence_positions zigzag local_len=3", r"\(6\) must be divisible by 4",
         lambda: sequence_positions(3, layout="zigzag")),
    ]  # fmt: skip
    for what, match, call in mismatched + malformed:
        with raises_on_rank(f"rank {rank}: {what}", match):
            call()

    # A group this rank is not in: rank 1 gets a ValueError; rank 0 runs a ring of one.
    only_zero = dist.new_group([0])  # every rank must call new_group
    x = _qkv(6)
    if rank == 1:
        with raises_on_rank("ring_attention(group=new_group([0])) on rank 1", "not a member"):
            ring_attention(*x, group=only_zero)
        with raises_on_rank("shard_sequence(group=new_group([0])) on rank 1", "not a member"):
            shard_sequence(torch.zeros(1, 4, 1, 1), group=only_zero)
    else:
        out = ring_attention(*x, group=only_zero, is_causal=True, backend="math")
        ref = dilated_attention.attention(*x, is_causal=True, backend="math")
        _close(out, ref, "ring of one over new_group([0])", atol=F64_ATOL)

    # Nothing is left half-sent: the world still computes exact ring attention.
    _run_matrix(world_size, [Case("zigzag", True, 2, "ring", "math")])


def _scale_mismatch_worker(rank: int, world_size: int) -> None:
    with raises_on_rank(
        f"rank {rank}: scale=0.5 on rank 0, scale=None on rank 1", r"scale.*differs"
    ):
        ring_attention(*_qkv(6), scale=0.5 if rank == 0 else None)


def _dtype_mismatch_worker(rank: int, world_size: int) -> None:
    dtype = torch.float32 if rank == 0 else torch.float64
    with raises_on_rank(
        f"rank {rank}: float32 shards on rank 0, float64 on rank 1", r"dtype.*differs"
    ):
        ring_attention(*_qkv(6, dtype=dtype))


def _one_rank_bad_layout_worker(rank: int, world_size: int) -> None:
    with raises_on_rank(
        f"rank {rank}: layout='striped' on rank 1 only",
        r"layout must be one of|rejected their ring attention inputs.*layout must be one of",
    ):
        ring_attention(*_qkv(6), layout="contiguous" if rank == 0 else "striped")


# -- tests ----------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ring_world(world_size: int, tmp_path: Any) -> None:
    """Sharding helpers, every ring combination vs float64 references, bytes sent, kernel work."""
    run_world(_world_worker, world_size, tmp_path)


@pytest.mark.distributed
def test_ring_subgroups(tmp_path: Any) -> None:
    run_world(_subgroup_worker, 4, tmp_path)


@pytest.mark.distributed
def test_ring_bad_input_raises_on_every_rank(tmp_path: Any) -> None:
    run_world(_bad_input_worker, 2, tmp_path, timeout_s=30)


# The docstring of ring_attention promises a ValueError "on every rank, before any other
# communication, when shards or options differ between ranks or are malformed". These three cases
# go beyond the shapes that prepare_ring all-gathers.


@pytest.mark.distributed
def test_ring_scale_mismatch_raises_on_every_rank(tmp_path: Any) -> None:
    run_world(_scale_mismatch_worker, 2, tmp_path, timeout_s=10)


@pytest.mark.distributed
def test_ring_dtype_mismatch_raises_on_every_rank(tmp_path: Any) -> None:
    run_world(_dtype_mismatch_worker, 2, tmp_path, timeout_s=10)


@pytest.mark.distributed
def test_ring_option_malformed_on_one_rank_raises_on_every_rank(tmp_path: Any) -> None:
    run_world(_one_rank_bad_layout_worker, 2, tmp_path, timeout_s=5)


# -- single process, no torch.distributed ---------------------------------------------------------


@pytest.mark.parametrize("backend", ["gloo", "cpu:gloo,cuda:nccl"])
def test_agreement_check_stays_on_the_cpu_where_the_group_allows(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The per-call all-gather of the agreement check uses CPU tensors (gloo) whenever the group
    has a CPU backend, so it never waits for the GPU (docs/ring.md)."""
    monkeypatch.setattr(comm_mod.dist, "get_backend", lambda group=None: backend)
    assert comm_mod._collective_device(None) == torch.device("cpu")


def test_group_without_init_raises() -> None:
    assert not dist.is_initialized()
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"not initialised"):
        ring_attention(q, q, q, group=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"not initialised"):
        shard_sequence(q, group=object())  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_single_process_is_plain_attention(layout: str) -> None:
    """Without torch.distributed the ring is one rank: shard and unshard are identities."""
    assert not dist.is_initialized()
    q = _full_inputs(8, 2)[0]
    assert torch.equal(shard_sequence(q, layout=layout), q)
    assert torch.equal(unshard_sequence(q, layout=layout), q)
    assert torch.equal(sequence_positions(8, layout=layout), torch.arange(8))
    case = Case(layout, True, 2, "ring", "math")
    _run_ring_case(case, 1)
    with pytest.raises(ValueError, match=r"\(7\) must be divisible by 2 \(world size 1 x 2"):
        shard_sequence(torch.zeros(1, 7, 1, 1), layout="zigzag")


def test_every_ring_function_asks_the_resolve_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-step kernel of every ring function comes from the resolve step, one request per
    call as a one-process call makes it: ``"dense"`` for dense and block-sparse ring attention,
    ``"dilated"`` with the schedule and the shard (world size, chunk length) for ring dilated
    attention; a kernel named by the caller reaches the request."""
    import dilated_attention.distributed.comm.agreement as agreement
    from dilated_attention import block_sparse_ring_attention, patterns, ring_dilated_attention
    from dilated_attention.core.geometry.schedule import Schedule

    seen: list[Any] = []
    real = agreement.resolve

    def spy(request: Any) -> Any:
        seen.append(request)
        return real(request)

    monkeypatch.setattr(agreement, "resolve", spy)
    q, k, v, _ = _full_inputs(8, 2)
    ring_attention(q, k, v, is_causal=True, layout="zigzag", backend="math")
    ring_dilated_attention(q, k, v, (4, 8), (1, 2), is_causal=True, layout="zigzag")
    block_sparse_ring_attention(q, k, v, patterns.LocalWindow(1), block_size=4)
    got = [(r.operation, r.shard, r.is_causal, r.backend, r.schedule) for r in seen]
    assert got == [
        ("dense", None, True, "math", None),
        ("dilated", (1, 4), True, None, Schedule((4, 8), (1, 2))),
        ("dense", None, False, None, None),
    ], got


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_single_process_cuda_ring_is_attention(layout: str, dtype: torch.dtype) -> None:
    """One rank on CUDA: the causal zigzag schedule's calls (merged by the fused kernel) give
    the single-call result, outputs and gradients."""
    assert not dist.is_initialized()
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (
        torch.randn(2, 96, 4, 32, device="cuda", generator=gen, dtype=dtype).requires_grad_()
        for _ in range(3)
    )
    dout = torch.randn(2, 96, 4, 32, device="cuda", generator=gen, dtype=dtype)
    ring = ring_attention(q, k, v, is_causal=True, layout=layout)
    grads = torch.autograd.grad(ring, (q, k, v), dout)
    want = dilated_attention.attention(q, k, v, is_causal=True)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    tol = {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(ring, want, **tol)
    for got, exp in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, exp, **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flash_attn4", "sdpa_cudnn", "triton"])
@pytest.mark.parametrize(
    ("operation", "layout", "is_causal", "kv_heads"),
    [
        ("ring", "contiguous", False, 4),
        ("ring", "zigzag", True, 2),
        ("ring dilated", "contiguous", True, 1),
        ("ring dilated", "contiguous", False, 4),
    ],
)
def test_single_process_cuda_ring_step_kernel_matches_oracle(
    backend: str, operation: str, layout: str, is_causal: bool, kv_heads: int
) -> None:
    """Each dense CUDA kernel as the ring's kernel (one rank; FlashAttention-4 where installed):
    output, lse and every gradient against the float64 oracle, with a same-dtype replica setting
    the error budget. Ring dilated runs its branches through the same kernel."""
    assert not dist.is_initialized()
    dtype, segs, rates = torch.bfloat16, [64, 256], [1, 4]
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 256, 4, 64, generator=gen).to(dtype)
    k, v = (torch.randn(2, 256, kv_heads, 64, generator=gen).to(dtype) for _ in "kv")
    dout = torch.randn(2, 256, 4, 64, generator=gen).to(dtype)
    dev = [t.cuda().requires_grad_() for t in (q, k, v)]
    reasons = dilated_attention.backend_reasons(*dev, is_causal=is_causal)[backend]
    if reasons:
        pytest.skip(f"{backend} cannot run here: {'; '.join(reasons)}")
    if operation == "ring":
        out, lse = ring_attention(
            *dev, is_causal=is_causal, layout=layout, backend=backend, return_lse=True
        )
    else:
        out, lse = dilated_attention.ring_dilated_attention(
            *dev, segs, rates, is_causal=is_causal, layout=layout, backend=backend,
            return_lse=True,
        )  # fmt: skip
    grads = torch.autograd.grad(out, dev, dout.cuda())
    results = []
    for cdt in (torch.float64, dtype):
        leaves = [t.detach().to(cdt).requires_grad_() for t in (q, k, v)]
        if operation == "ring":
            want, want_lse = oracle_attention(*leaves, is_causal=is_causal, compute_dtype=cdt)
        else:
            want, want_lse = oracle_dilated_attention(
                *leaves, segs, rates, is_causal=is_causal, compute_dtype=cdt
            )
        results.append((want, want_lse, torch.autograd.grad(want, leaves, dout.to(cdt))))
    (ref, ref_lse, ref_grads), (low, low_lse, low_grads) = results
    assert_close_to_oracle(out.detach().cpu(), ref, low, name="out", dtype=dtype)
    assert_close_to_oracle(lse.cpu(), ref_lse, low_lse, name="lse", dtype=dtype)
    for name, got, want, same in zip("qkv", grads, ref_grads, low_grads, strict=True):
        assert_close_to_oracle(got.cpu(), want, same, name=f"d{name}", dtype=dtype, grad=True)
