"""Packed documents (``cu_seqlens``): a packed batch equals each document run alone.

Note [Packed documents] in ``core/geometry/documents.py``: every document is segmented from its own
first token and attends only within itself. The float64 oracle is block-diagonal: each document's
dilated multiplicity (``tests/support/oracle.py``, built for the document's length alone) on
the diagonal, nothing between documents. Outputs, lse and dq, dk, dv are compared on every
backend that runs the inputs, causal and not, with GQA, a key padding mask, and documents of 1
token, shorter than the smallest segment, between, longer than the largest, odd.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from support.backend_params import DEVICE_BACKENDS, compiling_in_one_worker
from support.block_sparse import token_mask
from support.grouping import cut_small
from support.oracle import dilated_multiplicity, masked_attention
from support.triton import KERNEL_DEVICES, skip_without_triton
from torch import Tensor

from dilated_attention import (
    DilatedKVCache,
    StaticDilatedKVCache,
    attention,
    block_sparse_attention,
    dilated_attention,
)
from dilated_attention.backends import KernelInputs
from dilated_attention.backends.registry import registry_for
from dilated_attention.backends.triton import TritonBackend
from dilated_attention.patterns import DilatedBlocks, LocalWindow

H, HKV, D = 4, 2, 16
EXACT = {"atol": 0.0, "rtol": 0.0}
#: Dense kernels run packed block-sparse plans (the block-sparse kernels refuse packed rows).
PACKED_BACKENDS = compiling_in_one_worker(DEVICE_BACKENDS, "packed")
BLOCK_SPARSE_BACKENDS = [p for p in PACKED_BACKENDS if p.values[1] not in ("triton",)]
SEGS, RATES = (8, 16, 32), (1, 2, 4)
#: name: documents of each row (every row holds the same number of positions).
LAYOUTS = {
    "one-row": [[1, 5, 17, 40, 9, 3]],
    "two-rows": [[3, 30, 7, 35], [75]],
    "one-document": [[64]],
}


def _offsets(layout: list[list[int]]) -> list[int]:
    return [0, *itertools.accumulate(n for row in layout for n in row)]


def _multiplicity(layout: list[list[int]], is_causal: bool, dilated: bool) -> Tensor:
    """(B, H, N, N) block-diagonal weights: each document's own, as if alone."""
    rows = []
    for row in layout:
        n = sum(row)
        m = torch.zeros(H, n, n, dtype=torch.float64)
        start = 0
        for length in row:
            if dilated:
                block = dilated_multiplicity(length, H, SEGS, RATES, is_causal=is_causal)
            else:
                block = torch.ones(H, length, length, dtype=torch.float64)
                if is_causal:
                    block = block.tril()
            m[:, start : start + length, start : start + length] = block
            start += length
        rows.append(m)
    return torch.stack(rows)


def _oracle(q, k, v, dout, weights, mask) -> list[Tensor]:
    """out, lse and dq, dk, dv of the float64 oracle, row by row (each its own weights)."""
    results = []
    for b in range(q.shape[0]):
        leaves = [x[b : b + 1].double().detach().requires_grad_() for x in (q, k, v)]
        row_mask = None if mask is None else mask[b : b + 1]
        out, lse = masked_attention(*leaves, weights[b], key_padding_mask=row_mask)
        grads = torch.autograd.grad(out, leaves, dout[b : b + 1].double())
        results.append([out.detach(), lse.detach(), *grads])
    return [torch.cat(parts) for parts in zip(*results, strict=True)]


def _inputs(layout, device: str, dtype: torch.dtype, masked: bool):
    gen = torch.Generator().manual_seed(3)
    n, batch = sum(layout[0]), len(layout)
    d = D if device == "cpu" else 64  # FlashAttention-4's sm90 backward needs >= 32
    q = torch.randn(batch, n, H, d, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, n, HKV, d, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, n, HKV, d, generator=gen, dtype=torch.float64)
    dout = torch.randn(batch, n, H, d, generator=gen, dtype=torch.float64)
    mask = (torch.rand(batch, n, generator=gen) < 0.2) if masked else None
    # Round to the call's dtype first: the oracle sees what the kernels see.
    q, k, v, dout = (x.to(dtype).double() for x in (q, k, v, dout))
    dev = [x.to(device, dtype).requires_grad_() for x in (q, k, v)]
    return q, k, v, dout, mask, dev


