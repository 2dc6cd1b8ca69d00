"""The public attention functions: validate, resolve, run.

``attention`` (dense), ``dilated_attention`` and ``block_sparse_attention`` check their
arguments (``_validation.py``), describe the call as a :class:`~dilated_attention.resolve.Request`
and hand it to the resolve step, which chooses the kernel and how the work is cut and runs it
(Note [One resolve step] in ``resolve/resolver.py``). Under ``torch.compile``, ``torch.export``
and ``torch.func`` the same request runs inside a custom operator (``compiled/``).

Shape legend: B batch, N seq_len, H query heads, Hkv key/value heads (H % Hkv == 0), D head dim.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from . import _validation as V
from . import compiled, decode_step, window_decode
from .backends.registry import check_backend_name
from .block_sparse.plan import check_block_size
from .block_sparse.runtime import MaskLayout, check_block_mask, check_documents_aligned
from .core.autograd import Inputs
from .core.caches import Cache, check_cache_call, check_window_cache_call
from .core.documents import check_cu_seqlens, flatten, last_document, unflatten
from .core.hidden import hide_masked_keys
from .core.schedule import Schedule
from .core.static_cache import StaticDilatedKVCache
from .core.window_cache import StaticWindowKVCache
from .patterns import Pattern
from .resolve import BLOCK_SPARSE, DENSE, DILATED, Request, dilated_operation, resolve

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
#     and no window (Note [A window cache] in ``core/window_cache.py``): the dense operator
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
            among them (Note [Packed documents] in ``core/documents.py``); Nq == Nk.
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
            ``core/window_cache.py``), with ``is_causal=True`` and the layer's
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
    q, k, v = V.check_qkv(query, key, value, same_length=False)
    V.check_bool("is_causal", is_causal)
    V.check_bool("return_lse", return_lse)
    V.check_causal_lengths(q, k, is_causal, "attention")
    V.check_key_padding_mask(key_padding_mask, k.shape[0], k.shape[1], q.device)
    sinks = V.check_sinks(sinks, q)
    fields = dict(
        is_causal=is_causal, has_mask=key_padding_mask is not None,
        dropout_p=V.check_dropout("dropout_p", dropout_p), scale=V.check_scale(scale),
        backend=check_backend_name(backend), window=V.check_window_size(window_size),
        softcap=V.check_softcap(softcap), sinks=sinks is not None,
    )  # fmt: skip
    if cache is not None:
        new = Inputs(q, k, v, key_padding_mask)
        return _window_cache_call(cache, cu_seqlens, new, fields, return_lse, sinks)
    if cu_seqlens is not None:
        documents = check_cu_seqlens(cu_seqlens, q, k)
        return _packed(DENSE, documents, q, k, v, key_padding_mask, fields, return_lse, sinks)
    request = Request.of(DENSE, q, k, v, **fields)
    return compiled.route(request, q, k, v, key_padding_mask, return_lse, sinks)


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
    [Decoding rows] in ``core/decode.py``).

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
            an empty ``cache`` a prompt (Note [A packed prompt] in ``core/documents.py``).
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
    schedule = Schedule(segment_lengths, dilation_rates)  # checks them
    q, k, v = V.check_qkv(query, key, value, same_length=False)
    V.check_bool("is_causal", is_causal)
    V.check_bool("return_lse", return_lse)
    V.check_decoding_lengths(q, k, is_causal)
    V.check_key_padding_mask(key_padding_mask, k.shape[0], k.shape[1], q.device)
    sinks = V.check_sinks(sinks, q)
    window = V.check_window_size(window_size)
    if window is not None and (cache is not None or q.shape[1] != k.shape[1]):
        raise ValueError(
            f"window_size={window_size!r} in dilated_attention runs whole sequences only (no "
            f"cache, query as long as the key) yet; decode a layer of local windows alone with "
            f"attention(..., window_size=..., cache=WindowKVCache(window_size)), or call "
            f"without window_size"
        )
    fields = dict(
        is_causal=is_causal, has_mask=key_padding_mask is not None,
        dropout_p=V.check_dropout("dropout_p", dropout_p), scale=V.check_scale(scale),
        backend=check_backend_name(backend), schedule=schedule, window=window,
        softcap=V.check_softcap(softcap), sinks=sinks is not None,
    )  # fmt: skip
    if cu_seqlens is not None:
        return _packed_dilated(
            cu_seqlens, cache, q, k, v, key_padding_mask, fields, return_lse, sinks
        )
    if cache is not None:
        return _decode(cache, q, k, v, key_padding_mask, fields, return_lse, sinks)
    request = Request.of(dilated_operation(q.shape[1], k.shape[1]), q, k, v, **fields)
    return compiled.route(request, q, k, v, key_padding_mask, return_lse, sinks)


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
    if cu_seqlens is not None:
        documents = check_cu_seqlens(cu_seqlens, q, k)
        if mask is not None:
            return _packed_block_mask(documents, q, k, v, mask, fields, return_lse, sinks)
        return _packed(BLOCK_SPARSE, documents, q, k, v, None, fields, return_lse, sinks)
    request = Request.of(BLOCK_SPARSE, q, k, v, **fields)  # type: ignore[arg-type]
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


def _packed_block_mask(
    documents: tuple[int, ...],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    fields: dict[str, object],
    return_lse: bool,
    sinks: torch.Tensor | None,
) -> Output:
    """A checked block-sparse call with a run-time mask on packed documents: the rows run as
    they are, the pairs of two documents dropped from the mask's blocks (Note [Run-time block
    masks] in ``block_sparse/runtime.py``); documents must start at blocks."""
    check_documents_aligned(
        documents, q.shape[1], int(fields["block_size"]), "block_sparse_attention"  # type: ignore[call-overload]
    )
    if compiled.is_traced(q, k, v, mask):
        raise ValueError(
            "cu_seqlens is not supported under torch.compile, torch.export or torch.func yet: "
            "call the packed batch eagerly, or give each document its own row"
        )
    request = Request.of(BLOCK_SPARSE, q, k, v, documents=documents, **fields)  # type: ignore[arg-type]
    return compiled.route(request, q, k, v, mask, return_lse, sinks)


def _decode(
    cache: Cache,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    fields: dict[str, object],
    return_lse: bool,
    sinks: torch.Tensor | None = None,
) -> Output:
    """A checked dilated call on new tokens with their layer's cache: q (B, n, H, D), k and v
    (B, n, Hkv, D), key_padding_mask (B, n) over the new keys -> ``out`` or ``(out, lse)``.
    Resolved before the cache changes (a refused call leaves it as it was); then the new keys
    join the ones they read (positions ``cache.start`` to ``cache.length + n``)."""
    schedule, is_causal = fields["schedule"], bool(fields["is_causal"])
    assert isinstance(schedule, Schedule)  # dilated_attention's fields
    check_cache_call(cache, schedule.segment_lengths, schedule.dilation_rates, q, k, is_causal)
    if isinstance(cache, StaticDilatedKVCache):
        out, lse = decode_step.static_decode(cache, q, k, v, key_padding_mask, fields, sinks)
        return (out, lse) if return_lse else out
    if compiled.is_traced(q, k, v, key_padding_mask):
        raise ValueError(
            "cache= is not supported under torch.compile, torch.export or torch.func yet: "
            "decode eagerly (the cache is Python state the compiled operator cannot update)"
        )
    request = Request.of(
        dilated_operation(q.shape[1], k.shape[1], cache.length), q, k, v,
        key_start=cache.start, context_len=cache.length + k.shape[1], **fields,
    )  # fmt: skip
    strategy = resolve(request)
    k, v = hide_masked_keys(k, v, key_padding_mask)  # the cache keeps them so: no copy per token
    k, v, key_padding_mask, _ = cache.append(k, v, key_padding_mask)
    out, lse = strategy.run(q, k, v, key_padding_mask, sinks)
    return (out, lse) if return_lse else out


def _window_cache_call(
    cache: Cache,
    cu_seqlens: object,
    new: Inputs,
    fields: dict[str, object],
    return_lse: bool,
    sinks: torch.Tensor | None,
) -> Output:
    """A checked dense call on new tokens with a windowed layer's cache (Note [A window cache]
    in ``core/window_cache.py``): ``new`` holds q (B, n, H, D), k and v (B, n, Hkv, D) and the
    mask (B, n) over the new keys. With ``cu_seqlens`` a packed prompt (each row's last
    document into the cache), else the cache's decoding (``window_decode``)."""
    q, k, v, key_padding_mask = new
    window, is_causal = fields["window"], bool(fields["is_causal"])
    cache = check_window_cache_call(cache, window, q, k, is_causal)  # type: ignore[arg-type]
    if cu_seqlens is None:
        out, lse = window_decode.window_decode(cache, new, fields, sinks)
        return (out, lse) if return_lse else out
    documents = check_cu_seqlens(cu_seqlens, q, k, cache)
    result = _packed(DENSE, documents, q, k, v, key_padding_mask, fields, return_lse, sinks)
    _prompt_into(cache, documents, k, v, key_padding_mask)
    return result


