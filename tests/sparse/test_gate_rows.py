"""Gated rows (Note [Gated rows in one pass] in ``backends/triton_kernels/gates.py``): the
kernels give the bits of torch's ops for one product (``gate * out``, ``gate * dout``) and
copies, ``total + gate * out`` and the gate's gradient within one rounding of the float64
result, on plain rows and on the strided views of a run of residue classes; ``gated_add``'s
gradients against float64 (gradcheck and gradgradcheck); where the kernels are not taken
(CPU, broadcast gates, recorded ops, mixed dtypes) torch's ops give the same results."""

from __future__ import annotations

import pytest
import torch
from support.triton import KERNEL_DEVICES, skip_without_triton

from dilated_attention.sparse import gate_rows
from dilated_attention.sparse.residue_rows import ResidueRows

F64 = torch.float64
#: A run of three classes (first rows 1, 2, 3) of every fourth row of 64: (B, 16, 3, H, D) views.
CLASSES = ResidueRows(((1, 3),), 4, 64)
RUN = CLASSES.runs[0]


def _assert_rounded_once(got: torch.Tensor, terms: torch.Tensor) -> None:
    """``got`` is the float64 sum of ``terms`` (over the last dimension, kept) formed in
    float32 and rounded once to ``got``'s dtype: within a unit in its last place of the sum,
    plus float32's rounding of each partial sum (at most ``D`` of them, each within float32's
    unit of the terms' absolute sum)."""
    exact = terms.sum(-1, keepdim=True)
    scale = terms.abs().sum(-1, keepdim=True)
    bound = torch.finfo(got.dtype).eps * exact.abs() + terms.shape[-1] * 2**-23 * scale
    assert ((got.to(F64) - exact).abs() <= bound + torch.finfo(got.dtype).tiny).all()


def _gates_module():  # type: ignore[no-untyped-def]
    from dilated_attention.backends.triton_kernels import gates

    return gates


def _operands(device: str, dtype: torch.dtype, strided: bool) -> dict[str, torch.Tensor]:
    """out, total, dout (*lead, D) and gate (*lead, 1): plain (2, 37, 3, 40) rows, or a run's
    views (2, 16, 3, 3, 40): out laid out as a kernel's output of the classes as heads, total
    and dout views of whole tensors, the gate a view of (B, N, H, 3) gates."""
    gen = torch.Generator().manual_seed(7 + strided)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device, dtype)

    if not strided:
        gates = rand(2, 37, 3, 3)
        return {"out": rand(2, 37, 3, 40), "total": rand(2, 37, 3, 40),
                "dout": rand(2, 37, 3, 40), "gate": gates[..., 1, None]}  # fmt: skip
    gates = rand(2, 64, 3, 3)
    return {
        "out": rand(2, 16, 3 * 3, 40).unflatten(2, (3, 3)).transpose(2, 3),
        "total": CLASSES.view(rand(2, 64, 3, 40), 1, RUN),
        "dout": CLASSES.view(rand(2, 64, 3, 40), 1, RUN),
        "gate": CLASSES.view(gates[..., 2, None], 1, RUN),
    }


@pytest.mark.parametrize("strided", [False, True], ids=["rows", "classes"])
@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_the_kernels_give_torchs_bits(device: str, dtypes: list[torch.dtype], strided: bool):
    skip_without_triton(device)
    gates = _gates_module()
    for dtype in dtypes:
        x = _operands(device, dtype, strided)
        out, total, gate = x["out"], x["total"], x["gate"]
        product = torch.full_like(total, float("nan"))
        gates.gated_rows_into(product, out, gate)
        assert torch.equal(product, out * gate)
        summed = torch.full_like(total, float("nan"))
        gates.gated_rows_into(summed, out, gate, total)
        terms = torch.stack([total.to(F64), out.to(F64) * gate.to(F64)], -1)
        _assert_rounded_once(summed.unsqueeze(-1), terms)
        into = total.clone()  # in place into the total, as the inference sum adds
        gates.gated_rows_into(into, out, gate, into)
        assert torch.equal(into, summed)
        scaled = out.clone()  # in place into the output, as the inference sum's first term
        gates.gated_rows_into(scaled, scaled, gate)
        assert torch.equal(scaled, product)
        first = total[:1, :1]  # operands broadcasting along leading dimensions of size 1
        got = torch.full_like(total, float("nan"))
        gates.gated_rows_into(got, out, gate[:, :1], first)
        terms = torch.stack([first.to(F64).expand_as(got), out.to(F64) * gate[:, :1].to(F64)], -1)
        _assert_rounded_once(got.unsqueeze(-1), terms)
        copied = torch.full_like(total, float("nan"))
        gates.copy_rows(out, copied)
        assert torch.equal(copied, out)


