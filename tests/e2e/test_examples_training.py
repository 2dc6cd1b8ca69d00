"""The training examples run end to end: train_longnet (with checkpoint/resume reproducing an
uninterrupted run) and swap_attention (equality with the stock encoder, a falling loss)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support import REPO

pytestmark = pytest.mark.slow  # subprocesses and training runs: seconds each

ROOT = REPO
TRAIN = ROOT / "examples" / "train_longnet.py"
SWAP = ROOT / "examples" / "swap_attention.py"
TINY = [
    "--steps", "20", "--eval-every", "6", "--batch-size", "4", "--seq-len", "64",
    "--eval-windows", "4", "--corpus-bytes", "2000000", "--no-progress", "--seed", "3",
]  # fmt: skip


def _run(script: Path, *args: str, cwd: Path) -> str:
    proc = subprocess.run(
        [sys.executable, str(script), *args],
        cwd=cwd, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, f"{script.name} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _load_example(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _records(path: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_train_longnet_resume_reproduces_uninterrupted_run(tmp_path: Path) -> None:
    ckpt, plot = tmp_path / "ckpt.pt", tmp_path / "curve.png"
    first = _run(
        TRAIN, *TINY, "--stop-after", "12", "--checkpoint", str(ckpt),
        "--log", str(tmp_path / "resumed.jsonl"), "--no-plot", cwd=tmp_path,
    )  # fmt: skip
    assert "step 12 loss" in first and "step 13 loss" not in first
    assert ckpt.exists()
    # A damaged copy is refused before any training, with the file and the problem named.
    train_longnet, data = _load_example(TRAIN), ckpt.read_bytes()
    bad = tmp_path / "bad.pt"
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x01
    for damaged, why in (
        (bytes(flipped), "checksum mismatch"), (data[:-100], "truncated"), (b"", "is empty")
    ):  # fmt: skip
        bad.write_bytes(damaged)
        with pytest.raises(SystemExit, match=f"--resume: checkpoint {re.escape(str(bad))} .*{why}"):
            train_longnet.main([*TINY, "--checkpoint", str(bad), "--resume"])
    resumed = _run(
        TRAIN, *TINY, "--checkpoint", str(ckpt), "--resume",
        "--log", str(tmp_path / "resumed.jsonl"), "--plot", str(plot), cwd=tmp_path,
    )  # fmt: skip
    assert "resuming from" in resumed and "step 1 loss" not in resumed
    full = _run(TRAIN, *TINY, "--log", str(tmp_path / "full.jsonl"), "--no-plot", cwd=tmp_path)

    final = re.compile(r"^final step (\d+) loss (\S+) eval_bpb (\S+)$", re.M)
    assert final.search(resumed).groups() == final.search(full).groups()
    assert final.search(full).group(1) == "20"
    a, b = _records(tmp_path / "resumed.jsonl"), _records(tmp_path / "full.jsonl")
    assert a == b  # every loss and every held-out eval, bit for bit
    losses = [r["loss"] for r in b if "loss" in r]
    evals = [r["step"] for r in b if "eval_bpb" in r]
    assert len(losses) == 20 and evals == [0, 6, 12, 18, 20]
    assert sum(losses[-4:]) < sum(losses[:4])  # it learns
    if importlib.util.find_spec("matplotlib") is not None:
        assert plot.exists() and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "skipping the plot" in resumed


def test_train_longnet_options(tmp_path: Path) -> None:
    out = _run(
        TRAIN, "--steps", "3", "--eval-every", "3", "--batch-size", "2", "--seq-len", "32",
        "--eval-windows", "2", "--corpus-bytes", "2000000", "--no-progress", "--no-plot",
        "--activation-checkpointing", "--grad-clip", "0", "--warmup", "0", cwd=tmp_path,
    )  # fmt: skip
    assert "final step 3 loss" in out
    # Everything it writes goes under outputs/train_longnet/ of the working directory.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs"]
    assert (tmp_path / "outputs" / "train_longnet" / "checkpoint.pt").exists()


def test_train_longnet_resume_without_checkpoint_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    train_longnet = _load_example(TRAIN)
    default = Path("outputs") / "train_longnet" / "checkpoint.pt"
    message = f"--resume: no checkpoint at {re.escape(str(default))}; run without"
    with pytest.raises(SystemExit, match=message):
        train_longnet.main(["--resume"])
    with pytest.raises(SystemExit):
        train_longnet.main(["--resume", "--no-checkpoint"])
    assert "--resume needs a checkpoint" in capsys.readouterr().err


def test_swap_attention_example(tmp_path: Path) -> None:
    out = _run(SWAP, "--steps", "30", cwd=tmp_path)
    assert "equality check passed" in out
    losses = [float(x) for x in re.findall(r"^step \d+ loss (\S+)$", out, re.M)]
    assert len(losses) >= 3 and losses[-1] < losses[0]


def test_swap_adapter_rejects_non_causal_mask() -> None:
    torch = pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("swap_attention", SWAP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    stock = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    adapter = module.dilated_from_stock(stock, [8], [1])
    x = torch.randn(1, 8, 16)
    with pytest.raises(ValueError, match="causal mask"):
        adapter(x, x, x, attn_mask=torch.zeros(8, 8, dtype=torch.bool).fill_diagonal_(True),
                need_weights=False)  # fmt: skip
    out, _ = adapter(x, x, x, need_weights=False)
    expected, _ = stock(x, x, x, need_weights=False)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
