"""Local windows, soft-capped scores and attention sinks against the float64 oracle: outputs,
lse and every gradient (the sinks' too), on every CPU kernel that takes them, for dense,
dilated and block-sparse attention, packed documents, key padding, GQA, end-aligned queries and
decoding; kernels that cannot apply them refuse by reason; bad values are clear errors."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from support.backend_params import CPU_BACKENDS, backend_id, skip_unless_runnable
from support.oracle import (
    dilated_multiplicity,
    masked_attention,
    oracle_attention,
    oracle_dilated_attention,
)
from support.tolerances import assert_close_to_oracle

from dilated_attention import (
    DilatedKVCache,
    StaticDilatedKVCache,
    attention,
    block_sparse_attention,
    dilated_attention,
)
from dilated_attention.backends import get_backend
from dilated_attention.patterns import LocalWindow

WINDOWS = [None, (4, 0), (3, 2), (-1, 5), (0, 0)]


def _inputs(b: int, nq: int, nk: int, h: int, hkv: int, d: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, nq, h, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, nk, hkv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, nk, hkv, d, generator=gen, dtype=torch.float64)
    sinks = torch.randn(h, generator=gen, dtype=torch.float64)
    dout = torch.randn(b, nq, h, d, generator=gen, dtype=torch.float64)
    return q, k, v, sinks, dout


def _leaves(*xs: torch.Tensor | None, dtype: torch.dtype) -> list[torch.Tensor | None]:
    return [None if x is None else x.to(dtype).requires_grad_() for x in xs]


def _check(
    got: tuple[torch.Tensor, torch.Tensor],
    want: tuple[torch.Tensor, torch.Tensor],
    ins: list[torch.Tensor | None],
    ins64: list[torch.Tensor | None],
    dout: torch.Tensor,
    dtype: torch.dtype,
) -> None:
    """Outputs, lse and the gradients of every given input against the oracle's."""
    (out, lse), (want_out, want_lse) = got, want
    assert_close_to_oracle(out, want_out, name="out", dtype=dtype)
    assert_close_to_oracle(lse, want_lse, name="lse", dtype=dtype)
    leaves = [x for x in ins if x is not None]
    leaves64 = [x for x in ins64 if x is not None]
    grads = torch.autograd.grad(out, leaves, dout.to(dtype))
    want_grads = torch.autograd.grad(want_out, leaves64, dout)
    names = ["dq", "dk", "dv", "dsinks"]
    for name, g, w in zip(names, grads, want_grads, strict=False):
        assert g.dtype == (w.dtype if dtype == torch.float64 else dtype)
        assert_close_to_oracle(g, w, name=name, dtype=dtype, grad=True)


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("softcap", [None, 1.5], ids=["nocap", "cap"])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["nosink", "sink"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_dense_against_oracle(window, softcap, with_sinks, is_causal) -> None:
    """Dense attention, GQA, an odd length, every combination, float64."""
    q, k, v, sinks, dout = _inputs(2, 23, 23, 4, 2, 8, torch.float64)
    sinks = sinks if with_sinks else None
    ins = _leaves(q, k, v, sinks, dtype=torch.float64)
    got = attention(
        *ins[:3], is_causal=is_causal, window_size=window, softcap=softcap, sinks=ins[3],
        return_lse=True,
    )  # fmt: skip
    ins64 = _leaves(q, k, v, sinks, dtype=torch.float64)
    want = oracle_attention(
        *ins64[:3], is_causal=is_causal, window_size=window, softcap=softcap, sinks=ins64[3]
    )
    _check(got, want, ins, ins64, dout, torch.float64)


@pytest.mark.parametrize("backend", CPU_BACKENDS, ids=backend_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_every_cpu_kernel(backend: str | None, dtype: torch.dtype) -> None:
    """Each CPU kernel either computes window + softcap + sinks with a padding mask exactly, or
    refuses them by name with its reasons (never ignores them)."""
    q, k, v, sinks, dout = _inputs(2, 19, 19, 4, 1, 8, dtype)
    mask = torch.zeros(2, 19, dtype=torch.bool)
    mask[1, 3:7] = True
    options = dict(is_causal=True, window_size=(5, 0), softcap=2.0, key_padding_mask=mask)
    # Refused for another reason (a dtype, say): nothing to learn about these options here.
    skip_unless_runnable(backend, q.to(dtype), k.to(dtype), v.to(dtype), is_causal=True,
                         key_padding_mask=mask)  # fmt: skip
    takes = backend is None or (
        get_backend(backend).supports_window and get_backend(backend).supports_softcap
    )
    ins = _leaves(q, k, v, sinks, dtype=dtype)
    if not takes:
        with pytest.raises(ValueError, match=r"soft-capping|local window"):
            attention(*ins[:3], sinks=ins[3], backend=backend, **options)
        return
    got = attention(*ins[:3], sinks=ins[3], backend=backend, return_lse=True, **options)
    ins64 = _leaves(q, k, v, sinks, dtype=torch.float64)
    want = oracle_attention(*ins64[:3], sinks=ins64[3], **options)
    _check(got, want, ins, ins64, dout, dtype)


@pytest.mark.parametrize("nq", [1, 4, 9], ids=lambda n: f"nq{n}")
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_short_queries_are_end_aligned(nq: int, is_causal: bool) -> None:
    """A query shorter than the key holds its last positions, and its window sits there: the
    keys before the queries that a window reaches, and no more."""
    q, k, v, sinks, dout = _inputs(1, nq, 21, 2, 2, 8, torch.float64)
    ins = _leaves(q, k, v, sinks, dtype=torch.float64)
    options = dict(is_causal=is_causal, window_size=(6, 1), softcap=3.0)
    got = attention(*ins[:3], sinks=ins[3], return_lse=True, **options)
    ins64 = _leaves(q, k, v, sinks, dtype=torch.float64)
    want = oracle_attention(*ins64[:3], sinks=ins64[3], **options)
    _check(got, want, ins, ins64, dout, torch.float64)


def test_packed_documents_each_alone() -> None:
    """Packed documents under a window: each document's rows equal the document alone."""
    q, k, v, sinks, _ = _inputs(2, 16, 16, 2, 1, 8, torch.float64)
    cu = [0, 5, 16, 20, 32]  # row 0: documents of 5 and 11; row 1: 4 and 12
    options = dict(is_causal=True, window_size=(3, 0), softcap=2.5, sinks=sinks)
    out = attention(q, k, v, cu_seqlens=cu, **options)
    qf, kf, vf = (x.reshape(1, 32, *x.shape[2:]) for x in (q, k, v))
    for a, b in itertools.pairwise(cu):
        alone = attention(qf[:, a:b], kf[:, a:b], vf[:, a:b], **options)
        torch.testing.assert_close(out.reshape(1, 32, 2, 8)[:, a:b], alone, rtol=0, atol=1e-12)


@pytest.mark.parametrize("softcap", [None, 2.0], ids=["nocap", "cap"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_dilated_against_oracle(softcap, is_causal) -> None:
    """Dilated attention with soft-capping in every branch and one sink in the union's
    denominator, a padding mask and GQA."""
    q, k, v, sinks, dout = _inputs(2, 29, 29, 4, 2, 8, torch.float64)
    mask = torch.zeros(2, 29, dtype=torch.bool)
    mask[0, :6] = True
    ins = _leaves(q, k, v, sinks, dtype=torch.float64)
    segs, rates = [8, 16], [1, 2]
    got = dilated_attention(
        *ins[:3], segs, rates, is_causal=is_causal, softcap=softcap, sinks=ins[3],
        key_padding_mask=mask, return_lse=True,
    )  # fmt: skip
    ins64 = _leaves(q, k, v, sinks, dtype=torch.float64)
    want = oracle_dilated_attention(
        *ins64[:3], segs, rates, is_causal=is_causal, softcap=softcap, sinks=ins64[3],
        key_padding_mask=mask,
    )  # fmt: skip
    _check(got, want, ins, ins64, dout, torch.float64)


def test_dilated_packed_documents() -> None:
    """Packed documents with soft-capping and sinks: each document as if alone."""
    q, k, v, sinks, dout = _inputs(1, 30, 30, 2, 2, 8, torch.float64)
    cu = [0, 11, 30]
    ins = _leaves(q, k, v, sinks, dtype=torch.float64)
    out = dilated_attention(
        *ins[:3], [8], [2], is_causal=True, softcap=2.0, sinks=ins[3], cu_seqlens=cu
    )
    ins64 = _leaves(q, k, v, sinks, dtype=torch.float64)
    want = torch.cat([
        oracle_dilated_attention(
            *(x[:, a:b] for x in ins64[:3]), [8], [2], is_causal=True, softcap=2.0,
            sinks=ins64[3],
        )[0]
        for a, b in itertools.pairwise(cu)
    ], dim=1)  # fmt: skip
    assert_close_to_oracle(out, want, name="out")
    grads = torch.autograd.grad(out, ins, dout)
    want_grads = torch.autograd.grad(want, ins64, dout)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), grads, want_grads, strict=True):
        assert_close_to_oracle(g, w, name=name, grad=True)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_block_sparse_against_oracle(is_causal: bool) -> None:
    """Block-sparse attention with soft-capping and sinks."""
    q, k, v, sinks, dout = _inputs(2, 26, 26, 4, 2, 8, torch.float64)
    ins = _leaves(q, k, v, sinks, dtype=torch.float64)
    got = block_sparse_attention(
        *ins[:3], LocalWindow(1), block_size=8, is_causal=is_causal, softcap=1.5, sinks=ins[3],
        return_lse=True,
    )  # fmt: skip
    blocks = torch.arange(26) // 8
    keep = (blocks[:, None] - blocks[None, :]).abs() <= 1
    if is_causal:
        keep = keep & torch.ones(26, 26, dtype=torch.bool).tril()
    ins64 = _leaves(q, k, v, sinks, dtype=torch.float64)
    want = masked_attention(
        *ins64[:3], keep.long().expand(4, 26, 26), softcap=1.5, sinks=ins64[3]
    )
    _check(got, want, ins, ins64, dout, torch.float64)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_decoding_token_by_token_equals_the_causal_forward(static: bool) -> None:
    """A prompt then one token at a time through a cache, with soft-capping and sinks, equals
    the causal forward over every position."""
    q, k, v, sinks, _ = _inputs(2, 19, 19, 4, 2, 8, torch.float64)
    segs, rates = [4, 8], [1, 2]
    options = dict(is_causal=True, softcap=2.0, sinks=sinks)
    full = dilated_attention(q, k, v, segs, rates, **options)
    cache = (StaticDilatedKVCache if static else DilatedKVCache)(segs, rates, max_length=19)
    with torch.no_grad():
        steps = [dilated_attention(q[:, :7], k[:, :7], v[:, :7], segs, rates, cache=cache,
                                   **options)]  # fmt: skip
        for t in range(7, 19):
            sl = slice(t, t + 1)
            steps.append(
                dilated_attention(q[:, sl], k[:, sl], v[:, sl], segs, rates, cache=cache,
                                  **options)
            )
    torch.testing.assert_close(torch.cat(steps, dim=1), full.detach(), rtol=0, atol=1e-12)


def test_rows_without_keys_and_sinks() -> None:
    """A row whose keys are all hidden outputs zeros with lse equal to its sink, and its
    gradients are zero; a row that sees keys mixes them with the sink."""
    q, k, v, sinks, _ = _inputs(1, 6, 6, 2, 2, 4, torch.float64)
    mask = torch.tensor([[True, True, True, False, False, False]])
    ins = _leaves(q, k, v, sinks, dtype=torch.float64)
    out, lse = attention(
        *ins[:3], is_causal=True, key_padding_mask=mask, sinks=ins[3], return_lse=True
    )
    assert torch.equal(out[0, :3], torch.zeros_like(out[0, :3]))
    torch.testing.assert_close(lse[0, :, :3], sinks[:, None].expand(2, 3))
    dq, dsinks = torch.autograd.grad(out.sum(), (ins[0], ins[3]))
    assert torch.equal(dq[0, :3], torch.zeros_like(dq[0, :3]))
    assert bool(torch.isfinite(dsinks).all()) and bool((dsinks != 0).all())


def test_softcap_at_extreme_logits() -> None:
    """Scores near float32's limit are capped before the softmax: finite, equal to the oracle."""
    q, k, v, sinks, _dout = _inputs(1, 9, 9, 2, 2, 4, torch.float32)
    q = q * 1e18
    ins = _leaves(q, k, v, sinks, dtype=torch.float32)
    got = attention(*ins[:3], softcap=30.0, sinks=ins[3], is_causal=True, return_lse=True)
    assert bool(torch.isfinite(got[0]).all())
    ins64 = _leaves(q, k, v, sinks, dtype=torch.float64)
    want = oracle_attention(*ins64[:3], softcap=30.0, sinks=ins64[3], is_causal=True)
    assert_close_to_oracle(got[0], want[0], name="out", dtype=torch.float32)


def test_nan_stays_in_its_row() -> None:
    """A NaN query row gives NaN there only, and a NaN sink gradient (nothing silent)."""
    q, k, v, sinks, _ = _inputs(1, 5, 5, 2, 2, 4, torch.float64)
    q[0, 2, 0, 0] = math.nan
    ins = _leaves(q, k, v, sinks, dtype=torch.float64)
    out = attention(*ins[:3], window_size=(1, 1), softcap=2.0, sinks=ins[3])
    assert bool(torch.isnan(out[0, 2, 0]).all())
    assert bool(torch.isfinite(out[0, [0, 1, 3, 4]]).all())
    assert bool(torch.isfinite(out[0, 2, 1]).all())


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        (dict(window_size=(3,)), TypeError, "window_size must be None or a pair"),
        (dict(window_size=(3, "0")), TypeError, "window_size must be a pair of ints"),
        (dict(window_size=(-2, 0)), ValueError, "window_size sides must be >= 0"),
        (dict(softcap=-1.0), ValueError, "softcap must be a positive finite float"),
        (dict(softcap=math.inf), ValueError, "softcap must be a positive finite float"),
        (dict(softcap="50"), TypeError, "softcap must be a positive float"),
        (dict(sinks=[0.0, 0.0]), TypeError, "sinks must be a tensor"),
        (dict(sinks=torch.zeros(3)), ValueError, r"sinks must have shape \(num_heads,\)"),
        (dict(sinks=torch.zeros(2, dtype=torch.long)), ValueError, "floating"),
    ],
)
def test_bad_values(options, error, match) -> None:
    q = torch.randn(1, 4, 2, 4)
    with pytest.raises(error, match=match):
        attention(q, q, q, **options)


