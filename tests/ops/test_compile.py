"""torch.compile, torch.export and torch.func: results and gradients equal the eager ones.

Compiles use ``fullgraph=True`` (a graph break fails the test) and the ``aot_eager`` backend,
which needs no C++ compiler; one test per path also runs Inductor where its CPU code generation
works. What cannot work (torch.jit.trace, higher-order gradients through the operators,
forward-mode AD, the ring functions) must raise an error that says so and names the
alternative. Shapes are tiny: compiling dominates the runtime.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from support.graphs import captured
from support.grouping import cut_small
from support.triton import KERNEL_DEVICES, skip_without_triton
from support.writing_kernel import write_into_buffers

from dilated_attention import (
    BlockSparseAttention,
    DilatedAttention,
    LongNetConfig,
    LongNetLM,
    MultiheadDilatedAttention,
    attention,
    block_sparse_attention,
    block_sparse_ring_attention,
    dilated_attention,
    patterns,
    ring_attention,
    ring_dilated_attention,
)
from dilated_attention.core.execution.executor import PlanRunner
from dilated_attention.core.execution.fused_runner import FusedRunner

F64 = torch.float64
EXACT = {"atol": 1e-12, "rtol": 0.0}
CLOSE32 = {"atol": 1e-6, "rtol": 1e-5}
# 37 tokens: the last segment of both branches is partial; 4 query heads over 2 kv heads (GQA).
N, SEGS, RATES = 37, [8, 16], [1, 2]


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    """Each test compiles its own functions from scratch, never from Inductor's on-disk caches:
    their keys do not cover a custom operator's autograd, so a cache written by another version
    of this library would hand back that version's compiled backward."""
    torch._dynamo.reset()
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        yield


def _compile(
    fn: Callable[..., Any], backend: str = "aot_eager", fullgraph: bool = True
) -> Callable[..., Any]:
    return torch.compile(fn, fullgraph=fullgraph, backend=backend)


@pytest.fixture
def plan_forwards(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the executor's forwards (``PlanRunner.forward``, what every CPU call runs): one
    entry per call."""
    forwards: list[int] = []
    real = PlanRunner.forward

    def counted(self: PlanRunner, x: Any) -> Any:
        forwards.append(1)
        return real(self, x)

    monkeypatch.setattr(PlanRunner, "forward", counted)
    return forwards


def _qkv(n: int = N, dtype: torch.dtype = F64, device: str = "cpu") -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(2, n, 4, 8), (2, n, 2, 8), (2, n, 2, 8)]
    return [torch.randn(s, generator=gen, dtype=dtype).to(device) for s in shapes]


def _run(fn: Callable[..., Any], tensors: list[torch.Tensor]) -> tuple[Any, list[torch.Tensor]]:
    """``fn``'s result and the gradients of a weighted sum of its first output (weights exact in
    bfloat16, so runs in different dtypes weigh alike)."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    result = fn(*leaves)
    out = result[0] if isinstance(result, tuple) else result
    (out * _weights(out)).sum().backward()
    return result, [t.grad for t in leaves]


def _weights(out: torch.Tensor) -> torch.Tensor:
    """Weights of :func:`_run`'s sum, shaped like ``out``."""
    weights = torch.linspace(-1, 1, out.numel(), device=out.device).bfloat16().to(out.dtype)
    return weights.view_as(out)


def _inductor_cpu_works() -> bool:
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception:
        return False
    return True


