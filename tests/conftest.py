"""Shared pytest setup: seeds, the ``gpu`` marker skip, and float64 defaults for the oracle."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dilated_attention.backends import Backend, get_backend


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