def test_kernels_that_cannot_apply_them_refuse_by_name() -> None:
    """Naming a kernel that applies no soft-cap (or window) raises with its reason."""
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match=r"no soft-capping \(softcap\)"):
        attention(q, q, q, softcap=5.0, backend="cpu_flash")
    with pytest.raises(ValueError, match=r"no local window \(window_size\)"):
        attention(q, q, q, window_size=(2, 0), backend="cpu_flash")


@pytest.mark.parametrize(
    "options", [dict(softcap=2.0), dict(window_size=(2, 0)), dict(sinks=torch.zeros(2))],
    ids=["softcap", "window", "sinks"],
)  # fmt: skip
def test_double_backward_is_a_clear_error(options) -> None:
    q = torch.randn(1, 6, 2, 4, dtype=torch.float64, requires_grad=True)
    out = attention(q, q, q, is_causal=True, **options)
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="no higher-order gradients"):
        torch.autograd.grad(dq.sum(), q)


def test_under_torch_func_a_clear_error() -> None:
    """The compiled operators do not carry these options yet: a clear error, never dropped."""
    q = torch.randn(1, 6, 2, 4)
    with pytest.raises(ValueError, match=r"softcap not supported under torch\.compile"):
        torch.func.vmap(lambda x: attention(x, x, x, softcap=2.0))(q[None])


