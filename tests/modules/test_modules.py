"""``DilatedAttention`` and ``MultiheadDilatedAttention``: shapes, equivalences, causality, masks.

The multihead module is checked against an independent dense computation (its own projection
weights, then ``F.scaled_dot_product_attention``) and against ``nn.MultiheadAttention``, for the
single-branch schedule where dilated attention is plain attention.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dilated_attention
from dilated_attention import DilatedAttention, MultiheadDilatedAttention

B, N, E, H = 2, 50, 32, 4
HEAD_DIM = E // H
# Partial last segments at N = 50 for every branch (50 = 6*8+2 = 3*16+2 = 32+18).
SEGMENTS = [8, 16, 32]
RATES = [1, 2, 4]
F64 = torch.float64
EXACT = {"atol": 1e-12, "rtol": 0.0}
CLOSE64 = {"atol": 1e-10, "rtol": 1e-7}


def _mha(**kwargs: Any) -> MultiheadDilatedAttention:
    """A float64 multihead module with the default schedule; kwargs override."""
    args: dict[str, Any] = {
        "embed_dim": E,
        "num_heads": H,
        "segment_lengths": SEGMENTS,
        "dilation_rates": RATES,
        "dtype": F64,
    }
    args.update(kwargs)
    return MultiheadDilatedAttention(**args)


def _x(n: int = N, e: int = E, dtype: torch.dtype = F64) -> torch.Tensor:
    """A random (B, n, e) input."""
    return torch.randn(B, n, e, dtype=dtype)


def _linears(mha: MultiheadDilatedAttention) -> dict[str, nn.Linear]:
    """The q/k/v/out projections of the module, by their (torchscale / fkodom) names."""
    names = ("q_proj", "k_proj", "v_proj", "out_proj")
    missing = [n for n in names if not isinstance(getattr(mha, n, None), nn.Linear)]
    assert not missing, f"expected nn.Linear attributes {missing} on MultiheadDilatedAttention"
    return {n: getattr(mha, n) for n in names}


def _layer_norms(module: nn.Module) -> list[nn.LayerNorm]:
    """Every LayerNorm inside ``module``."""
    return [m for m in module.modules() if isinstance(m, nn.LayerNorm)]


def _out(result: Any) -> torch.Tensor:
    """The output tensor of a multihead forward, checking the (output, None) contract."""
    assert isinstance(result, tuple) and len(result) == 2, type(result)
    assert result[1] is None
    return result[0]


# -------------------------------------------------------------------------------- DilatedAttention


def test_public_exports() -> None:
    """The modules are importable from the package root and from ``dilated_attention.modules``
    (the same classes), and listed in both ``__all__``."""
    import dilated_attention.modules as modules

    for name in (
        "DilatedAttention", "MultiheadDilatedAttention", "MultiheadAttention",
        "BlockSparseAttention", "BlockSparseMultiheadAttention",
    ):  # fmt: skip
        assert name in dilated_attention.__all__ and name in modules.__all__
        assert getattr(modules, name) is getattr(dilated_attention, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_dilated_module_shape_dtype(dtype: torch.dtype) -> None:
    """Output has the query's shape and dtype."""
    q, k, v = (torch.randn(B, N, H, HEAD_DIM, dtype=dtype) for _ in range(3))
    out = DilatedAttention(SEGMENTS, RATES)(q, k, v)
    assert out.shape == q.shape
    assert out.dtype == dtype
    assert torch.isfinite(out.float()).all()


@pytest.mark.parametrize("kv_heads", [H, 2, 1], ids=lambda h: f"kv{h}")
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("use_mask", [False, True], ids=["nomask", "mask"])
def test_dilated_module_equals_functional(kv_heads: int, is_causal: bool, use_mask: bool) -> None:
    """The module is the functional API with the same arguments (GQA, causal, mask, scale)."""
    q = torch.randn(B, N, H, HEAD_DIM, dtype=F64)
    k = torch.randn(B, N, kv_heads, HEAD_DIM, dtype=F64)
    v = torch.randn(B, N, kv_heads, HEAD_DIM, dtype=F64)
    mask = torch.rand(B, N) < 0.3 if use_mask else None
    module = DilatedAttention(SEGMENTS, RATES, scale=0.3)
    out = module(q, k, v, is_causal=is_causal, key_padding_mask=mask)
    ref = dilated_attention.dilated_attention(
        q, k, v, SEGMENTS, RATES, is_causal=is_causal, scale=0.3, key_padding_mask=mask
    )
    assert out.shape == (B, N, H, HEAD_DIM)
    torch.testing.assert_close(out, ref, **EXACT)


