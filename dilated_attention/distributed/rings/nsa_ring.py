"""NSA-style attention over a sequence sharded across the ranks of a process group: each of
:func:`~dilated_attention.sparse.nsa_attention`'s branches with the exchange that suits it.

Note [NSA's branches over the ring]
    The gates come from a rank's own rows, so the branches combine on each rank as in one
    process (by gates, or through their log-sum-exp: Note [NSA's three branches] in
    ``sparse/nsa.py``); what needs the other ranks is each branch's keys:

    - *window*: :func:`ring_attention` with the window: only the ``w - 1`` key rows before a
      shard (and after it, not causal) travel, and their gradients back (Note [Halo
      exchange] in ``halo.py``).
    - *selected*: every key block's mean gathered and the blocks chosen per key/value head
      with the one-process rule (Note [MoBA's selection over the ring] in
      ``moba_ring.py``), then :func:`block_sparse_ring_attention` on this rank's rows of that
      run-time mask (Note [Run-time masks over the ring] in ``masked_ring.py``).
    - *compressed*: a compressed key is the mean of a window of ``l`` positions every ``d``
      (Note [Compressed keys] in ``sparse/compression.py``), and a window may straddle shards.
      Every window is a whole number of chunks of ``g = gcd(l, d, n)`` positions, and the
      mean of equal chunks' means is the window's mean; so each rank pools its shard into
      ``n / g`` chunk means of its keys and values (in float32, float64 for float64 input, as
      one process averages) and rank ``a`` gathers those of the ranks before the end of the
      last window its queries see (causal: the windows ending by its last position; else
      every window), differentiably (Note [A differentiable gather of a prefix of the ranks]
      in ``gather.py``: the backward sums the chunks' gradients home). It pools them into the
      compressed keys and runs the one-process calls, one per residue class of ``d``, on its
      own queries end-aligned at its shard's end (Note [The compressed branch exactly, per
      residue class]). With NSA's sizes (``l`` a multiple of ``d``, shards of whole strides)
      ``g = d``: ``1 / d`` of a shard's keys and values.

    With ``combine="lse"`` each branch's differentiable log-sum-exp makes one more call of
    that branch (Note [A differentiable log-sum-exp] in ``sparse/branches.py``), over the
    ring as well. Before any exchange the ranks agree on the call's shapes, options and grad
    mode, so a bad call raises on every rank. :func:`nsa_ring_volume` counts the bytes.

Shape legend: B batch, n local tokens, N = W n positions, H query heads, Hkv key/value heads,
D head dim, W ranks, l compress_block, d compress_stride, g the chunk of the compressed keys'
exchange.
"""

from __future__ import annotations

import math
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ... import _validation as V
from ...core.execution.call_runs import accumulator_dtype
from ...modules import CompressedSelectedWindowAttention
from ...sparse.compression import num_windows, window_means
from ...sparse.nsa import (
    Checked,
    check_call,
    combine_branches,
    compressed_branch,
    selected_branch,
    window_branch,
)
from ..comm import collectives as _comm
from ..comm.gather import gather_prefix, joined
from ..layout.cost import Shape, Volume, halo_volumes
from ..modules import RingModule
from .block_sparse_ring import block_sparse_ring_attention
from .masked_ring import masked_ring_volume
from .moba_ring import refuse_context_parallel, selected_rows
from .ring import ring_attention
from .template import RingSetup

__all__ = ["CompressedSelectedWindowRingAttention", "check_not_recomputed", "compressed_needs",
           "nsa_ring_attention",
           "nsa_ring_volume"]  # fmt: skip

_FIELDS = ("local seq_len", "batch", "heads", "key/value heads", "head_dim",
           "bytes per element", "compress_block", "compress_stride", "select_block", "topk",
           "window", "is_causal", "combine (0: gates, 1: lse)", _comm.GRAD_MODE,
           "grad mode of query and key")  # fmt: skip


