"""Dense calls on torch's autograd (Note [Dense calls on torch's autograd] in
``core/higher_order.py``): a plain dense training call on a kernel whose op torch's autograd
differentiates runs that op as torch records it, and a hook on its node swaps in the
differentiable recompute under ``create_graph=True``.

On the CPU the path runs on the CPU flash kernel made to record (``_recording_cpu_flash``: the
library keeps that kernel under its own Function, for its NaN handling); on CUDA on cuDNN, which
records in the library itself. Every value is compared with the float64 oracle
(``tests/support/oracle.py``, no code shared with the library).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Sequence
from types import SimpleNamespace

import pytest
import torch
from support.backend_params import runs_on
from support.oracle import oracle_attention

import dilated_attention as da
from dilated_attention.backends.sdpa import CpuFlashBackend, recorded_node_hooks
from dilated_attention.core import autograd
from dilated_attention.resolve import Request
from dilated_attention.resolve.resolver import _recorded

F64 = torch.float64


def _bhnd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


def _record_on_cpu(
    self: CpuFlashBackend,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grads: Callable[[torch.Tensor], Sequence[torch.Tensor]],
    *,
    scale: float,
    is_causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU flash op as torch records it, with the hooks cuDNN's recorded call hangs on its
    node. The op takes as many key/value heads as query heads (``native_gqa`` is False: the
    rule records no GQA call on it)."""
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = op(_bhnd(q), _bhnd(k), _bhnd(v), 0.0, is_causal, scale=scale)
    return recorded_node_hooks(out, grads), lse


@pytest.fixture
def _recording_cpu_flash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(CpuFlashBackend, "records_autograd", True)
    monkeypatch.setattr(CpuFlashBackend, "recorded_forward", _record_on_cpu)


