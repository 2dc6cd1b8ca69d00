"""Benchmark records: names, required fields, Markdown tables, the ring scaling table.

A record is ``benchmarks/results/<benchmark>_<device>.json``: ``{"environment": {...}, "results":
[...]}`` plus optional ``notes`` (text), ``columns`` (the columns of its main table) and, for the
ring benchmarks, ``runs`` (one entry per world size folded into the record). ``<device>`` names the
host: ``h100`` (one H100), ``h200x2`` (a host with 2 H200s), ``h200x4`` (4 H200s), ...; a record
holds the latest run of its benchmark on that device only (older runs stay in git history).
``findings_<device>.json`` holds measured facts from one-off runs (topic, what was measured,
device, commit, command or script, numbers) that code comments and the README rely on.

Nothing here imports torch, so ``summarize_results.py`` and its test run anywhere.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"

#: Fields every record's ``environment`` carries (``"unknown"`` where a value could not be
#: established). ``command`` is a string, or a list of strings for records folded from several
#: runs (one per world size).
REQUIRED_ENVIRONMENT = ("device", "device_label", "torch", "packages", "commit", "date", "command")
#: Fields of every finding in a ``findings_<device>.json`` record.
FINDING_FIELDS = ("topic", "measured", "device", "commit", "command", "numbers")
#: Packages whose versions a record's ``environment["packages"]`` always names.
REQUIRED_PACKAGES = ("triton",)

_LABEL = re.compile(r"^[a-z]+[0-9]+[a-z0-9]*(x[0-9]+)?$|^cpu$")


def device_label(name: str, count: int = 1) -> str:
    """Short device name for record files: the GPU model, lowercased, with ``x<count>`` when the
    host has more than one (``"NVIDIA H100 80GB HBM3", 1 -> "h100"``, ``"NVIDIA H200", 4 ->
    "h200x4"``). Labels records only; kernels are never chosen by it."""
    tokens = [t for t in re.split(r"[^A-Za-z0-9]+", name) if t]
    model = ""
    for i, token in enumerate(tokens):
        if any(c.isdigit() for c in token):
            model = token
            if token.isdigit() and i > 0 and tokens[i - 1].isalpha():  # "RTX 4090" -> rtx4090
                model = tokens[i - 1] + token
            break
    label = (model or "".join(tokens) or "cpu").lower()
    return f"{label}x{count}" if count > 1 else label


def split_name(stem: str) -> tuple[str, str]:
    """``"ring_dilated_h200x2"`` -> ``("ring_dilated", "h200x2")``: benchmark and device."""
    benchmark, _, device = stem.rpartition("_")
    return benchmark, device


def check_record(path: Path, record: Any) -> list[str]:
    """What a record file lacks (empty when it is complete): its name must be
    ``<benchmark>_<device>.json`` with the device in ``environment["device_label"]``, its
    environment must carry ``REQUIRED_ENVIRONMENT`` and its findings ``FINDING_FIELDS``."""
    problems: list[str] = []
    benchmark, device = split_name(path.stem)
    if not benchmark or not _LABEL.match(device):
        problems.append(f"name is not <benchmark>_<device>: {path.name}")
    if not isinstance(record, dict) or not isinstance(record.get("environment"), dict):
        return [*problems, "no environment"]
    env = record["environment"]
    for key in REQUIRED_ENVIRONMENT:
        value = env.get(key)
        if key == "packages":
            if not isinstance(value, dict) or any(p not in value for p in REQUIRED_PACKAGES):
                problems.append(f"environment.packages must name {REQUIRED_PACKAGES}")
        elif key == "command" and isinstance(value, list):
            if not value or not all(isinstance(c, str) and c for c in value):
                problems.append("environment.command: empty list or non-string entry")
        elif not isinstance(value, str) or not value:
            problems.append(f"environment.{key} missing or empty")
    if env.get("device_label") != device:
        problems.append(f"environment.device_label {env.get('device_label')!r} != {device!r}")
    results = record.get("results")
    if not isinstance(results, list) or not results:
        problems.append("results must be a non-empty list")
    elif benchmark == "findings":
        for i, finding in enumerate(results):
            missing = [f for f in FINDING_FIELDS if not finding.get(f)]
            if missing:
                problems.append(f"finding {i} lacks {missing}")
    return problems


def load_records(results_dir: Path = RESULTS_DIR) -> dict[Path, dict[str, Any]]:
    """Every ``*.json`` record under ``results_dir``, by path, in name order."""
    return {p: json.loads(p.read_text()) for p in sorted(results_dir.glob("*.json"))}


def cell(value: object) -> str:
    """A table cell: floats to 3 significant digits (whole numbers from 1000 up)."""
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    if isinstance(value, (list, tuple)):
        return "x".join(map(str, value))
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A Markdown table of ``rows`` restricted to ``columns``."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def scalar_columns(rows: list[dict[str, Any]]) -> list[str]:
    """The keys of ``rows`` whose values are scalars, in first-seen order."""
    columns: list[str] = []
    for row in rows:
        for key, value in row.items():
            if key not in columns and not isinstance(value, (dict, list)):
                columns.append(key)
    return columns


def scaling_table(rows: list[dict[str, Any]]) -> str:
    """Per-GPU efficiency of ring rows (``bench_ring.py``): each row's per-GPU TFLOP/s over the
    same implementation's at world 1 (tokens per GPU for the dilated weak-scaling rows, the whole
    sequence for the dense strong-scaling rows), from the same process group kind where the record
    has it, else from the NCCL group's."""
    rows = [dict(r) for r in rows]
    for row in rows:
        if row["kind"] == "dilated":
            row["seq_len"] //= row["world"]  # weak scaling: keyed by tokens per GPU
        row.setdefault("process_group", "nccl")

    def ref(row: dict[str, Any], group: str) -> tuple:
        return (row["kind"], row["impl"], row["seq_len"], row["causal"], group)

    ones = {ref(r, r["process_group"]): r for r in rows if r["world"] == 1}
    header = "| kind | impl | tokens (per GPU if dilated) | causal | world | fwd TFLOP/s per GPU "
    header += "(efficiency) | fwd+bwd TFLOP/s per GPU (efficiency) |"
    lines = [header, "|---|---|---|---|---|---|---|"]
    for r in rows:
        group = r["process_group"]
        r["label"] = r["impl"] if group == "nccl" else f"{r['impl']}, {group} group"
    order = ("kind", "label", "seq_len", "causal")
    for r in sorted(rows, key=lambda r: (*(str(r[k]) for k in order), r["world"])):
        one = ones.get(ref(r, r["process_group"])) or ones.get(ref(r, "nccl"), {})
        cells = []
        for step in ("fwd", "fwd_bwd"):
            value = r.get(f"{step}_tflops_per_gpu")
            base = one.get(f"{step}_tflops_per_gpu")
            eff = f" ({100 * value / base:.0f}%)" if value and base else ""
            cells.append("-" if value is None else f"{value:.0f}{eff}")
        lines.append(
            f"| {r['kind']} | {r['label']} | {r['seq_len']} | {r['causal']} | {r['world']} | "
            f"{cells[0]} | {cells[1]} |"
        )
    return "\n".join(lines)


