"""Build attention modules by kind, and explain which kernel runs them.

Kinds are registered by name with :func:`register_kind`. The kinds ``"dilated"`` and ``"local"``
(sliding-window attention, :class:`~dilated_attention.modules.LocalAttention`: pass ``window=W``
or ``window_size=(left, right)`` instead of a schedule) are built in, and so are the kinds of
blocks selected from the content: ``"moba"`` (MoBA-style,
:class:`~dilated_attention.modules.BlockSelectedAttention`: ``block_size=``, ``topk=``) and
``"nsa"`` (NSA-style, :class:`~dilated_attention.modules.CompressedSelectedWindowAttention`:
``compress_block=``, ``compress_stride=``, ``select_block=``, ``topk=``, ``window=``; its
multihead layer computes NSA's gates from its input), or their configs
(:class:`~dilated_attention.config.BlockSelectedConfig`,
:class:`~dilated_attention.config.CompressedSelectedWindowConfig`) as ``config=``;
ring and block-sparse kinds live in modules the factory never imports at load time: a kind listed in
``_PROVIDERS`` is imported the first time it is asked for, and that import registers it.

Block-sparse kinds (``"block_sparse"``, and ``"block_sparse_ring"`` over a sharded sequence) take a
``pattern`` instead of ``segment_lengths``/``dilation_rates``; build them with
:func:`create_block_sparse_attention` (the generic ``create_*`` functions accept them too when
given ``pattern=...``).

Names users of the earlier dilated-attention packages know map onto ours (``KIND_ALIASES``):

==========================================  =================
earlier name                                 kind here
==========================================  =================
``"standard"``, ``"improved"``               ``"dilated"``
``"distributed"``, ``"ring"``                ``"ring"``
==========================================  =================

(The earlier ``"block_sparse_ring"`` name is now a kind of its own: the ring variant.)
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import _validation as V
from .backends.registry import (
    BLOCK_SPARSE,
    DENSE,
    DILATED,
    OPERATIONS,
    BackendChoice,
    check_backend_name,
)
from .block_sparse.runtime import MaskLayout
from .config import (
    BlockSelectedConfig,
    CompressedSelectedWindowConfig,
    DilatedConfig,
    MultiheadDilatedConfig,
)
from .core.devices import resolve_device
from .core.geometry.schedule import Schedule
from .modules import (
    LAYER_ARGUMENTS,
    SELECTED_KINDS,
    DilatedAttention,
    MultiheadAttention,
    MultiheadDilatedAttention,
    build_local,
    build_local_multihead,
)
from .patterns import Pattern, check_pattern
from .resolve import Request, resolve
from .sparse.explain import explain_layer

__all__ = [
    "KIND_ALIASES",
    "create_block_sparse_attention",
    "create_dilated_attention",
    "create_multihead_dilated_attention",
    "explain",
    "list_kinds",
    "register_kind",
]


@dataclass(frozen=True)
class _Kind:
    """A kind's constructors: the inner (B, N, H, D) module, and the multihead layer (None: the
    library's :class:`MultiheadAttention` around the inner module)."""

    dilated: Callable[..., nn.Module]
    multihead: Callable[..., nn.Module] | None = None

    def build_multihead(self, params: dict[str, Any]) -> nn.Module:
        if self.multihead is not None:
            return self.multihead(**params)
        layer = {name: value for name, value in params.items() if name in LAYER_ARGUMENTS}
        inner = {name: value for name, value in params.items() if name not in LAYER_ARGUMENTS}
        return MultiheadAttention(attention=self.dilated(**inner), **layer)


_KINDS: dict[str, _Kind] = {
    "dilated": _Kind(dilated=DilatedAttention, multihead=MultiheadDilatedAttention),
    "local": _Kind(dilated=build_local, multihead=build_local_multihead),
    **{name: _Kind(*builders) for name, builders in SELECTED_KINDS.items()},
}

