"""Cross-rank agreement on gloo: a call that differs between ranks raises the same error on every
rank instead of hanging or aborting one of them.

Every world runs with a short process-group timeout (``TIMEOUT_S``): a collective left waiting by a
rank that skipped it fails the test within seconds, and ``run_world`` stops the whole world after
``2 * TIMEOUT_S + 30`` s. Each worker batches several checks into one spawned world (starting one
costs seconds on two cores) and ends with a valid call, which shows the group is still in step.

Workers run in separate processes where pytest does not rewrite ``assert``: every check names its
case (``_raises``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from support.distributed_utils import raises_on_rank, run_world

from dilated_attention import (
    BlockSparseRingMultiheadAttention,
    LongNetConfig,
    LongNetLM,
    RingMultiheadDilatedAttention,
    block_sparse_ring_attention,
    dilated_attention,
    patterns,
    ring_attention,
    ring_dilated_attention,
    sequence_positions,
    shard_sequence,
    unshard_sequence,
)

#: Process-group timeout of every world here: far above a step of these tiny calls, far below
#: the default (30 minutes for gloo).
TIMEOUT_S = 5.0
BATCH, HEADS, KV_HEADS, HEAD_DIM, LOCAL_LEN = 1, 4, 2, 8, 8
EMBED = 16

pytestmark = pytest.mark.distributed


def _raises(what: str, match: str, error: type[Exception] = ValueError) -> Any:
    """:func:`raises_on_rank` within half the process-group timeout."""
    return raises_on_rank(what, match, error, within_s=TIMEOUT_S / 2)


def _qkv(requires_grad: bool = False) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(BATCH, LOCAL_LEN, h, HEAD_DIM) for h in (HEADS, KV_HEADS, KV_HEADS)]
    return [
        torch.randn(s, generator=gen, dtype=torch.float64).requires_grad_(requires_grad)
        for s in shapes
    ]


def _ring_calls() -> list[tuple[str, Callable[..., torch.Tensor]]]:
    """(name, call(q, k, v)) for every ring function."""
    return [
        ("ring_attention", lambda q, k, v: ring_attention(q, k, v, is_causal=True)),
        (
            "ring_dilated_attention",
            lambda q, k, v: ring_dilated_attention(q, k, v, [4, 16], [1, 2], is_causal=True),
        ),
        (
            "block_sparse_ring_attention",
            lambda q, k, v: block_sparse_ring_attention(
                q, k, v, patterns.LocalWindow(1), block_size=4
            ),
        ),
    ]


# -- grad mode (issue 21, item 6) -----------------------------------------------------------------


def _grad_mode_worker(rank: int, world_size: int) -> None:
    """Ranks that differ in whether a backward follows raise in the forward, on every rank."""
    assert world_size == 2, world_size
    grad_mode = r"grad mode .*differs across ranks"
    for name, call in _ring_calls():
        # Rank 0 records a graph for a backward; rank 1 runs under no_grad.
        context = torch.no_grad() if rank == 1 else contextlib.nullcontext()
        with _raises(f"rank {rank}: {name}, no_grad on rank 1 only", grad_mode), context:
            call(*_qkv(requires_grad=True))
        # Grad enabled everywhere, but only rank 0's inputs require grad.
        with _raises(f"rank {rank}: {name}, requires_grad on rank 0 only", grad_mode):
            call(*_qkv(requires_grad=rank == 0))
    # The module: rank 1 under no_grad (e.g. an evaluation step taken on one rank only).
    torch.manual_seed(0)
    layer = RingMultiheadDilatedAttention(EMBED, 2, [4, 16], [1, 2], dtype=torch.float64)
    x = torch.randn(BATCH, LOCAL_LEN, EMBED, dtype=torch.float64)
    context = torch.no_grad() if rank == 1 else contextlib.nullcontext()
    what = f"rank {rank}: RingMultiheadDilatedAttention, no_grad on rank 1"
    with _raises(what, grad_mode), context:
        layer(x, is_causal=True)
    # Still in step: the same grad mode everywhere runs forward and backward.
    for name, call in _ring_calls():
        q, k, v = _qkv(requires_grad=True)
        call(q, k, v).sum().backward()
        assert q.grad is not None and k.grad is not None, f"rank {rank}: {name} gradients"
        with torch.no_grad():
            call(*_qkv(requires_grad=True))
    # backend="auto" on one rank and None on the other is the same choice, not a mismatch.
    q, k, v = _qkv()
    ring_attention(q, k, v, is_causal=True, backend="auto" if rank == 0 else None)
    # Schedule values far past the sequence run as their geometry (w = N, r = max(w, H)).
    huge = 2**62
    got = ring_dilated_attention(q, k, v, [4, huge], [1, huge], is_causal=True)
    global_len = world_size * LOCAL_LEN
    ref = ring_dilated_attention(q, k, v, [4, global_len], [1, global_len], is_causal=True)
    assert torch.equal(got, ref), f"rank {rank}: huge schedule values changed the result"
    # Rank 1 holds no query row of the r = 16 branch (heads 0-3 read positions 0-3): still the
    # single-process result (every rank's shard is the same tensor here).
    full = [torch.cat([x] * world_size, dim=1) for x in (q, k, v)]
    whole = dilated_attention(*full, [4, global_len], [1, global_len], is_causal=True)
    mine = whole[:, rank * LOCAL_LEN : (rank + 1) * LOCAL_LEN]
    torch.testing.assert_close(got, mine, msg=lambda m: f"rank {rank}: {m}")


def test_grad_mode_mismatch_raises_on_every_rank(tmp_path: Path) -> None:
    run_world(_grad_mode_worker, 2, tmp_path, timeout_s=TIMEOUT_S)


# -- ring multihead layer: per-rank checks before the ring call -----------------------------------


def _multihead_worker(rank: int, world_size: int) -> None:
    """The layer's own checks (they run before the ring call) rejecting one rank's call raise on
    every rank."""
    assert world_size == 2, world_size
    torch.manual_seed(0)
    layer = RingMultiheadDilatedAttention(EMBED, 2, [4, 16], [1, 2], dtype=torch.float64)
    x = torch.randn(BATCH, LOCAL_LEN, EMBED, dtype=torch.float64)
    r1 = rank == 1
    float_mask = torch.zeros(BATCH, LOCAL_LEN, dtype=torch.float64)
    bad_float_mask = float_mask + r1  # 1.0 on rank 1: not a 0/-inf padding mask
    cases: list[tuple[str, str, Callable[[], object]]] = [
        # Before: rank 1 raised, rank 0 waited in the ring call's agreement until the timeout.
        ("float key_padding_mask of 1.0 on rank 1", r"(rejected|as a float tensor)",
         lambda: layer(x, key_padding_mask=bad_float_mask)),
        ("need_weights=True on rank 1", r"(rejected|need_weights=True is not supported)",
         lambda: layer(x, need_weights=r1)),
        ("embed_dim 8 on rank 1", r"(rejected|query must have shape)",
         lambda: layer(x[..., : 8 if r1 else EMBED])),
        ("a non-causal attn_mask on rank 1", r"(rejected|is not the causal mask)",
         lambda: layer(x, attn_mask=torch.zeros(LOCAL_LEN, LOCAL_LEN) if r1 else None)),
    ]  # fmt: skip
    for what, match, call in cases:
        with _raises(f"rank {rank}: {what}", match):
            call()
    # The block-sparse ring layers reject a key padding mask: on one rank only, on every rank.
    sparse = BlockSparseRingMultiheadAttention(
        EMBED, 2, patterns.LocalWindow(1), block_size=4, dtype=torch.float64
    )
    no_padding = torch.zeros(BATCH, LOCAL_LEN, dtype=torch.bool) if r1 else None
    unsupported = "key_padding_mask is not supported" if r1 else r"rank\(s\) \[1\] rejected"
    with _raises(f"rank {rank}: block-sparse ring layer, a mask on rank 1", unsupported):
        sparse(x, key_padding_mask=no_padding)
    with _raises(f"rank {rank}: BlockSparseRingAttention, a mask on rank 1", unsupported):
        sparse.attention(*_qkv(), key_padding_mask=no_padding)
    # An error other than a rejection by the checks: the rank that hit it raises its own error.
    with _raises(
        f"rank {rank}: float32 input on rank 1 (its projection fails)",
        r"mat1 and mat2 must have the same dtype" if r1 else r"rank\(s\) \[1\] rejected.*dtype",
        RuntimeError if r1 else ValueError,
    ):
        layer(x.float() if r1 else x)
    # The LongNet model checks its tokens before any layer: a rejection on one rank.
    model = LongNetLM(
        LongNetConfig(
            vocab_size=32, embed_dim=EMBED, num_heads=2, num_layers=1, ffn_dim=32,
            segment_lengths=(4, 16), dilation_rates=(1, 2), kind="ring",
        )
    )  # fmt: skip
    tokens = torch.randint(0, 32, (BATCH, LOCAL_LEN))
    with _raises(
        f"rank {rank}: LongNetLM, a token id past the vocabulary on rank 1",
        r"token ids must be in \[0, vocab_size=32\)" if r1 else r"rank\(s\) \[1\] rejected",
    ):
        model(tokens + 40 * r1)
    assert model(tokens).shape == (BATCH, LOCAL_LEN, 32), f"rank {rank}: LongNetLM logits"
    # Still in step, and a valid float mask (0 = keep) is accepted.
    out, _ = layer(x, key_padding_mask=float_mask, is_causal=True)
    assert out.shape == x.shape, f"rank {rank}: out.shape {tuple(out.shape)}"
    out, _ = sparse(x, is_causal=True)
    assert out.shape == x.shape, f"rank {rank}: block-sparse out.shape {tuple(out.shape)}"


def test_multihead_layer_checks_raise_on_every_rank(tmp_path: Path) -> None:
    run_world(_multihead_worker, 2, tmp_path, timeout_s=TIMEOUT_S)


# -- sharding helpers (issue 21, items 5 and 7) ---------------------------------------------------


def _sharding_worker(rank: int, world_size: int) -> None:
    """unshard_sequence and sequence_positions agree across ranks before they gather."""
    assert world_size == 2, world_size
    r0 = rank == 0
    x = torch.arange(2 * 12 * 3, dtype=torch.float32).reshape(2, 12, 3)
    cases: list[tuple[str, str, Callable[[], object]]] = [
        # Before: gloo aborted a rank (EnforceNotMet, exit -6) on the unequal all-gather.
        ("unshard_sequence, 6 tokens on rank 0, 4 on rank 1",
         r"local seq_len \(x_local.shape\[seq_dim\]\) differs across ranks \(\[6, 4\] by rank\)",
         lambda: unshard_sequence(x[:, : 6 if r0 else 4])),
        ("unshard_sequence, float32 on rank 0, float64 on rank 1",
         r"dtype differs across ranks \(\['torch.float32', 'torch.float64'\]",
         lambda: unshard_sequence(x[:, :6].to(torch.float32 if r0 else torch.float64))),
        ("unshard_sequence, 3 dims on rank 0, 4 on rank 1",
         r"x_local.dim\(\) differs across ranks \(\[3, 4\]",
         lambda: unshard_sequence(x[:, :6] if r0 else x[:, :6, None])),
        ("unshard_sequence, last dim 3 on rank 0, 2 on rank 1",
         r"x_local.shape\[2\] differs across ranks \(\[3, 2\]",
         lambda: unshard_sequence(x[:, :6, : 3 if r0 else 2])),
        ("unshard_sequence, seq_dim 1 on rank 0, 2 on rank 1",
         r"seq_dim differs across ranks \(\[1, 2\]",
         lambda: unshard_sequence(x[:, :6, :], seq_dim=1 if r0 else 2)),
        ("unshard_sequence, layout 'striped' on rank 1 only",
         r"layout must be one of|rejected their unshard_sequence arguments.*layout must be one of",
         lambda: unshard_sequence(x[:, :6], layout="contiguous" if r0 else "striped")),
        ("unshard_sequence zigzag, odd local length 5 on every rank",
         r"local seq_len \(5\) must be even for layout='zigzag'",
         lambda: unshard_sequence(x[:, :5], layout="zigzag")),
        # Before: every rank got positions, overlapping ([0..3] and [4..9]).
        ("sequence_positions, 4 on rank 0, 6 on rank 1",
         r"local_len differs across ranks \(\[4, 6\] by rank\).*shard_sequence",
         lambda: sequence_positions(4 if r0 else 6)),
        ("sequence_positions, layout differs",
         r"layout differs across ranks \(\['contiguous', 'zigzag'\]",
         lambda: sequence_positions(4, layout="contiguous" if r0 else "zigzag")),
        ("sequence_positions, local_len -1 on rank 1",
         r"local_len must be a non-negative int|rejected their sequence_positions arguments",
         lambda: sequence_positions(4 if r0 else -1)),
    ]  # fmt: skip
    for what, match, call in cases:
        with _raises(f"rank {rank}: {what}", match):
            call()
    # Still in step: the round trips of valid calls (seq_dim -2 and 1 name the same dim).
    for layout in ("contiguous", "zigzag"):
        local = shard_sequence(x, layout=layout)
        assert torch.equal(unshard_sequence(local, layout=layout), x), f"{layout} round trip"
        back = unshard_sequence(local, layout=layout, seq_dim=-2 if r0 else 1)
        assert torch.equal(back, x), f"{layout} round trip with seq_dim -2 / 1"
        positions = sequence_positions(6, layout=layout)
        assert torch.equal(positions, _index(rank, layout)), (
            f"rank {rank}: {layout} positions {positions.tolist()}"
        )


def _index(rank: int, layout: str) -> torch.Tensor:
    """This rank's global positions for 12 tokens over 2 ranks."""
    if layout == "contiguous":
        return torch.arange(rank * 6, rank * 6 + 6)
    chunks = [rank, 3 - rank]
    return torch.cat([torch.arange(c * 3, c * 3 + 3) for c in chunks])


