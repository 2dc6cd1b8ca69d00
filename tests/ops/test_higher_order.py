"""Higher-order gradients (double backward): exact, or a clear error; never silently wrong.

Issue 21, item 2: the backward of every autograd Function treated the forward's ``out`` and
``lse`` as constants, so ``gradgradcheck`` failed and a gradient penalty through the layer was
wrong without any error. Every public function and CPU backend is checked here with
``torch.autograd.gradgradcheck`` in float64 and with a gradient penalty against the float64
oracle (``tests/support/oracle.py``, no library code); the ring functions must raise a clear
error (Note [Double backward] in ``dilated_attention/core/higher_order.py``).

The penalty uses ``loss = (out * w).sum()`` with a constant ``w``: the upstream gradient does not
require grad there, the case in which ``torch.autograd.function.once_differentiable`` attaches no
error and a second derivative would silently drop the attention's own curvature.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from support.block_sparse import token_mask
from support.distributed_utils import run_world
from support.oracle import masked_attention, oracle_attention, oracle_dilated_attention

import dilated_attention as da
from dilated_attention import patterns as P
from dilated_attention.backends.base import KernelInputs
from dilated_attention.backends.registry import get_backend
from dilated_attention.core.higher_order import outer_message, raised_as
from dilated_attention.sparse import moba_attention, nsa_attention

F64 = torch.float64
Fn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _cpu_backends() -> list[str | None]:
    """``None`` (automatic) and every registry backend that runs float64 training on the CPU."""
    inputs = KernelInputs(
        device=torch.device("cpu"), dtype=F64, head_dim=4, num_heads=4, num_kv_heads=2,
        query_len=11, key_len=11, is_causal=True, requires_grad=True,
    )  # fmt: skip
    names = [n for n in da.list_backends() if not get_backend(n).not_supported_reasons(inputs)]
    return [None, *names]


BACKENDS = _cpu_backends()


def _qkv(
    batch: int,
    query_len: int,
    heads: int,
    kv_heads: int,
    dim: int,
    *,
    key_len: int | None = None,
    dtype: torch.dtype = F64,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    key_len = query_len if key_len is None else key_len
    q = torch.randn(batch, query_len, heads, dim, generator=gen, dtype=F64)
    k = torch.randn(batch, key_len, kv_heads, dim, generator=gen, dtype=F64)
    v = torch.randn(batch, key_len, kv_heads, dim, generator=gen, dtype=F64)
    return tuple(x.to(dtype).requires_grad_() for x in (q, k, v))  # type: ignore[return-value]


def _padding(batch: int, key_len: int) -> torch.Tensor:
    """(B, Nk) key padding mask: a gap in batch 0, every key but the last ignored in batch 1."""
    mask = torch.zeros(batch, key_len, dtype=torch.bool)
    mask[0, 2:5] = True
    if batch > 1:
        mask[1, :-1] = True
    return mask


def _gradgradcheck(fn: Fn, inputs: Sequence[torch.Tensor], *, fast: bool = True) -> None:
    assert torch.autograd.gradgradcheck(fn, tuple(inputs), fast_mode=fast, atol=1e-6)


def _penalty_grads(
    fn: Fn, inputs: Sequence[torch.Tensor], w: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """d/d(q, k, v) of sum_i |d((out * w).sum()) / d input_i|^2 (w constant)."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*leaves)
    grads = torch.autograd.grad((out * w).sum(), leaves, create_graph=True)
    penalty = sum((g.to(F64) ** 2).sum() for g in grads)
    return torch.autograd.grad(penalty, leaves)


