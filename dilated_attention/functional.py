"""The functional API of dense and dilated attention: validate, choose a kernel, run the engine.

``block_sparse_attention`` lives in ``block_sparse/`` (which calls ``attention`` here for a
pattern that keeps every block pair).

Shape legend: B batch, N seq_len, H query heads, Hkv key/value heads (H % Hkv == 0), D head dim.
"""

from __future__ import annotations

import torch

from . import _validation as V
from . import compiled
from .backends.base import KernelInputs
from .backends.registry import DENSE, DILATED, Selection, check_backend_name, registry_for
from .core import decode
from .core.autograd import run_attention
from .core.decode import decode_plan, decode_token_plan
from .core.engine import Plan, PlanRunner, empty_attention
from .core.fused import FusedRunner, compile_ahead
from .core.grouped import grouped_plan
from .core.hidden import hide_masked_keys
from .core.kv_cache import DilatedKVCache
from .core.segment import branch_plan, effective_branches, plan_branches, runs_in_slots

__all__ = ["attention", "dilated_attention"]


def _check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value


@torch.compiler.disable  # selection probes kernels and caches: run it eagerly, never traced
def _choose(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    is_causal: bool,
    has_mask: bool,
    dropout_p: float,
    backend: str | None,
    operation: str = DENSE,
    branch_slots: bool = False,
) -> Selection:
    """The kernel of ``operation``'s registry (``registry_for``) for these inputs."""
    inputs = KernelInputs.from_tensors(
        q, k, is_causal=is_causal, has_mask=has_mask, dropout_p=dropout_p,
        branch_slots=branch_slots,
    )  # fmt: skip
    return registry_for(operation).select(inputs, backend)


def _rows_in_place(x: torch.Tensor) -> torch.Tensor:
    """``x`` (B, N, H, D) itself where its (position, head) rows are evenly strided, as the
    decoding calls gather them (a cache's rows: a view of its buffers, which must not be copied
    whole for every token); else a contiguous copy."""
    _, rows, heads, dim = x.shape
    even = x.stride(3) == 1 and x.stride(2) == dim and x.stride(1) == heads * dim
    return x if even or rows * heads * dim == 0 else x.contiguous()


def _check_cache(
    cache: object,
    segs: tuple[int, ...],
    rates: tuple[int, ...],
    q: torch.Tensor,
    k: torch.Tensor,
    is_causal: bool,
) -> None:
    """``cache=`` is this layer's :class:`DilatedKVCache`, for causal calls on new tokens."""
    if not isinstance(cache, DilatedKVCache):
        raise TypeError(
            f"cache must be a DilatedKVCache or None, got {type(cache).__name__}; build one per "
            f"layer: DilatedKVCache(segment_lengths, dilation_rates)"
        )
    if not is_causal:
        raise ValueError("cache= is for decoding and needs is_causal=True, got is_causal=False")
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"with cache=, pass the new tokens' query, key and value (the same length), got "
            f"query.shape={tuple(q.shape)}, key.shape={tuple(k.shape)}; the cache holds the rest"
        )
    cache.check(segs, rates, k)


def _check_decoding_lengths(q: torch.Tensor, k: torch.Tensor, is_causal: bool) -> None:
    """A query shorter than the key is the last positions of a causal call; nothing else."""
    if q.shape[1] == k.shape[1]:
        return
    shapes = f"query.shape={tuple(q.shape)}, key.shape={tuple(k.shape)}"
    if q.shape[1] > k.shape[1]:
        raise ValueError(
            f"query may be shorter than key (its rows are then the last key positions, for "
            f"decoding) but not longer, got {shapes}; pass keys and values for every position"
        )
    if not is_causal:
        raise ValueError(
            f"a query shorter than key (decoding: its rows are the last {q.shape[1]} of "
            f"{k.shape[1]} positions) needs is_causal=True, got {shapes} with is_causal=False; "
            f"for non-causal attention pass queries for every position"
        )


