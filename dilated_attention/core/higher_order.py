"""Higher-order gradients (double backward) of the library's autograd Functions.

Note [Double backward]
    Every Function's backward runs kernels with the forward's merged ``out`` and ``lse`` as
    inputs (Note [Backward with external statistics]). Those are functions of q and k that the
    backward treats as constants, and ``lse`` is marked non-differentiable, so under
    ``create_graph=True`` the ops a backward records do not describe how its gradients depend
    on q, k and v: differentiating them again gives wrong numbers without any error (a gradient
    penalty through the layer was off by 278 of 599; fused kernels and SDPA's aten backward ops
    have no derivative at all; tests/ops/test_higher_order.py compares the penalty's gradients
    with the float64 oracle). ``torch.is_grad_enabled()`` is True inside a
    backward exactly when autograd runs it with ``create_graph=True``; each backward checks it
    and then does one of two things.

    * Single-process Functions (dense, dilated, fused dilated, block-sparse) recompute their
      gradients with differentiable PyTorch ops, whatever kernel ran forward
      (:func:`differentiable_grads`). First pass: for every kernel call, the scores ``S`` of its
      rows, ``P = exp(S - m)`` with ``m`` the forward's merged lse *detached* (any per-row
      constant cancels from ``O`` and ``LSE``, so a detached shift changes no derivative; this
      one keeps every exponent <= 0 at any logit size), and ``P @ V`` and ``rowsum(P)`` added
      into whole-sequence sums; ``O = sum(P V) / sum(P)`` and ``LSE = m + log(sum(P))`` are then
      the merged output and log-sum-exp as differentiable functions of q, k and v (the multiset
      union of Eq. 10: a key in two branches is summed twice). Second pass: the gradient
      formulas of Note [Backward with external statistics] with these ``O`` and ``LSE``, so dq,
      dk and dv are differentiable functions of q, k, v and dout, to any order. Rows that see no
      key have ``sum(P) = 0``: they use ``m`` alone (``P`` is 0 there, so nothing divides by 0
      and no ``inf * 0`` reaches a derivative). The recompute holds each call's score matrix
      (``rows x keys`` per segment and head, in float32, float64 for float64 inputs) for autograd,
      like PyTorch's math SDPA does under double backward; a plain backward never takes this path.
    * Where that is impossible, the first-order gradients are computed under ``no_grad`` and
      passed through a node whose backward raises ``RuntimeError`` naming the function and the
      fix (:func:`first_order_only`): ring Functions (their backward's collectives are not
      differentiable) and dropout (the mask is not replayed differentiably). Torch's
      ``once_differentiable`` is not enough: it attaches its error only when a *gradient output*
      requires grad, so ``loss = (out * w).sum()`` with ``w`` constant followed by a penalty on
      the input gradient would still be silently wrong. The node also takes the Function's saved
      ``out`` (whose graph leads back to q, k and v) and the upstream gradient as inputs: on
      its own it would hang from detached copies, and ``torch.autograd.grad(penalty, q)``
      would find no path to q (autograd's generic "not used in the graph" error, or ``None``
      with ``allow_unused=True``); connected, autograd runs it, and it raises, on every route.
      A function that builds its result from such calls (``moba_attention``, ``nsa_attention``)
      runs them inside :func:`raised_as`: each Function takes the message in force during its
      forward, so the error names the function the user called and its fix, not a call inside.

Note [Dense calls on torch's autograd]
    A dense training call with nothing around its one kernel call (no key mask, window, soft-cap,
    sinks, dropout or packed documents; square when causal) on a kernel whose aten op torch's
    autograd differentiates (cuDNN's: ``Backend.records_autograd``) runs that op as torch records
    it, not under the one autograd Function (Note [One autograd Function] in ``autograd.py``).
    Torch's C++ node then runs the op's backward, the kernel the runner's backward would call, with
    none of the Function's Python in either direction: on an H100 (bf16, H = 16, D = 128, 4K-64K
    tokens) a forward+backward's host time over SDPA's, called from the same (B, N, H, D) tensors,
    fell from 0.22-0.55 ms to 0.11-0.21 ms. Torch's backward op has no derivative, so under
    ``create_graph=True`` a post-hook on the node (:class:`CreateGraphSwap`) returns the runner's
    differentiable recompute (Note [Double backward]) in place of its gradients: exact to any order,
    as on every other path (torch's backward has run by then, and its gradients are dropped: a
    double backward does that kernel's work once more than under the Function). The recompute holds
    q, k and v weakly (the node's saved tensors keep them alive as long as its graph can run
    backward, retained or not, and no longer: nothing outlives the step into the next one's forward)
    and the lse (2 / D of q's bytes in 16 bits); it holds no ``out``, which holds the node. cuDNN's
    node also gets a pre-hook that lays the upstream gradient out like the output, as the library's
    own backward did (``_UpstreamLike`` in ``backends/sdpa.py``). Saved-tensor hooks would free or
    move q, k and v behind the weak references: under non-reentrant activation checkpointing,
    ``save_on_cpu`` or any ``saved_tensors_hooks`` the call keeps the Function
    (``autograd.saved_tensor_hooks_active``), whose saved tensors go through the hooks.

Shape legend: B batch, Nq/Nk query/key positions, H query heads, Hkv key/value heads, D head dim;
per call G pieces of Lq query and Lk key rows with Hc query and Hkc key/value heads.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

import torch


# -- raising on double backward ------------------------------------------------------------------
class RaiseOnBackward(torch.autograd.Function):
    """``apply(message, fn, *args)``: ``fn(*args)`` (a tuple of tensors), on a node whose
    backward raises ``RuntimeError(message)``. Tensors among ``args`` that ``fn`` does not use
    may be passed as anchors: tensors the results depend on (Note [Double backward]), through
    which the node lies on every path from the results back to the inputs, so autograd runs it
    (and raises) whichever inputs a later ``torch.autograd.grad`` asks for. Composable with
    torch.func (a generated vmap rule): the custom operators' backward under the transforms
    runs through it (``compiled/operators.py``)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(message: str, fn: Any, *args: Any) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return tuple(fn(*args))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.message = inputs[0]

    @staticmethod
    def backward(ctx: Any, *_: torch.Tensor) -> tuple[None, ...]:  # type: ignore[override]
        raise RuntimeError(ctx.message)