def _assert_penalty_raises(fn: Fn, inputs: Sequence[torch.Tensor], match: str) -> None:
    """First-order grads under create_graph=True equal the plain ones; going further raises."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    torch.manual_seed(1)  # same dropout mask for both calls
    out = fn(*leaves)
    w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
    plain = torch.autograd.grad((out * w).sum(), leaves)
    torch.manual_seed(1)
    out = fn(*leaves)
    grads = torch.autograd.grad((out * w).sum(), leaves, create_graph=True)
    for got, want in zip(grads, plain, strict=True):
        torch.testing.assert_close(got.detach(), want)
    penalty = sum((g**2).sum() for g in grads)
    with pytest.raises(RuntimeError, match=match):
        penalty.backward()


#: How a second derivative is asked for. Every route must raise the library's message: the
#: first-order gradients of a function without double backward lie on a node that raises, and
#: that node must be connected to the inputs (and to the upstream gradient), or autograd finds
#: no path to them: its generic "appears to not have been used in the graph" error, or a silent
#: ``(None,)`` with ``allow_unused=True`` (issue 41, item 1).
SECOND_ORDER_ROUTES = (
    "backward",  # penalty.backward()
    "grad_q",  # torch.autograd.grad(penalty, q)
    "grad_q_allow_unused",
    "grad_k_allow_unused",
    "grad_v_allow_unused",
    "grad_all_allow_unused",
    "upstream_weight",  # q = x @ W, penalty on dL/dW, differentiated w.r.t. W
    "upstream_dout",  # loss = (out * w).sum() with w a leaf, differentiated w.r.t. w
)


def _second_order(fn: Fn, inputs: Sequence[torch.Tensor], route: str) -> object:
    """Differentiate ``fn``'s first-order gradients along ``route``; returns what autograd
    returned (the caller expects it to raise)."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    q = leaves[0]
    if route == "upstream_weight":
        weight = torch.eye(q.shape[-1], dtype=q.dtype).requires_grad_()
        out = fn(q.detach() @ weight, *leaves[1:])
        (g,) = torch.autograd.grad(out.sum(), weight, create_graph=True)
        return torch.autograd.grad((g**2).sum(), weight, allow_unused=True)
    out = fn(*leaves)
    if route == "upstream_dout":
        w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape).requires_grad_()
        (g,) = torch.autograd.grad((out * w).sum(), q, create_graph=True)
        return torch.autograd.grad((g**2).sum(), w, allow_unused=True)
    (g,) = torch.autograd.grad(out.sum(), q, create_graph=True)  # the call
    penalty = (g**2).sum()
    if route == "backward":
        penalty.backward()
        return None
    if route == "grad_all_allow_unused":
        return torch.autograd.grad(penalty, leaves, allow_unused=True)
    index = "qkv".index(route[len("grad_")])
    return torch.autograd.grad(penalty, leaves[index], allow_unused=route.endswith("unused"))


def _assert_every_route_raises(fn: Fn, inputs: Sequence[torch.Tensor], match: str) -> None:
    for route in SECOND_ORDER_ROUTES:
        with pytest.raises(RuntimeError, match=match):
            got = _second_order(fn, inputs, route)
            raise AssertionError(f"route {route}: no error, autograd returned {got!r}")


# -- gradgradcheck in float64: every public function x every CPU backend ---------------------------

DILATED_CASES = {
    # (batch, seq_len, heads, kv_heads, head_dim, segment_lengths, dilation_rates, causal, mask)
    "issue21": (1, 6, 2, 2, 3, [6], [1], False, False),
    "multi_odd_causal_gqa": (1, 11, 4, 2, 3, [4, 6], [1, 2], True, False),
    "ragged_mqa_masked": (2, 11, 3, 1, 2, [3, 5, 16], [1, 2, 3], False, True),
    "causal_masked": (2, 9, 2, 1, 2, [4, 9], [1, 2], True, True),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(DILATED_CASES))
def test_dilated_attention_gradgradcheck(case: str, backend: str | None) -> None:
    batch, n, heads, kv_heads, dim, segs, rates, causal, masked = DILATED_CASES[case]
    mask = _padding(batch, n) if masked else None

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return da.dilated_attention(
            q, k, v, segs, rates, is_causal=causal, key_padding_mask=mask, backend=backend
        )

    _gradgradcheck(fn, _qkv(batch, n, heads, kv_heads, dim), fast=case != "issue21")


