"""Soft-capped scores, local windows and attention sinks on our Triton kernels (Note [Soft-capped
scores in the kernels], Note [Local windows in the kernels] in
``backends/triton_kernels/device.py``): the dense kernels (windows, soft-capping), the fused dilated
engine and the block-sparse kernels (soft-capping), against the float64 oracle on out, lse and every
gradient (the sinks' too); tiles outside a window are skipped, not masked; a window wider than the
call runs the very blocks of no window. The static decode step's are in
``tests/ops/test_static_decoding.py``.

On a GPU the tests run in bfloat16 and float16 (``-m gpu``); on a machine without one,
``TRITON_INTERPRET=1 pytest tests/backends/test_triton_scores.py`` runs them through Triton's
interpreter (float32 and float16; slow). Without either they skip, but for the checks of the
backend's declarations and reasons.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
from support.oracle import dilated_multiplicity, masked_attention, oracle_attention
from support.tolerances import LOW_PRECISION, TOLERANCES, assert_close_to_oracle
from support.triton import KERNEL_DEVICES, poison_new_buffers, skip_without_triton
from torch import Tensor

from dilated_attention import attention, block_sparse_attention, dilated_attention
from dilated_attention import patterns as P
from dilated_attention.backends import KernelInputs, get_backend
from dilated_attention.backends import triton as triton_backend
from dilated_attention.core.contract import Window
from dilated_attention.core.execution import fused_runner

F64 = torch.float64
#: Oracle of a case: (q, k, v, sinks or None, compute dtype) -> (out, lse).
Oracle = Callable[[Tensor, Tensor, Tensor, Tensor | None, torch.dtype], tuple[Tensor, Tensor]]


def _draw(b: int, nq: int, nk: int, h: int, hkv: int, d: int, seed: int) -> list[Tensor]:
    """q, k, v, dout (float64) and sinks (H,)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(b, nq, h, d), (b, nk, hkv, d), (b, nk, hkv, d), (b, nq, h, d), (h,)]
    return [torch.randn(s, generator=gen, dtype=F64) for s in shapes]


def _check(
    device: str,
    dtype: torch.dtype,
    tensors: list[Tensor],
    run: Callable[..., tuple[Tensor, Tensor]],
    oracle: Oracle,
    with_sinks: bool = False,
) -> None:
    """``run(q, k, v, sinks)`` on ``device`` in ``dtype`` against the float64 ``oracle`` of the
    same rounded inputs: out, lse and the gradients of q, k, v (and the sinks); in 16-bit also
    within twice the error of the oracle computed in ``dtype`` (``assert_close_to_oracle``)."""
    q, k, v, dout, sinks = tensors
    exact = [x.to(dtype).to(F64) for x in (q, k, v, sinks)]
    count = 4 if with_sinks else 3
    leaves = [x.to(device, dtype).requires_grad_() for x in exact[:count]]
    out, lse = run(*leaves[:3], leaves[3] if with_sinks else None)
    grads = torch.autograd.grad(out, leaves, dout.to(device, dtype))

    def reference(compute: torch.dtype) -> tuple[list[Tensor], tuple[Tensor, ...]]:
        ins = [x.to(compute).requires_grad_() for x in exact[:count]]
        want = oracle(*ins[:3], ins[3] if with_sinks else None, compute)
        return [*want], torch.autograd.grad(want[0], ins, dout.to(dtype).to(compute))

    (want, want_lse), want_grads = reference(F64)
    low: list[Any] = [None] * (2 + count)
    if dtype in LOW_PRECISION:
        (low_out, low_lse), low_grads = reference(dtype)
        low = [low_out, low_lse, *low_grads]
    assert_close_to_oracle(out.detach().cpu(), want, low[0], name="out", dtype=dtype)
    assert_close_to_oracle(lse.cpu(), want_lse, low[1], name="lse", dtype=dtype)
    names = ("dq", "dk", "dv", "dsinks")
    for name, g, w, s in zip(names, grads, want_grads, low[2:], strict=False):
        assert_close_to_oracle(g.cpu(), w, s, name=name, dtype=dtype, grad=True)


@dataclass(frozen=True)
class Dense:
    id: str
    nq: int
    nk: int
    h: int
    hkv: int
    d: int
    causal: bool
    window: tuple[int, int] | None
    softcap: float | None
    mask: bool = False
    sinks: bool = False


