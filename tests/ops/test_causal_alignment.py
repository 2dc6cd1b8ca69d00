"""One causal convention: a causal query shorter than the key holds the key sequence's last
positions (end-aligned, as decoding needs and as FlashAttention-2 does), in ``attention``,
``dilated_attention`` and ``block_sparse_attention`` alike; a causal query longer than the key is
refused before any work.

Issue 41, item 9: ``attention()`` and block-sparse counted a short query's positions from the
start of the keys (top-left, SDPA's ``is_causal``), ``dilated_attention`` from the end. Every
operation and CPU backend is checked here against the float64 oracle (``tests/support``, no
library code) with masks written out position by position, and against the last rows of the
full causal call; no kernel may receive a rectangular causal call (the kernels' causal mask is
top-left, Note [The backend contract]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from support.backend_params import CPU_BACKENDS, backend_id
from support.block_sparse import token_mask
from support.oracle import masked_attention, oracle_dilated_attention

import dilated_attention as da
from dilated_attention import patterns as P
from dilated_attention.backends.base import Backend

F64 = torch.float64
H, HKV, D = 4, 2, 8
TIGHT = {"atol": 1e-10, "rtol": 1e-9}
Fn = Callable[..., Any]

# (Nq, Nk): one token, a chunk, a chunk crossing blocks and segments, all but one row.
LENGTHS = [(1, 19), (5, 19), (7, 24), (18, 19)]


def _inputs(nq: int, nk: int, seed: int = 0, head_dim: int = D) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q_shape, kv_shape = (2, nq, H, head_dim), (2, nk, HKV, head_dim)
    shapes = [q_shape, kv_shape, kv_shape, q_shape]
    return [torch.randn(s, generator=gen, dtype=F64) for s in shapes]


def _end_aligned(nq: int, nk: int) -> torch.Tensor:
    """(Nq, Nk) 0/1: query row ``i`` is position ``Nk - Nq + i`` and sees keys ``t`` up to it."""
    mask = torch.zeros(nq, nk, dtype=torch.int64)
    for i in range(nq):
        for t in range(nk):
            mask[i, t] = int(t <= nk - nq + i)
    return mask


def _run(fn: Fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor) -> list:
    """out, lse and (dq, dk, dv) of ``fn(q, k, v)`` returning ``(out, lse)``."""
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = fn(*leaves)
    return [out.detach(), lse, *torch.autograd.grad(out, leaves, dout)]


def _oracle(q, k, v, dout, multiplicity: torch.Tensor, padding=None) -> list:
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = masked_attention(*leaves, multiplicity, key_padding_mask=padding)
    return [out.detach(), lse.detach(), *torch.autograd.grad(out, leaves, dout)]


def _check(got: list, want: list, case: str) -> None:
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        if name == "lse":
            assert torch.equal(torch.isneginf(g), torch.isneginf(w)), f"{case}: lse -inf rows"
        torch.testing.assert_close(g, w, **TIGHT, msg=lambda m, n=name: f"{case} {n}: {m}")


# -- each operation against the float64 oracle, every CPU backend ---------------------------------
@pytest.mark.parametrize("backend", CPU_BACKENDS, ids=backend_id)
@pytest.mark.parametrize(("nq", "nk"), LENGTHS)
@pytest.mark.parametrize("padded", [False, True], ids=["", "padded"])
def test_attention_matches_oracle(nq: int, nk: int, padded: bool, backend: str | None) -> None:
    q, k, v, dout = _inputs(nq, nk, seed=nq * nk)
    padding = None
    if padded:  # a gap in batch 0; batch 1 keeps only its first key (every row sees it)
        padding = torch.zeros(2, nk, dtype=torch.bool)
        padding[0, 2:6] = True
        padding[1, 1:] = True
    got = _run(
        lambda q, k, v: da.attention(
            q, k, v, is_causal=True, key_padding_mask=padding, backend=backend, return_lse=True
        ),
        q, k, v, dout,
    )  # fmt: skip
    want = _oracle(q, k, v, dout, _end_aligned(nq, nk).expand(H, -1, -1), padding)
    _check(got, want, f"attention Nq={nq} Nk={nk} {backend}")


@pytest.mark.parametrize("backend", CPU_BACKENDS, ids=backend_id)
@pytest.mark.parametrize(("nq", "nk"), LENGTHS)
def test_dilated_attention_matches_oracle(nq: int, nk: int, backend: str | None) -> None:
    """The last ``Nq`` rows of the float64 causal dilated oracle over all ``Nk`` positions."""
    q, k, v, dout = _inputs(nq, nk, seed=nq + nk)
    segs, rates = [4, 8, 16], [1, 2, 4]
    got = _run(
        lambda q, k, v: da.dilated_attention(
            q, k, v, segs, rates, is_causal=True, backend=backend, return_lse=True
        ),
        q, k, v, dout,
    )  # fmt: skip
    # The full sequence's queries: ours at the end, zeros before them (no gradient flows there).
    q_full = torch.cat([torch.zeros(2, nk - nq, H, D, dtype=F64), q], dim=1)
    dout_full = torch.cat([torch.zeros(2, nk - nq, H, D, dtype=F64), dout], dim=1)
    leaves = [x.clone().requires_grad_() for x in (q_full, k, v)]
    out, lse = oracle_dilated_attention(*leaves, segs, rates, is_causal=True)
    dq, dk, dv = torch.autograd.grad(out, leaves, dout_full)
    want = [out.detach()[:, -nq:], lse.detach()[..., -nq:], dq[:, -nq:], dk, dv]
    _check(got, want, f"dilated Nq={nq} Nk={nk} {backend}")


SPARSE = {
    "local": (P.LocalWindow(1), 4),
    "random": (P.Random(0.5, seed=2), 4),
    "global_dilated": (P.GlobalLocal(1, 0) | P.DilatedBlocks((2,)), 3),
    "dense": (P.LocalWindow(100), 4),  # keeps every pair: runs attention() (Note [Dense fallback])
}


@pytest.mark.parametrize("backend", CPU_BACKENDS, ids=backend_id)
@pytest.mark.parametrize(("nq", "nk"), LENGTHS)
@pytest.mark.parametrize("name", list(SPARSE))
def test_block_sparse_attention_matches_oracle(
    name: str, nq: int, nk: int, backend: str | None
) -> None:
    """Query row ``i`` is position ``p = Nk - Nq + i``, in block ``p // block_size``."""
    pattern, block_size = SPARSE[name]
    q, k, v, dout = _inputs(nq, nk, seed=nq + 2 * nk)
    got = _run(
        lambda q, k, v: da.block_sparse_attention(
            q, k, v, pattern, block_size=block_size, is_causal=True, backend=backend,
            return_lse=True,
        ),
        q, k, v, dout,
    )  # fmt: skip
    mask = token_mask(pattern, block_size, nq, nk, True)  # loops; end-aligned by default
    # Written out here too: the same positions as the full sequence's last rows.
    full = token_mask(pattern, block_size, nk, nk, True)
    assert torch.equal(mask, full[-nq:])
    want = _oracle(q, k, v, dout, mask.expand(H, -1, -1))
    _check(got, want, f"block-sparse {name} Nq={nq} Nk={nk} {backend}")