ATTENTION_CASES = {
    # (batch, query_len, key_len, heads, kv_heads, head_dim, causal, mask)
    "self_causal_gqa": (1, 7, 7, 4, 2, 3, True, False),
    "cross_causal_masked": (2, 5, 8, 2, 1, 2, True, True),
    "cross_longer_queries": (1, 8, 5, 2, 2, 2, False, True),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_gradgradcheck(case: str, backend: str | None) -> None:
    batch, nq, nk, heads, kv_heads, dim, causal, masked = ATTENTION_CASES[case]
    mask = _padding(batch, nk) if masked else None

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return da.attention(q, k, v, is_causal=causal, key_padding_mask=mask, backend=backend)

    _gradgradcheck(fn, _qkv(batch, nq, heads, kv_heads, dim, key_len=nk))


SPARSE_CASES = {
    # (query_len, key_len, heads, kv_heads, pattern, block_size, causal)
    "local_causal_gqa": (11, 11, 4, 2, P.LocalWindow(1), 3, True),
    "rectangular_dilated": (7, 10, 2, 1, P.DilatedBlocks((2,)), 2, False),
    "dense_pattern": (9, 9, 2, 2, P.LocalWindow(8), 4, True),  # runs dense attention()
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(SPARSE_CASES))
def test_block_sparse_attention_gradgradcheck(case: str, backend: str | None) -> None:
    nq, nk, heads, kv_heads, pattern, block_size, causal = SPARSE_CASES[case]

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return da.block_sparse_attention(
            q, k, v, pattern, block_size=block_size, is_causal=causal, backend=backend
        )

    _gradgradcheck(fn, _qkv(1, nq, heads, kv_heads, 2, key_len=nk))


@pytest.mark.parametrize("backend", BACKENDS)
def test_multihead_dilated_attention_gradgradcheck(backend: str | None) -> None:
    """Through the layer's projections and sub-LayerNorm: the input and a weight."""
    torch.manual_seed(0)
    layer = da.MultiheadDilatedAttention(
        8, 4, [4, 8], [1, 2], num_kv_heads=2, backend=backend, dtype=F64
    )
    mask = _padding(2, 9)
    x = torch.randn(2, 9, 8, dtype=F64, requires_grad=True)
    weight = layer.q_proj.weight

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out, _ = torch.func.functional_call(
            layer, {"q_proj.weight": w}, (x,), {"key_padding_mask": mask, "is_causal": True}
        )
        return out

    _gradgradcheck(fn, (x, weight.detach().clone().requires_grad_()))


# -- a gradient penalty against the float64 oracle ------------------------------------------------


_SPARSE = P.LocalWindow(1) | P.DilatedBlocks((3,))
PENALTY_CASES: dict[str, tuple[Fn, Fn]] = {
    "dilated_attention": (
        lambda q, k, v: da.dilated_attention(q, k, v, [4, 6, 13], [1, 2, 3], is_causal=True),
        lambda q, k, v: oracle_dilated_attention(q, k, v, [4, 6, 13], [1, 2, 3], is_causal=True)[0],
    ),
    "attention": (
        lambda q, k, v: da.attention(q, k, v, is_causal=True),
        lambda q, k, v: oracle_attention(q, k, v, is_causal=True)[0],
    ),
    "block_sparse_attention": (
        lambda q, k, v: da.block_sparse_attention(q, k, v, _SPARSE, block_size=3, is_causal=True),
        lambda q, k, v: masked_attention(
            q, k, v, token_mask(_SPARSE, 3, 13, 13, True).expand(4, -1, -1)
        )[0],
    ),
}


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("name", list(PENALTY_CASES))
def test_gradient_penalty_matches_oracle(name: str, dtype: torch.dtype) -> None:
    """Second-order gradients of a penalty |dL/dq|^2 + |dL/dk|^2 + |dL/dv|^2 vs float64."""
    fn, oracle = PENALTY_CASES[name]
    inputs = _qkv(1, 13, 4, 2, 4, dtype=dtype, seed=3)
    w = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(4), dtype=F64)
    want = _penalty_grads(oracle, [x.to(F64) for x in inputs], w)
    got = _penalty_grads(fn, inputs, w.to(dtype))
    for label, g, e in zip("qkv", got, want, strict=True):
        scale = float(e.abs().max())
        tol = 1e-10 if dtype == F64 else 2e-5
        torch.testing.assert_close(
            g.to(F64), e, atol=tol * scale, rtol=tol,
            msg=lambda m, label=label: f"{name} {dtype} d(penalty)/d{label}: {m}",
        )  # fmt: skip


