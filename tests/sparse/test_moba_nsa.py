"""``moba_attention`` and ``nsa_attention`` against a readable float64 re-implementation
(``support/sparse_oracle.py``: explicit token masks and softmax, no library code): outputs and
the gradients of q, k, v and the gates, causal and not, GQA, odd lengths with a partial last
block, ``topk`` beyond the visible blocks, an end-aligned query, packed documents (MoBA), both
ways of combining NSA's branches; every bad argument raises, naming it, before any work.
"""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
from support.branch_order import backward_order, most_pending, watch
from support.sparse_oracle import (
    blocks_mask,
    document_ids,
    heads_first,
    moba_reference,
    nsa_reference,
    selected_blocks,
)
from torch import Tensor

import dilated_attention.sparse.moba as moba_module
import dilated_attention.sparse.nsa as nsa_module
import dilated_attention.sparse.selection as selection_module
from dilated_attention.sparse import moba_attention, nsa_attention

F64 = torch.float64
TIGHT = {"atol": 1e-10, "rtol": 1e-9}


def _leaves(
    batch: int, nq: int, heads: int, kv_heads: int, *, nk: int | None = None, dim: int = 8,
    seed: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    nk = nq if nk is None else nk
    shapes = ((batch, nq, heads, dim), (batch, nk, kv_heads, dim), (batch, nk, kv_heads, dim))
    return tuple(  # type: ignore[return-value]
        torch.randn(*s, generator=g, dtype=F64).requires_grad_() for s in shapes
    )


def _gates(q: Tensor, seed: int = 1) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*q.shape[:3], 3, generator=g, dtype=F64)
    return torch.sigmoid(logits).requires_grad_()


def _assert_same_with_gradients(out: Tensor, ref: Tensor, leaves: list[Tensor]) -> None:
    """Outputs equal, and the gradients of every leaf for one random upstream gradient."""
    torch.testing.assert_close(out, ref, **TIGHT)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=F64)
    got = torch.autograd.grad(out, leaves, dout)
    want = torch.autograd.grad(ref, leaves, dout)
    for name, a, b in zip("qkvg", got, want, strict=False):
        torch.testing.assert_close(a, b, **TIGHT, msg=lambda m, n=name: f"d{n}: {m}")


MOBA_CASES: dict[str, dict[str, Any]] = {
    # name: nq, nk, heads, kv_heads, block, topk, is_causal
    "causal-gqa-odd": dict(nq=37, nk=37, heads=4, kv=2, block=8, topk=2, causal=True),
    "topk-beyond-visible": dict(nq=37, nk=37, heads=2, kv=1, block=8, topk=9, causal=True),
    "own-block-only": dict(nq=21, nk=21, heads=2, kv=2, block=8, topk=0, causal=True),
    "not-causal": dict(nq=29, nk=29, heads=2, kv=2, block=8, topk=2, causal=False),
    "end-aligned": dict(nq=13, nk=37, heads=4, kv=2, block=8, topk=1, causal=True),
}


@pytest.mark.parametrize("case", MOBA_CASES.values(), ids=MOBA_CASES.keys())
def test_moba_matches_the_reference(case: dict[str, Any]) -> None:
    q, k, v = _leaves(2, case["nq"], case["heads"], case["kv"], nk=case["nk"])
    kw = dict(block_size=case["block"], topk=case["topk"], is_causal=case["causal"])
    out = moba_attention(q, k, v, **kw)
    ref = moba_reference(q, k, v, block=case["block"], topk=case["topk"],
                         is_causal=case["causal"])  # fmt: skip
    _assert_same_with_gradients(out, ref, [q, k, v])


def test_moba_under_torch_func_grad_equals_autograd() -> None:
    """``torch.func.grad`` through MoBA (its block means, choice and attention) gives the
    gradient autograd gives."""
    q, k, v = _leaves(1, 40, 4, 2, nk=40)

    def loss(q: Tensor) -> Tensor:
        return moba_attention(q, k, v, block_size=8, topk=2).pow(2).sum()

    (want,) = torch.autograd.grad(loss(q), q)
    torch.testing.assert_close(torch.func.grad(loss)(q.detach()), want)