DENSE = [
    Dense("left-causal-gqa", 150, 150, 4, 2, 32, True, (40, 0), None, sinks=True),
    Dense("both-sides-softcap-mask-d40", 150, 150, 4, 2, 40, False, (23, 17), 5.0, mask=True),
    Dense("left0-causal", 150, 150, 2, 1, 32, True, (0, 0), None),
    Dense("wider-than-the-call-softcap", 150, 150, 2, 2, 32, False, (500, 900), 2.0),
    Dense("rectangular-bottom-right-mask", 70, 150, 2, 2, 32, False, (30, 10), None, mask=True),
    Dense("query-longer-empty-rows-softcap", 150, 70, 2, 2, 32, False, (30, 10), 3.0),
    Dense("softcap-causal-mask-mqa", 150, 150, 4, 1, 32, True, None, 3.0, mask=True, sinks=True),
    Dense("unbounded-left", 150, 150, 2, 2, 32, False, (-1, 9), None),
    Dense("end-aligned-causal-softcap", 40, 150, 2, 2, 32, True, (50, 0), 4.0),
]


def _row_loads(monkeypatch: pytest.MonkeyPatch, row_loads: str) -> None:
    """Force the forward's row loads (Note [Rows through tensor descriptors]): through
    pointers, or through tensor descriptors wherever the layout allows (16-bit)."""
    kernels = triton_backend._kernels()
    policy = "never" if row_loads == "pointers" else "always"
    monkeypatch.setattr(kernels, "DESCRIPTOR_POLICY", policy)


def _padding(b: int, n: int, seed: int) -> Tensor:
    """(B, N) bool: a quarter of the keys, and a run of 40 in row 1, hidden."""
    mask = torch.rand(b, n, generator=torch.Generator().manual_seed(seed)) < 0.25
    mask[-1, 20:60] = True
    return mask


DENSE_PARAMS = [pytest.param(c, "pointers", id=c.id) for c in DENSE] + [
    pytest.param(c, "descriptors", id=f"{c.id}-descriptors") for c in DENSE[:2]
]


