"""The local (sliding-window) layer: :class:`LocalAttention` and the factory's kind ``"local"``
(the library's :class:`MultiheadAttention` around it) compute the float64 oracle's windowed
attention with soft-capping and learnable sinks, causal or not, with GQA, key padding, packed
documents and rotary positions; they decode through their window caches exactly; explain()
names the kernel their calls run on; bad arguments fail at construction."""

from __future__ import annotations

import itertools

import pytest
import torch
from einops import rearrange
from support.oracle import oracle_attention

from dilated_attention import (
    LocalAttention,
    MultiheadAttention,
    StaticWindowKVCache,
    WindowKVCache,
    create_dilated_attention,
    create_multihead_dilated_attention,
    explain,
    list_kinds,
)

F64 = torch.float64
TIGHT = {"atol": 1e-12, "rtol": 1e-10}


def _qkv(n: int, heads: int = 4, kv_heads: int = 2, batch: int = 2, seed: int = 0) -> list:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, n, heads, 8), (batch, n, kv_heads, 8), (batch, n, kv_heads, 8)]
    return [torch.randn(s, generator=gen, dtype=F64) for s in shapes]


def _layer(**kwargs) -> MultiheadAttention:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    options = dict(embed_dim=32, num_heads=4, num_kv_heads=2, window=5, softcap=3.0, sinks=True)
    layer = create_multihead_dilated_attention("local", **{**options, **kwargs})
    layer = layer.double()
    with torch.no_grad():
        layer.attention.sinks.copy_(torch.tensor([0.5, -1.0, 0.0, 1.5]))
    return layer


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("window", [dict(window=4), dict(window_size=(2, 3))], ids=["W4", "2_3"])
def test_the_inner_module_is_the_oracle(is_causal: bool, window: dict) -> None:
    """Window, soft-cap, sinks (a parameter with its gradient), GQA and key padding."""
    q, k, v = _qkv(19)
    layer = LocalAttention(**window, softcap=2.0, sinks=4).double()
    with torch.no_grad():
        layer.sinks.copy_(torch.tensor([0.3, -0.7, 1.1, 0.0]))
    mask = torch.zeros(2, 19, dtype=torch.bool)
    mask[1, :4] = True
    out = layer(q, k, v, is_causal=is_causal, key_padding_mask=mask)
    sinks = layer.sinks.detach().clone().requires_grad_()
    want, _ = oracle_attention(
        q, k, v, is_causal=is_causal, key_padding_mask=mask, softcap=2.0, sinks=sinks,
        window_size=layer.window_size,
    )  # fmt: skip
    torch.testing.assert_close(out, want, **TIGHT)
    (grad,) = torch.autograd.grad(out.square().sum(), layer.sinks)
    (want_grad,) = torch.autograd.grad(want.square().sum(), sinks)
    torch.testing.assert_close(grad, want_grad, **TIGHT)
    assert layer.window_size == ((3, 0) if "window" in window else (2, 3))


def test_the_multihead_layer_is_projections_around_the_oracle() -> None:
    """The factory's ``"local"`` multihead layer: q/k/v projections, the windowed attention
    with soft-capping and one learnable sink per head, sub-LayerNorm and the output projection,
    every sink getting its gradient."""
    layer = _layer()
    assert type(layer) is MultiheadAttention and isinstance(layer.attention, LocalAttention)
    assert isinstance(layer.attention.sinks, torch.nn.Parameter)
    assert "attention.sinks" in layer.state_dict()
    x = torch.randn(2, 17, 32, dtype=F64, generator=torch.Generator().manual_seed(1))
    y, _ = layer(x, is_causal=True)
    q = rearrange(layer.q_proj(x), "b n (h d) -> b n h d", h=4)
    k, v = (rearrange(p(x), "b n (h d) -> b n h d", h=2) for p in (layer.k_proj, layer.v_proj))
    att, _ = oracle_attention(q, k, v, is_causal=True, window_size=(4, 0), softcap=3.0,
                              sinks=layer.attention.sinks)  # fmt: skip
    want = layer.out_proj(layer.norm(rearrange(att, "b n h d -> b n (h d)")))
    torch.testing.assert_close(y, want, **TIGHT)
    y.square().sum().backward()
    grad = layer.attention.sinks.grad
    assert grad is not None and bool(grad.abs().gt(0).all())
    assert "window_size=(4, 0)" in repr(layer) and "softcap=3.0, sinks=4" in repr(layer)


