"""A plan's kernel calls: how a call reads its rows and writes them back, and the kernel on them.

A call reads some query rows against some key/value rows (:class:`Call`; Note [One executor] in
``executor.py``). Row addressing comes in four kinds: the whole tensors (:class:`WholeCall`,
dense attention), slices of positions (:class:`SliceCall`, ring attention's calls against a
key/value block), dilated row groups (``GroupCall`` in ``segment.py``; strided views,
``StridedCall`` in ``strided.py``) and stacked index lists (``SparseCall`` in
``block_sparse/plan.py``). :func:`call_forward` and :func:`call_backward` run a kernel on a
call's rows, with the fixed arguments of :class:`KernelArgs`.

Shape legend: B batch, N seq_len, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from ..contract import KernelBackend, KernelOutput, Window
from ..higher_order import RowCall


class Call(Protocol):
    """One kernel call of a plan: how it reads its rows and writes them back.

    A call reads ``G`` pieces of ``Lq`` query rows with ``Hc`` heads against ``Lk`` key/value
    rows with ``Hkc`` heads each; the pieces are stacked along the batch dimension. A call that
    sees a local window of its rows says so in a ``window`` attribute (:func:`window_of`).
    """

    causal: bool  # top-left causal within each piece

    def q_rows(self, x: torch.Tensor) -> torch.Tensor:
        """(B, Nq, H, E) -> (B * G, Lq, Hc, E): the call's rows of a query-side tensor."""
        ...

    def kv_rows(self, x: torch.Tensor) -> torch.Tensor:
        """(B, Nk, Hkv, E) -> (B * G, Lk, Hkc, E): the call's rows of a key-side tensor."""
        ...

    def key_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """(B, Nk) bool (``True`` = ignore) -> the kernels' (B * G, 1 or Hc, Lk), or None."""
        ...

    def put_q(self, dest: torch.Tensor, rows: torch.Tensor, *, accumulate: bool) -> None:
        """Write (or add) ``rows`` (B * G, Lq, Hc, E) into ``dest`` (B, Nq, H, E) in place."""
        ...

    def put_kv(self, dest: torch.Tensor, rows: torch.Tensor, *, accumulate: bool) -> None:
        """Write (or add) ``rows`` (B * G, Lk, Hkc, E) into ``dest`` (B, Nk, Hkv, E)."""
        ...

    def row_call(self, q: torch.Tensor, k: torch.Tensor) -> RowCall:
        """The call's rows as flat (position, head) indices, for the double backward."""
        ...


def window_of(call: Call) -> Window | None:
    """The local window over ``call``'s rows (Note [Scores a kernel call transforms] in
    ``contract.py``): :class:`WholeCall` and :class:`SliceCall` may carry one; no other kind
    of call does."""
    return getattr(call, "window", None)


@dataclass(frozen=True)
class WholeCall:
    """Every row of q against every row of k and v, as they are (dense attention), within
    ``window`` when one is given."""

    causal: bool
    window: Window | None = None
    reads_all_queries: ClassVar[bool] = True  # Plan.one_call

    def q_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def kv_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def key_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        return None if mask is None else mask.unsqueeze(1)

    def put_q(self, dest: torch.Tensor, rows: torch.Tensor, *, accumulate: bool) -> None:
        _put_slice(dest, slice(None), rows, accumulate)

    put_kv = put_q

    def row_call(self, q: torch.Tensor, k: torch.Tensor) -> RowCall:
        positions = [torch.arange(x.shape[1], device=q.device).view(1, -1) for x in (q, k)]
        return RowCall.from_positions(*positions, q.shape[2], k.shape[2], self.causal)


