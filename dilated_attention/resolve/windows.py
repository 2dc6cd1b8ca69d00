"""Local windows in the resolve step: the calls of a window over a request's positions, alone
(dense attention on packed documents) or as one more branch of dilated attention.

Note [A local window as a branch]
    ``dilated_attention(..., window_size=(left, right))`` adds one branch to the schedule: every
    position sees the keys of its window, ``p - left <= t <= p + right`` (with causality, the
    key mask, and its own document when documents are packed), across segment boundaries. It
    joins the dilated branches like any branch, through the exact merge (LongNet Eq. 10): one
    softmax over the multiset union of the branches' keys, so a key that a dilated branch and
    the window both reach counts twice, as a key in two dilated branches does. This is how
    NSA-style models mix a sliding window with other branches. The window branch is one call
    per row (per document when packed) on the kernel of the executor's plan, merged as it
    comes; the dilated branches run as the plan's views or gathers (not slots, whose merge
    knows dilated branches only, and not our fused kernels, which take no window yet).

Shape legend: N positions of a row (of the flattened batch with packed documents).
"""

from __future__ import annotations

import itertools

from ..backends.registry import DENSE as DENSE_REGISTRY
from ..backends.registry import DILATED as DILATED_REGISTRY
from ..backends.registry import registry_for
from ..core.contract import Window
from ..core.geometry.calls import Call, SliceCall, WholeCall
from ..core.geometry.documents import document_groups
from ..core.geometry.plan import Plan
from ..core.geometry.segment import describe_plan, dilated_plan
from .request import Request, kernel_inputs
from .strategy import PlanStrategy, Strategy


def window_calls(request: Request) -> tuple[Call, ...]:
    """The calls of ``request``'s local window over its positions (Note [A local window as a
    branch]): the whole rows, or each packed document against its own keys."""
    assert request.window is not None
    window, causal = Window(*request.window), request.is_causal
    if request.documents is None:
        return (WholeCall(causal, window),)
    return tuple(
        SliceCall(slice(a, b), slice(a, b), causal, window)
        for a, b in itertools.pairwise(request.documents)
    )


def describe_window(request: Request) -> str:
    """One line for ``explain()`` on the window's calls."""
    left, right = request.window or (-1, -1)
    reach = f"{'any' if left < 0 else left} before to {'any' if right < 0 else right} after"
    where = "each row" if request.documents is None else "each packed document"
    return f"local window ({reach} each position): one call over {where}, merged as it comes"


def packed_windows(request: Request) -> Strategy:
    """Packed documents under a local window: each document's positions against its own keys,
    one call each (Note [Packed documents] in ``core/geometry/documents.py``)."""
    inputs = kernel_inputs(request)
    kernel = registry_for(DENSE_REGISTRY).select(inputs, request.backend)
    plan = Plan(window_calls(request))
    how = f"{len(plan.calls)} packed documents, each against its own keys in a local window"
    return PlanStrategy(request, kernel, DENSE_REGISTRY, inputs, how, plan=plan, what="attention")


def windowed_dilated(request: Request) -> Strategy:
    """The dilated branches and a local window as one more branch, the executor's plan merging
    them as they come (Note [A local window as a branch])."""
    schedule, n, hkv = request.schedule, request.query_len, request.num_kv_heads
    assert schedule is not None
    inputs = kernel_inputs(request)
    kernel = registry_for(DILATED_REGISTRY).select(inputs, request.backend)
    strided = kernel.backend.reads_strided_rows
    if request.documents is not None:
        segs, rates = schedule.segment_lengths, schedule.dilation_rates
        groups = document_groups(request.documents, request.num_heads, segs, rates)
    else:
        groups = schedule.at(n, request.num_heads, hkv, request.first_head).groups
    branches = dilated_plan(groups, n, hkv, request.device, request.is_causal, strided)
    plan = Plan(branches.calls + window_calls(request))
    notes = (*describe_plan(groups, n, hkv, strided), describe_window(request))
    how = "the executor's plan of branch calls and the window's, merged by log-sum-exp"
    return PlanStrategy(
        request, kernel, DILATED_REGISTRY, inputs, how, notes, plan=plan, what="dilated_attention"
    )
