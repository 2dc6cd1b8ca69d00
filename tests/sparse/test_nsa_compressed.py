"""NSA's compressed branch runs residue classes alike on consecutive rows as one call (Note
[Residue classes as heads]): fewer calls than classes, and the same outputs, lse and gradients as
one plain ``attention`` call per class on strided views of the queries (the branch as first
written)."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

import dilated_attention.sparse.nsa as nsa
from dilated_attention import attention
from dilated_attention.sparse import compress_kv
from dilated_attention.sparse.compression import num_windows

F64 = torch.float64


def _per_class(q, k_cmp, v_cmp, key_len, block, stride, run):
    """One ``attention`` call per residue class on a strided view, written into a strided
    slice of the output: the branch without grouping."""
    batch, nq, heads, _ = q.shape
    out = q.new_zeros(batch, nq, heads, v_cmp.shape[-1])
    lse = torch.full((batch, heads, nq), -torch.inf, dtype=F64)
    call = functools.partial(attention, is_causal=run.is_causal, scale=run.scale,
                             return_lse=True)  # fmt: skip
    step = stride if run.is_causal else 1
    for start, keys in nsa._class_calls(nq, key_len, block, stride, run.is_causal,
                                        k_cmp.shape[1]):  # fmt: skip
        o_r, lse_r = call(q[:, start::step], k_cmp[:, :keys], v_cmp[:, :keys])
        out[:, start::step] = o_r
        lse[:, :, start::step] = lse_r
    return out, lse


@pytest.mark.parametrize(
    ("nq", "nk", "block", "stride", "heads", "kv_heads"),
    [
        (64, 64, 8, 4, 4, 2),  # l = 2 d: classes 0-2 alike, class 3 apart
        (61, 61, 8, 4, 4, 1),  # a length not divisible by d
        (20, 45, 5, 3, 2, 2),  # end-aligned, l not a multiple of d
    ],
)
def test_alike_classes_run_as_one_call(monkeypatch, nq, nk, block, stride, heads,
                                       kv_heads) -> None:  # fmt: skip
    g = torch.Generator().manual_seed(nq + nk)
    q = torch.randn(2, nq, heads, 8, generator=g, dtype=F64, requires_grad=True)
    k = torch.randn(2, nk, kv_heads, 8, generator=g, dtype=F64, requires_grad=True)
    v = torch.randn(2, nk, kv_heads, 8, generator=g, dtype=F64, requires_grad=True)
    k_cmp, v_cmp = compress_kv(k, v, block=block, stride=stride)
    run = nsa.Run(scale=0.3, backend=None, is_causal=True, need_lse=True)
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return attention(*args, **kwargs)

    monkeypatch.setattr(nsa, "attention", counted)
    out, lse = nsa.compressed_branch(q, k_cmp, v_cmp, nk, block, stride, run)
    per_class = sorted(nsa._class_calls(nq, nk, block, stride, True, k_cmp.shape[1]))
    # A call per run: classes on consecutive first rows with as many rows and keys
    kind = {start: (len(range(start, nq, stride)), keys) for start, keys in per_class}
    runs = 1 + sum(not (b == a + 1 and kind[a] == kind[b])
                   for (a, _), (b, _) in itertools.pairwise(per_class))  # fmt: skip
    # need_lse makes each call twice (Note [A differentiable log-sum-exp])
    assert len(calls) == 2 * runs and runs < len(per_class)
    want_out, want_lse = _per_class(q, k_cmp, v_cmp, nk, block, stride, run)
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse.detach(), want_lse, atol=1e-12, rtol=1e-12)
    dout = torch.randn(out.shape, generator=g, dtype=F64)
    got = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    want = torch.autograd.grad(want_out, (q, k, v), dout)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize(
    ("nq", "nk", "block", "stride"),
    [(64, 64, 8, 4), (61, 61, 8, 4), (20, 45, 5, 3), (4099, 4099, 32, 16), (30, 30, 7, 2)],
)
def test_runs_hold_every_class_once_and_are_as_long_as_they_can_be(nq, nk, block, stride):
    """``_runs``: each class (first row, keys) in exactly one run; a run's classes on
    consecutive first rows with as many rows and the same keys, at most ``stride`` of them; no
    two neighbouring runs that could have been one."""
    calls = nsa._class_calls(nq, nk, block, stride, True, num_windows(nk, block, stride))
    runs = nsa._runs(calls, stride, nq)

    def rows(start: int) -> int:
        return len(range(start, nq, stride))

    held = sorted((first + c, keys) for first, count, keys in runs for c in range(count))
    assert held == sorted(calls)
    for first, count, _ in runs:
        assert count <= stride and {rows(first + c) for c in range(count)} == {rows(first)}
    for (a, count, keys_a), (b, _, keys_b) in itertools.pairwise(runs):
        last = a + count - 1
        assert not (b == last + 1 and keys_a == keys_b and rows(last) == rows(b) and
                    count < stride)  # fmt: skip


def test_nsa_strides_classes_make_two_runs():
    """l = 2 d over a length divisible by d: the class whose first row comes first sees one
    compressed key more; the other d - 1 classes are one run."""
    calls = nsa._class_calls(64, 64, 8, 4, True, num_windows(64, 8, 4))
    assert nsa._runs(calls, 4, 64) == [(7, 1, 15), (8, 3, 14)]


@pytest.mark.parametrize(("nq", "block"), [(61, 8), (6, 8)], ids=["classes", "no-whole-window"])
def test_the_branch_joined_to_a_sum_is_the_sum_plus_its_gated_output(nq, block) -> None:
    """``gate`` and ``total``: ``total + gate * out`` of the plain branch, in value and in the
    gradients of q, k, v, the gate and the sum (float64), with and without a compressed key
    before the rows; a sum without a gate is refused before any work."""
    g = torch.Generator().manual_seed(nq)
    q = torch.randn(2, nq, 4, 8, generator=g, dtype=F64, requires_grad=True)
    k, v = (torch.randn(2, nq, 2, 8, generator=g, dtype=F64, requires_grad=True)
            for _ in range(2))  # fmt: skip
    gate = torch.rand(2, nq, 4, 1, generator=g, dtype=F64, requires_grad=True)
    total = torch.randn(2, nq, 4, 8, generator=g, dtype=F64, requires_grad=True)
    run = nsa.Run(scale=0.3, backend=None, is_causal=True, need_lse=False)
    k_cmp, v_cmp = compress_kv(k, v, block=block, stride=4)
    got, _ = nsa.compressed_branch(q, k_cmp, v_cmp, nq, block, 4, run, gate, total)
    plain, _ = nsa.compressed_branch(q, k_cmp, v_cmp, nq, block, 4, run)
    want = total + gate * plain
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    dout = torch.randn(got.shape, generator=g, dtype=F64)
    leaves = (q, k, v, gate, total)
    # no whole window: q, k and v reach neither result (their gradients None in both)
    grads = torch.autograd.grad(got, leaves, dout, allow_unused=True)
    wants = torch.autograd.grad(want, leaves, dout, allow_unused=True)
    unused = [nq < block] * 3 + [False, False]
    assert [x is None for x in grads] == [x is None for x in wants] == unused
    for a, b in zip(grads, wants, strict=True):
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    with pytest.raises(ValueError, match=r"total: a sum is joined only to the gated output.*"
                                         r"gate=None"):  # fmt: skip
        nsa.compressed_branch(q, k_cmp, v_cmp, nq, block, 4, run, None, total)