def test_sharding_helpers_agree_across_ranks(tmp_path: Path) -> None:
    run_world(_sharding_worker, 2, tmp_path, timeout_s=TIMEOUT_S)


# -- what a mismatch shows (issue 41, item 11) -----------------------------------------------------


def _readable_mismatch_worker(rank: int, world_size: int) -> None:
    """A field that differs is shown by its values on each rank, readably (schedules, scales,
    backends, dtypes), not as a checksum; several differing fields are all named."""
    assert world_size == 2, world_size
    r0 = rank == 0
    q, k, v = _qkv()
    eye = torch.eye(4, dtype=torch.bool)
    dilated = r"schedule \(segment_lengths, dilation_rates\) differs across ranks"
    sparse = r"schedule \(pattern, block_size\) differs across ranks"
    cases: list[tuple[str, str, Callable[[], object]]] = [
        ("segment_lengths (8, 16) / (8, 12)",
         dilated + r" \(\['segment_lengths=\[8, 16\], dilation_rates=\[1, 2\]', "
         r"'segment_lengths=\[8, 12\], dilation_rates=\[1, 2\]'\] by rank\)",
         lambda: ring_dilated_attention(q, k, v, (8, 16 if r0 else 12), (1, 2))),
        ("dilation_rates (1, 2) / (1, 4)",
         dilated + r" \(\['segment_lengths=\[8, 16\], dilation_rates=\[1, 2\]', "
         r"'segment_lengths=\[8, 16\], dilation_rates=\[1, 4\]'\] by rank\)",
         lambda: ring_dilated_attention(q, k, v, (8, 16), (1, 2 if r0 else 4))),
        ("LocalWindow(1) / LocalWindow(2)",
         sparse + r" \(\['pattern=LocalWindow\(window=1\), block_size=4', "
         r"'pattern=LocalWindow\(window=2\), block_size=4'\] by rank\)",
         lambda: block_sparse_ring_attention(q, k, v, patterns.LocalWindow(1 if r0 else 2),
                                             block_size=4)),
        ("two Custom masks of one shape",
         sparse + r" \(\['pattern=Custom\(mask of shape \(4, 4\), crc32 [0-9a-f]{8}\), "
         r"block_size=4', 'pattern=Custom\(mask of shape \(4, 4\), crc32 [0-9a-f]{8}\)",
         lambda: block_sparse_ring_attention(q, k, v, patterns.Custom(eye if r0 else ~eye),
                                             block_size=4)),
        ("scale 0.5 / default", r"scale differs across ranks \(\[0.5, None\] by rank\)",
         lambda: ring_attention(q, k, v, scale=0.5 if r0 else None)),
        ("backend math / auto", r"backend differs across ranks \(\['math', 'auto'\] by rank\)",
         lambda: ring_attention(q, k, v, backend="math" if r0 else None)),
        ("float64 / float32",
         r"dtype differs across ranks \(\['torch.float64', 'torch.float32'\] by rank\)",
         lambda: ring_attention(*(t if r0 else t.float() for t in (q, k, v)))),
        ("is_causal and scale both differ",
         r"is_causal differs across ranks \(\[True, False\] by rank\); "
         r"scale differs across ranks \(\[0.5, 0.25\] by rank\)",
         lambda: ring_attention(q, k, v, is_causal=r0, scale=0.5 if r0 else 0.25)),
    ]  # fmt: skip
    torch.manual_seed(0)
    layer = RingMultiheadDilatedAttention(EMBED, 2, [4, 16 if r0 else 8], [1, 2])
    x = torch.randn(BATCH, LOCAL_LEN, EMBED)
    cases.append(
        ("the ring layer's schedules",
         dilated + r" \(\['segment_lengths=\[4, 16\], dilation_rates=\[1, 2\]', "
         r"'segment_lengths=\[4, 8\], dilation_rates=\[1, 2\]'\] by rank\)",
         lambda: layer(x, is_causal=True))
    )  # fmt: skip
    for what, match, call in cases:
        with _raises(f"rank {rank}: {what}", match):
            call()
    out = ring_dilated_attention(q, k, v, (8, 16), (1, 2))  # still in step
    assert out.shape == q.shape, f"rank {rank}: {tuple(out.shape)}"


