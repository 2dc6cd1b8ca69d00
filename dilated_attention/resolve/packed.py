"""Packed documents in the resolve step: a packed batch runs as one row of its documents.

Note [Packed documents as one row]
    A call on packed documents (``cu_seqlens``) is one request over the batch as the caller
    shaped it, (B, N), with the documents' offsets among its ``B * N`` positions (read on the
    host once, where they are checked: plain ints). Rows hold their documents independently
    (Note [Packed documents] in ``core/geometry/documents.py``), so the resolve step runs the batch
    as one
    row: the request of ``(1, B * N)`` positions is resolved as any packed call (every
    document's row groups where it starts, our fused kernels over a table of segments, each
    document's kept blocks), and the strategy around it flattens the tensors into that row,
    runs it and gives the results the batch's shape. A batch of 0 sequences has no document
    (Note [An empty packed batch]): it resolves as the same empty batch unpacked.

Shape legend: B batch, N positions per row, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from .. import _validation as V
from ..core.geometry.documents import flatten, unflatten
from .request import Request
from .strategy import Strategy, WrappedStrategy

__all__ = ["PackedStrategy", "packed_call"]


@dataclass(frozen=True)
class PackedStrategy(WrappedStrategy):
    """A packed batch run as one row of its documents (Note [Packed documents as one row])."""

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        sinks: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q (B, N, H, D), k and v (B, N, Hkv, D), key_padding_mask (B, N) or None, sinks (H,)
        or None -> out (B, N, H, D), lse (B, H, N), through the row of (1, B * N) positions."""
        assert self.inner is not None  # resolve gives it the row's strategy
        batch, seq_len = q.shape[:2]
        qf, kf, vf, mask = (flatten(x) for x in (q, k, v, key_padding_mask))
        out, lse = self.inner.run(qf, kf, vf, mask, sinks)  # type: ignore[arg-type]
        return unflatten(out, lse, batch, seq_len)


def packed_call(request: Request, resolve_row: Callable[[Request], Strategy]) -> Strategy:
    """The strategy of a packed ``request`` (Note [Packed documents as one row]): the row's,
    resolved by ``resolve_row``, around which the batch is flattened; for a batch of 0 the
    unpacked call's."""
    if request.batch == 0:  # no document (Note [An empty packed batch])
        return resolve_row(replace(request, documents=None))
    rows = request.batch
    row = replace(
        request, batch=1, query_len=rows * request.query_len, key_len=rows * request.key_len
    )
    how = f"the batch's {V.counted(rows, 'row')} as one row of their documents"
    return PackedStrategy.around(request, resolve_row(row), how)
