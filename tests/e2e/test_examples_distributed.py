"""The torchrun long-sequence example (2 gloo ranks) and the extreme-length memory test."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import REPO

from dilated_attention import extreme
from dilated_attention.extreme import find_max_seq_len, measure_peak_memory

pytestmark = pytest.mark.slow  # subprocesses and training runs: seconds each

ROOT = REPO


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


@pytest.mark.distributed
def test_torchrun_example_first_loss_equals_single_process_loss(tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(ROOT / "examples" / "torchrun_long_sequence.py"), "--device", "cpu",
        "--dtype", "float64", "--steps", "2", "--seq-len", "256", "--batch", "1",
        "--num-layers", "2", "--corpus-bytes", str(1 << 20),
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120, check=False
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    # seq 256 over 2 ranks: 128 tokens each, so the 256 branch (r=4) spans both ranks.
    assert "segments [64, 128, 256]" in proc.stdout, proc.stdout
    match = re.search(r"ring_loss=(\S+) single_process_loss=(\S+)", proc.stdout)
    assert match, proc.stdout
    ring, single = float(match.group(1)), float(match.group(2))
    assert ring == pytest.approx(single, rel=1e-12, abs=0), (ring, single)
    assert "first-step check: OK" in proc.stdout
    losses = [float(x) for x in re.findall(r"step \d+: loss (\S+)", proc.stdout)]
    assert len(losses) == 2, proc.stdout
    assert losses[0] == pytest.approx(ring, abs=1e-4)


_TINY = [
    "--heads", "2", "--head-dim", "16", "--first-segment", "128", "--start-len", "256",
    "--max-seq-len", "2048", "--bisect", "1",
]  # fmt: skip


def _check_record(path: Path, max_len: int) -> None:
    record = json.loads(path.read_text())
    assert {"date", "torch", "device", "commit", "config"} <= set(record["environment"])
    assert record["environment"]["config"]["heads"] == 2
    rows = record["results"]
    assert [r["mode"] for r in rows] == ["forward", "forward+backward"]
    for row in rows:
        assert {"max_seq_len", "peak_gib", "bytes_per_token", "stopped_by", "attempts"} <= set(row)
        assert row["attempts"], row
        assert 0 <= row["max_seq_len"] <= max_len
        if row["max_seq_len"]:
            assert row["peak_gib"] >= 0 and row["bytes_per_token"] >= 0


def test_search_summaries_when_nothing_fits_and_when_the_cap_stops_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With peaks of 1 KiB per token (a stand-in for the measurement, which on the CPU reads
    the process's resident set): a budget below the first length's peak gives length 0, no
    peak, stopped by the budget; a generous one is stopped by the cap at the longest length
    tried, with its peak per token; one in between (on the CPU a length whose peak the last one
    predicts over the budget is skipped) bisects to the longest length within it."""
    monkeypatch.setattr(extreme, "measure_peak_memory", lambda seq_len, mode, **_: seq_len * 1024)
    common = {"heads": 2, "head_dim": 8, "first_segment": 64, "is_causal": True,
              "device": torch.device("cpu"), "dtype": torch.float32, "start_len": 128,
              "max_seq_len": 1024, "bisect": 1, "log": None}  # fmt: skip
    none = extreme.search("forward", budget_bytes=1000 * 128, **common)
    assert none["max_seq_len"] == 0 and none["peak_gib"] is None
    assert none["bytes_per_token"] is None and none["stopped_by"] == "memory budget"
    capped = extreme.search("forward", budget_bytes=2.0**40, **common)
    assert capped["stopped_by"] == "max_seq_len" and capped["max_seq_len"] == 1024
    assert capped["bytes_per_token"] == 1024
    assert capped["peak_gib"] == pytest.approx(1024 * 1024 / 2**30)
    within = extreme.search("forward", budget_bytes=1024 * 400, **common)  # 512 predicted over
    assert [a["seq_len"] for a in within["attempts"]] == [128, 256, 512, 384]
    assert "predicted_gib" in within["attempts"][2] and within["attempts"][3]["fits"]
    assert within["max_seq_len"] == 384 and within["stopped_by"] == "memory budget (predicted)"


