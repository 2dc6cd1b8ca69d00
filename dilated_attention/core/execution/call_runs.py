"""Calls run one after another, each result merged into float32 accumulators as it comes; their
backward replays them with the merged statistics (Note [One executor] in ``executor.py``).

The ring paths drive :func:`run_forward` and :func:`run_backward` block by block themselves;
:func:`merge_rows` merges with one kernel where a device registered one
(:func:`register_in_place_merge`).

Note [Exact gradients through the branch mix]
    The forward merges each group's ``(o_i, lse_i)`` into a running ``(out, lse)``
    (Note [Merging partial softmaxes]), which is LongNet Eq. 10: one softmax over the multiset union
    of the branches' keys. The mixing weights ``exp(lse_i - LSE)`` depend on q and k, so their
    gradient matters. Writing the merged result as that single softmax, its gradient with respect to
    the rows of branch ``i`` is exactly one attention backward over those rows with the *merged*
    ``out`` and ``LSE`` (Note [Backward with external statistics]). The backward therefore re-reads
    each group's rows, calls the kernel's backward with the merged statistics, and adds the row
    gradients into dq, dk, dv: no per-branch outputs are stored, and torchscale's no-grad weights
    are avoided.

Shape legend: B batch, N seq_len, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..contract import KernelBackend
from ..geometry.calls import Call, GradInputs, KernelArgs, call_backward, call_forward
from ..merge import merge_partial


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def new_accumulators(
    q: torch.Tensor, out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty merged results for queries like ``q`` (B, N, H, D): ``out`` (B, N, H, D) zeros and
    ``lse`` (B, N, H, 1) ``-inf``, both float32 (float64 for float64 inputs; ``out`` in
    ``out_dtype`` when given)."""
    batch, rows, heads, dim = q.shape
    acc = accumulator_dtype(q.dtype)
    out = torch.zeros(batch, rows, heads, dim, dtype=out_dtype or acc, device=q.device)
    lse = torch.full((batch, rows, heads, 1), float("-inf"), dtype=acc, device=q.device)
    return out, lse


def row_lse(lse: torch.Tensor) -> torch.Tensor:
    """(B, H, N) -> (B, N, H, 1), the layout a call reads its rows' statistics from."""
    return lse.transpose(1, 2).contiguous().unsqueeze(-1)


