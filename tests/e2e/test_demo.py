"""The main job (``python -m dilated_attention demo``) end to end with a few steps, and its data."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from dilated_attention.demo import (
    MIN_CORPUS_BYTES,
    load_corpus,
    reference_bits_per_byte,
    sample_windows,
)


@pytest.mark.slow  # trains for 30 steps in a subprocess
def test_demo_runs_end_to_end() -> None:
    args = ["--steps", "30", "--seq-len", "64", "--eval-windows", "8", "--sample-bytes", "16"]
    proc = subprocess.run(
        [sys.executable, "-m", "dilated_attention", "demo", *args],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "kernel cpu_flash on cpu" in out, out
    before = float(re.search(r"bits per byte before training: ([\d.]+)", out).group(1))
    after = float(re.search(r"bits per byte after 30 steps: ([\d.]+)", out).group(1))
    assert 7.0 < before < 9.0, out  # an untrained byte model is near log2(256) = 8 bits
    assert after < before - 1.0, out  # 30 steps already learn the byte statistics of source code
    # The sample shows its held-out prompt (seq_len // 2 bytes), then the continuation.
    assert "sample: the model continues a held-out prompt" in out
    assert "----- prompt (32 bytes) -----\n" in out, out
    assert "----- continuation (16 bytes, temperature 0.8, top-k 20, seed 0) -----\n" in out, out
    assert out.rstrip().endswith("----- end -----"), out
    assert "Warning" not in proc.stderr, proc.stderr  # nothing for a newcomer to puzzle over


def test_corpus_split_is_disjoint_and_deterministic() -> None:
    train, held_out = load_corpus(max_bytes=1 << 20)
    train2, held_out2 = load_corpus(max_bytes=1 << 20)
    assert torch.equal(train, train2) and torch.equal(held_out, held_out2)
    assert held_out.numel() > 0 and train.numel() > 5 * held_out.numel()
    windows = sample_windows(train, 4, 32, torch.Generator().manual_seed(0))
    assert windows.shape == (4, 33) and windows.dtype == torch.int64 and int(windows.max()) < 256


def test_corpus_below_its_minimum_is_refused_before_reading() -> None:
    message = rf"max_bytes \(--corpus-bytes\) must be >= {MIN_CORPUS_BYTES} \(1 MiB: every tenth"
    with pytest.raises(ValueError, match=message + r".*got 500000"):
        load_corpus(max_bytes=500_000)
    train, held_out = load_corpus(max_bytes=MIN_CORPUS_BYTES)  # the minimum holds some out
    assert train.numel() > 0 and held_out.numel() > 0


def test_reference_bits_per_byte_of_random_and_of_constant_bytes() -> None:
    """The scale the demo prints: random bytes give 8 bits (gzip cannot shrink them), one byte
    repeated gives 0 by its histogram and almost 0 by gzip."""
    random = torch.randint(0, 256, (1 << 18,), generator=torch.Generator().manual_seed(0))
    scale = reference_bits_per_byte(random.to(torch.uint8))
    assert scale["unigram"] == pytest.approx(8.0, abs=0.01)
    assert 8.0 <= scale["gzip"] < 8.1
    scale = reference_bits_per_byte(torch.full((1 << 18,), 65, dtype=torch.uint8))
    assert scale["unigram"] == 0.0 and scale["gzip"] < 0.01