@torch.compiler.disable  # a cached pure-Python plan: run it eagerly, never traced
def _plan(
    q: torch.Tensor,
    k: torch.Tensor,
    segs: tuple[int, ...],
    rates: tuple[int, ...],
    causal: bool,
    strided: bool = False,
    needs_grad: bool = False,
    writes_into: bool = False,
) -> Plan:
    """The executor's plan of a dilated call: rows gathered (Note [Row groups]), or read as
    strided views by a kernel that takes them (``strided``, Note [Strided row calls]), written
    into branch slots merged once by a kernel that also writes into given buffers where the
    branches allow (``writes_into``, Note [Branch slots merged once]); cut into position groups
    where that bounds its scratch (Note [Position-grouped plans])."""
    groups = plan_branches(q.shape[1], q.shape[2], segs, rates)
    plan = branch_plan(groups, q.shape[1], k.shape[2], q.device, causal, strided, writes_into)
    return grouped_plan(plan, q, segs, needs_grad, k.shape[2])


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    key_padding_mask: torch.Tensor | None = None,
    backend: str | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Dense softmax attention through the backend layer.

    Args:
        query: (B, Nq, H, D).
        key: (B, Nk, Hkv, D).
        value: (B, Nk, Hkv, D).
        is_causal: each query sees only the keys at or before its position. A query shorter
            than the key holds the last ``Nq`` of the ``Nk`` positions (end-aligned, as for
            decoding and in FlashAttention-2; PyTorch SDPA's ``is_causal`` is top-left
            aligned): query row ``i`` sees keys ``j <= Nk - Nq + i``. A query longer than the
            key raises ``ValueError``.
        scale: softmax scale; ``None`` means ``D ** -0.5``.
        dropout_p: dropout on the attention probabilities.
        key_padding_mask: (B, Nk) bool, ``True`` = ignore that key.
        backend: a name from :func:`list_backends`, or ``None`` / ``"auto"`` to choose
            automatically.
        return_lse: also return the log-sum-exp.

    Returns:
        ``out`` (B, Nq, H, D) in the input dtype, or ``(out, lse)`` with ``lse`` (B, H, Nq) float32
        (float64 for float64 inputs), detached. Rows that see no key give 0 and ``lse = -inf``.
        A batch of 0 (or 0 heads) gives empty tensors, and empty gradients in backward.
        Higher-order gradients (``create_graph=True``) are exact on every backend in eager mode
        (``torch.compile`` cannot take them, a torch limit; it raises); with ``dropout_p > 0``
        differentiating the gradients raises ``RuntimeError`` (Note [Double backward] in
        ``core/higher_order.py``).

    Raises:
        ValueError / TypeError: malformed inputs (including ``seq_len`` 0), before any work;
            ValueError when ``backend`` is unknown or cannot run the inputs (the message lists
            the reasons).
    """
    q, k, v = V.check_qkv(query, key, value, same_length=False)
    is_causal = _check_flag("is_causal", is_causal)
    return_lse = _check_flag("return_lse", return_lse)
    V.check_causal_lengths(q, k, is_causal, "attention")
    V.check_key_padding_mask(key_padding_mask, k.shape[0], k.shape[1], q.device)
    dropout_p = V.check_dropout("dropout_p", dropout_p)
    checked_scale = V.check_scale(scale)
    backend = check_backend_name(backend)
    if compiled.is_traced(q, k, v, key_padding_mask):  # Note [Custom operators for torch.compile]
        out, lse = compiled.dense(
            q, k, v, key_padding_mask, is_causal=is_causal, scale=checked_scale,
            dropout_p=dropout_p, backend=backend,
        )  # fmt: skip
        return (out, lse) if return_lse else out
    # End-aligned causal queries run as square causal calls (and calls without a mask): the
    # kernel is chosen for those shapes (decode.dense_decode_plan).
    end_aligned = is_causal and q.shape[1] < k.shape[1]
    kernel = _choose(
        q, k[:, : q.shape[1]] if end_aligned else k, is_causal=is_causal,
        has_mask=key_padding_mask is not None, dropout_p=dropout_p, backend=backend,
    )  # fmt: skip
    if q.numel() == 0:
        out, lse = empty_attention(q, k, v)
        return (out, lse) if return_lse else out
    softmax_scale = checked_scale if checked_scale is not None else q.shape[-1] ** -0.5
    plan = Plan.dense(is_causal)
    if end_aligned:
        plan = decode.dense_decode_plan(q.shape[1], k.shape[1])
    runner = PlanRunner(plan, kernel.backend, softmax_scale, dropout_p, "attention")
    k, v = hide_masked_keys(k, v, key_padding_mask)  # Note [Hidden keys cannot poison rows]
    out, lse = run_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), key_padding_mask, runner
    )
    return (out, lse) if return_lse else out


def dilated_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segment_lengths: list[int] | tuple[int, ...],
    dilation_rates: list[int] | tuple[int, ...],
    *,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    key_padding_mask: torch.Tensor | None = None,
    backend: str | None = None,
    return_lse: bool = False,
    cache: DilatedKVCache | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """LongNet dilated attention with exact branch mixing (LongNet Eq. 10) and exact gradients.

    Branch ``i`` cuts the sequence into segments of ``segment_lengths[i]`` (the last may be shorter)
    and, inside each, head ``j`` attends among the rows ``offset + r*m`` with ``r =
    dilation_rates[i]``
    and ``offset = j mod r``. Every head takes part in every branch; the branches mix as one softmax
    over the multiset union of their keys. For N = 8, one branch (w=8, r=2), heads 0 and 1::

        position   0 1 2 3 4 5 6 7
        head 0     x . x . x . x .     rows {0, 2, 4, 6} attend among themselves
        head 1     . x . x . x . x     rows {1, 3, 5, 7}

    Decoding: with ``is_causal=True`` the query may be shorter than the key: its ``Nq`` rows are
    the last ``Nq`` of the ``N`` key positions (a new token, or a chunk), and each equals that row
    of the causal call over all ``N`` positions. A new token then reads at most ``ceil(w / r)``
    keys per branch, whatever ``N`` is (Note [Decoding rows] in ``core/decode.py``).

    Args:
        query: (B, N, H, D); with ``is_causal=True`` also (B, Nq, H, D), Nq <= N (decoding).
        key: (B, N, Hkv, D).
        value: (B, N, Hkv, D).
        segment_lengths: w per branch (positive ints; ``w > N`` means one segment).
        dilation_rates: r per branch (positive ints; need not divide w).
        is_causal: a row sees only keys at or before its position.
        scale: softmax scale; ``None`` means ``D ** -0.5``.
        dropout_p: dropout on the attention probabilities.
        key_padding_mask: (B, N) bool, ``True`` = ignore that key.
        backend: a name from :func:`list_backends`, or ``None`` / ``"auto"`` to choose
            automatically.
        return_lse: also return the merged log-sum-exp.
        cache: a :class:`~dilated_attention.DilatedKVCache` of this layer, for decoding with
            ``is_causal=True``: query, key and value are the next tokens' (same length); their
            keys and values are appended to the cache and the queries attend to every key they
            can read, which the cache keeps within the longest segment (Note [Bounded dilated
            cache]). With a cache, ``key_padding_mask`` is (B, N) over the new keys; the cache
            keeps the masks of the keys it holds.

    Returns:
        ``out`` (B, N, H, D) in the input dtype, or ``(out, lse)`` with ``lse`` (B, H, N) float32
        (float64 for float64 inputs), detached. Rows no branch covers, or whose keys are all masked,
        give 0 and ``lse = -inf``. A batch of 0 (or 0 heads) gives empty tensors, and empty
        gradients in backward. Higher-order gradients (``create_graph=True``) are exact on every
        backend in eager mode (``torch.compile`` cannot take them, a torch limit; it raises); with
        ``dropout_p > 0`` differentiating the gradients raises ``RuntimeError``.

    Raises:
        ValueError / TypeError: malformed inputs (including ``seq_len`` 0), before any work;
            ValueError when ``backend`` is unknown or cannot run the inputs (the message lists
            the reasons).
    """
    q, k, v = V.check_qkv(query, key, value, same_length=False)
    segs, rates = V.check_branches(segment_lengths, dilation_rates)
    is_causal = _check_flag("is_causal", is_causal)
    return_lse = _check_flag("return_lse", return_lse)
    _check_decoding_lengths(q, k, is_causal)
    V.check_key_padding_mask(key_padding_mask, k.shape[0], k.shape[1], q.device)
    if cache is not None:
        _check_cache(cache, segs, rates, q, k, is_causal)
    dropout_p = V.check_dropout("dropout_p", dropout_p)
    checked_scale = V.check_scale(scale)
    backend = check_backend_name(backend)
    if compiled.is_traced(q, k, v, key_padding_mask):  # Note [Custom operators for torch.compile]
        if cache is not None:
            raise ValueError(
                "cache= is not supported under torch.compile, torch.export or torch.func yet: "
                "decode eagerly (the cache is Python state the compiled operator cannot update)"
            )
        out, lse = compiled.dilated(
            q, k, v, key_padding_mask, segs, rates, is_causal=is_causal, scale=checked_scale,
            dropout_p=dropout_p, backend=backend,
        )  # fmt: skip
        return (out, lse) if return_lse else out
    # Decoding (Note [Decoding rows]): one query row per call against its keys, on the dense
    # registry's kernel; otherwise the dilated registry's. A cache that holds earlier tokens
    # makes every call a decoding one.
    decoding = q.shape[1] != k.shape[1] or (cache is not None and cache.length > 0)
    # Decoding calls are one row against its keys and, in a chunk, square causal calls (Note
    # [Decoding rows]): the kernel is chosen for those shapes. One token without gradients is
    # one call with a per-head key mask (Note [One call per decoded token]) on a kernel that
    # takes masks.
    chunk = decoding and q.shape[1] > 1
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    one_call = (
        decoding and not chunk and not needs_grad and q.device.type in decode.ONE_CALL_DEVICE_TYPES
    )
    shape = (q[:, :1] if decoding else q, k[:, :1] if chunk else k)
    choice = dict(dropout_p=dropout_p, backend=backend, operation=DENSE if decoding else DILATED)
    kernel = None
    if one_call:
        try:
            kernel = _choose(*shape, is_causal=False, has_mask=True, **choice)
        except ValueError:  # a kernel asked for by name takes no masks: one call per branch
            one_call = False
    if kernel is None:
        slots = not decoding and runs_in_slots(q.shape[1], q.shape[2], k.shape[2], segs, rates)
        kernel = _choose(
            *shape, is_causal=chunk if decoding else is_causal,
            has_mask=key_padding_mask is not None, branch_slots=slots, **choice,
        )  # fmt: skip
    key_start = 0
    k, v = hide_masked_keys(k, v, key_padding_mask)  # a cache keeps them so: no copy per token
    if cache is not None:  # checked and chosen: the new tokens' keys join the ones they read
        k, v, key_padding_mask, key_start = cache.append(k, v, key_padding_mask)
    if q.numel() == 0:
        out, lse = empty_attention(q, k, v)
        return (out, lse) if return_lse else out
    softmax_scale = checked_scale if checked_scale is not None else q.shape[-1] ** -0.5
    key_len = key_start + k.shape[1]  # positions so far
    if one_call:  # the layer's schedule: the plan picks its effective branches
        plan = decode_token_plan(key_len, q.shape[2], segs, rates, q.device, key_start, q.shape[0])
    segs, rates = effective_branches(key_len, q.shape[2], segs, rates)
    if decoding and not one_call:
        plan = decode_plan(
            q.shape[1], key_len, q.shape[2], k.shape[2], segs, rates, q.device, key_start,
            kernel.backend.reads_strided_rows,
        )  # fmt: skip
    if decoding:
        runner = PlanRunner(plan, kernel.backend, softmax_scale, dropout_p, "dilated_attention")
        k, v = _rows_in_place(k), _rows_in_place(v)
        out, lse = run_attention(q, k, v, key_padding_mask, runner)
        return (out, lse) if return_lse else out
    if kernel.runs_plan:  # the fused kernels run every branch themselves (core/fused.py)
        # They read rows through strides: a (B, N, H, D) view of (B, H, N, D) tensors (the
        # transformers layout) runs as it is; only a strided last dim is copied.
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        branches = tuple(zip(segs, rates, strict=True))
        compile_ahead(
            q, k, v, key_padding_mask, branches, kernel.backend, is_causal=is_causal,
            scale=softmax_scale, needs_grad=needs_grad,
        )  # fmt: skip
        runner = FusedRunner(branches, kernel.backend, is_causal, softmax_scale)
        out, lse = run_attention(q, k, v, key_padding_mask, runner)
        return (out, lse) if return_lse else out
    strided, writes_into = kernel.backend.reads_strided_rows, kernel.backend.writes_into
    plan = _plan(q, k, segs, rates, is_causal, strided, needs_grad, writes_into)
    runner = PlanRunner(plan, kernel.backend, softmax_scale, dropout_p, "dilated_attention")
    out, lse = run_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), key_padding_mask, runner
    )
    return (out, lse) if return_lse else out
