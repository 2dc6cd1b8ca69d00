"""No project history in the library's text: comments, docstrings and strings of the package's
Python files, its data files, README.md and docs/ name no issue numbers, commit hashes or work
sessions. History belongs in CHANGELOG.md and git; a measured fact cites the record under
benchmarks/results/ or the test that shows it.

Python files are read with ``tokenize``, so only comments and string literals are searched (a
Triton kernel's numeric constants are not). A hash is a word of 7-40 lowercase hex digits with at
least one letter and one digit, which English and numbers are not (``1e10000``-style exponents
excepted).
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest
from support import REPO

PACKAGE = REPO / "dilated_attention"

ISSUE = re.compile(r"\b(?:issues?|PR|pull request)\s*#?\s*\d+", re.IGNORECASE)
SESSION = re.compile(
    r"\b(?:sessions?|(?:this|last|previous|next) round|round \d+|helper \d+)\b", re.IGNORECASE
)
HASH = re.compile(r"(?<![\w.])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![\w])")
EXPONENT = re.compile(r"\d+e\d+")
#: Words that look like hashes but are not (none so far).
ALLOWED: frozenset[str] = frozenset()


def findings(text: str) -> list[tuple[int, str]]:
    """(offset, word) of the issue references, session history and hash-like words in ``text``."""
    found = [(m.start(), m.group(0)) for m in ISSUE.finditer(text)]
    found += [(m.start(), m.group(0)) for m in SESSION.finditer(text)]
    found += [
        (m.start(), m.group(0))
        for m in HASH.finditer(text)
        if m.group(0) not in ALLOWED and not EXPONENT.fullmatch(m.group(0))
    ]
    return found


def problems(text: str) -> list[str]:
    return [word for _, word in findings(text)]


def _python_text(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and string literal in a Python file."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
    kinds = {tokenize.COMMENT, tokenize.STRING}
    fstring = {getattr(tokenize, name) for name in ("FSTRING_MIDDLE",) if hasattr(tokenize, name)}
    return [(tok.start[0], tok.string) for tok in tokens if tok.type in kinds | fstring]


#: Suffixes of the package's text files (Python, and data shipped with it).
TEXT = {".py", ".json", ".toml", ".md", ".txt"}


def _files() -> list[Path]:
    package = [p for p in sorted(PACKAGE.rglob("*")) if p.suffix in TEXT and p.is_file()]
    return [*package, REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_issue_numbers_hashes_or_sessions(path: Path) -> None:
    if path.suffix == ".py":
        pieces = _python_text(path)
    else:
        pieces = list(enumerate(path.read_text(encoding="utf-8").splitlines(), start=1))
    found = [
        (line + text[:offset].count("\n"), word)
        for line, text in pieces
        for offset, word in findings(text)
    ]
    assert not found, (
        f"{path.relative_to(REPO)} names project history (line, text): {found}; state the fact "
        f"and cite the benchmark record or test that shows it (history goes in CHANGELOG.md)"
    )


@pytest.mark.parametrize(
    "text",
    [
        "lost its NaN that way (issue 21)",
        "see Issue #42",
        "measured at 64a341b",
        "(git: 7197b45)",
        "commit 9e57fac0f618dc65a1d9872c4d9304d098881e9e",
        "fixed this session",
        "done in this round",
    ],
)
def test_detector_flags_history(text: str) -> None:
    assert problems(text), text


@pytest.mark.parametrize(
    "text",
    [
        "p = tl.exp2(x * 1.4426950408889634)",
        "mask = 0x7fffffff",
        "float16 and bfloat16 at 1048576 tokens, 1e10000",
        "cuDNN reported at 0.8-1.0x there (transformers#48163)",
        "deadbeef cafebabe",
        "the issue is that rows see no key",
    ],
)
def test_detector_passes_ordinary_text(text: str) -> None:
    assert not problems(text), problems(text)
