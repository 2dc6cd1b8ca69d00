"""``flash_attn3``: FlashAttention-3 (flash-attn's ``hopper/`` build), Hopper (sm90) only.

Loaded as ``flash_attn_3.flash_attn_interface``, else the top-level ``flash_attn_interface``
(both layouts have shipped). Like ``flash_attn2`` it calls the low-level forward and backward,
whose backward takes ``out`` and ``softmax_lse`` as inputs (the hook for merged statistics): the
module's ``_flash_attn_forward`` / ``_flash_attn_backward`` when present, else the registered ops
``torch.ops.flash_attn_3.fwd`` / ``bwd``. Their signatures differ between releases
(Note [FlashAttention-3 entry points]), so arguments are bound by name.

Shapes: q (B, Nq, H, D), k/v (B, Nk, Hkv, D), out (B, Nq, H, D), lse (B, H, Nq) float32; the
(B, N, H, D) layout goes in without transposes. Causal masking is bottom-right aligned, so only
square causal calls are accepted. No dropout, no key mask; GQA is native.

Note [FlashAttention-3 entry points]
    Older ``flash_attn_interface``: ``_flash_attn_forward(q, k, v, k_new, v_new, qv, out,
    cu_seqlens_q, ..., softmax_scale, causal, window_size=(-1, -1), ...)`` -> ``(out,
    softmax_lse, *rest)``, with the optional tensors as required positionals (filled with
    ``None``); ``_flash_attn_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, ..., dq, dk,
    dv, softmax_scale, causal, window_size=(-1, -1), ...)`` -> ``(dq, dk, dv, softmax_d)``.
    Newer (``torch.library.custom_op``): ``window_size_left/right`` ints and keyword defaults;
    the backward writes ``dq, dk, dv`` in place and returns ``softmax_d``. The ``torch.ops``
    schemas call the causal flag ``is_causal`` and, in older builds, give no defaults for
    ints such as ``num_splits`` and ``sm_margin`` (filled from ``_FILL``).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch

from ._compat import _bind, _capability, _grads_from, _import_failure, _last_dim_contiguous
from .base import Backend, KernelInputs, KernelOutput

_HALF = frozenset({torch.float16, torch.bfloat16})

# Values for parameters that some releases declare without a default (the kernel's own defaults).
_FILL: dict[str, Any] = {
    "window_size": (-1, -1), "window_size_left": -1, "window_size_right": -1,
    "attention_chunk": 0, "softcap": 0.0, "rotary_interleaved": True,
    "is_rotary_interleaved": True, "num_splits": 1, "pack_gqa": None, "sm_margin": 0,
    "deterministic": False,
}  # fmt: skip


def _interface() -> ModuleType:
    """The FlashAttention-3 Python interface module, in either packaging."""
    errors = []
    for name in ("flash_attn_3.flash_attn_interface", "flash_attn_interface"):
        try:
            return importlib.import_module(name)
        except Exception as exc:  # a broken extension raises more than ImportError
            first_line = (str(exc).strip().splitlines() or [""])[0][:200]
            errors.append(f"{name}: {type(exc).__name__}: {first_line}")
    raise ImportError("; ".join(errors))


def _entry_points(mod: ModuleType) -> tuple[Any, Any]:
    """``(forward, backward)``: the module's low-level functions, else the registered ops."""
    fwd = getattr(mod, "_flash_attn_forward", None)
    bwd = getattr(mod, "_flash_attn_backward", None)
    if fwd is not None and bwd is not None:
        return fwd, bwd
    ops = torch.ops.flash_attn_3
    return ops.fwd, ops.bwd


class FlashAttn3Backend(Backend):
    """FlashAttention-3 (``flash_attn_3``): Hopper kernels, fp16/bf16, head dim <= 256."""

    name = "flash_attn3"
    verified_on_hardware = False  # tested against fakes of flash-attn 3 only
    description = "FlashAttention-3 (flash_attn_3 / flash_attn_interface), sm90 only; native GQA"
    devices = frozenset({"cuda"})
    dtypes = _HALF
    # Head dims are rounded up to the compiled 64/96/128/192/256 kernels; 16-bit rows must be
    # 16-byte aligned.
    max_head_dim = 256
    head_dim_multiple = 8
    min_compute_capability = (9, 0)
    supports_rectangular_causal = False
    supports_dropout = False
    aux_only_for_dropout = True  # no aux at all
    native_gqa = True

    def import_reasons(self) -> list[str]:
        try:
            mod = _interface()
        except ImportError as exc:
            return [f"flash_attn_3 import failed: {exc}"]
        try:
            fwd, bwd = _entry_points(mod)
            _bind(fwd, {}, fill=_FILL, none_for_unknown=True)
            _bind(bwd, {}, fill=_FILL, none_for_unknown=True)
        except Exception as exc:  # any import-time failure is a reason, never a crash
            return [_import_failure("flash_attn_3", exc)]
        return []

    def not_supported_reasons(self, inputs: KernelInputs) -> list[str]:
        cc = _capability(inputs)
        if cc is not None and cc[0] > 9:
            # The wheels carry sm90a kernels (plus optional sm80 ones); nothing for Blackwell.
            return [f"needs compute capability sm90 (Hopper), device is sm{cc[0]}{cc[1]}"]
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
        fwd, _ = _entry_points(_interface())
        q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
        values = {
            "q": q, "k": k, "v": v, "softmax_scale": scale, "causal": is_causal,
            "is_causal": is_causal,
        }  # fmt: skip
        res = fwd(**_bind(fwd, values, fill=_FILL, none_for_unknown=True))
        return KernelOutput(res[0], res[1])

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
        _, bwd = _entry_points(_interface())
        dout, out = dout.to(q.dtype), out.to(q.dtype)
        dout, q, k, v, out = (_last_dim_contiguous(x) for x in (dout, q, k, v, out))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        values = {
            "dout": dout, "q": q, "k": k, "v": v, "out": out, "softmax_lse": lse.contiguous(),
            "dq": dq, "dk": dk, "dv": dv, "softmax_scale": scale, "causal": is_causal,
            "is_causal": is_causal, "deterministic": False,
        }  # fmt: skip
        res = bwd(**_bind(bwd, values, fill=_FILL, none_for_unknown=True))
        return _grads_from(res, dq, dk, dv)