@dataclass(frozen=True)
class SliceCall:
    """Query rows ``q`` against key/value rows ``kv``, both slices of positions (views, no
    copies; ring attention's calls against one key/value block), within ``window`` (in the
    slices' own rows) when one is given."""

    q: slice
    kv: slice
    causal: bool
    window: Window | None = None

    def q_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, self.q]

    def kv_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, self.kv]

    def key_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        return None if mask is None else mask[:, None, self.kv]

    def put_q(self, dest: torch.Tensor, rows: torch.Tensor, *, accumulate: bool) -> None:
        _put_slice(dest, self.q, rows, accumulate)

    def put_kv(self, dest: torch.Tensor, rows: torch.Tensor, *, accumulate: bool) -> None:
        _put_slice(dest, self.kv, rows, accumulate)

    def row_call(self, q: torch.Tensor, k: torch.Tensor) -> RowCall:
        positions = [
            torch.arange(rows.start, rows.stop, device=q.device).view(1, -1)
            for rows in (self.q, self.kv)
        ]
        return RowCall.from_positions(*positions, q.shape[2], k.shape[2], self.causal)


def put_view(view: torch.Tensor, values: torch.Tensor, accumulate: bool) -> None:
    """Write (or add) ``values`` into ``view``, a view of a call's destination, in place (a
    16-bit ``values`` adds into a float32 ``view`` in one pass, without a float32 copy)."""
    if not accumulate:
        view.copy_(values)
    elif torch.promote_types(view.dtype, values.dtype) == view.dtype:
        view.add_(values)
    else:
        view.add_(values.to(view.dtype))


def _put_slice(dest: torch.Tensor, rows: slice, values: torch.Tensor, accumulate: bool) -> None:
    put_view(dest[:, rows], values, accumulate)


@dataclass(frozen=True)
class KernelArgs:
    """The kernel every call of a plan runs, and the arguments every call passes it."""

    backend: KernelBackend
    scale: float
    dropout_p: float = 0.0
    softcap: float | None = None


@dataclass(frozen=True)
class GradInputs:
    """What a backward replays its calls with: the forward's inputs and merged results, and the
    gradient of the output.

    Attributes:
        dout, q, out: (B, Nq, H, D).
        k, v: (B, Nk, Hkv, D).
        lse_rows: (B, Nq, H, 1) merged log-sum-exp (``row_lse`` of the (B, H, Nq) one).
        key_padding_mask: (B, Nk) bool, or None.
    """

    dout: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse_rows: torch.Tensor
    key_padding_mask: torch.Tensor | None

    def part(self, index: slice | tuple[slice, slice]) -> GradInputs:
        """Every tensor's ``[index]``: batch rows, or (batch rows, positions)."""
        mask = self.key_padding_mask
        return GradInputs(
            self.dout[index], self.q[index], self.k[index], self.v[index], self.out[index],
            self.lse_rows[index], None if mask is None else mask[index],
        )  # fmt: skip


def _call_lse(call: Call, lse_rows: torch.Tensor) -> torch.Tensor:
    """The call's (B * G, Hc, Lq) statistics from (B, N, H, 1)."""
    return call.q_rows(lse_rows).squeeze(-1).transpose(1, 2)


def call_forward(
    call: Call,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    kernel: KernelArgs,
    *,
    into: KernelOutput | None = None,
) -> KernelOutput:
    """The kernel's forward on ``call``'s rows (into ``into`` where the backend writes there)."""
    return kernel.backend.forward(
        call.q_rows(q), call.kv_rows(k), call.kv_rows(v), scale=kernel.scale,
        is_causal=call.causal, key_mask=call.key_mask(key_padding_mask),
        dropout_p=kernel.dropout_p, into=into, softcap=kernel.softcap, window=window_of(call),
    )  # fmt: skip


def call_backward(
    call: Call,
    saved: GradInputs,
    aux: Any,
    kernel: KernelArgs,
    *,
    into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's backward on ``call``'s rows with the merged statistics ``saved.out`` and
    ``saved.lse_rows``; into ``into`` where the backend writes there."""
    s = saved
    return kernel.backend.backward(
        call.q_rows(s.dout), call.q_rows(s.q), call.kv_rows(s.k), call.kv_rows(s.v),
        call.q_rows(s.out), _call_lse(call, s.lse_rows), aux, scale=kernel.scale,
        is_causal=call.causal, key_mask=call.key_mask(s.key_padding_mask),
        dropout_p=kernel.dropout_p, into=into, softcap=kernel.softcap, window=window_of(call),
    )  # fmt: skip
