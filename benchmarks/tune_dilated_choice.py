"""The automatic choice between FlashAttention-4 slots and the fused Triton kernels, from records.

    python benchmarks/tune_dilated_choice.py           # print the table the records give
    python benchmarks/tune_dilated_choice.py --write   # -> backends/slots_thresholds.json

Reads ``bench_dilated.py`` records under ``benchmarks/results/`` (:data:`RECORDS`): one run
at 64K, 256K and 1M (``dilated_h100``) and four near the thresholds (``dilated_threshold_h100``
at 128K and 512K, three ``dilated_tuning<i>_h100`` at 128K, 256K and 512K), each a separate
process, written by

    python benchmarks/bench_dilated.py --schedules longnet --seq-lens 65536 262144 1048576 \\
        --paths auto triton flash_attn4 'cudnn ceiling' 'fa4 ceiling'
    python benchmarks/bench_dilated.py --schedules longnet --seq-lens 131072 524288 \\
        --paths triton flash_attn4 --out benchmarks/results/dilated_threshold_h100
    python benchmarks/bench_dilated.py --schedules longnet --seq-lens 131072 262144 524288 \\
        --paths triton flash_attn4 --out benchmarks/results/dilated_tuning1_h100   # 2, 3

and the same with ``--kv-heads 4`` to the ``_gqa`` names (``dilated_tuning_gqa1_h100``), with two
more GQA runs at 1M (``dilated_tuning_1m_gqa<i>_h100``), where one cell's runs disagreed. These
were measured before FlashAttention-4's slotted calls replayed from CUDA graphs (Note [A slotted
call's launches from a CUDA graph] in ``core/execution/executor.py``); the records of
:data:`REPLAYED_RECORDS` were measured with them, at 4K-256K, where the host decided:

    python benchmarks/bench_dilated.py --schedules longnet --seq-lens 16384 32768 65536 \\
        --kv-heads 16 --paths triton flash_attn4 --warmup 3 --repeats 10 --min-ms 30 \\
        --out benchmarks/results/dilated_tuning_short_h100

and the same with ``--kv-heads 4`` to ``dilated_tuning_short_gqa_h100``, then both again with
``--seq-lens 131072`` to ``dilated_tuning_128k_h100`` and ``dilated_tuning_128k_gqa_h100``, and with
``--seq-lens 262144 --kv-heads 16`` to ``dilated_tuning_256k_h100`` (``--kv-heads 4 --warmup 2
--repeats 5`` to ``dilated_tuning_256k_gqa_h100``), and ``--schedules longnet longnet_n --seq-lens
8192 --kv-heads 16 --paths triton flash_attn4 'dense cudnn'`` to ``dilated_tuning_8k_h100``, and the
same at ``--seq-lens 4096 --rounds 2`` to ``dilated_tuning_4k_h100``; three GQA runs after the key
slots took the query slots' layout (``--seq-lens 16384 65536 131072 262144 --kv-heads 4 --warmup 2
--repeats 5`` to ``dilated_tuning_gqa_keyslots<i>_h100``); and on an H200 (the same sm90 device
class), three GQA runs at 4K and 8K, where no H100 record measured shared key/value heads
(``--schedules longnet longnet_n --seq-lens 4096 8192 --head-dims 128 --kv-heads 4 --causal both
--paths triton flash_attn4 'dense cudnn' --warmup 3 --repeats 10 --min-ms 30`` to
``dilated_tuning_short_gqa<i>_h200``), and three more without GQA after a fused call's plan was
kept per request (``--head-dims 128 64 --kv-heads 16``, otherwise the same, to
``dilated_tuning_short_mha<i>_h200``). Where they measured a cell at
a length, their times replace the older records' (whose FlashAttention-4 times include the host time
a replay removes); the older records alone give each cell's ``min_query_len_without_graphs``, the
threshold used where the graphs are turned off. For every cell (shared key/value heads or not,
forward only or forward+backward, head dim, causal or not) and every measured length it takes each
path's median time over the runs of its ``flash_attn4`` and ``triton`` rows of both LongNet
schedules (:data:`SCHEDULES`: at 4K-8K their branch counts differ and either may favour a
path), leaving out FlashAttention-4 runs whose peak memory passed both
:data:`MAX_MEMORY_RATIO` of the unavoidable bytes and the fused kernels' peak in the same record
(:data:`MEMORY_SLACK`): a median, as
FlashAttention-4's times near the thresholds move by up to 2x from one process to the next
(host-bound: its Python interface), while the fused kernels' move by a few percent. The cell's
threshold is the shortest measured length from which FlashAttention-4 was :data:`MIN_GAIN` times
faster at that length and at every longer one (``null`` where it was not at the longest): a near tie
goes to the fused kernels, whose times are steadier and whose peak memory is lower. ``--write``
stores the table with the records' names and the medians it was read from (Note [The measured slots
table] in ``dilated_attention/backends/slots_thresholds.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Collection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _records import RESULTS_DIR, markdown_table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from dilated_attention.backends.slots_thresholds import TABLE_FILE, cell_key  # noqa: E402

RECORDS = (
    *(f"dilated{kind}_h100" for kind in ("", "_gqa")),
    *(f"dilated_threshold{kind}_h100" for kind in ("", "_gqa")),
    *(f"dilated_tuning{kind}{run}_h100" for kind in ("", "_gqa") for run in (1, 2, 3)),
    "dilated_tuning_1m_gqa1_h100",
    "dilated_tuning_1m_gqa2_h100",
)
#: Records measured with FlashAttention-4's slotted calls replayed from CUDA graphs.
REPLAYED_RECORDS = (
    "dilated_tuning_short_h100", "dilated_tuning_short_gqa_h100",
    "dilated_tuning_128k_h100", "dilated_tuning_128k_gqa_h100", "dilated_tuning_256k_h100",
    "dilated_tuning_8k_h100", "dilated_tuning_256k_gqa_h100", "dilated_tuning_4k_h100",
    "dilated_tuning_gqa_keyslots1_h100", "dilated_tuning_gqa_keyslots2_h100",
    "dilated_tuning_gqa_keyslots3_h100",
    *(f"dilated_tuning_short_gqa{run}_h200" for run in (1, 2, 3)),
    *(f"dilated_tuning_short_mha{run}_h200" for run in (1, 2, 3)),
)  # fmt: skip
#: The schedules whose rows give the times: the fixed LongNet schedule of the older records,
#: and ``longnet_schedule(N)``, what users get at each length, which at 4K-8K has fewer
#: branches and there moves the choice (the short runs measure both).
SCHEDULES = ("longnet", "longnet_n")
PATHS = ("flash_attn4", "triton")
STEPS = (("forward", "fwd"), ("training", "fwd_bwd"))
#: FlashAttention-4 is not a candidate where its peak memory passed this share of the
#: unavoidable bytes and, by more than MEMORY_SLACK, the fused kernels' peak in the same record
#: (with gradients at 8K-32K tokens the fused kernels' own scratch passes the share: they are
#: the fallback, always a candidate, and a path whose peak is no higher than theirs allocates
#: no more; the records' peaks count allocated bytes, not the pool FA4's CUDA graphs keep
#: reserved, Note [Graphs share one memory pool per stream]).
MAX_MEMORY_RATIO = 1.15
MEMORY_SLACK = 1.02
#: FlashAttention-4 is chosen where its median time is at most 1/MIN_GAIN of the fused kernels'.
MIN_GAIN = 1.03

#: {cell: {length: {path: median ms}}}
Times = dict[str, dict[int, dict[str, float]]]


def median_times(records: list[dict[str, Any]], schedules: Collection[str]) -> Times:
    """Each path's median time per cell and length over the records' rows of ``schedules`` (a
    collection of names; a single name is refused, whose ``in`` would match its substrings)."""
    if isinstance(schedules, str):
        raise TypeError(f"schedules must be a collection of names, got the string {schedules!r}")
    runs: dict[str, dict[int, dict[str, list[float]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list))
    )
    for record in records:
        fused = _fused_peaks(record)
        for row in record["results"]:
            path = row["path"]
            if row.get("schedule") not in schedules or path not in PATHS or "error" in row:
                continue
            for direction, step in STEPS:
                column = f"{step}_ms"
                bound = max(MAX_MEMORY_RATIO, fused.get(_at(row, step), 0.0) * MEMORY_SLACK)
                if column not in row or (
                    path != "triton" and row.get(f"{step}_mem_ratio", 0.0) > bound
                ):
                    continue
                shared = row["kv_heads"] < row["heads"]
                key = cell_key(shared, direction == "training", row["head_dim"], row["causal"])
                runs[key][row["seq_len"]][path].append(row[column])
    return {
        key: {
            n: {path: statistics.median(ms) for path, ms in at.items()} for n, at in lengths.items()
        }
        for key, lengths in runs.items()
    }


def _at(row: dict[str, Any], step: str) -> tuple[object, ...]:
    """A row's measured cell and length, for one step."""
    return (row.get("schedule"), row["heads"], row["kv_heads"], row["head_dim"], row["causal"],
            row["seq_len"], step)  # fmt: skip