def _qkv(
    n: int, heads: int, kv_heads: int, dtype: torch.dtype, seed: int = 0, device: str = "cpu"
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = ((2, n, heads, 8), (2, n, kv_heads, 8), (2, n, kv_heads, 8))
    return [torch.randn(s, generator=gen, dtype=F64).to(device, dtype) for s in shapes]


def _upstream(out: torch.Tensor, layout: str) -> torch.Tensor:
    """An upstream gradient shaped like ``out`` (B, N, H, D), float64 on the CPU: random in
    (B, N, H, D) or (B, H, N, D) memory order, or ones (what ``out.sum()`` sends, as an
    expanded stride-0 tensor on the device)."""
    if layout == "ones":
        return torch.ones(out.shape, dtype=F64)
    gen = torch.Generator().manual_seed(1)
    if layout == "bhnd":
        b, n, h, d = out.shape
        return torch.randn(b, h, n, d, generator=gen, dtype=F64).transpose(1, 2)
    return torch.randn(out.shape, generator=gen, dtype=F64)


def _on_device(dout: torch.Tensor, like: torch.Tensor, layout: str) -> torch.Tensor:
    """``dout`` as the call's upstream gradient, in ``layout``'s memory order."""
    if layout == "ones":
        return torch.ones((), device=like.device, dtype=like.dtype).expand(like.shape)
    if layout == "bhnd":
        return dout.transpose(1, 2).to(like.device, like.dtype).transpose(1, 2)
    return dout.to(like.device, like.dtype)


def _against_oracle(
    out: torch.Tensor,
    lse: torch.Tensor,
    inputs: Sequence[torch.Tensor],
    causal: bool,
    layout: str = "bnhd",
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(out, lse, dq, dk, dv) of the call, on the CPU in float64, and the oracle's on the same
    rounded inputs and upstream gradient (in ``layout``: :func:`_upstream`)."""
    exact = [x.detach().cpu().to(F64).requires_grad_() for x in inputs]
    want_out, want_lse = oracle_attention(*exact, is_causal=causal)
    dout = _upstream(out, layout).to(out.dtype).to(F64)
    got = torch.autograd.grad(out, inputs, _on_device(dout, out, layout))
    want = torch.autograd.grad(want_out, exact, dout)
    return (
        [x.detach().cpu().to(F64) for x in (out, lse, *got)],
        [want_out.detach(), want_lse, *want],
    )


def _node_names(out: torch.Tensor) -> set[str]:
    """The names of every node in ``out``'s graph."""
    names, todo = set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node.name() not in names:
            names.add(node.name())
            todo += [n for n, _ in node.next_functions]
    return names


def _grad_fn_name(out: torch.Tensor) -> str:
    node = out.grad_fn
    while node is not None and "Transpose" in node.name():  # the (B, H, N, D) view back
        node = node.next_functions[0][0]
    return "" if node is None else node.name()


@pytest.mark.usefixtures("_recording_cpu_flash")
@pytest.mark.parametrize("layout", ["bnhd", "bhnd", "ones"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_a_recorded_call_matches_the_oracle(
    causal: bool, kv_heads: int, dtype: torch.dtype, layout: str
) -> None:
    """Output, lse and every gradient of a recorded call (odd length) against float64, and the
    call is the recorded op's node, not the library's Function; with fewer key/value heads,
    which this op does not take, the Function's."""
    q, k, v = (x.requires_grad_() for x in _qkv(13, 4, kv_heads, dtype))
    out, lse = da.attention(q, k, v, is_causal=causal, backend="cpu_flash", return_lse=True)
    recorded = "ScaledDotProductFlashAttentionForCpuBackward0"
    assert _grad_fn_name(out) == (recorded if kv_heads == 4 else "AttentionFunctionBackward")
    got, want = _against_oracle(out, lse, (q, k, v), causal, layout)
    tol = 1e-10 if dtype == F64 else 2e-5
    for name, g, e in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(g, e, atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.usefixtures("_recording_cpu_flash")
def test_the_strategy_says_it_is_recorded() -> None:
    """``explain`` says so for a training call, not for inference."""
    options = dict(device="cpu", dtype=torch.float32, head_dim=8, num_heads=4, seq_len=13,
                   is_causal=True, backend="cpu_flash", operation="dense")  # fmt: skip
    assert "recorded by torch's autograd" in da.explain(**options).description
    assert "recorded" not in da.explain(**options, requires_grad=False).description


_NOT_RECORDED: dict[str, Callable[..., torch.Tensor]] = {
    "key padding mask": lambda q, k, v: da.attention(
        q, k, v, key_padding_mask=torch.zeros(2, 13, dtype=torch.bool), backend="cpu_flash"
    ),
    "sinks": lambda q, k, v: da.attention(q, k, v, sinks=torch.zeros(4), backend="cpu_flash"),
    "end-aligned causal": lambda q, k, v: da.attention(
        q[:, 5:], k, v, is_causal=True, backend="cpu_flash"
    ),
    "packed documents": lambda q, k, v: da.attention(
        q, k, v, cu_seqlens=[0, 6, 13, 26], backend="cpu_flash"
    ),
}


@pytest.mark.usefixtures("_recording_cpu_flash")
@pytest.mark.parametrize("name", list(_NOT_RECORDED))
def test_calls_with_something_around_the_kernel_keep_the_function(name: str) -> None:
    """What the kernel's op alone does not do keeps the call under the library's Function."""
    q, k, v = (x.requires_grad_() for x in _qkv(13, 4, 4, torch.float32))
    names = _node_names(_NOT_RECORDED[name](q, k, v))
    assert "AttentionFunctionBackward" in names
    assert not [n for n in names if "ScaledDotProduct" in n]


@pytest.mark.usefixtures("_recording_cpu_flash")
@pytest.mark.parametrize(
    "fields",
    [{"window": (4, 0)}, {"softcap": 5.0}, {"dropout_p": 0.1}, {"min_rows": 14}, {}],
    ids=["window", "softcap", "dropout", "too few rows", "plain"],
)
def test_the_rule_refuses_what_the_op_does_not_do(fields: dict[str, object]) -> None:
    """The resolver's rule on requests the CPU kernel cannot run itself (a window, soft-capping,
    dropout; fewer rows than the kernel takes): only the plain call is recorded."""
    q, k, v = (x.requires_grad_() for x in _qkv(13, 4, 4, torch.float32))
    backend = CpuFlashBackend()
    if "min_rows" in fields:
        backend.min_rows = fields.pop("min_rows")  # type: ignore[misc]
    request = Request.of("dense", q, k, v, is_causal=True, **fields)
    assert _recorded(request, SimpleNamespace(backend=backend)) == (fields == {} and
                                                                   backend.min_rows == 1)


def _penalty_grads(
    fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], w: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """d/d(q, k, v) of sum_i |d((out * w).sum()) / d input_i|^2."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    grads = torch.autograd.grad((fn(*leaves) * w).sum(), leaves, create_graph=True)
    return torch.autograd.grad(sum((g.to(F64) ** 2).sum() for g in grads), leaves)


def _assert_penalty_matches(
    fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], tol: float, causal: bool
) -> None:
    """``fn``'s gradient-penalty gradients (on the inputs' device and dtype) against the float64
    oracle's on the same rounded inputs and weights, on the CPU."""
    w = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(4), dtype=F64)
    w = w.to(inputs[0].dtype).to(F64)  # the same rounded weights for both
    oracle = lambda q, k, v: oracle_attention(q, k, v, is_causal=causal)[0]  # noqa: E731
    want = _penalty_grads(oracle, [x.detach().cpu().to(F64) for x in inputs], w)
    got = _penalty_grads(fn, inputs, w.to(inputs[0].device, inputs[0].dtype))
    for label, g, e in zip("qkv", got, want, strict=True):
        scale = float(e.abs().max())
        torch.testing.assert_close(
            g.cpu().to(F64), e, atol=tol * scale, rtol=tol,
            msg=lambda m, label=label: f"d(penalty)/d{label}: {m}",
        )  # fmt: skip


@pytest.mark.usefixtures("_recording_cpu_flash")
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_a_recorded_call_has_exact_second_order_gradients(dtype: torch.dtype) -> None:
    """Under create_graph=True the node's hook swaps in the differentiable recompute: a gradient
    penalty's gradients match float64 (torch's own backward op has no derivative)."""
    fn = lambda q, k, v: da.attention(q, k, v, is_causal=True, backend="cpu_flash")  # noqa: E731
    tol = 1e-10 if dtype == F64 else 2e-5
    _assert_penalty_matches(fn, _qkv(13, 4, 4, dtype, seed=3), tol, causal=True)


@pytest.mark.usefixtures("_recording_cpu_flash")
@pytest.mark.parametrize("needs", ["qkv", "q", "kv"])
def test_second_order_gradients_of_a_rectangular_call(needs: str) -> None:
    """A non-causal call with fewer queries than keys, some inputs needing no gradient: the
    penalty's gradients of those that do match float64."""
    q, k, v = _qkv(13, 4, 4, F64, seed=5)
    q = q[:, :9]

    def penalty(fn: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, ...]:
        inputs = [
            x.detach().clone().requires_grad_(name in needs)
            for name, x in zip("qkv", (q, k, v), strict=True)
        ]
        wanted = [x for x in inputs if x.requires_grad]
        out = fn(*inputs)
        w = torch.linspace(-1, 1, out.numel(), dtype=F64).view(out.shape)
        grads = torch.autograd.grad((out * w).sum(), wanted, create_graph=True)
        return torch.autograd.grad(sum((g**2).sum() for g in grads), wanted)

    got = penalty(lambda q, k, v: da.attention(q, k, v, backend="cpu_flash"))
    want = penalty(lambda q, k, v: oracle_attention(q, k, v)[0])
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e, atol=1e-10, rtol=1e-10)


@pytest.mark.usefixtures("_recording_cpu_flash")
def test_saved_tensor_hooks_keep_the_function() -> None:
    """Under saved-tensor hooks (here a counting pair; checkpointing and save_on_cpu install such
    hooks) the call keeps the library's Function, whose saved tensors go through them: the
    recorded node's hook would hold q, k and v outside them."""
    q, k, v = (x.requires_grad_() for x in _qkv(13, 4, 4, torch.float32))
    packed: list[int] = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        packed.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = da.attention(q, k, v, is_causal=True, backend="cpu_flash")
    assert _grad_fn_name(out) == "AttentionFunctionBackward"
    assert q.numel() in packed
    want = oracle_attention(*(x.detach().to(F64) for x in (q, k, v)), is_causal=True)[0]
    torch.testing.assert_close(out.detach().to(F64), want, atol=2e-5, rtol=2e-5)


@pytest.mark.usefixtures("_recording_cpu_flash")
@pytest.mark.parametrize("query", ["missing", "refuses"])
def test_a_torch_that_cannot_say_keeps_the_function(
    query: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where torch has no query for the saved-tensor hooks in force, or it raises, the call keeps
    the Function (which honours any hooks) instead of failing."""

    def refuses(_: bool) -> None:
        raise TypeError("takes no arguments")

    monkeypatch.setattr(autograd, "_TOP_SAVED_HOOKS", None if query == "missing" else refuses)
    q, k, v = (x.requires_grad_() for x in _qkv(13, 4, 4, torch.float32))
    out = da.attention(q, k, v, is_causal=True, backend="cpu_flash")
    assert _grad_fn_name(out) == "AttentionFunctionBackward"


@pytest.mark.usefixtures("_recording_cpu_flash")
def test_checkpointing_frees_the_inputs_and_keeps_the_gradients() -> None:
    """Non-reentrant activation checkpointing: the query made inside the checkpointed function is
    freed after the forward (not held by a hook), and the gradients equal the call's without
    checkpointing."""
    leaf, k, v = (x.requires_grad_() for x in _qkv(13, 4, 4, torch.float32))
    held: list[weakref.ref[torch.Tensor]] = []

    def layer(x: torch.Tensor) -> torch.Tensor:
        q = x * 2.0
        held.append(weakref.ref(q))
        return da.attention(q, k, v, is_causal=True, backend="cpu_flash")

    out = torch.utils.checkpoint.checkpoint(layer, leaf, use_reentrant=False)
    gc.collect()
    assert held[0]() is None
    got = torch.autograd.grad(out.sum(), (leaf, k, v))
    want = torch.autograd.grad(layer(leaf).sum(), (leaf, k, v))
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e)


@pytest.mark.usefixtures("_recording_cpu_flash")
def test_a_recorded_output_is_freed_without_a_backward() -> None:
    """The node's hooks hold no output: an output never differentiated is freed once dropped."""
    q, k, v = (x.requires_grad_() for x in _qkv(13, 4, 4, torch.float32))
    out = da.attention(q, k, v, is_causal=True, backend="cpu_flash")
    assert _grad_fn_name(out) == "ScaledDotProductFlashAttentionForCpuBackward0"
    held = weakref.ref(out)
    del out
    gc.collect()
    assert held() is None


@pytest.mark.usefixtures("_recording_cpu_flash")
def test_a_plain_backward_lets_the_inputs_go() -> None:
    """After a plain backward the hook holds no input: a query that only the graph still
    references is freed while the output (and so the node) lives on."""
    leaf, k, v = (x.requires_grad_() for x in _qkv(13, 4, 4, torch.float32))
    q = leaf * 1.0  # not a leaf: nothing but the call refers to it
    held = weakref.ref(q)
    out = da.attention(q, k, v, is_causal=True, backend="cpu_flash")
    del q
    out.sum().backward()
    gc.collect()
    assert held() is None
    assert out.grad_fn is not None


@pytest.mark.usefixtures("_recording_cpu_flash")
def test_create_graph_after_a_retained_plain_backward_is_exact() -> None:
    """A plain backward with retain_graph=True, then a gradient penalty through the same node
    (the query made inside, held by nothing but the graph): the node's saved tensors keep the
    weakly held inputs, and the penalty's gradients match float64."""
    leaf, k, v = (x.requires_grad_() for x in _qkv(13, 4, 4, F64, seed=3))
    out = da.attention(leaf * 1.0, k, v, is_causal=True, backend="cpu_flash")
    w = torch.linspace(-1, 1, out.numel(), dtype=F64).view(out.shape)
    torch.autograd.grad((out * w).sum(), (leaf, k, v), retain_graph=True)
    grads = torch.autograd.grad((out * w).sum(), (leaf, k, v), create_graph=True)
    got = torch.autograd.grad(sum((g**2).sum() for g in grads), (leaf, k, v))
    exact = [x.detach().clone().requires_grad_() for x in (leaf, k, v)]
    want_out = oracle_attention(*exact, is_causal=True)[0]
    grads = torch.autograd.grad((want_out * w).sum(), exact, create_graph=True)
    want = torch.autograd.grad(sum((g**2).sum() for g in grads), exact)
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e, atol=1e-10, rtol=1e-10)


# -- cuDNN, recorded by the library itself ---------------------------------------------------


cudnn_only = pytest.mark.skipif(
    not (torch.cuda.is_available() and runs_on("sdpa_cudnn", "cuda")),
    reason="needs CUDA with cuDNN attention (or --require-backends sdpa_cudnn)",
)


@pytest.mark.gpu
@cudnn_only
@pytest.mark.parametrize("layout", ["bnhd", "bhnd", "ones"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv_heads", [4, 1], ids=["mha", "gqa"])
def test_cudnn_records_and_matches_the_oracle(causal: bool, kv_heads: int, layout: str) -> None:
    """cuDNN's recorded call against float64, with upstream gradients laid out like the output,
    in another memory order, and expanded from one value (``out.sum()``): torch's own backward
    takes each."""
    q, k, v = (x.requires_grad_() for x in _qkv(77, 4, kv_heads, torch.bfloat16, device="cuda"))
    out, lse = da.attention(q, k, v, is_causal=causal, backend="sdpa_cudnn", return_lse=True)
    assert "Cudnn" in _grad_fn_name(out)
    got, want = _against_oracle(out, lse, (q, k, v), causal, layout)
    for name, g, e in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(
            g, e, atol=3e-2 * float(e.abs().max()), rtol=3e-2, msg=lambda m, n=name: f"{n}: {m}"
        )  # fmt: skip


@pytest.mark.gpu
@cudnn_only
def test_cudnn_recorded_second_order_gradients_match_the_oracle() -> None:
    fn = lambda q, k, v: da.attention(q, k, v, is_causal=True, backend="sdpa_cudnn")  # noqa: E731
    inputs = _qkv(77, 4, 2, torch.bfloat16, seed=3, device="cuda")
    _assert_penalty_matches(fn, inputs, 3e-2, causal=True)
