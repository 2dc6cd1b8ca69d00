"""``block_sparse_attention``: validation, the dense shortcut, the kernel choice and the call.

Note [Dense fallback]
    A pattern whose block mask keeps every block pair (every pair at or below the diagonal when
    causal) is dense attention, with the same causal mask. ``block_sparse_attention`` then
    calls the library's dense ``attention`` (cuDNN on an H100) instead of either kernel above:
    FlexAttention walking every tile runs at about 0.7x of dense cuDNN (H100, N = 262,144: 0.64x
    forward, 0.71x forward+backward; ``benchmarks/results/block_sparse_long_h100.json``), and
    the fallback would split the work into many calls. Only ``backend="flex"`` (by argument,
    ``use_backend`` or the environment) keeps FlexAttention at full density.

Note [End-aligned causal blocks]
    A causal query shorter than the key holds the last ``Nq`` of the ``Nk`` positions, as in
    dense and dilated attention (decoding, chunked prefill): query row ``i`` is position
    ``p = Nk - Nq + i``, in block ``p // block_size``, and sees key ``t`` when the pattern keeps
    ``(p // block_size, t // block_size)`` and ``t <= p``. The pattern is asked for the square
    block mask of the ``Nk`` positions. The plan computes exactly those rows (``plan_calls`` with
    a query range, as ring attention's shards; every causal call it makes is square, so any
    dense kernel runs it). FlashAttention-4's block sparsity, our block-sparse Triton kernels
    and FlexAttention take a top-left causal mask over the query rows they are given, so such a
    call never goes to them: chosen automatically it runs the plan, and naming one of them
    raises ``ValueError`` before any work.
"""

from __future__ import annotations

import functools

import torch

from .. import _validation as V
from .. import compiled
from ..backends.base import KernelInputs
from ..backends.flash_attn4 import FlashAttn4Backend
from ..backends.registry import (
    BLOCK_SPARSE,
    DENSE,
    Selection,
    _requested,
    check_backend_name,
    registry_for,
)
from ..core.autograd import run_attention
from ..core.engine import Plan, PlanRunner, empty_attention
from ..patterns import Pattern, check_pattern
from . import plan
from .fa4 import FlashAttn4BlockSparseRunner, fa4_tiles
from .flex import _flex_forward
from .plan import _local_plan, check_block_size, num_blocks
from .triton_autograd import TritonBlockSparseRunner, _triton_lists


def _check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value


def keeps_every_pair(mask: torch.Tensor, is_causal: bool) -> bool:
    """Whether the block mask keeps every block pair the causal mask (when causal) leaves.

    Then block-sparse attention IS dense attention (causal when causal), and the dense kernel
    computes it exactly and faster than a sparse kernel walking every block. ``mask``: square
    when causal (the blocks of the key positions, Note [End-aligned causal blocks]).
    """
    if is_causal:
        mask = mask | ~torch.ones_like(mask).tril()
    return bool(mask.all())


@functools.lru_cache(maxsize=16)
def _is_dense(pattern: Pattern, nq: int, nk: int, is_causal: bool) -> bool:
    """``keeps_every_pair`` of the pattern's mask, kept per call shape (milliseconds at 256K
    tokens on a CPU, for an answer that never changes)."""
    return keeps_every_pair(pattern.block_mask(nq, nk), is_causal)


@torch.compiler.disable  # selection probes kernels and caches: run it eagerly, never traced
def _choose(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    is_causal: bool,
    block_size: int,
    needs_grad: bool,
    backend: str | None,
) -> Selection:
    """The block-sparse registry's kernel (``registry_for("block_sparse")``): on CUDA, nothing
    asked for, FlashAttention-4's block sparsity, then our block-sparse Triton kernels for calls
    without gradients and FlexAttention for training, each where it runs, then the executor's
    plan on the device's dense kernel (Note [Block-sparse plan]). ``"flash_attn4"`` /
    ``"triton"`` / ``"flex"`` name those three kernels; any other name runs the plan on that
    dense kernel."""
    inputs = KernelInputs.from_tensors(
        q, k, is_causal=is_causal, requires_grad=needs_grad, block_size=block_size
    )
    return registry_for(BLOCK_SPARSE).select(inputs, backend)