MASK = torch.zeros(2, N, dtype=torch.bool)
MASK[:, -5:] = True
# A run-time block mask per batch row and key/value head (Note [Run-time block masks]).
BLOCK_MASK = torch.rand(2, 2, 10, 10, generator=torch.Generator().manual_seed(1)) < 0.5
CALLS: dict[str, Callable[..., Any]] = {
    "dilated": lambda q, k, v: dilated_attention(
        q, k, v, SEGS, RATES, is_causal=True, key_padding_mask=MASK, return_lse=True
    ),
    "dense": lambda q, k, v: attention(q, k, v, key_padding_mask=MASK, return_lse=True),
    "block_sparse": lambda q, k, v: block_sparse_attention(
        q, k, v, patterns.LocalWindow(1) | patterns.GlobalLocal(1, 0), block_size=4,
        is_causal=True, return_lse=True,
    ),
    "block_mask": lambda q, k, v: block_sparse_attention(
        q, k, v, BLOCK_MASK, block_size=4, is_causal=True, return_lse=True
    ),
}  # fmt: skip


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "default"])
@pytest.mark.parametrize("name", list(CALLS))
def test_functions_compile_and_match_eager(
    name: str, fullgraph: bool, plan_forwards: list[int]
) -> None:
    """Outputs and gradients equal eager ones, and the compiled backward runs the plan's
    backward on the forward's saved results: one forward per step, as in eager (Note [Backward
    without the forward] in ``core/autograd.py``)."""
    call = CALLS[name]
    (out, lse), grads = _run(_compile(call, fullgraph=fullgraph), _qkv())
    assert len(plan_forwards) == 1
    (ref_out, ref_lse), ref_grads = _run(call, _qkv())
    assert len(plan_forwards) == 2
    torch.testing.assert_close(out, ref_out, **EXACT)
    torch.testing.assert_close(lse, ref_lse, **EXACT)
    assert lse.dtype == F64 and not lse.requires_grad  # as eager: float64 in, detached
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, **EXACT)


def test_block_sparse_pattern_is_guarded() -> None:
    """Another pattern object recompiles and gives its own result (the pattern reaches the
    operator as a key: Note [Patterns as operator arguments])."""
    q, k, v = _qkv(n=24)
    fn = _compile(lambda q, k, v, p: block_sparse_attention(q, k, v, p, block_size=4))
    for pattern in (patterns.LocalWindow(0), patterns.DilatedBlocks([2]), patterns.LocalWindow(0)):
        expected = block_sparse_attention(q, k, v, pattern, block_size=4)
        torch.testing.assert_close(fn(q, k, v, pattern), expected, **EXACT)


def test_block_mask_is_an_input_of_the_graph() -> None:
    """A run-time mask reaches the operator as a tensor input (Note [The call's mask tensor]):
    a new mask of the same shape reruns the compiled graph without recompiling; int block
    indices (another dtype and width) compile their own."""
    q, k, v = _qkv(n=24)
    fn = _compile(lambda q, k, v, m: block_sparse_attention(q, k, v, m, block_size=4,
                                                              is_causal=True))  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    masks = [torch.rand(2, 4, 6, 6, generator=gen) < 0.5 for _ in range(3)]
    torch.testing.assert_close(fn(q, k, v, masks[0]), block_sparse_attention(
        q, k, v, masks[0], block_size=4, is_causal=True), **EXACT)  # fmt: skip
    with torch._dynamo.config.patch(error_on_recompile=True):
        for mask in masks[1:]:
            expected = block_sparse_attention(q, k, v, mask, block_size=4, is_causal=True)
            torch.testing.assert_close(fn(q, k, v, mask), expected, **EXACT)
    indices = torch.randint(-1, 6, (1, 2, 6, 2), generator=gen)
    expected = block_sparse_attention(q, k, v, indices, block_size=4, is_causal=True)
    torch.testing.assert_close(fn(q, k, v, indices), expected, **EXACT)


