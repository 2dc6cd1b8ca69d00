"""The fused engine's launches allocate nothing (Note [A call's launches from a CUDA graph] in
``core/execution/graphs.py``): everything a call writes is allocated before its launches run,
so a CUDA graph captured from them never takes memory of its own and never hands out an output
that a later replay overwrites. Checked on every path through the engine (several position
and head groups, no rate-1 branch, one branch, packed documents, a padding mask), forward and
backward, with the allocating factories made to fail while the launches run."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from support.triton import KERNEL_DEVICES, skip_without_triton

from dilated_attention import dilated_attention
from dilated_attention.backends import triton as triton_backend
from dilated_attention.core.execution import fused

#: The tensor factories a launch sequence must not call.
FACTORIES = ("empty", "zeros", "full", "ones", "empty_like", "zeros_like", "full_like",
             "ones_like", "empty_strided")  # fmt: skip

#: (id, length, heads, kv heads, segments, rates, options)
CASES = [
    ("groups", 300, 8, 4, [60, 150, 300], [1, 3, 4], {"split": True}),
    ("no-rate-1", 200, 4, 2, [64, 200], [2, 4], {"mask": True}),
    ("single-branch", 200, 4, 2, [100], [2], {}),
    ("packed", 240, 4, 2, [48, 120, 240], [1, 3, 4], {"cu_seqlens": [0, 110, 240]}),
]


@contextlib.contextmanager
def _no_allocation(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Inside, every tensor factory of :data:`FACTORIES` raises."""

    def refuse(name: str) -> Callable[..., Any]:
        def factory(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError(f"torch.{name} called while the launches run")

        return factory

    with monkeypatch.context() as patch:
        for name in FACTORIES:
            patch.setattr(torch, name, refuse(name))
        yield


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_the_launches_allocate_nothing(
    case: tuple[Any, ...], device: str, dtypes: list[torch.dtype], monkeypatch: pytest.MonkeyPatch
) -> None:
    skip_without_triton(device)
    _, n, heads, kv_heads, segs, rates, options = case
    if options.get("split"):  # many position and head groups, as very long sequences get
        monkeypatch.setattr(fused, "MIN_GROUP_POSITIONS", 1)
        monkeypatch.setattr(fused, "SCRATCH_SHARE", 1000)
    ran: list[str] = []
    real = triton_backend.TritonBackend.run_launches

    def guarded(self: Any, key: Any, tensors: Any, launches: Any, keep: Any = None) -> None:
        def checked() -> None:
            with _no_allocation(monkeypatch):
                launches()
            ran.append(key[0])

        real(self, key, tensors, checked, keep)

    monkeypatch.setattr(triton_backend.TritonBackend, "run_launches", guarded)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, n, heads, 32, generator=gen)
    k, v = (torch.randn(1, n, kv_heads, 32, generator=gen) for _ in "kv")
    mask = (torch.rand(1, n, generator=gen) < 0.2).to(device) if options.get("mask") else None
    leaves = [x.to(device, dtypes[0]).requires_grad_() for x in (q, k, v)]
    out = dilated_attention(*leaves, segs, rates, is_causal=True, key_padding_mask=mask,
                            cu_seqlens=options.get("cu_seqlens"), backend="triton")  # fmt: skip
    torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert ran[-2:] == ["fused_forward", "fused_backward"]
