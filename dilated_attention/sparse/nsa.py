"""NSA-style attention: three branches over one query (compressed keys, selected blocks, a
sliding window), each on the library's kernels, combined by gates or merged exactly.

Note [NSA's three branches]
    Native Sparse Attention (DeepSeek, arXiv 2502.11089) gives every query three views of the
    keys, each an attention of its own:

    - *compressed*: the keys and values pooled over windows of ``l`` positions every ``d``
      (:func:`~dilated_attention.sparse.compress_kv`), a compressed key visible to the query
      at ``p`` once its whole window lies at or before ``p`` (Note [Compressed keys]);
    - *selected*: the ``topk`` key blocks of ``l'`` positions that matter most to the query,
      attended at full resolution, and the query's own block (causal);
    - *window*: the last ``w`` keys (a sliding window).

    The outputs are combined by gates from the input, ``o = g_cmp o_cmp + g_slc o_slc + g_win
    o_win`` (Note [Gated branches] in ``branches.py``), or, with ``combine="lse"``, merged
    into one softmax over the three key sets (Note [A differentiable log-sum-exp]).

    The selection: NSA ranks key blocks by the compressed branch's attention probabilities,
    summed over the compressed keys that overlap each block and over a group's query heads.
    Those probabilities are an (N x Nc) tensor per head, which the library's kernels never
    form (they return ``out`` and ``lse`` only; N = 64K with d = 16 would be 256M entries per
    head). Here the blocks are chosen by MoBA's gate
    (:func:`~dilated_attention.sparse.select_blocks`: each query block's mean query against
    each key block's mean key), one choice per key/value head shared by its group of query
    heads (``per="kv_head"``, NSA's sharing, so a kernel loads each key block once per
    group), made from ``(Mq + Mk)`` pooled vectors. Both are a query's affinity with a block
    through its mean key (NSA's compressed keys are pooled keys too); NSA's is per token and
    softmax-weighted, this one per query block (block-sparse kernels take one set of key
    blocks per query block). Gradients do not flow through the choice (in NSA neither).

Note [The compressed branch exactly, per residue class]
    Compressed key ``c`` (window ``[c d, c d + l)``) is visible to position ``p`` when
    ``c d + l - 1 <= p``, i.e. ``c <= floor((p - l + 1) / d)``: not a block-aligned rule, so
    not a block mask. For the positions ``p = r + m d`` of one residue class ``r`` (mod
    ``d``) it is ``c <= m + t_r`` with ``t_r = floor((r - l + 1) / d)``: query ``m`` of the
    class sees a causal prefix of the compressed keys, shifted by the constant ``t_r``. So
    each class is one end-aligned causal :func:`~dilated_attention.attention` call: its
    queries a strided view of the query rows (every ``d``-th, from the first that sees a
    compressed key), its keys the first ``m_end + t_r`` compressed keys. ``d`` calls of
    ``~N / d`` rows and at most ``Nc`` keys each: exact per token, on the library's kernels,
    no (N x Nc) score tensor. Rows that see no compressed key (before the end of the first
    window) give 0 (and ``lse = -inf``). Without ``is_causal`` every query sees every
    compressed key: one call.

Note [Residue classes as heads]
    Classes with as many rows and compressed keys see the keys alike (query ``m`` of each sees
    ``c <= m + (keys - rows)``), so those whose first rows are consecutive (a run, one strided
    view of the query: Note [Runs of classes as one view] in ``residue_rows.py``) run as one
    call: their queries side by side as more heads, head ``h`` of class ``c`` as head ``h * G
    + c`` of G classes, so that key/value head ``j`` serves its group's heads of every class
    (GQA) and the compressed keys and values are read once; the run's output and lse are views
    of the call's. With ``l = 2 d`` (NSA's 32 and 16) and a length divisible by ``d`` that is
    two calls instead of ``d``: a call of one class at 64K tokens is ~4K rows over at most ~4K
    keys, too short to hide its host time.

Shape legend: B batch, Nq query rows, Nk key rows, H query heads, Hkv key/value heads, D head
dim, Nc compressed keys, l compress_block, d compress_stride.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .. import _validation as V
from ..backends.registry import check_backend_name
from ..block_sparse.runtime import CHOSEN_BLOCKS_FIX
from ..config import COMBINE
from ..core.higher_order import no_higher_order_message, raising_as
from ..functional import attention, block_sparse_attention
from .branches import gated_sum, gated_sum_of, lse_with_gradient, merge_branches
from .compression import compress_kv
from .gate_rows import copy_rows, gated_add
from .recompute import recomputed_by_heads
from .residue_rows import ResidueRows
from .selection import _check_topk, select_blocks

__all__ = ["BRANCHES", "COMBINE", "nsa_attention"]

#: The branches of :func:`nsa_attention`, in the order of the gates' last dimension.
BRANCHES = ("compressed", "selected", "window")

Result = tuple[torch.Tensor, torch.Tensor | None]
#: Its double-backward error (Note [Double backward] in ``core/higher_order.py``).
FIRST_ORDER_MESSAGE = no_higher_order_message(
    "nsa_attention",
    "its selected branch (a run-time block mask) and its sliding window compute their gradients "
    "without a graph",
    CHOSEN_BLOCKS_FIX,
)


@raising_as(FIRST_ORDER_MESSAGE)
def nsa_attention(
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
    scale: float | None = None,
    backend: str | None = None,
    recompute: bool = False,
) -> torch.Tensor:
    """NSA (Native Sparse Attention): compressed keys, selected blocks and a sliding window,
    each an exact attention on the library's kernels, combined by ``gates`` (Note [NSA's three
    branches]). Example of what query position 9 sees, ``compress_block=4,
    compress_stride=2``, ``select_block=4``, ``topk=1``, ``window=3`` (``x`` seen)::

        position     0 1 2 3 4 5 6 7 8 9
        compressed   [0..3] [2..5] [4..7] [6..9]     four windows, each ending by 9
        selected     x x x x . . . . x x       block 0 chosen, block 2 its own (causal)
        window       . . . . . . . x x x

    Gradients are exact for ``query``, ``key``, ``value`` (the compressed keys' back through
    their pooling) and ``gates``; none flows through the selection (Note [NSA's three
    branches]). Runs on the inputs' device without host synchronisation.

    Args:
        query: (B, Nq, H, D).
        key: (B, Nk, Hkv, D), H % Hkv == 0 (GQA).
        value: (B, Nk, Hkv, D).
        gates: (B, Nq, H, 3), the branches' gates in the order of :data:`BRANCHES`
            (compressed, selected, window), already activated (NSA: a sigmoid of a linear map
            of the input), in the query's dtype and on its device; None with
            ``combine="lse"``.
        compress_block: positions per compressed window (NSA's ``l``, 32 in the paper).
        compress_stride: positions between the windows' starts (NSA's ``d``, 16), at most
            ``compress_block``.
        select_block: positions per selected block (NSA's ``l'``, 64).
        topk: selected blocks per query block besides its own (NSA's ``n`` = 16 counts the
            initial and local blocks; here only the own block is forced); fewer where fewer
            are visible. 0 keeps the own block alone (causal only).
        window: the sliding window's length ``w`` (512 in the paper): the query and the
            ``w - 1`` keys before it (causal), or the keys within ``w - 1`` positions on either
            side (not causal).
        is_causal: position ``p`` sees keys ``t <= p``; a query shorter than the key holds its
            last ``Nq`` positions (end-aligned). Not causal: ``Nq == Nk``, and every query sees
            every compressed key.
        combine: ``"gates"`` (NSA: ``o = sum_c g_c o_c``) or ``"lse"`` (one softmax over the
            multiset union of the three key sets, through their log-sum-exp: Note [A
            differentiable log-sum-exp] in ``branches.py``, which says what its gradient costs).
        scale: softmax scale of every branch; ``None`` means ``D ** -0.5``.
        backend: the kernel of every branch, as ``backend`` of
            :func:`~dilated_attention.attention` and
            :func:`~dilated_attention.block_sparse_attention`; ``None``: each call's automatic
            choice.
        recompute: keep only the inputs, the output and the chosen blocks for the backward,
            which runs the branches again a group of heads at a time (Note [Branches
            recomputed by heads] in ``recompute.py``): from 64K tokens (16 heads) a
            forward+backward's peak memory near that of q, k, v, out and their gradients, for
            one more forward of the branches (bound by the host at shorter lengths). False:
            the branches keep their outputs (the faster backward).

    Returns:
        (B, Nq, H, D) in the input dtype.

    Raises:
        TypeError: tensors of the wrong type or dtype; an argument of the wrong type.
        ValueError: malformed shapes or devices, a size not a positive int, ``compress_stride >
            compress_block``, ``topk < 0`` (or 0 without ``is_causal``), an unknown
            ``combine``, ``gates`` missing or given where not used, a causal query longer than
            the key or a non-causal one of another length; all before any work.
    """
    c = check_call(query, key, value, gates, (compress_block, compress_stride, select_block,
                   topk, window), is_causal, combine, scale, backend)  # fmt: skip
    V.check_bool("recompute", recompute)
    _, _, select, topk, _ = c.sizes
    mask = select_blocks(c.q, c.k, block_size=select, topk=topk, is_causal=c.run.is_causal,
                         per="kv_head", return_indices=True)  # fmt: skip
    layer = functools.partial(_layer, sizes=c.sizes, run=c.run)
    if recompute and _records_gradient(c.q, c.k, c.v, c.gates):
        return recomputed_by_heads(layer, c.q, c.k, c.v, c.gates, mask, FIRST_ORDER_MESSAGE)
    return layer(c.q, c.k, c.v, c.gates, mask)


def _layer(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: torch.Tensor | None,
    mask: torch.Tensor, *, sizes: tuple[int, int, int, int, int], run: Run,
) -> torch.Tensor:  # fmt: skip
    """The three branches on the chosen blocks ``mask`` (B, Hkv, Mq, K), combined: the body
    of :func:`nsa_attention` after its checks and choice, for any heads of the query and the
    key/value heads they see (Note [Branches recomputed by heads])."""
    block, stride, select, _, window = sizes
    k_cmp, v_cmp = compress_kv(k, v, block=block, stride=stride)
    branches = (
        lambda gate=None, total=None: compressed_branch(q, k_cmp, v_cmp, k.shape[1], block,
                                                        stride, run, gate, total),
        lambda: selected_branch(q, k, v, mask, select, run),
        lambda: window_branch(q, k, v, window, run),
    )
    if gates is not None and not _records_gradient(q, k, v, gates):
        # Inference: one branch output at a time besides the sum (Note [Gated branches]), the
        # compressed branch first (INFERENCE_ORDER).
        calls = [lambda b=b: b()[0] for b in branches]
        return gated_sum_of(calls, gates, INFERENCE_ORDER)
    return combine_branches(branches, gates)


def _records_gradient(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records a graph through any of ``tensors``."""
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)