def test_block_mask_under_vmap_and_export(tmp_path: Any) -> None:
    """torch.func.vmap folds a mask of one batch row into every mapped row, or maps the masks
    with the queries; torch.export keeps a run-time mask as an input of the saved program."""
    q_mapped = torch.randn(3, 2, 16, 4, 8, dtype=F64)
    k, v = _qkv(n=16)[1:]
    gen = torch.Generator().manual_seed(3)
    shared = torch.rand(1, 2, 4, 4, generator=gen) < 0.5
    masks = torch.rand(3, 2, 4, 4, 4, generator=gen) < 0.5

    def call(q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return block_sparse_attention(q, k, v, mask, block_size=4, is_causal=True)

    mapped = torch.func.vmap(call, in_dims=(0, None))(q_mapped, shared)
    torch.testing.assert_close(mapped, torch.stack([call(q, shared) for q in q_mapped]), **EXACT)
    mapped = torch.func.vmap(call)(q_mapped, masks)
    expected = torch.stack([call(q, m) for q, m in zip(q_mapped, masks, strict=True)])
    torch.testing.assert_close(mapped, expected, **EXACT)

    class Masked(torch.nn.Module):
        def forward(self, q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return call(q, mask)

    path = tmp_path / "masked.pt2"
    torch.export.save(torch.export.export(Masked(), (q_mapped[0], masks[0])), path)
    loaded = torch.export.load(path).module()
    torch.testing.assert_close(loaded(q_mapped[1], masks[1]), call(q_mapped[1], masks[1]),
                               **EXACT)  # fmt: skip


def test_dropout_under_compile_is_exact(plan_forwards: list[int]) -> None:
    """The backward runs the forward again, replaying its RNG state (the kernel's dropout state
    comes from its forward): output and gradients equal eager ones drawn from the same seed,
    and the RNG stream after the call is the same."""
    call: Callable[..., Any] = lambda q, k, v: dilated_attention(  # noqa: E731
        q, k, v, SEGS, RATES, dropout_p=0.3
    )
    results = []
    for fn, forwards in ((_compile(call), 2), (call, 1)):
        torch.manual_seed(7)
        plan_forwards.clear()
        out, grads = _run(fn, _qkv(dtype=torch.float32))
        assert len(plan_forwards) == forwards
        results.append((out, grads, torch.rand(4)))
    (out, grads, after), (ref_out, ref_grads, ref_after) = results
    torch.testing.assert_close(out, ref_out, **CLOSE32)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, **CLOSE32)
    assert torch.equal(after, ref_after)
    no_dropout = dilated_attention(*_qkv(dtype=torch.float32), SEGS, RATES)
    assert not torch.allclose(out, no_dropout)  # dropout did drop


def test_modules_compile_fullgraph_and_match_eager() -> None:
    torch.manual_seed(0)
    mha = MultiheadDilatedAttention(32, 4, segment_lengths=SEGS, dilation_rates=RATES, dtype=F64)
    inner = DilatedAttention(SEGS, RATES)
    sparse = BlockSparseAttention(patterns.LocalWindow(1), block_size=4)
    x = torch.randn(2, N, 32, dtype=F64)
    cases: list[tuple[torch.nn.Module, Callable[..., Any], list[torch.Tensor]]] = [
        (mha, lambda m, x: m(x, key_padding_mask=MASK, is_causal=True)[0], [x]),
        (inner, lambda m, q, k, v: m(q, k, v, is_causal=True), _qkv()),
        (sparse, lambda m, q, k, v: m(q, k, v), _qkv()),
    ]
    for module, call, inputs in cases:
        twin = copy.deepcopy(module)
        compiled = _compile(twin)
        out, grads = _run(functools.partial(call, compiled), inputs)
        ref_out, ref_grads = _run(functools.partial(call, module), inputs)
        torch.testing.assert_close(out, ref_out, **EXACT)
        for got, want in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(got, want, **EXACT)
        for p, ref_p in zip(twin.parameters(), module.parameters(), strict=True):
            torch.testing.assert_close(p.grad, ref_p.grad, **EXACT)


@pytest.mark.slow
def test_longnet_trains_under_compile() -> None:
    """Forward, backward and optimizer step of the compiled model give the eager losses."""
    torch.manual_seed(0)
    config = LongNetConfig(
        vocab_size=61, embed_dim=32, num_heads=4, num_layers=2, segment_lengths=(8, 16),
        dilation_rates=(1, 2), ffn_dim=64,
    )  # fmt: skip
    model = LongNetLM(config)
    tokens = torch.randint(0, 61, (2, 25))

    def train(m: torch.nn.Module, forward: Callable[..., Any]) -> list[float]:
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        losses = []
        for _ in range(2):
            logits = forward(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, 61), tokens[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    twin = copy.deepcopy(model)
    compiled_losses = train(twin, _compile(twin))
    eager_losses = train(model, model)
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-5, abs=1e-6)
    assert compiled_losses[1] < compiled_losses[0]
    for p, ref in zip(twin.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p, ref, atol=1e-5, rtol=1e-4)
    with pytest.raises(RuntimeError, match="token ids must be in"):
        _compile(twin)(torch.tensor([[1, 2, 61]]))  # the range check holds in the graph too


@pytest.mark.skipif(
    not _inductor_cpu_works(), reason="Inductor's CPU code generation needs a C++ compiler"
)
def test_inductor_cpu() -> None:
    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dilated_attention(q * 2, k, v, SEGS, RATES, is_causal=True).tanh()

    out, grads = _run(_compile(call, backend="inductor"), _qkv(dtype=torch.float32))
    ref_out, ref_grads = _run(call, _qkv(dtype=torch.float32))
    torch.testing.assert_close(out, ref_out, **CLOSE32)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, **CLOSE32)


