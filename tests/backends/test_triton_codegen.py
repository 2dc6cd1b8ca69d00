"""What our Triton kernels compile to for an H100 (sm90), checked on any machine that has Triton's
NVIDIA compiler: compiling for a GPU needs no GPU (Triton's device queries are answered here).

Catches code generation that the numbers cannot show: row loads and stores that lost their
16-byte vectors run the same arithmetic, correctly, at half the speed (Note [Specialization and
first calls] in ``backends/triton_kernels/launchers.py``).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from dilated_attention.backends import triton as triton_backend
from dilated_attention.backends.triton_kernels.tiles import tile_configs
from dilated_attention.core.autograd import Inputs
from dilated_attention.core.contract import Window
from dilated_attention.core.execution.fused_runner import FusedRunner

pytest.importorskip("triton.backends.nvidia.compiler", reason="needs Triton's NVIDIA compiler")
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

pytestmark = pytest.mark.skipif(
    triton_backend.interpreting(), reason="TRITON_INTERPRET=1: the interpreter compiles nothing"
)

SM90 = (9, 0)
SCALAR_16_BIT_ACCESS = r"(?:ld|st)\.global(?:\.\w+)*\.b16\b"
VECTOR_ACCESS = r"(?:ld|st)\.global(?:\.\w+)*\.v4\.|cp\.async\.cg\.shared\.global"
#: A LongNet-like schedule with strided branches, at a length whose (B, H, N) strides are not
#: multiples of 16 (they must not cost the row tensors their alignment).
BRANCHES = ((256, 1), (512, 2), (1024, 4))
SEQ_LEN = 1000


class _DriverForSM90:
    """Answers the device, stream and target queries Triton makes while compiling."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", SM90[0] * 10 + SM90[1], 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_device_interface(self) -> Any:
        return torch.cuda


def _sm90_ptx(
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    head_dim: int,
    kv_heads: int,
    causal: bool,
    softcap: float | None = None,
    window: Window | None = None,
) -> list[tuple[str, str]]:
    """(kernel name, PTX) of every distinct kernel of a family's forward and backward: the
    fused engine's, or with a ``window`` a dense call's (the window's kernels)."""
    kernels = triton_backend._kernels()
    recorded: list[Any] = []
    monkeypatch.setattr(
        kernels, "compile_launches", lambda launches, workers=None: recorded.extend(launches)
    )
    monkeypatch.setattr(
        triton_backend, "_tiles", lambda x: tile_configs(SM90, x.shape[-1], x.dtype)
    )
    q = torch.randn(2, SEQ_LEN, 4, head_dim, dtype=dtype)
    k, v = (torch.randn(2, SEQ_LEN, kv_heads, head_dim, dtype=dtype) for _ in "kv")
    backend, scale = triton_backend.TritonBackend(), head_dim**-0.5
    if window is None:
        runner = FusedRunner(BRANCHES, backend, causal, scale, softcap=softcap)
        runner.compile_ahead(Inputs(q, k, v, None), needs_grad=True)
    else:
        scores = {"softcap": softcap, "window": window}
        with kernels.compile_ahead():  # the launches recorded, not run
            res = backend._forward(q, k, v, scale=scale, is_causal=causal, key_mask=None,
                                   dropout_p=0.0, **scores)  # fmt: skip
            backend._backward(q, q, k, v, q, res.lse, None, scale=scale, is_causal=causal,
                              key_mask=None, dropout_p=0.0, **scores)  # fmt: skip
    assert {launch.kernel.__name__ for launch in recorded} >= {"_forward_kernel", "_dq_kernel"}
    monkeypatch.setattr(driver, "_active", _DriverForSM90())
    distinct = {launch.specialization(): launch for launch in recorded}
    return [(launch.kernel.__name__, launch.compile().asm["ptx"]) for launch in distinct.values()]


@pytest.mark.parametrize(
    ("dtype", "head_dim", "kv_heads", "causal"),
    [
        (torch.bfloat16, 64, 4, False),
        (torch.float16, 128, 2, True),
    ],
    ids=["bf16-d64", "fp16-d128-gqa-causal"],
)
def test_rows_load_and_store_as_16_byte_vectors(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, head_dim: int, kv_heads: int, causal: bool
) -> None:
    """No 16-bit value is loaded or stored alone: q, k, v, out, dout and the gradients move in
    16-byte vectors (``ld``/``st.global.v4``, ``cp.async`` of 16 bytes), in every kernel."""
    for name, ptx in _sm90_ptx(monkeypatch, dtype, head_dim, kv_heads, causal):
        scalar = re.findall(SCALAR_16_BIT_ACCESS, ptx)
        assert not scalar, f"{name}: {len(scalar)} scalar 16-bit global accesses ({scalar[0]})"
        vectors = re.findall(VECTOR_ACCESS, ptx)
        assert vectors, f"{name}: no 16-byte global access at all"


@pytest.mark.parametrize(
    ("causal", "softcap", "window"),
    [(False, 30.0, None), (True, 30.0, Window(127, 0)), (False, None, Window(64, 63))],
    ids=["fused-softcap", "dense-causal-window-softcap", "dense-window"],
)
def test_soft_capped_and_windowed_kernels_compile_with_16_byte_vectors(
    monkeypatch: pytest.MonkeyPatch, causal: bool, softcap: float | None, window: Window | None
) -> None:
    """The ``SOFTCAP`` and ``WINDOW`` variants (Note [Soft-capped scores in the kernels], Note
    [Local windows in the kernels]) compile for sm90 and keep every row access a 16-byte
    vector; soft-capping adds ``ex2`` (the tanh) to the forward."""
    ptx = _sm90_ptx(monkeypatch, torch.bfloat16, 64, 2, causal, softcap, window)
    for name, code in ptx:
        assert not re.findall(SCALAR_16_BIT_ACCESS, code), name
        assert re.findall(VECTOR_ACCESS, code), name
    if softcap is not None:
        plain = _sm90_ptx(monkeypatch, torch.bfloat16, 64, 2, causal, None, window)

        def exponents(kernels: list[tuple[str, str]]) -> int:
            return sum(code.count("ex2.approx") for name, code in kernels if "forward" in name)

        assert exponents(ptx) > exponents(plain)