def _check(got: list[Tensor], want: list[Tensor], dtype: torch.dtype, what: str) -> None:
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        g = g.detach().double().cpu()
        finite = torch.isfinite(w)
        assert torch.equal(finite, torch.isfinite(g)), f"{what} {name}: -inf rows differ"
        scale = float(w[finite].abs().max()) if finite.any() else 1.0
        atol, rtol = (1e-10, 1e-8) if dtype == torch.float64 else (3e-2 * scale, 3e-2)
        torch.testing.assert_close(g[finite], w[finite], atol=atol, rtol=rtol,
                                   msg=lambda m, n=name: f"{what} {n}: {m}")  # fmt: skip


def _run_or_skip(backend: str | None, call: Callable[[], Any]) -> Any:
    """``call()``; a skip where the named ``backend`` refuses these inputs (its reasons)."""
    try:
        return call()
    except ValueError as error:
        if backend is not None and "cannot run these inputs" in str(error):
            pytest.skip(f"{backend}: {error}")
        raise


def _dtype(device: str) -> torch.dtype:
    return torch.float64 if device == "cpu" else torch.bfloat16


@pytest.mark.parametrize(("device", "backend"), PACKED_BACKENDS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("masked", [False, True], ids=["", "masked"])
def test_packed_dilated_equals_each_document_alone(device, backend, layout, is_causal, masked):
    docs, dtype = LAYOUTS[layout], _dtype(device)
    q, k, v, dout, mask, dev = _inputs(docs, device, dtype, masked)
    dev_mask = None if mask is None else mask.to(device)
    out, lse = _run_or_skip(backend, lambda: dilated_attention(
        *dev, SEGS, RATES, is_causal=is_causal, key_padding_mask=dev_mask, backend=backend,
        return_lse=True, cu_seqlens=torch.tensor(_offsets(docs)),
    ))  # fmt: skip
    grads = torch.autograd.grad(out, dev, dout.to(device, dtype))
    want = _oracle(q, k, v, dout, _multiplicity(docs, is_causal, dilated=True), mask)
    _check([out, lse, *grads], want, dtype, f"{layout} {backend}")


@pytest.mark.parametrize(("device", "backend"), PACKED_BACKENDS)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_packed_attention_sees_only_its_document(device, backend, is_causal):
    docs, dtype = LAYOUTS["two-rows"], _dtype(device)
    q, k, v, dout, mask, dev = _inputs(docs, device, dtype, masked=False)
    out, lse = _run_or_skip(backend, lambda: attention(
        *dev, is_causal=is_causal, backend=backend, return_lse=True, cu_seqlens=_offsets(docs)
    ))  # fmt: skip
    grads = torch.autograd.grad(out, dev, dout.to(device, dtype))
    want = _oracle(q, k, v, dout, _multiplicity(docs, is_causal, dilated=False), mask)
    _check([out, lse, *grads], want, dtype, f"attention {backend}")


def test_packed_call_equals_the_unpacked_calls_exactly() -> None:
    """The same kernels on the same rows: bit for bit what each document gives alone."""
    docs = LAYOUTS["one-row"][0]
    *_, dev = _inputs([docs], "cpu", torch.float32, masked=False)
    out = dilated_attention(*dev, SEGS, RATES, is_causal=True, cu_seqlens=_offsets([docs]))
    offsets = _offsets([docs])
    alone = [
        dilated_attention(*(x[:, a:b] for x in dev), SEGS, RATES, is_causal=True)
        for a, b in itertools.pairwise(offsets)
    ]
    assert torch.equal(out, torch.cat(alone, dim=1))


def test_the_fused_kernels_take_packed_documents() -> None:
    inputs = KernelInputs(torch.device("cpu"), torch.float32, 64, 4, 4, 128, 128,
                          documents=True)  # fmt: skip
    reasons = registry_for("dilated").reasons("triton", inputs)
    assert not any("packed documents" in reason for reason in reasons), reasons


#: Documents across several position groups of the fused engine, several in one group too.
FUSED_LAYOUT = [[1, 7, 70, 33, 8, 100, 2, 35]]


@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("masked", [False, True], ids=["", "masked"])
def test_packed_fused_kernels_equal_each_document_alone(
    device, dtypes, is_causal, masked, monkeypatch
):
    """Our fused kernels read each branch's segments from a table (Note [Packed documents in
    the fused engine]): with position groups cut small, documents span groups and groups hold
    several documents; outputs and gradients still equal each document alone."""
    skip_without_triton(device)
    cut_small(monkeypatch)
    dtype = dtypes[0]
    q, k, v, dout, mask, dev = _inputs(FUSED_LAYOUT, device, dtype, masked)
    dev_mask = None if mask is None else mask.to(device)
    out, lse = dilated_attention(
        *dev, SEGS, RATES, is_causal=is_causal, key_padding_mask=dev_mask, backend="triton",
        return_lse=True, cu_seqlens=_offsets(FUSED_LAYOUT),
    )  # fmt: skip
    grads = torch.autograd.grad(out, dev, dout.to(device, dtype))
    want = _oracle(q, k, v, dout, _multiplicity(FUSED_LAYOUT, is_causal, dilated=True), mask)
    _check([out, lse, *grads], want, dtype, f"fused {device}")


@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_packed_fused_kernels_launch_once_per_branch(device, dtypes, monkeypatch):
    """However many documents: one forward launch per branch (one position group, one head
    group at this size), the rate-1 branch's writing the output."""
    skip_without_triton(device)
    launches: list[int] = []
    real = TritonBackend.forward_branch

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        launches.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(TritonBackend, "forward_branch", counted)
    for layout in (FUSED_LAYOUT, [[2] * 128], [[256]]):
        *_, dev = _inputs(layout, device, dtypes[0], masked=False)
        with torch.no_grad():
            for _ in range(2):  # the first call of a shape family also compiles it ahead
                launches.clear()
                dilated_attention(*dev, SEGS, RATES, backend="triton", cu_seqlens=_offsets(layout))
        assert len(launches) == len(SEGS), (layout, len(launches))


N_BAD = 10


@pytest.mark.parametrize(
    ("cu_seqlens", "error", "match"),
    [
        ([0, 4, 10], None, None),
        (torch.tensor([0, 4, 10], dtype=torch.int32), None, None),
        ([1, 4, 10], ValueError, r"start at 0 and end at B \* N = 1 \* 10 = 10"),
        ([0, 4, 9], ValueError, r"start at 0 and end at B \* N"),
        ([0, 4, 4, 10], ValueError, "strictly increasing.*got 4 then 4"),
        ([0, 6, 4, 10], ValueError, "strictly increasing.*got 6 then 4"),
        ([10], ValueError, "start at 0"),
        (torch.tensor([0.0, 10.0]), TypeError, "must hold ints.*torch.float32"),
        (torch.tensor([[0, 10]]), ValueError, "must be 1-D"),
        ([0, 4.5, 10], TypeError, "must hold ints, got 4.5"),
        ([0, True, 10], TypeError, "must hold ints, got True"),
        ("0,10", TypeError, "a 1-D int tensor or a sequence of ints, got str"),
        (torch.tensor([0, 10], device="meta"), ValueError, "on meta and the tensors on cpu"),
    ],
)
def test_bad_cu_seqlens_is_a_clear_error(cu_seqlens, error, match) -> None:
    q = torch.randn(1, N_BAD, H, D)
    k = v = torch.randn(1, N_BAD, HKV, D)
    if error is None:
        dilated_attention(q, k, v, SEGS, RATES, cu_seqlens=cu_seqlens)
        return
    with pytest.raises(error, match=match):
        dilated_attention(q, k, v, SEGS, RATES, cu_seqlens=cu_seqlens)
    with pytest.raises(error, match=match):
        attention(q, k, v, cu_seqlens=cu_seqlens)


@pytest.mark.parametrize("cu_seqlens", [[0], torch.tensor([0], dtype=torch.int32)],
                         ids=["list", "tensor"])  # fmt: skip
def test_an_empty_batch_packs_no_documents_and_gives_empty_results(cu_seqlens) -> None:
    """A batch of 0 sequences: offsets [0] (no document) give what the unpacked empty batch
    gives, as every function does for B = 0 (Note [An empty packed batch])."""
    q = torch.randn(0, N_BAD, H, D, requires_grad=True)
    k = v = torch.randn(0, N_BAD, HKV, D)
    calls: dict[str, Callable[..., Any]] = {
        "dilated": lambda **kw: dilated_attention(q, k, v, SEGS, RATES, is_causal=True, **kw),
        "dense": lambda **kw: attention(q, k, v, **kw),
        "block-sparse": lambda **kw: block_sparse_attention(q, k, v, LocalWindow(1),
                                                            block_size=4, **kw),
    }
    for name, call in calls.items():
        out, lse = call(cu_seqlens=cu_seqlens, return_lse=True)
        want, want_lse = call(return_lse=True)
        for got, expected in ((out, want), (lse, want_lse)):
            assert (got.shape, got.dtype) == (expected.shape, expected.dtype), name
        (grad,) = torch.autograd.grad(out.sum(), q)
        assert grad.shape == q.shape, name
    cache = DilatedKVCache(SEGS, RATES)  # a packed prompt: each row's whole (empty) length
    out = dilated_attention(q, k, v, SEGS, RATES, is_causal=True, cache=cache, cu_seqlens=[0])
    assert out.shape == q.shape and cache.length == N_BAD


@pytest.mark.parametrize("cu_seqlens", [[0, 0], [0, 10], []], ids=["empty-document", "10", "none"])
def test_an_empty_batch_with_documents_is_a_clear_error(cu_seqlens) -> None:
    q = torch.randn(0, N_BAD, H, D)
    k = v = torch.randn(0, N_BAD, HKV, D)
    match = r"a batch of 0 sequences holds no documents, so its cu_seqlens is \[0\].*got "
    with pytest.raises(ValueError, match=match + re.escape(str(cu_seqlens))):
        dilated_attention(q, k, v, SEGS, RATES, cu_seqlens=cu_seqlens)
    with pytest.raises(ValueError, match=match):
        attention(q, k, v, cu_seqlens=cu_seqlens)


def test_a_document_crossing_rows_is_refused() -> None:
    q = torch.randn(2, 10, H, D)
    k = v = torch.randn(2, 10, HKV, D)
    with pytest.raises(ValueError, match=r"crosses from row 0 into row 1.*missing 10"):
        dilated_attention(q, k, v, SEGS, RATES, cu_seqlens=[0, 4, 15, 20])
    dilated_attention(q, k, v, SEGS, RATES, cu_seqlens=[0, 4, 10, 15, 20])


@pytest.mark.parametrize("kind", [DilatedKVCache, StaticDilatedKVCache], ids=lambda k: k.__name__)
@pytest.mark.parametrize("masked", [False, True], ids=["", "masked"])
@pytest.mark.parametrize("layout", [[[1, 5, 17, 40]], [[3, 17, 16], [20, 16]]], ids=["one", "two"])
def test_a_packed_prompt_continues_each_rows_last_document(layout, masked, kind) -> None:
    """Note [A packed prompt]: the prompt's output is the packed call's, and the cache then
    holds each row's last document, so tokens decoded after it get what they get after that
    document alone (exactly with a growing cache; a static cache's one call per token sums in
    another order)."""
    gen = torch.Generator().manual_seed(5)
    batch, n, last = len(layout), sum(layout[0]), layout[0][-1]
    q, k, v = (torch.randn(batch, n, h, D, generator=gen) for h in (H, HKV, HKV))
    mask = (torch.rand(batch, n, generator=gen) < 0.2) if masked else None
    packed, alone = kind(SEGS, RATES), DilatedKVCache(SEGS, RATES)
    out = dilated_attention(q, k, v, SEGS, RATES, is_causal=True, key_padding_mask=mask,
                            cu_seqlens=_offsets(layout), cache=packed)  # fmt: skip
    want = dilated_attention(q, k, v, SEGS, RATES, is_causal=True, key_padding_mask=mask,
                             cu_seqlens=_offsets(layout))  # fmt: skip
    assert torch.equal(out, want)
    tail = slice(n - last, None)
    tail_mask = None if mask is None else mask[:, tail]
    dilated_attention(q[:, tail], k[:, tail], v[:, tail], SEGS, RATES, is_causal=True,
                      key_padding_mask=tail_mask, cache=alone)  # fmt: skip
    assert packed.length == alone.length == last
    for _ in range(4):
        new = [torch.randn(batch, 1, h, D, generator=gen) for h in (H, HKV, HKV)]
        with torch.no_grad():
            got = dilated_attention(*new, SEGS, RATES, is_causal=True, cache=packed)
            want = dilated_attention(*new, SEGS, RATES, is_causal=True, cache=alone)
        torch.testing.assert_close(got, want, **({} if kind is StaticDilatedKVCache else EXACT))


def test_a_packed_prompt_is_refused_before_any_work() -> None:
    q = torch.randn(1, 2, H, D)
    k = v = torch.randn(1, 10, HKV, D)
    with pytest.raises(ValueError, match="query of the key's length"):
        dilated_attention(q, k, v, SEGS, RATES, is_causal=True, cu_seqlens=[0, 4, 10])
    cache = DilatedKVCache(SEGS, RATES)
    q = torch.randn(1, 10, H, D)
    k = v = torch.randn(1, 10, HKV, D)
    dilated_attention(q, k, v, SEGS, RATES, is_causal=True, cache=cache)
    with pytest.raises(ValueError, match="caches must be empty, got one holding 10 positions"):
        dilated_attention(q, k, v, SEGS, RATES, is_causal=True, cache=cache, cu_seqlens=[0, 10])
    assert cache.length == 10
    fresh = DilatedKVCache(SEGS, RATES)
    q2, k2 = torch.randn(2, 10, H, D), torch.randn(2, 10, HKV, D)
    with pytest.raises(ValueError, match=r"one length in every row .* got \[6, 10\]"):
        dilated_attention(q2, k2, k2, SEGS, RATES, is_causal=True, cache=fresh,
                          cu_seqlens=[0, 4, 10, 20])  # fmt: skip
    with pytest.raises(ValueError, match="is_causal"):
        dilated_attention(q, k, v, SEGS, RATES, cache=fresh, cu_seqlens=[0, 10])
    assert fresh.length == 0


def test_packed_documents_under_torch_func_raise() -> None:
    q = torch.randn(1, 10, H, D)
    k = v = torch.randn(1, 10, HKV, D)

    def loss(q: Tensor) -> Tensor:
        return dilated_attention(q, k, v, SEGS, RATES, cu_seqlens=[0, 4, 10]).sum()

    with pytest.raises(ValueError, match=r"cu_seqlens is not supported under torch\.compile"):
        torch.func.grad(loss)(q)


@pytest.mark.parametrize(("device", "backend"), BLOCK_SPARSE_BACKENDS)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_packed_block_sparse_keeps_blocks_inside_documents(device, backend, is_causal):
    """Each document's blocks count from its own first token; no block pair crosses
    documents: the oracle's weights are each document's own token mask on the diagonal."""
    docs, dtype = LAYOUTS["two-rows"], _dtype(device)
    pattern, size = LocalWindow(1) | DilatedBlocks(2), 4
    q, k, v, dout, _, dev = _inputs(docs, device, dtype, masked=False)
    out, lse = _run_or_skip(backend, lambda: block_sparse_attention(
        *dev, pattern, block_size=size, is_causal=is_causal, backend=backend, return_lse=True,
        cu_seqlens=_offsets(docs),
    ))  # fmt: skip
    grads = torch.autograd.grad(out, dev, dout.to(device, dtype))
    weights = torch.zeros(len(docs), H, sum(docs[0]), sum(docs[0]), dtype=torch.float64)
    for b, row in enumerate(docs):
        for a, e in itertools.pairwise([0, *itertools.accumulate(row)]):
            block = token_mask(pattern, size, e - a, e - a, is_causal).to(torch.float64)
            weights[b, :, a:e, a:e] = block
    want = _oracle(q, k, v, dout, weights, None)
    _check([out, lse, *grads], want, dtype, f"block-sparse {backend}")


def test_block_sparse_kernels_refuse_packed_documents_by_name() -> None:
    q = torch.randn(1, 16, H, D)
    k = v = torch.randn(1, 16, HKV, D)
    inputs = KernelInputs(torch.device("cpu"), torch.float32, D, H, HKV, 16, 16,
                          block_size=4, documents=True)  # fmt: skip
    for name in ("triton", "flex", "flash_attn4"):
        reasons = registry_for("block_sparse").reasons(name, inputs)
        assert any("packed documents" in reason for reason in reasons), (name, reasons)
    with pytest.raises(ValueError, match="packed documents"):
        block_sparse_attention(q, k, v, LocalWindow(1), block_size=4, backend="triton",
                               cu_seqlens=[0, 5, 16])  # fmt: skip


def test_packed_second_order_gradients_equal_each_document_alone() -> None:
    offsets = _offsets(LAYOUTS["one-row"])
    *_, dev = _inputs(LAYOUTS["one-row"], "cpu", torch.float64, masked=False)

    def second_order(packed: bool) -> tuple[Tensor, ...]:
        if packed:
            out = dilated_attention(*dev, SEGS, RATES, is_causal=True, cu_seqlens=offsets)
        else:
            out = torch.cat([
                dilated_attention(*(x[:, a:b] for x in dev), SEGS, RATES, is_causal=True)
                for a, b in itertools.pairwise(offsets)
            ], dim=1)  # fmt: skip
        (dq,) = torch.autograd.grad(out.pow(2).sum(), dev[0], create_graph=True)
        return torch.autograd.grad(dq.pow(2).sum(), dev)

    for got, want in zip(second_order(True), second_order(False), strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


def test_a_gathered_calls_key_mask_reaches_fa4_with_one_stride_1_dimension() -> None:
    """A dense row group's key mask is a view with stride 1 on its size-1 head dimension too;
    FlashAttention-4's CuTe DSL refused such an aux tensor ("no unique stride-1 leading
    dimension") on packed masked calls, and a one-key call's mask has stride 1 everywhere.
    Its aux tensor has row-major strides and names its key dimension as the stride-1 one."""
    from dilated_attention.backends.flash_attn4 import aux_mask
    from dilated_attention.core.geometry.segment import GroupCall, plan_branches

    (group,) = plan_branches(12, 2, (4,), (1,))
    key_mask = GroupCall(group, 2, torch.device("cpu"), False).key_mask(torch.zeros(1, 12) > 0)
    assert key_mask.shape == (3, 1, 4) and key_mask.stride().count(1) == 2  # the view
    aux = aux_mask(key_mask)
    assert aux.dtype == torch.int32 and aux.stride() == (4, 4, 1) and aux.__leading_dim__ == 2
    assert torch.equal(aux.bool(), key_mask)
    one_key = aux_mask(torch.zeros(3, 1, 1, dtype=torch.bool))  # a document of one token
    assert one_key.stride() == (1, 1, 1) and one_key.__leading_dim__ == 2