def test_export_round_trip(tmp_path: Any) -> None:
    torch.manual_seed(0)
    mha = MultiheadDilatedAttention(32, 4, segment_lengths=SEGS, dilation_rates=RATES)
    x = torch.randn(2, N, 32)

    class Causal(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = mha

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mha(x, is_causal=True)[0]

    path = tmp_path / "mha.pt2"
    torch.export.save(torch.export.export(Causal(), (x,)), path)
    loaded = torch.export.load(path).module()
    torch.testing.assert_close(loaded(x), Causal()(x), **CLOSE32)
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match="block_sparse_attention cannot be exported"):
        torch.export.export(BlockSparseAttention(patterns.LocalWindow(1), block_size=4), (q, k, v))


# -- torch.func ------------------------------------------------------------------------------------
def test_operator_results_never_alias_inputs_or_each_other() -> None:
    """An operator's outputs may not alias its inputs or each other (custom operator rules):
    a result sharing memory with an input or an earlier result, or empty, is copied; a fresh
    one is returned as it is, made contiguous."""
    from dilated_attention.compiled.operators import _fresh

    q = torch.randn(2, 8, 3, 4)
    fresh = torch.randn(2, 8, 3, 4)
    view_of_q = q[:, :, :1]
    strided = torch.randn(2, 3, 8, 4).transpose(1, 2)
    empty = torch.randn(0, 8, 3, 4)
    got = _fresh([fresh, view_of_q, fresh, strided, empty], (q, None))
    assert got[0] is fresh
    for result, given in zip(got[1:], (view_of_q, fresh, strided, empty), strict=True):
        assert result is not given and torch.equal(result, given)
        assert result.is_contiguous()
    memory = [r.untyped_storage().data_ptr() for r in got if r.numel()]
    assert len(set(memory)) == len(memory)
    assert q.untyped_storage().data_ptr() not in memory


def test_func_grad_matches_autograd() -> None:
    def loss(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = dilated_attention(q, k, v, SEGS, RATES, is_causal=True, key_padding_mask=MASK)
        return (out.sin() * out).sum()

    tensors = _qkv()
    grads = torch.func.grad(loss, argnums=(0, 1, 2))(*tensors)
    leaves = [t.clone().requires_grad_() for t in tensors]
    expected = torch.autograd.grad(loss(*leaves), leaves)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, **EXACT)


