"""``--require-backends NAMES``: backends a test run must have.

A GPU run that silently skips every FlashAttention-4 test because ``flash_attn.cute`` failed to
import looks like a green run. With ``--require-backends flash_attn4,triton`` (or the environment
variable ``DILATED_ATTENTION_REQUIRE_BACKENDS``), a test that would skip while a named backend is
missing or broken (its ``availability_reasons`` non-empty: not importable, or its probe launch
failed) fails instead, with that backend's reasons. Which tests: those whose skip reason or test
id names the backend (``flash_attn4`` in ``test_x[case-flash_attn4-bfloat16]``), and the
registry-driven suites (``backend_params``), which then collect a required backend on its devices
even where it is unavailable instead of leaving it out. A backend that is available but cannot
run particular inputs still skips those tests.

``tests/conftest.py`` sets :data:`REQUIRED` from the option before any test module is imported.
"""

from __future__ import annotations

import re

import torch

from dilated_attention import list_backends
from dilated_attention.backends import get_backend

__all__ = [
    "ENV",
    "OPTION",
    "REQUIRED",
    "failure_message",
    "missing_named_in",
    "parse",
    "unavailable_reasons",
]

OPTION = "--require-backends"
ENV = "DILATED_ATTENTION_REQUIRE_BACKENDS"

#: The backends this run requires (set by ``tests/conftest.py``).
REQUIRED: frozenset[str] = frozenset()


def parse(value: str | None) -> frozenset[str]:
    """Comma-separated backend names (spaces and empty items ignored) -> a set; ``ValueError``
    naming the unknown ones and the registered names."""
    names = frozenset(n.strip() for n in (value or "").split(",") if n.strip())
    unknown = sorted(names - set(list_backends()))
    if unknown:
        raise ValueError(
            f"{OPTION} / {ENV} takes registered backend names separated by commas, got unknown "
            f"{unknown} in {value!r}; registered: {', '.join(list_backends())}"
        )
    return names


def unavailable_reasons(name: str) -> list[str]:
    """Why backend ``name`` is missing or broken here (empty when it imports and launches): on
    CUDA where it runs there and a GPU is present (or it runs nowhere else), else on the CPU."""
    backend = get_backend(name)
    cuda = "cuda" in backend.devices and (torch.cuda.is_available() or "cpu" not in backend.devices)
    device = torch.device("cuda" if cuda else "cpu")
    if device.type not in backend.devices:
        return [f"runs on {sorted(backend.devices)}, none of which is here"]
    return backend.availability_reasons(device)


def named_in(text: str, names: frozenset[str]) -> list[str]:
    """The names in ``names`` that occur in ``text`` as whole tokens (not inside a longer run of
    letters and digits: ``flash_attn4`` in ``test_cuda_flash_attn4_writes[x]``, not ``flex`` in
    ``reflexive``), sorted."""
    token = r"(?<![A-Za-z0-9]){}(?![A-Za-z0-9])"
    return sorted(n for n in names if re.search(token.format(re.escape(n)), text))


def missing_named_in(text: str) -> dict[str, list[str]]:
    """For each required backend named in ``text`` that is unavailable here, its reasons."""
    found = {name: unavailable_reasons(name) for name in named_in(text, REQUIRED)}
    return {name: reasons for name, reasons in found.items() if reasons}


def failure_message(missing: dict[str, list[str]]) -> str:
    """What a test that would have skipped says instead."""
    return "; ".join(
        f"{name} is required ({OPTION} / {ENV}) but unavailable here: {'; '.join(reasons)}"
        for name, reasons in sorted(missing.items())
    )
