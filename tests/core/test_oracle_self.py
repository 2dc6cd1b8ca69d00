"""Checks of the float64 oracle itself against independent facts (it is the ground truth)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from support.block_sparse import token_mask
from support.oracle import (
    branch_positions,
    dilated_multiplicity,
    oracle_attention,
    oracle_dilated_attention,
)
from support.sdpa import sdpa_bnhd
from support.shared_results import shared_result
from torch import Tensor

from dilated_attention import patterns as P

F64 = torch.float64


def _randn(*shape: int) -> Tensor:
    return torch.randn(*shape, dtype=F64)


def test_branch_positions_ragged() -> None:
    """w=10, r=3, N=25, head 4 (offset 1): segments [0,10), [10,20), [20,25)."""
    assert branch_positions(25, 10, 3, 4) == [[1, 4, 7], [11, 14, 17], [21, 24]]
    # Offset larger than the last (partial) segment: nothing covered there.
    assert branch_positions(50, 16, 6, 5) == [[5, 11], [21, 27], [37, 43], []]
    # Segment longer than the sequence: one segment.
    assert branch_positions(7, 100, 2, 1) == [[1, 3, 5]]


def test_multiplicity_hand_case() -> None:
    """N=4, one branch w=4 r=2, H=2: head 0 covers {0, 2}, head 1 covers {1, 3}."""
    M = dilated_multiplicity(4, 2, [4], [2])
    expected = torch.tensor(
        [
            [[1, 0, 1, 0], [0, 0, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]],
            [[0, 0, 0, 0], [0, 1, 0, 1], [0, 0, 0, 0], [0, 1, 0, 1]],
        ]
    )
    assert torch.equal(M, expected)
    causal = dilated_multiplicity(4, 2, [4], [2], is_causal=True)
    assert torch.equal(causal, torch.tril(expected))


def test_multiplicity_counts_overlap() -> None:
    """Branches (4,1) and (8,2) overlap: head 0, query 2 sees key 0 twice, keys 1 and 4 once."""
    M = dilated_multiplicity(8, 2, [4, 8], [1, 2])
    assert M[0, 2].tolist() == [2, 1, 2, 1, 1, 0, 1, 0]
    assert M[1, 2].tolist() == [1, 1, 1, 1, 0, 0, 0, 0]  # head 1 offset 1: query 2 not in branch 2


def test_hand_computed_output() -> None:
    """The hand case above, values written out from the softmax definition."""
    B, N, H, D = 1, 4, 2, 3
    q, k, v = _randn(B, N, H, D), _randn(B, N, H, D), _randn(B, N, H, D)
    out, lse = oracle_dilated_attention(q, k, v, [4], [2])
    scale = D**-0.5
    for j, covered in ((0, [0, 2]), (1, [1, 3])):
        for p in range(N):
            if p not in covered:
                assert torch.equal(out[0, p, j], torch.zeros(D, dtype=F64))
                assert lse[0, j, p] == float("-inf")
                continue
            s = [float(q[0, p, j] @ k[0, t, j]) * scale for t in covered]
            e = [math.exp(x) for x in s]
            want = sum(ei * v[0, t, j] for ei, t in zip(e, covered, strict=True)) / sum(e)
            torch.testing.assert_close(out[0, p, j], want, atol=1e-12, rtol=1e-12)
            assert abs(float(lse[0, j, p]) - math.log(sum(e))) < 1e-12


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize(("H", "H_kv"), [(4, 4), (4, 2), (3, 1)])
def test_single_branch_is_sdpa(is_causal: bool, H: int, H_kv: int) -> None:
    """One branch (N, 1) is plain attention: equals F.scaled_dot_product_attention and logsumexp."""
    B, N, D = 2, 19, 8
    q, k, v = _randn(B, N, H, D), _randn(B, N, H_kv, D), _randn(B, N, H_kv, D)
    out, lse = oracle_dilated_attention(q, k, v, [N], [1], is_causal=is_causal)
    torch.testing.assert_close(out, sdpa_bnhd(q, k, v, is_causal=is_causal), atol=1e-12, rtol=1e-10)
    kk = k.repeat_interleave(H // H_kv, dim=2)
    scores = torch.einsum("bphd,bthd->bhpt", q, kk) * D**-0.5
    if is_causal:
        scores = scores.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), atol=1e-12, rtol=1e-10)
    out2, lse2 = oracle_attention(q, k, v, is_causal=is_causal)
    torch.testing.assert_close(out2, out, atol=0, rtol=0)
    torch.testing.assert_close(lse2, lse, atol=0, rtol=0)


@pytest.mark.parametrize("is_causal", [False, True])
def test_key_padding_is_sdpa_mask(is_causal: bool) -> None:
    """key_padding_mask (True = ignore) is an SDPA bool mask (True = keep) when no row is empty."""
    B, N, H, D = 2, 13, 2, 4
    q, k, v = _randn(B, N, H, D), _randn(B, N, H, D), _randn(B, N, H, D)
    mask = torch.rand(B, N) < 0.4
    mask[:, 0] = False  # keep key 0 so no causal row is empty
    out, _ = oracle_attention(q, k, v, is_causal=is_causal, key_padding_mask=mask)
    want = sdpa_bnhd(q, k, v, is_causal=is_causal, mask=mask)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-10)


def test_explicit_scale_is_sdpa_scale() -> None:
    """An explicit scale multiplies the scores exactly like SDPA's ``scale``."""
    B, N, H, D = 1, 11, 2, 8
    q, k, v = _randn(B, N, H, D), _randn(B, N, H, D), _randn(B, N, H, D)
    out, _ = oracle_attention(q, k, v, scale=0.37)
    want = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=0.37
    ).transpose(1, 2)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-10)