class Run(NamedTuple):
    """What every branch's calls share: the softmax scale, the kernel asked for (None:
    automatic), causality, and whether ``lse`` is needed (``combine="lse"``)."""

    scale: float
    backend: str | None
    is_causal: bool
    need_lse: bool


class Checked(NamedTuple):
    """A checked call of :func:`nsa_attention`: its tensors, gates (None with
    ``combine="lse"``), sizes ``(compress_block, compress_stride, select_block, topk,
    window)`` and what every branch shares."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    gates: torch.Tensor | None
    sizes: tuple[int, int, int, int, int]
    run: Run


def check_call(
    query: object, key: object, value: object, gates: object, sizes: tuple[object, ...],
    is_causal: object, combine: object, scale: object, backend: object,
) -> Checked:  # fmt: skip
    """:func:`nsa_attention`'s arguments checked, before any work (``sizes``: compress_block,
    compress_stride, select_block, topk, window as given).

    Raises:
        TypeError / ValueError: as :func:`nsa_attention` says.
    """
    q, k, v = V.check_qkv(query, key, value, same_length=False)
    V.check_bool("is_causal", is_causal)
    checked = _check_sizes(*sizes, bool(is_causal))
    _check_combine(combine)
    g = _check_gates(gates, q, str(combine))
    _check_lengths(q, k, bool(is_causal))
    scale = V.check_scale(scale)
    run = Run(
        q.shape[-1] ** -0.5 if scale is None else scale, check_backend_name(backend),
        bool(is_causal), combine == "lse",
    )  # fmt: skip
    return Checked(q, k, v, g, checked, run)


#: The order in which the branches (compressed, selected, window) run and join the gated sum
#: with gradients: the compressed branch, which saves the most, last, so that its backward runs
#: first (Note [Branches joined as they come] in ``branches.py``).
JOIN_ORDER = (1, 2, 0)
#: Without gradients: the compressed branch first, while no sum is held beside its classes'
#: stacked queries and output (last, it would hold one output-sized tensor more at its peak).
#: The sum's terms then add in another order than with gradients: the two agree to rounding.
INFERENCE_ORDER = (0, 1, 2)


def combine_branches(
    branches: tuple[Callable[..., Result], Callable[[], Result], Callable[[], Result]],
    gates: torch.Tensor | None,
) -> torch.Tensor:
    """The branches (compressed, selected, window), each a call run just before its result
    joins (Note [Branches joined as they come] in ``branches.py``), combined: summed by
    ``gates`` (B, N, H, 3), or merged through their log-sum-exp where ``gates`` is None. The
    compressed branch's call takes an optional gate (B, N, H, 1) and sum so far and then
    returns the sum with its term joined (Note [A branch that gates its own rows])."""
    if gates is not None:
        compressed, *others = branches
        calls = [lambda gate, total: compressed(gate, total)[0],
                 *(lambda b=b: b()[0] for b in others)]  # fmt: skip
        return gated_sum(calls, gates, JOIN_ORDER, self_gated=(0,))
    # The window branch first: every row sees its own key there, so no merge step meets two
    # empty sides (merge_branches: their gradient would be NaN).
    return merge_branches([branches[2], branches[1], branches[0]])  # type: ignore[list-item]


def _check_sizes(
    block: object, stride: object, select: object, topk: object, window: object, is_causal: bool
) -> tuple[int, int, int, int, int]:
    """The branches' sizes, checked: (compress_block, compress_stride, select_block, topk,
    window)."""
    block = V.check_positive_int("compress_block", block)
    stride = V.check_positive_int("compress_stride", stride)
    if stride > block:
        raise ValueError(
            f"compress_stride must be at most compress_block (windows of compress_block="
            f"{block} positions every compress_stride positions, so that every position lies in "
            f"a window), got compress_stride={stride}; e.g. NSA's compress_block=32, "
            f"compress_stride=16"
        )
    select = V.check_positive_int("select_block", select)
    window = V.check_positive_int("window", window)
    return block, stride, select, _check_topk(topk, is_causal), window


def _check_combine(combine: object) -> None:
    if not isinstance(combine, str):
        raise TypeError(f"combine must be one of {COMBINE}, got {combine!r}")
    if combine not in COMBINE:
        raise ValueError(
            f"combine must be one of {COMBINE}, got combine={combine!r}: 'gates' sums the "
            f"branches weighted by gates (NSA), 'lse' merges them into one softmax"
        )


def _check_gates(gates: object, q: torch.Tensor, combine: str) -> torch.Tensor | None:
    """``gates`` (B, Nq, H, 3) in the query's dtype and device, or None for ``combine="lse"``."""
    expected = (*q.shape[:3], len(BRANCHES))
    if combine == "lse":
        if gates is not None:
            raise ValueError(
                "gates are not used with combine='lse' (the branches merge through their "
                "log-sum-exp); pass gates=None, or combine='gates'"
            )
        return None
    if not isinstance(gates, torch.Tensor):
        raise TypeError(
            f"gates must be a tensor {expected} (batch, seq_len, num_heads, 3: compressed, "
            f"selected, window; activated, e.g. a sigmoid) with combine='gates', got "
            f"{type(gates).__name__}; or pass combine='lse'"
        )
    V.check_like_query("gates", gates, q)
    if tuple(gates.shape) != expected:
        raise ValueError(
            f"gates must have shape (batch, seq_len, num_heads, 3) = {expected} (one gate per "
            f"branch: compressed, selected, window), got gates.shape={tuple(gates.shape)}"
        )
    return gates