def _window_multiplicity(n: int, heads: int, window: tuple[int, int], causal: bool):
    """(H, N, N) 0/1: position p sees key t in the window (and t <= p when causal)."""
    left, right = window
    p, t = torch.arange(n)[:, None], torch.arange(n)[None, :]
    seen = torch.ones(n, n, dtype=torch.bool)
    if left >= 0:
        seen &= t >= p - left
    if right >= 0:
        seen &= t <= p + right
    if causal:
        seen &= t <= p
    return seen.long().expand(heads, n, n)


@pytest.mark.parametrize("window", [(3, 0), (2, 4)], ids=str)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_dilated_window_branch(window, is_causal) -> None:
    """A local window is one more branch of the union: its keys count once more beside the
    dilated branches' (the oracle's multiplicities add), with soft-capping and sinks."""
    q, k, v, sinks, dout = _inputs(2, 27, 27, 4, 2, 8, torch.float64)
    segs, rates = [8, 16], [1, 2]
    ins = _leaves(q, k, v, sinks, dtype=torch.float64)
    got = dilated_attention(
        *ins[:3], segs, rates, is_causal=is_causal, window_size=window, softcap=2.0,
        sinks=ins[3], return_lse=True,
    )  # fmt: skip
    M = dilated_multiplicity(27, 4, segs, rates, is_causal=is_causal)
    M = M + _window_multiplicity(27, 4, window, is_causal)
    ins64 = _leaves(q, k, v, sinks, dtype=torch.float64)
    want = masked_attention(*ins64[:3], M, softcap=2.0, sinks=ins64[3])
    _check(got, want, ins, ins64, dout, torch.float64)


