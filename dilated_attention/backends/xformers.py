"""``xformers``: ``xformers.ops.fmha`` memory-efficient attention, with the log-sum-exp.

Forward through ``memory_efficient_attention_forward_requires_grad`` (returns ``(out, lse)``),
backward through ``memory_efficient_attention_backward(grad, output, lse, query, key, value,
attn_bias, p, scale)``, which takes ``output`` and ``lse`` as inputs: the hook for merged
statistics. xformers picks the operator (flash, CUTLASS, ...) for each call itself.

Shapes: q (B, Nq, H, D), k/v (B, Nk, H, D) (the base class expands GQA key/value heads: xformers
only has a forward-only 5-D GQA layout), out (B, Nq, H, D), lse (B, H, Nq) float32. Some xformers
operators pad the lse rows to a multiple of 32; it is cut back to Nq here, and the backward pads
what it is given itself.

Causal masking is ``LowerTriangularMask``, top-left aligned like ours, so rectangular causal
calls are fine (xformers' dispatcher routes them past the bottom-right-only flash operator).

Since 0.0.35 xformers ships no attention kernels of its own (it calls PyTorch's and flash-attn's),
and a wheel can import cleanly yet have no usable kernel for this torch build: ``import_reasons``
covers the import only, and the base class's cached launch probe catches the rest.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch

from ._compat import _import_failure, _last_dim_contiguous
from .base import Backend, KernelOutput


def _fmha() -> ModuleType:
    # Imported here, never at module import: xformers is optional, and a wheel built for another
    # torch can fail on import with errors other than ImportError.
    return importlib.import_module("xformers.ops.fmha")


def _causal_bias(fmha: ModuleType) -> Any:
    mask_cls = getattr(fmha, "LowerTriangularMask", None)
    if mask_cls is None:
        mask_cls = importlib.import_module("xformers.ops.fmha.attn_bias").LowerTriangularMask
    return mask_cls()


class XformersBackend(Backend):
    """xformers ``memory_efficient_attention`` (``pip install xformers``); fp16/bf16/fp32."""

    name = "xformers"
    verified_on_hardware = False  # tested against fakes of xformers only
    description = "xformers.ops.fmha memory-efficient attention; fp32 too, GQA by expansion"
    devices = frozenset({"cuda"})
    dtypes = frozenset({torch.float16, torch.bfloat16, torch.float32})
    # Rows must be 16-byte aligned for the half kernels (8 elements), 4 elements for fp32.
    head_dim_multiple = 8
    min_compute_capability = (6, 0)
    supports_dropout = False  # the non-autograd forward/backward refuse p > 0
    aux_only_for_dropout = True  # no aux at all
    native_gqa = False

    def import_reasons(self) -> list[str]:
        try:
            fmha = _fmha()
            if not (
                hasattr(fmha, "memory_efficient_attention_forward_requires_grad")
                or hasattr(fmha, "_memory_efficient_attention_forward_requires_grad")
            ):
                return ["xformers.ops.fmha has no forward that returns the lse"]
            if not hasattr(fmha, "memory_efficient_attention_backward"):
                return ["xformers.ops.fmha has no memory_efficient_attention_backward"]
        except Exception as exc:  # any import-time failure is a reason, never a crash
            return [_import_failure("xformers", exc)]
        return []

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
        fmha = _fmha()
        q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
        bias = _causal_bias(fmha) if is_causal else None
        public = getattr(fmha, "memory_efficient_attention_forward_requires_grad", None)
        if public is not None:
            out, lse = public(q, k, v, attn_bias=bias, p=0.0, scale=scale)
        else:
            inp = fmha.Inputs(query=q, key=k, value=v, attn_bias=bias, p=0.0, scale=scale)
            out, ctx = fmha._memory_efficient_attention_forward_requires_grad(inp, op=None)
            lse = ctx.lse
        return KernelOutput(out, lse[..., : q.shape[1]].float())

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
        fmha = _fmha()
        dout, out = dout.to(q.dtype), out.to(q.dtype)
        dout, q, k, v, out = (_last_dim_contiguous(x) for x in (dout, q, k, v, out))
        bias = _causal_bias(fmha) if is_causal else None
        grads = fmha.memory_efficient_attention_backward(
            dout, out, lse.contiguous(), q, k, v, attn_bias=bias, p=0.0, scale=scale
        )
        dq, dk, dv = grads[:3]
        return dq, dk, dv
