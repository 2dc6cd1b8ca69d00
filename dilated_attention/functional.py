"""The public attention functions: validate, resolve, run.

``attention`` (dense), ``dilated_attention`` and ``block_sparse_attention`` check their
arguments (``_validation.py``), describe the call as one
:class:`~dilated_attention.resolve.Request` (packed documents and a decoding cache included:
Note [A cache call is one request] in ``resolve/caches.py``) and hand it to ``compiled.route``,
the one call they make after their checks: the resolve step chooses the kernel and how the
work is cut and runs it (Note [One resolve step] in ``resolve/resolver.py``). Under
``torch.compile``, ``torch.export`` and ``torch.func`` the same request runs inside a custom
operator (``compiled/``).

Shape legend: B batch, N seq_len, H query heads, Hkv key/value heads (H % Hkv == 0), D head dim.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from . import _validation as V
from . import compiled
from .backends.registry import check_backend_name
from .block_sparse.plan import check_block_size
from .block_sparse.runtime import MaskLayout, check_block_mask, check_documents_aligned
from .core.autograd import Inputs
from .core.decoding.caches import Cache, check_cache_call, check_window_cache_call
from .core.decoding.window_cache import StaticWindowKVCache
from .core.geometry.documents import check_cu_seqlens
from .core.geometry.schedule import Schedule
from .patterns import Pattern
from .resolve import BLOCK_SPARSE, DENSE, CheckedCalls, Request, dilated_operation
from .resolve.caches import cache_fields

__all__ = ["attention", "block_sparse_attention", "dilated_attention"]

Output = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
_F = TypeVar("_F", bound=Callable[..., Any])

# Note [Eager calls under torch.compile]
#     The custom operators (``compiled/``) carry a call's tensors and plain options, not yet
#     packed documents' offsets (read on the host), a local window, a soft-cap or sinks (a
#     tensor with a gradient of its own). A traced call that asks for one of those runs the
#     public function eagerly instead: a graph break, the rest of the model still compiled,
#     the call's result and gradients the eager ones. ``fullgraph=True`` raises there, with
#     this reason. Under torch.func transforms they raise ``ValueError`` (nothing runs eagerly
#     inside a transform). One call with a window traces: the one-token step of a
#     ``StaticWindowKVCache`` without soft-cap or sinks, which reads its ring through a key mask
#     and no window (Note [A window cache] in ``core/decoding/window_cache.py``): the dense operator
#     carries it, so a hybrid model's static step compiles into one graph.
_EAGER_OPTIONS = ("cu_seqlens", "window_size", "softcap", "sinks")
_EAGER_REASON = (
    "dilated_attention: packed documents (cu_seqlens), window_size, softcap and sinks run "
    "eagerly under torch.compile (the custom operators do not carry them yet): compile without "
    "fullgraph=True to run such calls eagerly between graphs, or call without them"
)


def _eager_under_compile(fn: _F) -> _F:
    """``fn`` run eagerly when ``torch.compile`` traces a call that asks for one of
    ``_EAGER_OPTIONS`` (Note [Eager calls under torch.compile])."""
    eager = torch.compiler.disable(fn, reason=_EAGER_REASON)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() and _runs_eagerly(args, kwargs):
            return eager(*args, **kwargs)
        return fn(*args, **kwargs)

    return call  # type: ignore[return-value]


def _runs_eagerly(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a traced call asks for one of ``_EAGER_OPTIONS``, other than a window read by a
    static window cache's one-token step (Note [Eager calls under torch.compile])."""
    asked = [name for name in _EAGER_OPTIONS if kwargs.get(name) is not None]
    cache, query = kwargs.get("cache"), args[0] if args else kwargs.get("query")
    step = (
        isinstance(cache, StaticWindowKVCache) and cache.key is not None
        and isinstance(query, torch.Tensor) and query.dim() == 4 and query.shape[1] == 1
    )  # fmt: skip
    return bool(asked) and not (asked == ["window_size"] and step)


