"""NSA's compressed keys: ``compress_kv`` (windows of ``block`` positions every ``stride``,
mean-pooled) against a loop over the windows in float64, with gradients; and
``compressed_key_mask`` (a compressed key is visible once its whole window lies at or before
the query) against a loop over queries and windows; bad arguments.
"""

from __future__ import annotations

import pytest
import torch
from support.tolerances import rounding_floor
from torch import Tensor

from dilated_attention.sparse import compress_kv, compressed_key_mask
from dilated_attention.sparse.compression import window_means


def windows(n: int, block: int, stride: int) -> list[range]:
    """The whole windows ``[c * stride, c * stride + block)`` inside ``n`` positions."""
    found, start = [], 0
    while start + block <= n:
        found.append(range(start, start + block))
        start += stride
    return found


def pooled(x: Tensor, block: int, stride: int) -> Tensor:
    """(B, N, H, D) -> (B, Nc, H, D): the mean of every whole window, one at a time."""
    means = [x[:, list(w)].mean(1) for w in windows(x.shape[1], block, stride)]
    return torch.stack(means, 1) if means else x[:, :0]


SHAPES = {
    # name: (N, block, stride)
    "nsa-overlapping": (40, 8, 4),
    "odd-overlap": (23, 5, 3),
    "tiling": (24, 6, 6),
    "tail-left-out": (26, 6, 6),
    "stride-1": (9, 4, 1),
    "one-window": (7, 7, 2),
    "shorter-than-a-window": (5, 6, 2),
}