def test_dilated_module_scale_is_used() -> None:
    """``scale`` reaches the kernel: default equals head_dim**-0.5, another scale differs."""
    q, k, v = (torch.randn(B, N, H, HEAD_DIM, dtype=F64) for _ in range(3))
    default = DilatedAttention(SEGMENTS, RATES)(q, k, v)
    explicit = DilatedAttention(SEGMENTS, RATES, scale=HEAD_DIM**-0.5)(q, k, v)
    torch.testing.assert_close(explicit, default, **CLOSE64)
    assert not torch.allclose(DilatedAttention(SEGMENTS, RATES, scale=2.0)(q, k, v), default)


def test_dilated_module_gqa_equals_repeated_kv() -> None:
    """GQA through the module equals repeating each kv head for its query-head group."""
    q = torch.randn(B, N, H, HEAD_DIM, dtype=F64)
    k = torch.randn(B, N, 2, HEAD_DIM, dtype=F64)
    v = torch.randn(B, N, 2, HEAD_DIM, dtype=F64)
    module = DilatedAttention(SEGMENTS, RATES)
    out = module(q, k, v)
    ref = module(q, k.repeat_interleave(H // 2, dim=2), v.repeat_interleave(H // 2, dim=2))
    torch.testing.assert_close(out, ref, **CLOSE64)


def test_dilated_module_dropout_train_vs_eval() -> None:
    """Dropout acts in training mode only; eval equals the functional result without dropout."""
    q, k, v = (torch.randn(B, N, H, HEAD_DIM, dtype=F64) for _ in range(3))
    module = DilatedAttention(SEGMENTS, RATES, dropout=0.5)
    ref = dilated_attention.dilated_attention(q, k, v, SEGMENTS, RATES)
    module.eval()
    torch.testing.assert_close(module(q, k, v), ref, **EXACT)
    module.train()
    a, b = module(q, k, v), module(q, k, v)
    assert not torch.allclose(a, b)
    assert not torch.allclose(a, ref)


# ----------------------------------------------------------------------- MultiheadDilatedAttention


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_multihead_shape_and_return(dtype: torch.dtype) -> None:
    """(B, N, E) in, ((B, N, E), None) out, in the module's dtype."""
    mha = _mha(dtype=dtype)
    x = _x(dtype=dtype)
    out = _out(mha(x))
    assert out.shape == (B, N, E)
    assert out.dtype == dtype
    assert torch.isfinite(out).all()


def test_multihead_self_attention_default() -> None:
    """``forward(x)`` is ``forward(x, x, x)``."""
    mha = _mha()
    x = _x()
    torch.testing.assert_close(_out(mha(x)), _out(mha(x, x, x)), **EXACT)
    torch.testing.assert_close(
        _out(mha(x, is_causal=True)), _out(mha(x, x, x, is_causal=True)), **EXACT
    )


def test_multihead_cross_attention_differs() -> None:
    """Distinct key/value inputs are actually used (not silently replaced by the query)."""
    mha = _mha()
    x, y = _x(), _x()
    assert not torch.allclose(_out(mha(x, y, y)), _out(mha(x)))


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_multihead_gqa_parameter_shapes(num_kv_heads: int) -> None:
    """k/v projections output num_kv_heads * head_dim features; q and out stay E x E."""
    mha = _mha(num_kv_heads=num_kv_heads)
    lin = _linears(mha)
    kv_dim = num_kv_heads * HEAD_DIM
    assert lin["q_proj"].weight.shape == (E, E)
    assert lin["k_proj"].weight.shape == (kv_dim, E)
    assert lin["v_proj"].weight.shape == (kv_dim, E)
    assert lin["out_proj"].weight.shape == (E, E)
    assert lin["k_proj"].bias is not None and lin["k_proj"].bias.shape == (kv_dim,)
    out = _out(mha(_x()))
    assert out.shape == (B, N, E)


def test_multihead_default_num_kv_heads_is_num_heads() -> None:
    """Without num_kv_heads the module is plain multi-head attention."""
    lin = _linears(_mha())
    assert lin["k_proj"].weight.shape == (E, E)
    assert lin["v_proj"].weight.shape == (E, E)


# ---------------------------------------------------------------------- dense / nn.MHA equivalence


def _dense_reference(
    mha: MultiheadDilatedAttention,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    num_kv_heads: int,
    is_causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Projections with F.linear, SDPA over all positions, optional sub-LN, out projection."""
    lin = _linears(mha)
    b, n, _ = query.shape
    q = F.linear(query, lin["q_proj"].weight, lin["q_proj"].bias).view(b, n, H, HEAD_DIM)
    k = F.linear(key, lin["k_proj"].weight, lin["k_proj"].bias).view(b, n, num_kv_heads, HEAD_DIM)
    v = F.linear(value, lin["v_proj"].weight, lin["v_proj"].bias).view(b, n, num_kv_heads, HEAD_DIM)
    group = H // num_kv_heads
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    mask = None
    if is_causal or key_padding_mask is not None:
        mask = torch.ones(b, 1, n, n, dtype=torch.bool)
        if is_causal:
            mask = mask & torch.ones(n, n, dtype=torch.bool).tril()
        if key_padding_mask is not None:
            mask = mask & ~key_padding_mask[:, None, None, :]
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
    )
    o = o.transpose(1, 2).reshape(b, n, E)
    for ln in _layer_norms(mha):
        o = F.layer_norm(o, ln.normalized_shape, ln.weight, ln.bias, ln.eps)
    return F.linear(o, lin["out_proj"].weight, lin["out_proj"].bias)


@pytest.mark.parametrize("num_kv_heads", [H, 2, 1], ids=lambda h: f"kv{h}")
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layer_norm", [False, True], ids=["noln", "subln"])
def test_multihead_single_branch_equals_dense(
    num_kv_heads: int, is_causal: bool, layer_norm: bool
) -> None:
    """Schedule ([N], [1]) is plain attention: projections + SDPA + (sub-LN) + out projection."""
    mha = _mha(
        segment_lengths=[N], dilation_rates=[1], num_kv_heads=num_kv_heads, layer_norm=layer_norm
    )
    assert len(_layer_norms(mha)) == (1 if layer_norm else 0)
    with torch.no_grad():  # make the LayerNorm affine non-trivial so the test sees it
        for ln in _layer_norms(mha):
            ln.weight.uniform_(0.5, 1.5)
            ln.bias.normal_()
    x, y = _x(), _x()
    for query, kv in ((x, x), (x, y)):
        out = _out(mha(query, kv, kv, is_causal=is_causal))
        ref = _dense_reference(mha, query, kv, kv, num_kv_heads=num_kv_heads, is_causal=is_causal)
        torch.testing.assert_close(out, ref, **CLOSE64)


@pytest.mark.parametrize("num_kv_heads", [H, 2], ids=lambda h: f"kv{h}")
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_multihead_multi_branch_equals_functional(num_kv_heads: int, is_causal: bool) -> None:
    """Multi-branch wiring: projections + functional dilated_attention + sub-LN + out projection."""
    mha = _mha(num_kv_heads=num_kv_heads)
    lin = _linears(mha)
    x, y = _x(), _x()
    mask = _padding_mask()
    q = lin["q_proj"](x).view(B, N, H, HEAD_DIM)
    k = lin["k_proj"](y).view(B, N, num_kv_heads, HEAD_DIM)
    v = lin["v_proj"](y).view(B, N, num_kv_heads, HEAD_DIM)
    o = dilated_attention.dilated_attention(
        q, k, v, SEGMENTS, RATES, is_causal=is_causal, key_padding_mask=mask
    ).reshape(B, N, E)
    (ln,) = _layer_norms(mha)
    ref = lin["out_proj"](ln(o))
    out = _out(mha(x, y, y, is_causal=is_causal, key_padding_mask=mask))
    torch.testing.assert_close(out, ref, **CLOSE64)


def test_multihead_single_branch_with_mask_equals_dense() -> None:
    """Same as above with a key_padding_mask (no fully masked rows)."""
    mha = _mha(segment_lengths=[N], dilation_rates=[1], layer_norm=False)
    x, y = _x(), _x()
    mask = torch.zeros(B, N, dtype=torch.bool)
    mask[0, -7:] = True
    mask[1, 3:9] = True
    out = _out(mha(x, y, y, key_padding_mask=mask))
    ref = _dense_reference(mha, x, y, y, num_kv_heads=H, key_padding_mask=mask)
    torch.testing.assert_close(out, ref, **CLOSE64)


def test_multihead_matches_nn_multihead_attention() -> None:
    """Drop-in: with nn.MultiheadAttention's weights, single branch and no sub-LN, outputs agree."""
    mha = _mha(segment_lengths=[N], dilation_rates=[1], layer_norm=False)
    ref = nn.MultiheadAttention(E, H, batch_first=True, dtype=F64)
    lin = _linears(mha)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([lin[n].weight for n in ("q_proj", "k_proj", "v_proj")]))
        ref.in_proj_bias.copy_(torch.cat([lin[n].bias for n in ("q_proj", "k_proj", "v_proj")]))
        ref.out_proj.weight.copy_(lin["out_proj"].weight)
        ref.out_proj.bias.copy_(lin["out_proj"].bias)
    ref.eval()
    x, y = _x(), _x()
    mask = torch.zeros(B, N, dtype=torch.bool)
    mask[:, -5:] = True
    expected, _ = ref(x, y, y, key_padding_mask=mask, need_weights=False)
    torch.testing.assert_close(_out(mha(x, y, y, key_padding_mask=mask)), expected, **CLOSE64)
    causal = nn.Transformer.generate_square_subsequent_mask(N, dtype=F64)
    expected, _ = ref(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)
    torch.testing.assert_close(_out(mha(x, is_causal=True)), expected, **CLOSE64)


# --------------------------------------------------------------------------------------- causality


@pytest.mark.parametrize("t", [1, 7, 8, 17, 33, 48, 49])
def test_multihead_causal_ignores_future(t: int) -> None:
    """With is_causal, tokens at positions >= t never change outputs at positions < t."""
    mha = _mha()
    x = _x()
    x2 = x.clone()
    x2[:, t:] = torch.randn_like(x2[:, t:]) * 3
    out, out2 = _out(mha(x, is_causal=True)), _out(mha(x2, is_causal=True))
    torch.testing.assert_close(out2[:, :t], out[:, :t], **EXACT)
    assert not torch.allclose(out2[:, t:], out[:, t:])


@pytest.mark.parametrize("num_kv_heads", [2, 1])
def test_multihead_causal_ignores_future_gqa(num_kv_heads: int) -> None:
    """Causality holds with grouped kv heads too."""
    mha = _mha(num_kv_heads=num_kv_heads)
    x = _x()
    x2 = x.clone()
    x2[:, 20:] = torch.randn_like(x2[:, 20:])
    torch.testing.assert_close(
        _out(mha(x2, is_causal=True))[:, :20], _out(mha(x, is_causal=True))[:, :20], **EXACT
    )


def test_multihead_non_causal_sees_future() -> None:
    """Control: without is_causal the same change does reach earlier positions."""
    mha = _mha()
    x = _x()
    x2 = x.clone()
    x2[:, 20:] = torch.randn_like(x2[:, 20:]) * 3
    assert not torch.allclose(_out(mha(x2))[:, :20], _out(mha(x))[:, :20])


# -------------------------------------------------------------------------------- key padding mask


def _padding_mask() -> torch.Tensor:
    """Padding at the end of one sequence, scattered inside the other."""
    mask = torch.zeros(B, N, dtype=torch.bool)
    mask[0, -9:] = True
    mask[1, [2, 5, 11, 12, 30, 31, 44]] = True
    return mask


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_multihead_padding_cross_attention(is_causal: bool) -> None:
    """Changing padded key/value tokens changes no output row."""
    mha = _mha()
    x, y = _x(), _x()
    mask = _padding_mask()
    y2 = torch.where(mask[..., None], torch.randn_like(y) * 5, y)
    out = _out(mha(x, y, y, is_causal=is_causal, key_padding_mask=mask))
    out2 = _out(mha(x, y2, y2, is_causal=is_causal, key_padding_mask=mask))
    torch.testing.assert_close(out2, out, **EXACT)
    # Control: without the mask the same change does matter.
    assert not torch.allclose(
        _out(mha(x, y2, y2, is_causal=is_causal)), _out(mha(x, y, y, is_causal=is_causal))
    )


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_multihead_padding_self_attention(is_causal: bool) -> None:
    """Self-attention: changing padded tokens changes no non-padded row (padded rows may change)."""
    mha = _mha()
    x = _x()
    mask = _padding_mask()
    x2 = torch.where(mask[..., None], torch.randn_like(x) * 5, x)
    out = _out(mha(x, is_causal=is_causal, key_padding_mask=mask))
    out2 = _out(mha(x2, is_causal=is_causal, key_padding_mask=mask))
    keep = ~mask
    torch.testing.assert_close(out2[keep], out[keep], **EXACT)
    assert torch.isfinite(out).all()


# ------------------------------------------------------------------------- state, compile, dropout


def test_multihead_state_dict_round_trip() -> None:
    """A fresh module loaded with another's state_dict gives identical outputs."""
    torch.manual_seed(1)
    a = _mha(num_kv_heads=2)
    torch.manual_seed(2)
    b = _mha(num_kv_heads=2)
    x = _x()
    assert not torch.allclose(_out(a(x)), _out(b(x)))
    b.load_state_dict(a.state_dict())
    assert set(a.state_dict()) == set(b.state_dict())
    torch.testing.assert_close(_out(b(x)), _out(a(x)), atol=0.0, rtol=0.0)


def test_multihead_torch_compile() -> None:
    """``torch.compile`` (dynamo + AOT autograd, no codegen) runs fwd and bwd like eager."""
    torch._dynamo.reset()
    mha = _mha(dtype=torch.float32)
    x = _x(dtype=torch.float32).requires_grad_(True)
    expected = _out(mha(x, is_causal=True))
    compiled = torch.compile(mha, backend="aot_eager")
    out = _out(compiled(x, is_causal=True))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_multihead_dropout_eval_deterministic() -> None:
    """In eval mode dropout is off: two calls agree, and equal a dropout-free module."""
    torch.manual_seed(3)
    mha = _mha(dropout=0.5).eval()
    torch.manual_seed(3)
    plain = _mha(dropout=0.0)
    x = _x()
    out = _out(mha(x))
    torch.testing.assert_close(_out(mha(x)), out, atol=0.0, rtol=0.0)
    torch.testing.assert_close(_out(plain(x)), out, **EXACT)


def test_multihead_dropout_train() -> None:
    """In train mode with dropout=0.5, two calls differ, and backward runs."""
    mha = _mha(dropout=0.5).train()
    x = _x().requires_grad_(True)
    a, b = _out(mha(x)), _out(mha(x))
    assert not torch.allclose(a, b)
    (a.sum() + b.sum()).backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_multihead_no_dropout_train_deterministic() -> None:
    """Training mode alone (dropout=0) changes nothing."""
    mha = _mha().train()
    x = _x()
    torch.testing.assert_close(_out(mha(x)), _out(mha.eval()(x)), atol=0.0, rtol=0.0)


# --------------------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("layer_norm", [True, False], ids=["subln", "noln"])
@pytest.mark.parametrize("num_kv_heads", [H, 2], ids=lambda h: f"kv{h}")
def test_multihead_gradients_reach_every_parameter(layer_norm: bool, num_kv_heads: int) -> None:
    """Every parameter gets a finite gradient; the input too."""
    mha = _mha(layer_norm=layer_norm, num_kv_heads=num_kv_heads)
    x = _x().requires_grad_(True)
    mask = _padding_mask()
    _out(mha(x, is_causal=True, key_padding_mask=mask)).square().sum().backward()
    for name, p in mha.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert mha.get_parameter(_param_name(mha, "q_proj.weight")).grad.abs().sum() > 0


def _param_name(mha: nn.Module, suffix: str) -> str:
    """The full name of the parameter ending with ``suffix``."""
    names = [n for n, _ in mha.named_parameters() if n.endswith(suffix)]
    assert len(names) == 1, (suffix, names)
    return names[0]


def test_multihead_input_gradcheck() -> None:
    """Module gradients are exact: gradcheck on a tiny float64 module, causal, partial segments."""
    mha = MultiheadDilatedAttention(8, 2, [4, 8], [1, 2], dtype=F64)
    x = torch.randn(1, 11, 8, dtype=F64, requires_grad=True)
    mask = torch.zeros(1, 11, dtype=torch.bool)
    mask[0, 5] = True
    assert torch.autograd.gradcheck(lambda t: mha(t, is_causal=True)[0], (x,), fast_mode=True)
    assert torch.autograd.gradcheck(
        lambda t: mha(t, key_padding_mask=mask)[0], (x,), fast_mode=True
    )


# ---------------------------------------------------------------------------- construction options


def test_layer_norm_option() -> None:
    """layer_norm=True adds one LayerNorm(E, eps); layer_norm=False adds none and still works."""
    with_ln = _mha(layer_norm=True, layer_norm_eps=1e-3)
    lns = _layer_norms(with_ln)
    assert len(lns) == 1
    assert tuple(lns[0].normalized_shape) == (E,)
    assert lns[0].eps == 1e-3
    without = _mha(layer_norm=False)
    assert _layer_norms(without) == []
    out = _out(without(_x()))
    assert out.shape == (B, N, E) and torch.isfinite(out).all()


def test_gamma_init_scales_value_and_out_projections() -> None:
    """gamma_init=2 doubles the init scale of v/out projection weights and leaves q/k alone."""
    big_e = 64
    norms: dict[float, dict[str, float]] = {}
    for gamma in (1.0, 2.0):
        torch.manual_seed(0)
        lin = _linears(_mha(embed_dim=big_e, gamma_init=gamma))
        norms[gamma] = {n: m.weight.norm().item() for n, m in lin.items()}
    for name in ("v_proj", "out_proj"):
        ratio = norms[2.0][name] / norms[1.0][name]
        assert 1.8 < ratio < 2.2, (name, ratio)
    for name in ("q_proj", "k_proj"):
        ratio = norms[2.0][name] / norms[1.0][name]
        assert 0.9 < ratio < 1.1, (name, ratio)


@pytest.mark.parametrize("layer_norm", [True, False], ids=["subln", "noln"])
def test_bias_false(layer_norm: bool) -> None:
    """bias=False: no projection has a bias (without sub-LN, no parameter is a bias at all)."""
    mha = _mha(bias=False, layer_norm=layer_norm)
    for name, m in _linears(mha).items():
        assert m.bias is None, name
    if not layer_norm:
        assert [n for n, _ in mha.named_parameters() if "bias" in n] == []
    assert _out(mha(_x())).shape == (B, N, E)


def test_bias_true_projections_have_bias() -> None:
    """bias=True (default) gives every projection a bias."""
    for name, m in _linears(_mha()).items():
        assert m.bias is not None, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_factory_kwargs(dtype: torch.dtype) -> None:
    """dtype= and device= reach every parameter."""
    mha = _mha(dtype=dtype, device=torch.device("cpu"), num_kv_heads=2)
    for name, p in mha.named_parameters():
        assert p.dtype == dtype, name
        assert p.device.type == "cpu", name
    out = _out(mha(_x(dtype=dtype)))
    assert out.dtype == dtype


def test_factory_meta_device() -> None:
    """device='meta' builds without allocating (large models are built this way)."""
    mha = MultiheadDilatedAttention(E, H, SEGMENTS, RATES, device="meta")
    assert all(p.device.type == "meta" for p in mha.parameters())


def test_multihead_param_count() -> None:
    """Parameter count matches q/k/v/out projections with biases plus one LayerNorm."""
    kv = 2
    mha = _mha(num_kv_heads=kv)
    kv_dim = kv * HEAD_DIM
    expected = (E * E + E) * 2 + (kv_dim * E + kv_dim) * 2 + 2 * E
    assert sum(p.numel() for p in mha.parameters()) == expected


# -- rotary positions inside the layer ------------------------------------------------------------
def _rotate_complex(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """RoPE by its definition: channels (j, j + D/2) as one complex number, times
    exp(i * position * base ** (-2j / D)). x (B, N, H, D) float64."""
    half = x.shape[-1] // 2
    freq = base ** (-torch.arange(half, dtype=F64) / half)
    turn = torch.polar(torch.ones(len(positions), half, dtype=F64), positions[:, None] * freq)
    z = torch.complex(x[..., :half], x[..., half:]) * turn[:, None, :]
    return torch.cat([z.real, z.imag], dim=-1)


@pytest.mark.parametrize("shift", [0, 1000])
def test_rotary_layer_is_projections_rotation_attention(shift: int) -> None:
    """``use_rotary()``: q and k rotated at ``positions`` between the projections and attention;
    a one-branch schedule against projections, RoPE by definition and SDPA in float64."""
    layer = _mha(segment_lengths=[N], dilation_rates=[1], num_kv_heads=2).use_rotary(500.0)
    x = torch.randn(B, N, E, dtype=F64)
    positions = torch.arange(N) + shift
    got, _ = layer(x, is_causal=True, positions=positions)
    q = layer.q_proj(x).view(B, N, H, HEAD_DIM)
    k, v = (proj(x).view(B, N, 2, HEAD_DIM) for proj in (layer.k_proj, layer.v_proj))
    q, k = (_rotate_complex(t, positions.double(), 500.0) for t in (q, k))
    k, v = (t.repeat_interleave(H // 2, dim=2) for t in (k, v))
    att = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
    want = layer.out_proj(layer.norm(att.transpose(1, 2).reshape(B, N, E)))
    torch.testing.assert_close(got, want, **CLOSE64)
    if shift == 0:  # the default positions are 0..N-1
        torch.testing.assert_close(layer(x, is_causal=True)[0], got, **EXACT)
    plain = _mha(segment_lengths=[N], dilation_rates=[1], num_kv_heads=2)
    plain.load_state_dict(layer.state_dict())  # rotary adds no parameters or buffers
    assert not torch.allclose(plain(x, is_causal=True)[0], got)


def test_rotary_positions_are_checked() -> None:
    layer = _mha()
    x = torch.randn(B, N, E, dtype=F64)
    with pytest.raises(ValueError, match=r"positions are only used with rotary.*use_rotary"):
        layer(x, positions=torch.arange(N))
    layer.use_rotary()
    with pytest.raises(ValueError, match=r"positions must be a \(seq_len=50,\) integer tensor"):
        layer(x, positions=torch.arange(N - 1))
    with pytest.raises(ValueError, match=r"dtype torch.float64"):
        layer(x, positions=torch.arange(N, dtype=F64))
    with pytest.raises(TypeError, match=r"positions must be a \(seq_len,\) int tensor"):
        layer(x, positions=list(range(N)))


def test_cache_needs_a_dilated_inner_module() -> None:
    """A multihead layer decodes with a cache only around ``DilatedAttention``; a decode through
    ``MultiheadDilatedAttention`` equals the full layer's last rows."""
    from dilated_attention import BlockSparseMultiheadAttention, DilatedKVCache
    from dilated_attention import patterns as P

    layer = _mha(num_kv_heads=2)
    x = torch.randn(B, N, E, dtype=F64)
    full, _ = layer(x, is_causal=True)
    cache = DilatedKVCache(SEGMENTS, RATES)
    head, _ = layer(x[:, :40], is_causal=True, cache=cache)
    tail, _ = layer(x[:, 40:], is_causal=True, cache=cache)
    torch.testing.assert_close(torch.cat([head, tail], dim=1), full, **CLOSE64)
    # With rotary, the new tokens' positions continue from the cache by default.
    layer.use_rotary(100.0)
    full, _ = layer(x, is_causal=True)
    cache = DilatedKVCache(SEGMENTS, RATES)
    spans = ((0, 31), (31, 32), (32, N))
    pieces = [layer(x[:, a:b], is_causal=True, cache=cache)[0] for a, b in spans]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, **CLOSE64)
    backwards = torch.arange(N - 32, 0, -1) + 32
    with pytest.raises(ValueError, match=r"positions must increase"):
        layer(x[:, 32:], is_causal=True, cache=DilatedKVCache(SEGMENTS, RATES), positions=backwards)
    sparse = BlockSparseMultiheadAttention(E, H, P.LocalWindow(1), block_size=8, dtype=F64)
    with pytest.raises(ValueError, match=r"cache= needs a layer whose inner module decodes"):
        sparse(x, is_causal=True, cache=DilatedKVCache([8], [1]))
    ring = dilated_attention.RingMultiheadDilatedAttention(E, H, SEGMENTS, RATES, dtype=F64)
    with pytest.raises(ValueError, match=r"got RingDilatedAttention"):  # one process: no agreement
        ring(x, is_causal=True, cache=DilatedKVCache(SEGMENTS, RATES))