@pytest.mark.parametrize("plan", ["gathered", "slots", "grouped slots"])
def test_func_backward_runs_the_plan_backward_on_the_forward_results(
    plan: str, plan_forwards: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.func runs the same operators: their backward runs the plan's backward on the
    forward's ``out`` and ``lse``, with no kernel ``aux`` (Note [Backward without the forward]),
    on calls gathered, written into branch slots, and in slots cut into position groups; one
    forward, and the gradients of eager autograd."""
    if plan != "gathered":
        write_into_buffers(monkeypatch)
    if plan == "grouped slots":
        cut_small(monkeypatch)
    n = 64
    mask = torch.zeros(2, n, dtype=torch.bool)
    mask[1, 3::5] = True

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dilated_attention(
            q, k, v, SEGS, RATES, is_causal=True, key_padding_mask=mask, backend="math"
        )

    tensors = _qkv(n=n)
    dout = torch.randn(tensors[0].shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    out, vjp = torch.func.vjp(call, *tensors)
    grads = vjp(dout)
    assert len(plan_forwards) == 1
    leaves = [t.clone().requires_grad_() for t in tensors]
    ref_out = call(*leaves)
    ref_grads = torch.autograd.grad(ref_out, leaves, dout)
    assert len(plan_forwards) == 2
    torch.testing.assert_close(out, ref_out, **EXACT)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, **EXACT)


@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_fused_kernels_backward_runs_no_forward_again(
    device: str, dtypes: list[torch.dtype], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Our fused dilated kernels under torch.compile and torch.func: the backward operator runs
    their backward on the forward's ``out`` and ``lse`` (Note [Backward without the forward]),
    one forward per step as in eager, and the gradients are eager autograd's, bit for bit."""
    skip_without_triton(device)
    forwards: list[int] = []
    real = FusedRunner.forward
    monkeypatch.setattr(FusedRunner, "forward", lambda r, x: forwards.append(1) or real(r, x))
    n = 64
    mask = torch.zeros(2, n, dtype=torch.bool, device=device)
    mask[1, 3::5] = True

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dilated_attention(
            q, k, v, [16, 32], [1, 2], is_causal=True, key_padding_mask=mask, backend="triton"
        )

    gen = torch.Generator().manual_seed(0)
    shapes = [(2, n, 4, 16), (2, n, 2, 16), (2, n, 2, 16)]
    tensors = [torch.randn(s, generator=gen).to(device, dtypes[0]) for s in shapes]
    ref_out, ref_grads = _run(call, tensors)
    assert len(forwards) == 1
    forwards.clear()
    out, grads = _run(_compile(call), tensors)
    assert len(forwards) == 1
    forwards.clear()
    func_out, vjp = torch.func.vjp(call, *tensors)
    func_grads = vjp(_weights(func_out))
    assert len(forwards) == 1
    got = [out, *grads, func_out, *func_grads]
    for value, want in zip(got, [ref_out, *ref_grads] * 2, strict=True):
        torch.testing.assert_close(value, want, atol=0, rtol=0)


def test_func_vmap_folds_into_batch() -> None:
    q_mapped = torch.randn(3, 2, 16, 4, 8, dtype=F64)
    k, v = _qkv(n=16)[1:]
    mapped = torch.func.vmap(lambda q: dilated_attention(q, k, v, SEGS, RATES))(q_mapped)
    expected = torch.stack([dilated_attention(q, k, v, SEGS, RATES) for q in q_mapped])
    torch.testing.assert_close(mapped, expected, **EXACT)
    # jacrev vmaps the backward operator: one row of the Jacobian against autograd.
    jac = torch.func.jacrev(lambda q: dilated_attention(q, k, v, SEGS, RATES)[0, 3, 1])(q_mapped[0])
    leaf = q_mapped[0].clone().requires_grad_()
    (row,) = torch.autograd.grad(dilated_attention(leaf, k, v, SEGS, RATES)[0, 3, 1, 2], leaf)
    torch.testing.assert_close(jac[2], row, **EXACT)


def test_func_unsupported_raise_clearly() -> None:
    q, k, v = _qkv(n=16)

    def loss(q: torch.Tensor) -> torch.Tensor:
        return dilated_attention(q, k, v, SEGS, RATES).square().sum()

    with pytest.raises(RuntimeError, match=r"first-order gradients only.*create_graph=True"):
        torch.func.grad(lambda q: torch.func.grad(loss)(q).sum())(q)
    with pytest.raises(RuntimeError, match=r"forward-mode AD.*torch\.func\.vjp"):
        torch.func.jvp(lambda q: dilated_attention(q, k, v, SEGS, RATES), (q,), (q,))

    def dropout(q: torch.Tensor) -> torch.Tensor:
        return dilated_attention(q, k, v, SEGS, RATES, dropout_p=0.5)

    batch = q.expand(3, *q.shape)
    with pytest.raises(RuntimeError, match="randomness='different'"):
        torch.func.vmap(dropout)(batch)
    out = torch.func.vmap(dropout, randomness="different")(batch)
    assert not torch.equal(out[0], out[1])  # each mapped element drew its own mask


#: What differentiating a gradient taken under torch.compile raises, per compile backend.
SECOND_ORDER_ERRORS = {
    # AOTAutograd (behind torch.compile's default "inductor" too): any function, SDPA included.
    "aot_eager": r"double backward",
    # Dynamo alone reaches our operator's backward, which names the eager alternative.
    "eager": r"first-order gradients only.*torch\.autograd\.grad\(\.\.\., create_graph=True\)",
}


@pytest.mark.parametrize(
    ("name", "backend"),
    [(name, backend) for name in CALLS for backend in SECOND_ORDER_ERRORS]
    + [("torch sdpa", "aot_eager")],
)
def test_compile_takes_no_higher_order_gradients(name: str, backend: str) -> None:
    """Under torch.compile, ``create_graph=True`` still gives the exact first-order gradients;
    differentiating them raises, never a silent ``None`` (``allow_unused=True``). A torch limit
    (torch's own SDPA raises the same under AOTAutograd); eager autograd takes them."""
    if name == "torch sdpa":
        call: Callable[..., Any] = lambda q, k, v: F.scaled_dot_product_attention(  # noqa: E731
            *(x.transpose(1, 2) for x in (q, k, v)), is_causal=True, enable_gqa=True
        ).transpose(1, 2)
    else:
        call = CALLS[name]
    q, k, v = (t.requires_grad_() for t in _qkv())

    def first(fn: Callable[..., Any]) -> torch.Tensor:
        out = fn(q, k, v)
        out = out[0] if isinstance(out, tuple) else out
        return torch.autograd.grad(out.square().sum(), q, create_graph=True)[0]

    grad = first(_compile(call, backend))
    torch.testing.assert_close(grad, first(call), **EXACT)
    for allow_unused in (False, True):
        with pytest.raises(RuntimeError, match=SECOND_ORDER_ERRORS[backend]):
            penalty = grad.square().sum()
            torch.autograd.grad(penalty, (q, k), allow_unused=allow_unused, retain_graph=True)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore::FutureWarning")
def test_jit_trace_raises_clearly() -> None:
    q, k, v = _qkv(n=16)
    with pytest.raises(RuntimeError, match=r"torch\.jit\.trace.*torch\.compile.*torch\.export"):
        torch.jit.trace(lambda q, k, v: dilated_attention(q, k, v, SEGS, RATES), (q, k, v))


RING_CALLS: dict[str, Callable[..., Any]] = {
    "ring_attention": lambda q, k, v: ring_attention(q, k, v),
    "ring_dilated_attention": lambda q, k, v: ring_dilated_attention(q, k, v, SEGS, RATES),
    "block_sparse_ring_attention": lambda q, k, v: block_sparse_ring_attention(
        q, k, v, patterns.LocalWindow(1), block_size=4
    ),
}


@pytest.mark.parametrize("name", list(RING_CALLS))
def test_ring_functions_refuse_tracing_clearly(name: str) -> None:
    """Both errors come before any communication (no process group is needed to see them)."""
    call = RING_CALLS[name]
    q, k, v = _qkv(n=16)
    with pytest.raises(torch._dynamo.exc.Unsupported, match=f"{name} communicates between ranks"):
        _compile(call)(q, k, v)
    with pytest.raises(RuntimeError, match=f"{name} does not support torch.func"):
        torch.func.grad(lambda q: call(q, k, v).sum())(q)


# -- CUDA ------------------------------------------------------------------------------------------
BF16 = {"atol": 2e-2, "rtol": 5e-3}


@pytest.mark.gpu
def test_inductor_cuda_bf16_dilated_attention() -> None:
    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dilated_attention(q, k, v, [256, 512], [1, 2], is_causal=True) * 2

    tensors = _qkv(n=1024, dtype=torch.bfloat16, device="cuda")
    out, grads = _run(_compile(call, backend="inductor"), tensors)
    ref_out, ref_grads = _run(call, tensors)
    torch.testing.assert_close(out, ref_out, **BF16)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, **BF16)