# -- a clear error where double backward cannot be provided ------------------------------------


def _dropout_cases() -> dict[str, tuple[str, Fn]]:
    """name -> (public function in the message, call with dropout_p > 0) on 8 positions."""
    module = da.DilatedAttention([4, 8], [1, 2], dropout=0.3).train()
    return {
        "attention": ("attention", lambda q, k, v: da.attention(q, k, v, dropout_p=0.3)),
        "attention_math": (
            "attention",
            lambda q, k, v: da.attention(q, k, v, dropout_p=0.3, backend="math"),
        ),
        "dilated_attention": (
            "dilated_attention",
            lambda q, k, v: da.dilated_attention(q, k, v, [4, 8], [1, 2], dropout_p=0.3),
        ),
        "dilated_attention_math": (
            "dilated_attention",
            lambda q, k, v: da.dilated_attention(
                q, k, v, [4, 8], [1, 2], dropout_p=0.3, backend="math"
            ),
        ),
        "dilated_decoding": (  # the last 3 positions against all 8 (Note [Decoding rows])
            "dilated_attention",
            lambda q, k, v: da.dilated_attention(
                q[:, -3:], k, v, [4, 8], [1, 2], is_causal=True, dropout_p=0.3
            ),
        ),
        "DilatedAttention_module": ("dilated_attention", lambda q, k, v: module(q, k, v)),
    }


@pytest.mark.parametrize("name", list(_dropout_cases()))
def test_dropout_double_backward_raises(name: str) -> None:
    what, fn = _dropout_cases()[name]
    match = rf"{what} with dropout_p > 0 has no higher-order gradients"
    _assert_penalty_raises(fn, _qkv(1, 8, 2, 2, 4), match)
    _assert_every_route_raises(fn, _qkv(1, 8, 2, 2, 4), match)


def test_compiled_dropout_double_backward_raises() -> None:
    """Under torch.compile the double backward is torch's to refuse (its compiled backward is
    not differentiable); it does so on every route, never with None."""
    fn = torch.compile(lambda q, k, v: da.attention(q, k, v, dropout_p=0.3), backend="aot_eager")
    match = "double backward"  # torch's message
    _assert_every_route_raises(fn, _qkv(1, 8, 2, 2, 4), match)


def test_func_dropout_double_backward_raises() -> None:
    """torch.func runs the custom operator, whose backward raises when differentiated, also
    through a vjp followed by eager autograd with ``allow_unused=True``."""
    q, k, v = (x.detach() for x in _qkv(1, 8, 2, 2, 4))

    def loss(q: torch.Tensor) -> torch.Tensor:
        return da.dilated_attention(q, k, v, [4, 8], [1, 2], dropout_p=0.3).sum()

    match = r"first-order gradients only.*create_graph=True"
    with pytest.raises(RuntimeError, match=match):
        torch.func.grad(lambda q: torch.func.grad(loss)(q).pow(2).sum())(q)
    leaf = q.clone().requires_grad_()
    _, vjp = torch.func.vjp(loss, leaf)
    (g,) = vjp(torch.ones((), dtype=F64))
    with pytest.raises(RuntimeError, match=match):
        torch.autograd.grad((g**2).sum(), leaf, allow_unused=True)