@pytest.mark.parametrize("strided", [False, True], ids=["rows", "classes"])
@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_the_gate_gradients_in_one_pass(device: str, dtypes: list[torch.dtype], strided: bool):
    """``d_out`` has the bits of ``gate * dout``; ``d_gate`` is the float64 sum of the row's
    products within one rounding of its dtype; either may be left out."""
    skip_without_triton(device)
    gates = _gates_module()
    for dtype in dtypes:
        x = _operands(device, dtype, strided)
        dout, out, gate = x["dout"], x["out"], x["gate"]
        d_out = torch.full_like(out, float("nan"))
        d_gate = torch.full_like(gate, float("nan"))
        gates.gate_grads_into(d_out, d_gate, dout, out, gate)
        assert torch.equal(d_out, gate * dout)
        _assert_rounded_once(d_gate, dout.to(F64) * out.to(F64))
        alone = torch.full_like(gate, float("nan"))
        gates.gate_grads_into(None, alone, dout, out, gate)
        assert torch.equal(alone, d_gate)
        only_out = torch.full_like(out, float("nan"))
        gates.gate_grads_into(only_out, None, dout, out, gate)
        assert torch.equal(only_out, d_out)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_gated_add_gradchecks_in_float64(device: str) -> None:
    """float64 takes torch's ops on every device (the kernels take 16- and 32-bit floats)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gen = torch.Generator().manual_seed(3)
    total, out = (torch.randn(2, 5, 3, 6, generator=gen, dtype=F64).to(device).requires_grad_()
                  for _ in range(2))  # fmt: skip
    gate = torch.rand(2, 5, 3, 1, generator=gen, dtype=F64).to(device).requires_grad_()
    torch.testing.assert_close(gate_rows.gated_add(total, out, gate), total + gate * out,
                               rtol=0, atol=0)  # fmt: skip
    assert torch.autograd.gradcheck(gate_rows.gated_add, (total, out, gate))
    assert torch.autograd.gradgradcheck(gate_rows.gated_add, (total, out, gate))
    assert torch.autograd.gradcheck(lambda o, g: gate_rows.gated_add(None, o, g), (out, gate))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gated_add_on_the_gpu_against_torchs_ops(dtype: torch.dtype) -> None:
    """The kernels' path (CUDA): the sum's bits and the branch's gradient's bits are torch's,
    the gate's gradient within a rounding; under create_graph the ops are torch's own."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    x = _operands("cuda", dtype, strided=False)
    total, out, gate, dout = (x[k].clone().requires_grad_(k != "dout")
                              for k in ("total", "out", "gate", "dout"))  # fmt: skip
    assert gate_rows._kernels(out.detach(), gate=gate.detach()) is not None
    got = gate_rows.gated_add(total, out, gate)
    want = total + gate * out
    x64 = {key: value.detach().to(F64) for key, value in x.items()}
    terms = torch.stack([x64["total"], x64["out"] * x64["gate"]], -1)
    _assert_rounded_once(got.unsqueeze(-1), terms)
    grads = torch.autograd.grad(got, (total, out, gate), dout)
    wants = torch.autograd.grad(want, (total, out, gate), dout)
    assert torch.equal(grads[0], wants[0]) and torch.equal(grads[1], wants[1])
    _assert_rounded_once(grads[2], x64["dout"] * x64["out"])
    again = torch.autograd.grad(gate_rows.gated_add(total, out, gate), (out, gate), dout,
                                create_graph=True)  # fmt: skip
    assert all(g.requires_grad for g in again)
    assert torch.equal(again[0], wants[1])  # torch's own ops under create_graph
    torch.testing.assert_close(again[1], wants[2])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scaled_scatter_joined_to_a_sum_on_the_gpu(dtype: torch.dtype) -> None:
    """``scatter(parts, scale=g, total=t)`` on the kernels' path: every row within one rounding
    of the float64 ``t + g * scatter(parts)`` (``t`` itself in the rows no class holds), the
    gradients of ``t`` and of the parts torch's bits, the scale's within a rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    classes = ResidueRows(((1, 3),), 4, 64)
    gen = torch.Generator().manual_seed(5)
    x, total, dout = (torch.randn(2, 64, 3, 40, generator=gen).to("cuda", dtype)
                      for _ in range(3))  # fmt: skip
    gates = torch.rand(2, 64, 3, 3, generator=gen).to("cuda", dtype).requires_grad_()
    total.requires_grad_()
    parts = [p.clone().requires_grad_() for p in classes.gather(x, 1)]
    views = [classes.view(t.detach(), 1, classes.runs[0]) for t in (total, gates[..., 1, None])]
    out_view = parts[0].detach()
    assert gate_rows._kernels(out_view, out_view, views[0], gate=views[1],
                              written=(out_view,)) is not None  # fmt: skip
    got = classes.scatter(parts, 1, 0.0, scale=gates[..., 1, None], total=total)
    want = total + gates[..., 1, None] * classes.scatter(parts, 1, 0.0)
    held = classes.scatter([p.detach().to(F64) for p in parts], 1, 0.0)  # 0 where no class
    gate = gates[..., 1, None].detach().to(F64)
    _assert_rounded_once(got.unsqueeze(-1), torch.stack([total.detach().to(F64), gate * held],
                                                        -1))  # fmt: skip
    assert torch.equal(got[:, 0], total[:, 0])  # row 0: no class holds it
    grads = torch.autograd.grad(got, (total, gates, *parts), dout)
    wants = torch.autograd.grad(want, (total, gates, *parts), dout)
    assert torch.equal(grads[0], wants[0]) and torch.equal(grads[2], wants[2])
    _assert_rounded_once(grads[1][..., 1, None], dout.to(F64) * held)
    assert not grads[1][..., 0::2].any()


def test_where_the_kernels_are_not_taken() -> None:
    """CPU tensors, a gate with more than one value per row, mixed dtypes, rows that are not
    contiguous and ops autograd records all take torch's ops; a gate that broadcasts along a
    leading dimension gets its gradient summed over it."""
    cpu = torch.randn(2, 4, 3, 8)
    assert gate_rows._kernels(cpu, gate=cpu[..., :1]) is None
    if torch.cuda.is_available():
        x = torch.randn(2, 4, 3, 8, device="cuda")
        assert gate_rows._kernels(x, gate=x[..., :2]) is None  # two values per row
        assert gate_rows._kernels(x, x.half(), gate=x[..., :1]) is None
        assert gate_rows._kernels(x.transpose(-1, -2), gate=x[..., :1]) is None
        assert gate_rows._kernels(x.requires_grad_(), gate=x[..., :1]) is None
    gen = torch.Generator().manual_seed(5)
    dout, out = (torch.randn(2, 4, 3, 8, generator=gen, dtype=F64) for _ in range(2))
    gate = torch.rand(2, 1, 3, 1, generator=gen, dtype=F64)  # one gate for every position
    torch.testing.assert_close(gate_rows.gated_rows(out, gate), out * gate, rtol=0, atol=0)
    d_out, d_gate = torch.empty_like(out), torch.empty_like(gate)
    gate_rows.gate_grads(dout, out, gate, d_out, d_gate)
    torch.testing.assert_close(d_out, dout * gate, rtol=0, atol=0)
    torch.testing.assert_close(d_gate, (dout * out).sum(dim=(1, 3), keepdim=True))


def test_gated_add_promotes_as_torch_does() -> None:
    """A float32 gate on 16-bit outputs gives a float32 sum, and each gradient in its input's
    dtype, as ``total + gate * out`` with torch's ops."""
    gen = torch.Generator().manual_seed(9)
    out = torch.randn(2, 5, 3, 6, generator=gen).bfloat16().requires_grad_()
    gate = torch.rand(2, 5, 3, 1, generator=gen).requires_grad_()
    got = gate_rows.gated_add(None, out, gate)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, gate * out, rtol=0, atol=0)
    d_out, d_gate = torch.autograd.grad(got, (out, gate), torch.ones_like(got))
    assert (d_out.dtype, d_gate.dtype) == (torch.bfloat16, torch.float32)


