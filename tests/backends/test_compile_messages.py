"""What the kernels' first calls print (``backends/triton.py``,
``backends/flash_attn4/__init__.py``): the Triton backend's compile line once per shape family
up to segment lengths (generation that recomputes every step clips the segments to each new
length), and FlashAttention-4 calls without the CuTe DSL's ``aux_data`` warning. Fake kernels
stand in: no GPU, Triton or FA4 needed.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import types
import warnings
from typing import Any

import pytest
import torch

from dilated_attention.backends import flash_attn4
from dilated_attention.backends import triton as triton_backend
from dilated_attention.core.geometry.segment import effective_branches

HEADS, DIM = 4, 64


def _family(seq_len: int, grad: bool = False) -> tuple[Any, ...]:
    """A LongNet schedule's shape family at ``seq_len``, as ``compile_ahead`` in
    ``core/execution/fused_runner.py`` keys it (segments clipped to the length)."""
    segs, rates = effective_branches(seq_len, HEADS, (8, 16), (1, 2))
    branches = tuple(zip(segs, rates, strict=True))
    return (torch.device("cuda", 0), torch.float16, torch.Size([HEADS, DIM]), HEADS, branches,
            True, False, grad, False, False, False)  # fmt: skip


def test_recompute_generation_logs_one_compile_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """15 lengths of one schedule: every new family still compiles ahead, one WARNING line,
    the rest at DEBUG; a family that differs in more than its segment lengths gets its own
    line, and a family seen before neither compiles nor logs."""
    compiles: list[int] = []

    def compile_ahead() -> contextlib.AbstractContextManager[None]:
        compiles.append(1)
        return contextlib.nullcontext()

    monkeypatch.setattr(triton_backend, "interpreting", lambda: False)
    monkeypatch.setattr(triton_backend, "_kernels", lambda: types.SimpleNamespace(
        compile_ahead=compile_ahead))  # fmt: skip
    backend = triton_backend.TritonBackend()
    caplog.set_level(logging.DEBUG, logger="dilated_attention")
    for n in range(2, 17):
        assert backend.begin_compile(_family(n)) is not None
    assert backend.begin_compile(_family(16)) is None
    assert backend.begin_compile(_family(16, grad=True)) is not None
    lines = [r for r in caplog.records if "compiling the Triton kernels" in r.getMessage()]
    warned = [r.getMessage() for r in lines if r.levelno == logging.WARNING]
    assert len(compiles) == 16 and len(lines) == 16
    assert len(warned) == 2, warned
    assert "branches [(2, 1), (2, 2)]" in warned[0] and "forward and backward" in warned[1]


# -- FlashAttention-4 -----------------------------------------------------------------------------
#: The CuTe DSL's message (nvidia-cutlass-dsl 4.8.1, ``DiagId.ARG_UNSUPPORTED_TYPE``) as it names
#: FA4's argument.
DSL_MESSAGE = (
    "Argument aux_data (position 17) cannot be converted to a JitArgument for function "
    "'__call__'. Its type `<class 'flash_attn.cute.utils.AuxData'>` is not supported. If the "
    "value is known at compile time, annotate it: `aux_data: Constexpr`. Otherwise, implement "
    "the `JitArgument` or `DynamicExpression` protocol for type `<class "
    "'flash_attn.cute.utils.AuxData'>`, or register a custom argument adapter."
)


def _install_warning_fa4(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake ``flash_attn.cute.interface`` whose entry points warn as a first compile does:
    the DSL's aux_data message and another one, which must pass."""

    def _flash_attn_fwd(q, k, v, softmax_scale=None, causal=False, return_lse=False,
                        out=None, lse=None):  # fmt: skip
        warnings.warn(DSL_MESSAGE, UserWarning, stacklevel=2)
        warnings.warn("forward: some other warning", UserWarning, stacklevel=2)
        b, n, h, _ = q.shape
        return torch.zeros_like(q), torch.zeros(b, h, n)

    def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, dq=None,
                        dk=None, dv=None):  # fmt: skip
        warnings.warn(DSL_MESSAGE.replace("17", "21"), UserWarning, stacklevel=2)
        return dq, dk, dv

    entry_points = {"_flash_attn_fwd": _flash_attn_fwd, "_flash_attn_bwd": _flash_attn_bwd}
    for name, attrs in (("flash_attn", {}), ("flash_attn.cute", {}),
                        ("flash_attn.cute.interface", entry_points)):  # fmt: skip
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**attrs))


def test_flash_attn4_calls_drop_the_dsl_aux_data_warning_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under an "always" filter set before the call (what a user's or pytest's filters may be),
    the forward and backward let every warning through but the DSL's aux_data one; the filter
    is added once, and a warning shown "once" elsewhere is not shown again after FA4 calls
    (adding a filter, as a ``catch_warnings`` around every call did, resets that record)."""
    _install_warning_fa4(monkeypatch)
    backend = flash_attn4.FlashAttn4Backend()
    q, k, v = (torch.randn(1, 8, 2, 16, dtype=torch.float16) for _ in "qkv")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            res = backend.forward(q, k, v, scale=0.25, is_causal=False)
            backend.backward(q, q, k, v, res.out, res.lse, res.aux, scale=0.25, is_causal=False)
        ours = [f for f in warnings.filters if f[0] == "ignore" and f[2] is UserWarning]
        assert len(ours) == 1, ours
        warnings.warn(DSL_MESSAGE, UserWarning, stacklevel=1)  # the filter is process-wide
    assert [str(w.message) for w in caught] == ["forward: some other warning"] * 2
    flash_attn4._filter_dsl_warning()  # the filter, as a first call leaves it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("once")
        warnings.warn("shown once", UserWarning, stacklevel=1)
        backend.forward(q, k, v, scale=0.25, is_causal=False)
        warnings.warn("shown once", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught].count("shown once") == 1