def test_mismatch_shows_each_ranks_values(tmp_path: Path) -> None:
    run_world(_readable_mismatch_worker, 2, tmp_path, timeout_s=TIMEOUT_S)


# -- rotary positions and packed documents on one rank only ----------------------------------------


def _rotary_cases(rank: int, world_size: int) -> list[tuple[str, str, Callable[[], object]]]:
    """(what, the error expected, call) of a ring layer with rotary positions, and a ring
    LongNetLM, rejecting the last rank's call (the layer's own checks, or packed documents
    there only). Before, the healthy ranks died of SIGABRT (gloo EnforceNotMet): their rotary
    positions' own collective met the rejected rank's agreement."""
    r_last = rank == world_size - 1
    torch.manual_seed(0)
    layer = RingMultiheadDilatedAttention(EMBED, 2, [4, 16], [1, 2], dtype=torch.float64)
    layer.use_rotary()
    x = torch.randn(BATCH, LOCAL_LEN, EMBED, dtype=torch.float64)
    row = [0, 3, LOCAL_LEN * world_size] if r_last else None
    float_mask = torch.full((BATCH, LOCAL_LEN), float(r_last), dtype=torch.float64)
    model = LongNetLM(
        LongNetConfig(
            vocab_size=32, embed_dim=EMBED, num_heads=2, num_layers=1, ffn_dim=32,
            segment_lengths=(4, 16), dilation_rates=(1, 2), kind="ring",
        )
    )  # fmt: skip
    tokens = torch.randint(0, 32, (BATCH, LOCAL_LEN))
    documents = r"cu_seqlens \(packed documents' offsets\) differs across ranks"
    return [
        ("need_weights=True on the last rank", r"(rejected|need_weights=True is not supported)",
         lambda: layer(x, need_weights=r_last)),
        ("a non-causal attn_mask on the last rank", r"(rejected|is not the causal mask)",
         lambda: layer(x, attn_mask=torch.zeros(LOCAL_LEN, LOCAL_LEN) if r_last else None)),
        ("a float key_padding_mask of 1.0 on the last rank", r"(rejected|as a float tensor)",
         lambda: layer(x, key_padding_mask=float_mask)),
        ("cu_seqlens on the last rank", documents,
         lambda: layer(x, is_causal=True, cu_seqlens=row)),
        ("a ring LongNetLM, cu_seqlens on the last rank", documents,
         lambda: model(tokens, cu_seqlens=row)),
    ]  # fmt: skip