def _ring_cases() -> dict[str, Fn]:
    return {
        "ring_attention": lambda q, k, v: da.ring_attention(q, k, v, is_causal=True),
        "ring_dilated_attention": lambda q, k, v: da.ring_dilated_attention(
            q, k, v, [4, 8], [1, 2], is_causal=True
        ),
        "block_sparse_ring_attention": lambda q, k, v: da.block_sparse_ring_attention(
            q, k, v, P.LocalWindow(1), block_size=2
        ),
    }


def _ring_raises(name: str, fn: Fn, inputs: Sequence[torch.Tensor]) -> None:
    match = (
        rf"{name} has no higher-order gradients \(double backward\).*collectives.*run "
        r"\w+\(\) on the whole sequence"
    )
    _assert_penalty_raises(fn, inputs, match)
    _assert_every_route_raises(fn, inputs, match)


@pytest.mark.parametrize("name", list(_ring_cases()))
def test_ring_double_backward_raises_in_one_process(name: str) -> None:
    """Without torch.distributed a ring function is one rank; the error is the same."""
    _ring_raises(name, _ring_cases()[name], _qkv(1, 8, 4, 2, 4))


def _ring_worker(rank: int, world_size: int) -> None:
    gen = torch.Generator().manual_seed(7)
    full = [torch.randn(1, 8 * world_size, h, 4, generator=gen, dtype=F64) for h in (4, 2, 2)]
    shards = [x.chunk(world_size, dim=1)[rank] for x in full]
    for name, fn in _ring_cases().items():
        _ring_raises(name, fn, shards)


@pytest.mark.distributed
def test_ring_double_backward_raises_on_every_rank(tmp_path: Any) -> None:
    """World size 2 (gloo): the first-order gradients under create_graph=True are exact and
    equal on both ranks' shards; differentiating them raises the same error on every rank."""
    run_world(_ring_worker, 2, tmp_path, timeout_s=30)


def _chosen_block_cases() -> dict[str, tuple[str, Fn]]:
    """name -> (public function in the message, call on 19 positions): functions whose blocks
    the inputs choose, built from calls without double backward."""
    gates = torch.rand(1, 19, 4, 3, generator=torch.Generator().manual_seed(2), dtype=F64)
    nsa = dict(compress_block=4, compress_stride=2, select_block=4, topk=1, window=5)
    return {
        "moba": ("moba_attention", lambda q, k, v: moba_attention(q, k, v, block_size=4, topk=1)),
        "nsa_gates": ("nsa_attention", lambda q, k, v: nsa_attention(q, k, v, gates, **nsa)),
        "nsa_lse": (
            "nsa_attention",
            lambda q, k, v: nsa_attention(q, k, v, None, combine="lse", **nsa),
        ),
        "nsa_recomputed": (
            "nsa_attention",
            lambda q, k, v: nsa_attention(q, k, v, gates, recompute=True, **nsa),
        ),
    }


@pytest.mark.parametrize("name", list(_chosen_block_cases()))
def test_chosen_block_functions_name_themselves_in_the_double_backward_error(name: str) -> None:
    """MoBA and NSA raise their own message (the function the user called and its fix), not
    the message of a call they make; a run-time mask called afterwards keeps its own."""
    what, fn = _chosen_block_cases()[name]
    inputs = _qkv(1, 19, 4, 2, 4, seed=5)
    _assert_penalty_raises(fn, inputs, rf"^{what} has no higher-order gradients.*detach its output")
    mask = torch.rand(1, 4, 5, 5, generator=torch.Generator().manual_seed(3)) < 0.5
    _assert_penalty_raises(
        lambda q, k, v: da.block_sparse_attention(q, k, v, mask, block_size=4, is_causal=True),
        inputs,
        r"^block_sparse_attention with a run-time block mask has no higher-order gradients",
    )