def _check_lengths(q: torch.Tensor, k: torch.Tensor, is_causal: bool) -> None:
    V.check_causal_lengths(q, k, is_causal, "nsa_attention")
    if not is_causal and q.shape[1] != k.shape[1]:
        raise ValueError(
            f"nsa_attention with is_causal=False needs a query for every key position (the "
            f"window is centred on the query), got query.shape={tuple(q.shape)}, "
            f"key.shape={tuple(k.shape)}; pass is_causal=True for a shorter, end-aligned query"
        )


def _branch(
    call: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, run: Run
) -> Result:
    """One branch's ``(out, lse)`` from its call (``call(q, k, v, return_lse=...)``): ``lse``
    None unless asked for, else differentiable (Note [A differentiable log-sum-exp])."""
    if not run.need_lse:
        return call(q, k, v), None
    out, lse = call(q, k, v, return_lse=True)
    return out, lse_with_gradient(call, q, k, lse, run.scale)


def window_branch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, run: Run,
    attend: Callable[..., Any] | None = None, **where: Any,
) -> Result:  # fmt: skip
    """The sliding window branch: ``attend`` (:func:`~dilated_attention.attention`, or the
    ring's with ``where``: its group) with ``window_size=(w - 1, 0)`` (causal) or ``(w - 1,
    w - 1)``."""
    size = (window - 1, 0 if run.is_causal else window - 1)
    call = functools.partial(
        attend or attention, is_causal=run.is_causal, window_size=size, scale=run.scale,
        backend=run.backend, **where,
    )  # fmt: skip
    return _branch(call, q, k, v, run)