def _packed_dilated(
    cu_seqlens: object,
    cache: Cache | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    fields: dict[str, object],
    return_lse: bool,
    sinks: torch.Tensor | None = None,
) -> Output:
    """Checked dilated attention on packed documents; with a ``cache`` a packed prompt (Note [A
    packed prompt] in ``core/documents.py``): the packed call, then each row's last document's
    keys and values into the cache, which is checked first."""
    documents = check_cu_seqlens(cu_seqlens, q, k, cache)
    if cache is not None:
        schedule = fields["schedule"]
        assert isinstance(schedule, Schedule)  # dilated_attention's fields
        segs, rates, causal = schedule.segment_lengths, schedule.dilation_rates, fields["is_causal"]
        check_cache_call(cache, segs, rates, q, k, bool(causal))
    result = _packed(DILATED, documents, q, k, v, key_padding_mask, fields, return_lse, sinks)
    _prompt_into(cache, documents, k, v, key_padding_mask)
    return result


def _prompt_into(
    cache: Cache | None,
    documents: tuple[int, ...],
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
) -> None:
    """A packed prompt's cache (checked; Note [A packed prompt] in ``core/documents.py``) takes
    each row's last document's keys and values (B, n, Hkv, D) and mask (B, n), from the
    packed rows k, v (B, N, Hkv, D); nothing without a cache."""
    if cache is None:
        return
    tail = slice(k.shape[1] - last_document(documents, *k.shape[:2]), None)
    mask = None if key_padding_mask is None else key_padding_mask[:, tail]
    k, v = hide_masked_keys(k[:, tail], v[:, tail], mask)
    cache.take_prompt(k, v, mask)


