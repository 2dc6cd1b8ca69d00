"""The command line ``python -m dilated_attention``: every command's ``--help``, the ``demo --save``
-> ``generate`` round trip, ``layer`` and ``info`` on a CPU, and clear errors for bad flags."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support import REPO

from dilated_attention.__main__ import main
from dilated_attention.demo import format_sample
from dilated_attention.models import load_checkpoint

# A demo that takes seconds: two steps on short sequences from a 2 MB corpus.
_TINY_DEMO = [
    "--steps", "2", "--batch-size", "2", "--seq-len", "32", "--eval-windows", "2",
    "--sample-bytes", "4", "--corpus-bytes", "2000000", "--no-progress",
]  # fmt: skip


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread: the tiny model's many small ops run faster, and much faster when other
    processes share the CPU (idle threads spin at every op's barrier)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``main(argv)``: (exit status, stdout, stderr)."""
    try:
        main(list(argv))
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def test_top_level_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "--help")
    assert code == 0
    for command in ("demo", "generate", "layer", "warmup", "info"):
        assert re.search(rf"^\s+{command}\s+\S", out, re.M), out  # name and a one-line summary
    assert "COMMAND --help" in out


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["layer", "--help"], ["--seq-len SEQ_LEN", "(default: 16384)", "--heads HEADS",
                               "(default: 8)", "--head-dim HEAD_DIM", "(default: 32)",
                               "--first-segment", "(default: 2048)", "--device", "--dtype",
                               "--repeats", "--causal, --no-causal"]),
        (["demo", "-h"], ["--steps STEPS", "(default: 700)", "--save PATH", "--seq-len",
                          "--corpus-bytes", "at least 1048576 (1 MiB)", "--device",
                          "--preset {base,tiny,tiny_hybrid}"]),
        (["generate", "--help"], ["--checkpoint PATH", "--prompt PROMPT", "--max-new-tokens N",
                                  "(default: 200)", "--temperature T", "(default: 0.8)",
                                  "--top-k K", "(default: 20)", "--seed S", "--device"]),
        (["info", "--help"], ["--head-dim HEAD_DIM", "(default: 64)", "--causal"]),
        (["warmup", "--help"], ["--seq-len SEQ_LEN", "--heads HEADS", "--head-dim HEAD_DIM",
                                "--first-segment", "--kv-heads KV_HEADS", "--key-padding",
                                "--grad, --no-grad", "--dtype", "TRITON_CACHE_DIR"]),
    ],
)  # fmt: skip
def test_each_command_help_shows_its_own_flags(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: list[str]
) -> None:
    code, out, _ = _run(capsys, *argv)
    assert code == 0
    assert out.startswith(f"usage: python -m dilated_attention {argv[0]} "), out
    for text in expected:
        assert text in " ".join(out.split()), (text, out)  # help lines wrap with the terminal
    assert "(default: None)" not in out


def test_help_through_the_module_entry_point() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dilated_attention", "layer", "--help"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "usage: python -m dilated_attention layer" in proc.stdout
    assert "(default: 16384)" in proc.stdout and "--head-dim" in proc.stdout
    assert proc.stderr == ""  # no warning on the way (e.g. torch's NumPy warning)


def test_missing_or_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    # No command: the whole help, so every command is listed with its summary, then the error.
    code, out, err = _run(capsys)
    assert code == 2 and out == ""
    assert err.startswith("usage: python -m dilated_attention ")
    for command in ("demo", "generate", "layer", "warmup", "info"):
        assert re.search(rf"^\s+{command}\s+\S", err, re.M), err
    assert err.rstrip().endswith("error: name a command: demo, generate, layer, warmup, info")
    code, _, err = _run(capsys, "train")
    assert code == 2 and "invalid choice: 'train'" in err


def test_layer_and_info_run_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(
        capsys, "layer", "--seq-len", "256", "--first-segment", "128", "--heads", "2",
        "--head-dim", "8", "--repeats", "1", "--device", "cpu",
    )  # fmt: skip
    assert code == 0
    assert "segment_lengths=[128, 256]" in out and "backend chosen:" in out
    assert "  branches:\n    w=128 r=1" in out  # how each branch runs on the chosen kernel
    assert "input gradient finite: True" in out
    code, out, _ = _run(capsys, "info")
    assert code == 0 and "cpu:" in out and "backend" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the sample is a CPU-only machine's")