def nsa_ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    gates: torch.Tensor | None,
    *,
    compress_block: int,
    compress_stride: int,
    select_block: int,
    topk: int,
    window: int,
    is_causal: bool = True,
    combine: str = "gates",
    group: dist.ProcessGroup | None = None,
    scale: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """:func:`~dilated_attention.sparse.nsa_attention` over a sequence sharded across
    ``group``: this rank's shard of the one-process result, with exact gradients for the local
    query, key, value and gates (Note [NSA's branches over the ring]).

    Args:
        query: (B, n, H, D) this rank's contiguous shard (``shard_sequence(x)``, N = W * n).
        key: (B, n, Hkv, D), H % Hkv == 0 (GQA).
        value: (B, n, Hkv, D).
        gates: (B, n, H, 3) this rank's rows of the gates (compressed, selected, window), as
            in ``nsa_attention``; None with ``combine="lse"``.
        compress_block, compress_stride, select_block, topk, window, is_causal, combine,
            scale: as in ``nsa_attention``, over the whole sequence; ``n`` must be a multiple
            of ``select_block``.
        group: the process group (default: the world); not a ``ContextParallel``.
        backend: every branch's kernel, as in :func:`ring_attention` and
            :func:`block_sparse_ring_attention`.

    Returns:
        (B, n, H, D) in the input dtype.

    Raises:
        TypeError / ValueError: on every rank, before any other communication: malformed
            tensors or options (as ``nsa_attention``), query and key shards of different
            lengths, shards that are not whole selected blocks, or shapes, options and grad
            modes that differ between ranks. A ``ContextParallel`` group raises at once.
    """
    c = _agreed(query, key, value, gates,
                (compress_block, compress_stride, select_block, topk, window), is_causal,
                combine, scale, backend, group)  # fmt: skip
    block, stride, select, count, size = c.sizes
    causal, n = c.run.is_causal, c.q.shape[1]
    rank, world = _comm.group_rank_and_size(group)
    k_cmp, v_cmp, chunks = _compressed_keys(c.k, c.v, block, stride, causal, group)
    key_len = (rank + 1) * n if causal else world * n  # the queries end-aligned at their end
    mask = selected_rows(c.q, c.k, select, count, causal, "kv_head", group)
    branches = (
        lambda gate=None, total=None: compressed_branch(c.q, k_cmp, v_cmp, key_len, block,
                                                        stride, c.run, gate, total),
        lambda: selected_branch(c.q, c.k, c.v, mask, select, c.run, block_sparse_ring_attention,
                                group=group),
        lambda: window_branch(c.q, c.k, c.v, size, c.run, ring_attention, group=group),
    )  # fmt: skip
    return joined(combine_branches(branches, c.gates), chunks)


def _agreed(
    query: object, key: object, value: object, gates: object, sizes: tuple[object, ...],
    is_causal: object, combine: object, scale: object, backend: object,
    group: dist.ProcessGroup | None,
) -> Checked:  # fmt: skip
    """This rank's checks, then the agreement of every rank (before any exchange).

    Raises:
        TypeError / ValueError: this rank's own error; ``ValueError`` naming the rank on the
            others, or on every rank where the fields differ.
    """
    refuse_context_parallel(group, "nsa_ring_attention")
    error: Exception | None = None
    fields = [0] * len(_FIELDS)
    checked = None
    try:
        checked = check_call(query, key, value, gates, sizes, is_causal, combine, scale,
                             backend)  # fmt: skip
        fields = _fields(checked)
    except Exception as exc:  # any rejection on one rank must reach the others: no hang
        error = exc
    fixes = {_comm.GRAD_MODE: _comm.GRAD_MODE_FIX}
    _comm.check_same_on_all_ranks(fields, _FIELDS, group, error,
                                  what="nsa_ring_attention inputs", fixes=fixes)  # fmt: skip
    assert checked is not None  # else check_same_on_all_ranks raised
    return checked


