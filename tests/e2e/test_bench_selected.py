"""``benchmarks/bench_selected.py``'s derived columns: speed-ups, rates on the visited pairs and
the selection's share of the MoBA call, eager, replayed and back to back."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_selected


def _rows() -> list[dict]:
    moba = {"seq_len": 1024, "path": "moba", "pair_ratio": 4.0, "fwd_ms": 4.0, "fwd_bwd_ms": 12.0}
    moba.update(fwd_steady_ms=2.0, fwd_bwd_steady_ms=10.0)
    return [
        {"seq_len": 1024, "path": "dense cudnn", "fwd_ms": 8.0, "fwd_bwd_ms": 24.0},
        {"seq_len": 1024, "path": "all blocks", "fwd_ms": 10.0, "fwd_bwd_ms": 30.0},
        moba,
    ]


def test_the_selection_share_is_taken_per_timing() -> None:
    """Eager and replayed selection over MoBA's per-call forward, the back-to-back selection
    over MoBA's back-to-back forward; rates = speedup / pair ratio."""
    rows = _rows()
    bench_selected.derive(rows, {"eager": 0.4, "gpu": 0.2, "steady": 0.06}, [])
    moba = rows[2]
    assert moba["selection_share"] == pytest.approx(0.1)
    assert moba["selection_gpu_share"] == pytest.approx(0.05)
    assert moba["selection_steady_share"] == pytest.approx(0.03)
    assert moba["fwd_speedup"] == pytest.approx(2.0)
    assert moba["visited_rate_fwd"] == pytest.approx(0.5)
    assert moba["kernel_rate_fwd_bwd"] == pytest.approx(30.0 / 12.0 / 4.0)


def test_no_steady_share_without_back_to_back_times() -> None:
    """A MoBA row measured one call at a time only has no back-to-back share."""
    rows = _rows()
    del rows[2]["fwd_steady_ms"]
    bench_selected.derive(rows, {"eager": 0.4, "gpu": 0.2, "steady": 0.1}, [])
    assert "selection_steady_share" not in rows[2]
    assert rows[2]["selection_share"] == pytest.approx(0.1)
