"""The quality benchmark's record (``bench_quality.py``): each finished run's result file, the
record merged from them and from the rows already in it, its Markdown table and its plots.

A run's result is ``<run dir>/result.json``: ``{"environment": ..., "row": ..., "losses": ...}``
(``losses``: the language-model loss of every step). The record is
``benchmarks/results/quality_<device>.json`` (``_timing.write_record``): one row per (method,
seed, context), the latest run of each; its environment is the latest run's, with the commands
(a list) and commits of all its rows.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from _records import check_record, markdown_table
from _timing import environment, record_header, write_record

#: The record's main table (``benchmarks/results/README.md``).
COLUMNS = ["method", "seed", "context", "steps", "bpb", "bpb_far", "retrieval_accuracy",
           "retrieval_far", "retrieval_value_accuracy", "copy_bpb", "copy_bpb_far",
           "copy_source_bpb", "tokens_per_s", "tflops",
           "peak_memory_gib", "train_seconds", "wall_seconds"]  # fmt: skip
#: What every row carries (``tests/e2e/test_bench_quality.py`` holds the rows to it).
REQUIRED = ("method", "seed", "context", "steps", "bpb", "bpb_by_position", "retrieval_accuracy",
            "retrieval_value_accuracy", "retrieval_by_distance", "copy_bpb", "copy_source_bpb",
            "copy_by_distance", "wall_seconds", "train_seconds",
            "peak_memory_gib", "tokens_per_s", "tflops", "loss_first", "loss_last", "settings",
            "commit", "date", "command")  # fmt: skip
#: The by-method table's columns: the mean over seeds, min-max in brackets.
SUMMARY = ["bpb", "bpb_far", "retrieval_accuracy", "retrieval_far", "retrieval_value_accuracy",
           "copy_bpb", "copy_bpb_far", "copy_source_bpb",
           "tokens_per_s", "tflops", "peak_memory_gib", "train_seconds"]  # fmt: skip
#: The tables by bucket: (title, row field, entry of a bucket or None for the value itself).
BUCKETS = [
    ("Bits per byte by position", "bpb_by_position", None),
    ("Retrieval accuracy (exact match) by distance", "retrieval_by_distance", "accuracy"),
    ("Retrieval values right by distance", "retrieval_by_distance", "value_accuracy"),
    ("Bits per byte on repeated passages by distance", "copy_by_distance", "bpb"),
]


def key(row: dict[str, Any]) -> tuple[str, int, int]:
    return (row["method"], row["seed"], row["context"])


def write_result(
    directory: Path, row: dict[str, Any], commands: list[str], losses: list[float]
) -> Path:
    """A finished run's result file; ``row`` gains its commit, date and first command."""
    env = environment()
    row.update(commit=env["commit"], date=env["date"], command=commands[0])
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "result.json"
    payload = {"environment": {**env, "command": commands[0]}, "row": row, "losses": losses}
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return path


def collect(
    record: Path, run_dir: Path, order: list[str] | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str | None]:
    """The rows of the record at ``record`` (if any) and of the results under ``run_dir``, the
    latest of each (method, seed, context), by context, seed and method (in ``order``, then by
    name); their environments; the record's notes."""
    rows: dict[tuple, dict[str, Any]] = {}
    envs, notes = [], None
    sources = []
    if record.exists():
        old = json.loads(record.read_text())
        envs.append(old["environment"])
        notes = old.get("notes")
        sources += old["results"]
    for path in sorted(run_dir.rglob("result.json")) if run_dir.exists() else []:
        result = json.loads(path.read_text())
        envs.append(result["environment"])
        sources.append(result["row"])
    for row in sources:
        if key(row) not in rows or row["date"] >= rows[key(row)]["date"]:
            rows[key(row)] = row
    rank = {name: i for i, name in enumerate(order or [])}

    def position(row: dict[str, Any]) -> tuple:
        return (row["context"], row["seed"], rank.get(row["method"], len(rank)), row["method"])

    ordered = sorted(rows.values(), key=position)
    return ordered, envs, notes


def finished(rows: list[dict[str, Any]], settings: dict[str, Any]) -> set[tuple]:
    """The (method, seed, context) of the rows measured with ``settings``."""
    return {key(r) for r in rows if r.get("settings") == settings}


def _environment(rows: list[dict[str, Any]], envs: list[dict[str, Any]]) -> dict[str, Any]:
    """The latest environment, with every row's command and commit."""
    labels = sorted({e["device_label"] for e in envs})
    if len(labels) > 1:
        raise ValueError(
            f"the runs to merge come from several devices {labels}; a record holds one device: "
            f"pass --out and --run-dir of one device's runs"
        )
    env = dict(max(envs, key=lambda e: e["date"]))
    env["command"] = list(dict.fromkeys(r["command"] for r in rows))
    env["commit"] = ", ".join(dict.fromkeys(r["commit"] for r in rows))
    env["date"] = max(r["date"] for r in rows)
    return env