def test_gated_add_keeps_only_what_its_gradients_need() -> None:
    """Without the gate's gradient the branch's output is not kept for the backward (nor the
    gate without the output's), as torch's product keeps them; the gradients asked for are
    still right, the others None."""
    gen = torch.Generator().manual_seed(11)
    total, out = (torch.randn(2, 5, 3, 6, generator=gen, dtype=F64) for _ in range(2))
    gate = torch.rand(2, 5, 3, 1, generator=gen, dtype=F64)
    for need_out, need_gate in ((True, False), (False, True)):
        o, g = out.clone().requires_grad_(need_out), gate.clone().requires_grad_(need_gate)
        saved: list[torch.Tensor] = []

        def keep(x: torch.Tensor, saved: list[torch.Tensor] = saved) -> torch.Tensor:
            saved.append(x)
            return x

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda x: x):
            got = gate_rows.gated_add(total, o, g)
        assert [x.shape[-1] for x in saved] == ([1] if need_out else [6])
        grads = torch.autograd.grad(got, [x for x in (o, g) if x.requires_grad],
                                    torch.ones_like(got))  # fmt: skip
        want = gate.expand_as(out) if need_out else out.sum(-1, keepdim=True)
        torch.testing.assert_close(grads[0], want, rtol=0, atol=1e-12)


def test_broadcast_operands_get_their_own_shapes() -> None:
    """An output or gate that broadcasts along leading dimensions gives the broadcast sum, and
    its gradient summed back to its own shape (torch's ops; the kernels take only operands
    whose written rows are all their own)."""
    gen = torch.Generator().manual_seed(13)
    out = torch.randn(2, 5, 1, 6, generator=gen, dtype=F64, requires_grad=True)
    gate = torch.rand(2, 5, 3, 1, generator=gen, dtype=F64, requires_grad=True)
    got = gate_rows.gated_add(None, out, gate)
    assert got.shape == (2, 5, 3, 6)
    torch.testing.assert_close(got, gate * out, rtol=0, atol=0)
    assert torch.autograd.gradcheck(lambda o, g: gate_rows.gated_add(None, o, g), (out, gate))
    if torch.cuda.is_available():
        x = torch.randn(2, 5, 3, 6, device="cuda")
        expanded = torch.empty(2, 5, 1, 6, device="cuda").expand(2, 5, 3, 6)
        assert gate_rows._kernels(expanded, x, written=(expanded,)) is None  # racing writes
        assert gate_rows._kernels(x, x[:, :, :2]) is None  # neither its size nor 1

