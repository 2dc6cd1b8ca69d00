"""``flash_attn2``: the flash-attn 2.x package (Dao-AILab), through its private forward/backward.

The public ``flash_attn_func`` is an autograd function whose backward only ever sees its own
``out``/``lse``. The engine needs a backward that takes merged statistics (Note [Backward with
external statistics] in ``core/reference.py``), so this calls
``flash_attn.flash_attn_interface._flash_attn_forward`` / ``_flash_attn_backward``, which take
``out`` and ``softmax_lse`` as inputs. Their signatures changed in 2.7
(Note [flash-attn 2 private signatures]).

Shapes: q (B, Nq, H, D), k/v (B, Nk, Hkv, D), out (B, Nq, H, D), lse (B, H, Nq) float32.
flash-attn takes this (B, N, H, D) layout with any row, head and batch stride, so tensors go in as
they are; one is copied only when its last dim is strided (the kernel needs ``stride(-1) == 1``).

Causal masking in flash-attn is bottom-right aligned: identical to our top-left convention when
Nq == Nk, so rectangular causal calls are refused (``supports_rectangular_causal = False``).

Note [flash-attn 2 private signatures]
    2.6.x:  ``_flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
            alibi_slopes, return_softmax)`` -> 8-tuple ``(out, q, k, v, out_padded, softmax_lse,
            S_dmask, rng_state)``; ``_flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk,
            dv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
            deterministic, rng_state=None)`` -> ``(dq, dk, dv, softmax_d)``.
    2.7+:   ``window_size`` becomes ``window_size_left, window_size_right``; the forward returns
            the 4-tuple ``(out, softmax_lse, S_dmask, rng_state)``; the backward is a
            ``torch.library.custom_op`` that writes ``dq, dk, dv`` in place and returns only
            ``softmax_d``.
    Both are called by keyword, with the names read from the signature (``inspect.signature``
    of the function, or of ``func._init_fn`` for a custom op, whose ``__call__`` is
    ``(*args, **kwargs)``), and the results are told apart by their length. ``dq, dk, dv`` are
    always preallocated and passed in: 2.6 writes into them too and returns them.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch

from ._compat import (
    _HALF,
    _bind,
    _capability,
    _grads_from,
    _import_failure,
    _last_dim_contiguous,
    _parameters,
)
from .base import Backend, KernelInputs, KernelOutput


# -- the backend -----------------------------------------------------------------------------------
def _interface() -> ModuleType:
    # Imported here, never at module import: flash-attn is optional and loading its CUDA
    # extension can fail in ways other than ImportError (undefined symbols, driver errors).
    return importlib.import_module("flash_attn.flash_attn_interface")


class FlashAttn2Backend(Backend):
    """flash-attn 2.x (``pip install flash-attn``): FlashAttention-2, sm80+, fp16/bf16, dropout."""

    name = "flash_attn2"
    verified_on_hardware = False  # tested against fakes of flash-attn 2 only
    description = "flash-attn 2.x package (FlashAttention-2), sm80+; dropout, native GQA"
    devices = frozenset({"cuda"})
    dtypes = _HALF
    max_head_dim = 256
    # The private entry points do not pad the head dim (only the public wrappers do).
    head_dim_multiple = 8
    min_compute_capability = (8, 0)
    supports_rectangular_causal = False
    supports_dropout = True
    native_gqa = True

    def import_reasons(self) -> list[str]:
        try:
            mod = _interface()
            for func in (mod._flash_attn_forward, mod._flash_attn_backward):
                _parameters(func)
        except Exception as exc:  # any import-time failure is a reason, never a crash
            return [_import_failure("flash_attn", exc)]
        return []

    def not_supported_reasons(self, inputs: KernelInputs) -> list[str]:
        cc = _capability(inputs)
        dim = inputs.head_dim
        wide_backward = inputs.requires_grad and 192 < dim <= 256
        wide_backward = wide_backward and (dim <= 224 or inputs.dropout_p > 0)
        if wide_backward and cc is not None and cc > (8, 0) and cc != (9, 0):
            # flash-attn's own check (mha_bwd in csrc/flash_attn/flash_api.cpp, since 2.5.5):
            # these backward kernels need the shared memory of A100/H100.
            return [
                f"backward with head_dim {dim}"
                + (" and dropout" if inputs.dropout_p > 0 else "")
                + f" needs sm80 or sm90, device is sm{cc[0]}{cc[1]}"
            ]
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
        fwd = _interface()._flash_attn_forward
        q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
        values = {
            "q": q, "k": k, "v": v, "dropout_p": dropout_p, "softmax_scale": scale,
            "causal": is_causal, "window_size": (-1, -1), "window_size_left": -1,
            "window_size_right": -1, "softcap": 0.0, "alibi_slopes": None,
            "return_softmax": False,
        }  # fmt: skip
        res = fwd(**_bind(fwd, values))
        if len(res) == 8:  # 2.6: (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state)
            out, lse, rng_state = res[0], res[5], res[7]
        elif len(res) == 4:  # 2.7+: (out, softmax_lse, S_dmask, rng_state)
            out, lse, rng_state = res[0], res[1], res[3]
        else:
            raise RuntimeError(
                f"flash_attn._flash_attn_forward returned {len(res)} values; expected 8 (2.6) or "
                "4 (2.7+)"
            )
        return KernelOutput(out, lse, rng_state)

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
        bwd = _interface()._flash_attn_backward
        dout, out = dout.to(q.dtype), out.to(q.dtype)
        dout, q, k, v, out = (_last_dim_contiguous(x) for x in (dout, q, k, v, out))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        values = {
            "dout": dout, "q": q, "k": k, "v": v, "out": out, "softmax_lse": lse.contiguous(),
            "dq": dq, "dk": dk, "dv": dv, "dropout_p": dropout_p, "softmax_scale": scale,
            "causal": is_causal, "window_size": (-1, -1), "window_size_left": -1,
            "window_size_right": -1, "softcap": 0.0, "alibi_slopes": None,
            "deterministic": False, "rng_state": aux,
        }  # fmt: skip
        res = bwd(**_bind(bwd, values))
        return _grads_from(res, dq, dk, dv)