# -- one convention: a short causal query is the last rows of the full call -----------------------
def _operations() -> dict[str, Fn]:
    return {
        "attention": lambda q, k, v, **kw: da.attention(q, k, v, **kw),
        "dilated_attention": lambda q, k, v, **kw: da.dilated_attention(
            q, k, v, [4, 8], [1, 2], **kw
        ),
        "block_sparse_attention": lambda q, k, v, **kw: da.block_sparse_attention(
            q, k, v, P.LocalWindow(1) | P.Random(0.4, seed=1), block_size=3, **kw
        ),
    }


@pytest.mark.parametrize("name", list(_operations()))
def test_short_query_equals_last_rows_of_full_call(name: str) -> None:
    """Each operation, queries at the last 6 of 17 positions: out and lse equal the full causal
    call's last rows, and dk, dv its gradients when only those rows carry a gradient."""
    fn = _operations()[name]
    q, k, v, dout = _inputs(17, 17, seed=5)
    dout[:, :-6] = 0
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = fn(*full, is_causal=True, return_lse=True)
    _, dk, dv = torch.autograd.grad(out, full, dout)
    short = [q[:, -6:].clone().requires_grad_(), k.clone().requires_grad_(), v.clone()]
    short[2].requires_grad_()
    got, got_lse = fn(*short, is_causal=True, return_lse=True)
    got_dq, got_dk, got_dv = torch.autograd.grad(got, short, dout[:, -6:])
    (dq_full,) = torch.autograd.grad(fn(*full, is_causal=True), full[0], dout)
    pairs = [("out", got, out[:, -6:]), ("lse", got_lse, lse[..., -6:]),
             ("dq", got_dq, dq_full[:, -6:]), ("dk", got_dk, dk), ("dv", got_dv, dv)]  # fmt: skip
    for label, a, b in pairs:
        torch.testing.assert_close(a, b, **TIGHT, msg=lambda m, n=label: f"{name} {n}: {m}")


