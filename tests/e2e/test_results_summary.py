"""Benchmark records and their generated summary (CPU only, no GPU, no torch in the generator).

``benchmarks/results/README.md`` is written by ``benchmarks/summarize_results.py`` from the JSON
records beside it: these tests regenerate it into a temporary directory and require the committed
file to be identical (so the two cannot drift), and require every record to carry the fields a
reader needs (device, torch and package versions, commit, date, command).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO

ROOT = REPO
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
sys.path.insert(0, str(BENCHMARKS))

import _records  # noqa: E402
import summarize_results  # noqa: E402

RECORDS = sorted(RESULTS.glob("*.json"))


def _generate(out: Path) -> str:
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "summarize_results.py"), "--out", str(out)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out.read_text()


def test_committed_summary_is_what_the_generator_writes(tmp_path: Path) -> None:
    generated = _generate(tmp_path / "README.md")
    committed = (RESULTS / "README.md").read_text()
    assert generated == committed, (
        "benchmarks/results/README.md is stale: run python benchmarks/summarize_results.py"
    )


def test_generator_is_idempotent(tmp_path: Path) -> None:
    first = _generate(tmp_path / "a.md")
    second = _generate(tmp_path / "b.md")
    assert first == second
    assert first == summarize_results.render(RESULTS)


def test_check_mode_accepts_the_committed_summary() -> None:
    assert summarize_results.main(["--check"]) == 0


@pytest.mark.parametrize("path", RECORDS, ids=[p.stem for p in RECORDS])
def test_every_record_carries_the_required_fields(path: Path) -> None:
    record = json.loads(path.read_text())
    assert _records.check_record(path, record) == []
    env = record["environment"]
    for key in _records.REQUIRED_ENVIRONMENT:
        assert env[key], f"{path.name}: environment.{key} is empty"
    assert env["packages"]["triton"], f"{path.name}: no triton version (or 'unknown')"


def test_every_record_has_a_section_and_every_file_a_record() -> None:
    text = (RESULTS / "README.md").read_text()
    for path in RECORDS:
        assert f"\n## {path.stem}\n" in text, path.name
    stems = {p.stem for p in RECORDS}
    for path in RESULTS.iterdir():
        if path.name != "README.md":  # a record's own files, or its plots: <record>_<plot>
            owner = any(path.stem == s or path.stem.startswith(f"{s}_") for s in stems)
            assert owner, f"{path.name} has no JSON record beside it"


def test_check_record_reports_what_is_missing(tmp_path: Path) -> None:
    path = tmp_path / "dilated_h100.json"
    record = {"environment": {"device": "NVIDIA H100 80GB HBM3", "device_label": "h200x2"},
              "results": []}  # fmt: skip
    problems = _records.check_record(path, record)
    assert any("environment.commit" in p for p in problems)
    assert any("environment.command" in p for p in problems)
    assert any("packages" in p for p in problems)
    assert any("device_label" in p for p in problems)
    assert any("results" in p for p in problems)
    assert _records.check_record(tmp_path / "dilated.json", record)[0].startswith("name is not")


@pytest.mark.parametrize(
    ("name", "count", "label"),
    [
        ("NVIDIA H100 80GB HBM3", 1, "h100"),
        ("NVIDIA H200", 2, "h200x2"),
        ("NVIDIA H200", 4, "h200x4"),
        ("NVIDIA A100-SXM4-80GB", 8, "a100x8"),
        ("NVIDIA GeForce RTX 4090", 1, "rtx4090"),
    ],
)
def test_device_label(name: str, count: int, label: str) -> None:
    assert _records.device_label(name, count) == label
    assert _records.split_name(f"ring_dilated_{label}") == ("ring_dilated", label)


def _run(world: int, group: str, commit: str, fwd: float) -> tuple[dict, list[dict]]:
    env = {"device": "NVIDIA H200", "device_label": "h200x2", "torch": "2", "commit": commit,
           "packages": {"triton": "3"}, "date": f"2026-01-0{world}", "world_size": world,
           "process_group": group, "command": f"torchrun --nproc_per_node={world} x"}  # fmt: skip
    rows = [{"kind": "dilated", "impl": "ours (ring dilated)", "world": world,
             "seq_len": 1024 * world, "causal": False, "fwd_tflops_per_gpu": fwd,
             "fwd_bwd_tflops_per_gpu": fwd}]  # fmt: skip
    return env, rows


def test_ring_runs_fold_into_one_record_per_commit() -> None:
    record = _records.fold_run(None, *_run(2, "nccl", "abc", 90.0))
    record = _records.fold_run(record, *_run(1, "nccl", "abc", 100.0))
    record = _records.fold_run(record, *_run(2, "nccl", "abc", 80.0))  # replaces the first W = 2
    assert [r["world_size"] for r in record["runs"]] == [1, 2]
    assert [r["fwd_tflops_per_gpu"] for r in record["results"]] == [100.0, 80.0]
    assert len(record["environment"]["command"]) == 2
    assert _records.check_record(Path("ring_dilated_h200x2.json"), record) == []
    table = _records.scaling_table(record["results"])
    assert "| 2 | 80 (80%) | 80 (80%) |" in table
    fresh = _records.fold_run(record, *_run(1, "nccl", "def", 50.0))  # another commit: afresh
    assert [r["world"] for r in fresh["results"]] == [1]


def test_bench_ring_summarize_reads_the_folded_records() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_ring.py"), "--summarize",
         str(RESULTS / "ring_h200x4.json")],
        capture_output=True, text=True, timeout=300, check=False, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| dense | ours (ring) | 131072 | False | 4 | 569 (92%) | 521 (92%) |" in proc.stdout