def row_lse_later(lse: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
    """:func:`row_lse` of ``lse`` (B, H, N) as an empty (B, N, H, 1) tensor and the copy that
    fills it, for a backward to run among its launches: a replayed graph then copies too, and
    the copy is not one more launch of its own (Note [A call's launches from a CUDA graph] in
    ``graphs.py``)."""
    batch, heads, rows = lse.shape
    lse_rows = torch.empty(batch, rows, heads, 1, dtype=lse.dtype, device=lse.device)
    return lse_rows, lambda: lse_rows.copy_(lse.transpose(1, 2).unsqueeze(-1))


#: How a call's result merges into the accumulators: ``(call, out, lse, part_out, part_lse)``
#: with ``out`` (B, Nq, H, D), ``lse`` (B, Nq, H, 1), ``part_out`` (B * G, Lq, Hc, D) and
#: ``part_lse`` (B * G, Hc, Lq) as the kernel returned them.
Merge = Callable[[Call, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


#: A fused in-place merge: ``(out, lse, part, part_lse)`` with ``out`` (B', L, Hc, D) and ``lse``
#: (B', L, Hc) float32 views of the accumulators, ``part`` (B', L, Hc, D) last dim contiguous and
#: ``part_lse`` (B', L, Hc), any strides.
InPlaceMerge = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
_IN_PLACE_MERGES: dict[str, Callable[[], InPlaceMerge | None]] = {}


def register_in_place_merge(device_type: str, load: Callable[[], InPlaceMerge | None]) -> None:
    """Give the executor a one-kernel merge for float32 accumulators on ``device_type``.

    ``load()`` returns the merge, or None where its kernel cannot be loaded (then the torch ops
    of :func:`~dilated_attention.core.merge.merge_partial` merge). The Triton backend registers
    CUDA's: it reads each output once and writes the merged row back, a quarter of the bytes of
    the torch ops (about ten passes over the call's rows).
    """
    _IN_PLACE_MERGES[device_type] = load


def _in_place_merge(out: torch.Tensor, lse: torch.Tensor) -> InPlaceMerge | None:
    if out.dtype != torch.float32 or lse.dtype != torch.float32:
        return None
    load = _IN_PLACE_MERGES.get(out.device.type)
    return None if load is None else load()


def _is_view_of(rows: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether ``rows`` (a call's rows of ``base``) is ``base`` or a view of it, so that writing
    into it writes ``base`` (a call's rows are a copy where they are gathered)."""
    return rows is base or rows._base is base


def merge_rows(
    call: Call, out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor
) -> None:
    """The executor's :data:`Merge`: merge the call's result into its rows of the accumulators
    (Note [Merging partial softmaxes]), in place with one kernel where one is registered
    (:func:`register_in_place_merge`): into the accumulators themselves where the call's rows
    are views, else into the gathered copy of its rows, which is then written back. Without a
    registered kernel: torch ops on the rows, written back."""
    rows, lse_rows = call.q_rows(out), call.q_rows(lse)
    fused = _in_place_merge(out, lse)
    if fused is not None:
        part = part_out if part_out.stride(-1) == 1 else part_out.contiguous()
        fused(rows, lse_rows.squeeze(-1), part, part_lse.transpose(1, 2))
        if _is_view_of(rows, out) and _is_view_of(lse_rows, lse):
            return
        new_out, new_lse = rows, lse_rows  # gathered copies, merged: write them back
    else:
        merged_out, merged_lse = merge_partial(
            rows, lse_rows.squeeze(-1), part_out, part_lse.transpose(1, 2)
        )
        new_out, new_lse = merged_out, merged_lse.unsqueeze(-1)
    call.put_q(out, new_out, accumulate=False)
    call.put_q(lse, new_lse, accumulate=False)


def run_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    calls: Sequence[Call],
    backend: KernelBackend,
    *,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    auxes: list[Any],
    dropout_p: float = 0.0,
    merge: Merge | None = merge_rows,
    softcap: float | None = None,
) -> None:
    """Run ``calls`` and merge each result into ``out`` / ``lse`` in place.

    Args:
        q: (B, Nq, H, D); k, v: (B, Nk, Hkv, D): the rows the calls read.
        key_padding_mask: (B, Nk) bool (``True`` = ignore), or None.
        out: (B, Nq, H, D), ``lse``: (B, Nq, H, 1): accumulators (:func:`new_accumulators`), or,
            with ``merge=None``, buffers each call writes its rows into directly (calls that
            cover disjoint rows).
        auxes: each call's kernel ``aux`` is appended, in call order.
        merge: how a result merges in (:func:`merge_rows`).
        softcap: every call's scores soft-capped (Note [Scores a kernel call transforms]).
    """
    kernel = KernelArgs(backend, scale, dropout_p, softcap)
    for call in calls:
        res = call_forward(call, q, k, v, key_padding_mask, kernel)
        auxes.append(res.aux)
        if merge is not None:
            merge(call, out, lse, res.out, res.lse)
        else:
            call.put_q(out, res.out, accumulate=False)
            call.put_q(lse, res.lse.transpose(1, 2).unsqueeze(-1), accumulate=False)


def run_backward(
    saved: GradInputs,
    calls: Sequence[Call],
    kernel: KernelArgs,
    auxes: Iterator[Any],
    *,
    dq: torch.Tensor,
    dk: torch.Tensor | None,
    dv: torch.Tensor | None,
    kv_grads: Callable[[Call, torch.Tensor, torch.Tensor], None] | None = None,
) -> None:
    """Replay ``calls`` with the merged statistics and add their gradients into dq, dk, dv
    (Note [Exact gradients through the branch mix]).

    Args:
        saved: the forward's inputs and merged results, and the output's gradient.
        auxes: the forward's ``aux`` values, consumed in call order.
        dq: (B, Nq, H, D); dk, dv: (B, Nk, Hkv, D): accumulators.
        kv_grads: where each call's key/value gradients (B * G, Lk, Hkc, D) go instead of
            ``dk`` / ``dv`` (ring attention sends them to the block's owner).
    """
    for call in calls:
        dq_rows, dk_rows, dv_rows = call_backward(call, saved, next(auxes), kernel)
        call.put_q(dq, dq_rows, accumulate=True)
        if kv_grads is not None:
            kv_grads(call, dk_rows, dv_rows)
        elif dk is None or dv is None:
            raise TypeError("run_backward needs dk and dv accumulators, or kv_grads")
        else:
            call.put_kv(dk, dk_rows, accumulate=True)
            call.put_kv(dv, dv_rows, accumulate=True)
