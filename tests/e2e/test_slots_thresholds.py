"""The measured slots table is what its records give (Note [The measured slots table]).

``dilated_attention/backends/slots_thresholds.json`` is written by
``benchmarks/tune_dilated_choice.py --write`` from ``bench_dilated.py`` records: these tests derive
the table again from the records it names and require the committed one to be identical (with
the times it was read from), so a re-measured record without a re-derived table, or a hand edit,
fails here.
"""

from __future__ import annotations

import json
import sys

import pytest
from support import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import tune_dilated_choice

from dilated_attention.backends import slots_thresholds


def test_the_table_is_derived_from_the_records_it_names() -> None:
    table = slots_thresholds.table()
    assert table["majors"], "no device class measured"
    for major, sources in table["sources"].items():
        eager, replayed = (
            [json.loads((tune_dilated_choice.RESULTS_DIR / name).read_text()) for name in names]
            for names in (sources, table["replayed_sources"][major])
        )  # fmt: skip
        schedules = table["schedules"][major]
        assert schedules == list(tune_dilated_choice.SCHEDULES)  # the tuner's default
        derived = tune_dilated_choice.derived_cells(eager, replayed, schedules)
        assert derived == table["majors"][major]


def test_newer_records_replace_the_older_times_where_they_measured() -> None:
    """The thresholds with graphs read the replayed records' times where they measured a length
    and the older ones elsewhere; without graphs, the older ones alone."""
    older = [[_row(n, "flash_attn4", 3.0), _row(n, "triton", 2.0)] for n in (8, 16)]
    older.append([_row(32, "flash_attn4", 1.0), _row(32, "triton", 2.0)])
    newer = [[_row(n, "flash_attn4", 1.0), _row(n, "triton", 2.0)] for n in (8, 16)]
    cells = tune_dilated_choice.derived_cells(
        [{"results": rows} for rows in older], [{"results": rows} for rows in newer]
    )  # fmt: skip
    cell = cells["mha/forward/d64/full"]
    assert cell["min_query_len"] == 8 and cell["min_query_len_without_graphs"] == 32
    assert cell["measured_ms"]["8"] == {"flash_attn4": 1.0, "triton": 2.0}
    assert cell["measured_ms"]["32"] == {"flash_attn4": 1.0, "triton": 2.0}


def _row(seq_len: int, path: str, fwd_ms: float, mem_ratio: float = 1.1) -> dict[str, object]:
    return {"schedule": "longnet", "seq_len": seq_len, "head_dim": 64, "heads": 16,
            "kv_heads": 16, "causal": False, "path": path, "fwd_ms": fwd_ms,
            "fwd_mem_ratio": mem_ratio}  # fmt: skip


def test_times_are_the_median_over_runs_within_the_memory_bound() -> None:
    runs = [[_row(8, "flash_attn4", ms), _row(8, "triton", 2.0)] for ms in (1.0, 9.0, 3.0)]
    runs.append([_row(8, "flash_attn4", 0.5, mem_ratio=1.2)])  # over the bound: left out
    runs.append([{**_row(8, "triton", 0.1), "schedule": "paper"}])  # another schedule
    times = tune_dilated_choice.median_times([{"results": rows} for rows in runs], ("longnet",))
    assert times == {"mha/forward/d64/full": {8: {"flash_attn4": 3.0, "triton": 2.0}}}


def test_the_default_schedules_pool_their_runs() -> None:
    """By default the times are medians over the runs of both LongNet schedules (the fixed one
    and ``longnet_schedule(N)``), one median over all of them; other schedules are left out."""
    runs = [[_row(8, "flash_attn4", ms), _row(8, "triton", 2.0)] for ms in (1.0, 5.0)]
    runs.append([{**_row(8, "flash_attn4", 4.0), "schedule": "longnet_n"}])
    runs.append([{**_row(8, "flash_attn4", 0.1), "schedule": "paper"}])
    records = [{"results": rows} for rows in runs]
    assert tune_dilated_choice.SCHEDULES == ("longnet", "longnet_n")
    cells = tune_dilated_choice.derived_cells(records, [])  # the default schedules
    assert cells["mha/forward/d64/full"]["measured_ms"] == {
        "8": {"flash_attn4": 4.0, "triton": 2.0}
    }
    only = tune_dilated_choice.median_times(records, ("longnet",))
    assert only == {"mha/forward/d64/full": {8: {"flash_attn4": 3.0, "triton": 2.0}}}
    with pytest.raises(TypeError, match="collection of names"):
        tune_dilated_choice.median_times(records, "longnet")


@pytest.mark.parametrize(
    ("fa4_ratio", "fused_ratio", "kept"),
    [(1.2, 1.19, True), (1.2, 1.1, False), (1.3, 1.2, False), (1.14, 1.0, True)],
)
def test_fa4_may_take_what_the_fused_kernels_take(
    fa4_ratio: float, fused_ratio: float, kept: bool
) -> None:
    """Past the memory bound, FlashAttention-4 stays a candidate where the fused kernels in the
    same record took as much (within MEMORY_SLACK); the fused kernels always are."""
    rows = [_row(8, "flash_attn4", 1.0, fa4_ratio), _row(8, "triton", 2.0, fused_ratio)]
    times = tune_dilated_choice.median_times([{"results": rows}], ("longnet",))
    expected = {"triton": 2.0, **({"flash_attn4": 1.0} if kept else {})}
    assert times == {"mha/forward/d64/full": {8: expected}}


def test_thresholds_take_the_shortest_length_faster_from_there_on() -> None:
    """FlashAttention-4 must be MIN_GAIN times faster at the threshold and at every longer
    measured length."""
    tie = 2.0 / tune_dilated_choice.MIN_GAIN * 1.001  # faster, but by less than MIN_GAIN
    times = {
        "mha/training/d64/full": {
            1: {"flash_attn4": 2.0, "triton": 1.0},
            2: {"flash_attn4": 1.0, "triton": 2.0},  # faster here, but not at 3
            3: {"flash_attn4": 3.0, "triton": 2.0},
            4: {"flash_attn4": 1.0, "triton": 2.0},
            5: {"flash_attn4": 1.0, "triton": 2.0},
        },
        "mha/forward/d64/full": {
            1: {"flash_attn4": 1.0, "triton": 2.0},
            2: {"flash_attn4": 2.0, "triton": 1.0},
        },
        "gqa/forward/d64/full": {1: {"flash_attn4": 1.0}, 2: {"flash_attn4": 1.0, "triton": 2.0}},
        "gqa/training/d64/full": {
            1: {"flash_attn4": 1.0, "triton": 2.0},
            2: {"flash_attn4": tie, "triton": 2.0},
        },
    }
    cells = tune_dilated_choice.thresholds(times)
    assert cells["mha/training/d64/full"]["min_query_len"] == 4
    assert cells["mha/forward/d64/full"]["min_query_len"] is None
    assert cells["gqa/forward/d64/full"]["min_query_len"] == 2  # length 1 lacks a triton time
    assert cells["gqa/training/d64/full"]["min_query_len"] is None  # a near tie at the longest