@pytest.mark.parametrize(("n", "block", "stride"), SHAPES.values(), ids=SHAPES.keys())
def test_matches_the_window_loop_with_gradients(n: int, block: int, stride: int) -> None:
    key = torch.randn(2, n, 3, 8, dtype=torch.float64, requires_grad=True)
    value = torch.randn(2, n, 3, 8, dtype=torch.float64, requires_grad=True)
    k_cmp, v_cmp = compress_kv(key, value, block=block, stride=stride)
    count = len(windows(n, block, stride))
    assert k_cmp.shape == v_cmp.shape == (2, count, 3, 8)
    k_ref, v_ref = pooled(key, block, stride), pooled(value, block, stride)
    torch.testing.assert_close(k_cmp, k_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(v_cmp, v_ref, rtol=1e-12, atol=1e-12)
    if count:
        dk, dv = torch.randn_like(k_cmp), torch.randn_like(v_cmp)
        grads = torch.autograd.grad((k_cmp, v_cmp), (key, value), (dk, dv))
        expected = torch.autograd.grad((k_ref, v_ref), (key, value), (dk, dv))
        for got, want in zip(grads, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("block", "stride"), [(5, 3), (6, 6), (8, 4)])
def test_twice_differentiable_on_strided_input(block: int, stride: int) -> None:
    """The pooling's own gradient (pieces spread over their positions) is differentiable, and
    a key that is a strided view (heads before positions in memory) pools as its copy."""
    key = torch.randn(1, 3, 23, 2, dtype=torch.float64).transpose(1, 2).requires_grad_()
    value = torch.randn(1, 23, 3, 2, dtype=torch.float64, requires_grad=True)

    def pool(k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return compress_kv(k, v, block=block, stride=stride)

    torch.testing.assert_close(pool(key, value)[0], pooled(key.contiguous(), block, stride))
    assert torch.autograd.gradcheck(pool, (key, value))
    assert torch.autograd.gradgradcheck(pool, (key, value))


def test_torch_func_transforms_and_forward_mode() -> None:
    """``torch.func.grad``, ``vmap`` (over a batch of keys, and of gradients), ``jvp`` and
    forward-mode dual tensors through the pooling, against the window loop's."""
    key = torch.randn(2, 23, 3, 4, dtype=torch.float64)
    tangent = torch.randn_like(key)

    def pool(x: Tensor) -> Tensor:
        return compress_kv(x, x, block=5, stride=3)[0]

    leaf = key.clone().requires_grad_()
    (want,) = torch.autograd.grad(pooled(leaf, 5, 3).pow(2).sum(), leaf)
    torch.testing.assert_close(torch.func.grad(lambda x: pool(x).pow(2).sum())(key), want)
    stack = torch.randn(3, *key.shape, dtype=torch.float64)
    torch.testing.assert_close(torch.func.vmap(pool)(stack),
                               torch.stack([pooled(x, 5, 3) for x in stack]))  # fmt: skip
    grads = torch.func.vmap(torch.func.grad(lambda x: pool(x).sum()))(stack)
    torch.testing.assert_close(grads[1], torch.func.grad(lambda x: pool(x).sum())(stack[1]))
    _, pushed = torch.func.jvp(pool, (key,), (tangent,))
    torch.testing.assert_close(pushed, pooled(tangent, 5, 3))
    with torch.autograd.forward_ad.dual_level():
        dual = pool(torch.autograd.forward_ad.make_dual(key, tangent))
        torch.testing.assert_close(torch.autograd.forward_ad.unpack_dual(dual).tangent,
                                   pooled(tangent, 5, 3))  # fmt: skip


@pytest.mark.parametrize(("n", "block", "stride"), [(30, 4, 6), (31, 3, 5), (9, 2, 9)])
def test_window_means_of_windows_apart(n: int, block: int, stride: int) -> None:
    """``window_means`` also pools windows with gaps between them (``stride > block``, as
    nothing in NSA does): positions in no window get no gradient."""
    x = torch.randn(1, n, 2, 3, dtype=torch.float64, requires_grad=True)
    means = window_means(x, block, stride)
    torch.testing.assert_close(means, pooled(x, block, stride), rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x: window_means(x, block, stride), (x,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_keeps_its_dtype_and_rounds_the_exact_mean(dtype: torch.dtype) -> None:
    """The pooled keys are the exact window means rounded to the input dtype. Values of 3000 in
    windows of 32: their sum (96000) is past float16's largest value (65504), so a mean made
    as a sum in the input dtype would be inf there."""
    key = (torch.randn(1, 64, 2, 16) + 3000).to(dtype)
    k_cmp, v_cmp = compress_kv(key, key, block=32, stride=16)
    assert k_cmp.dtype == v_cmp.dtype == dtype
    expected = pooled(key.double(), 32, 16)
    torch.testing.assert_close(k_cmp.double(), expected, rtol=0,
                               atol=rounding_floor(expected, dtype))  # fmt: skip


@pytest.mark.parametrize(("nq", "nk"), [(40, 40), (1, 40), (13, 40), (3, 5)])
@pytest.mark.parametrize(("block", "stride"), [(8, 4), (5, 3), (6, 6), (1, 1)])
def test_visibility_matches_the_loop(nq: int, nk: int, block: int, stride: int) -> None:
    """Query row ``i`` (position ``nk - nq + i``) sees window ``c`` iff its last position is
    at or before the query's."""
    mask = compressed_key_mask(nq, nk, block=block, stride=stride)
    found = windows(nk, block, stride)
    assert mask.dtype == torch.bool and mask.shape == (nq, len(found))
    for i in range(nq):
        p = nk - nq + i
        for c, window in enumerate(found):
            assert bool(mask[i, c]) == all(t <= p for t in window), (i, c)


def test_the_mask_is_made_on_the_device_asked() -> None:
    mask = compressed_key_mask(4, 8, block=4, stride=2, device="meta")
    assert mask.device.type == "meta" and mask.shape == (4, 3)


def test_rows_before_the_first_window_ends_see_nothing() -> None:
    mask = compressed_key_mask(10, 10, block=4, stride=2)
    assert not mask[:3].any() and mask[3:, 0].all()


_KEY = torch.randn(1, 8, 2, 4)
BAD = {
    # name: (arguments changed, error type, message)
    "block-0": ({"block": 0}, ValueError, "block must be a positive int"),
    "stride-bool": ({"stride": True}, ValueError, "stride must be a positive int"),
    "stride-above-block": ({"stride": 5}, ValueError, "stride must be at most block"),
    "value-shape": ({"value": torch.randn(1, 8, 2, 5)}, ValueError, "same shape"),
    "value-dtype": ({"value": _KEY.double()}, TypeError, "same dtype as key"),
    "value-device": ({"value": _KEY.to("meta")}, ValueError, "same device as key"),
    "key-3d": ({"key": torch.randn(8, 2, 4)}, ValueError, "key must have shape"),
    "key-list": ({"key": [1.0]}, TypeError, "key must be a torch.Tensor"),
}  # fmt: skip


@pytest.mark.parametrize(("change", "error", "message"), BAD.values(), ids=BAD.keys())
def test_compress_kv_bad_arguments(change: dict, error: type, message: str) -> None:
    arguments = {"key": _KEY, "value": _KEY, "block": 4, "stride": 2, **change}
    with pytest.raises(error, match=message):
        compress_kv(arguments.pop("key"), arguments.pop("value"), **arguments)


MASK_BAD = {
    "query-longer": ({"query_len": 9}, ValueError, "query_len must be at most key_len"),
    "query-0": ({"query_len": 0}, ValueError, "query_len must be a positive int"),
    "key-float": ({"key_len": 8.0}, ValueError, "key_len must be a positive int"),
    "stride-above-block": ({"stride": 5}, ValueError, "stride must be at most block"),
    "device-int": ({"device": 0}, TypeError, "device must be a torch.device"),
}


@pytest.mark.parametrize(("change", "error", "message"), MASK_BAD.values(), ids=MASK_BAD.keys())
def test_compressed_key_mask_bad_arguments(change: dict, error: type, message: str) -> None:
    arguments = {"query_len": 4, "key_len": 8, "block": 4, "stride": 2, **change}
    with pytest.raises(error, match=message):
        compressed_key_mask(arguments.pop("query_len"), arguments.pop("key_len"), **arguments)
