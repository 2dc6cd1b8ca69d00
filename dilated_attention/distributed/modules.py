"""Ring modules: the local modules' constructors and forwards, over a sharded sequence.

Each rank passes its shard (B, n, ...) of the sequence; the modules return that rank's shard of the
result. They wrap the local modules from outside (``modules.py`` never imports this package).
"""

from __future__ import annotations

from typing import Any, ClassVar, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from .. import _validation as V
from ..backends.registry import check_backend_name
from ..config import MultiheadDilatedConfig
from ..modules import DilatedAttention, MultiheadAttention, MultiheadDilatedAttention
from ..modules.scores import learnable_sinks
from .comm.agreement import COMMS, AgreedForward, reject_ring_call
from .layout.sharding import check_layout
from .rings.packed_ring import shard_offsets, shard_positions
from .rings.ring import ring_attention
from .rings.ring_dilated import ring_dilated_attention

__all__ = ["RingAttention", "RingDilatedAttention", "RingModule", "RingMultiheadAttention",
           "RingMultiheadDilatedAttention"]  # fmt: skip


def _no_dropout(dropout: float) -> None:
    if V.check_dropout("dropout", dropout) > 0:
        raise ValueError(
            f"dropout must be 0 for ring attention (got {dropout}): per-step dropout masks are not "
            "supported across ranks; use the local modules for dropout"
        )


class RingModule:
    """Mixin that runs a module's attention over a sharded sequence: put before the local
    module's class (or ``nn.Module``), it replaces the local forward by the operation's ring
    function, called with the module's options (:meth:`ring_options`).

    Attributes:
        ring_function: the ring function (``ring_attention``, ``ring_dilated_attention``, ...),
            taking ``(query, key, value, *, is_causal, key_padding_mask, **ring_options())``.
        group: the process group (None: the world).
        ring_calls: calls that reached the ring function, and so its agreement across ranks
            (read by :class:`~dilated_attention.distributed.comm.agreement.AgreedForward` to tell a
            layer's own errors from the ring call's).
    """

    ring_function: ClassVar[Any]
    group: dist.ProcessGroup | None
    ring_calls: int
    #: The forward takes ``cu_seqlens=``: packed documents over the whole sharded row (Note
    #: [Packed documents across ranks] in ``packed_ring.py``).
    takes_documents = True

    def _init_ring(self, group: dist.ProcessGroup | None) -> None:
        """Set the ring's attributes (after the local module's constructor)."""
        self.group, self.ring_calls = group, 0

    def ring_options(self) -> dict[str, object]:
        """The module's arguments to :attr:`ring_function` besides the call's own."""
        raise NotImplementedError

    def reject_call(self, error: Exception) -> NoReturn:
        """Take part in :attr:`ring_function`'s agreement across ranks with this rank's
        ``error``, then raise it (:func:`~.agreement.reject_ring_call`): a call rejected
        before the ring function was reached raises on every rank."""
        reject_ring_call(error, self.group)

    def score_options(self) -> dict[str, object]:
        """The module's local window, soft-cap and learnable sinks (its ``window_size``,
        ``softcap`` and ``sinks`` attributes, as the local modules keep them: a local module
        made a ring module by ``context_parallel`` passes its own on), those set."""
        names = ("window_size", "softcap", "sinks")
        given = {name: getattr(self, name, None) for name in names}
        return {name: value for name, value in given.items() if value is not None}

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        is_causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | list[int] | tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """query (B, n, H, D), key/value (B, n, Hkv, D), key_padding_mask (B, n) bool or None:
        local shards -> (B, n, H, D); cu_seqlens: packed documents over the whole row."""
        self.ring_calls += 1
        documents = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
        out = self.ring_function(
            query, key, value, is_causal=is_causal, key_padding_mask=key_padding_mask,
            **self.ring_options(), **self.score_options(), **documents,
        )  # fmt: skip
        assert isinstance(out, torch.Tensor)  # return_lse=False: for the type checker
        return out


class RingAttention(RingModule, nn.Module):
    """Exact dense attention over a sequence sharded across ``group``; see ``ring_attention``.

    Args:
        group: process group (default: the world).
        scale: softmax scale (``None``: head_dim ** -0.5).
        layout: ``"contiguous"`` or ``"zigzag"`` (causal only).
        backend: kernel name or ``None``.
        comm: ``"ring"`` or ``"allgather"``.
        window_size: a local window ``(left, right)`` (only its halo travels), or None.
        softcap: soft-capped scores, or None.
        sinks: learnable attention sinks for this many query heads (a parameter initialised to
            0, replicated: a rank's gradient is its rows' share), or None.
    """

    ring_function = staticmethod(ring_attention)

    def __init__(
        self,
        *,
        group: dist.ProcessGroup | None = None,
        scale: float | None = None,
        layout: str = "contiguous",
        backend: str | None = None,
        comm: str = "ring",
        window_size: tuple[int, int] | None = None,
        softcap: float | None = None,
        sinks: int | None = None,
    ) -> None:
        super().__init__()
        self.window_size = V.check_window_size(window_size)
        self.softcap = V.check_softcap(softcap)
        self.sinks = learnable_sinks(sinks)
        self.scale = V.check_scale(scale)
        self.layout = check_layout(layout)
        if comm not in COMMS:
            raise ValueError(f"comm must be one of {COMMS}, got {comm!r}")
        self.backend, self.comm = check_backend_name(backend), comm  # "auto" -> None
        self._init_ring(group)

    def ring_options(self) -> dict[str, object]:
        return {
            "group": self.group, "scale": self.scale, "layout": self.layout,
            "backend": self.backend, "comm": self.comm,
        }  # fmt: skip