def test_duplicate_branch_keeps_output_shifts_lse() -> None:
    """Doubling every weight leaves the softmax unchanged but adds log 2 to the LSE."""
    B, N, H, D = 2, 24, 4, 8
    q, k, v = _randn(B, N, H, D), _randn(B, N, H, D), _randn(B, N, H, D)
    out1, lse1 = oracle_dilated_attention(q, k, v, [8], [2], is_causal=True)
    out2, lse2 = oracle_dilated_attention(q, k, v, [8, 8], [2, 2], is_causal=True)
    torch.testing.assert_close(out2, out1, atol=1e-13, rtol=1e-12)
    finite = torch.isfinite(lse1)
    assert torch.equal(finite, torch.isfinite(lse2))
    assert not bool(finite.all())  # r=2 leaves rows uncovered
    torch.testing.assert_close(lse2[finite], lse1[finite] + math.log(2), atol=1e-13, rtol=1e-12)


def _eq10_composition(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    segment_lengths: list[int],
    dilation_rates: list[int],
    *,
    is_causal: bool,
) -> tuple[Tensor, Tensor]:
    """Independent route: per branch gather each segment's dilated rows, run SDPA, mix by Eq. 10."""
    B, N, H, D = q.shape
    group = H // k.shape[2]
    outs: list[Tensor] = []
    lses: list[Tensor] = []
    for w, r in zip(segment_lengths, dilation_rates, strict=True):
        o_i = torch.zeros(B, N, H, D, dtype=F64)
        lse_i = torch.full((B, H, N), float("-inf"), dtype=F64)
        for j in range(H):
            for t0 in range(0, N, w):
                start, stop = t0 + j % r, min(t0 + w, N)
                if start >= stop:
                    continue
                idx = torch.arange(start, stop, r)
                qs = q[:, idx, j].unsqueeze(1)  # (B, 1, L, D)
                ks = k[:, idx, j // group].unsqueeze(1)
                vs = v[:, idx, j // group].unsqueeze(1)
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=is_causal)
                s = qs @ ks.transpose(-1, -2) * D**-0.5
                if is_causal:
                    L = idx.numel()
                    s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
                o_i[:, idx, j] = o[:, 0]
                lse_i[:, j, idx] = torch.logsumexp(s, dim=-1)[:, 0]
        outs.append(o_i)
        lses.append(lse_i)
    lse_all = torch.stack(lses)  # (m, B, H, N)
    lse = torch.logsumexp(lse_all, dim=0)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    alpha = torch.exp(lse_all - safe)  # exp(-inf) = 0 for uncovered branches
    out = sum(a.transpose(1, 2).unsqueeze(-1) * o for a, o in zip(alpha, outs, strict=True))
    return out, lse


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize(
    ("N", "H", "H_kv", "segments", "rates"),
    [
        (37, 4, 4, [8, 16, 32], [1, 2, 4]),
        (50, 6, 3, [10, 16], [3, 6]),
        (20, 2, 1, [8, 64], [1, 4]),
    ],
)
def test_oracle_matches_eq10_composition(
    is_causal: bool, N: int, H: int, H_kv: int, segments: list[int], rates: list[int]
) -> None:
    """Multiset-union softmax == branch outputs mixed by softmax denominators (Eq. 10), grads."""
    B, D = 2, 8
    leaves = [_randn(B, N, H, D), _randn(B, N, H_kv, D), _randn(B, N, H_kv, D)]
    a = [x.clone().requires_grad_() for x in leaves]
    b = [x.clone().requires_grad_() for x in leaves]
    out, lse = oracle_dilated_attention(*a, segments, rates, is_causal=is_causal)
    want, want_lse = _eq10_composition(*b, segments, rates, is_causal=is_causal)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=1e-10)
    dout = _randn(B, N, H, D)
    grads = torch.autograd.grad(out, a, dout)
    want_grads = torch.autograd.grad(want, b, dout)
    for name, g, w in zip("qkv", grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-10, msg=lambda m, n=name: f"d{n}: {m}")