def fold_run(
    existing: dict[str, Any] | None, env: dict[str, Any], rows: list[dict[str, Any]]
) -> dict[str, Any]:
    """A ring record with one more run (one world size, one process group) folded in.

    Runs of the same commit on the same device accumulate, and a new run of a world size and
    process group already there replaces it; a record of another commit or device is replaced
    whole, so a record never mixes commits.
    """
    world, group = env["world_size"], env["process_group"]
    run = {"world_size": world, "process_group": group, "date": env["date"],
           "command": env["command"]}  # fmt: skip
    rows = [{**r, "process_group": group} for r in rows]
    runs, kept = [run], []
    if existing is not None:
        old = existing.get("environment", {})
        if (old.get("commit"), old.get("device_label")) == (env["commit"], env["device_label"]):
            runs += [
                r for r in existing.get("runs", [])
                if (r["world_size"], r["process_group"]) != (world, group)
            ]  # fmt: skip
            kept = [
                r for r in existing.get("results", [])
                if (r["world"], r.get("process_group", "nccl")) != (world, group)
            ]  # fmt: skip
    runs.sort(key=lambda r: (r["world_size"], r["process_group"]))
    top = {k: v for k, v in env.items() if k not in ("world_size", "process_group")}
    top["date"] = max(r["date"] for r in runs)
    top["command"] = [r["command"] for r in runs]
    results = sorted(kept + rows, key=lambda r: (r["world"], r.get("process_group", "nccl")))
    record: dict[str, Any] = {"environment": top, "runs": runs}
    if existing is not None and kept and existing.get("notes"):
        record["notes"] = existing["notes"]
    record["results"] = results
    return record