def _packed(
    operation: str,
    documents: tuple[int, ...],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    fields: dict[str, object],
    return_lse: bool,
    sinks: torch.Tensor | None = None,
) -> Output:
    """A checked call on packed documents (Note [Packed documents] in ``core/documents.py``):
    q (B, N, H, D), k and v (B, N, Hkv, D) as one row of their documents, run, and the results
    in the batch's shape."""
    if compiled.is_traced(q, k, v, key_padding_mask):
        raise ValueError(
            "cu_seqlens is not supported under torch.compile, torch.export or torch.func yet: "
            "call the packed batch eagerly, or give each document its own row"
        )
    batch, seq_len = q.shape[:2]
    if batch == 0:  # no document: the empty batch unpacked (Note [An empty packed batch])
        request = Request.of(operation, q, k, v, **fields)  # type: ignore[arg-type]
        return compiled.route(request, q, k, v, key_padding_mask, return_lse)
    qf, kf, vf, mask = (flatten(x) for x in (q, k, v, key_padding_mask))
    request = Request.of(operation, qf, kf, vf, documents=documents, **fields)  # type: ignore[arg-type]
    out, lse = compiled.route(request, qf, kf, vf, mask, True, sinks)  # type: ignore[arg-type]
    out, lse = unflatten(out, lse, batch, seq_len)
    return (out, lse) if return_lse else out