#: kind -> module that provides it, imported on first request only. The module either calls
#: register_kind on import or exposes ``FACTORY_KINDS = {kind: (dilated_cls, multihead_cls)}``.
_PROVIDERS: dict[str, str] = {
    "ring": "dilated_attention.distributed.modules",
    "block_sparse": "dilated_attention.modules",
    "block_sparse_ring": "dilated_attention.distributed.rings.block_sparse_ring",
}

#: The kinds :func:`create_block_sparse_attention` builds (besides ``"auto"``).
BLOCK_SPARSE_KINDS = ("block_sparse", "block_sparse_ring")

#: The configs ``config=`` takes.
KindConfig = (
    DilatedConfig | MultiheadDilatedConfig | BlockSelectedConfig | CompressedSelectedWindowConfig
)

KIND_ALIASES: dict[str, str] = {
    "standard": "dilated",
    "improved": "dilated",
    "distributed": "ring",
}


def register_kind(
    name: str,
    *,
    dilated: Callable[..., nn.Module],
    multihead: Callable[..., nn.Module] | None = None,
) -> None:
    """Register a module kind: constructors taking the local modules' arguments.

    ``dilated`` builds the inner (B, N, H, D) module. ``multihead`` builds the multihead layer;
    without it the factory builds :class:`~dilated_attention.modules.MultiheadAttention` around
    ``dilated(...)``, passing the layer's own arguments (``embed_dim``, ``num_heads``,
    ``num_kv_heads``, ``bias``, ...) to the layer and the rest to ``dilated``.

    Raises:
        TypeError: ``name`` is not a string, or a constructor is not callable.
        ValueError: ``name`` is empty or ``"auto"`` (reserved for the automatic choice).
    """
    if not isinstance(name, str):
        raise TypeError(
            f"name must be a string naming the kind, got {name!r} ({type(name).__name__}); e.g. "
            f"register_kind('my_kind', dilated=MyAttention, multihead=MyMultihead)"
        )
    if not name.strip() or name == "auto":
        raise ValueError(
            f"name must be a non-empty string other than 'auto' (which picks a kind), got {name!r}"
        )
    for arg, builder in (("dilated", dilated), ("multihead", multihead)):
        if builder is None and arg == "multihead":
            continue
        if not callable(builder):
            raise TypeError(
                f"{arg} must be a callable (a module class or a function) returning an "
                f"nn.Module, got {arg}={builder!r} ({type(builder).__name__})"
            )
    _KINDS[name] = _Kind(dilated=dilated, multihead=multihead)


def list_kinds() -> list[str]:
    """Kinds that can be built here (registered, or importable on request), and ``"auto"``."""
    return ["auto", *_KINDS, *(k for k in _PROVIDERS if k not in _KINDS)]


def _distributed_world_size() -> int:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def _resolve_kind(kind: object) -> _Kind:
    if not isinstance(kind, str):
        raise TypeError(f"kind must be a string, one of {list_kinds()}, got {kind!r}")
    name = KIND_ALIASES.get(kind, kind)
    if name == "auto":
        multi_rank = _distributed_world_size() > 1
        name = "ring" if multi_rank and ("ring" in _KINDS or "ring" in _PROVIDERS) else "dilated"
    if name not in _KINDS and name in _PROVIDERS:
        try:
            provider = importlib.import_module(_PROVIDERS[name])
        except ImportError as exc:
            raise ValueError(
                f"kind {kind!r} is not available: importing {_PROVIDERS[name]} failed ({exc})"
            ) from exc
        for provided, (dilated, multihead) in getattr(provider, "FACTORY_KINDS", {}).items():
            _KINDS.setdefault(provided, _Kind(dilated=dilated, multihead=multihead))
    if name not in _KINDS:
        alias = f" (an alias of {name!r})" if name != kind else ""
        raise ValueError(
            f"kind {kind!r}{alias} is not available; valid kinds: {list_kinds()}, aliases: "
            f"{sorted(KIND_ALIASES)}"
        )
    return _KINDS[name]