def test_dilated_window_branch_packed() -> None:
    """With packed documents the window stays inside each document."""
    q, k, v, _, _ = _inputs(1, 30, 30, 2, 1, 8, torch.float64)
    cu = [0, 13, 30]
    out = dilated_attention(q, k, v, [8], [2], is_causal=True, window_size=(4, 0), cu_seqlens=cu)
    for a, b in itertools.pairwise(cu):
        alone = dilated_attention(
            q[:, a:b], k[:, a:b], v[:, a:b], [8], [2], is_causal=True, window_size=(4, 0)
        )
        torch.testing.assert_close(out[:, a:b], alone, rtol=0, atol=1e-12)


def test_dilated_window_with_a_cache_is_refused() -> None:
    q = torch.randn(1, 4, 2, 4)
    with pytest.raises(ValueError, match=r"window_size=.* runs whole sequences only"):
        dilated_attention(q, q, q, [4], [1], is_causal=True, window_size=(2, 0),
                          cache=DilatedKVCache([4], [1]))  # fmt: skip


def test_explain_names_them() -> None:
    """explain() takes the three and says which kernel applies them and why others do not."""
    from dilated_attention import explain

    choice = explain(device="cpu", is_causal=True, window_size=(127, 0), softcap=30.0, sinks=True)
    text = str(choice)
    assert "window (127, 0)" in text and "softcap 30.0" in text and "sinks" in text
    assert choice.backend == "math"
    assert "no soft-capping (softcap)" in "; ".join(choice.reasons["cpu_flash"])
    with pytest.raises(ValueError, match="softcap must be a positive finite float"):
        explain(device="cpu", softcap=-2.0)


@pytest.mark.slow
def test_under_torch_compile_they_run_eagerly_between_graphs() -> None:
    """torch.compile runs calls with a window, a soft-cap, sinks or packed documents eagerly (a
    graph break): the eager result and gradients; fullgraph=True names the reason."""
    q = torch.randn(1, 16, 2, 8, dtype=torch.float64, requires_grad=True)
    sinks = torch.zeros(2, dtype=torch.float64, requires_grad=True)

    def loss(x: torch.Tensor) -> torch.Tensor:
        return dilated_attention(
            x, x, x, [8], [1], cu_seqlens=[0, 5, 16], window_size=(2, 0), softcap=3.0,
            sinks=sinks, is_causal=True,
        ).square().sum()  # fmt: skip

    got = torch.compile(loss)(q)
    grads = torch.autograd.grad(got, (q, sinks))
    want = loss(q)
    want_grads = torch.autograd.grad(want, (q, sinks))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    whole = torch.compile(lambda x: attention(x, x, x, softcap=3.0), fullgraph=True)
    with pytest.raises(Exception, match=r"run eagerly under torch\.compile"):
        whole(q)
