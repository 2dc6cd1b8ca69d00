"""``flex``: PyTorch FlexAttention, compiled (Triton on CUDA).

FlexAttention returns the log-sum-exp (``return_lse=True``) but exposes no backward that takes
another ``out``/``lse``. Its log-sum-exp is differentiable, though, which is enough for exact
gradients of a merged result:

Note [Merged gradients through a kernel's own autograd]
    With ``out = sum_j w_j o_j`` and ``w_j = exp(lse_j - LSE)``, ``d out / d o_i = w_i`` and
    ``d out / d lse_i = w_i (o_i - out)``. So the backward recomputes this part's
    ``(o_i, lse_i)`` with autograd and back-propagates ``w_i * dout`` into ``o_i`` and
    ``w_i * rowsum(dout * (o_i - out))`` into ``lse_i``. For an unmerged call ``w_i = 1`` and the
    second term vanishes.

Note [Our own compiled FlexAttention]
    Dynamo keeps its compiled code, and its recompile count, per Python code object. Compiling
    ``flex_attention`` itself would share both with every other ``torch.compile(flex_attention)``
    in the process: once any of them passes the recompile limit (8 by default), dynamo skips
    ``flex_attention`` for good and every later call runs unfused, materialising all N x N
    scores (an out-of-memory at N = 65536 on an H100, seen in ``bench_block_sparse.py`` next to
    its plain-Flex baseline). So we compile two small wrappers of our own. The dense backend's
    wrapper specialises to the first input shape and, after a recompile, to dynamic shapes (one
    kernel for every sequence length, as dilated plans hold many). Block-sparse attention's
    wrapper is static (``dynamic=False``): one kernel per sequence length, because the
    dynamic-shape kernel ran about 1.9x / 1.5x slower (forward / forward+backward) than the
    static one at N = 65536, 10% density on an H100 (16.3 / 47.6 ms vs 8.5-9.1 / 32-33 ms).

On CPU, compiled FlexAttention is inference-only and cannot return the log-sum-exp (torch 2.13),
so this backend is CUDA-only.

Shapes: (B, N, H, D) in, transposed to FlexAttention's (B, H, N, D) as views.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .base import Backend, KernelInputs, KernelOutput

_RECOMPILE_LIMIT = 256
_LIMIT_NAME = (
    "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
)


try:
    from torch.nn.attention.flex_attention import flex_attention as _flex_attention
except ImportError:  # a torch without FlexAttention; import_reasons() says so
    _flex_attention = None


def _flex_dynamic(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any, scale: float,
    enable_gqa: bool, kernel_options: dict[str, Any] | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Compiled with automatic dynamic shapes (Note [Our own compiled FlexAttention])."""
    return _flex_attention(
        q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa, return_lse=True,
        kernel_options=kernel_options,
    )  # fmt: skip