def _fused_peaks(record: dict[str, Any]) -> dict[tuple[object, ...], float]:
    """The fused kernels' (``triton`` rows') peak memory ratio per cell, length and step of one
    record."""
    peaks: dict[tuple[object, ...], float] = {}
    for row in record["results"]:
        if row["path"] != "triton" or "error" in row:
            continue
        for _, step in STEPS:
            ratio = row.get(f"{step}_mem_ratio")
            if ratio is not None:
                at = _at(row, step)
                peaks[at] = max(peaks.get(at, 0.0), ratio)
    return peaks


def thresholds(times: Times) -> dict[str, dict[str, Any]]:
    """Per cell: the shortest length from which FlashAttention-4 was :data:`MIN_GAIN` times
    faster at every measured length on (None: not at the longest), with the times it was read
    from."""
    cells = {}
    for key in sorted(times):
        measured = {n: t for n, t in sorted(times[key].items()) if set(PATHS) <= t.keys()}
        least = None
        for n in sorted(measured, reverse=True):
            if measured[n]["flash_attn4"] * MIN_GAIN > measured[n]["triton"]:
                break
            least = n
        times_ms = {str(n): {p: round(t[p], 3) for p in PATHS} for n, t in measured.items()}
        cells[key] = {"min_query_len": least, "measured_ms": times_ms}
    return cells


