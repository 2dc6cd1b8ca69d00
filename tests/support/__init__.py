"""Helpers shared by the test suite: the float64 oracle, tolerances, backend parameters, gloo
worlds, block-sparse and Triton helpers. Nothing here imports the library's private code to
compute a reference."""

from pathlib import Path

#: The repository's root directory.
REPO = Path(__file__).resolve().parents[2]