def test_the_outermost_raised_as_wins() -> None:
    """Nested :func:`raised_as`: the outer message stays in force inside; none after."""
    assert outer_message() is None
    with raised_as("outer"):
        with raised_as("inner"):
            assert outer_message() == "outer"
        assert outer_message() == "outer"
    assert outer_message() is None


# -- CUDA kernels ---------------------------------------------------------------------------------


def _gpu_cases() -> dict[str, tuple[Fn, Fn]]:
    pattern = P.LocalWindow(1)
    mask = token_mask(pattern, 64, 256, 256, True).expand(4, -1, -1)
    return {
        "dilated_default": (
            lambda q, k, v: da.dilated_attention(q, k, v, [64, 128], [1, 2], is_causal=True),
            lambda q, k, v: oracle_dilated_attention(q, k, v, [64, 128], [1, 2], is_causal=True)[0],
        ),
        "dilated_triton": (
            lambda q, k, v: da.dilated_attention(
                q, k, v, [64, 128], [1, 2], is_causal=True, backend="triton"
            ),
            lambda q, k, v: oracle_dilated_attention(q, k, v, [64, 128], [1, 2], is_causal=True)[0],
        ),
        "attention_default": (
            lambda q, k, v: da.attention(q, k, v, is_causal=True),
            lambda q, k, v: oracle_attention(q, k, v, is_causal=True)[0],
        ),
        "block_sparse_triton": (
            lambda q, k, v: da.block_sparse_attention(
                q, k, v, pattern, block_size=64, is_causal=True, backend="triton"
            ),
            lambda q, k, v: masked_attention(q, k, v, mask)[0],
        ),
        "block_sparse_fallback": (
            lambda q, k, v: da.block_sparse_attention(
                q, k, v, pattern, block_size=64, is_causal=True, backend="math"
            ),
            lambda q, k, v: masked_attention(q, k, v, mask)[0],
        ),
    }


# The block-sparse Triton kernels take 16-bit inputs only (float32 tiles do not fit in shared
# memory), so that case runs in bfloat16 with a bfloat16 budget.
_GPU_DTYPES = {"block_sparse_triton": (torch.bfloat16, 3e-2)}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(_gpu_cases()))
def test_gpu_gradient_penalty_matches_oracle(name: str) -> None:
    """CUDA kernels (fused Triton, SDPA, block-sparse Triton) vs the float64 oracle, in float32
    (block-sparse Triton: bfloat16)."""
    fn, oracle = _gpu_cases()[name]
    dtype, tol = _GPU_DTYPES.get(name, (torch.float32, 1e-4))
    inputs = [
        x.detach().to(dtype).cuda().to(F64).requires_grad_()
        for x in _qkv(1, 256, 4, 2, 64, seed=5)
    ]  # the oracle sees the same rounded inputs
    w = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(6), dtype=F64)
    w = w.to(dtype).cuda().to(F64)
    want = _penalty_grads(oracle, inputs, w)
    got = _penalty_grads(fn, [x.to(dtype) for x in inputs], w.to(dtype))
    for label, g, e in zip("qkv", got, want, strict=True):
        scale = float(e.abs().max())
        torch.testing.assert_close(
            g.to(F64), e, atol=tol * scale, rtol=tol,
            msg=lambda m, label=label: f"{name} d(penalty)/d{label}: {m}",
        )  # fmt: skip


@pytest.mark.gpu
def test_gpu_block_sparse_flex_double_backward_raises() -> None:
    """FlexAttention (block-sparse training default on CUDA) is torch.compile'd; torch raises
    for double backward through it. A clear error, not silently wrong numbers."""
    q, k, v = (x.detach().cuda().float().requires_grad_() for x in _qkv(1, 256, 4, 2, 64))
    out = da.block_sparse_attention(
        q, k, v, P.LocalWindow(1), block_size=64, is_causal=True, backend="flex"
    )
    with pytest.raises(RuntimeError, match="double backward"):
        grads = torch.autograd.grad((out * 0.5).sum(), (q, k, v), create_graph=True)
        sum((g**2).sum() for g in grads).backward()