def overlaid(older: Times, newer: Times) -> Times:
    """``older``'s times with each (cell, length) that ``newer`` measured taken from ``newer``."""
    cells = {key: dict(lengths) for key, lengths in older.items()}
    for key, lengths in newer.items():
        cells.setdefault(key, {}).update(lengths)
    return cells


def derived_cells(eager: list[dict[str, Any]], replayed: list[dict[str, Any]],
                  schedules: Collection[str] = SCHEDULES) -> dict[str, dict[str, Any]]:  # fmt: skip
    """The table's cells: :func:`thresholds` of the ``replayed`` records' times over the
    ``eager`` ones' (:func:`overlaid`), each with ``min_query_len_without_graphs``, the
    threshold of the ``eager`` records alone."""
    older = median_times(eager, schedules)
    cells = thresholds(overlaid(older, median_times(replayed, schedules)))
    without = thresholds(older)
    for key, cell in cells.items():
        cell["min_query_len_without_graphs"] = without.get(key, {}).get("min_query_len")
    return cells


def _load(names: list[str]) -> list[dict[str, Any]]:
    return [json.loads((RESULTS_DIR / f"{name}.json").read_text()) for name in names]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--records", nargs="+", default=list(RECORDS))
    parser.add_argument("--replayed-records", nargs="*", default=list(REPLAYED_RECORDS))
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    parser.add_argument("--major", type=int, default=9, help="the records' compute capability")
    parser.add_argument("--write", action="store_true", help=f"store the table in {TABLE_FILE}")
    args = parser.parse_args()
    cells = derived_cells(_load(args.records), _load(args.replayed_records), args.schedules)
    rows = [{"cell": key, "min_query_len": c["min_query_len"],
             "without graphs": c["min_query_len_without_graphs"],
             **{f"{n}: fa4 / triton ms": f"{t['flash_attn4']} / {t['triton']}"
                for n, t in c["measured_ms"].items()}}
            for key, c in cells.items()]  # fmt: skip
    columns = list(dict.fromkeys(col for row in rows for col in row))
    print(markdown_table(rows, columns))
    if not args.write:
        return
    path = ROOT / "dilated_attention" / "backends" / TABLE_FILE
    old = json.loads(path.read_text()) if path.exists() else {}
    about = (
        "Per device class (compute capability major) and cell, the shortest measured length "
        "from which FlashAttention-4 writing into branch slots ran faster than our fused Triton "
        "kernels at that length and every longer one measured (null: at none): min_query_len "
        "with its calls replayed from CUDA graphs (the records in replayed_sources, over those "
        "in sources where they measured a length), min_query_len_without_graphs from the "
        "records in sources alone; each time the median over the rows of the schedules "
        "named under schedules. Written by benchmarks/tune_dilated_choice.py --write; not "
        "edited by hand (Note [The measured slots table] in slots_thresholds.py)."
    )
    table = {"about": about, "majors": old.get("majors", {}), "sources": old.get("sources", {}),
             "replayed_sources": old.get("replayed_sources", {}),
             "schedules": old.get("schedules", {})}  # fmt: skip
    table["majors"][str(args.major)] = cells
    table["schedules"][str(args.major)] = list(args.schedules)
    table["sources"][str(args.major)] = [f"{name}.json" for name in args.records]
    table["replayed_sources"][str(args.major)] = [f"{n}.json" for n in args.replayed_records]
    path.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