def selected_branch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, block: int,
    run: Run, attend: Callable[..., Any] | None = None, **where: Any,
) -> Result:  # fmt: skip
    """The selected branch: ``attend`` (:func:`~dilated_attention.block_sparse_attention`, or
    the ring's with ``where``) on the run-time block ``mask`` of the blocks chosen per
    key/value head (Note [NSA's three branches])."""

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **lse: bool) -> Any:
        return (attend or block_sparse_attention)(
            q, k, v, mask, block_size=block, is_causal=run.is_causal, scale=run.scale,
            backend=run.backend, **where, **lse,
        )  # fmt: skip

    return _branch(call, q, k, v, run)


def compressed_branch(
    q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, key_len: int, block: int,
    stride: int, run: Run, gate: torch.Tensor | None = None, total: torch.Tensor | None = None,
) -> Result:  # fmt: skip
    """The compressed branch, exact per token (Note [The compressed branch exactly, per
    residue class]; the classes' rows taken and put back as Note [Residue classes gathered
    once] in ``residue_rows.py`` says, classes alike run as one call: Note [Residue classes as
    heads]): ``(out (B, Nq, H, D), lse (B, H, Nq) or None)``.

    Args:
        q: (B, Nq, H, D), the last ``Nq`` of ``key_len`` positions (end-aligned).
        k_cmp, v_cmp: (B, Nc, Hkv, D) the compressed keys and values of those positions
            (:func:`~dilated_attention.sparse.compress_kv`), or of a prefix holding every
            window the queries see (the ring's: the keys a rank's queries see).
        gate: (B, Nq, H, 1) or None: ``out`` is then ``gate * out``, its classes' outputs
            gated as they are put back (Note [A branch that gates its own rows] in
            ``branches.py``); ``lse`` is not asked for.
        total: (B, Nq, H, D) or None, with ``gate`` only: ``out`` is then ``total + gate *
            out``, the classes' gated outputs added as they are put back.
    """
    if total is not None and gate is None:
        raise ValueError(
            "total: a sum is joined only to the gated output (total + gate * out), got "
            "gate=None; pass gate too, or add total to the result yourself"
        )
    batch, nq, heads, _ = q.shape
    lse_dtype = torch.promote_types(q.dtype, torch.float32)
    calls = _class_calls(nq, key_len, block, stride, run.is_causal, k_cmp.shape[1])
    if not calls:
        out = q.new_zeros(batch, nq, heads, v_cmp.shape[-1])
        out = out if gate is None else gated_add(total, out, gate)
        lse = torch.full((batch, heads, nq), -torch.inf, dtype=lse_dtype, device=q.device)
        return out, lse if run.need_lse else None
    call = functools.partial(
        attention, is_causal=run.is_causal, scale=run.scale, backend=run.backend
    )
    step = stride if run.is_causal else 1
    runs = _runs(calls, step, nq)
    classes = ResidueRows(tuple((first, count) for first, count, _ in runs), step, nq)
    outs: list[Any] = []
    lses: list[Any] = []
    for (_, count, keys), q_run in zip(runs, classes.gather(q, 1), strict=True):
        q_g = _classes_as_heads(q_run)
        o_g, lse_g = _branch(call, q_g, k_cmp[:, :keys], v_cmp[:, :keys], run)
        del q_g  # not held past its call (without gradients nothing else holds it)
        o_run, lse_run = _heads_as_classes(o_g, lse_g, count)
        outs.append(o_run)
        lses.append(lse_run)
    out = classes.scatter(outs, 1, 0.0, scale=gate, total=total)
    if not run.need_lse:
        return out, None
    return out, classes.scatter([x.to(lse_dtype) for x in lses], 2, -torch.inf)


