"""The layers with local windows, soft-capping and learnable sinks: they compute what the
functions compute with those options (checked against the float64 oracle through the
functional tests), their sinks are parameters with gradients, the factory builds them, bad
values fail at construction, and context parallelism keeps them."""

from __future__ import annotations

import copy

import pytest
import torch
from support.oracle import masked_attention

from dilated_attention import (
    BlockSparseMultiheadAttention,
    DilatedAttention,
    MultiheadDilatedAttention,
    RingMultiheadDilatedAttention,
    create_block_sparse_attention,
    create_multihead_dilated_attention,
)
from dilated_attention.distributed import context_parallel
from dilated_attention.patterns import LocalWindow


def test_inner_module_is_the_function() -> None:
    """DilatedAttention with one branch over the sequence, a window, a cap and sinks is the
    oracle's dense attention with the same options (each key in both the branch and the window
    counts twice: the oracle's weights are the branch's plus the window's)."""
    torch.manual_seed(0)
    layer = DilatedAttention([12], [1], window_size=(2, 0), softcap=3.0, sinks=2).double()
    with torch.no_grad():
        layer.sinks.copy_(torch.tensor([0.5, -1.0]))
    q, k, v = (torch.randn(1, 12, 2, 8, dtype=torch.float64) for _ in range(3))
    out = layer(q, k, v, is_causal=True)
    p, t = torch.arange(12)[:, None], torch.arange(12)[None, :]
    weight = (t <= p).long() + ((t <= p) & (t >= p - 2)).long()
    want, _ = masked_attention(q, k, v, weight.expand(2, 12, 12), softcap=3.0, sinks=layer.sinks)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)


def test_multihead_sinks_are_parameters_with_gradients() -> None:
    torch.manual_seed(0)
    layer = MultiheadDilatedAttention(32, 4, [8, 16], [1, 2], softcap=10.0, sinks=True)
    assert isinstance(layer.attention.sinks, torch.nn.Parameter)
    assert "attention.sinks" in layer.state_dict()
    assert layer.attention.sinks.shape == (4,)
    y, _ = layer(torch.randn(2, 20, 32), is_causal=True)
    y.square().sum().backward()
    grad = layer.attention.sinks.grad
    assert grad is not None and bool(grad.abs().gt(0).all())
    assert "softcap=10.0, sinks=4" in repr(layer)


def test_block_sparse_layer_sinks() -> None:
    torch.manual_seed(0)
    layer = BlockSparseMultiheadAttention(32, 4, LocalWindow(1), block_size=8, softcap=4.0,
                                          sinks=True)  # fmt: skip
    y, _ = layer(torch.randn(1, 24, 32), is_causal=True)
    y.sum().backward()
    assert layer.attention.sinks.grad is not None


def test_factory_builds_them() -> None:
    layer = create_multihead_dilated_attention(
        "dilated", embed_dim=32, num_heads=4, segment_lengths=[8], dilation_rates=[1],
        window_size=(3, 0), sinks=True,
    )  # fmt: skip
    assert layer.attention.window_size == (3, 0) and layer.attention.sinks.shape == (4,)
    sparse = create_block_sparse_attention(
        embed_dim=32, num_heads=4, pattern=LocalWindow(1), softcap=2.0
    )
    assert sparse.attention.softcap == 2.0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(window_size=(1, 2, 3)), TypeError, "window_size"),
        (dict(softcap=0.0 - 1), ValueError, "softcap"),
        (dict(sinks=2), TypeError, "sinks must be True or False"),
    ],
)
def test_bad_values_at_construction(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        MultiheadDilatedAttention(32, 4, [8], [1], **kwargs)


def test_inner_sinks_count_checked() -> None:
    with pytest.raises(ValueError, match="sinks must be a positive int"):
        DilatedAttention([8], [1], sinks=0)


def test_context_parallel_keeps_them() -> None:
    """Turned into a ring layer, a layer keeps its window, cap and sinks parameter and applies
    them (one process: the ring of one rank gives the local layer's output and gradients; over
    ranks: tests/distributed/test_ring_windows.py)."""
    torch.manual_seed(0)
    local = MultiheadDilatedAttention(32, 4, [8], [1], window_size=(3, 0), softcap=5.0,
                                      sinks=True).double()  # fmt: skip
    with torch.no_grad():
        local.attention.sinks.copy_(torch.tensor([0.5, -1.0, 0.0, 2.0]))
    model = context_parallel(torch.nn.Sequential(copy.deepcopy(local)), None)
    assert type(model[0]) is RingMultiheadDilatedAttention
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    want, got = local(x, is_causal=True)[0], model[0](x, is_causal=True)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    (want_grad,) = torch.autograd.grad(want.square().sum(), local.attention.sinks)
    (grad,) = torch.autograd.grad(got.square().sum(), model[0].attention.sinks)
    torch.testing.assert_close(grad, want_grad, rtol=0, atol=1e-12)


def test_context_parallel_refuses_local_layers() -> None:
    """A local (sliding-window) layer has no ring layer yet: context_parallel raises rather
    than leave it attending within each rank's shard alone."""
    from dilated_attention import create_multihead_dilated_attention

    layer = create_multihead_dilated_attention("local", embed_dim=32, num_heads=4, window=8)
    model = torch.nn.Sequential(layer)
    with pytest.raises(ValueError, match="local \\(sliding-window\\) layer, which has no ring"):
        context_parallel(model, None)
