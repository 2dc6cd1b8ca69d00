"""PyTorch's fused SDPA kernels, called through the aten ops that return the log-sum-exp.

``cpu_flash``, ``sdpa_flash`` (FlashAttention-2 inside PyTorch), ``sdpa_efficient`` (the CUTLASS
memory-efficient kernel) and ``sdpa_cudnn`` (cuDNN's fused attention). The public
``F.scaled_dot_product_attention`` returns no log-sum-exp, so these call the private
``aten::_scaled_dot_product_*`` forward and backward ops, whose backward takes ``out`` and
``logsumexp`` as inputs: the hook for merged statistics. The ops take (B, H, N, D); our (B, N, H, D)
rows go in as transposed views, with no copy.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import Backend, KernelInputs, KernelOutput

_aten = torch.ops.aten
_HALF = frozenset({torch.float16, torch.bfloat16})


def _bhnd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


def _additive_bias(
    key_mask: torch.Tensor | None, num_heads: int, query_len: int, dtype: torch.dtype, align: int
) -> torch.Tensor | None:
    """(B, Hm, Nk) bool 'ignore' mask -> additive (B, H, Nq, Nk) bias view (0 or -inf).

    The storage's last dim is padded to a multiple of ``align`` (the memory-efficient kernel reads
    the bias in aligned vectors); the returned tensor is a broadcasting view of it.
    """
    if key_mask is None:
        return None
    batch, heads_m, key_len = key_mask.shape
    padded = -(-key_len // align) * align
    storage = torch.zeros(batch, heads_m, 1, padded, dtype=dtype, device=key_mask.device)
    storage[..., :key_len].masked_fill_(key_mask.unsqueeze(2), float("-inf"))
    return storage[..., :key_len].expand(batch, num_heads, query_len, key_len)


def _has_op(name: str) -> list[str]:
    return [] if hasattr(_aten, name) else [f"torch {torch.__version__} has no aten::{name}"]


class CpuFlashBackend(Backend):
    """``aten::_scaled_dot_product_flash_attention_for_cpu``: PyTorch's tiled CPU kernel."""

    name = "cpu_flash"
    description = "PyTorch's flash-attention CPU kernel (aten)"
    devices = frozenset({"cpu"})
    dtypes = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
    supports_mask = True
    # The kernel's own GQA backward sums dk/dv over query heads in the input dtype, which loses
    # bf16 precision; expanding and reducing with one float32-accumulated sum is exact to rounding.
    native_gqa = False

    def import_reasons(self) -> list[str]:
        return _has_op("_scaled_dot_product_flash_attention_for_cpu")

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
        bias = _additive_bias(key_mask, q.shape[2], q.shape[1], q.dtype, 1)
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            _bhnd(q), _bhnd(k), _bhnd(v), 0.0, is_causal, attn_mask=bias, scale=scale
        )
        return KernelOutput(_bhnd(out), lse)

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
        bias = _additive_bias(key_mask, q.shape[2], q.shape[1], q.dtype, 1)
        grads = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _bhnd(dout), _bhnd(q), _bhnd(k), _bhnd(v), _bhnd(out), lse,
            0.0, is_causal, attn_mask=bias, scale=scale,
        )  # fmt: skip
        dq, dk, dv = (_bhnd(g) for g in grads)
        return dq, dk, dv


class _CudaSdpaBackend(Backend):
    devices = frozenset({"cuda"})
    supports_rectangular_causal = False

    def probe(self, device: torch.device) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA is not available")
        super().probe(device)


class SdpaFlashBackend(_CudaSdpaBackend):
    """``aten::_scaled_dot_product_flash_attention``: FlashAttention-2 as built into PyTorch."""

    name = "sdpa_flash"
    description = "FlashAttention-2 inside PyTorch (aten), sm80+"
    dtypes = _HALF
    max_head_dim = 256
    head_dim_multiple = 8
    min_compute_capability = (8, 0)
    supports_dropout = True

    def import_reasons(self) -> list[str]:
        reasons = _has_op("_scaled_dot_product_flash_attention")
        if not reasons and not torch.backends.cuda.is_flash_attention_available():
            reasons.append("this torch build has no flash attention kernels")
        return reasons

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
        res = _aten._scaled_dot_product_flash_attention(
            _bhnd(q), _bhnd(k), _bhnd(v), dropout_p, is_causal, False, scale=scale
        )
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = res
        return KernelOutput(_bhnd(out), lse, (cum_q, cum_k, max_q, max_k, seed, offset))

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
        cum_q, cum_k, max_q, max_k, seed, offset = aux
        grads = _aten._scaled_dot_product_flash_attention_backward(
            _bhnd(dout), _bhnd(q), _bhnd(k), _bhnd(v), _bhnd(out), lse.contiguous(),
            cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset, scale=scale,
        )  # fmt: skip
        dq, dk, dv = (_bhnd(g) for g in grads)
        return dq, dk, dv