def _merge_config(
    config: KindConfig | None,
    fields: dict[str, Any],
    backend: object,
    kwargs: dict[str, Any],
) -> dict[str, Any]:
    """Constructor arguments from either a config or keyword arguments; ``backend`` (when not
    ``"auto"``) and ``kwargs`` override the config's values."""
    chosen_backend = check_backend_name(backend)
    if config is None:
        return {**fields, **kwargs, "backend": chosen_backend}
    # A field the config does not hold (the layer's embed_dim around a MoBA config) is given.
    held = {f.name for f in dataclasses.fields(config)}
    given = sorted(name for name, value in fields.items() if value is not None and name in held)
    if given:
        raise ValueError(
            f"pass either config= or {given} as arguments, not both; to change a field of a "
            f"config use dataclasses.replace(config, ...)"
        )
    outside = {name: value for name, value in fields.items() if name not in held}
    params = {**outside, **config.kwargs(), **kwargs}
    if chosen_backend is not None:
        params["backend"] = chosen_backend
    return params


def create_dilated_attention(
    kind: str = "auto",
    *,
    segment_lengths: list[int] | tuple[int, ...] | None = None,
    dilation_rates: list[int] | tuple[int, ...] | None = None,
    backend: str = "auto",
    config: DilatedConfig | BlockSelectedConfig | CompressedSelectedWindowConfig | None = None,
    **kwargs: Any,
) -> nn.Module:
    """A dilated attention module over (B, N, H, D) tensors.

    Args:
        kind: ``"auto"`` (ring when a process group of more than one rank is initialised and ring
            attention is available, else ``"dilated"``), ``"dilated"``, ``"local"`` (a sliding
            window: ``window=W`` or ``window_size=(left, right)`` instead of a schedule), or
            another registered kind or alias (see the module docstring).
        segment_lengths: w per branch (or give ``config``).
        dilation_rates: r per branch.
        backend: ``"auto"`` or a kernel name from ``list_backends()``.
        config: a :class:`DilatedConfig` instead of the keyword arguments (kind ``"moba"``: a
            :class:`BlockSelectedConfig`, ``"nsa"``: a :class:`CompressedSelectedWindowConfig`).
        **kwargs: further constructor arguments (``scale``, ``dropout``, ...).

    Returns:
        A module with ``forward(query, key, value, *, is_causal=False, key_padding_mask=None)``.
    """
    builder = _resolve_kind(kind)
    fields = {"segment_lengths": segment_lengths, "dilation_rates": dilation_rates}
    params = _merge_config(config, fields, backend, kwargs)
    return builder.dilated(**params)


def create_multihead_dilated_attention(
    kind: str = "auto",
    *,
    embed_dim: int | None = None,
    num_heads: int | None = None,
    segment_lengths: list[int] | tuple[int, ...] | None = None,
    dilation_rates: list[int] | tuple[int, ...] | None = None,
    backend: str = "auto",
    config: KindConfig | None = None,
    **kwargs: Any,
) -> nn.Module:
    """A batch-first multihead dilated attention layer (drop-in for ``nn.MultiheadAttention``).

    Args:
        kind: as in :func:`create_dilated_attention`.
        embed_dim, num_heads, segment_lengths, dilation_rates: as in ``MultiheadDilatedAttention``
            (or give ``config``).
        backend: ``"auto"`` or a kernel name.
        config: a :class:`MultiheadDilatedConfig` instead of the keyword arguments (kinds
            ``"moba"`` and ``"nsa"``: their inner module's config, next to ``embed_dim`` and
            ``num_heads``).
        **kwargs: further constructor arguments (``num_kv_heads``, ``dropout``, ``device``, ...).

    Returns:
        A module with ``nn.MultiheadAttention``'s call: ``forward(query, key=None,
        value=None, key_padding_mask=None, need_weights=False, attn_mask=None,
        average_attn_weights=True, is_causal=False) -> (out, None)``.
    """
    builder = _resolve_kind(kind)
    fields = {
        "embed_dim": embed_dim,
        "num_heads": num_heads,
        "segment_lengths": segment_lengths,
        "dilation_rates": dilation_rates,
    }
    params = _merge_config(config, fields, backend, kwargs)
    return builder.build_multihead(params)