def merge(
    record: Path,
    run_dir: Path,
    notes: str | None = None,
    *,
    plots: bool = True,
    order: list[str] | None = None,
) -> dict[str, Any] | None:
    """Write the merged record (``record``, a ``.json`` path), its table and (``plots``) its
    plots, methods in ``order``; None when there is nothing to merge."""
    rows, envs, old_notes = collect(record, run_dir, order)
    if not rows:
        return None
    env = _environment(rows, envs)
    write_record(record, env, rows, columns=COLUMNS, notes=notes or old_notes)
    written = json.loads(record.read_text())
    problems = check_record(record, written)
    if problems:
        raise ValueError(f"{record} is incomplete: {problems}")
    stem = record.with_suffix("")
    stem.with_suffix(".md").write_text(markdown(written) + "\n")
    if plots:
        plot(written, stem)
    return written


def _spread(values: list[float | None]) -> tuple[float, float, float] | None:
    """(mean, min, max) of the values that are there, or None."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    return statistics.fmean(present), min(present), max(present)


def _cell(values: list[float | None], digits: int = 3) -> str:
    spread = _spread(values)
    if spread is None:
        return "-"
    mean, lo, hi = spread
    if len([v for v in values if v is not None]) == 1:
        return f"{mean:.{digits}g}"
    return f"{mean:.{digits}g} ({lo:.{digits}g}-{hi:.{digits}g})"


def _groups(rows: list[dict[str, Any]]) -> dict[tuple[int, str], list[dict[str, Any]]]:
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["context"], row["method"]), []).append(row)
    return groups


def markdown(record: dict[str, Any]) -> str:
    """The record as Markdown: by method (mean over seeds, min-max in brackets), bits per byte
    by position, retrieval accuracy by distance, then every run."""
    rows, lines = record["results"], [record_header(record["environment"])]
    if record.get("notes"):
        lines += [record["notes"], ""]
    lines += [
        "| context | method | seeds | " + " | ".join(SUMMARY) + " |",
        "|" + "---|" * (len(SUMMARY) + 3),
    ]
    for (context, method), group in _groups(rows).items():
        cells = [_cell([r.get(c) for r in group]) for c in SUMMARY]
        lines.append(f"| {context} | {method} | {len(group)} | " + " | ".join(cells) + " |")
    for title, field, inner in BUCKETS:
        for context in sorted({r["context"] for r in rows}):
            some = next(r for r in rows if r["context"] == context)
            buckets = list(some[field])
            lines += [
                "",
                f"{title}, context {context} (mean over seeds, min-max):",
                "",
                "| method | " + " | ".join(buckets) + " |",
                "|" + "---|" * (len(buckets) + 1),
            ]
            for (ctx, method), group in _groups(rows).items():
                if ctx != context:
                    continue
                values = [
                    [r[field][b] if inner is None else r[field][b][inner] for r in group]
                    for b in buckets
                ]
                lines.append(f"| {method} | " + " | ".join(_cell(v) for v in values) + " |")
    lines += ["", "Every run:", "", markdown_table(rows, COLUMNS)]
    return "\n".join(lines)


def plot(record: dict[str, Any], stem: Path) -> list[Path]:
    """``<stem>_bpb_by_position.png``, ``<stem>_retrieval.png`` and ``<stem>_copy.png``: one
    line per method (the mean over seeds, bars from the lowest to the highest seed), one panel
    per context."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots")
        return []
    rows, written = record["results"], []
    contexts = sorted({r["context"] for r in rows})
    for suffix, field, inner, ylabel in (
        ("bpb_by_position", "bpb_by_position", None, "held-out bits per byte"),
        ("retrieval", "retrieval_by_distance", "accuracy", "retrieval accuracy (exact match)"),
        ("copy", "copy_by_distance", "bpb", "bits per byte on a repeated passage"),
    ):
        fig, axes = plt.subplots(
            1, len(contexts), figsize=(6.5 * len(contexts), 4.2), squeeze=False
        )
        for ax, context in zip(axes[0], contexts, strict=True):
            for (ctx, method), group in _groups(rows).items():
                if ctx != context:
                    continue
                buckets = list(group[0][field])
                points = [
                    (
                        i,
                        _spread(
                            [r[field][b] if inner is None else r[field][b][inner] for r in group]
                        ),
                    )
                    for i, b in enumerate(buckets)
                ]
                points = [(i, s) for i, s in points if s is not None]
                xs = [i for i, _ in points]
                mean = [s[0] for _, s in points]
                err = [[s[0] - s[1] for _, s in points], [s[2] - s[0] for _, s in points]]
                ax.errorbar(xs, mean, yerr=err, marker="o", capsize=3, label=method)
                ax.set_xticks(range(len(buckets)), buckets, rotation=30)
            x_label = "position in the context" if inner is None else "distance (tokens)"
            ax.set(xlabel=x_label, ylabel=ylabel, title=f"context {context}")
            if inner == "accuracy":
                ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(f"{record['environment'].get('device', '')}: mean over seeds, bars min-max")
        fig.tight_layout()
        path = Path(f"{stem}_{suffix}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written