def test_bench_extreme_cpu_writes_record(tmp_path: Path) -> None:
    out = tmp_path / "extreme"
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "bench_extreme.py"), "--device", "cpu",
        *_TINY, "--max-memory-gib", "1", "--no-plot", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    _check_record(out.with_suffix(".json"), 2048)
    rows = json.loads(out.with_suffix(".json").read_text())["results"]
    # A 1 GiB budget holds these sizes: the cap stops the search.
    assert all(r["max_seq_len"] == 2048 and r["stopped_by"] == "max_seq_len" for r in rows), rows


def test_extreme_length_example_runs_outside_the_repository(tmp_path: Path) -> None:
    """The example needs only the installed package: copied to a directory outside the checkout
    and run from there, with every benchmarks/ module made unimportable, it writes its record and
    plot under outputs/extreme_length/ of the working directory."""
    script = tmp_path / "extreme_length.py"
    shutil.copy(ROOT / "examples" / "extreme_length.py", script)
    args = ["--device", "cpu", *_TINY, "--max-memory-gib", "1"]
    code = (
        "import runpy, sys\n"
        "assert not any(p.rstrip('/').endswith('benchmarks') for p in sys.path), sys.path\n"
        "for name in ('benchmarks', 'bench_extreme', '_timing', '_records'):\n"
        "    sys.modules[name] = None  # importing any of them now raises ImportError\n"
        f"sys.argv = [{str(script)!r}, *{args!r}]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "forward: 2,048 tokens fit" in proc.stdout, proc.stdout
    out = tmp_path / "outputs" / "extreme_length"
    record = json.loads((out / "extreme_length.json").read_text())
    assert {"date", "torch", "device", "dilated_attention", "config"} <= set(record["environment"])
    assert record["environment"]["config"]["heads"] == 2
    assert [r["max_seq_len"] for r in record["results"]] == [2048, 2048]
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "extreme_length.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["extreme_length.py", "outputs"]


def test_extreme_module_validates_its_arguments() -> None:
    with pytest.raises(ValueError, match="mode must be one of"):
        find_max_seq_len(modes=["backward"], device="cpu", log=None)
    with pytest.raises(ValueError, match="max_memory_gib must be > 0"):
        find_max_seq_len(device="cpu", max_memory_gib=0, log=None)
    with pytest.raises(ValueError, match="first_segment"):
        find_max_seq_len(device="cpu", first_segment=0, log=None)
    with pytest.raises(ValueError, match="device='junk' is not a device"):
        measure_peak_memory(256, device="junk")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device is available here"):
            measure_peak_memory(256, device="cuda")


def test_measure_peak_memory_on_cpu() -> None:
    peak = measure_peak_memory(
        512, "forward+backward", heads=2, head_dim=16, first_segment=128, device="cpu"
    )
    assert peak is not None and peak >= 0


@pytest.mark.distributed
@pytest.mark.parametrize("split", ["ring", "heads"])
def test_fsdp_times_context_parallel_example_gives_the_single_process_losses(
    split: str, tmp_path: Path
) -> None:
    """LongNetLM on a 2 x 2 mesh (FSDP2 over every rank, the sequence over the mesh's ``cp``
    ranks by a ring or a head all-to-all) trains with the single-process losses (float64)."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
        str(ROOT / "examples" / "context_parallel_fsdp.py"), "--device", "cpu", "--split", split,
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240, check=False
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "Warning" not in proc.stderr, proc.stderr  # e.g. a loss with grad made a float
    pairs = re.findall(r"step \d+: loss (\S+) single_process_loss (\S+)", proc.stdout)
    assert len(pairs) == 3, proc.stdout
    for got, want in pairs:
        assert float(got) == pytest.approx(float(want), rel=1e-12, abs=0), proc.stdout
    sizes = (2, 1) if split == "ring" else (1, 2)
    assert f"cp=2 (ring of {sizes[0]} x head all-to-all of {sizes[1]})" in proc.stdout