def _views(count: int) -> Any:
    """``fn`` for :class:`RaiseOnBackward`: views of the first ``count`` tensors."""
    return lambda *tensors: tuple(g.view_as(g) for g in tensors[:count])


def no_higher_order_message(what: str, why: str, fix: str) -> str:
    """The error raised when a first-order-only gradient is differentiated."""
    return f"{what} has no higher-order gradients (double backward): {why}. {fix}"


def ring_message(what: str, single: str) -> str:
    """The double-backward error of a ring function ``what`` whose one-process form is
    ``single``."""
    return no_higher_order_message(
        what,
        "its backward exchanges gradients between the ranks through collectives, which autograd "
        "cannot differentiate",
        f"For a gradient penalty or other double backward, run {single} on the whole sequence "
        "in one process instead; it supports double backward.",
    )


#: The double-backward error of the library function a call runs inside (:func:`raised_as`).
_OUTER_MESSAGE: ContextVar[str | None] = ContextVar("outer_first_order_message", default=None)
_Function = TypeVar("_Function", bound=Callable[..., Any])


@contextlib.contextmanager
def raised_as(message: str) -> Iterator[None]:
    """Calls made within raise ``message`` where their first-order gradients are differentiated,
    in place of their own (Note [Double backward]); the outermost message in force wins."""
    token = _OUTER_MESSAGE.set(message) if _OUTER_MESSAGE.get() is None else None
    try:
        yield
    finally:
        if token is not None:
            _OUTER_MESSAGE.reset(token)