def test_info_sample_in_the_docs_is_what_info_prints(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/kernels.md shows ``info``'s output on a CPU-only machine: the same text, but for the
    versions line and the thread count, which are the machine's own."""
    doc = (REPO / "docs" / "kernels.md").read_text()
    sample = re.search(r"The output\s+of a CPU-only machine \(.*?\):\n\n```\n(.*?)```", doc, re.S)
    assert sample, "docs/kernels.md: no info sample of a CPU-only machine"
    code, out, _ = _run(capsys, "info")
    assert code == 0

    def body(text: str) -> list[str]:
        lines = [line.rstrip() for line in text.splitlines()[1:]]  # without the versions line
        return [re.sub(r"^cpu: \d+ threads?$", "cpu: N threads", line) for line in lines]

    assert body(sample.group(1)) == body(out), "docs/kernels.md's info sample is stale"


def test_warmup_on_cpu_compiles_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(
        capsys, "warmup", "--seq-len", "4096", "--first-segment", "512", "--device", "cpu"
    )
    assert code == 0
    assert "dilation_rates=[1, 2, 4, 8]" in out and "nothing to compile on cpu" in out
    code, _, err = _run(capsys, "warmup", "--heads", "8", "--kv-heads", "3", "--device", "cpu")
    assert code == 2 and "--kv-heads must divide --heads (8), got 3" in err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_warmup_on_gpu_runs_the_family(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(
        capsys, "warmup", "--seq-len", "2048", "--first-segment", "512", "--heads", "4",
        "--kv-heads", "2", "--head-dim", "64", "--key-padding", "--device", "cuda",
    )  # fmt: skip
    assert code == 0, out
    assert "done in" in out and "compiled kernels are in" in out


@pytest.mark.parametrize("command", ["layer", "demo", "warmup"])
def test_bad_device_is_a_clear_usage_error(
    capsys: pytest.CaptureFixture[str], command: str
) -> None:
    code, _, err = _run(capsys, command, "--device", "junk")
    assert code == 2 and "--device junk is not a device; use cpu, cuda or cuda:N" in err
    if not torch.cuda.is_available():
        code, _, err = _run(capsys, command, "--device", "cuda")
        assert code == 2
        assert "--device cuda: no CUDA device is available here" in err and "--device cpu" in err


@pytest.mark.usefixtures("one_thread")
def test_demo_save_then_generate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "out" / "model.pt"
    code, out, _ = _run(capsys, "demo", *_TINY_DEMO, "--save", str(path))
    assert code == 0, out
    # The demo's own sample shows its prompt, then the continuation.
    sample = re.search(
        r"----- prompt \((\d+) bytes\) -----\n(.*)\n----- continuation \((\d+) bytes, "
        r"temperature 0.8, top-k 20, seed 0\) -----\n(.*)\n----- end -----",
        out, re.S,
    )  # fmt: skip
    assert sample, out
    assert sample.group(1) == "16" and sample.group(3) == "4"  # seq_len // 2 and --sample-bytes
    # How good the figure is: the scale, measured on the same held-out text.
    scale = re.search(
        r"\n  for scale: 8 = random bytes; on this held-out text byte frequencies alone give "
        r"(\d\.\d\d),\n  gzip -9 (\d\.\d\d); well-trained byte-level models go well below gzip"
        r"[^\n]*\n[^\n]*\n[^\n]*\n  reach 1\.6-2\.0 \(docs/quality\.md\)",
        out,
    )  # fmt: skip
    assert scale, out
    assert 4.0 < float(scale.group(1)) < 5.5 and 1.0 < float(scale.group(2)) < 2.5, out
    assert f"model saved to {path}" in out and "generate --checkpoint" in out
    assert path.exists()

    prompt = "def forward(self"
    args = ["generate", "--checkpoint", str(path), "--prompt", prompt, "--max-new-tokens", "6"]
    code, out, err = _run(capsys, *args, "--seed", "1")
    assert code == 0, err
    expected_head = (
        f"----- prompt (16 bytes) -----\n{prompt}\n"
        "----- continuation (6 bytes, temperature 0.8, top-k 20, seed 1) -----\n"
    )
    assert out.startswith(expected_head), out
    assert out.rstrip().endswith("----- end -----")
    code, again, _ = _run(capsys, *args, "--seed", "1")
    assert code == 0 and again == out  # the seed makes it reproducible

    # The continuation is the loaded model's own sample (greedy here: the seed does not matter).
    code, out, _ = _run(capsys, *args, "--temperature", "0")
    model = load_checkpoint(path).model
    tokens = model.generate(torch.tensor([list(prompt.encode())]), 6, temperature=0)
    how = "temperature 0, top-k 20, seed 0"
    assert code == 0
    assert out.strip() == format_sample(prompt.encode(), bytes(tokens[0, 16:].tolist()), how=how)


def test_generate_refuses_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.pt"
    code, _, err = _run(capsys, "generate", "--checkpoint", str(missing), "--prompt", "x")
    assert code == 2 and f"no checkpoint at {missing}" in err
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    code, _, err = _run(capsys, "generate", "--checkpoint", str(text), "--prompt", "x")
    assert code == 2 and "text file" in err and "not a checkpoint" in err
    code, _, err = _run(capsys, "generate", "--checkpoint", str(text), "--prompt", "")
    assert code == 2 and "--prompt is empty" in err
    code, _, err = _run(
        capsys, "generate", "--checkpoint", str(text), "--prompt", "x", "--top-k", "-1"
    )
    assert code == 2 and "--top-k must be >= 0" in err
    code, _, err = _run(capsys, "generate", "--prompt", "x")
    assert code == 2 and "required: --checkpoint" in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
        (["--lr", "-1"], "--lr must be a finite number > 0, got -1.0"),
        (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
        (["--seq-len", "1"], "--seq-len must be >= 2"),
        (["--time-budget", "nan"], "--time-budget must be a finite number of seconds >= 0"),
        (["--time-budget", "-5"], "--time-budget must be a finite number of seconds >= 0"),
        (["--corpus-bytes", "500000"], "--corpus-bytes must be >= 1048576 (1 MiB: every tenth"),
    ],
)
def test_demo_refuses_bad_flags_in_one_line(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    argv = [*_TINY_DEMO, *flags]  # argparse takes the last of a repeated flag
    code, out, err = _run(capsys, "demo", *argv)
    assert code == 2, out
    assert message in err and "Traceback" not in err, err
    assert "bits per byte" not in out  # refused before any work


@pytest.mark.usefixtures("one_thread")
def test_demo_stops_at_its_time_budget(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*_TINY_DEMO, "--steps", "100000", "--time-budget", "1"]
    code, out, _ = _run(capsys, "demo", *argv)
    assert code == 0, out
    steps = int(re.search(r"bits per byte after (\d+) steps", out).group(1))
    seconds = float(re.search(r"training time ([\d.]+) s \(time budget 1 s\)", out).group(1))
    assert 1 <= steps < 100000
    assert 1.0 <= seconds < 10.0  # one step past the budget at most


@pytest.mark.usefixtures("one_thread")
def test_demo_with_zero_steps_trains_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "demo", *_TINY_DEMO, "--steps", "0")
    assert code == 0, out
    before = re.search(r"bits per byte before training: ([\d.]+)", out).group(1)
    assert f"after 0 steps: {before} (before {before})" in out, out


def test_demo_learning_rate_follows_the_budget_or_the_steps() -> None:
    from dilated_attention.demo import _progress
    from dilated_attention.models.training import warmup_cosine as _lr

    assert _progress(50, 100, elapsed=10.0, budget=0.0) == 0.5  # no budget: steps only
    assert _progress(50, 100, elapsed=90.0, budget=120.0) == 0.75  # time is further along
    assert _progress(0, 0, elapsed=0.0, budget=120.0) == 1.0  # no steps: nothing to train
    assert _lr(0.0, 1.0) > 0  # the first step learns
    assert _lr(0.05, 1.0) == pytest.approx(1.0)  # peak after the 5% warm-up
    assert _lr(1.0, 1.0) == pytest.approx(0.0)
    assert _lr(0.5, 1.0) > _lr(0.9, 1.0) > 0  # cosine decay


def test_generate_refuses_nan_temperature_and_long_prompts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dilated_attention.models import LongNetConfig, LongNetLM, save_checkpoint

    config = LongNetConfig.from_preset("tiny", num_layers=1, max_seq_len=8)
    path = save_checkpoint(tmp_path / "capped.pt", LongNetLM(config))
    base = ["generate", "--checkpoint", str(path), "--max-new-tokens", "2"]
    for value in ("nan", "inf", "-1"):
        code, out, err = _run(capsys, *base, "--prompt", "x", "--temperature", value)
        assert code == 2 and "--temperature must be a finite number >= 0" in err, err
        assert "Traceback" not in err and out == ""
    code, out, err = _run(capsys, *base, "--prompt", "x" * 9)
    assert code == 2, out
    assert "--prompt is 9 bytes, longer than the model's max_seq_len=8" in err, err
    code, out, err = _run(capsys, *base, "--prompt", "x" * 8)  # at the cap: runs
    assert code == 0, err