class SdpaEfficientBackend(_CudaSdpaBackend):
    """``aten::_scaled_dot_product_efficient_attention``: the CUTLASS memory-efficient kernel."""

    name = "sdpa_efficient"
    description = "memory-efficient (CUTLASS) kernel inside PyTorch (aten), sm50+"
    dtypes = frozenset({torch.float16, torch.bfloat16, torch.float32})
    head_dim_multiple = 8
    min_compute_capability = (5, 0)
    supports_mask = True
    supports_dropout = True
    native_gqa = False
    _LSE_ALIGN = 32

    def import_reasons(self) -> list[str]:
        return _has_op("_scaled_dot_product_efficient_attention")

    def not_supported_reasons(self, inputs: KernelInputs) -> list[str]:
        reasons = super().not_supported_reasons(inputs)
        if inputs.device.type == "cuda" and inputs.dtype == torch.bfloat16:
            cc = torch.cuda.get_device_capability(inputs.device)
            if cc < (8, 0):
                # PyTorch builds this kernel's bfloat16 variant for sm80+ only (sdp_utils.cpp).
                reasons.insert(
                    0, f"bfloat16 needs compute capability >= sm80, device is sm{cc[0]}{cc[1]}"
                )
        return reasons

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
        bias = _additive_bias(key_mask, q.shape[2], q.shape[1], q.dtype, 16)
        out, lse, seed, offset = _aten._scaled_dot_product_efficient_attention(
            _bhnd(q), _bhnd(k), _bhnd(v), bias, True, dropout_p, is_causal, scale=scale
        )
        return KernelOutput(_bhnd(out), lse[..., : q.shape[1]], (seed, offset))

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
        seed, offset = aux
        bias = _additive_bias(key_mask, q.shape[2], q.shape[1], q.dtype, 16)
        rows = lse.shape[-1]
        padded = torch.zeros(
            *lse.shape[:-1], -(-rows // self._LSE_ALIGN) * self._LSE_ALIGN,
            dtype=torch.float32, device=lse.device,
        )  # fmt: skip
        padded[..., :rows] = lse
        grads = _aten._scaled_dot_product_efficient_attention_backward(
            _bhnd(dout), _bhnd(q), _bhnd(k), _bhnd(v), bias, _bhnd(out), padded,
            seed, offset, dropout_p, [True, True, True, False], is_causal, scale=scale,
        )  # fmt: skip
        dq, dk, dv = (_bhnd(g) for g in grads[:3])
        return dq, dk, dv


class SdpaCudnnBackend(_CudaSdpaBackend):
    """``aten::_scaled_dot_product_cudnn_attention``: cuDNN's fused attention, fastest on Hopper."""

    name = "sdpa_cudnn"
    description = "cuDNN fused attention inside PyTorch (aten), sm80+"
    dtypes = _HALF
    max_head_dim = 128
    head_dim_multiple = 8
    min_compute_capability = (8, 0)
    native_gqa = False
    min_rows = 2

    def import_reasons(self) -> list[str]:
        reasons = _has_op("_scaled_dot_product_cudnn_attention")
        if not reasons and not torch.backends.cudnn.is_available():
            reasons.append("cuDNN is not available in this torch build")
        return reasons

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
        res = _aten._scaled_dot_product_cudnn_attention(
            _bhnd(q), _bhnd(k), _bhnd(v), None, True, 0.0, is_causal, False, scale=scale
        )
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = res
        if lse.dim() == 4:
            lse = lse.squeeze(-1)
        return KernelOutput(_bhnd(out), lse, (cum_q, cum_k, max_q, max_k, seed, offset))

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
        cum_q, cum_k, max_q, max_k, seed, offset = aux
        out_t = _bhnd(out)
        dout_t = _bhnd(dout)
        if dout_t.stride() != out_t.stride():
            # cuDNN's backward wants dout laid out like out; empty_like keeps out's strides.
            dout_t = torch.empty_like(out_t).copy_(dout_t)
        grads = _aten._scaled_dot_product_cudnn_attention_backward(
            dout_t, _bhnd(q), _bhnd(k), _bhnd(v), out_t, lse.unsqueeze(-1).contiguous(),
            seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, is_causal, scale=scale,
        )  # fmt: skip
        dq, dk, dv = (_bhnd(g) for g in grads)
        return dq, dk, dv