@torch.compiler.disable  # selection probes kernels and caches: run it eagerly, never traced
def _choose_end_aligned(
    q: torch.Tensor, k: torch.Tensor, *, needs_grad: bool, backend: str | None
) -> Selection:
    """The dense kernel that runs the plan of an end-aligned causal call (Note [End-aligned
    causal blocks]), chosen for its square causal calls; a block-sparse plan kernel asked for by
    name raises ``ValueError``: its causal mask is top-left aligned."""
    requested, source = _requested(backend)
    if requested in registry_for(BLOCK_SPARSE).plan_kernels:
        raise ValueError(
            f"backend {requested!r} (from {source}) cannot run block_sparse_attention with "
            f"is_causal=True and a query shorter than the key (query.shape={tuple(q.shape)}, "
            f"key.shape={tuple(k.shape)}): its causal mask is top-left aligned, and such a "
            f"query holds the last {q.shape[1]} of the {k.shape[1]} positions (end-aligned). "
            f"Let the library choose (backend=None), which runs the block-sparse plan on a "
            f"dense kernel, or name a dense kernel from list_backends()"
        )
    inputs = KernelInputs.from_tensors(
        q, k[:, : q.shape[1]], is_causal=True, requires_grad=needs_grad
    )
    return registry_for(DENSE).select(inputs, backend)