def raising_as(message: str) -> Callable[[_Function], _Function]:
    """A public function's decorator: its calls run inside :func:`raised_as` ``(message)``
    (not while torch.compile traces it: the custom operators keep their own errors)."""

    def decorate(function: _Function) -> _Function:
        @functools.wraps(function)
        def call(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():
                return function(*args, **kwargs)
            with raised_as(message):
                return function(*args, **kwargs)

        return call  # type: ignore[return-value]

    return decorate


def outer_message() -> str | None:
    """The message of the :func:`raised_as` in force (None outside any)."""
    return _OUTER_MESSAGE.get()


def first_order_only(
    grads: Sequence[torch.Tensor | None],
    message: str,
    anchors: Sequence[torch.Tensor | None] = (),
) -> tuple[torch.Tensor | None, ...]:
    """``grads`` as they are in a plain backward; under ``create_graph=True``, copies whose
    differentiation raises ``RuntimeError(message)`` (Note [Double backward]).

    Args:
        grads: a backward's results (tensors or None), computed without a graph.
        message: the error, from :func:`no_higher_order_message`.
        anchors: the tensors, as the backward received them, through which the gradients
            depend on the inputs: the Function's saved output (whose graph leads to q, k and v)
            and the upstream gradient. Without them a later ``torch.autograd.grad(..., q)``
            would find no path from the gradients to q: autograd's generic "not used in the
            graph" error, or None with ``allow_unused=True``, instead of ``message``.

    Returns:
        The gradients, in order, with None kept.
    """
    if not torch.is_grad_enabled():
        return tuple(grads)
    present = [i for i, g in enumerate(grads) if g is not None]
    if not present:
        return tuple(grads)
    # Detached leaves that require grad, so the error node is recorded whatever the inputs were.
    leaves = [grads[i].detach().requires_grad_() for i in present]  # type: ignore[union-attr]
    links = [a for a in anchors if a is not None and a.requires_grad]
    wrapped = RaiseOnBackward.apply(message, _views(len(leaves)), *leaves, *links)
    out = list(grads)
    for i, g in zip(present, wrapped, strict=True):
        out[i] = g
    return tuple(out)


# -- a node torch's autograd recorded -------------------------------------------------------------
class CreateGraphSwap:
    """A post-hook for the node of a kernel op that torch's autograd recorded (Note [Dense calls
    on torch's autograd]): in a plain backward it keeps torch's gradients; under
    ``create_graph=True`` it returns ``grads(dout)`` in their place.

    Args:
        grads: the upstream gradient of the call's output (B, Nq, H, D) -> dq, dk, dv as
            differentiable functions of the call's inputs, shaped like q, k and v.
        to_node: a gradient (B, N, heads, D) -> the layout of the node's input it replaces (the
            op's (B, heads, N, D) view).
        from_node: the node's output gradient -> (B, Nq, H, D).
    """

    def __init__(
        self,
        grads: Callable[[torch.Tensor], Sequence[torch.Tensor]],
        to_node: Callable[[torch.Tensor], torch.Tensor],
        from_node: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        self._grads, self._to_node, self._from_node = grads, to_node, from_node

    def __call__(
        self,
        grad_inputs: Sequence[torch.Tensor | None],
        grad_outputs: Sequence[torch.Tensor | None],
    ) -> tuple[torch.Tensor | None, ...] | None:
        dout = grad_outputs[0]
        if not torch.is_grad_enabled() or dout is None:  # a plain backward: torch's are exact
            return None
        swapped = list(grad_inputs)
        for i, g in enumerate(self._grads(self._from_node(dout))):
            if swapped[i] is not None:
                swapped[i] = self._to_node(g)
        return tuple(swapped)


# -- differentiable recompute ---------------------------------------------------------------------
@dataclass(frozen=True)
class RowCall:
    """One kernel call's rows as flat indices into (position, head) rows.

    Attributes:
        q_index: (G, Lq * Hc) int64 into the ``Nq * H`` rows of ``q.view(B, Nq * H, D)``, in
            (row, head) order per piece.
        kv_index: (G, Lk * Hkc) int64 into the ``Nk * Hkv`` rows of k and v, likewise.
        heads: Hc; query head ``i`` of the call reads key/value head ``i // (Hc // Hkc)``.
        kv_heads: Hkc.
        causal: top-left causal within each piece (query row ``i`` sees key rows ``j <= i``).
    """

    q_index: torch.Tensor
    kv_index: torch.Tensor
    heads: int
    kv_heads: int
    causal: bool

    @classmethod
    def from_positions(
        cls,
        q_pos: torch.Tensor,
        kv_pos: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        causal: bool,
    ) -> RowCall:
        """A call over every head, from (G, Lq) query and (G, Lk) key positions."""

        def flat(pos: torch.Tensor, heads: int) -> torch.Tensor:
            head = torch.arange(heads, device=pos.device)
            return (pos.unsqueeze(-1) * heads + head).flatten(1)

        return cls(
            flat(q_pos, num_heads), flat(kv_pos, num_kv_heads), num_heads, num_kv_heads, causal
        )


def flat_rows(x: torch.Tensor, index: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, N, Hx, E) (or (B, N, Hx)) and (G, L * heads) -> (B * G, L, heads, E) (or no E)."""
    batch, g = x.shape[0], index.shape[0]
    flat = x.reshape(batch, -1, *x.shape[3:]).index_select(1, index.flatten())
    return flat.view(batch * g, index.shape[1] // heads, heads, *x.shape[3:])


def _scatter(total: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``total`` (B, N * Hx, E) plus ``rows`` (B * G, L, heads, E) at ``index``, out of place."""
    src = rows.reshape(total.shape[0], -1, total.shape[-1]).to(total.dtype)
    return total.index_add(1, index.flatten(), src)


def _scores(
    q: torch.Tensor,
    k: torch.Tensor,
    call: RowCall,
    key_ignore: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Scaled, masked scores (B*G, Hkc, g, Lq, Lk) of (B*G, Lq, Hc, D) q and (B*G, Lk, Hkc, D) k.

    ``key_ignore`` is (B*G, Lk, Hkc) bool or None.
    """
    rows_q, dim = q.shape[1], q.shape[-1]
    qg = q.view(q.shape[0], rows_q, call.kv_heads, call.heads // call.kv_heads, dim)
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qg, k) * scale
    ignore = None
    if key_ignore is not None:
        ignore = key_ignore.permute(0, 2, 1)[:, :, None, None, :]
    if call.causal:
        rows_k = k.shape[1]
        key_pos = torch.arange(rows_k, device=q.device)
        future = key_pos > torch.arange(rows_q, device=q.device).view(-1, 1)
        ignore = future if ignore is None else ignore | future
    if ignore is not None:
        scores = scores.masked_fill(ignore, float("-inf"))
    return scores


def differentiable_grads(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    calls: Sequence[RowCall],
    *,
    scale: float,
    key_padding_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of the merged attention over ``calls``, as differentiable functions of
    q, k, v and dout (Note [Double backward]).

    Args:
        dout: (B, Nq, H, D) upstream gradient.
        q: (B, Nq, H, D); k, v: (B, Nk, Hkv, D).
        lse: (B, H, Nq) the forward's merged log-sum-exp; used only as a (detached) shift.
        calls: every kernel call of the forward; a key in several calls counts in each.
        scale: softmax scale.
        key_padding_mask: (B, Nk) bool, ``True`` = ignore the key, or None.

    Returns:
        ``(dq, dk, dv)`` shaped and typed like ``(q, k, v)``.
    """
    batch, num_q, heads, dim = q.shape
    num_k, kv_heads = k.shape[1], k.shape[2]
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    qc, kc, vc, doc = (x.to(cdt) for x in (q, k, v, dout))
    shift = lse.detach().to(cdt).transpose(1, 2)
    shift = torch.where(torch.isinf(shift), torch.zeros_like(shift), shift)  # (B, Nq, H)

    def ignored(call: RowCall) -> torch.Tensor | None:
        if key_padding_mask is None:
            return None
        positions = call.kv_index // kv_heads
        return flat_rows(key_padding_mask, positions, call.kv_heads)

    # First pass: O and LSE as functions of q, k, v.
    sums = qc.new_zeros(batch, num_q * heads, dim + 1)
    for call in calls:
        k_rows = flat_rows(kc, call.kv_index, call.kv_heads)
        v_rows = flat_rows(vc, call.kv_index, call.kv_heads)
        s = _scores(flat_rows(qc, call.q_index, call.heads), k_rows, call, ignored(call), scale)
        m = flat_rows(shift.unsqueeze(-1), call.q_index, call.heads)  # (B*G, Lq, Hc, 1)
        m = m.permute(0, 2, 1, 3).reshape(s.shape[0], call.kv_heads, -1, s.shape[3], 1)
        p = torch.exp(s - m)
        v1 = torch.cat([v_rows, torch.ones_like(v_rows[..., :1])], dim=-1)
        pv = torch.einsum("bhgqk,bkhd->bqhgd", p, v1)
        sums = _scatter(sums, call.q_index, pv)
    sums = sums.view(batch, num_q, heads, dim + 1)
    total = sums[..., dim]
    seen = total > 0
    safe_total = torch.where(seen, total, torch.ones_like(total))
    out = sums[..., :dim] / safe_total.unsqueeze(-1)
    lse_rows = shift + torch.log(safe_total)  # finite stand-in where no key is seen (P = 0)
    delta = (doc * out).sum(-1)  # (B, Nq, H)

    # Second pass: Note [Backward with external statistics] with the differentiable O and LSE.
    dq = qc.new_zeros(batch, num_q * heads, dim)
    dk = qc.new_zeros(batch, num_k * kv_heads, dim)
    dv = qc.new_zeros(batch, num_k * kv_heads, dim)
    stats = torch.stack([lse_rows, delta], dim=-1)  # (B, Nq, H, 2)
    for call in calls:
        q_rows = flat_rows(qc, call.q_index, call.heads)
        k_rows = flat_rows(kc, call.kv_index, call.kv_heads)
        v_rows = flat_rows(vc, call.kv_index, call.kv_heads)
        do_rows = flat_rows(doc, call.q_index, call.heads)
        s = _scores(q_rows, k_rows, call, ignored(call), scale)
        shape = (s.shape[0], call.kv_heads, -1, s.shape[3], 2)
        st = flat_rows(stats, call.q_index, call.heads).permute(0, 2, 1, 3).reshape(shape)
        p = torch.exp(s - st[..., :1])
        g = call.heads // call.kv_heads
        do_g = do_rows.view(do_rows.shape[0], do_rows.shape[1], call.kv_heads, g, dim)
        q_g = q_rows.view(do_g.shape)
        dv_rows = torch.einsum("bhgqk,bqhgd->bkhd", p, do_g)
        dp = torch.einsum("bqhgd,bkhd->bhgqk", do_g, v_rows)
        ds = p * (dp - st[..., 1:]) * scale
        dq_rows = torch.einsum("bhgqk,bkhd->bqhgd", ds, k_rows)
        dk_rows = torch.einsum("bhgqk,bqhgd->bkhd", ds, q_g)
        dq = _scatter(dq, call.q_index, dq_rows)
        dk = _scatter(dk, call.kv_index, dk_rows)
        dv = _scatter(dv, call.kv_index, dv_rows)
    return (
        dq.view(q.shape).to(q.dtype),
        dk.view(k.shape).to(k.dtype),
        dv.view(v.shape).to(v.dtype),
    )