def test_packed_documents_with_rotary_are_each_alone() -> None:
    """``cu_seqlens``: every document's rows (rotary positions from 0 in each) equal the
    document alone."""
    layer = _layer().use_rotary()
    x = torch.randn(2, 12, 32, dtype=F64, generator=torch.Generator().manual_seed(2))
    cu = [0, 5, 12, 15, 24]
    y, _ = layer(x, is_causal=True, cu_seqlens=cu)
    flat, y_flat = x.reshape(1, 24, 32), y.reshape(1, 24, 32)
    for a, b in itertools.pairwise(cu):
        alone, _ = layer(flat[:, a:b], is_causal=True)
        torch.testing.assert_close(y_flat[:, a:b], alone, **TIGHT)


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
def test_decoding_through_the_layer_equals_its_forward(static: bool) -> None:
    """Rotary positions follow the cache: a prompt, tokens and a chunk through the layer's own
    cache (``new_cache``) give the rows of its full causal forward."""
    layer = _layer().use_rotary().eval()
    x = torch.randn(2, 26, 32, dtype=F64, generator=torch.Generator().manual_seed(3))
    cache = layer.attention.new_cache(static=static)
    assert isinstance(cache, StaticWindowKVCache if static else WindowKVCache)
    with torch.no_grad():
        want, _ = layer(x, is_causal=True)
        parts = [layer(x[:, :3], is_causal=True, cache=cache)[0]]
        parts += [layer(x[:, t : t + 1], is_causal=True, cache=cache)[0] for t in range(3, 12)]
        parts.append(layer(x[:, 12:20], is_causal=True, cache=cache)[0])
        parts += [layer(x[:, t : t + 1], is_causal=True, cache=cache)[0] for t in range(20, 26)]
    torch.testing.assert_close(torch.cat(parts, dim=1), want, **TIGHT)


def test_the_factory_builds_the_kind() -> None:
    assert "local" in list_kinds()
    inner = create_dilated_attention("local", window_size=(7, 0), softcap=5.0, sinks=2)
    assert isinstance(inner, LocalAttention) and inner.window_size == (7, 0)
    assert inner.sinks is not None and inner.sinks.shape == (2,)
    plain = create_multihead_dilated_attention("local", embed_dim=16, num_heads=2, window=3)
    assert plain.attention.sinks is None and plain.attention.softcap is None
    y, _ = plain(torch.randn(1, 9, 16), is_causal=True)
    assert y.shape == (1, 9, 16)


def test_explain_names_the_kernel_of_a_local_layer() -> None:
    """A local layer's call is dense attention in its window: explain() with the layer's
    window, soft-cap and sinks says which kernel runs it and why no other."""
    layer = _layer(window=9)
    choice = explain(
        device="cpu", dtype=torch.float64, head_dim=8, num_heads=4, num_kv_heads=2, seq_len=64,
        is_causal=True, window_size=layer.attention.window_size, softcap=3.0, sinks=True,
    )  # fmt: skip
    assert choice.backend == "math"
    assert "window (8, 0), softcap 3.0, sinks" in str(choice)
    assert "cpu_flash: not used (no soft-capping (softcap); no local window" in str(choice)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(), ValueError, "exactly one of window"),
        (dict(window=4, window_size=(3, 0)), ValueError, "exactly one of window"),
        (dict(window=0), ValueError, "window must be a positive int"),
        (dict(window_size=(-1, 0)), ValueError, "window_size must bound the left side"),
        (dict(window_size=(3,)), TypeError, "window_size must be None or a pair"),
        (dict(window=4, softcap=-1.0), ValueError, "softcap must be a positive finite float"),
        (dict(window=4, sinks=0), ValueError, "sinks must be a positive int"),
        (dict(window=4, dropout=1.5), ValueError, "dropout"),
    ],
)
def test_bad_arguments_of_the_inner_module(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        LocalAttention(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(segment_lengths=[8]), ValueError, "kind 'local' takes a window, not segment_len"),
        (dict(sinks=2), TypeError, "sinks must be True or False"),
        (dict(num_heads=3), ValueError, "embed_dim"),
    ],
)
def test_bad_arguments_of_the_factory_layer(kwargs: dict, error: type, match: str) -> None:
    options = dict(embed_dim=32, num_heads=4, window=4)
    with pytest.raises(error, match=match):
        create_multihead_dilated_attention("local", **{**options, **kwargs})