@pytest.mark.parametrize(("case", "row_loads"), DENSE_PARAMS)
@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_dense_windows_and_softcap_match_the_oracle(
    device: str,
    dtypes: list[torch.dtype],
    case: Dense,
    row_loads: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``attention(..., window_size=, softcap=, backend="triton")``: windows on one side, on
    both, of width 0, wider than the call, unbounded on one side, bottom-right aligned on
    rectangular calls (rows that see no key), with causality, GQA, a head dim that is no power
    of two and key padding; soft-capping alone and with a window; every new buffer NaN-filled
    (a row no kernel writes shows)."""
    skip_without_triton(device)
    _row_loads(monkeypatch, row_loads)
    poison_new_buffers(monkeypatch)
    c = case
    tensors = _draw(2, c.nq, c.nk, c.h, c.hkv, c.d, seed=c.nq + c.nk)
    mask = _padding(2, c.nk, seed=3) if c.mask else None
    options = dict(is_causal=c.causal, window_size=c.window, softcap=c.softcap)

    def run(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None) -> tuple[Tensor, Tensor]:
        dev_mask = None if mask is None else mask.to(q.device)
        return attention(q, k, v, key_padding_mask=dev_mask, sinks=sinks, backend="triton",
                         return_lse=True, **options)  # fmt: skip

    def oracle(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, compute: torch.dtype):
        return oracle_attention(q, k, v, key_padding_mask=mask, sinks=sinks,
                                compute_dtype=compute, **options)  # fmt: skip

    for dtype in dtypes:
        _check(device, dtype, tensors, run, oracle, with_sinks=c.sinks)


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize(
    ("causal", "window", "softcap"),
    [(True, (255, 0), None), (False, (100, 100), 30.0), (True, (511, 0), 50.0)],
    ids=["causal-256", "both-sides-softcap", "causal-512-softcap"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_dense_windows_at_gpu_tile_sizes(
    dim: int,
    causal: bool,
    window: tuple[int, int],
    softcap: float | None,
    dtype: torch.dtype,
) -> None:
    """Windows several 128-row tiles wide on a call of 1,031 rows, at the head dims whose
    forward reads rows through tensor descriptors on Hopper: the blocks inside run unmasked,
    the two edges checked, the rest skipped."""
    skip_without_triton("cuda")
    tensors = _draw(2, 1031, 1031, 4, 2, dim, seed=dim)
    options = dict(is_causal=causal, window_size=window, softcap=softcap)

    def run(q: Tensor, k: Tensor, v: Tensor, _: Tensor | None) -> tuple[Tensor, Tensor]:
        return attention(q, k, v, backend="triton", return_lse=True, **options)

    def oracle(q: Tensor, k: Tensor, v: Tensor, _: Tensor | None, compute: torch.dtype):
        return oracle_attention(q, k, v, compute_dtype=compute, **options)

    _check("cuda", dtype, tensors, run, oracle)


@pytest.mark.parametrize("row_loads", ["pointers", "descriptors"])
@pytest.mark.parametrize(
    ("causal", "window"), [(True, (48, 0)), (False, (48, 32))], ids=["causal", "both-sides"]
)
@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_tiles_outside_the_window_are_skipped_not_masked(
    device: str,
    dtypes: list[torch.dtype],
    causal: bool,
    window: tuple[int, int],
    row_loads: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Keys 0-127 hold NaN: a kernel that loaded their tile and masked it would carry ``0 *
    NaN`` into every row of its tiles. Rows whose window starts past key 128 plus a tile (any
    tile of at most 128 rows) never load that tile: their out, lse and dq are finite and equal
    the float64 oracle's, and so are dk and dv of the keys whose query tiles hold only such
    rows. The kernel is called as it is (``Backend.forward`` would rerun a CPU call holding a
    NaN on the exact path)."""
    skip_without_triton(device)
    _row_loads(monkeypatch, row_loads)
    n, first_row, first_key = 768, 320, 512
    q, k, v, dout, _ = _draw(1, n, n, 2, 1, 32, seed=9)
    backend = get_backend("triton")
    options: dict[str, Any] = dict(scale=32**-0.5, is_causal=causal, key_mask=None,
                                   dropout_p=0.0, window=Window(*window))  # fmt: skip
    for dtype in dtypes:
        qd, kd, vd, dd = (x.to(device, dtype) for x in (q, k, v, dout))
        kd[:, :128], vd[:, :128] = float("nan"), float("nan")
        res = backend._forward(qd, kd, vd, **options)
        grads = backend._backward(dd, qd, kd, vd, res.out, res.lse, None, **options)
        exact = [x.to(dtype).to(F64).requires_grad_() for x in (q, k, v)]
        want, want_lse = oracle_attention(*exact, is_causal=causal, window_size=window)
        want_grads = torch.autograd.grad(want, exact, dout.to(dtype).to(F64))
        rows, keys = slice(first_row, None), slice(first_key, None)
        for name, got, ref, at in (
            ("out", res.out, want, rows), ("dq", grads[0], want_grads[0], rows),
            ("dk", grads[1], want_grads[1], keys), ("dv", grads[2], want_grads[2], keys),
        ):  # fmt: skip
            part = got[:, at].cpu().double()
            assert bool(part.isfinite().all()), f"{name}: a skipped tile's NaN reached it"
            _close(part, ref[:, at].detach(), dtype, name)
        _close(res.lse[:, :, rows].cpu().double(), want_lse[:, :, rows], dtype, "lse")


def _close(got: Tensor, want: Tensor, dtype: torch.dtype, name: str) -> None:
    """``got`` within the table's tolerance of ``dtype`` (tests/support/tolerances.py) of the
    float64 ``want``, relative to the largest magnitude of ``want`` where it passes 1 (gradients
    of scaled inputs); for the checks without a same-dtype reference."""
    tol = TOLERANCES[dtype]
    largest = max(1.0, float(want[want.isfinite()].abs().max())) if want.numel() else 1.0
    torch.testing.assert_close(
        got.double(), want, atol=tol.grad_atol * largest, rtol=tol.grad_rtol,
        msg=lambda m: f"{name} ({dtype}): {m}",
    )  # fmt: skip


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_a_window_wider_than_the_call_runs_the_blocks_of_none(
    device: str, dtypes: list[torch.dtype], causal: bool
) -> None:
    """A window that reaches past every row visits the blocks of the call without a window, the
    full ones unmasked (Note [Local windows in the kernels]): the same bits, forward and
    backward."""
    skip_without_triton(device)
    q, k, v, dout, _ = _draw(1, 150, 150, 2, 1, 32, seed=4)
    backend = get_backend("triton")
    base: dict[str, Any] = dict(scale=0.2, is_causal=causal, key_mask=None, dropout_p=0.0)
    for dtype in dtypes:
        qd, kd, vd, dd = (x.to(device, dtype) for x in (q, k, v, dout))
        results = []
        for options in (base, {**base, "window": Window(150, 500)}):
            res = backend._forward(qd, kd, vd, **options)
            grads = backend._backward(dd, qd, kd, vd, res.out, res.lse, None, **options)
            results.append([res.out, res.lse, *grads])
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results, strict=True):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("window", [None, (37, 5)], ids=["no-window", "window"])
@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_softcap_at_extreme_logits(
    device: str, dtypes: list[torch.dtype], window: tuple[int, int] | None
) -> None:
    """Scores near the float range (logits ~1e34 in float32 inputs, ~1e5 in 16-bit ones, whose
    products the kernels sum in float32) are capped before the softmax: out, lse and every
    gradient finite and equal to the float64 oracle's, causal, with sinks, with a window and
    without (no same-dtype reference: 16-bit products that large overflow)."""
    skip_without_triton(device)
    q, k, v, dout, sinks = _draw(1, 130, 130, 2, 1, 32, seed=6)
    options = dict(is_causal=True, window_size=window, softcap=20.0)
    for dtype in dtypes:
        big = 1e17 if dtype == torch.float32 else 4e2
        exact = [x.to(dtype).to(F64) for x in (q * big, k * big, v, sinks)]
        leaves = [x.to(device, dtype).requires_grad_() for x in exact]
        out, lse = attention(*leaves[:3], sinks=leaves[3], backend="triton", return_lse=True,
                             **options)  # fmt: skip
        grads = torch.autograd.grad(out, leaves, dout.to(device, dtype))
        ins = [x.clone().requires_grad_() for x in exact]
        want, want_lse = oracle_attention(*ins[:3], sinks=ins[3], **options)
        want_grads = torch.autograd.grad(want, ins, dout.to(dtype).to(F64))
        for name, got, ref in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), (out, lse, *grads),
                                  (want, want_lse, *want_grads), strict=True):  # fmt: skip
            assert bool(got.isfinite().all()), name
            _close(got.detach().cpu(), ref.detach(), dtype, name)


