"""Shared pytest setup: seeds, the ``gpu`` marker skip, per-worker CPU threads, and float64
defaults for the oracle."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from dilated_attention.backends import Backend, get_backend


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, give each worker its share of the CPU's threads: torch's default
    (one intra-op thread per core in every worker) oversubscribes the cores many times over,
    and the float64 oracle's products then run 10-100x slower than alone (measured on a 16-core
    GPU host at ``-n 16``: 5-19 s tests took 83-199 s)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is not None:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``@pytest.mark.gpu`` tests when no CUDA device is present, saying why."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the backends whose ``_forward`` ran (math and cpu_flash are spied on)."""
    calls: list[str] = []
    for name in ("math", "cpu_flash"):
        cls = type(get_backend(name))
        original = cls._forward

        def spy(self: Backend, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            calls.append(self.name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, "_forward", spy)
    return calls
