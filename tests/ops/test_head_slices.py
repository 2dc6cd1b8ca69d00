"""A dilated call on a slice of a layer's heads (Note [Heads from a later layer head] in
``core/geometry/schedule.py``): with ``first_head = j0`` the call's head ``h`` keeps the layer
head's offset ``(j0 + h) mod r``, so the slices a head all-to-all hands each rank give the layer's
rows of those heads exactly, outputs and every gradient (float64 oracle of the whole layer)."""

from __future__ import annotations

import pytest
import torch
from support.backend_params import CPU_BACKENDS, backend_id, skip_unless_runnable
from support.oracle import oracle_dilated_attention
from support.tolerances import TOLERANCES
from support.triton import KERNEL_DEVICES, skip_without_triton

from dilated_attention.core.geometry.schedule import Schedule
from dilated_attention.resolve import DECODE, DILATED, Request, execute, resolve

TIGHT = {"atol": 1e-10, "rtol": 1e-7}
#: (segments, rates): rates above, at and below the slice's heads; ragged segments.
SCHEDULES = [((8, 16), (1, 4)), ((10, 16, 32), (3, 6, 16)), ((4,), (8,))]


def _slice_grads(q, k, v, segs, rates, causal, slices, backend=None):  # type: ignore[no-untyped-def]
    """Each slice ``(j0, heads)`` as its own call; the joined outputs and the gradients of a
    fixed random loss over them."""
    group = q.shape[2] // k.shape[2]
    outs = []
    for j0, count in slices:
        kv = slice(j0 // group, (j0 + count - 1) // group + 1)
        qs, ks, vs = q[:, :, j0 : j0 + count], k[:, :, kv], v[:, :, kv]
        request = Request.of(
            DILATED, qs, ks, vs, is_causal=causal, schedule=Schedule(segs, rates),
            first_head=j0, backend=backend,
        )  # fmt: skip
        outs.append(execute(request, qs, ks, vs, None)[0])
    out = torch.cat(outs, dim=2)
    grads = torch.autograd.grad((out * _weights(out)).sum(), (q, k, v))
    return out, grads


def _weights(out: torch.Tensor) -> torch.Tensor:
    """The loss's fixed random weights, shaped, typed and placed like ``out``."""
    gen = torch.Generator().manual_seed(1)
    return torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.device, out.dtype)


def _leaves(n: int, heads: int, kv_heads: int, dtype: torch.dtype, device: str = "cpu") -> list:
    gen = torch.Generator().manual_seed(0)
    shapes = [(2, n, heads, 8), (2, n, kv_heads, 8), (2, n, kv_heads, 8)]
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(device, dtype).requires_grad_()
            for s in shapes]  # fmt: skip


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: f"w{s[0]}r{s[1]}")
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("backend", CPU_BACKENDS, ids=backend_id)
def test_head_slices_equal_the_layer(schedule: tuple, causal: bool, ranks: int, backend) -> None:  # type: ignore[no-untyped-def]
    segs, rates = schedule
    q, k, v = _leaves(37, 8, 4, torch.float64)
    skip_unless_runnable(backend, q[:, :, :2], k[:, :, :1], v[:, :, :1], is_causal=causal,
                         key_padding_mask=None)  # fmt: skip
    heads = 8 // ranks
    out, grads = _slice_grads(q, k, v, segs, rates, causal,
                              [(r * heads, heads) for r in range(ranks)], backend)  # fmt: skip
    want, _ = oracle_dilated_attention(q, k, v, segs, rates, is_causal=causal)
    want_grads = torch.autograd.grad((want * _weights(want)).sum(), (q, k, v))
    torch.testing.assert_close(out, want, **TIGHT)
    for got, expected in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, expected, **TIGHT)


def test_a_slice_whose_offsets_move_gathers_its_rows() -> None:
    """Strided views and branch slots lay head ``h`` at offset ``h mod r``: a slice that starts
    at a head whose offset is not 0 gathers its rows; one starting at a multiple of every rate
    is the unshifted layout."""
    schedule = Schedule((8, 16), (1, 4))
    shifted = schedule.at(32, 2, 2, first_head=2)
    assert shifted.first_head == 2 and shifted.not_slotted is not None
    assert [g.offsets for g in shifted.groups if g.rate == 4] == [(2, 3)]
    assert schedule.at(32, 2, 2, first_head=4) == schedule.at(32, 2, 2)


def test_a_head_slice_is_refused_where_it_is_not_one_sequence() -> None:
    q = k = v = torch.randn(1, 8, 2, 4)
    fields = dict(schedule=Schedule((4,), (2,)), first_head=1, is_causal=True)
    with pytest.raises(ValueError, match="first_head=1: a call on a slice of a layer's heads"):
        resolve(Request.of(DECODE, q[:, :1], k, v, **fields))
    with pytest.raises(ValueError, match="on packed documents"):
        resolve(Request.of(DILATED, q, k, v, documents=(0, 3, 8), **fields))


@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_our_fused_kernels_take_the_first_head(device: str, dtypes: list[torch.dtype]) -> None:
    """The fused kernels launch with the slice's first layer head (their ``head0``)."""
    skip_without_triton(device)
    segs, rates = (10, 16, 32), (3, 6, 16)
    for dtype in dtypes:
        q, k, v = _leaves(40, 8, 4, dtype, device)
        out, grads = _slice_grads(q, k, v, segs, rates, True, [(0, 2), (2, 4), (6, 2)], "triton")
        leaves = [x.detach().double().cpu().requires_grad_() for x in (q, k, v)]
        want, _ = oracle_dilated_attention(*leaves, segs, rates, is_causal=True)
        want_grads = torch.autograd.grad((want * _weights(want)).sum(), leaves)
        tol = TOLERANCES[dtype]
        torch.testing.assert_close(out.double().cpu(), want, atol=tol.atol, rtol=tol.rtol)
        for got, expected in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(got.double().cpu(), expected, atol=tol.grad_atol,
                                       rtol=tol.grad_rtol)  # fmt: skip