@_eager_under_compile
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
    cu_seqlens: torch.Tensor | list[int] | None = None,
    window_size: tuple[int, int] | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    cache: Cache | None = None,
) -> Output:
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
        cu_seqlens: packed documents, each attending only within itself: their offsets among
            the ``B * N`` positions read row after row, from 0 to ``B * N``, every row start
            among them (Note [Packed documents] in ``core/geometry/documents.py``); Nq == Nk.
        window_size: ``(left, right)``: position ``p`` sees keys ``p - left`` to ``p + right``
            (``-1``: unbounded on that side; FlashAttention's convention), with causality and
            every mask; a query shorter than the key holds its last positions. A sliding window
            of ``W`` tokens is ``(W - 1, 0)`` with ``is_causal=True``.
        softcap: every scaled score ``s`` becomes ``softcap * tanh(s / softcap)`` (Gemma 2).
        sinks: (H,) logits, one per query head: a key with zero value in every row's
            denominator (gpt-oss), with its gradient. The ``lse`` returned includes it.
        cache: decoding a layer of local windowed attention: its
            :class:`~dilated_attention.WindowKVCache` or
            :class:`~dilated_attention.StaticWindowKVCache` (Note [A window cache] in
            ``core/decoding/window_cache.py``), with ``is_causal=True`` and the layer's
            ``window_size``: query, key and value are the next tokens' (same length), their
            keys taken by the cache, which holds the window they read; ``key_padding_mask`` is
            then (B, N) over the new keys. With ``cu_seqlens`` and an empty cache, a packed
            prompt (each row's last document into the cache).

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
    options = (is_causal, scale, dropout_p, backend, return_lse, window_size, softcap)
    return _checked_route(
        _ATTENTION, _check_attention, (query, key, value, key_padding_mask, sinks), options,
        cu_seqlens, cache, return_lse,
    )  # fmt: skip


def _checked_route(
    calls: CheckedCalls,
    check: Callable[..., Request],
    tensors: tuple[Any, ...],
    options: tuple[Any, ...],
    cu_seqlens: torch.Tensor | list[int] | None,
    cache: Cache | None,
    return_lse: bool,
) -> Any:
    """``check(*tensors, cu_seqlens, cache, *options)``'s request, kept per call signature in
    ``calls`` where the call has no packed documents or cache (Note [Checked once per call
    signature] in ``resolve/request.py``), routed with ``tensors`` (query, key, value, key
    padding mask, sinks)."""
    request = calls.request(
        tensors,
        options,
        lambda: check(*tensors, cu_seqlens, cache, *options),
        kept=cu_seqlens is None and cache is None,
    )
    query, key, value, key_padding_mask, sinks = tensors
    return compiled.route(request, query, key, value, key_padding_mask, return_lse, sinks, cache)


#: The requests of the call signatures ``attention`` has checked (Note [Checked once per call
#: signature] in ``resolve/request.py``).
_ATTENTION = CheckedCalls()


def _check_attention(
    query: object,
    key: object,
    value: object,
    key_padding_mask: object,
    sinks: object,
    cu_seqlens: torch.Tensor | list[int] | None,
    cache: Cache | None,
    is_causal: bool,
    scale: float | None,
    dropout_p: float,
    backend: str | None,
    return_lse: bool,
    window_size: tuple[int, int] | None,
    softcap: float | None,
) -> Request:
    """:func:`attention`'s checks of its arguments, then the call described as its request."""
    q, k, v = V.check_qkv(query, key, value, same_length=False)
    V.check_bool("is_causal", is_causal)
    V.check_bool("return_lse", return_lse)
    V.check_causal_lengths(q, k, is_causal, "attention")
    fields, checked_sinks = _check_options(
        q, k, key_padding_mask, sinks, is_causal, dropout_p, scale, backend, window_size, softcap
    )
    if cache is not None:
        check_window_cache_call(cache, fields["window"], q, k, is_causal)  # type: ignore[arg-type]
    return _check_request(DENSE, q, k, v, key_padding_mask, checked_sinks, cu_seqlens, cache,
                          fields)  # fmt: skip


def _check_options(
    q: torch.Tensor,
    k: torch.Tensor,
    key_padding_mask: object,
    sinks: object,
    is_causal: bool,
    dropout_p: float,
    scale: float | None,
    backend: str | None,
    window_size: tuple[int, int] | None,
    softcap: float | None,
) -> tuple[dict[str, Any], torch.Tensor | None]:
    """The checks ``attention`` and ``dilated_attention`` share, of the key padding mask (B, Nk),
    the sinks (H,) and the options, for q (B, Nq, H, D) and k (B, Nk, Hkv, D): the request's
    fields they give, and the checked sinks."""
    V.check_key_padding_mask(key_padding_mask, k.shape[0], k.shape[1], q.device)
    checked_sinks = V.check_sinks(sinks, q)
    fields = dict(
        is_causal=is_causal, has_mask=key_padding_mask is not None,
        dropout_p=V.check_dropout("dropout_p", dropout_p), scale=V.check_scale(scale),
        backend=check_backend_name(backend), window=V.check_window_size(window_size),
        softcap=V.check_softcap(softcap), sinks=checked_sinks is not None,
    )  # fmt: skip
    return fields, checked_sinks


def _check_request(
    operation: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: object,
    checked_sinks: torch.Tensor | None,
    cu_seqlens: torch.Tensor | list[int] | None,
    cache: Cache | None,
    fields: dict[str, Any],
) -> Request:
    """Packed documents' offsets checked, then the call described as its request: ``fields``
    with what a decoding cache holds (Note [A cache call is one request])."""
    documents = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, q, k, cache)
    if cache is not None:
        new = Inputs(q, k, v, key_padding_mask)  # type: ignore[arg-type]
        fields |= cache_fields(cache, new, checked_sinks, fields, packed=documents is not None)
    return Request.of(operation, q, k, v, documents=documents, **fields)


@_eager_under_compile
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
    cache: Cache | None = None,
    cu_seqlens: torch.Tensor | list[int] | None = None,
    window_size: tuple[int, int] | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> Output:
    """LongNet dilated attention with exact branch mixing (LongNet Eq. 10) and exact gradients.

    Branch ``i`` cuts the sequence into segments of ``segment_lengths[i]`` (the last may be
    shorter) and, inside each, head ``j`` attends among the rows ``offset + r*m`` with ``r =
    dilation_rates[i]`` and ``offset = j mod r``. Every head takes part in every branch; the
    branches mix as one softmax over the multiset union of their keys. For N = 8, one branch
    (w=8, r=2), heads 0 and 1::

        position   0 1 2 3 4 5 6 7
        head 0     x . x . x . x .     rows {0, 2, 4, 6} attend among themselves
        head 1     . x . x . x . x     rows {1, 3, 5, 7}

    Decoding: with ``is_causal=True`` the query may be shorter than the key: its ``Nq`` rows are
    the last ``Nq`` of the ``N`` key positions, each equal to that row of the causal call over
    all ``N`` positions; a new token reads at most ``ceil(w / r)`` keys per branch (Note
    [Decoding rows] in ``core/decoding/decode.py``).

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
        backend: a name from :func:`list_backends`; ``None`` / ``"auto"``: automatic.
        return_lse: also return the merged log-sum-exp.
        cache: this layer's :class:`~dilated_attention.DilatedKVCache` (Note [Bounded
            dilated cache]) or :class:`~dilated_attention.StaticDilatedKVCache` (Note [A
            decode step with static shapes]), for decoding with ``is_causal=True``: query, key
            and value are the next tokens' (same length), their keys taken by the cache, which
            holds every key they can read; ``key_padding_mask`` is then (B, N) over the new
            keys.
        cu_seqlens: packed documents, as in :func:`attention`, each segmented as if alone; with
            an empty ``cache`` a prompt (Note [A packed prompt] in ``core/geometry/documents.py``).
        window_size: ``(left, right)``: one more branch, a local window across segments (each
            position sees keys ``p - left`` to ``p + right``, as in :func:`attention`), joined
            to the others in the union (Note [A local window as a branch] in
            ``resolve/windows.py``). Not with ``cache`` or a query shorter than the key yet
            (a layer of local windows alone decodes with ``attention(..., cache=...)``).
        softcap: every scaled score ``s`` becomes ``softcap * tanh(s / softcap)``, in every
            branch.
        sinks: (H,) logits, as in :func:`attention`: counted once in the denominator of the
            union of the branches.

    Returns:
        As :func:`attention` (``out``, or ``out`` and a detached ``lse`` (B, H, N)); rows no
        branch covers, or whose keys are all masked, give 0 and ``lse = -inf``.

    Raises:
        ValueError / TypeError: malformed inputs (including ``seq_len`` 0), before any work;
            ValueError when ``backend`` is unknown or cannot run the inputs (the message lists
            the reasons).
    """
    options = (
        segment_lengths, dilation_rates, is_causal, scale, dropout_p, backend, return_lse,
        window_size, softcap,
    )  # fmt: skip
    return _checked_route(
        _DILATED, _check_dilated, (query, key, value, key_padding_mask, sinks), options,
        cu_seqlens, cache, return_lse,
    )  # fmt: skip


#: The requests of the call signatures ``dilated_attention`` has checked.
_DILATED = CheckedCalls()


def _check_dilated(
    query: object,
    key: object,
    value: object,
    key_padding_mask: object,
    sinks: object,
    cu_seqlens: torch.Tensor | list[int] | None,
    cache: Cache | None,
    segment_lengths: list[int] | tuple[int, ...],
    dilation_rates: list[int] | tuple[int, ...],
    is_causal: bool,
    scale: float | None,
    dropout_p: float,
    backend: str | None,
    return_lse: bool,
    window_size: tuple[int, int] | None,
    softcap: float | None,
) -> Request:
    """:func:`dilated_attention`'s checks of its arguments, then the call described as its
    request."""
    schedule = Schedule(segment_lengths, dilation_rates)  # checks them
    q, k, v = V.check_qkv(query, key, value, same_length=False)
    V.check_bool("is_causal", is_causal)
    V.check_bool("return_lse", return_lse)
    V.check_decoding_lengths(q, k, is_causal)
    fields, checked_sinks = _check_options(
        q, k, key_padding_mask, sinks, is_causal, dropout_p, scale, backend, window_size, softcap
    )
    if fields["window"] is not None and (cache is not None or q.shape[1] != k.shape[1]):
        raise ValueError(
            f"window_size={window_size!r} in dilated_attention runs whole sequences only (no "
            f"cache, query as long as the key) yet; decode a layer of local windows alone with "
            f"attention(..., window_size=..., cache=WindowKVCache(window_size)), or call "
            f"without window_size"
        )
    if cache is not None:
        check_cache_call(cache, schedule.segment_lengths, schedule.dilation_rates, q, k, is_causal)
    operation = dilated_operation(q.shape[1], k.shape[1])
    return _check_request(operation, q, k, v, key_padding_mask, checked_sinks, cu_seqlens, cache,
                          {**fields, "schedule": schedule})  # fmt: skip


@_eager_under_compile
def block_sparse_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    pattern: Pattern | torch.Tensor,
    *,
    block_size: int = 128,
    is_causal: bool = False,
    scale: float | None = None,
    backend: str | None = None,
    return_lse: bool = False,
    cu_seqlens: torch.Tensor | list[int] | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> Output:
    """Dense attention restricted to the block pairs ``pattern`` keeps (and causal, when asked).

    Query token ``p`` (block ``p // block_size``) attends key token ``t`` (block
    ``t // block_size``) when the pattern keeps that block pair and, if causal, ``t <= p``.
    With ``is_causal=True`` a query shorter than the key holds the last ``Nq`` of the ``Nk``
    positions (end-aligned, as in :func:`~dilated_attention.attention`): query row ``i`` is
    position ``p = Nk - Nq + i``, in block ``p // block_size`` (Note [End-aligned causal
    blocks] in ``resolve/resolver.py``). Query rows that attend no key give 0 (and
    ``lse = -inf``, or the sink's logit with ``sinks``). Gradients are exact, and so are
    higher-order ones (``create_graph=True``) on every kernel but FlexAttention, for which
    torch.compile raises on double backward: pass ``backend="triton"`` or a fallback kernel
    name for a gradient penalty on CUDA.

    Run-time block masks (Note [Run-time block masks] in ``block_sparse/runtime.py``): in place
    of a pattern, a tensor on the inputs' device chooses the block pairs per batch row and head
    at run time (content-selected sparsity, e.g. from
    :func:`~dilated_attention.sparse.select_blocks`): bool ``(Bm, Hm, Mq, Mk)`` (``True`` =
    the pair attends) or int block indices ``(Bm, Hm, Mq, K)`` (each query block's key blocks,
    ``-1`` = none), with ``Bm`` B or 1, ``Hm`` H, Hkv (one mask per key/value head, serving its
    group of query heads) or 1, ``Mq = ceil(Nq / block_size)``, ``Mk = ceil(Nk / block_size)``.
    Mask row ``i`` covers query *rows* ``[i * block_size, (i + 1) * block_size)`` (a pattern's
    rows are blocks of positions; the same unless an end-aligned causal query is shorter than
    the key), and query row ``r`` attends key ``t`` when the mask keeps
    ``(r // block_size, t // block_size)`` and, if causal, ``t <= Nk - Nq + r``. An index
    outside ``[0, Mk)`` keeps nothing and a repeated index counts once (neither is checked:
    that would read the mask on the host). The mask is used without host synchronisation
    (its checks read its shape, dtype and device) and gets no gradient; gradients through the
    call are exact, first order only. For example, 4 blocks, causal, a per-head mask::

        mask[b, h] = [[1, 0, 0, 0],     key block  0 1 2 3
                      [1, 1, 0, 0],     query 0    x . . .
                      [0, 1, 1, 0],     query 1    x x . .
                      [1, 0, 0, 1]]     query 2    . x x .   (x: attends, causal inside)
                                        query 3    x . . x

    Args:
        query: (B, Nq, H, D).
        key: (B, Nk, Hkv, D), H % Hkv == 0 (GQA). Nk may differ from Nq.
        value: (B, Nk, Hkv, D).
        pattern: a :mod:`dilated_attention.patterns` pattern; it is asked for the block mask
            ``(ceil(Nq / block_size), ceil(Nk / block_size))``, or with ``is_causal=True``
            ``(ceil(Nk / block_size), ceil(Nk / block_size))`` (the blocks of the key
            positions, which the query's positions are among). Or a run-time block mask: bool
            (Bm, Hm, Mq, Mk) or int (Bm, Hm, Mq, K) on the inputs' device (above).
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
            ``ValueError`` there). A run-time mask goes to the same three kernels, their lists
            made on the device; its plan runs one query block at a time on a dense kernel
            that takes key masks (Note [Run-time masks on a dense kernel] in
            ``block_sparse/rows.py``).
        return_lse: also return the log-sum-exp.
        cu_seqlens: packed documents, as in :func:`attention`: each document's blocks count
            from its own first token, and no block pair crosses documents. With a run-time
            mask every document must start at a multiple of ``block_size`` within its row
            (as for :func:`~dilated_attention.sparse.select_blocks`), the mask's blocks being
            the row's.
        softcap, sinks: as in :func:`attention`.

    Returns:
        ``out`` (B, Nq, H, D) in the input dtype, or ``(out, lse)`` with ``lse`` (B, H, Nq)
        float32 (float64 for float64 inputs on the fallback), detached.

    Raises:
        TypeError: ``pattern`` is neither a Pattern nor a tensor, a run-time mask of another
            dtype than bool or int; wrong argument types.
        ValueError: malformed tensors, ``block_size < 1``, a ``Custom`` mask of another block
            count, a run-time mask of another rank, size or device, a causal query longer than
            the key, documents not aligned to blocks with a run-time mask, or a backend that
            cannot run the inputs.
    """
    q, k, v = V.check_qkv(query, key, value, same_length=False)
    block_size = check_block_size(block_size)
    layout = _check_blocks(pattern, q, k, block_size)
    V.check_bool("is_causal", is_causal)
    V.check_bool("return_lse", return_lse)
    V.check_causal_lengths(q, k, is_causal, "block_sparse_attention")
    sinks = V.check_sinks(sinks, q)
    fields = dict(
        pattern=None if layout else pattern, block_mask=layout, block_size=block_size,
        is_causal=is_causal, scale=V.check_scale(scale), backend=check_backend_name(backend),
        softcap=V.check_softcap(softcap), sinks=sinks is not None,
    )  # fmt: skip
    mask = pattern if layout is not None else None  # the call's mask tensor
    documents = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, q, k)
    if documents is not None and mask is not None:
        check_documents_aligned(documents, q.shape[1], block_size, "block_sparse_attention")
    request = Request.of(BLOCK_SPARSE, q, k, v, documents=documents, **fields)  # type: ignore[arg-type]
    return compiled.route(request, q, k, v, mask, return_lse, sinks)


def _check_blocks(
    pattern: object, q: torch.Tensor, k: torch.Tensor, block_size: int
) -> MaskLayout | None:
    """A run-time block mask's layout (Note [Run-time block masks]), None for a pattern.

    Raises:
        TypeError: neither a Pattern nor a tensor; a mask of another dtype.
        ValueError: a mask of another rank, size or device.
    """
    if isinstance(pattern, torch.Tensor):
        return check_block_mask(pattern, q, k, block_size)
    if not isinstance(pattern, Pattern):
        raise TypeError(
            f"pattern must be a dilated_attention.patterns.Pattern (LocalWindow, GlobalLocal, "
            f"DilatedBlocks, Random, Custom, or a | / & of them) or a run-time block mask on "
            f"the inputs' device (bool (B or 1, H, Hkv or 1, Mq, Mk), or int block indices "
            f"(B or 1, H, Hkv or 1, Mq, K)), got {type(pattern).__name__}; e.g. "
            f"patterns.LocalWindow(1), or the mask of dilated_attention.sparse.select_blocks"
        )
    return None
