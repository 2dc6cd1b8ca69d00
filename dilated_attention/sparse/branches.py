"""Branches together: attention results over different key sets combined by per-branch gates
or merged exactly through their log-sum-exp, with exact gradients either way.

A branch is which keys a query sees, from which key/value source (a sliding window, selected
blocks, compressed keys). Each runs through the library's public calls (``attention``,
``block_sparse_attention``) and gives ``(out, lse)``; this module combines them.

Note [Gated branches]
    NSA combines its branches by gates computed from the input: ``o = sum_c g_c * o_c``, each
    ``g_c`` (B, N, H) already activated (a sigmoid: the gates do not sum to 1). Every term is a
    product of differentiable tensors, so autograd gives the exact gradients of the branches'
    outputs (``g_c * dout``, through each call's own backward) and of the gates
    (``dout . o_c``). No log-sum-exp is needed: the calls run without ``return_lse``. Where
    no gradient is recorded (inference), each branch's output is added as soon as it is made
    (:func:`gated_sum_of`): one branch output besides the sum in memory instead of three.

Note [Branches joined as they come]
    With gradients, each branch's output is kept for its own backward and the gates' gradient,
    but the upstream gradients of the branches need not all live at once. Autograd runs the
    ready nodes made last first. Where every branch ran before the sum, its terms' nodes are the
    newest, so the backward made all three branch gradients (``g_c * dout``, each the size of
    the output) before any branch's backward ran. :func:`gated_sum` and
    :func:`merge_branches` therefore take the branches as calls and run each just before it
    joins: a branch's attention node is then newer than the earlier terms' nodes, and its
    backward runs as soon as its term's has, while one branch gradient is alive, not three
    (two in the merge, whose first step joins the first two branches).
    The branch that joins last has its backward run first, and what its call saved is freed
    before the other branches' backwards run: NSA's compressed branch, which saves the most
    (its classes' queries as heads and their output), joins last (``order``).
    A term joins as ``total + gate * out`` through the same op in :func:`gated_sum` and
    :func:`gated_sum_of` (one pass each way on the GPU, rounded once: Note [Gated rows in one
    pass] in ``backends/triton_kernels/gates.py``), so that both give the same bits; its
    backward makes the branch's gradient and the gate's in one pass, without a product the
    size of the output beside them.

Note [A branch that gates its own rows]
    The product ``g_c * o_c`` keeps ``o_c`` for the gate's gradient. Where a branch makes its
    output from parts put back in rows (NSA's compressed branch: its residue classes' outputs,
    which its kernel call keeps anyway), that output is one more tensor the size of the output
    kept until the backward. Such a branch takes its gate and the sum so far and returns the
    sum with its term joined (``self_gated`` of :func:`gated_sum`): each part times its rows'
    gates, added to the sum's rows and written into the result's (``ResidueRows.scatter`` with
    ``scale`` and ``total``), the bits of the other terms' joins, keeping only the parts and
    the gates for the gradients and making no product the size of the output on the way.

Note [A differentiable log-sum-exp]
    Merging branches through their log-sum-exp (Note [Merging partial softmaxes] in
    ``core/merge.py``) gives one softmax over the union of their keys (the multiset union, as
    in LongNet's Eq. 10: a key two branches see counts twice). Its gradient needs each branch's
    ``lse`` as a function of q and k: ``d out / d lse_c = w_c (o_c - out)`` (Note [Merged
    gradients through a kernel's own autograd] in ``backends/flex.py``). The library's calls
    return ``lse`` detached (their backward takes the merged statistics inside the engine,
    not a gradient of ``lse``), so :func:`lse_with_gradient` adds it from the public calls
    alone. With ``P`` the call's attention probabilities and ``s_ij = scale * q_i . k_j``::

        d lse_i / d q_i = scale * sum_j P_ij k_j        (the call with values = keys)
        d lse_i / d k_j = scale * P_ij q_i              (that call's value gradient, fed
                                                         scale * g_i q_i)

    so one more call of the branch, on the detached query and key with the key as its value,
    gives both: ``lse + scale * ((q - sg(q)) . sg(a) + sg(q) . (a - sg(a)))`` with ``a`` that
    call's output and ``sg`` the detached value. The added term is exactly zero in value; its
    gradient is the two lines above (to the key through the value slot, so through whatever
    made the key: compressed keys back through their pooling). The price is that call, forward
    and backward, per branch: where only the gates are asked for (NSA's combination) nothing
    of it runs, and without gradients (inference) neither. The engine's own merge does without
    it (its backward reads the merged statistics, Note [Backward with external statistics]);
    branches from different key sources would need that inside the engine. The two lines hold
    for plain scaled dot-product scores (no soft-cap, no sinks), which the branches here are.

Shape legend: B batch, N query rows, Nk key rows, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..core.merge import merge_partial
from .gate_rows import gated_add, gated_rows

__all__ = ["BranchCall", "gated_sum", "gated_sum_of", "lse_with_gradient", "merge_branches"]

#: A branch's attention call on (query, key, value) -> out (B, N, H, D): the same keys seen
#: by the same queries whatever tensors are passed (:func:`lse_with_gradient` passes the key
#: as the value).
BranchCall = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def lse_with_gradient(
    call: BranchCall, query: torch.Tensor, key: torch.Tensor, lse: torch.Tensor, scale: float
) -> torch.Tensor:
    """``lse`` of ``call(query, key, value)`` as a differentiable function of ``query`` and
    ``key`` (Note [A differentiable log-sum-exp]); ``lse`` itself where no gradient is recorded.

    Args:
        call: the branch's attention call (without ``return_lse``).
        query: (B, N, H, D), as the branch's call took it.
        key: (B, Nk, Hkv, D), likewise.
        lse: (B, H, N) that call's detached log-sum-exp.
        scale: its softmax scale.

    Returns:
        (B, H, N) equal to ``lse`` in value, in its dtype.
    """
    if not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad)):
        return lse
    q0 = query.detach()
    keys_out = call(q0, key.detach(), key)  # sum_j P_ij k_j, differentiable in the value slot
    a0 = keys_out.detach()
    dtype = lse.dtype
    term = (query.to(dtype) - q0.to(dtype)) * a0.to(dtype)
    term = term + q0.to(dtype) * (keys_out.to(dtype) - a0.to(dtype))
    return lse + (term.sum(-1) * scale).transpose(1, 2)


def _join_order(order: Sequence[int] | None, count: int) -> list[int]:
    """``order`` (every index below ``count`` once), or ``0 .. count - 1`` where None."""
    if order is None:
        return list(range(count))
    if sorted(order) != list(range(count)):
        raise ValueError(
            f"order: expected each of the {count} branch indices 0..{count - 1} once, got "
            f"{tuple(order)}; pass a permutation such as {tuple(range(count))}"
        )
    return list(order)


def gated_sum(
    calls: Sequence[Callable[..., torch.Tensor]],
    gates: torch.Tensor,
    order: Sequence[int] | None = None,
    *,
    self_gated: Sequence[int] = (),
) -> torch.Tensor:
    """``sum_c gates[..., c] * calls[c]()``, each call run just before its term joins the sum
    (Note [Branches joined as they come]); differentiable (Note [Gated branches]).

    Args:
        calls: C functions, each returning a (B, N, H, D) branch output.
        gates: (B, N, H, C), already activated.
        order: the branches' indices in the order they run and join (default: as given);
            autograd runs their backwards in the reverse order.
        self_gated: the indices of calls that take their gate, (B, N, H, 1), and the sum so
            far (None for the first term), and return the sum with their term joined, ``total
            + gate * out``, themselves, with the bits of the join (Note [A branch that gates
            its own rows]).

    Returns:
        (B, N, H, D) in the outputs' dtype.
    """

    def joined(c: int, total: torch.Tensor | None) -> torch.Tensor:
        gate = gates[..., c, None]
        if c not in self_gated:
            return gated_add(total, calls[c](), gate)
        return calls[c](gate, total)

    first, *rest = _join_order(order, len(calls))
    total = joined(first, None)
    for c in rest:
        total = joined(c, total)
    return total


def gated_sum_of(
    calls: Sequence[Callable[[], torch.Tensor]],
    gates: torch.Tensor,
    order: Sequence[int] | None = None,
) -> torch.Tensor:
    """:func:`gated_sum` of the outputs of ``calls``, each made and added before the next call
    runs: one branch's output besides the sum is held at a time, not all of them. The same
    bits as :func:`gated_sum` in the same ``order`` (the first term a product, each later one
    joined by the same op, Note [Branches joined as they come]); in place, so for calls that
    record no gradient (the caller's to know).

    Args:
        calls: C functions, each returning a new (B, N, H, D) tensor that nothing else holds.
        gates: (B, N, H, C), already activated.
        order: as in :func:`gated_sum`.

    Returns:
        (B, N, H, D) in the outputs' dtype.
    """
    first, *rest = _join_order(order, len(calls))
    total = calls[first]()
    gated_rows(total, gates[..., first, None], into=total)
    for c in rest:
        gated_rows(calls[c](), gates[..., c, None], total, into=total)
    return total


def merge_branches(
    calls: Sequence[Callable[[], tuple[torch.Tensor, torch.Tensor]]],
) -> torch.Tensor:
    """The branches' results merged into one softmax over the (multiset) union of their keys,
    through the library's merge (Note [Merging partial softmaxes] in ``core/merge.py``),
    differentiable in every ``out`` and ``lse``; each call run just before it joins (Note
    [Branches joined as they come]).

    Args:
        calls: per branch a function returning ``(out, lse)``, out (B, N, H, D), lse (B, H,
            N) (differentiable where :func:`lse_with_gradient` made it so). The first branch
            must see a key in every row (a row no branch sees has no gradient to give: NaN).

    Returns:
        (B, N, H, D) in the first ``out``'s dtype.
    """
    out, lse = calls[0]()
    dtype = out.dtype
    acc_dtype = torch.promote_types(dtype, torch.float32)
    acc, acc_lse = out.to(acc_dtype), lse.transpose(1, 2).to(acc_dtype)
    for call in calls[1:]:
        out_c, lse_c = call()
        acc, acc_lse = merge_partial(acc, acc_lse, out_c, lse_c.transpose(1, 2))
    return acc.to(dtype)