def test_moba_soft_caps_the_chosen_blocks_scores_and_adds_sinks() -> None:
    """Gemma 2's soft-cap and gpt-oss's sinks (one logit per query head, counted once in each
    row's denominator) on the blocks the plain affinities choose, against explicit scores."""
    q, k, v = _leaves(2, 29, 4, 2)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(3), dtype=F64)
    sinks.requires_grad_()
    out = moba_attention(q, k, v, block_size=8, topk=1, softcap=2.0, sinks=sinks)
    chosen = selected_blocks(q, k, block=8, topk=1, is_causal=True, per_kv_head=False)
    mask = blocks_mask(chosen, block=8, nq=29, nk=29, is_causal=True)
    scores = q.transpose(1, 2) @ heads_first(k, 4).transpose(-1, -2) * 8**-0.5
    scores = (2.0 * torch.tanh(scores / 2.0)).masked_fill(~mask, float("-inf"))
    sink = sinks[None, :, None, None].expand(*scores.shape[:3], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    ref = (probs @ heads_first(v, 4)).transpose(1, 2)
    _assert_same_with_gradients(out, ref, [q, k, v, sinks])


def test_moba_packed_documents_choose_within_each() -> None:
    """Two rows of 24 holding four documents that start at blocks: blocks are chosen, and
    attended, only within the query's document."""
    cu_seqlens = [0, 8, 24, 40, 48]
    q, k, v = _leaves(2, 24, 4, 2, seed=3)
    out = moba_attention(q, k, v, block_size=8, topk=1, cu_seqlens=cu_seqlens)
    ref = moba_reference(q, k, v, block=8, topk=1, is_causal=True,
                         documents=document_ids(cu_seqlens, 2, 24))  # fmt: skip
    _assert_same_with_gradients(out, ref, [q, k, v])


NSA_CASES: dict[str, dict[str, Any]] = {
    # name: nq, nk, heads, kv_heads, sizes (compress_block, compress_stride, select_block,
    # topk, window), is_causal
    "causal-gqa-odd": dict(nq=37, nk=37, heads=4, kv=2, sizes=(4, 2, 8, 2, 5), causal=True),
    "stride-3-topk-beyond": dict(
        nq=37, nk=37, heads=2, kv=1, sizes=(5, 3, 8, 9, 3), causal=True
    ),
    "end-aligned": dict(nq=13, nk=37, heads=4, kv=2, sizes=(5, 3, 8, 1, 4), causal=True),
    "no-whole-window": dict(nq=6, nk=6, heads=2, kv=2, sizes=(8, 4, 4, 1, 3), causal=True),
    "not-causal": dict(nq=29, nk=29, heads=2, kv=1, sizes=(4, 4, 8, 2, 4), causal=False),
}


def _nsa_kwargs(case: dict[str, Any]) -> dict[str, Any]:
    names = ("compress_block", "compress_stride", "select_block", "topk", "window")
    return {**dict(zip(names, case["sizes"], strict=True)), "is_causal": case["causal"]}


@pytest.mark.parametrize("combine", ["gates", "lse"])
@pytest.mark.parametrize("case", NSA_CASES.values(), ids=NSA_CASES.keys())
def test_nsa_matches_the_reference(case: dict[str, Any], combine: str) -> None:
    """Gated: the gated sum of the three branches, with the gates' gradient. ``lse``: one
    softmax over the three key sets (the compressed keys, then the keys twice), exact in its
    gradients too (Note [A differentiable log-sum-exp])."""
    q, k, v = _leaves(2, case["nq"], case["heads"], case["kv"], nk=case["nk"], seed=5)
    gates = _gates(q) if combine == "gates" else None
    kw = _nsa_kwargs(case)
    out = nsa_attention(q, k, v, gates, combine=combine, **kw)
    ref = nsa_reference(q, k, v, gates, **kw)
    _assert_same_with_gradients(out, ref, [q, k, v] + ([gates] if gates is not None else []))


@pytest.mark.parametrize("case", NSA_CASES.values(), ids=NSA_CASES.keys())
def test_nsa_without_gradients_adds_each_branch_as_it_comes(
    case: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inference (no gradient recorded): each branch's output is added to the gated sum before
    the next branch runs (one branch output held besides the sum), the compressed branch first;
    the bits of the gated sum training computes in that order, and to rounding what training
    computes in its own; the reference agrees."""
    q, k, v = (x.detach().bfloat16() for x in _leaves(2, case["nq"], case["heads"], case["kv"],
                                                      nk=case["nk"], seed=6))  # fmt: skip
    gates = _gates(q.double()).detach().bfloat16()
    kw = _nsa_kwargs(case)
    outputs: list[weakref.ref[Tensor]] = []
    alive: list[int] = []  # earlier branch outputs still held as each branch starts
    orders: list[Any] = []
    real = nsa_module.gated_sum_of

    def spy(calls: list[Any], g: Tensor, order: Any) -> Tensor:
        orders.append(tuple(order))

        def counted(call: Any) -> Any:
            def run() -> Tensor:
                alive.append(sum(ref() is not None for ref in outputs))
                out = call()
                outputs.append(weakref.ref(out))
                return out

            return run

        return real([counted(call) for call in calls], g, order)

    monkeypatch.setattr(nsa_module, "gated_sum_of", spy)
    with torch.no_grad():
        streamed = nsa_attention(q, k, v, gates, **kw)
    assert alive == [0, 1, 1]  # the sum (the first output, scaled in place) and nothing else
    assert orders == [(0, 1, 2)]  # compressed, selected, window
    monkeypatch.setattr(nsa_module, "JOIN_ORDER", (0, 1, 2))
    same_order = nsa_attention(*(x.clone().requires_grad_() for x in (q, k, v)), gates, **kw)
    assert torch.equal(streamed, same_order.detach())
    monkeypatch.undo()
    trained = nsa_attention(*(x.requires_grad_() for x in (q, k, v)), gates, **kw)
    torch.testing.assert_close(streamed, trained.detach(), atol=8e-3, rtol=1.6e-2)
    ref = nsa_reference(*(x.double() for x in (q, k, v)), gates.double(), **kw)
    torch.testing.assert_close(streamed.double(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("combine", ["gates", "lse"])
def test_nsa_training_runs_the_compressed_branch_backward_first(
    combine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With gradients the compressed branch (which saves the most) joins last, so that autograd
    runs its backward first and frees what it saved before the other branches' backwards, and
    each branch's backward starts before the next branch's gradient is made (Note [Branches
    joined as they come]); the result still matches the reference."""
    case = NSA_CASES["causal-gqa-odd"]
    q, k, v = _leaves(2, case["nq"], case["heads"], case["kv"], nk=case["nk"], seed=7)
    gates = _gates(q) if combine == "gates" else None
    nodes: dict[str, Any] = {}
    for name in ("compressed", "selected", "window"):
        real = getattr(nsa_module, f"{name}_branch")

        def spy(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            out, lse = _real(*args, **kwargs)
            nodes[_name] = out.grad_fn
            return out, lse

        monkeypatch.setattr(nsa_module, f"{name}_branch", spy)
    kw = _nsa_kwargs(case)
    out = nsa_attention(q, k, v, gates, combine=combine, **kw)
    events: list[str] = []
    watch(out, nodes, events)
    ref = nsa_reference(q, k, v, gates, **kw)
    _assert_same_with_gradients(out, ref, [q, k, v] + ([gates] if gates is not None else []))
    assert backward_order(events)[0] == "compressed", events
    # The merge's first step joins two branches (window and selected), so two there.
    assert most_pending(events) == (1 if combine == "gates" else 2), events


def test_nsa_training_keeps_no_put_back_compressed_output() -> None:
    """With gates the compressed branch gates its classes' outputs as it puts them back (Note
    [A branch that gates its own rows]): what autograd keeps for the backward holds the
    query-sized tensors of the query and of the selected and window branches' outputs, not
    one more for the compressed branch's rows (its classes' outputs are its call's own);
    values and gradients still match the reference."""
    case = NSA_CASES["causal-gqa-odd"]
    q, k, v = _leaves(2, case["nq"], case["heads"], case["kv"], nk=case["nk"], seed=8)
    gates = _gates(q)
    kept: dict[int, int] = {}

    def pack(x: Tensor) -> Tensor:
        storage = x.untyped_storage()
        kept[storage.data_ptr()] = storage.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = nsa_attention(q, k, v, gates, **_nsa_kwargs(case))
    assert sorted(kept.values()).count(q.nbytes) == 3, kept  # q, o_selected, o_window
    ref = nsa_reference(q, k, v, gates, **_nsa_kwargs(case))
    _assert_same_with_gradients(out, ref, [q, k, v, gates])


def test_nsa_compressed_keys_get_gradients_through_their_pooling() -> None:
    """Only the compressed branch gated on: the keys' and values' gradients are the pooling's
    (every position of a window gets a share), as in the reference."""
    q, k, v = _leaves(1, 24, 2, 2, seed=9)
    gates = torch.zeros(*q.shape[:3], 3, dtype=F64)
    gates[..., 0] = 1.0
    kw = dict(compress_block=4, compress_stride=2, select_block=8, topk=1, window=3)
    out = nsa_attention(q, k, v, gates, **kw)
    dk = torch.autograd.grad(out.sum(), k, retain_graph=True)[0]
    assert bool((dk.abs().sum(-1) > 0).all())  # every position is in a window some query sees
    ref = nsa_reference(q, k, v, gates, is_causal=True, **kw)
    _assert_same_with_gradients(out, ref, [q, k, v])


# -- bad input ------------------------------------------------------------------------------------
@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any work (the selection, a pooling, an attention call) fails the test: every bad
    argument must raise before."""

    def work(*args: object, **kwargs: object) -> None:
        raise AssertionError("work started before the arguments were checked")

    for module, name in ((selection_module, "_select"), (moba_module, "block_sparse_attention"),
                         (nsa_module, "compress_kv"), (nsa_module, "attention"),
                         (nsa_module, "block_sparse_attention")):  # fmt: skip
        monkeypatch.setattr(module, name, work)


def _moba_call(**change: Any) -> None:
    q, k, v = (x.detach() for x in _leaves(1, 16, 2, 2))
    args = dict(query=q, key=k, value=v, block_size=8, topk=1, is_causal=True)
    args.update(change)
    moba_attention(args.pop("query"), args.pop("key"), args.pop("value"), **args)


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize(
    ("change", "error", "name"),
    [
        (dict(query=[1.0]), TypeError, "query"),
        (dict(key=torch.zeros(1, 16, 2, 8)), TypeError, "key"),
        (dict(value=torch.zeros(1, 15, 2, 8, dtype=F64)), ValueError, "value"),
        (dict(block_size=0), ValueError, "block_size"),
        (dict(block_size=8.0), TypeError, "block_size"),
        (dict(topk=-1), ValueError, "topk"),
        (dict(topk=0, is_causal=False), ValueError, "topk"),
        (dict(topk="2"), TypeError, "topk"),
        (dict(is_causal=1), TypeError, "is_causal"),
        (dict(cu_seqlens=[0, 4, 16]), ValueError, "block_size"),
        (dict(cu_seqlens=[0, 3]), ValueError, "cu_seqlens"),
        (dict(scale=-1.0), ValueError, "scale"),
        (dict(backend="nope"), ValueError, "backend"),
    ],
    ids=lambda x: str(x) if isinstance(x, str) else None,
)
def test_moba_bad_arguments_raise_before_any_work(
    change: dict[str, Any], error: type[Exception], name: str
) -> None:
    with pytest.raises(error, match=name):
        _moba_call(**change)


def _nsa_call(**change: Any) -> None:
    q, k, v = (x.detach() for x in _leaves(1, 16, 2, 2))
    args: dict[str, Any] = dict(
        query=q, key=k, value=v, gates=torch.full((1, 16, 2, 3), 0.5, dtype=F64),
        compress_block=4, compress_stride=2, select_block=8, topk=1, window=4, is_causal=True,
    )  # fmt: skip
    args.update(change)
    nsa_attention(args.pop("query"), args.pop("key"), args.pop("value"), args.pop("gates"),
                  **args)  # fmt: skip


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize(
    ("change", "error", "name"),
    [
        (dict(query=None), TypeError, "query"),
        (dict(key=torch.zeros(1, 16, 3, 8, dtype=F64)), ValueError, "key"),
        (dict(value=torch.zeros(1, 16, 2, 8, dtype=torch.float32)), TypeError, "value"),
        (dict(gates=None), TypeError, "gates"),
        (dict(gates=torch.zeros(1, 16, 2, 2, dtype=F64)), ValueError, "gates"),
        (dict(gates=torch.zeros(1, 16, 2, 3)), TypeError, "gates"),
        (dict(combine="lse"), ValueError, "gates"),
        (dict(combine="sum"), ValueError, "combine"),
        (dict(combine=None), TypeError, "combine"),
        (dict(compress_block=0), ValueError, "compress_block"),
        (dict(compress_stride=5), ValueError, "compress_stride"),
        (dict(compress_stride=1.5), ValueError, "compress_stride"),
        (dict(select_block=-8), ValueError, "select_block"),
        (dict(topk=-2), ValueError, "topk"),
        (dict(topk=0, is_causal=False), ValueError, "topk"),
        (dict(window=0), ValueError, "window"),
        (dict(window="4"), ValueError, "window"),
        (dict(is_causal="no"), TypeError, "is_causal"),
        (dict(scale=0.0), ValueError, "scale"),
        (dict(backend=3), TypeError, "backend"),
    ],
    ids=lambda x: str(x) if isinstance(x, str) else None,
)
def test_nsa_bad_arguments_raise_before_any_work(
    change: dict[str, Any], error: type[Exception], name: str
) -> None:
    with pytest.raises(error, match=name):
        _nsa_call(**change)


@pytest.mark.usefixtures("no_work")
def test_nsa_lengths_checked_before_any_work() -> None:
    """A causal query longer than the key, and a non-causal one of another length (the window
    is centred on the query's own position), raise before any work."""
    q, k, v = (x.detach() for x in _leaves(1, 16, 2, 2, nk=12))
    kw = dict(compress_block=4, compress_stride=2, select_block=8, topk=1, window=4)
    with pytest.raises(ValueError, match="query cannot be longer"):
        nsa_attention(q, k, v, None, combine="lse", **kw)
    with pytest.raises(ValueError, match="is_causal=False needs a query for every key"):
        nsa_attention(q, k, v, None, combine="lse", is_causal=False, **kw)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(softcap=-1.0), r"softcap must be a positive finite float"),
        (dict(sinks=torch.zeros(3)), r"sinks"),
    ],
)
def test_moba_rejects_a_bad_softcap_or_sinks_before_choosing_blocks(
    monkeypatch: pytest.MonkeyPatch, options: dict, match: str
) -> None:
    """A bad soft-cap or sinks is named before any work: the selection never runs."""
    import dilated_attention.sparse.moba as moba_module

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("select_blocks ran before the arguments were checked")

    monkeypatch.setattr(moba_module, "select_blocks", never)
    q = torch.randn(1, 16, 4, 8)
    with pytest.raises(ValueError, match=match):
        moba_attention(q, q[:, :, :2], q[:, :, :2], block_size=8, topk=1, **options)
