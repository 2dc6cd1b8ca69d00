"""The spanning branches' compact results and gradients as one more slot of the local plan
(Note [Spanning results stay compact] in ``ring_dilated.py``): where their cells are exactly
the rows of one slot, the local plan's merge and sums read them beside its own slots, so no
float32 output or gradients of the shard exist.

Shape legend: B batch, n local tokens, H query heads, D head dim, M / K the query / key cells
a rank holds of the spanning branches.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from ...core.geometry.slots import ExtraSlotGradients, SlotView
from ..layout.dilated_plan import DilatedRingPlan


def span_slot_rate(plan: DilatedRingPlan, local: Any, n: int, heads: int) -> int | None:
    """The rate of the one slot that holds the spanning branches' cells (Note [Spanning results
    stay compact]): their smallest, where the local plan runs in slots, it divides every other
    rate, every position group of the local plan starts at a multiple of it, and the cells
    of the ``n`` positions and ``heads`` query heads are exactly that slot's (the shard starts
    at a multiple of it in the branches' segments, heads from the first); else None."""
    if not local.slots or not plan.span_rates or plan.q_cells is None:
        return None
    rate = min(plan.span_rates)
    if any(r % rate for r in plan.span_rates) or any(g.start % rate for g in local.groups):
        return None
    return rate if plan.q_cells.slot_rows(rate, heads, n) is not None else None


def spanning_results(
    plan: DilatedRingPlan,
    local: Any,
    q: torch.Tensor,
    spans: Callable[[], tuple[torch.Tensor, ...]],
) -> Callable[[], list[SlotView]] | None:
    """The spanning branches' compact results (``spans()``: out (B, M, D) and lse (B, M)
    float32 over ``plan.q_cells``) as one slot the local plan's merge reads beside its own
    (:func:`span_slot_rate`), made when the merge asks; else None (they are merged into a
    float32 output)."""
    batch, n, heads, dim = q.shape
    rate = span_slot_rate(plan, local, n, heads)
    if rate is None or (local.groups and local.grouped_forward):
        return None
    assert plan.q_cells is not None  # span_slot_rate checked it
    cells = plan.q_cells.slot_rows(rate, heads, n)
    rows = -(-n // rate)

    def views() -> list[SlotView]:
        cell_out, cell_lse = spans()[:2]
        out = _in_slot(cell_out, cells, rows * heads, 0.0)
        lse = _in_slot(cell_lse, cells % heads * rows + cells // heads, heads * rows, -math.inf)
        return [SlotView(out.view(batch, rows, heads, dim), lse.view(batch, 1, heads, rows), n,
                         rate)]  # fmt: skip

    return views


def spanning_slots(
    plan: DilatedRingPlan,
    local: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    spans: Callable[[], tuple[torch.Tensor, torch.Tensor]],
) -> ExtraSlotGradients | None:
    """The spanning branches' compact gradients (``spans()``: dq (B, M, D) over
    ``plan.q_cells``, dk and dv (2, B, K, D) over ``plan.kv_cells``, float32) as one slot the
    local plan's sums read beside its own (:func:`span_slot_rate`; without GQA, where key
    gradients share the query slots' layout); else None (they are added into float32
    scratch)."""
    batch, n, heads, dim = q.shape
    rate = span_slot_rate(plan, local, n, heads)
    if rate is None or k.shape[2] != heads:
        return None
    assert plan.q_cells is not None and plan.kv_cells is not None  # a plan with spans has them
    q_rows = plan.q_cells.slot_rows(rate, heads, n)
    kv_rows = plan.kv_cells.slot_rows(rate, heads, n)
    if q_rows is None or kv_rows is None:
        return None

    size = -(-n // rate) * heads

    @functools.cache
    def make() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cell_dq, cell_dkv = spans()
        dq, dk, dv = (
            _in_slot(grad, rows, size, 0.0).view(batch, -1, heads, dim)
            for grad, rows in ((cell_dq, q_rows), (cell_dkv[0], kv_rows), (cell_dkv[1], kv_rows))
        )
        return dq, dk, dv

    return ExtraSlotGradients(make, rate)


def _in_slot(values: torch.Tensor, rows: torch.Tensor, size: int, fill: float) -> torch.Tensor:
    """Compact cell ``values`` (B, M, ...) at ``rows`` (M,) of a slot of ``size`` rows (the
    cells' ``Cells.slot_rows``), as (B, size, ...) with ``fill`` in the other rows."""
    slot = values.new_full((values.shape[0], size, *values.shape[2:]), fill)
    return slot.index_copy_(1, rows, values)
