"""Bound launches (Note [Bound launches] in ``backends/triton_kernels/launch.py``): a site's
launches recorded once with its tensors as roles, replayed with a later call's tensors. The
recording is checked here against a stand-in compiled kernel (no GPU); the GPU tests run the fused
engine through replayed launches against the float64 oracle."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from dilated_attention.backends.triton_kernels import launch as L
from dilated_attention.functional import dilated_attention


class _FakeCompiled:
    """What a compiled kernel's launcher is handed (its arguments after the grid)."""

    function = "function"
    packed_metadata = "metadata"

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def run(self, *args: Any) -> None:
        self.calls.append(args)


@pytest.fixture
def fake_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    active = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda d: 7)
    monkeypatch.setattr(L, "driver", SimpleNamespace(active=active))
    monkeypatch.setattr(L, "_BOUND", {})


def _descriptor(base: torch.Tensor) -> L._Descriptor:
    return L._Descriptor(base, [2, 3], [3, 1], [1, 2], "zero")


def _record(q: torch.Tensor, out: torch.Tensor, table: torch.Tensor, mask: Any) -> _FakeCompiled:
    compiled = _FakeCompiled()
    site = ("site",)
    with L.binding(site, (q, out, mask), constants=(table,)):
        record = L.current_binding()
        assert record is not None
        args = (q, out, mask.view(torch.uint8), table, _descriptor(q), 5, 0.5)
        record.add((compiled, ("CONST",)), (4, 2), args)
    return compiled


def test_replay_puts_the_new_tensors_in_their_roles(fake_driver: None) -> None:
    q, out = torch.randn(2, 3), torch.empty(2, 3)
    mask, table = torch.zeros(4, dtype=torch.bool), torch.arange(3)
    compiled = _record(q, out, table, mask)
    q2, out2, mask2 = torch.randn(2, 3), torch.empty(2, 3), torch.ones(4, dtype=torch.bool)
    assert L.replay(("site",), (q2, out2, mask2))
    (call,) = compiled.calls
    grid, stream, rest = call[:3], call[3], call[4:]
    assert grid == (4, 2, 1) and stream == 7
    assert rest[:5] == ("function", "metadata", None, None, None)
    args = rest[5:]
    assert args[0] is q2 and args[1] is out2 and args[2] is mask2  # the mask by its address
    assert args[3] is table  # a constant the key keeps alive
    assert args[4].base is q2 and args[4].shape == [2, 3] and args[4].block_shape == [1, 2]
    assert args[5:] == (5, 0.5, "CONST")
    assert not L.replay(("other",), (q2, out2, mask2))


def test_a_launch_with_a_stranger_tensor_is_never_bound(fake_driver: None) -> None:
    """A tensor that is no role (a per-call buffer the site did not name) would be replayed as
    a dangling pointer: the site key stays unbound."""
    q, out, stranger = torch.randn(2, 3), torch.empty(2, 3), torch.empty(5)
    with L.binding(("site",), (q, out)):
        L.current_binding().add((_FakeCompiled(), ()), (1,), (q, out, stranger))  # type: ignore[union-attr]
    assert not L.replay(("site",), (q, out))


def test_roles_at_one_address_are_never_bound(fake_driver: None) -> None:
    q = torch.randn(2, 3)
    with L.binding(("site",), (q, q[0])):
        L.current_binding().add((_FakeCompiled(), ()), (1,), (q,))  # type: ignore[union-attr]
    assert not L.replay(("site",), (q, q))


def test_a_jit_launch_leaves_the_site_unbound(fake_driver: None) -> None:
    """Interpreted or hooked launches have no compiled kernel to keep."""
    q = torch.randn(2, 3)
    with L.binding(("site",), (q,)):
        L.current_binding().add(None, (1,), (q,))  # type: ignore[union-attr]
    assert not L.replay(("site",), (q,))


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv_heads", [4, 1])
def test_replayed_calls_equal_first_calls(is_causal: bool, kv_heads: int) -> None:
    """The second and third calls of a key replay bound launches with new tensors (new
    addresses, another key mask) and compute what a call through the JIT computes."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (2, 1000, 4, 64)

    def draw(heads: int) -> torch.Tensor:
        size = (*shape[:2], heads, shape[3])
        return torch.randn(size, device="cuda", dtype=torch.bfloat16, generator=gen)

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> list:
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out, lse = dilated_attention(
            *leaves, [128, 512], [1, 4], is_causal=is_causal, key_padding_mask=mask,
            backend="triton", return_lse=True,
        )  # fmt: skip
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
        return [out.detach(), lse, *grads]

    calls = []
    for _ in range(3):
        q, k, v = draw(4), draw(kv_heads), draw(kv_heads)
        mask = torch.rand(shape[:2], device="cuda", generator=gen) < 0.2
        first = run(q, k, v, mask)
        L.clear_bound()
        fresh = run(q.clone(), k.clone(), v.clone(), mask.clone())
        for a, b in zip(first, fresh, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        calls.append(len(L._BOUND))
    assert calls[0] > 0 and calls[0] == calls[1] == calls[2]


@pytest.mark.gpu
def test_the_second_call_only_replays(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call whose every site ran before computes no launch arguments: no kernel's Python
    launcher (the JIT's or ours) runs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    q, k, v = (torch.randn(1, 2048, 4, 64, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))  # fmt: skip

    def step() -> None:
        out = dilated_attention(q, k, v, [512, 2048], [1, 2], is_causal=True, backend="triton")
        out.sum().backward()

    step()
    launched: list[Any] = []
    monkeypatch.setattr(L, "launch", lambda *a: launched.append(a))  # every unbound launch
    step()
    assert launched == []