def create_block_sparse_attention(
    pattern: Pattern,
    *,
    block_size: int = 128,
    kind: str = "auto",
    embed_dim: int | None = None,
    num_heads: int | None = None,
    backend: str = "auto",
    **kwargs: Any,
) -> nn.Module:
    """A block-sparse attention module (or multihead layer, given ``embed_dim``/``num_heads``).

    Args:
        pattern: a :mod:`dilated_attention.patterns` pattern (e.g. ``patterns.LocalWindow(1)``,
            ``patterns.preset("sparse_10")``).
        block_size: tokens per block.
        kind: ``"auto"`` (``"block_sparse_ring"`` when a process group of more than one rank is
            initialised, else ``"block_sparse"``), ``"block_sparse"`` or ``"block_sparse_ring"``.
        embed_dim, num_heads: give both for a batch-first multihead layer over (B, N, E).
        backend: ``"auto"``, ``"flex"`` or a kernel name from ``list_backends()``.
        **kwargs: further constructor arguments (``scale``, ``num_kv_heads``, ``group``,
            ``device``, ...).

    Returns:
        ``BlockSparseAttention`` / ``BlockSparseRingAttention`` with ``forward(query, key,
        value, *, is_causal=False)`` over (B, N, H, D), or ``BlockSparseMultiheadAttention`` /
        ``BlockSparseRingMultiheadAttention`` with ``nn.MultiheadAttention``'s call
        (``forward(query, key=None, value=None, key_padding_mask=None, need_weights=False,
        attn_mask=None, average_attn_weights=True, is_causal=False) -> (out, None)``) over
        (B, N, E).

    Raises:
        TypeError: ``pattern`` is not a Pattern.
        ValueError: an unknown kind or backend, ``block_size < 1``, only one of
            ``embed_dim``/``num_heads``.
    """
    check_pattern(pattern)
    if not isinstance(kind, str):
        raise TypeError(
            f"kind must be a string, one of ('auto', *{BLOCK_SPARSE_KINDS}), got {kind!r}"
        )
    if kind == "auto":
        kind = "block_sparse_ring" if _distributed_world_size() > 1 else "block_sparse"
    if kind not in BLOCK_SPARSE_KINDS:
        raise ValueError(
            f"kind must be 'auto' or one of {BLOCK_SPARSE_KINDS} for block-sparse attention, got "
            f"{kind!r}; for dilated kinds use create_dilated_attention"
        )
    builder = _resolve_kind(kind)
    params = {"pattern": pattern, "block_size": block_size, **kwargs}
    params["backend"] = check_backend_name(backend)
    if (embed_dim is None) != (num_heads is None):
        raise ValueError(
            f"give both embed_dim and num_heads for a multihead layer, or neither for a (B, N, H, "
            f"D) module; got embed_dim={embed_dim!r}, num_heads={num_heads!r}"
        )
    if embed_dim is None:
        return builder.dilated(**params)
    return builder.build_multihead({"embed_dim": embed_dim, "num_heads": num_heads, **params})


