"""PyTorch's fused SDPA kernels, called through the aten ops that return the log-sum-exp.

``cpu_flash``, ``sdpa_flash`` (FlashAttention-2 inside PyTorch), ``sdpa_efficient`` (the CUTLASS
memory-efficient kernel) and ``sdpa_cudnn`` (cuDNN's fused attention). The public
``F.scaled_dot_product_attention`` returns no log-sum-exp, so these call the private
``aten::_scaled_dot_product_*`` forward and backward ops, whose backward takes ``out`` and
``logsumexp`` as inputs: the hook for merged statistics. The ops take (B, H, N, D); our (B, N, H, D)
rows go in as transposed views, with no copy.

Note [Forward ops through torch's bindings]
    The forward ops also have generated Python bindings (``torch._scaled_dot_product_*``): the
    same dispatcher entry and kernel as ``torch.ops.aten``, whose Python-side packet call and
    schema matching of the arguments cost about 2 us more per call on the host, on every dense
    call. So the forwards call those bindings where torch has them (:func:`_binding`); the
    backward ops have none and go through ``torch.ops.aten``.

Note [NaN rows in the CPU flash kernel]
    ``_scaled_dot_product_flash_attention_for_cpu`` without a mask takes each row's maximum score
    over vectors of the CPU's SIMD width and finishes the remainder with a scalar maximum that
    skips NaN. A row whose scores all fall in that scalar remainder (fewer keys than one vector:
    16 in float32, bfloat16 and float16, 8 in float64 on AVX-512; half that on AVX2) and are all
    NaN looks fully masked: output 0, lse 0. A NaN query row in a short last segment, or in a
    dilated branch with ``w / r`` below the width, would lose its NaN that way
    (tests/ops/test_extreme_inputs.py, ``test_nan_rows_stay_nan``, runs such rows). With an
    additive mask the kernel reduces the whole row with vector operations, which keep NaN. So
    calls whose rows see fewer keys than the width pass an all-zero mask (forward and backward
    alike): the same kernel and arithmetic, NaN kept. The width is measured once per dtype with
    the kernel itself (``_nan_safety``), not assumed from the CPU's name, and so is the masked
    path's behaviour; should that drop NaN too, such calls go to the plain-PyTorch kernel
    (``core/reference.py``) instead. Calls with at least that many keys, the common case, run
    exactly as before, and the choice is made from shapes alone (no synchronization). A causal
    call's first rows see few keys, but the kernel's smallest query block (32 rows) already
    reads a whole vector of scores, so there only ``min(Nq, Nk)`` counts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..core.higher_order import CreateGraphSwap
from ..core.reference import reference_backward, reference_forward
from .base import Backend, KernelInputs, KernelOutput

_aten = torch.ops.aten
_HALF = frozenset({torch.float16, torch.bfloat16})


def _binding(name: str) -> Callable[..., Any]:
    """The forward op ``aten::<name>`` through ``torch.<name>`` where torch has that binding,
    else through ``torch.ops.aten`` when called (Note [Forward ops through torch's bindings])."""
    direct = getattr(torch, name, None)
    if direct is not None:
        return direct  # type: ignore[no-any-return]
    return lambda *args, **kwargs: getattr(_aten, name)(*args, **kwargs)


_CPU_FLASH = _binding("_scaled_dot_product_flash_attention_for_cpu")
_FLASH = _binding("_scaled_dot_product_flash_attention")
_EFFICIENT = _binding("_scaled_dot_product_efficient_attention")
_CUDNN = _binding("_scaled_dot_product_cudnn_attention")

#: Key counts probed for Note [NaN rows in the CPU flash kernel] (a vector of 64 float32 is
#: 2048 bits, SVE's maximum).
_NAN_PROBE_MAX_KEYS = 128


@dataclass(frozen=True)
class _NanSafety:
    """How the CPU flash kernel treats an all-NaN row, for one dtype.

    Attributes:
        keys: the smallest key count from which the kernel without a mask keeps such a row NaN.
        masked_keeps_nan: with an additive mask it keeps it NaN at every smaller key count.
    """

    keys: int
    masked_keeps_nan: bool


#: dtype -> its measured :class:`_NanSafety` (Note [NaN rows in the CPU flash kernel]).
_NAN_SAFETY: dict[torch.dtype, _NanSafety] = {}


def _keeps_nan(dtype: torch.dtype, keys: int, masked: bool) -> bool:
    """Whether the kernel returns NaN for an all-NaN query row against ``keys`` keys.

    Deterministic inputs: a probe must not advance the caller's random generators.
    """
    q = torch.full((1, 1, 1, 8), float("nan"), dtype=dtype)
    kv = torch.ones(1, 1, keys, 8, dtype=dtype)
    bias = torch.zeros(1, 1, 1, keys, dtype=dtype) if masked else None
    with torch.no_grad():
        out, _ = _aten._scaled_dot_product_flash_attention_for_cpu(
            q, kv, kv, 0.0, False, attn_mask=bias
        )
    return bool(torch.isnan(out).all())


def _nan_safety(dtype: torch.dtype) -> _NanSafety:
    """The kernel's :class:`_NanSafety` for ``dtype``, measured on first use (the backend's probe
    measures every dtype ahead of time, so traced code only reads the cache)."""
    if dtype not in _NAN_SAFETY:
        dropped = [n for n in range(1, _NAN_PROBE_MAX_KEYS + 1) if not _keeps_nan(dtype, n, False)]
        keys = max(dropped, default=0) + 1
        masked = all(_keeps_nan(dtype, n, True) for n in range(1, keys))
        _NAN_SAFETY[dtype] = _NanSafety(keys, masked)
    return _NAN_SAFETY[dtype]


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
    reads_strided_rows = True  # PyTorch's CPU flash kernel: any strides, last dim contiguous
    description = "PyTorch's flash-attention CPU kernel (aten)"
    devices = frozenset({"cpu"})
    dtypes = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
    supports_mask = True
    # The kernel's own GQA backward sums dk/dv over query heads in the input dtype, which loses
    # bf16 precision; expanding and reducing with one float32-accumulated sum is exact to rounding.
    native_gqa = False
    aux_only_for_dropout = True  # no aux at all

    def import_reasons(self) -> list[str]:
        return _has_op("_scaled_dot_product_flash_attention_for_cpu")

    def probe(self, device: torch.device) -> None:
        """Launch the kernel, forward and backward, and measure per dtype how it treats NaN rows
        (Note [NaN rows in the CPU flash kernel])."""
        for dtype in sorted(self.dtypes, key=str):
            _nan_safety(dtype)
        q = torch.linspace(-1.0, 1.0, 1 * 2 * 128 * 64).view(1, 2, 128, 64)
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.0, True)
        _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            torch.ones_like(out), q, q, q, out, lse, 0.0, True
        )
        super().probe(device)

    @staticmethod
    def _nan_route(q: torch.Tensor, k: torch.Tensor, is_causal: bool) -> str:
        """``"kernel"``, or for calls whose rows may see too few keys for the unmasked kernel to
        keep a NaN, ``"masked"`` (the kernel with a mask) or ``"math"`` (Note [NaN rows in the
        CPU flash kernel]); decided from shapes alone.

        Args:
            q: (B, Nq, H, D); k: (B, Nk, Hkv, D).
        """
        safety = _nan_safety(q.dtype)
        keys = min(q.shape[1], k.shape[1]) if is_causal else k.shape[1]
        if keys >= safety.keys:
            return "kernel"
        return "masked" if safety.masked_keeps_nan else "math"

    @staticmethod
    def _bias(
        key_mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, route: str
    ) -> torch.Tensor | None:
        """The additive mask for the kernel: the key mask's, or all zeros on the ``"masked"``
        route; (B, H, Nq, Nk) views."""
        batch, query_len, heads, _ = q.shape
        if key_mask is None and route == "masked":
            zeros = torch.zeros(1, 1, 1, k.shape[1], dtype=q.dtype, device=q.device)
            return zeros.expand(batch, heads, query_len, k.shape[1])
        return _additive_bias(key_mask, heads, query_len, q.dtype, 1)

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
        route = self._nan_route(q, k, is_causal)
        if route == "math":
            out, lse = reference_forward(
                q, k, v, scale=scale, is_causal=is_causal, key_mask=key_mask
            )
            return KernelOutput(out, lse)
        bias = None if key_mask is None and route == "kernel" else self._bias(key_mask, q, k, route)
        out, lse = _CPU_FLASH(
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
        route = self._nan_route(q, k, is_causal)  # the forward's, from the same shapes
        if route == "math":
            return reference_backward(
                dout, q, k, v, out, lse, scale=scale, is_causal=is_causal, key_mask=key_mask
            )
        bias = None if key_mask is None and route == "kernel" else self._bias(key_mask, q, k, route)
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _bhnd(dout), _bhnd(q), _bhnd(k), _bhnd(v), _bhnd(out), lse,
            0.0, is_causal, attn_mask=bias, scale=scale,
        )  # fmt: skip
        return _bhnd(dq), _bhnd(dk), _bhnd(dv)


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
        res = _FLASH(_bhnd(q), _bhnd(k), _bhnd(v), dropout_p, is_causal, False, scale=scale)
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
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
            _bhnd(dout), _bhnd(q), _bhnd(k), _bhnd(v), _bhnd(out), lse.contiguous(),
            cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset, scale=scale,
        )  # fmt: skip
        return _bhnd(dq), _bhnd(dk), _bhnd(dv)


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
        out, lse, seed, offset = _EFFICIENT(
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


class _UpstreamLike:
    """A pre-hook for the node of cuDNN's recorded forward: the upstream gradient laid out like
    the output, as cuDNN's backward reads it (the backward of :class:`SdpaCudnnBackend` copies it
    so too). Torch's own backward of the op takes another layout, but on an H100 (torch 2.11,
    cuDNN 9.19) it gave wrong gradients for an upstream gradient in (B, H, N, D) memory order
    in a process where calls of the same shape had run with the output's layout before (the
    same test passed alone; tests/ops/test_recorded_dense.py runs both in one process).

    Args:
        strides: the output's strides, (B, H, N, D) as the op returned it.
    """

    def __init__(self, strides: tuple[int, ...]) -> None:
        self.strides = strides

    def __call__(
        self, grad_outputs: tuple[torch.Tensor | None, ...]
    ) -> tuple[torch.Tensor | None, ...] | None:
        dout = grad_outputs[0]
        if dout is None or dout.stride() == self.strides:
            return None
        return (_laid_out(dout, self.strides), *grad_outputs[1:])


def _laid_out(x: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    """``x`` itself where it has ``strides``, else a copy that has them (cuDNN's backward reads
    the upstream gradient laid out like the output)."""
    if x.stride() == strides:
        return x
    return torch.empty_strided(x.shape, strides, dtype=x.dtype, device=x.device).copy_(x)


def recorded_node_hooks(
    out: torch.Tensor, grads: Callable[[torch.Tensor], Sequence[torch.Tensor]]
) -> torch.Tensor:
    """Hang a recorded call's hooks on the node of ``out`` (the op's (B, H, N, D) output): the
    upstream gradient laid out like it (:class:`_UpstreamLike`) and ``grads`` under
    ``create_graph=True`` (``CreateGraphSwap``); returns ``out`` as (B, N, H, D), contiguous
    as the other paths' results (Note [Dense calls on torch's autograd] in
    ``core/higher_order.py``)."""
    node = out.grad_fn
    if node is not None:
        node.register_prehook(_UpstreamLike(out.stride()))
        node.register_hook(CreateGraphSwap(grads, _bhnd, _bhnd))
    return _bhnd(out).contiguous()


class SdpaCudnnBackend(_CudaSdpaBackend):
    """``aten::_scaled_dot_product_cudnn_attention``: cuDNN's fused attention, fastest on Hopper."""

    name = "sdpa_cudnn"
    description = "cuDNN fused attention inside PyTorch (aten), sm80+"
    dtypes = _HALF
    max_head_dim = 128
    head_dim_multiple = 8
    min_compute_capability = (8, 0)
    # The op takes fewer key/value heads than query heads and returns their gradients so
    # (torch 2.11, cuDNN 9.19: the same out, lse, dk and dv bit for bit as expanded heads): no
    # copy of k and v per call and no sum of dk and dv, which cost about 0.2-0.4 ms of host
    # time a training call at 16K-64K tokens on an H100 (launches issued while the GPU is busy
    # cost several times their idle host time) and 1 ms of GPU time at 64K.
    native_gqa = True
    min_rows = 2
    records_autograd = True

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
        res = _CUDNN(_bhnd(q), _bhnd(k), _bhnd(v), None, True, 0.0, is_causal, False, scale=scale)
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = res
        if lse.dim() == 4:
            lse = lse.squeeze(-1)
        return KernelOutput(_bhnd(out), lse, (cum_q, cum_k, max_q, max_k, seed, offset))

    def recorded_forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        grads: Callable[[torch.Tensor], Sequence[torch.Tensor]],
        *,
        scale: float,
        is_causal: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse, *_ = _CUDNN(
            _bhnd(q), _bhnd(k), _bhnd(v), None, True, 0.0, is_causal, False, scale=scale
        )  # fmt: skip
        lse = lse.squeeze(-1) if lse.dim() == 4 else lse
        return recorded_node_hooks(out, grads), lse.contiguous()

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
        dout_t = _laid_out(_bhnd(dout), out_t.stride())
        dq, dk, dv = _aten._scaled_dot_product_cudnn_attention_backward(
            dout_t, _bhnd(q), _bhnd(k), _bhnd(v), out_t, lse.unsqueeze(-1).contiguous(),
            seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, is_causal, scale=scale,
        )  # fmt: skip
        return _bhnd(dq), _bhnd(dk), _bhnd(dv)
