"""The examples' command lines: every ``--help`` explains every flag and shows its default, bad
values are refused with the fix before any work, and the output reads right.

For the help, each script runs as ``__main__`` (``runpy``) with its ``parse_args`` intercepted,
so the parser it builds is inspected without training anything."""

from __future__ import annotations

import argparse
import importlib.util
import runpy
import sys
from pathlib import Path
from typing import Any

import pytest
from support import REPO

from dilated_attention.demo import MIN_CORPUS_BYTES

EXAMPLES = sorted((REPO / "examples").glob("*.py"))


class _ParsedError(Exception):
    """Raised in place of parsing: carries the parser the script built."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def _parser_of(script: Path, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    def intercept(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise _ParsedError(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", intercept)
    monkeypatch.setattr(sys, "argv", [str(script)])
    with pytest.raises(_ParsedError) as parsed:
        runpy.run_path(str(script), run_name="__main__")
    return parsed.value.parser


def _is_switch(action: argparse.Action) -> bool:
    """An on/off flag that is off unless given (``store_true``): nothing to show as a default."""
    return action.nargs == 0 and action.const is True and action.default is False


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_every_flag_has_help_and_shows_its_default(
    script: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parser = _parser_of(script, monkeypatch)
    formatter = parser._get_formatter()
    missing, no_default = [], []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        flag = "/".join(action.option_strings) or action.dest
        if not action.help or action.help == argparse.SUPPRESS:
            missing.append(flag)
            continue
        if action.required or _is_switch(action):
            continue
        # The default is shown by the formatter, or said in words where it depends on the
        # machine (None: "default 16K CPU, 1M GPU").
        if "default" not in formatter._expand_help(action).lower():
            no_default.append(flag)
    assert not missing, f"{script.name}: flags without help text: {missing}"
    assert not no_default, f"{script.name}: flags whose help shows no default: {no_default}"


def _load_example(name: str) -> Any:
    path = REPO / "examples" / name
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_corpus_bytes_help_states_its_minimum(
    script: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parser = _parser_of(script, monkeypatch)
    for action in parser._actions:
        if "--corpus-bytes" in action.option_strings:
            assert f"at least {MIN_CORPUS_BYTES} (1 MiB)" in action.help, action.help


@pytest.mark.parametrize("name", ["train_longnet.py", "torchrun_long_sequence.py"])
def test_corpus_bytes_below_the_minimum_is_a_usage_error(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        _load_example(name).parse_args(["--corpus-bytes", "500000"])
    assert exit_.value.code == 2
    assert f"--corpus-bytes must be >= {MIN_CORPUS_BYTES} (1 MiB), got 500000" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("dp", "cp", "world", "fix"),
    [
        (2, 2, 4, None),
        (2, 2, 2, "use --dp 1 --cp 2, or start 4 processes (torchrun --nproc_per_node=4)"),
        (2, 2, 8, "use --dp 4 --cp 2, or start 4 processes"),
        (2, 4, 2, "use --dp 2 --cp 1, or start 8 processes"),  # --dp kept where --cp cannot be
        (2, 2, 3, "use --dp 1 --cp 3, or start 4 processes"),
    ],
)
def test_mesh_that_does_not_fit_the_world_names_its_size_and_a_pair_that_fits(
    dp: int, cp: int, world: int, fix: str | None
) -> None:
    message = _load_example("context_parallel_fsdp.py").mesh_mismatch(dp, cp, world)
    if fix is None:
        assert message is None
    else:
        assert message.startswith(
            f"--dp {dp} x --cp {cp} = {dp * cp} ranks, but the world has {world} processes; "
        ), message
        assert fix in message, message


def test_swap_attention_counts_one_layer_in_the_singular(
    capsys: pytest.CaptureFixture[str],
) -> None:
    _load_example("swap_attention.py").main(
        ["--layers", "1", "--seq-len", "16", "--steps", "1", "--batch-size", "2", "--device", "cpu"]
    )
    assert "swapped: MultiheadDilatedAttention in 1 layer\n" in capsys.readouterr().out
