"""``flash_attn4``: FlashAttention-4 (``flash_attn.cute``, CuTe DSL, ``pip install flash-attn-4``).

Kernels are compiled just in time for Hopper (sm90) and Blackwell (sm100). This calls
``flash_attn.cute.interface._flash_attn_fwd`` with ``return_lse=True`` and
``_flash_attn_bwd(q, k, v, out, dout, lse, ...)``, the low-level backward that takes ``out`` and
``lse`` as inputs (the hook for merged statistics) and returns ``(dq, dk, dv)``. Arguments are
bound by name (``flash_attn2._bind``): the interface is still beta and its keyword lists grow.

Shapes: q (B, Nq, H, D), k/v (B, Nk, Hkv, D), out (B, Nq, H, D), lse (B, H, Nq) float32; the
(B, N, H, D) layout goes in without transposes. Causal masking is bottom-right aligned, so only
square causal calls are accepted. No dropout, no key mask; GQA is native.

Head dims (as of flash-attn-4 4.0.0b36): sm90 up to 256; sm100 up to 128, or exactly 256 (192
only with a 128 value dim, which this library never asks for).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch

from ._compat import (
    _bind,
    _capability,
    _grads_from,
    _import_failure,
    _last_dim_contiguous,
    _parameters,
)
from .base import Backend, KernelInputs, KernelOutput

_HALF = frozenset({torch.float16, torch.bfloat16})
_MAJORS = (9, 10)


def _interface() -> ModuleType:
    # Imported here, never at module import: it pulls in the CuTe DSL (cutlass, cuda-python).
    return importlib.import_module("flash_attn.cute.interface")


class FlashAttn4Backend(Backend):
    """FlashAttention-4 (``flash_attn.cute``): sm90/sm100, fp16/bf16, forward and backward."""

    name = "flash_attn4"
    reads_strided_rows = True  # any strides with the last dim contiguous
    description = "FlashAttention-4 (flash_attn.cute, CuTe DSL), sm90/sm100; native GQA"
    devices = frozenset({"cuda"})
    dtypes = _HALF
    max_head_dim = 256
    head_dim_multiple = 8
    min_compute_capability = (9, 0)
    supports_rectangular_causal = False
    supports_dropout = False
    native_gqa = True

    def import_reasons(self) -> list[str]:
        try:
            mod = _interface()
            fwd_params = _parameters(mod._flash_attn_fwd)
            bwd_params = _parameters(mod._flash_attn_bwd)
        except Exception as exc:  # any import-time failure is a reason, never a crash
            return [_import_failure("flash_attn.cute", exc)]
        missing = sorted({"softmax_scale", "causal"} - fwd_params.keys())
        # The backward must take out and lse as inputs: that is how merged statistics get in.
        missing += sorted({"out", "dout", "lse", "softmax_scale", "causal"} - bwd_params.keys())
        if missing:
            return [f"flash_attn.cute.interface entry points lack parameters {missing}"]
        return []

    def not_supported_reasons(self, inputs: KernelInputs) -> list[str]:
        cc = _capability(inputs)
        if cc is not None and cc >= (9, 0):
            if cc[0] not in _MAJORS:
                return [f"needs compute capability sm90 or sm100, device is sm{cc[0]}{cc[1]}"]
            dim = inputs.head_dim
            if cc[0] == 10 and 128 < dim != 256:
                return [f"head_dim {dim} on sm{cc[0]}{cc[1]}: needs <= 128 or exactly 256"]
        return super().not_supported_reasons(inputs)

    def _forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float,
        is_causal: bool,
        key_mask: torch.Tensor | None,
        dropout_p: float,
    ) -> KernelOutput:
        fwd = _interface()._flash_attn_fwd
        q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
        kwargs = _bind(
            fwd, {"q": q, "k": k, "v": v, "softmax_scale": scale, "causal": is_causal,
                  "return_lse": True},
        )  # fmt: skip
        if "return_lse" not in kwargs:
            # Releases before ``return_lse`` allocate the lse only when q requires grad.
            kwargs["q"] = q.detach().requires_grad_()
        out, lse = fwd(**kwargs)[:2]
        if lse is None:
            raise RuntimeError("flash_attn.cute._flash_attn_fwd returned no lse")
        return KernelOutput(out, lse)

    def _backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        aux: Any,
        *,
        scale: float,
        is_causal: bool,
        key_mask: torch.Tensor | None,
        dropout_p: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bwd = _interface()._flash_attn_bwd
        dout, out = dout.to(q.dtype), out.to(q.dtype)
        dout, q, k, v, out = (_last_dim_contiguous(x) for x in (dout, q, k, v, out))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        values = {
            "q": q, "k": k, "v": v, "out": out, "dout": dout, "lse": lse.contiguous(),
            "softmax_scale": scale, "causal": is_causal, "dq": dq, "dk": dk, "dv": dv,
        }  # fmt: skip
        res = bwd(**_bind(bwd, values))
        return _grads_from(res, dq, dk, dv)