@pytest.mark.gpu
def test_inductor_cuda_bf16_multihead_module() -> None:
    """Inductor compiles the projections and norms around the custom op with its own fused
    bfloat16 kernels, which round differently from eager (0.3% of dx entries differed from eager
    by more than 1% on an H100): so both are held to a float64 copy of the module, the compiled
    one no farther from it than twice the eager error."""
    torch.manual_seed(0)
    mha = MultiheadDilatedAttention(
        256, 4, segment_lengths=[256, 512], dilation_rates=[1, 2], device="cuda",
        dtype=torch.bfloat16,
    )  # fmt: skip
    twin = copy.deepcopy(mha)
    exact = copy.deepcopy(mha).double()
    x = torch.randn(2, 1024, 256, device="cuda", dtype=torch.bfloat16)
    out, (dx,) = _run(lambda x: _compile(twin, backend="inductor")(x, is_causal=True)[0], [x])
    eager_out, (eager_dx,) = _run(lambda x: mha(x, is_causal=True)[0], [x])
    exact_out, (exact_dx,) = _run(lambda x: exact(x, is_causal=True)[0], [x.double()])
    pairs = [(out, eager_out, exact_out), (dx, eager_dx, exact_dx)]
    pairs += [
        (compiled.grad, eager.grad, reference.grad)
        for compiled, eager, reference in zip(
            twin.parameters(), mha.parameters(), exact.parameters(), strict=True
        )
    ]
    for compiled_value, eager_value, exact_value in pairs:
        eager_error = (eager_value.double() - exact_value).abs().max().item()
        compiled_error = (compiled_value.double() - exact_value).abs().max().item()
        assert compiled_error <= 2 * eager_error + 1e-3, (compiled_error, eager_error)


