"""README.md as a newcomer meets it: short, opening with the two commands (the CPU wheel said
before the first install), and every Python snippet runs as printed, each on its own.

Names a snippet leaves to the reader are given here (``_GIVEN``): ``config`` and ``path`` of the
Hugging Face snippet."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from support import REPO

README = REPO / "README.md"


def _text() -> str:
    return README.read_text(encoding="utf-8")


def _blocks(language: str) -> list[tuple[int, str]]:
    """(line, code) of each fenced block of ``language``."""
    text = _text()
    return [
        (text[: m.start()].count("\n") + 1, m.group(1))
        for m in re.finditer(rf"^```{language}\n(.*?)^```$", text, re.S | re.M)
    ]


def test_readme_is_at_most_250_lines() -> None:
    assert len(_text().splitlines()) <= 250


def test_readme_opens_with_the_demo_and_the_tests_the_cpu_wheel_said_first() -> None:
    (_, demo), (_, tests) = _blocks("bash")[:2]
    assert demo.strip() == "pip install -e . && python -m dilated_attention demo"
    assert tests.strip().startswith('pip install -e ".[dev]" && ')
    assert tests.strip().endswith("python -m pytest -q")
    # Copying the first install command on a machine without a GPU must not pull CUDA wheels:
    # the CPU wheel comes before it.
    text = _text()
    cpu_wheel = text.find("--index-url https://download.pytorch.org/whl/cpu")
    assert 0 <= cpu_wheel < text.find("pip install -e ."), "the CPU wheel line must come first"


def _given(code: str, tmp_path: Path) -> dict[str, object]:
    """The names ``code`` uses but leaves to the reader."""
    names: dict[str, object] = {}
    if "AutoModelForCausalLM.from_config(config)" in code:
        transformers = pytest.importorskip("transformers")
        names["config"] = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2,
        )  # fmt: skip
        names["path"] = str(tmp_path / "model")
    return names


SNIPPETS = _blocks("python")


@pytest.mark.slow  # the snippets' real sizes: a few seconds in all
@pytest.mark.parametrize(("line", "code"), SNIPPETS, ids=[f"line{line}" for line, _ in SNIPPETS])
def test_python_snippet_runs(
    line: int, code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # what a snippet writes stays in the test's directory
    torch.manual_seed(0)
    namespace = {"__name__": "__readme__", **_given(code, tmp_path)}
    exec(compile(code, f"README.md:{line}", "exec"), namespace)
