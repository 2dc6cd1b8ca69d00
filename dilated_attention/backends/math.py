"""``math``: the plain-PyTorch backend (``core/reference.py``); any device, any float dtype."""

from __future__ import annotations

from typing import Any

import torch

from ..core.contract import Window
from ..core.reference import reference_backward, reference_forward
from .base import Backend, KernelOutput


class MathBackend(Backend):
    """Eager attention in float32 (float64 for float64 inputs), chunked over query rows.

    It supports everything the engine can ask for (causal, key padding, dropout, GQA, float64) and
    is the oracle-grade fallback; it is the slowest backend.
    """

    name = "math"
    reads_strided_rows = True  # plain PyTorch: any strides
    description = "plain PyTorch, chunked; any device and dtype"
    devices = frozenset({"cpu", "cuda", "mps", "xpu"})
    dtypes = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
    supports_mask = True
    supports_dropout = True
    aux_only_for_dropout = True  # the dropout seed
    supports_softcap = True
    supports_window = True
    empty_rows_have_neg_inf_lse = True
    exact_on_hidden_keys = True  # core/reference.py takes the exact path itself

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
        softcap: float | None = None,
        window: Window | None = None,
    ) -> KernelOutput:
        seed = None
        if dropout_p > 0:
            # Drawn from the global generator so torch.manual_seed makes runs repeatable.
            seed = int(torch.randint(0, 2**62, (1,)).item())
        out, lse = reference_forward(
            q, k, v, scale=scale, is_causal=is_causal, key_mask=key_mask,
            dropout_p=dropout_p, dropout_seed=seed, softcap=softcap, window=window,
        )  # fmt: skip
        return KernelOutput(out, lse, seed)

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
        softcap: float | None = None,
        window: Window | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return reference_backward(
            dout, q, k, v, out, lse, scale=scale, is_causal=is_causal, key_mask=key_mask,
            dropout_p=dropout_p, dropout_seed=aux, softcap=softcap, window=window,
        )  # fmt: skip