def test_empty_rows_are_zero_with_finite_grads() -> None:
    """Uncovered queries and fully padded rows: out 0, lse -inf, zero dq there, no NaN anywhere."""
    B, N, H, D = 2, 16, 2, 4
    q, k, v = (_randn(B, N, H, D).requires_grad_() for _ in range(3))
    mask = torch.zeros(B, N, dtype=torch.bool)
    mask[1, :8] = True  # batch 1: first segment of w=8 fully padded
    out, lse = oracle_dilated_attention(q, k, v, [8], [2], key_padding_mask=mask)
    empty = torch.isinf(lse)  # (B, H, N)
    assert bool(empty[0, 0, 1::2].all()) and bool(empty[0, 1, 0::2].all())
    assert bool(empty[1, :, :8].all())
    assert int(empty.sum()) == B * H * N // 2 + H * 4
    assert bool((out.transpose(1, 2)[empty] == 0).all())
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), _randn(B, N, H, D))
    for g in (dq, dk, dv):
        assert bool(torch.isfinite(g).all())
    assert bool((dq.transpose(1, 2)[empty] == 0).all())
    assert bool((dk[1, :8] == 0).all()) and bool((dv[1, :8] == 0).all())


def test_low_precision_replica_differs_but_is_close() -> None:
    """compute_dtype=bfloat16 gives a genuinely low-precision result near the float64 one."""
    B, N, H, D = 1, 32, 2, 16
    q, k, v = (_randn(B, N, H, D).to(torch.bfloat16) for _ in range(3))
    out64, _ = oracle_dilated_attention(q, k, v, [8, 16], [1, 2])
    outlp, lselp = oracle_dilated_attention(q, k, v, [8, 16], [1, 2], compute_dtype=torch.bfloat16)
    assert outlp.dtype == torch.bfloat16 and lselp.dtype == torch.bfloat16
    err = (outlp.double() - out64).abs().max().item()
    assert 0 < err < 5e-2


def _outputs_and_grads(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, dout: Tensor) -> list[Tensor]:
    """``[out, dq, dk, dv]`` of the causal dilated oracle (w 8, 16; r 1, 2) with ``mask``."""
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, _ = oracle_dilated_attention(
        *leaves, [8, 16], [1, 2], is_causal=True, key_padding_mask=mask
    )
    return [out.detach(), *torch.autograd.grad(out, leaves, dout)]


@pytest.mark.parametrize(("where", "pos"), [("k", 13), ("v", 13), ("v", 6), ("q", 5), ("k", 21)])
@pytest.mark.parametrize("H_kv", [4, 2])
def test_nan_reaches_exactly_what_depends_on_it(where: str, pos: int, H_kv: int) -> None:
    """A NaN input element turns exactly the outputs and gradients that depend on it NaN and
    leaves the others at their values: an entry depends on it when two finite stand-ins for
    the NaN give it different values. Keys the mask hides (position 6 in batch 1), keys after a
    causal row and keys of other segments or offsets depend on nothing they cannot see
    (Note [Hidden keys cannot poison rows] in the library's ``core/hidden.py``)."""
    B, N, H, D = 2, 24, 4, 4
    q, dout = _randn(B, N, H, D), _randn(B, N, H, D)
    k, v = _randn(B, N, H_kv, D), _randn(B, N, H_kv, D)
    mask = torch.zeros(B, N, dtype=torch.bool)
    mask[1, [6, 17]] = True
    mask[0, 3] = True

    def with_value(value: float) -> list[Tensor]:
        x = {"q": q, "k": k, "v": v}[where].clone()
        x[1, pos, 1] = value
        args = {"q": q, "k": k, "v": v, where: x}
        return _outputs_and_grads(args["q"], args["k"], args["v"], mask, dout)

    got, low, high = with_value(math.nan), with_value(0.3), with_value(-1.7)
    for name, g, a, b in zip(("out", "dq", "dk", "dv"), got, low, high, strict=True):
        depends = (a - b).abs() > 1e-12
        assert torch.equal(torch.isnan(g), depends), f"{name}: NaN is not what depends on it"
        torch.testing.assert_close(g[~depends], a[~depends], atol=1e-12, rtol=1e-12)
    reached, untouched = int(got[0].isnan().sum()), int(got[0].isfinite().sum())
    if where == "v" and pos == 6:  # masked: nothing sees it
        assert reached == 0
    else:  # some rows see it, and some of its head cannot
        assert reached > 0 and bool(got[0][1, :, 1].isfinite().any()), (reached, untouched)