def _runs(calls: list[tuple[int, int]], step: int, nq: int) -> list[tuple[int, int, int]]:
    """The classes' calls (first row, compressed keys) as runs ``(first row, classes, keys)``
    of classes on consecutive first rows with as many rows and keys (Note [Residue classes as
    heads]), in the order of their first rows."""
    runs: list[tuple[int, int, int]] = []
    for first, keys in sorted(calls):
        if runs:
            start, count, seen = runs[-1]
            same_rows = len(range(first, nq, step)) == len(range(start, nq, step))
            if seen == keys and count < step and first == start + count and same_rows:
                runs[-1] = (start, count + 1, keys)
                continue
        runs.append((first, 1, keys))
    return runs


def _classes_as_heads(part: torch.Tensor) -> torch.Tensor:
    """A run of G classes' queries (B, n, G, H, D) as one query (B, n, H * G, D), head ``h * G
    + c`` class ``c``'s head ``h``: key/value head ``j`` serves the G classes' heads of its
    group (Note [Residue classes as heads]); one class is a view, more a copy in one pass
    (``copy_rows``), whose gradient is a view of the query's."""
    if part.shape[2] == 1:
        return part.flatten(2, 3)
    return _AsHeads.apply(part)  # type: ignore[no-any-return]


class _AsHeads(torch.autograd.Function):
    """:func:`_classes_as_heads` of more than one class: the copy, and the gradient's view."""

    @staticmethod
    def forward(ctx: Any, part: torch.Tensor) -> torch.Tensor:
        batch, rows, count, heads, dim = part.shape
        ctx.count = count
        stacked = part.new_empty(batch, rows, heads, count, dim)
        copy_rows(part.transpose(2, 3), stacked)
        return stacked.flatten(2, 3)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.unflatten(2, (-1, ctx.count)).transpose(2, 3)