class _Stack(torch.nn.Module):
    """Multihead dilated layers with residual connections, as a model stacks them."""

    def __init__(self, layers: int, **kwargs: Any) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            MultiheadDilatedAttention(**kwargs) for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x, is_causal=True)[0]
        return x


@pytest.fixture
def runner_forwards(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the forwards of the runners that dilated calls run (fused kernels or a plan)."""
    forwards: list[int] = []
    for runner in (FusedRunner, PlanRunner):
        real = runner.forward
        counted = lambda r, x, real=real: forwards.append(1) or real(r, x)  # noqa: E731
        monkeypatch.setattr(runner, "forward", counted)
    return forwards


@pytest.mark.gpu
def test_reduce_overhead_trains_a_multihead_stack(runner_forwards: list[int]) -> None:
    """``torch.compile(mode="reduce-overhead", fullgraph=True)`` (CUDA graph trees) of a stack
    of two layers trains 3 steps: compiled before any eager call, so whatever the first calls
    make lies in the trees' memory pool, which they check holds nothing but tracked outputs;
    the attention runs inside the graphs (no Python of it runs once they replay, and no graph
    was skipped); each step's output and gradients are as close to float64 as eager's
    (Inductor sums the float32 projections in its own order)."""
    torch.manual_seed(0)
    model = _Stack(
        2, embed_dim=128, num_heads=4, segment_lengths=[256, 512], dilation_rates=[1, 2],
        device="cuda",
    )  # fmt: skip
    twin = copy.deepcopy(model)
    compiled = torch.compile(twin, mode="reduce-overhead", fullgraph=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    xs = [torch.randn(2, 1024, 128, device="cuda", generator=gen) for _ in range(3)]
    torch._dynamo.utils.counters.clear()
    steps, per_step = [], []
    for x in xs:
        torch.compiler.cudagraph_mark_step_begin()
        runner_forwards.clear()
        out, (dx,) = _run(compiled, [x])  # the graphs' outputs are reused: copied at once
        steps.append((out.clone(), dx.clone(), [p.grad.clone() for p in twin.parameters()]))
        per_step.append(len(runner_forwards))
        twin.zero_grad(set_to_none=True)
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0
    # One forward per layer (the backward runs none), and none once the graphs replay.
    assert per_step[0] == 2 and per_step[-1] == 0, per_step
    exact_model = copy.deepcopy(model).double()
    for x, (out, dx, grads) in zip(xs, steps, strict=True):
        ref_out, (ref_dx,) = _run(model, [x])
        exact_out, (exact_dx,) = _run(exact_model, [x.double()])
        pairs = [(out, ref_out, exact_out), (dx, ref_dx, exact_dx)]
        pairs += [
            (got, p.grad, e.grad)
            for got, p, e in zip(grads, model.parameters(), exact_model.parameters(), strict=True)
        ]
        for compiled_value, eager_value, exact_value in pairs:
            # Inductor sums the projections' float32 products in its own order: the compiled
            # step is held to eager's distance from float64, not to eager's rounding.
            eager_error = (eager_value.double() - exact_value).abs().max().item()
            compiled_error = (compiled_value.double() - exact_value).abs().max().item()
            scale = exact_value.abs().max().item()
            assert compiled_error <= 2 * eager_error + 1e-4 * scale, (compiled_error, eager_error)
        model.zero_grad(set_to_none=True)
        exact_model.zero_grad(set_to_none=True)


@pytest.mark.gpu
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
def test_cuda_graph_captures_dilated_attention_forward_and_backward(masked: bool) -> None:
    """A ``torch.cuda.graph`` capture of ``dilated_attention``'s forward and backward, after
    the usual warm-up on a side stream (where the kernel is chosen and compiled), replayed on new
    inputs copied into the captured ones: outputs and gradients equal eager calls on those
    inputs, bit for bit (the same kernels)."""
    n = 1024
    mask = torch.zeros(2, n, dtype=torch.bool, device="cuda")
    mask[1, -100:] = masked

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dilated_attention(
            q, k, v, [256, 512], [1, 2], is_causal=True, key_padding_mask=mask if masked else None
        )

    static = [t.requires_grad_() for t in _qkv(n=n, dtype=torch.bfloat16, device="cuda")]
    dout = torch.randn_like(static[0])
    outs: list[torch.Tensor] = []

    def step() -> None:
        for t in static:
            t.grad = None
        outs[:] = [call(*static)]
        outs[0].backward(dout)

    graph = captured(step, warmups=2)
    (out,) = outs
    for seed in (1, 2):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        new = [torch.randn(t.shape, device="cuda", generator=gen).bfloat16() for t in static]
        with torch.no_grad():
            for t, value in zip(static, new, strict=True):
                t.copy_(value)
        graph.replay()
        leaves = [t.clone().requires_grad_() for t in new]
        ref_out = call(*leaves)
        ref_out.backward(dout)
        torch.testing.assert_close(out, ref_out, atol=0, rtol=0)
        for t, leaf in zip(static, leaves, strict=True):
            torch.testing.assert_close(t.grad, leaf.grad, atol=0, rtol=0)
