"""What one attention call asks for: the operation, shapes, dtype, device, flags, schedule or
pattern, and gradient needs, as plain values (no tensors): the input of the resolve step.

Note [The call's mask tensor]
    Besides query, key and value, a call carries at most one mask tensor, and every layer
    passes it on in the same place (``route``, ``execute``, a custom operator's fourth input,
    ``Strategy.run`` and ``prepare``): a dense or dilated call's key padding mask (B, Nk), or a
    block-sparse call's run-time block mask (Note [Run-time block masks] in
    ``block_sparse/runtime.py``; a block-sparse call takes no key padding mask). The request
    says which it is (``has_mask``, ``block_mask``) and describes it by plain values, so that a
    mask made each step resolves to the strategy kept for its request
    (:meth:`Request.key_padding_mask` picks the key padding mask out).

Shape legend: B batch, Nq query rows, Nk key rows, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from ..backends.base import KernelInputs
from ..backends.registry import generation
from ..block_sparse.runtime import MaskLayout
from ..core.geometry.schedule import Schedule
from ..patterns import Pattern

__all__ = [
    "BLOCK_SPARSE", "DECODE", "DENSE", "DILATED", "OPERATIONS", "CheckedCalls", "Request",
    "dilated_operation", "forget_requests", "kernel_inputs",
]  # fmt: skip

_T = TypeVar("_T")

#: The operations a request can name.
DENSE, DILATED, BLOCK_SPARSE, DECODE = "dense", "dilated", "block_sparse", "decode"
OPERATIONS = (DENSE, DILATED, BLOCK_SPARSE, DECODE)


def dilated_operation(query_len: int, key_len: int, cached_tokens: int = 0) -> str:
    """``"decode"`` for a dilated call whose queries are the last positions (a query shorter
    than the key, or new tokens after ``cached_tokens`` a cache holds), else ``"dilated"``."""
    return DECODE if query_len != key_len or cached_tokens > 0 else DILATED


@dataclass(frozen=True)
class Request:
    """One attention call, described (Note [One resolve step] in ``resolve/resolver.py``).

    Attributes:
        operation: one of :data:`OPERATIONS`. ``"decode"`` is dilated attention for queries at
            the last positions (a query shorter than the keys, or a cache holding earlier
            tokens).
        device, dtype: of the query.
        batch, query_len, key_len, num_heads, num_kv_heads, head_dim: the shapes, B, Nq, Nk
            (the keys given to this call), H, Hkv, D.
        is_causal, has_mask, dropout_p, scale: the call's flags (``scale`` None: ``D ** -0.5``).
        requires_grad: the call will be differentiated (grad mode on and an input requires it).
        backend: the kernel asked for by name (None: the automatic choice, or what
            ``use_backend`` or the environment names).
        schedule: the dilated schedule (``"dilated"``, ``"decode"``).
        pattern, block_size: the block-sparse pattern and its block size.
        block_mask: a block-sparse call's run-time block mask, described (the tensor is the
            call's mask tensor: Note [The call's mask tensor]); None: ``pattern`` gives the
            blocks.
        key_start, context_len: ``"decode"`` (and a call with a cache): the position of the
            first key row this call reads and the positions so far, this call's included (with
            a cache its held rows plus the new ones; None: ``key_len``).
        shard: ``"dilated"`` over a sequence sharded across ranks (ring dilated attention):
            ``(world_size, chunk_len)``, this call's rows being one rank's ``query_len`` of the
            ``world_size * query_len`` positions, in chunks of ``chunk_len`` (one per rank, two
            under the zigzag layout). The kernel is then chosen for the local branches, whose
            segments lie inside one chunk (``ScheduleLayout.sharded``). None: one process.
        documents: packed documents: the offsets of the documents among the ``batch *
            query_len`` positions read row after row (Note [Packed documents] in
            ``core/geometry/documents.py``; the resolve step runs the batch as one row of them, Note
            [Packed documents as one row] in ``resolve/packed.py``, but with a run-time block
            mask, whose blocks are the rows'). None: each row is one sequence.
        static: ``"decode"`` of one token per batch row at positions given as a tensor, the
            keys being a static cache's ``key_len`` buffer rows (Note [A decode step with
            static shapes] in ``core/decoding/static_cache.py``); with a static ``cache``, its
            one-token step.
        cache: the kind of decoding cache the call's new tokens extend (its class name, e.g.
            ``"DilatedKVCache"``; the cache itself travels beside the tensors), with what it
            holds in ``key_len``, ``key_start``, ``context_len``, ``static`` (Note [A cache call
            is one request] in ``resolve/caches.py``). With ``documents``: a packed prompt into
            it. None: no cache.
        first_head: ``"dilated"``: the layer head that the call's head 0 is, the call holding
            a slice of the layer's heads (Note [Heads from a later layer head] in
            ``core/geometry/schedule.py``).
        softcap, window, sinks: soft-capped scores, a local window ``(left, right)`` over the
            positions, attention sinks given (Note [Local windows, soft-capping and sinks] in
            ``core/sinks.py``).
    """

    operation: str
    device: torch.device
    dtype: torch.dtype
    batch: int
    query_len: int
    key_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    is_causal: bool = False
    has_mask: bool = False
    dropout_p: float = 0.0
    scale: float | None = None
    requires_grad: bool = False
    backend: str | None = None
    schedule: Schedule | None = None
    pattern: Pattern | None = None
    block_size: int = 128
    key_start: int = 0
    context_len: int | None = None
    shard: tuple[int, int] | None = None
    documents: tuple[int, ...] | None = None
    static: bool = False
    first_head: int = 0
    softcap: float | None = None
    window: tuple[int, int] | None = None
    sinks: bool = False
    block_mask: MaskLayout | None = None
    cache: str | None = None

    @classmethod
    def of(
        cls,
        operation: str,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        **fields: object,
    ) -> Request:
        """The request of a call on q (B, Nq, H, D), k and v (B, Nk, Hkv, D); ``fields`` are the
        remaining attributes. ``requires_grad`` defaults to grad mode and the inputs', and
        ``key_len`` to ``Nk`` (a cache call reads more keys than it is given). The same
        description gives the same request object (Note [One request per description])."""
        if "requires_grad" not in fields:
            fields["requires_grad"] = torch.is_grad_enabled() and (
                q.requires_grad or k.requires_grad or v.requires_grad
            )
        fields.setdefault("key_len", k.shape[1])
        described = _description(cls, operation, q, k, fields)
        try:
            request = _DESCRIBED.get(described) if described is not None else None
        except TypeError:  # a symbolic size, or a value that is no key: not kept
            described = request = None
        if request is None:
            batch, query_len, num_heads, head_dim = q.shape
            request = cls(
                operation=operation, device=q.device, dtype=q.dtype, batch=batch,
                query_len=query_len, num_heads=num_heads, num_kv_heads=k.shape[2],
                head_dim=head_dim, **fields,  # type: ignore[arg-type]
            )  # fmt: skip
            if described is not None:
                if len(_DESCRIBED) >= DESCRIBED_LIMIT:
                    del _DESCRIBED[next(iter(_DESCRIBED))]
                _DESCRIBED[described] = request
        return request

    def key_padding_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """The call's mask tensor as a key padding mask: None where it is a run-time block mask
        (Note [The call's mask tensor])."""
        return None if self.block_mask is not None else mask

    @property
    def positions(self) -> int:
        """The key positions so far (``context_len``, else ``key_len``)."""
        return self.key_len if self.context_len is None else self.context_len

    @property
    def softmax_scale(self) -> float:
        """``scale``, or ``D ** -0.5``."""
        return self.scale if self.scale is not None else self.head_dim**-0.5

    def check_traceable(self) -> None:
        """Refuse what the custom operators of ``compiled/`` cannot carry yet: a window, a
        soft-cap, sinks.

        Raises:
            ValueError: the call asks for one of them.
        """
        asked = (("window_size", self.window), ("softcap", self.softcap), ("sinks", self.sinks))
        names = [name for name, value in asked if value is not None and value is not False]
        if names:
            raise ValueError(
                f"{', '.join(names)} not supported under torch.compile, torch.export or "
                f"torch.func yet: call the function eagerly (torch.compiler.disable around it), "
                f"or without it"
            )

    @property
    def empty(self) -> bool:
        """No query rows to compute (a batch of 0 or 0 heads)."""
        return self.batch * self.query_len * self.num_heads * self.head_dim == 0


# Note [One request per description]
#     A Request is plain values, so the same call described again (the same shapes, dtype,
#     device and fields) is an equal Request; building one (a frozen dataclass of some thirty
#     fields) took more host time than resolving it (Note [Resolved once per request] in
#     ``resolver.py``). :meth:`Request.of` keeps each description's Request and returns it for
#     an equal description, at the cost of one tuple and one dictionary lookup. Not kept:
#     packed documents and cache calls (their offsets and positions change from call to call),
#     descriptions with a value that cannot be a key (a symbolic size), and calls traced by
#     torch.compile.
#: Descriptions -> their Request (Note [One request per description]).
_DESCRIBED: dict[tuple[object, ...], Request] = {}
#: Descriptions kept at most; the oldest is dropped first.
DESCRIBED_LIMIT = 512


def _description(
    cls: type[Request], operation: str, q: torch.Tensor, k: torch.Tensor, fields: dict[str, object]
) -> tuple[object, ...] | None:
    """What :meth:`Request.of` builds a request from, as a dictionary key, or None where it is
    not kept (Note [One request per description])."""
    if fields.get("documents") is not None or fields.get("cache") is not None:
        return None
    if torch.compiler.is_compiling():
        return None
    names, values = tuple(fields), tuple(fields.values())
    return (cls, operation, q.shape, k.shape[2], q.dtype, q.device, names, values)


def forget_requests() -> None:
    """Forget every kept request (Note [One request per description], Note [Checked once per
    call signature])."""
    _DESCRIBED.clear()
    for calls in _CHECKED_CALLS:
        calls.clear()


# Note [Checked once per call signature]
#     A public function's checks, and the Request it describes, read metadata only: the tensors'
#     types, shapes, dtypes, devices and whether they require gradients, grad mode, the
#     registered kernels (for a name given as ``backend``) and the values of the other
#     arguments. So a call with the metadata of one already checked passes the same checks and
#     describes the same Request: the function keeps the Request of each call signature it has
#     checked (:class:`CheckedCalls`) and takes it for such a call, at the cost of one tuple and
#     one dictionary lookup (at short lengths, ``attention``'s checks and description were a
#     third of its host time over SDPA's; ``dilated_attention``'s checked its schedule on every
#     call). A signature holds each option's type beside its value (``1 == True``, and only the
#     bool passes ``check_bool``; a tuple's or list's items likewise, a list by the values it
#     holds at the call), and only calls that passed every check are kept, so a bad call always
#     runs the checks and raises. Not kept: calls whose checks read more than metadata (packed
#     documents' offsets, a cache's state: ``kept=False``), options of other types than
#     :data:`_PLAIN` (a tensor, a NumPy integer), and calls traced by torch.compile (the checks
#     are traced there).
#: Every :class:`CheckedCalls`, so that :func:`forget_requests` forgets them all.
_CHECKED_CALLS: list[CheckedCalls] = []
#: The option types a signature holds by value (a tuple or list of them too); a call with any
#: other option (a tensor, a NumPy integer) is checked every time.
_PLAIN = frozenset({bool, int, float, str, type(None)})
#: Call signatures kept at most per function; the oldest is dropped first.
CHECKED_LIMIT = 512


class CheckedCalls:
    """The Request of each call signature a public function has checked (Note [Checked once
    per call signature])."""

    def __init__(self) -> None:
        self._kept: dict[tuple[object, ...], Request] = {}
        _CHECKED_CALLS.append(self)

    @staticmethod
    def _signature(
        tensors: Sequence[object], options: Sequence[object]
    ) -> tuple[object, ...] | None:
        """A call's signature: its tensor arguments' metadata (each a tensor or None) and its
        other arguments' types and values; None while torch.compile traces, or where a tensor
        argument is not a tensor (the checks raise)."""
        if torch.compiler.is_compiling():
            return None
        key: list[object] = [torch.is_grad_enabled(), generation()]
        append = key.append  # every call of the public function builds this key
        for x in tensors:
            if x is None:
                append(None)
            elif isinstance(x, torch.Tensor):
                append((type(x), x.shape, x.dtype, x.device, x.requires_grad))
            else:
                return None
        for value in options:
            kind = type(value)
            if kind is tuple or kind is list:
                value = tuple(value)
                items = tuple(map(type, value))
                if not _PLAIN.issuperset(items):
                    return None
                append(items)
            elif kind not in _PLAIN:
                return None
            append(kind)
            append(value)
        return tuple(key)

    def request(
        self,
        tensors: Sequence[object],
        options: Sequence[object],
        check: Callable[[], Request],
        kept: bool = True,
    ) -> Request:
        """The Request of a call: the one kept for its signature, else ``check()``'s (the
        function's checks, which raise on bad input), kept where ``kept`` (the checks read
        metadata only)."""
        signature = self._signature(tensors, options) if kept else None
        request = self._get(signature)
        if request is None:
            request = check()
            self._keep(signature, request)
        return request

    def _get(self, signature: tuple[object, ...] | None) -> Request | None:
        """The Request kept for ``signature``, or None (not checked yet, or not kept)."""
        return None if signature is None else self._kept.get(signature)

    def _keep(self, signature: tuple[object, ...] | None, request: Request) -> None:
        """Keep ``request`` for ``signature``, a call that passed every check."""
        if signature is None:
            return
        self._kept[signature] = request
        if len(self._kept) > CHECKED_LIMIT:
            del self._kept[next(iter(self._kept))]

    def clear(self) -> None:
        """Forget every kept signature."""
        self._kept.clear()


def kernel_inputs(
    request: Request,
    *,
    query_len: int | None = None,
    key_len: int | None = None,
    is_causal: bool | None = None,
    has_mask: bool | None = None,
    block_size: int | None = None,
    branch_slots: bool = False,
) -> KernelInputs:
    """What the registries judge kernels by: ``request``'s, with a kernel call's own
    shape or flags where they differ from the request's (decoding's one-row calls, a
    chunk's square causal calls)."""
    return KernelInputs(
        device=request.device, dtype=request.dtype, head_dim=request.head_dim,
        num_heads=request.num_heads, num_kv_heads=request.num_kv_heads,
        query_len=given(query_len, request.query_len), key_len=given(key_len, request.key_len),
        is_causal=given(is_causal, request.is_causal), has_mask=given(has_mask, request.has_mask),
        dropout_p=request.dropout_p, requires_grad=request.requires_grad, block_size=block_size,
        branch_slots=branch_slots, documents=request.documents is not None,
        softcap=request.softcap is not None, window=request.window is not None,
        sinks=request.sinks, batch=_launch_rows(request),
    )  # fmt: skip


def _launch_rows(request: Request) -> int:
    """The batch rows a kernel's launch grid holds: one for packed documents (one row of the
    batch's positions) and for a static cache's step (whose launches put the rows on the
    grid's long axis), else the batch."""
    return 1 if request.documents is not None or request.static else request.batch


def given(value: _T | None, default: _T) -> _T:
    """``value``, or ``default`` where it is None."""
    return default if value is None else value