def _flex_static(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any, scale: float,
    enable_gqa: bool, kernel_options: dict[str, Any] | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Compiled with static shapes; a code object of its own, so a cache of its own."""
    return _flex_attention(
        q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa, return_lse=True,
        kernel_options=kernel_options,
    )  # fmt: skip


@functools.cache
def _compiled_flex(static_shapes: bool = False) -> Callable[..., Any]:
    if static_shapes:
        return torch.compile(_flex_static, dynamic=False)
    return torch.compile(_flex_dynamic)


def compiled_flex_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    block_mask: Any,
    scale: float,
    kernel_options: dict[str, Any] | None = None,
    static_shapes: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The process-wide compiled FlexAttention, in its own (B, H, N, D) layout.

    Shared by this backend (dynamic shapes) and block-sparse attention (``block_sparse/flex.py``,
    static shapes), each with a compiled wrapper of its own (Note [Our own compiled
    FlexAttention]).

    Args:
        q: (B, H, Nq, D); k, v: (B, Hkv, Nk, D) (GQA when Hkv < H).
        block_mask: a FlexAttention ``BlockMask`` or None.
        scale: softmax scale.
        kernel_options: FlexAttention ``kernel_options`` (tile sizes, warps, stages; ``fwd_`` /
            ``bwd_`` prefixes for one pass); None keeps Inductor's defaults. Each distinct dict
            is a separate compiled graph.
        static_shapes: compile one kernel per shape instead of going dynamic after the first
            recompile (Note [Our own compiled FlexAttention]).

    Returns:
        ``out`` (B, H, Nq, D) and ``lse`` (B, H, Nq) (natural log), both differentiable.
    """
    # Past dynamo's recompile limit (8 per function by default) FlexAttention would silently run
    # unfused, materialising every score; a dilated plan alone can hold more shapes than that.
    with torch._dynamo.config.patch(**{_LIMIT_NAME: _RECOMPILE_LIMIT}):
        out, lse = _compiled_flex(static_shapes)(
            q, k, v, block_mask, scale, q.shape[1] != k.shape[1], kernel_options
        )
    return out, lse


def _flex(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, is_causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, N, H, D) in; ``out`` (B, N, H, D) and ``lse`` (B, H, N) out."""
    block_mask = _causal_block_mask(q.shape[1], k.shape[1], q.device) if is_causal else None
    out, lse = compiled_flex_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask,
        scale=scale,
    )  # fmt: skip
    return out.transpose(1, 2), lse


@functools.lru_cache(maxsize=64)
def _causal_block_mask(query_len: int, key_len: int, device: torch.device) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    def causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return q_idx >= kv_idx

    return create_block_mask(causal, None, None, query_len, key_len, device=device)


class FlexBackend(Backend):
    """Compiled FlexAttention; causal through a block mask, GQA native, exact merged gradients
    through its differentiable log-sum-exp (Note [Merged gradients through a kernel's own
    autograd]).
    """

    name = "flex"
    description = "PyTorch FlexAttention, compiled with Triton (CUDA); compiles once per shape"
    devices = frozenset({"cuda"})
    dtypes = frozenset({torch.float16, torch.bfloat16, torch.float32})
    min_compute_capability = (8, 0)
    min_head_dim = 16  # Inductor's FlexAttention lowering refuses smaller embeddings
    supports_rectangular_causal = True
    # One-row calls go to the plain-PyTorch kernel: torch.compile specializes a size of 1, so each
    # would compile graphs of its own (dynamo's 0/1 specialization) for a call that costs nothing.
    min_rows = 2
    aux_only_for_dropout = True  # no aux at all

    def import_reasons(self) -> list[str]:
        try:
            from torch.nn.attention import flex_attention  # noqa: F401
        except Exception as exc:
            return [f"torch {torch.__version__} has no FlexAttention: {exc}"]
        return []

    _CPU_REASON = (
        "CPU FlexAttention is inference-only and returns no log-sum-exp, which merging needs "
        "(torch.compile limitation)"
    )

    def not_supported_reasons(self, inputs: KernelInputs) -> list[str]:
        if inputs.device.type == "cpu":
            return [self._CPU_REASON]
        return super().not_supported_reasons(inputs)

    def probe(self, device: torch.device) -> None:
        if device.type == "cpu":
            raise RuntimeError(self._CPU_REASON)
        super().probe(device)

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
        out, lse = _flex(q, k, v, scale=scale, is_causal=is_causal)
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
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with torch.enable_grad():
            own_out, own_lse = _flex(*leaves, scale=scale, is_causal=is_causal)
            weight = torch.exp(own_lse.detach() - lse)  # (B, H, N)
            weight_bnh = weight.transpose(1, 2).unsqueeze(-1)
            grad_out = (weight_bnh * dout.float()).to(own_out.dtype)
            drift = (dout.float() * (own_out.detach().float() - out.float())).sum(-1)
            grad_lse = weight * drift.transpose(1, 2)
            dq, dk, dv = torch.autograd.grad((own_out, own_lse), leaves, (grad_out, grad_lse))
        return dq, dk, dv