def explain(
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    head_dim: int = 64,
    num_heads: int = 16,
    num_kv_heads: int | None = None,
    seq_len: int = 4096,
    is_causal: bool = False,
    key_padding_mask: bool = False,
    dropout_p: float = 0.0,
    requires_grad: bool = True,
    backend: str | None = None,
    dilated: bool = False,
    operation: str | None = None,
    block_size: int = 128,
    segment_lengths: Sequence[int] | None = None,
    dilation_rates: Sequence[int] | None = None,
    window_size: tuple[int, int] | None = None,
    softcap: float | None = None,
    sinks: bool = False,
    block_mask: bool = False,
    kind: str | None = None,
) -> BackendChoice:
    """Which kernel would run an attention operation with these properties, and why no other.

    Args:
        device: default CUDA when available, else CPU.
        dtype: default bfloat16 on CUDA, float32 elsewhere.
        head_dim, num_heads, num_kv_heads, seq_len: the kernel call's shape (one segment's rows).
        is_causal, key_padding_mask, dropout_p, requires_grad: the features it needs.
        backend: explain a forced choice instead of the automatic one (``None`` or ``"auto"``:
            the automatic one).
        dilated: the same as ``operation="dilated"``.
        operation: whose registry answers: ``"dense"`` (the default), ``"dilated"`` (where our
            fused kernels run every branch themselves on the devices they were measured fastest
            on) or ``"block_sparse"`` (our block-sparse Triton kernels and FlexAttention, each
            running the whole pattern, then the plan on a dense kernel).
        block_size: tokens per block, for ``operation="block_sparse"``.
        segment_lengths, dilation_rates: a dilated schedule over ``seq_len`` positions (implies
            ``operation="dilated"``): the choice then also says how each branch runs on the
            chosen kernel (``.branches``).
        window_size, softcap, sinks: a local window, soft-capped scores, attention sinks
            (Note [Local windows, soft-capping and sinks] in ``core/sinks.py``). A layer of
            kind ``"local"`` runs ``operation="dense"`` with its ``window_size`` (``(W - 1,
            0)`` for ``window=W``, with ``is_causal=True`` in a decoder).
        block_mask: block-sparse attention on a run-time block mask (a bool mask per batch row
            and head, Note [Run-time block masks]) instead of a pattern; implies
            ``operation="block_sparse"``.
        kind: ``"moba"`` or ``"nsa"``: the calls of a layer of that factory kind over
            ``seq_len`` positions (Note [Explaining a selected-block layer]): MoBA's
            block-sparse call on a run-time mask of ``block_size`` blocks (one per query head);
            NSA's three branches, ``.branches`` one line each: the compressed keys (causal:
            calls of about ``seq_len / 16`` rows over as many compressed keys, the default
            ``compress_stride``), the selected ``block_size`` blocks (a mask per key/value
            head) and the window (``window_size``, default ``(511, 0)``). Leave
            ``operation``, ``dilated``, the schedule and ``block_mask`` out.

    Returns:
        The resolve step's choice (:class:`BackendChoice`): ``.backend``, ``.reasons`` (every
        other kernel, why not), ``.order``, ``.source``, ``.operation``, ``.runs_plan``, with a
        schedule ``.branches`` (how each branch runs), and ``str(choice)``: all of it in words.

    Raises:
        ValueError: ``device`` is not a device or not available here (e.g. ``"cuda"`` on a
            machine without a GPU), a size is not a positive int (or ``num_heads`` is not a
            multiple of ``num_kv_heads``), ``dropout_p`` is outside [0, 1), ``backend`` is
            unknown or cannot run these inputs, or no backend can.
        TypeError: ``device``, ``dtype``, ``backend`` or a flag has the wrong type.
    """
    dev = resolve_device(device)
    head_dim = V.check_positive_int("head_dim", head_dim)
    num_heads = V.check_positive_int("num_heads", num_heads)
    # embed_dim = head_dim * num_heads always divides: this checks num_kv_heads only.
    num_kv_heads = V.check_heads(head_dim * num_heads, num_heads, num_kv_heads)
    seq_len = V.check_positive_int("seq_len", seq_len)
    flags = {"is_causal": is_causal, "key_padding_mask": key_padding_mask,
             "requires_grad": requires_grad, "dilated": dilated, "sinks": sinks,
             "block_mask": block_mask}  # fmt: skip
    for name, flag in flags.items():
        V.check_bool(name, flag)
    dropout_p = V.check_dropout("dropout_p", dropout_p)
    backend = check_backend_name(backend)
    block_size = V.check_positive_int("block_size", block_size)
    if kind is not None and (operation or dilated or segment_lengths or block_mask):
        raise ValueError(
            f"kind={kind!r} explains a layer of that kind (its calls' operations are its "
            f"own), got operation={operation!r}, dilated={dilated}, segment_lengths="
            f"{segment_lengths!r}, block_mask={block_mask}; leave them out"
        )
    if block_mask and operation is None and not dilated:
        operation = BLOCK_SPARSE
    schedule, operation = _explained_operation(operation, dilated, segment_lengths, dilation_rates)
    if block_mask and operation != BLOCK_SPARSE:
        raise ValueError(
            f"block_mask=True explains block-sparse attention on a run-time block mask, got "
            f"operation={operation!r}; leave operation, dilated and the schedule out, or pass "
            f"operation='block_sparse'"
        )
    layout = MaskLayout(False, 1, num_heads, -(-seq_len // block_size)) if block_mask else None
    if operation == BLOCK_SPARSE and (key_padding_mask or dropout_p):
        raise ValueError(
            f"block-sparse attention takes no key_padding_mask and no dropout (got "
            f"key_padding_mask={key_padding_mask}, dropout_p={dropout_p}); express padding in "
            f"the pattern, or explain operation='dense' / 'dilated'"
        )
    request = Request(
        operation=operation, device=dev, dtype=_explained_dtype(dev, dtype), batch=1,
        query_len=seq_len,
        key_len=seq_len, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        is_causal=is_causal, has_mask=key_padding_mask, dropout_p=dropout_p,
        requires_grad=requires_grad, backend=backend, block_size=block_size,
        schedule=schedule, window=V.check_window_size(window_size),
        softcap=V.check_softcap(softcap), sinks=sinks, block_mask=layout,
    )  # fmt: skip
    return resolve(request).choice() if kind is None else explain_layer(kind, request)


def _explained_dtype(device: torch.device, dtype: object) -> torch.dtype:
    """``explain``'s dtype: bfloat16 on CUDA and float32 elsewhere by default.

    Raises:
        TypeError: not a torch.dtype or None.
    """
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if not isinstance(dtype, torch.dtype):
        raise TypeError(
            f"dtype must be a torch.dtype such as torch.bfloat16, or None, got dtype={dtype!r}"
        )
    return dtype


def _explained_operation(
    operation: str | None,
    dilated: bool,
    segment_lengths: Sequence[int] | None,
    dilation_rates: Sequence[int] | None,
) -> tuple[Schedule | None, str]:
    """``explain``'s schedule (None without one) and operation: a schedule means
    ``"dilated"``; otherwise ``operation``, or ``"dilated"`` / ``"dense"`` by ``dilated``.

    Raises:
        ValueError: half a schedule, an invalid one, a schedule with another operation, or an
            unknown operation.
    """
    schedule = None
    if segment_lengths is not None or dilation_rates is not None:
        if segment_lengths is None or dilation_rates is None:
            raise ValueError(
                f"pass segment_lengths and dilation_rates together, got segment_lengths="
                f"{segment_lengths!r}, dilation_rates={dilation_rates!r}"
            )
        schedule = Schedule(segment_lengths, dilation_rates)  # checks them
        if operation not in (None, DILATED):
            raise ValueError(
                f"a schedule (segment_lengths, dilation_rates) explains operation='dilated', "
                f"got operation={operation!r}; leave operation out or pass 'dilated'"
            )
        return schedule, DILATED
    if operation is None:
        return None, DILATED if dilated else DENSE
    if operation not in OPERATIONS or (dilated and operation != DILATED):
        raise ValueError(
            f"operation must be one of {OPERATIONS} (or None: 'dilated' when dilated=True, else "
            f"'dense'), got operation={operation!r} with dilated={dilated!r}"
        )
    return None, operation
