"""What the benchmarks compute beside their timings: ``bench_dilated.py``'s FLOP ratio and
speedup columns, ``bench_compile.py``'s rows (against eager, a failing path) and its stack."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from support.oracle import dilated_multiplicity
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_compile
import bench_dilated

from dilated_attention import MultiheadDilatedAttention, longnet_schedule

#: The FLOP ratios of ``longnet_schedule(N)`` at 4K-64K, causal, as the short-length comparison
#: quotes them (to two places at 4K, one above): ``(value, places)``.
TABLE = {4096: (1.33, 2), 8192: (2.3, 1), 16384: (4.3, 1), 32768: (8.3, 1), 65536: (16.3, 1)}


@pytest.mark.parametrize("seq_len", sorted(TABLE))
def test_flop_ratio_of_the_longnet_schedule(seq_len: int) -> None:
    """``longnet_n`` is ``longnet_schedule(N)``, and its FLOP ratio at each length is the
    quoted one. The quoted values halve the causal pair counts (N * N / 2 over the sum of
    m * m / 2: the ratio without the causal flag); the exact causal counts (N (N + 1) / 2 over
    the sum of m (m + 1) / 2) differ from that by under 0.1% (16.246 against 16.254 at 64K,
    quoted as 16.3)."""
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
    (dense cuDNN's own row 1), and ``*_steady_speedup`` the same for the back-to-back times
    where both rows have them; none on a failed row, none where dense cuDNN failed."""
    rows = [
        {"path": "auto", "fwd_ms": 2.0, "fwd_bwd_ms": 5.0, "fwd_tflops": 1.0,
         "fwd_bwd_tflops": 1.0, "fwd_steady_ms": 1.0, "fwd_bwd_steady_ms": 8.0},
        {"path": "dense cudnn", "fwd_ms": 4.0, "fwd_bwd_ms": 20.0, "fwd_tflops": 1.0,
         "fwd_bwd_tflops": 1.0, "fwd_steady_ms": 3.0, "fwd_bwd_steady_ms": 12.0},
        {"path": "dense attention", "fwd_ms": 4.0, "fwd_bwd_ms": 20.0, "fwd_tflops": 1.0,
         "fwd_bwd_tflops": 1.0},
        {"path": "auto captured", "error": "RuntimeError: capture failed"},
    ]  # fmt: skip
    bench_dilated.relative_columns(rows)
    assert (rows[0]["fwd_speedup"], rows[0]["fwd_bwd_speedup"]) == (2.0, 4.0)
    assert (rows[0]["fwd_steady_speedup"], rows[0]["fwd_bwd_steady_speedup"]) == (3.0, 1.5)
    assert (rows[1]["fwd_speedup"], rows[1]["fwd_bwd_speedup"]) == (1.0, 1.0)
    assert "fwd_steady_speedup" not in rows[2]  # timed one call at a time only
    assert "fwd_speedup" not in rows[3]
    alone = [dict(rows[0]), {"path": "dense cudnn", "error": "out of memory"}]
    del alone[0]["fwd_speedup"], alone[0]["fwd_bwd_speedup"]
    bench_dilated.relative_columns(alone)
    assert "fwd_speedup" not in alone[0]


def test_compile_rows_against_eager_and_a_failing_path() -> None:
    """``bench_compile.measure_cell`` on a tiny CPU module: every path timed with its host time,
    ``vs_eager`` = eager's time over the path's, the loss and gradient differences against
    eager's (a path that scales the output by 1.01 scales the loss and every gradient by
    1.0201), and a path that fails records its error while the paths after it still run."""
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    x = torch.randn(1, 4, 8)
    args = bench_compile.parse_args(["--warmup", "0", "--repeats", "2"])

    def broken(m: nn.Module) -> nn.Module:
        raise RuntimeError("Detected 4 tensor(s) in the cudagraph pool\nnot tracked")

    wraps = {"eager": (lambda m: m, False), "broken": (broken, False),
             "scaled": (lambda m: lambda x: m(x) * 1.01, False)}  # fmt: skip
    rows = bench_compile.measure_cell(model, x, ["eager", "broken", "scaled"], args, wraps)
    eager, failed, scaled = rows
    assert failed["error"] == "RuntimeError: Detected 4 tensor(s) in the cudagraph pool"
    assert "fwd_bwd_ms" not in failed and "vs_eager" not in failed
    for row in (eager, scaled):
        assert row["fwd_bwd_host_ms"] == row["fwd_bwd_ms"] > 0  # the CPU: wall time
    assert eager["vs_eager"] == 1.0
    assert scaled["vs_eager"] == eager["fwd_bwd_ms"] / scaled["fwd_bwd_ms"]
    assert scaled["loss_rel_diff"] == pytest.approx(0.0201, rel=1e-4)
    assert scaled["grad_rel_diff"] == pytest.approx(0.0201, rel=1e-4)
    assert all(p.grad is None for p in model.parameters())


def test_compile_stack_is_four_longnet_layers() -> None:
    """The stack holds ``--layers`` multihead dilated layers on ``longnet_schedule(N)``."""
    stack = bench_compile.Stack(4, 32, 4, 8192, device=torch.device("cpu"), dtype=torch.float32)
    assert len(stack.layers) == 4
    for layer in stack.layers:
        assert isinstance(layer, MultiheadDilatedAttention)
        config = layer.config
        assert (list(config.segment_lengths), list(config.dilation_rates)) == longnet_schedule(8192)


def test_bench_compile_arguments() -> None:
    """The default run is 4K-64K with every path, eager first; and a value it cannot run is
    refused before any work, naming the argument."""
    args = bench_compile.parse_args([])
    assert args.seq_lens == [4096, 8192, 16384, 32768, 65536]
    assert args.paths == ["eager", "compile", "compile fullgraph", "reduce-overhead"]
    assert (args.layers, args.embed_dim, args.heads) == (4, 2048, 16)
    with pytest.raises(SystemExit):
        bench_compile.parse_args(["--embed-dim", "100"])