class RingDilatedAttention(RingModule, DilatedAttention):
    """:class:`~dilated_attention.DilatedAttention` over a sharded sequence.

    Args:
        segment_lengths, dilation_rates, scale, backend: as in ``DilatedAttention``.
        group: process group (default: the world).
        dropout: must be 0 (no dropout across ranks).
        layout: ``"contiguous"`` or ``"zigzag"`` (causal only).
        window_size, softcap, sinks: as in ``DilatedAttention`` (a local window as one more
            branch, soft-capped scores, learnable sinks for this many query heads).
    """

    decodes_with_cache = False  # a sharded sequence has no single cache
    takes_documents = True
    ring_function = staticmethod(ring_dilated_attention)

    def __init__(
        self,
        segment_lengths: list[int] | tuple[int, ...],
        dilation_rates: list[int] | tuple[int, ...],
        *,
        group: dist.ProcessGroup | None = None,
        scale: float | None = None,
        dropout: float = 0.0,
        backend: str | None = None,
        layout: str = "contiguous",
        window_size: tuple[int, int] | None = None,
        softcap: float | None = None,
        sinks: int | None = None,
    ) -> None:
        super().__init__(
            segment_lengths, dilation_rates, scale=scale, dropout=dropout, backend=backend,
            window_size=window_size, softcap=softcap, sinks=sinks,
        )  # fmt: skip
        _no_dropout(dropout)
        self.layout = check_layout(layout)
        self._init_ring(group)

    def ring_options(self) -> dict[str, object]:
        return {
            "segment_lengths": self.segment_lengths, "dilation_rates": self.dilation_rates,
            "group": self.group, "scale": self.scale, "layout": self.layout,
            "backend": self.backend,
        }  # fmt: skip


class RingMultiheadDilatedAttention(AgreedForward, MultiheadDilatedAttention):
    """:class:`~dilated_attention.MultiheadDilatedAttention` over a sharded sequence: same
    constructor (plus ``group`` and ``layout``) and forward; each rank passes its (B, n, E) shard.
    Parameters are replicated: wrap the model in DDP/FSDP as usual for data parallelism.

    A call rejected on one rank, by the layer's own checks or by the ring call's agreement,
    raises on every rank (:class:`~dilated_attention.distributed.comm.agreement.AgreedForward`): the
    rank whose call was rejected its own error, the others ``ValueError`` naming that rank.
    ``window_size``, ``softcap`` and ``sinks`` as in the local layer (``attention.sinks``)."""

    attention: RingDilatedAttention

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        segment_lengths: list[int] | tuple[int, ...],
        dilation_rates: list[int] | tuple[int, ...],
        *,
        group: dist.ProcessGroup | None = None,
        layout: str = "contiguous",
        num_kv_heads: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        layer_norm: bool = True,
        layer_norm_eps: float = 1e-5,
        gamma_init: float = 1.0,
        backend: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        window_size: tuple[int, int] | None = None,
        softcap: float | None = None,
        sinks: bool = False,
    ) -> None:
        config = MultiheadDilatedConfig(
            embed_dim=embed_dim, num_heads=num_heads, segment_lengths=segment_lengths,
            dilation_rates=dilation_rates, num_kv_heads=num_kv_heads, dropout=dropout, bias=bias,
            layer_norm=layer_norm, layer_norm_eps=layer_norm_eps, gamma_init=gamma_init,
            backend=check_backend_name(backend),  # "auto" -> None
            window_size=window_size, softcap=softcap, sinks=sinks,
        )  # fmt: skip
        attention = RingDilatedAttention(
            config.segment_lengths, config.dilation_rates, group=group, dropout=config.dropout,
            backend=config.backend, layout=layout, window_size=config.window_size,
            softcap=config.softcap, sinks=num_heads if config.sinks else None,
        )  # fmt: skip
        self._init_layer(config, attention, batch_first=True, device=device, dtype=dtype)

    def _check_documents(self, cu_seqlens: object, query: torch.Tensor) -> tuple[int, ...]:
        """Offsets over the whole sharded row (one row: B = 1, ``W * n`` positions)."""
        return shard_offsets(cu_seqlens, query, self.attention.group)

    def _document_positions(
        self, documents: tuple[int, ...], query: torch.Tensor
    ) -> torch.Tensor:
        """This rank's shard of the row's positions within their documents."""
        return shard_positions(documents, query, self.attention.group)

    def _check_key_padding_mask(self, mask: object, query: torch.Tensor) -> None:
        """Left to the ring call, which checks the mask on every rank together: a mask rejected
        on one rank alone must raise on all of them, not leave the others waiting."""


class RingMultiheadAttention(AgreedForward, MultiheadAttention):
    """The library's :class:`~dilated_attention.modules.MultiheadAttention` around a ring
    module: what ``context_parallel`` makes of that layer when it turns its inner module into
    a ring module (the factory's MoBA- and NSA-style layers are this layer around their inner
    modules). The same constructor and forward; each rank passes its (B, n, E) shard.

    A call rejected on one rank, by the layer's own checks or by the ring call's agreement,
    raises on every rank (:class:`~dilated_attention.distributed.comm.agreement.AgreedForward`); the
    rotary positions default to the shard's global positions."""


#: Read by the factory when kind="ring" is first requested (``factory._PROVIDERS``).
FACTORY_KINDS = {"ring": (RingDilatedAttention, RingMultiheadDilatedAttention)}