def block_sparse_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    pattern: Pattern,
    *,
    block_size: int = 128,
    is_causal: bool = False,
    scale: float | None = None,
    backend: str | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Dense attention restricted to the block pairs ``pattern`` keeps (and causal, when asked).

    Query token ``p`` (block ``p // block_size``) attends key token ``t`` (block
    ``t // block_size``) when the pattern keeps that block pair and, if causal, ``t <= p``.
    With ``is_causal=True`` a query shorter than the key holds the last ``Nq`` of the ``Nk``
    positions (end-aligned, as in :func:`~dilated_attention.attention`): query row ``i`` is
    position ``p = Nk - Nq + i``, in block ``p // block_size`` (Note [End-aligned causal
    blocks]). Query rows that attend no key give 0 (and ``lse = -inf``). Gradients are exact,
    and so are higher-order ones (``create_graph=True``) on every kernel but FlexAttention, for
    which torch.compile raises on double backward: pass ``backend="triton"`` or a fallback
    kernel name for a gradient penalty on CUDA.

    Args:
        query: (B, Nq, H, D).
        key: (B, Nk, Hkv, D), H % Hkv == 0 (GQA). Nk may differ from Nq.
        value: (B, Nk, Hkv, D).
        pattern: a :mod:`dilated_attention.patterns` pattern; it is asked for the block mask
            ``(ceil(Nq / block_size), ceil(Nk / block_size))``, or with ``is_causal=True``
            ``(ceil(Nk / block_size), ceil(Nk / block_size))`` (the blocks of the key
            positions, which the query's positions are among).
        block_size: tokens per block; the last block may be shorter.
        is_causal: query position ``p`` sees keys ``t <= p`` (end-aligned when the query is
            shorter than the key; a longer query raises ``ValueError``).
        scale: softmax scale; ``None`` means ``D ** -0.5``.
        backend: a name in the block-sparse registry (``registry_for("block_sparse")``).
            ``None`` picks, on CUDA, FlashAttention-4's block sparsity (installed, sm90, a
            ``block_size`` that is a multiple of 128, D <= 128), then our block-sparse Triton
            kernels for calls without gradients and FlexAttention for training (each where it
            runs), else the plan on the device's dense kernel (Note [Block-sparse plan]);
            ``"flash_attn4"``, ``"triton"`` and ``"flex"`` name those kernels (``ValueError``
            with the reasons where they cannot run the inputs); any other name from
            ``list_backends()`` runs the plan on that dense kernel. A pattern that keeps every
            block pair runs dense ``attention`` with the same ``backend`` (Note [Dense
            fallback]), except under ``"flex"``. An end-aligned causal call (a query shorter
            than the key) always runs the plan (the three kernels named above raise
            ``ValueError`` there).
        return_lse: also return the log-sum-exp.

    Returns:
        ``out`` (B, Nq, H, D) in the input dtype, or ``(out, lse)`` with ``lse`` (B, H, Nq)
        float32 (float64 for float64 inputs on the fallback), detached.

    Raises:
        TypeError: ``pattern`` is not a Pattern; wrong argument types.
        ValueError: malformed tensors, ``block_size < 1``, a ``Custom`` mask of another block
            count, a causal query longer than the key, or a backend that cannot run the
            inputs.
    """
    q, k, v = V.check_qkv(query, key, value, same_length=False)
    pattern = check_pattern(pattern)
    block_size = check_block_size(block_size)
    is_causal = _check_flag("is_causal", is_causal)
    return_lse = _check_flag("return_lse", return_lse)
    V.check_causal_lengths(q, k, is_causal, "block_sparse_attention")
    checked_scale = V.check_scale(scale)
    backend = check_backend_name(backend)  # "auto" -> None; ValueError naming the valid ones
    if compiled.is_traced(q, k, v):  # Note [Custom operators for torch.compile] (compiled.py)
        out, lse = compiled.block_sparse(
            q, k, v, pattern, block_size=block_size, is_causal=is_causal, scale=checked_scale,
            backend=backend,
        )  # fmt: skip
        return (out, lse) if return_lse else out
    softmax_scale = checked_scale if checked_scale is not None else q.shape[-1] ** -0.5
    query_len, key_len = q.shape[1], k.shape[1]
    # The query's first position: end-aligned when causal (Note [End-aligned causal blocks]).
    query_start = key_len - query_len if is_causal else 0
    # Ask the pattern first: a Custom mask of the wrong size fails before any kernel work.
    dense = _is_dense(
        pattern, num_blocks(key_len if is_causal else query_len, block_size),
        num_blocks(key_len, block_size), is_causal,
    )  # fmt: skip
    if dense and _requested(backend)[0] != "flex":
        # Dense attention exactly (Note [Dense fallback]); a named kernel stays the kernel.
        from ..functional import attention

        out, lse = attention(
            q, k, v, is_causal=is_causal, scale=softmax_scale, backend=backend, return_lse=True
        )
        return (out, lse) if return_lse else out
    if q.numel() == 0:  # batch 0 or 0 heads: empty out and grads, no kernel launch
        out, lse = empty_attention(q, k, v)
        return (out, lse) if return_lse else out
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if query_start:
        kernel = _choose_end_aligned(q, k, needs_grad=needs_grad, backend=backend)
    else:
        kernel = _choose(
            q, k, is_causal=is_causal, block_size=block_size, needs_grad=needs_grad,
            backend=backend,
        )  # fmt: skip
    if kernel.runs_plan and kernel.backend.name == "triton":
        lists = _triton_lists(pattern, block_size, query_len, key_len, is_causal, q.device)
        runner = TritonBlockSparseRunner(lists, block_size, is_causal, softmax_scale)
        out, lse = run_attention(q.contiguous(), k.contiguous(), v.contiguous(), None, runner)
    elif kernel.runs_plan and isinstance(kernel.backend, FlashAttn4Backend):
        tiles = fa4_tiles(pattern, block_size, query_len, key_len, is_causal, q.device)
        runner = FlashAttn4BlockSparseRunner(
            kernel.backend, tiles, block_size, is_causal, softmax_scale
        )
        out, lse = run_attention(q, k, v, None, runner)  # FA4 reads strided rows
    elif kernel.runs_plan:  # FlexAttention on the pattern's BlockMask
        out, lse = _flex_forward(
            q, k, v, pattern, block_size=block_size, is_causal=is_causal, scale=softmax_scale
        )
    else:
        budget = max(key_len, plan.MIN_KV_ROWS_PER_CALL)
        calls, _ = _local_plan(
            pattern, block_size, query_len, key_len, is_causal, q.device, budget, query_start
        )
        runner = PlanRunner(
            Plan(tuple(calls)), kernel.backend, softmax_scale, what="block_sparse_attention"
        )
        out, lse = run_attention(q.contiguous(), k.contiguous(), v.contiguous(), None, runner)
    return (out, lse) if return_lse else out