@pytest.mark.parametrize("name", list(_operations()))
def test_no_kernel_gets_a_rectangular_causal_call(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernels' causal mask is top-left: every causal kernel call of an end-aligned query is
    square, forward and backward (SDPA and FlashAttention would otherwise align it their own
    way)."""
    seen: list[tuple[bool, int, int]] = []
    forward, backward = Backend.forward, Backend.backward

    def spy_forward(self: Backend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any):
        seen.append((bool(kw.get("is_causal")), q.shape[1], k.shape[1]))
        return forward(self, q, k, v, **kw)

    def spy_backward(self: Backend, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     *args: Any, **kw: Any):  # fmt: skip
        seen.append((bool(kw.get("is_causal")), q.shape[1], k.shape[1]))
        return backward(self, dout, q, k, *args, **kw)

    monkeypatch.setattr(Backend, "forward", spy_forward)
    monkeypatch.setattr(Backend, "backward", spy_backward)
    q, k, v, _ = _inputs(5, 17)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    _operations()[name](*leaves, is_causal=True).sum().backward()
    assert any(causal for causal, _, _ in seen), f"{name}: no causal call recorded: {seen}"
    rectangular = [call for call in seen if call[0] and call[1] != call[2]]
    assert not rectangular, f"{name}: rectangular causal kernel calls {rectangular}"


@pytest.mark.parametrize("name", list(_operations()))
def test_compiled_short_query_equals_eager(name: str) -> None:
    """The custom operator under torch.compile runs the eager call: the same convention."""
    fn = _operations()[name]
    q, k, v, _ = _inputs(5, 17, seed=9)
    compiled = torch.compile(lambda q, k, v: fn(q, k, v, is_causal=True), backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v), fn(q, k, v, is_causal=True), **TIGHT)


# -- refused before any work ----------------------------------------------------------------------
@pytest.mark.parametrize("name", list(_operations()))
def test_causal_query_longer_than_key_raises(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_kernel(*args: object, **kwargs: object) -> None:
        raise AssertionError("a kernel ran before the error")

    monkeypatch.setattr(Backend, "forward", no_kernel)
    q, k, v, _ = _inputs(9, 6)
    with pytest.raises(ValueError, match=r"query.*(longer|shorter).*9, 4, 8.*6, 2, 8"):
        _operations()[name](q, k, v, is_causal=True)
    monkeypatch.undo()
    if name != "dilated_attention":  # dilated attention is self-attention: equal lengths only
        out = _operations()[name](q, k, v, is_causal=False)  # cross-attention: any lengths
        assert out.shape == q.shape


@pytest.mark.parametrize("backend", ["triton", "flex", "flash_attn4"])
def test_block_sparse_kernels_with_top_left_masks_refuse_short_causal_queries(
    backend: str,
) -> None:
    """Named, the block-sparse plan kernels (whose causal mask is top-left) raise, saying why
    and what runs it; chosen automatically, the plan runs (the oracle tests above)."""
    q, k, v, _ = _inputs(5, 17)
    match = rf"'{backend}' .*query shorter than the key.*end-aligned.*backend=None"
    with pytest.raises(ValueError, match=match):
        da.block_sparse_attention(q, k, v, P.LocalWindow(1), block_size=4, is_causal=True,
                                  backend=backend)  # fmt: skip


# -- CUDA: kernels whose own causal mask is aligned otherwise -------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("backend", [None, "sdpa_flash", "sdpa_efficient", "sdpa_cudnn",
                                     "flash_attn2", "flash_attn3", "flash_attn4"])  # fmt: skip
def test_gpu_attention_short_causal_query_matches_oracle(backend: str | None) -> None:
    """SDPA's ``is_causal`` is top-left, FlashAttention's bottom-right: each runs square causal
    calls here, and every one gives the end-aligned result (before, the SDPA and FlashAttention
    kernels refused a rectangular causal call, and automatic choice fell back to others)."""
    # head_dim 64: every kernel here runs it with gradients (FA4's sm90 backward needs >= 32)
    q, k, v, dout = (x.to(torch.bfloat16).to(F64) for x in _inputs(37, 100, head_dim=64))
    dev = [x.cuda().to(torch.bfloat16).requires_grad_() for x in (q, k, v)]
    reasons = da.backend_reasons(*dev, is_causal=True)  # with gradients, as the call below
    if backend is not None and reasons[backend]:
        pytest.skip(f"{backend} cannot run here: {reasons[backend]}")
    out, lse = da.attention(*dev, is_causal=True, backend=backend, return_lse=True)
    grads = torch.autograd.grad(out, dev, dout.cuda().to(torch.bfloat16))
    want = _oracle(q, k, v, dout, _end_aligned(37, 100).expand(H, -1, -1))
    got = [out, lse, *grads]
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        scale = float(w.abs().max())
        torch.testing.assert_close(g.double().cpu(), w, atol=3e-2 * scale, rtol=3e-2,
                                   msg=lambda m, n=name: f"{backend} {n}: {m}")  # fmt: skip


@pytest.mark.gpu
def test_gpu_block_sparse_short_causal_query_matches_oracle() -> None:
    """On CUDA automatic choice runs the plan on a dense kernel for an end-aligned query."""
    pattern = P.LocalWindow(1) | P.Random(0.3, seed=4)
    q, k, v, dout = (x.to(torch.bfloat16).to(F64) for x in _inputs(100, 300))
    dev = [x.cuda().to(torch.bfloat16).requires_grad_() for x in (q, k, v)]
    out, lse = da.block_sparse_attention(
        *dev, pattern, block_size=64, is_causal=True, return_lse=True
    )
    grads = torch.autograd.grad(out, dev, dout.cuda().to(torch.bfloat16))
    want = _oracle(q, k, v, dout, token_mask(pattern, 64, 100, 300, True).expand(H, -1, -1))
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), [out, lse, *grads], want, strict=True):
        scale = float(w[torch.isfinite(w)].abs().max())
        torch.testing.assert_close(g.double().cpu(), w, atol=3e-2 * scale, rtol=3e-2,
                                   msg=lambda m, n=name: f"{n}: {m}")  # fmt: skip