def _token_mask_by_loops(
    pattern: P.Pattern, block_size: int, nq: int, nk: int, is_causal: bool, start: int
) -> Tensor:
    """The block-sparse oracle's token mask by its definition, one (row, key) pair at a time."""
    blocks = pattern.block_mask(-(-(start + nq) // block_size), -(-nk // block_size))
    mask = torch.zeros(nq, nk, dtype=torch.int64)
    for i in range(nq):
        p = start + i
        for t in range(nk):
            if blocks[p // block_size, t // block_size] and (not is_causal or t <= p):
                mask[i, t] = 1
    return mask


@pytest.mark.parametrize(
    ("pattern", "block_size", "nq", "nk", "start"),
    [
        (P.LocalWindow(1), 8, 40, 40, None),
        (P.Random(0.3, seed=3) | P.LocalWindow(0), 5, 33, 33, None),  # ragged last block
        (P.GlobalLocal(1, 0), 16, 21, 50, None),  # short query: end-aligned when causal
        (P.DilatedBlocks((2,)), 8, 50, 21, 0),  # query longer than key: top-left
        (P.Custom(torch.eye(5, dtype=torch.bool).roll(1, 1)), 7, 35, 35, 0),  # empty rows
        (P.LocalWindow(0) | P.Random(0.4, seed=1), 4, 12, 30, 9),  # a query start of its own
    ],
)
@pytest.mark.parametrize("is_causal", [False, True])
def test_token_mask_is_the_block_mask_per_token(
    pattern: P.Pattern, block_size: int, nq: int, nk: int, start: int | None, is_causal: bool
) -> None:
    """``token_mask`` (indexing) equals the definition written as a loop per token pair."""
    got = token_mask(pattern, block_size, nq, nk, is_causal, query_start=start)
    if start is None:  # the library's convention: causal queries end-aligned
        start = nk - nq if is_causal else 0
    want = _token_mask_by_loops(pattern, block_size, nq, nk, is_causal, start)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert 0 < int(want.sum()) < nq * nk  # neither empty nor full: the case tests something


def test_shared_results_are_computed_once_and_handed_out_as_copies() -> None:
    """``shared_result``: one computation per arguments; detached results (no autograd graph
    kept); each call a fresh copy, so writing into one changes nothing for the next caller."""
    calls: list[tuple[str, int]] = []

    @shared_result
    def oracle(name: str, n: int) -> tuple[Tensor, list[Tensor]]:
        calls.append((name, n))
        x = torch.arange(float(n), dtype=F64).requires_grad_()
        y = x * 2
        return y, [y.sum(), torch.autograd.grad(y.sum(), x)[0]]

    first = oracle("a", 3)
    assert isinstance(first, tuple) and isinstance(first[1], list)
    assert not first[0].requires_grad and first[0].grad_fn is None
    first[0].fill_(math.nan)
    first[1][1].zero_()
    second = oracle("a", 3)
    assert torch.equal(second[0], torch.tensor([0.0, 2.0, 4.0], dtype=F64))
    assert torch.equal(second[1][1], torch.full((3,), 2.0, dtype=F64))
    assert second[0].data_ptr() != first[0].data_ptr()
    oracle("b", 3)
    oracle(name="a", n=3)  # another spelling of the arguments is another key
    assert calls == [("a", 3), ("b", 3), ("a", 3)]
    assert oracle.cache_info().hits == 1
