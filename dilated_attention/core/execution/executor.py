"""The one executor: run a plan of kernel calls, merge their results, and differentiate exactly.

Note [One executor]
    Dense attention, dilated attention through gathers, block-sparse attention on any dense
    kernel, and the local pieces of the ring paths are all *plans* (``Plan`` in ``plan.py``):
    lists of kernel calls, each reading some query rows against some key/value rows (``Call``
    in ``calls.py``). A call says how its rows are read and written back; the executor does the
    rest, the same way for every plan: each call's ``(out, lse)`` merged into float32
    accumulators (Note [Merging partial softmaxes]), then the backward replaying every call with
    the merged statistics (``call_runs.py``, Note [Exact gradients through the branch mix]). Row
    addressing comes in four kinds: the whole tensors (``WholeCall``, dense attention), slices
    of positions (``SliceCall``, ring attention's calls against a key/value block), dilated row
    groups (``GroupCall`` in ``segment.py``) and stacked index lists (``SparseCall`` in
    ``block_sparse/plan.py``). A dilated plan on a kernel that writes into given buffers runs
    its calls into branch slots merged once instead (Note [Branch slots merged once] in
    ``slots.py``; ``slot_runs.py``), and a long plan runs in position groups
    (``grouped_runs.py``). :class:`PlanRunner` runs a plan under the one autograd Function
    (Note [One autograd Function] in ``autograd.py``); the ring paths drive the runners
    (``run_forward``, ``run_backward`` in ``call_runs.py``) block by block in runners of their
    own, which own the communication; kernels that run a whole plan themselves (the fused
    dilated Triton kernels, ``fused.py``; our block-sparse Triton kernels) are runners too.

Note [A slotted call's launches from a CUDA graph]
    A slotted plan on FlashAttention-4 makes one kernel call per branch and offset class
    (dozens at 64K tokens for LongNet's schedule), and FA4's Python interface spends ~0.1-0.4
    ms of host time on each: measured on an H100 at 64K (H = 16, D = 128, causal), a forward
    took 5.6 ms and a forward+backward 53 ms, nearly all of it host time, where the same calls
    replayed from one CUDA graph took 2.5 and 12.2 ms (the fused Triton kernels: 4.0 and
    19.3). So a slotted plan, whole or in position groups, allocates its outputs (and slot
    buffers) first and then runs its calls and the merge (backward: the calls and the sums)
    as one closure through the kernel backend's ``run_launches``, which replays them from a
    CUDA graph once the same call has run at the same addresses (Note [A call's launches from
    a CUDA graph] in ``graphs.py``; the groups' slots and FA4's workspace, allocated and freed
    inside, live in the stream's shared pool: Note [Graphs share one memory pool per
    stream]). The key is the plan (which the graph keeps alive, so its identity names it; a
    request makes its plan once per query size) and the kernel's arguments. Only calls whose
    kernels keep no ``aux`` take this route (without dropout, on a backend whose aux is only
    for dropout: a replay makes none), and only without a ring's spanning results, which the
    closure would read without naming them.

Shape legend: B batch, N seq_len, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..autograd import Backward, Forward, Grads, Inputs, Saved
from ..contract import KernelBackend
from ..geometry.calls import GradInputs, KernelArgs, window_of
from ..geometry.plan import Plan
from ..geometry.slots import ExtraSlotGradients, SlotView
from ..higher_order import differentiable_grads, no_higher_order_message
from .call_runs import (
    accumulator_dtype,
    merge_rows,
    new_accumulators,
    row_lse,
    row_lse_later,
    run_backward,
    run_forward,
)
from .grouped_runs import ExtraGradients, grouped_backward, grouped_forward
from .slot_runs import LaunchRunner, first_then, slot_backward, slot_forward


def _replayed(plan: Plan, kernel: KernelArgs, step: str) -> LaunchRunner | None:
    """How a slotted ``plan``'s launches of ``step`` run: through the backend's
    ``run_launches`` (Note [A slotted call's launches from a CUDA graph]), or None where its
    kernel calls keep an ``aux`` (dropout)."""
    if kernel.dropout_p or not kernel.backend.aux_only_for_dropout:
        return None
    key = (step, id(plan), kernel)
    run = kernel.backend.run_launches
    return lambda tensors, launches: run(key, tensors, launches, keep=plan)


def plan_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    plan: Plan,
    kernel: KernelArgs,
    *,
    out_dtype: torch.dtype | None = None,
    extra: Callable[[], Sequence[SlotView]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
    """Forward of a whole plan (Note [One executor]).

    Args:
        q: (B, Nq, H, D); k, v: (B, Nk, Hkv, D), contiguous.
        key_padding_mask: (B, Nk) bool (``True`` = ignore) or None.
        kernel: the kernel and what every call passes it: the scale, dropout, the soft-cap of
            every call's scores (Note [Scores a kernel call transforms]); a
            :class:`PlanRunner` makes it once.
        out_dtype: dtype of ``out`` (default ``q.dtype``; float32 keeps the merge unrounded for a
            caller that merges further, e.g. ring dilated attention).
        extra: more results the slots' merge reads (a plan in slots, forward not grouped):
            returns their slot views, called once after the plan's calls are queued.

    Returns:
        ``out`` (B, Nq, H, D), ``lse`` (B, H, Nq) float32 (float64 for float64 inputs; ``-inf``
        where no key is seen), and each call's backend ``aux`` for the backward.
    """
    if plan.one_call and not plan.slots and not (plan.groups and plan.grouped_forward):
        return _one_call_forward(q, k, v, key_padding_mask, plan, kernel, out_dtype)
    acc = accumulator_dtype(q.dtype)
    grouped = bool(plan.groups and plan.grouped_forward)
    assert extra is None or (plan.slots and not grouped)  # the ring's rule (spanning_results)
    if grouped:
        return grouped_forward(q, k, v, key_padding_mask, plan, kernel, out_dtype=out_dtype,
                               runner=_replayed(plan, kernel, "grouped_forward"))  # fmt: skip
    if plan.slots:
        batch, seq_len, heads, _ = q.shape
        out = torch.empty(q.shape, dtype=out_dtype or q.dtype, device=q.device)
        lse = torch.empty(batch, heads, seq_len, dtype=acc, device=q.device)
        auxes: list[Any] = []
        runner = None if extra is not None else _replayed(plan, kernel, "slot_forward")
        slot_forward(
            q, k, v, key_padding_mask, plan.calls, plan.slots, kernel, out=out, lse=lse,
            auxes=auxes, extra=extra, runner=runner,
        )  # fmt: skip
        # Through a runner every aux is None, and a replay makes none: the backward's repeat.
        return out, lse, (auxes if runner is None else None)
    merging = len(plan.calls) > 1
    # One call: its rows are written as they come, so out needs no float32 copy.
    out, lse = new_accumulators(q, None if merging else q.dtype)
    auxes = []
    run_forward(
        q, k, v, key_padding_mask, plan.calls, kernel.backend, scale=kernel.scale, out=out,
        lse=lse, auxes=auxes, dropout_p=kernel.dropout_p, merge=merge_rows if merging else None,
        softcap=kernel.softcap,
    )  # fmt: skip
    return out.to(out_dtype or q.dtype), lse.squeeze(-1).transpose(1, 2).contiguous(), auxes


def _one_call_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    plan: Plan,
    kernel: KernelArgs,
    out_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
    """:func:`plan_forward` of a plan of one call that reads every query row as it is (dense
    attention, a decoded token): the kernel's results are the plan's, with no accumulators. The
    dense path runs this on every call, so it only converts what needs converting."""
    (call,) = plan.calls
    res = kernel.backend.forward(
        q, call.kv_rows(k), call.kv_rows(v), scale=kernel.scale, is_causal=call.causal,
        key_mask=call.key_mask(key_padding_mask), dropout_p=kernel.dropout_p,
        softcap=kernel.softcap, window=window_of(call),
    )  # fmt: skip
    out, lse, dtype = res.out, res.lse, out_dtype or q.dtype
    out = out if out.dtype == dtype else out.to(dtype)
    acc = accumulator_dtype(q.dtype)
    lse = lse if lse.dtype == acc else lse.to(acc)
    return out.contiguous(), lse.contiguous(), [res.aux]


def plan_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    plan: Plan,
    kernel: KernelArgs,
    auxes: list[Any] | None,
    *,
    extra: ExtraGradients | ExtraSlotGradients | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact gradients of :func:`plan_forward`.

    Args:
        dout: (B, Nq, H, D) upstream gradient of ``out``.
        out: (B, Nq, H, D) merged output; ``lse``: (B, H, Nq) merged log-sum-exp.
        kernel: as in :func:`plan_forward`.
        auxes: the forward's kernel ``aux`` values, or None where each of them is None (a kernel
            that keeps none: Note [Backward without the forward] in ``autograd.py``).
        extra: more gradients joined before the rounding: slots the sums read beside the
            plan's own (``slots.ExtraSlotGradients``, slotted plans only), or a callback adding
            them (``grouped_runs.ExtraGradients``), which a grouped plan calls per batch element
            and group on float32 scratch of the group's size, any other on float32 gradients
            of the whole.

    Returns:
        ``(dq, dk, dv)`` shaped and typed like ``(q, k, v)``.
    """
    dout = dout.contiguous()
    whole = (dout, q, k, v, out, lse, key_padding_mask, plan, kernel)
    if plan.whole and extra is None and not (plan.groups or plan.slots):  # dense attention
        return _typed_like(_whole_backward(*whole, None if auxes is None else auxes[0]), (q, k, v))
    aux: Iterable[Any] = itertools.repeat(None) if auxes is None else auxes
    # Groups replay the forward's calls cut, so the kernels' aux values (dropout states) must
    # come from the same cut calls; a whole forward's calls with no aux cut freely.
    if plan.groups and (plan.grouped_forward or all(a is None for a in auxes or ())):
        if not plan.grouped_forward:
            aux = itertools.repeat(None)
        runner = None if extra is not None else _replayed(plan, kernel, "grouped_backward")
        return grouped_backward(
            dout, q, k, v, out, lse, key_padding_mask, plan, kernel, aux, extra=extra,
            runner=runner,
        )  # fmt: skip
    acc = accumulator_dtype(q.dtype)
    in_slots = extra if isinstance(extra, ExtraSlotGradients) else None
    if in_slots is not None:  # read beside the plan's own slots: no float32 gradients
        assert plan.slots  # the ring gives extra slots to slotted plans only
        extra = None
    if plan.slots:  # float32 where extra gradients join, else the inputs' dtypes
        grads = [
            torch.empty(x.shape, dtype=acc if extra else x.dtype, device=x.device)
            for x in (q, k, v)
        ]
        lse_rows, fill_rows = row_lse_later(lse)
        saved = GradInputs(dout, q, k, v, out, lse_rows, key_padding_mask)
        views = None
        if in_slots is not None:
            views = functools.partial(in_slots.views, slice(None), 0, q.shape[1])
        runner = None if views is not None else _replayed(plan, kernel, "slot_backward")
        if runner is None:
            fill_rows()
        else:  # the copy among the replayed launches
            runner = first_then(fill_rows, (lse,), runner)
        slot_backward(saved, plan.calls, plan.slots, kernel, iter(aux), grads=grads, extra=views,
                      runner=runner)  # fmt: skip
    elif plan.whole:  # with extra gradients joined
        grads = _whole_backward(*whole, next(iter(aux)))
    else:
        grads = tuple(torch.zeros(x.shape, dtype=acc, device=q.device) for x in (q, k, v))
        saved = GradInputs(dout, q, k, v, out, row_lse(lse), key_padding_mask)
        run_backward(saved, plan.calls, kernel, iter(aux), dq=grads[0], dk=grads[1], dv=grads[2])
    if extra is not None:
        grads = [g.to(acc) for g in grads]
        extra(*grads, 0, q.shape[1], slice(None))
    return _typed_like(grads, (q, k, v))


def _whole_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    plan: Plan,
    kernel: KernelArgs,
    aux: Any,
) -> Grads:
    """The gradients of a plan of one call over every row (``plan.whole``), from the kernel's
    backward with the forward's ``aux``, in the kernel's dtypes."""
    (call,) = plan.calls
    return kernel.backend.backward(
        dout, q, k, v, out, lse, aux, scale=kernel.scale, is_causal=call.causal,
        key_mask=call.key_mask(key_padding_mask), dropout_p=kernel.dropout_p,
        softcap=kernel.softcap, window=window_of(call),
    )  # fmt: skip


def _typed_like(grads: Sequence[torch.Tensor], inputs: Grads) -> Grads:
    """``grads`` (dq, dk, dv) in the dtypes of ``inputs`` (q, k, v), converting only those
    that differ (a no-op ``.to`` still costs host time on every call)."""
    dq, dk, dv = grads
    q, k, v = inputs
    if dq.dtype == q.dtype and dk.dtype == k.dtype and dv.dtype == v.dtype:
        return dq, dk, dv  # the dense path's case: nothing to convert
    return _typed(dq, q.dtype), _typed(dk, k.dtype), _typed(dv, v.dtype)


def _typed(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``, converted only where it differs."""
    return x if x.dtype == dtype else x.to(dtype)


_DROPOUT_MESSAGE = no_higher_order_message(
    "{what} with dropout_p > 0",
    "the dropout mask is not replayed differentiably",
    "Pass dropout_p=0 (call module.eval()) for a gradient penalty or other double backward.",
)


_SCORES_MESSAGE = no_higher_order_message(
    "{what} with softcap or window_size",
    "the differentiable recompute of the gradients applies causality and key masks only",
    "Call it without softcap and window_size for a gradient penalty or other double backward.",
)


@dataclass(frozen=True)
class PlanRunner:
    """The executor as a :class:`~dilated_attention.core.autograd.Runner`: ``plan`` on
    ``backend`` (:func:`plan_forward` / :func:`plan_backward`). ``what``: the public function's
    name, for the double-backward error under dropout."""

    plan: Plan
    backend: KernelBackend
    scale: float
    dropout_p: float = 0.0
    what: str = "attention"
    softcap: float | None = None

    @property
    def first_order_message(self) -> str:
        if self.dropout_p:
            return _DROPOUT_MESSAGE.format(what=self.what)
        return _SCORES_MESSAGE.format(what=self.what)

    @functools.cached_property
    def kernel(self) -> KernelArgs:
        """The kernel and the arguments every call passes it: made once per runner (a dense
        request's runner is made once: Note [Resolved once per request] in ``resolver.py``)."""
        return KernelArgs(self.backend, self.scale, self.dropout_p, self.softcap)

    def forward(self, x: Inputs) -> Forward:
        q, k, v, key_padding_mask = x
        out, lse, auxes = plan_forward(q, k, v, key_padding_mask, self.plan, self.kernel)
        return Forward(out, lse, saved=(k, v, key_padding_mask), state=auxes)

    def backward(self, b: Backward) -> Grads:
        dout, q, out, lse, (k, v, key_padding_mask), state = b
        return plan_backward(
            dout, q, k, v, out, lse, key_padding_mask, self.plan, self.kernel, state
        )

    def differentiable_backward(self, b: Backward) -> Grads | None:
        dout, q, _, lse, saved, _ = b
        if self.dropout_p:
            return None  # the dropout mask is not replayed differentiably
        if self.softcap is not None or any(window_of(c) for c in self.plan.calls):
            return None  # the recompute knows causality and key masks only
        k, v, key_padding_mask = saved
        calls = [call.row_call(q, k) for call in self.plan.calls]
        return differentiable_grads(
            dout, q, k, v, lse, calls, scale=self.scale, key_padding_mask=key_padding_mask
        )

    def saved_without_forward(self, x: Inputs) -> Saved | None:
        if self.dropout_p or not self.backend.aux_only_for_dropout:
            return None  # the kernel's aux (its dropout state, its metadata) comes from forward
        return x.k, x.v, x.key_padding_mask


def empty_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` for a checked call with no query rows (batch 0 or 0 heads).

    SDPA returns empty tensors there; so do we, without launching a kernel (some reject empty
    launches). ``out`` is tied to q, k and v through their sums (of zero elements: free), so
    backward gives all three their empty gradients.

    Args:
        q: (B, Nq, H, D) with B * H == 0.
        k: (B, Nk, Hkv, D).
        v: (B, Nk, Hkv, D).

    Returns:
        out (B, Nq, H, D) in q's dtype; lse (B, H, Nq) float32 (float64 for float64 inputs).
    """
    batch, query_len, heads, _ = q.shape
    link = (q.sum() + k.sum() + v.sum()) * 0
    out = torch.zeros_like(q) + link
    lse = q.new_full((batch, heads, query_len), float("-inf"), dtype=accumulator_dtype(q.dtype))
    return out, lse