# -- the fused dilated engine ----------------------------------------------------------------------
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_fused_dilated_softcap_and_sinks(
    device: str,
    dtypes: list[torch.dtype],
    causal: bool,
    packed: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``dilated_attention(..., softcap=, sinks=, backend="triton")`` runs the fused engine
    with the cap in every branch launch (never dropped), forward and backward: GQA, ragged
    rates, a padding mask or packed documents, against the float64 oracle."""
    skip_without_triton(device)
    caps: list[float | None] = []
    real = fused_runner.fused_forward

    def spy(*args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        caps.append(kwargs.get("softcap"))
        return real(*args, **kwargs)

    monkeypatch.setattr(fused_runner, "fused_forward", spy)
    segs, rates, n = [48, 120, 240], [1, 3, 4], 240
    tensors = _draw(1 if packed else 2, n, n, 4, 2, 32, seed=12)
    mask = None if packed else _padding(2, n, seed=5)
    cu = [0, 110, 240] if packed else None
    options = dict(is_causal=causal, softcap=4.0)

    def run(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None) -> tuple[Tensor, Tensor]:
        dev_mask = None if mask is None else mask.to(q.device)
        return dilated_attention(q, k, v, segs, rates, key_padding_mask=dev_mask, sinks=sinks,
                                 cu_seqlens=cu, backend="triton", return_lse=True,
                                 **options)  # fmt: skip

    def oracle(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, compute: torch.dtype):
        weight = dilated_multiplicity(n, 4, segs, rates, is_causal=causal)
        if packed:  # each document alone: its own segments, no key of the other
            weight = torch.zeros_like(weight)
            for a, b in itertools.pairwise(cu):
                weight[:, a:b, a:b] = dilated_multiplicity(b - a, 4, segs, rates,
                                                           is_causal=causal)  # fmt: skip
        return masked_attention(q, k, v, weight, key_padding_mask=mask, sinks=sinks,
                                compute_dtype=compute, softcap=options["softcap"])  # fmt: skip

    for dtype in dtypes:
        caps.clear()
        _check(device, dtype, tensors, run, oracle, with_sinks=True)
        assert caps and all(cap == options["softcap"] for cap in caps), caps


@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_fused_softcap_has_no_double_backward(device: str, dtypes: list[torch.dtype]) -> None:
    """The fused engine's differentiable recompute knows causality and masks only: under
    ``create_graph=True`` with a soft-cap the gradients raise a clear error when differentiated,
    never a recompute without the cap."""
    skip_without_triton(device)
    q = torch.randn(1, 40, 2, 16, dtype=dtypes[0], device=device, requires_grad=True)
    out = dilated_attention(q, q, q, [8, 40], [1, 2], softcap=3.0, backend="triton")
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="no higher-order gradients"):
        torch.autograd.grad(dq.sum(), q)


# -- block-sparse ----------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_block_sparse_softcap(device: str, dtypes: list[torch.dtype], causal: bool) -> None:
    """``block_sparse_attention(..., softcap=, backend="triton")``: the block-sparse kernels cap
    every score, forward and backward (GQA, a ragged last block, sinks)."""
    skip_without_triton(device)
    n, block = 200, 64
    tensors = _draw(2, n, n, 4, 2, 32, seed=7)
    pattern = P.LocalWindow(1) | P.Random(0.3, seed=1)
    blocks = torch.arange(n) // block
    keep = pattern.block_mask(4, 4)[blocks[:, None], blocks[None, :]]
    if causal:
        keep = keep & torch.ones(n, n, dtype=torch.bool).tril()

    def run(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None) -> tuple[Tensor, Tensor]:
        return block_sparse_attention(q, k, v, pattern, block_size=block, is_causal=causal,
                                      softcap=2.5, sinks=sinks, backend="triton",
                                      return_lse=True)  # fmt: skip

    def oracle(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, compute: torch.dtype):
        return masked_attention(q, k, v, keep.long().expand(4, n, n), softcap=2.5, sinks=sinks,
                                compute_dtype=compute)  # fmt: skip

    for dtype in dtypes:
        _check(device, dtype, tensors, run, oracle, with_sinks=True)


# -- declarations and reasons (no kernel runs) -----------------------------------------------------
def _inputs(**changes: Any) -> KernelInputs:
    base = KernelInputs(device=torch.device("cpu"), dtype=torch.float16, head_dim=64,
                        num_heads=4, num_kv_heads=2, query_len=256, key_len=256)  # fmt: skip
    return replace(base, **changes)


def test_the_backend_takes_softcap_and_windows() -> None:
    """The Triton backend applies both (forward and backward): no reason names them, so the
    registries pick it (and its fused plan kernel) for such calls."""
    backend = get_backend("triton")
    assert backend.supports_softcap and backend.supports_window
    reasons = backend.capability_reasons(_inputs(softcap=True, window=True, requires_grad=True))
    assert not [r for r in reasons if "soft-capping" in r or "window" in r], reasons


def test_block_sparse_kernels_take_softcap_but_refuse_windows() -> None:
    """The block-sparse kernels cap scores (no reason) but apply no window: a reason, never a
    window dropped."""
    backend = get_backend("triton")
    capped = triton_backend.block_sparse_reasons(backend, _inputs(block_size=64, softcap=True))
    assert not [r for r in capped if "soft" in r], capped
    windowed = triton_backend.block_sparse_reasons(backend, _inputs(block_size=64, window=True))
    assert "no local window in the block-sparse Triton kernels" in windowed


def test_window_offsets_of_a_launch() -> None:
    """A window's offsets ``win_lo <= j - i <= win_hi`` for a launch of Nq query rows against
    Nk keys (bottom-right: row i at key row i + Nk - Nq), unbounded or too wide sides clamped to
    the rows' span; only dense launches take one."""
    pytest.importorskip("triton")
    kernels = triton_backend._kernels()
    dense = kernels.Branch(0, 70, 150, 70, 150, 1)

    def offsets(window: Window) -> tuple[int, int]:
        scores = kernels._scores(dense, None, window)
        assert scores.window
        return scores.win_lo, scores.win_hi

    assert offsets(Window(30, 10)) == (50, 90)
    assert offsets(Window(-1, -1)) == (-70, 150)
    assert offsets(Window(10**9, 10**9)) == (-70, 150)
    assert offsets(Window(0, 0)) == (80, 80)
    assert kernels._scores(dense, 2.0, None).forward(0.5) == (
        kernels.LOG2E, 1.0, 0, 0, 0.25, 2.0,
    )  # fmt: skip
    with pytest.raises(ValueError, match="dense launch"):
        kernels._scores(kernels.Branch(0, 32, 32, 64, 64, 2), None, Window(4, 0))
