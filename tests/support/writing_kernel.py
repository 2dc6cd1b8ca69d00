"""The math backend as a kernel that writes its results into the buffers it is handed (the
contract's ``into``, as FlashAttention-4 does), so that branch slots (Note [Branch slots merged
once] in ``core/geometry/slots.py``) run on the CPU."""

from __future__ import annotations

from typing import Any

import pytest

from dilated_attention.backends.math import MathBackend
from dilated_attention.core.contract import KernelOutput


def write_into_buffers(monkeypatch: pytest.MonkeyPatch | None = None) -> list[str]:
    """Make the math backend write into given buffers; returns the list of the passes that did
    (``"forward"`` / ``"backward"``). With ``monkeypatch`` the change is undone after the test;
    without (a spawned rank's process), it lasts the process."""
    writes: list[str] = []
    real_forward, real_backward = MathBackend._forward, MathBackend._backward

    def _forward(self: MathBackend, q: Any, k: Any, v: Any, *, into: Any = None, **kw: Any) -> Any:
        res = real_forward(self, q, k, v, **kw)
        if into is None:
            return res
        into.out.copy_(res.out)
        into.lse.copy_(res.lse)
        writes.append("forward")
        return KernelOutput(into.out, into.lse, res.aux)

    def _backward(self: MathBackend, *args: Any, into: Any = None, **kw: Any) -> Any:
        grads = real_backward(self, *args, **kw)
        if into is None:
            return grads
        for dest, grad in zip(into, grads, strict=True):
            dest.copy_(grad)
        writes.append("backward")
        return into

    for name, value in (("writes_into", True), ("_forward", _forward), ("_backward", _backward)):
        if monkeypatch is None:
            setattr(MathBackend, name, value)
        else:
            monkeypatch.setattr(MathBackend, name, value)
    return writes