def _rotary_worker(rank: int, world_size: int) -> None:
    """Every case of :func:`_rotary_cases` raises a clear error on every rank."""
    for what, match, call in _rotary_cases(rank, world_size):
        with _raises(f"rank {rank}/{world_size}: {what}", match):
            call()
    torch.manual_seed(0)
    layer = RingMultiheadDilatedAttention(EMBED, 2, [4, 16], [1, 2]).use_rotary()
    x = torch.randn(BATCH, LOCAL_LEN, EMBED)
    out, _ = layer(x, is_causal=True)  # still in step
    assert out.shape == x.shape, f"rank {rank}: out.shape {tuple(out.shape)}"


@pytest.mark.parametrize("world_size", [2, 3])
def test_rotary_ring_layer_faults_raise_on_every_rank(world_size: int, tmp_path: Path) -> None:
    run_world(_rotary_worker, world_size, tmp_path, timeout_s=TIMEOUT_S)


def _packed_cases(rank: int, world_size: int) -> list[tuple[str, str, Callable[[], object]]]:
    """(what, the error expected, call) of cu_seqlens on one rank only, or other offsets there,
    for every ring function: named as what differs, with each rank's offsets, and no other
    field. Before: "comm differs across ranks" (ring_dilated_attention has no comm), or
    "schedule (segment_lengths, dilation_rates) differs" for dense attention."""
    q, k, v = _qkv()
    x = torch.ones(BATCH, LOCAL_LEN, EMBED)
    torch.manual_seed(0)
    layer = RingMultiheadDilatedAttention(EMBED, 2, [4, 16], [1, 2])
    calls: list[tuple[str, Callable[..., object]]] = [
        ("ring_attention", lambda **kw: ring_attention(q, k, v, **kw)),
        ("ring_dilated_attention",
         lambda **kw: ring_dilated_attention(q, k, v, [4, 16], [1, 2], is_causal=True, **kw)),
        ("block_sparse_ring_attention",
         lambda **kw: block_sparse_ring_attention(q, k, v, patterns.LocalWindow(1), block_size=4,
                                                  **kw)),
        ("RingMultiheadDilatedAttention", lambda **kw: layer(x, is_causal=True, **kw)),
    ]  # fmt: skip
    row = [0, 5, world_size * LOCAL_LEN]
    cases: list[tuple[str, str, Callable[[], object]]] = []
    for name, call in calls:
        for mine in (None, [0, 3, world_size * LOCAL_LEN]):
            match = (
                rf"^cu_seqlens \(packed documents' offsets\) differs across ranks "
                rf"\(\[{_listed(mine)}, {_listed(row)}\] by rank\): every rank"
            )
            offsets = row if rank == 1 else mine
            cases.append((f"{name}, cu_seqlens {mine} / {row}", match,
                          lambda call=call, offsets=offsets: call(cu_seqlens=offsets)))
    return cases


def _listed(offsets: list[int] | None) -> str:
    """How the mismatch message shows ``offsets``, as a regular expression."""
    return "None" if offsets is None else r"\[" + ", ".join(map(str, offsets)) + r"\]"


def _packed_mismatch_worker(rank: int, world_size: int) -> None:
    assert world_size == 2, world_size
    for what, match, call in _packed_cases(rank, world_size):
        with _raises(f"rank {rank}: {what}", match):
            call()
    x = _qkv()[0]
    ring_attention(x, x, x, cu_seqlens=[0, 5, 2 * LOCAL_LEN])  # still in step


def test_a_packed_mismatch_names_cu_seqlens(tmp_path: Path) -> None:
    run_world(_packed_mismatch_worker, 2, tmp_path, timeout_s=TIMEOUT_S)
