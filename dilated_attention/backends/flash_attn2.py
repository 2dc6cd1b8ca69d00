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

This module also holds the small signature helpers the other flash backends share
(:func:`_parameters`, :func:`_bind`, :func:`_grads_from`, :func:`_import_failure`).

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
import inspect
from types import ModuleType
from typing import Any

import torch

from .base import Backend, KernelInputs, KernelOutput

_HALF = frozenset({torch.float16, torch.bfloat16})
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


# -- helpers shared by the flash-attn backends -----------------------------------------------------
def _import_failure(package: str, exc: BaseException) -> str:
    """A one-line reason for a failed import (any exception, not only ``ImportError``)."""
    first_line = (str(exc).strip().splitlines() or [""])[0][:200]
    return f"{package} import failed: {type(exc).__name__}: {first_line}"


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _parameters(func: Any) -> dict[str, str]:
    """Parameter names of ``func``, each mapped to ``"default"``, ``"optional"`` or ``"required"``.

    Reads a Python function's signature; for a ``torch.library.custom_op`` (a ``CustomOpDef``,
    whose ``__call__`` is ``(*args, **kwargs)``) the wrapped function's, ``func._init_fn``; for a
    ``torch.ops`` op, its schema, where an argument of ``Optional`` type without a default is
    ``"optional"`` (``None`` is a valid value).

    Raises:
        RuntimeError: none of these can be read.
    """
    target = getattr(func, "_init_fn", func)
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        params = None
    if params is not None and not any(p.kind in _VARIADIC for p in params):
        return {
            p.name: "required" if p.default is inspect.Parameter.empty else "default"
            for p in params
        }
    schema = getattr(getattr(func, "default", func), "_schema", None)
    if schema is not None:
        kinds = {}
        for arg in schema.arguments:
            if arg.has_default_value():
                kinds[arg.name] = "default"
            elif isinstance(arg.type, torch.OptionalType):
                kinds[arg.name] = "optional"
            else:
                kinds[arg.name] = "required"
        return kinds
    raise RuntimeError(f"cannot read the parameters of {func!r}")


def _bind(
    func: Any,
    values: dict[str, Any],
    *,
    fill: dict[str, Any] | None = None,
    none_for_unknown: bool = False,
) -> dict[str, Any]:
    """Keyword arguments for ``func`` from ``values``, by the names ``func`` actually has.

    ``values`` may name parameters that only some versions have (``window_size`` and
    ``window_size_left``): only the names ``func`` has are passed. A parameter without a default
    that ``values`` does not give takes ``fill[name]``, else ``None`` when its type is optional
    (or ``none_for_unknown``); anything else is an error, raised before any kernel runs.

    Raises:
        TypeError: a required parameter nobody knows how to fill.
    """
    kwargs: dict[str, Any] = {}
    for name, kind in _parameters(func).items():
        if name in values:
            kwargs[name] = values[name]
        elif kind == "default":
            continue
        elif fill is not None and name in fill:
            kwargs[name] = fill[name]
        elif kind == "optional" or none_for_unknown:
            kwargs[name] = None
        else:
            raise TypeError(f"{func!r} needs argument {name!r}, which this backend cannot fill")
    return kwargs


def _grads_from(
    res: Any, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` from a backward that returns them, or the buffers it wrote in place."""
    if isinstance(res, (tuple, list)) and len(res) >= 3:
        grads = tuple(res[:3])
        shapes = (dq.shape, dk.shape, dv.shape)
        if all(
            isinstance(g, torch.Tensor) and g.shape == s for g, s in zip(grads, shapes, strict=True)
        ):
            return grads[0], grads[1], grads[2]
    return dq, dk, dv


def _capability(inputs: KernelInputs) -> tuple[int, int] | None:
    if inputs.device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(inputs.device)
    return major, minor


# -- the backend -----------------------------------------------------------------------------------
def _interface() -> ModuleType:
    # Imported here, never at module import: flash-attn is optional and loading its CUDA
    # extension can fail in ways other than ImportError (undefined symbols, driver errors).
    return importlib.import_module("flash_attn.flash_attn_interface")


class FlashAttn2Backend(Backend):
    """flash-attn 2.x (``pip install flash-attn``): FlashAttention-2, sm80+, fp16/bf16, dropout."""

    name = "flash_attn2"
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