def _fields(c: Checked) -> list[int]:
    """The values every rank must share, of a checked call.

    Raises:
        ValueError: query and key shards of different lengths; shards that are not whole
            selected blocks.
    """
    q, k = c.q, c.k
    select = c.sizes[2]
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"nsa_ring_attention takes shards of one sequence: query and key must have the "
            f"same local seq_len, got query.shape={tuple(q.shape)}, key.shape={tuple(k.shape)}"
        )
    if q.shape[1] % select:
        raise ValueError(
            f"nsa_ring_attention needs every shard to be whole selected blocks: the local "
            f"seq_len ({q.shape[1]}) must be a multiple of select_block={select}; pad the "
            f"sequence or use a select_block that divides {q.shape[1]}"
        )
    tensors = (q, k, c.v) if c.gates is None else (q, k, c.v, c.gates)
    return [q.shape[1], q.shape[0], q.shape[2], k.shape[2], q.shape[3], q.element_size(),
            *c.sizes, int(c.run.is_causal), int(c.run.need_lse),
            int(_comm.backward_follows(*tensors)), int(_comm.backward_follows(q, k))]  # fmt: skip


def compressed_needs(
    n: int, world_size: int, block: int, stride: int, is_causal: bool
) -> tuple[int, ...]:
    """Per rank, how many leading ranks' chunks its compressed keys read: those before the
    end of the last window its queries see (Note [NSA's branches over the ring])."""
    needs = []
    for rank in range(world_size):
        seen = num_windows((rank + 1) * n if is_causal else world_size * n, block, stride)
        end = 0 if seen == 0 else (seen - 1) * stride + block  # one past the last window
        needs.append(-(-end // n))
    return tuple(needs)


def _compressed_keys(
    k: torch.Tensor, v: torch.Tensor, block: int, stride: int, is_causal: bool,
    group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The compressed keys and values of the windows this rank's queries may see, (B, Nc',
    Hkv, D) each in the keys' dtype, from the chunk means gathered (Note [NSA's branches over
    the ring]), and the gathered chunks (for :func:`~.gather.joined`)."""
    rank, world = _comm.group_rank_and_size(group)
    ranks = tuple(_comm.global_rank(group, r) for r in range(world))
    batch, n = k.shape[:2]
    g = math.gcd(block, stride, n)
    piece = torch.stack([window_means(k, g, g), window_means(v, g, g)])  # (2, B, n / g, Hkv, D)
    needs = compressed_needs(n, world, block, stride, is_causal)
    chunks = gather_prefix(piece, ranks, rank, needs)  # (needs, 2, B, n / g, Hkv, D)
    rows = chunks.permute(1, 2, 0, 3, 4, 5).flatten(2, 3).flatten(0, 1)  # (2 B, needs n / g, ..)
    pooled = window_means(rows, block // g, stride // g).to(k.dtype)
    return pooled[:batch], pooled[batch:], chunks


def nsa_ring_volume(
    key: torch.Tensor,
    setup: RingSetup,
    *,
    compress_block: int,
    compress_stride: int,
    select_block: int,
    window: int,
    combine: str,
) -> Volume:
    """Bytes this rank sends in one :func:`nsa_ring_attention` call that records gradients for
    its query or key (Note [NSA's branches over the ring]): forward, the compressed keys'
    chunks to the ranks that read them, the key blocks' means (selection), the masked ring's
    shards and the window's halo; backward, the chunks' gradients home and the two rings'
    (:func:`masked_ring_volume`, the halo's). ``combine="lse"`` repeats each ring call.

    Args:
        key: (B, n, Hkv, D) this rank's keys (the shards' size and dtype).
        setup: this rank's place (``rank``, ``world_size``, ``is_causal``).
        compress_block, compress_stride, select_block, window, combine: the call's.
    """
    batch, n, kv_heads, dim = key.shape
    rank, world, causal = setup.rank, setup.world_size, setup.is_causal
    acc = accumulator_dtype(key.dtype)
    acc_bytes = torch.empty(0, dtype=acc).element_size()
    g = math.gcd(compress_block, compress_stride, n)
    needs = compressed_needs(n, world, compress_block, compress_stride, causal)
    chunks = 2 * batch * (n // g) * kv_heads * dim * acc_bytes
    readers = sum(1 for a in range(world) if a != rank and needs[a] > rank)
    sources = sum(1 for b in range(needs[rank]) if b != rank)
    means = (world - 1) * batch * (n // select_block) * kv_heads * dim * acc_bytes
    side = window - 1
    shape = Shape(batch, world * n, kv_heads, kv_heads, dim, key.dtype, causal,
                  window=(side, 0 if causal else side))  # fmt: skip
    rings = masked_ring_volume(key, setup, acc) + halo_volumes(shape, world)[rank]
    calls = 2 if combine == "lse" else 1
    return Volume(readers * chunks + means + calls * rings.forward,
                  sources * chunks + calls * rings.backward)  # fmt: skip


def reject_call(error: Exception, group: dist.ProcessGroup | None) -> NoReturn:
    """Take part in :func:`nsa_ring_attention`'s agreement with this rank's ``error``, then
    raise it: the peers already waiting there raise too."""
    _comm.raise_on_all_ranks(error, _FIELDS, group, what="nsa_ring_attention inputs")


def _layer_call(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    gates: torch.Tensor | None,
    *,
    key_padding_mask: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    **options: Any,
) -> torch.Tensor:
    """:func:`nsa_ring_attention` as :class:`CompressedSelectedWindowRingAttention` calls it:
    a key padding mask on any rank raises on every rank."""
    try:
        V.check_no_key_padding_mask(key_padding_mask)
    except ValueError as exc:
        reject_call(exc, group)
    return nsa_ring_attention(query, key, value, gates, group=group, **options)


def check_not_recomputed(recompute: object, name: str) -> None:
    """The ring's branches keep their outputs for the backward: ``recompute`` must be False.

    Raises:
        TypeError: ``recompute`` not a bool. ValueError: True.
    """
    if V.check_bool("recompute", recompute):
        raise ValueError(
            f"{name}: the ring's NSA branches keep their outputs for the backward, got "
            f"recompute={recompute!r}; build the layer with recompute=False (each rank's "
            f"shard already holds 1 / world of the sequence's activations)"
        )


class CompressedSelectedWindowRingAttention(RingModule, CompressedSelectedWindowAttention):
    """:class:`~dilated_attention.modules.CompressedSelectedWindowAttention` (NSA-style) over
    a sequence sharded across ``group`` in contiguous shards of whole selected blocks
    (:func:`nsa_ring_attention`); what ``context_parallel`` makes of that layer.

    Args:
        compress_block, compress_stride, select_block, topk, window, combine, scale, backend,
            dropout: as in ``CompressedSelectedWindowAttention``; ``recompute`` must be False.
        group: the process group (default: the world).

    Its forward takes (B, n, ...) local shards and this rank's rows of the gates;
    ``key_padding_mask`` must be None (on any rank: every rank raises).
    """

    ring_function = staticmethod(_layer_call)
    takes_documents = False
    layout = "contiguous"

    def __init__(
        self,
        *,
        compress_block: int,
        compress_stride: int,
        select_block: int,
        topk: int,
        window: int,
        combine: str = "gates",
        group: dist.ProcessGroup | None = None,
        scale: float | None = None,
        backend: str | None = None,
        recompute: bool = False,
        dropout: float = 0.0,
    ) -> None:
        check_not_recomputed(recompute, type(self).__name__)
        super().__init__(
            compress_block=compress_block, compress_stride=compress_stride,
            select_block=select_block, topk=topk, window=window, combine=combine, scale=scale,
            backend=backend, dropout=dropout,
        )  # fmt: skip
        self._init_ring(group)

    def ring_options(self) -> dict[str, object]:
        c = self.config
        return {"compress_block": c.compress_block, "compress_stride": c.compress_stride,
                "select_block": c.select_block, "topk": c.topk, "window": c.window,
                "combine": c.combine, "group": self.group, "scale": c.scale,
                "backend": c.backend}  # fmt: skip

    def forward(  # type: ignore[override]
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        is_causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
        gates: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Args: query (B, n, H, D), key and value (B, n, Hkv, D) this rank's shards; gates
        (B, n, H, 3) its rows of the gates with ``combine="gates"``, else None.

        Returns:
            (B, n, H, D).
        """
        self.ring_calls += 1
        return self.ring_function(query, key, value, gates, is_causal=is_causal,
                                  key_padding_mask=key_padding_mask,
                                  **self.ring_options())  # fmt: skip

    def reject_call(self, error: Exception) -> NoReturn:
        reject_call(error, self.group)