def _heads_as_classes(
    out: torch.Tensor, lse: torch.Tensor | None, count: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`_classes_as_heads` undone, as views: ``out`` (B, n, H * G, D) and ``lse`` (B,
    H * G, n) or None -> the run's (B, n, G, H, D) and (B, H, n, G) (or None)."""
    outs = out.unflatten(2, (-1, count)).transpose(2, 3)
    return outs, None if lse is None else lse.unflatten(1, (-1, count)).transpose(2, 3)


def _class_calls(
    nq: int, nk: int, block: int, stride: int, is_causal: bool, count: int
) -> list[tuple[int, int]]:
    """``(first query row, compressed keys)`` of each call of the compressed branch: one per
    residue class with a row that sees a compressed key (causal), else one of every row and
    key; rows ``first, first + stride, ...`` (causal) or all. Note [The compressed branch
    exactly, per residue class]."""
    if count == 0:
        return []
    if not is_causal:
        return [(0, count)]
    offset = nk - nq  # the position of query row 0 (end-aligned)
    calls = []
    for r in range(stride):
        shift = (r - block + 1) // stride  # t_r: query m of the class sees keys c <= m + t_r
        first = max(0, -shift, -((r - offset) // stride))  # seeing a key, among the rows
        end = -((r - nk) // stride)  # one past the class's last position below nk
        if end > first:
            calls.append((r + first * stride - offset, end + shift))
    return calls
