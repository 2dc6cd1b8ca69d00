"""What the benchmarks compute beside their timings: ``bench_dilated.py``'s FLOP ratio and
speedup columns."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from support.oracle import dilated_multiplicity

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_dilated

from dilated_attention import longnet_schedule

#: The FLOP ratios of the LongNet schedule at 4K-64K, causal, as the issue's H100 table gives
#: them (rounded there to two places at 4K, one above).
TABLE = {4096: (1.33, 2), 8192: (2.3, 1), 16384: (4.3, 1), 32768: (8.3, 1), 65536: (16.3, 1)}


@pytest.mark.parametrize("seq_len", sorted(TABLE))
def test_flop_ratio_of_the_longnet_schedule(seq_len: int) -> None:
    """``longnet_n`` is ``longnet_schedule(N)``, and its FLOP ratio at each length is the
    table's. The table halves the causal pair counts (N * N / 2 over the sum of m * m / 2: the
    ratio without the causal flag); the exact causal counts (N (N + 1) / 2 over the sum of
    m (m + 1) / 2) differ from that by under 0.1% (16.246 against 16.254 at 64K, which the
    table rounds to 16.3)."""
    segs, rates = bench_dilated.schedule_at("longnet_n", seq_len)
    assert (list(segs), list(rates)) == longnet_schedule(seq_len)
    value, places = TABLE[seq_len]
    halved = bench_dilated.flop_ratio(seq_len, 16, segs, rates, False)
    causal = bench_dilated.flop_ratio(seq_len, 16, segs, rates, True)
    assert round(halved, places) == value
    assert causal == pytest.approx(halved, rel=1e-3) and causal < halved
    if seq_len == 4096:
        assert round(causal, 2) == 1.33


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    ("seq_len", "heads", "segs", "rates"),
    [
        (64, 4, (16, 32), (1, 2)),  # whole segments
        (50, 3, (16, 32), (2, 4)),  # a short last segment, offsets past its end
        (48, 5, (8, 64), (3, 1)),  # a rate that leaves a partial stride; a segment beyond N
        (40, 2, (40,), (1,)),  # dense: ratio 1
    ],
)
def test_flop_ratio_counts_what_the_oracle_visits(
    seq_len: int, heads: int, segs: tuple[int, ...], rates: tuple[int, ...], causal: bool
) -> None:
    """The pairs of the schedule are the float64 sum of the oracle's multiplicity matrix (how
    many branches let each head's query see each key, built position by position), and the
    ratio is dense pairs over that."""
    visited = dilated_multiplicity(seq_len, heads, segs, rates, is_causal=causal)
    total = float(visited.to(torch.float64).sum())
    assert bench_dilated.schedule_pairs(seq_len, heads, segs, rates, causal) == total
    dense = heads * float(torch.ones(seq_len, seq_len, dtype=torch.float64).tril().sum()
                          if causal else seq_len * seq_len)  # fmt: skip
    ratio = bench_dilated.flop_ratio(seq_len, heads, segs, rates, causal)
    assert ratio == pytest.approx(dense / total, rel=1e-12)


def test_speedups_are_dense_cudnn_time_over_each_rows() -> None:
    """``fwd_speedup`` / ``fwd_bwd_speedup``: the cell's ``dense cudnn`` time over the row's
    (dense cuDNN's own row 1); none on a failed row, none where dense cuDNN failed."""
    rows = [
        {"path": "auto", "fwd_ms": 2.0, "fwd_bwd_ms": 5.0, "fwd_tflops": 1.0,
         "fwd_bwd_tflops": 1.0},
        {"path": "dense cudnn", "fwd_ms": 4.0, "fwd_bwd_ms": 20.0, "fwd_tflops": 1.0,
         "fwd_bwd_tflops": 1.0},
        {"path": "auto captured", "error": "RuntimeError: capture failed"},
    ]  # fmt: skip
    bench_dilated.relative_columns(rows)
    assert (rows[0]["fwd_speedup"], rows[0]["fwd_bwd_speedup"]) == (2.0, 4.0)
    assert (rows[1]["fwd_speedup"], rows[1]["fwd_bwd_speedup"]) == (1.0, 1.0)
    assert "fwd_speedup" not in rows[2]
    alone = [dict(rows[0]), {"path": "dense cudnn", "error": "out of memory"}]
    del alone[0]["fwd_speedup"], alone[0]["fwd_bwd_speedup"]
    bench_dilated.relative_columns(alone)
    assert "fwd_speedup" not in alone[0]
