"""The layers of blocks selected from the content: :class:`BlockSelectedAttention` (MoBA-style,
kind ``"moba"``) and :class:`CompressedSelectedWindowAttention` (NSA-style, kind ``"nsa"``),
in the library's :class:`MultiheadAttention` (with NSA's gate projection), against the float64
re-implementation of ``support/sparse_oracle.py``, parameters' gradients included; the factory
kinds, their configs and ``explain(kind=)``; ``LongNetLM`` with them on every layer or as the
global layers between windowed ones (training, checkpoints, generation); bad arguments; on
CUDA, bf16 forward and backward against the oracle and a training step without host
synchronisation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from support.sparse_oracle import moba_reference, nsa_reference
from support.tolerances import assert_close_to_oracle
from torch import Tensor, nn

from dilated_attention import (
    BlockSelectedAttention,
    CompressedSelectedWindowAttention,
    LongNetConfig,
    LongNetLM,
    MultiheadAttention,
    create_dilated_attention,
    create_multihead_dilated_attention,
    explain,
)
from dilated_attention.config import BlockSelectedConfig, CompressedSelectedWindowConfig
from dilated_attention.models.checkpoint import load_checkpoint, save_checkpoint

F64 = torch.float64
TIGHT = {"atol": 1e-10, "rtol": 1e-9}
NSA = dict(compress_block=4, compress_stride=2, select_block=8, topk=2, window=5)
MOBA = dict(block_size=8, topk=2)


def _project(layer: MultiheadAttention, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The layer's q, k, v (B, N, H or Hkv, D), computed here from its weights."""
    b, n, _ = x.shape
    d = layer.head_dim
    return (layer.q_proj(x).view(b, n, -1, d), layer.k_proj(x).view(b, n, -1, d),
            layer.v_proj(x).view(b, n, -1, d))  # fmt: skip


def _output(layer: MultiheadAttention, o: Tensor) -> Tensor:
    """(B, N, H, D) -> the layer's sub-LayerNorm and output projection."""
    assert layer.norm is not None
    return layer.out_proj(layer.norm(o.flatten(2)))


def _assert_layer_is_reference(layer: nn.Module, out: Tensor, ref: Tensor, x: Tensor) -> None:
    """Outputs, and the gradients of the input and every parameter, equal."""
    torch.testing.assert_close(out, ref, **TIGHT)
    leaves = [x, *layer.parameters()]
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    got = torch.autograd.grad(out, leaves, dout)
    want = torch.autograd.grad(ref, leaves, dout)
    names = ["x", *(name for name, _ in layer.named_parameters())]
    for name, a, b in zip(names, got, want, strict=True):
        torch.testing.assert_close(a, b, **TIGHT, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("combine", ["gates", "lse"])
def test_the_nsa_layer_is_the_reference_with_its_gate_projection(
    combine: str, recompute: bool
) -> None:
    """Gates: ``sigmoid(gate_proj(x))`` per head and branch, zero-initialised (every gate 1/2
    at first), here set at random; the gate projection's gradients are exact. ``lse``: no gate
    projection. ``recompute``: the branches run again in the backward, the same gradients."""
    torch.manual_seed(0)
    inner = CompressedSelectedWindowAttention(**NSA, combine=combine, recompute=recompute)
    assert ("recompute=True" in repr(inner)) == recompute
    layer = MultiheadAttention(32, 4, inner, num_kv_heads=2, dtype=F64)
    if combine == "lse":
        assert layer.gate_proj is None
    else:
        assert layer.gate_proj is not None and layer.gate_proj.out_features == 12
        assert not layer.gate_proj.weight.any() and not layer.gate_proj.bias.any()
        nn.init.normal_(layer.gate_proj.weight, std=0.3)
        nn.init.normal_(layer.gate_proj.bias)
    x = torch.randn(2, 29, 32, dtype=F64, requires_grad=True)
    out = layer(x, is_causal=True)[0]
    q, k, v = _project(layer, x)
    gates = None
    if layer.gate_proj is not None:
        gates = torch.sigmoid(layer.gate_proj(x)).view(2, 29, 4, 3)
    ref = _output(layer, nsa_reference(q, k, v, gates, is_causal=True, **NSA))
    _assert_layer_is_reference(layer, out, ref, x)


def test_the_moba_layer_is_the_reference() -> None:
    torch.manual_seed(1)
    layer = create_multihead_dilated_attention(
        "moba", embed_dim=32, num_heads=4, num_kv_heads=2, dtype=F64, **MOBA
    )
    assert isinstance(layer.attention, BlockSelectedAttention) and layer.gate_proj is None
    x = torch.randn(2, 29, 32, dtype=F64, requires_grad=True)
    out = layer(x, is_causal=True)[0]
    q, k, v = _project(layer, x)
    ref = _output(layer, moba_reference(q, k, v, block=8, topk=2, is_causal=True))
    _assert_layer_is_reference(layer, out, ref, x)


# -- the factory --------------------------------------------------------------------------------
def test_factory_kinds_take_keywords_or_their_configs() -> None:
    inner = create_dilated_attention("moba", block_size=16, topk=3)
    assert isinstance(inner, BlockSelectedAttention) and (inner.block_size, inner.topk) == (16, 3)
    config = CompressedSelectedWindowConfig(window=64, topk=4)
    nsa = create_multihead_dilated_attention("nsa", embed_dim=32, num_heads=4, config=config)
    assert isinstance(nsa.attention, CompressedSelectedWindowAttention)
    assert nsa.attention.config == config and nsa.gate_proj.out_features == 12
    lse = create_dilated_attention("nsa", config=CompressedSelectedWindowConfig(combine="lse"))
    assert lse.gates_per_head == 0
    assert BlockSelectedAttention.from_config(BlockSelectedConfig()).block_size == 512
    with pytest.raises(ValueError, match="takes no segment_lengths"):
        create_dilated_attention("moba", config=BlockSelectedConfig(), segment_lengths=[8])


@pytest.mark.parametrize(
    ("kind", "kwargs", "match"),
    [
        ("moba", dict(segment_lengths=[8], dilation_rates=[1], **MOBA), "takes no segment_lengths"),
        ("moba", dict(softcap=5.0, **MOBA), "takes no softcap"),
        ("nsa", dict(sinks=True, **NSA), "takes no sinks"),
        ("moba", dict(block_size=0, topk=1), "block_size"),
        ("moba", dict(block_size=8, topk=-1), "topk"),
        ("moba", dict(dropout=0.1, **MOBA), "dropout"),
        ("moba", dict(backend="nope", **MOBA), "backend"),
        ("nsa", dict(NSA, compress_stride=8), "compress_stride"),
        ("nsa", dict(NSA, window=0), "window"),
        ("nsa", dict(NSA, combine="mean"), "combine"),
    ],
)
def test_factory_kinds_refuse_bad_arguments(kind: str, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        create_multihead_dilated_attention(kind, embed_dim=32, num_heads=4, **kwargs)


@pytest.mark.parametrize("kind", ["moba", "nsa"])
def test_factory_layers_train(kind: str) -> None:
    """A few steps of Adam on a regression through the layer: the loss falls."""
    torch.manual_seed(2)
    sizes = MOBA if kind == "moba" else NSA
    layer = create_multihead_dilated_attention(kind, embed_dim=16, num_heads=2, **sizes)
    x, target = torch.randn(2, 24, 16), torch.randn(2, 24, 16)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    losses = []
    for _ in range(6):
        loss = F.mse_loss(layer(x, is_causal=True)[0], target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses


def test_explain_describes_the_layers() -> None:
    moba = explain(kind="moba", device="cpu", is_causal=True, seq_len=512, block_size=64)
    assert moba.operation == "block_sparse" and "MoBA-style" in str(moba)
    assert "run-time block mask" in str(moba)
    nsa = explain(kind="nsa", device="cpu", is_causal=True, seq_len=512, block_size=64,
                  num_heads=4, num_kv_heads=2, window_size=(63, 0))  # fmt: skip
    assert [line.split(":")[0] for line in nsa.branches] == [
        "compressed keys", "selected blocks", "window (63, 0)",
    ]  # fmt: skip
    text = str(nsa)
    assert "Nq=32 Nk=32" in text and "(1, 2, Mq, Mk=8)" in text and "window (63, 0)" in text
    with pytest.raises(ValueError, match="kind must be one of"):
        explain(kind="dilated", device="cpu")
    with pytest.raises(ValueError, match="leave them out"):
        explain(kind="moba", device="cpu", block_mask=True)


@pytest.mark.parametrize("kind", ["moba", "nsa"])
def test_context_parallel_makes_selected_layers_ring_layers(kind: str) -> None:
    """context_parallel turns the layer into the library's ring multihead layer around the
    kind's ring module, with its parameters; in one process (a world of one) it computes what
    the local layer does. Contiguous shards only: layout='zigzag' changes nothing."""
    from dilated_attention.distributed import RingMultiheadAttention, context_parallel
    from dilated_attention.distributed.rings.moba_ring import BlockSelectedRingAttention
    from dilated_attention.distributed.rings.nsa_ring import CompressedSelectedWindowRingAttention

    sizes = MOBA if kind == "moba" else NSA
    torch.manual_seed(0)
    layer = create_multihead_dilated_attention(kind, embed_dim=32, num_heads=4, num_kv_heads=2,
                                               **sizes).double().use_rotary()  # fmt: skip
    x = torch.randn(2, 16, 32, dtype=F64)
    want = layer(x, is_causal=True)[0]
    model = nn.Sequential(layer)
    with pytest.raises(ValueError, match="contiguous shards only"):
        context_parallel(model, None, layout="zigzag")
    assert type(layer) is MultiheadAttention
    assert context_parallel(model, None) is model
    ring = (BlockSelectedRingAttention if kind == "moba" else
            CompressedSelectedWindowRingAttention)  # fmt: skip
    assert type(layer) is RingMultiheadAttention and type(layer.attention) is ring
    torch.testing.assert_close(layer(x, is_causal=True)[0], want, **TIGHT)


# -- LongNetLM ----------------------------------------------------------------------------------
def _config(**fields: Any) -> LongNetConfig:
    base = dict(vocab_size=32, embed_dim=32, num_heads=4, num_kv_heads=2, num_layers=2,
                segment_lengths=(16,), dilation_rates=(1,), ffn_dim=64)  # fmt: skip
    return LongNetConfig(**{**base, **fields})


SPARSE_MODELS = {
    "moba-every-layer": dict(kind="moba", sparse=BlockSelectedConfig(**MOBA)),
    "nsa-between-windows": dict(
        kind="nsa", sparse=CompressedSelectedWindowConfig(**NSA), local_window=6, global_every=2
    ),
}


@pytest.mark.parametrize("fields", SPARSE_MODELS.values(), ids=SPARSE_MODELS.keys())
def test_longnet_with_selected_layers_trains_and_round_trips(
    fields: dict[str, Any], tmp_path: Path
) -> None:
    torch.manual_seed(4)
    model = LongNetLM(_config(**fields))
    kinds = [type(block.attn.mha.attention).__name__ for block in model.blocks]
    expected = {"moba": ["BlockSelectedAttention"] * 2,
                "nsa": ["LocalAttention", "CompressedSelectedWindowAttention"]}  # fmt: skip
    assert kinds == expected[fields["kind"]]
    tokens = torch.randint(0, 32, (2, 25), generator=torch.Generator().manual_seed(5))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(5):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses
    ckpt = load_checkpoint(save_checkpoint(tmp_path / "sparse.pt", model))
    assert ckpt.config == model.config and ckpt.config.sparse == fields["sparse"]
    with torch.no_grad():
        assert torch.equal(ckpt.model.eval()(tokens), model.eval()(tokens))
    assert model.generate(tokens[:, :5], 3, temperature=0).shape == (2, 8)  # whole prefix a step
    changed = BlockSelectedConfig(block_size=4) if fields["kind"] == "moba" else None
    with pytest.raises(ValueError, match=r"change the attention of .* sparse="):
        load_checkpoint(tmp_path / "sparse.pt", overrides={"sparse": changed})


def test_longnet_config_fills_and_checks_sparse() -> None:
    assert _config(kind="nsa").sparse == CompressedSelectedWindowConfig()
    assert _config(kind="moba", sparse={"block_size": 8, "topk": 1}).sparse == BlockSelectedConfig(
        block_size=8, topk=1
    )
    cases = [
        (dict(kind="dilated", sparse=BlockSelectedConfig()), "sparse="),
        (dict(kind="nsa", sparse=BlockSelectedConfig()), "CompressedSelectedWindowConfig"),
        (dict(kind="moba", sinks=True), "sinks=True"),
        (dict(kind="moba", dropout=0.1), "dropout=0.1"),
        (dict(kind="nsa", softcap=30.0), "softcap=30.0"),
    ]
    for fields, match in cases:
        with pytest.raises(ValueError, match=match):
            _config(**fields)


# -- CUDA ---------------------------------------------------------------------------------------
def _planted(batch: int, n: int, heads: int, kv_heads: int, dim: int, block: int) -> list[Tensor]:
    """q, k, v (bf16 values) whose blocks have distinct means, so that the choice does not
    hang on rounding: each block's rows share a random direction, plus noise."""
    g = torch.Generator().manual_seed(11)
    blocks = -(-n // block)

    def planted(h: int) -> Tensor:
        shared = torch.randn(batch, blocks, h, dim, generator=g).repeat_interleave(block, 1)
        return (shared[:, :n] * 0.6 + 0.5 * torch.randn(batch, n, h, dim, generator=g))

    q, k, v = planted(heads), planted(kv_heads), torch.randn(batch, n, kv_heads, dim, generator=g)
    return [x.to(torch.bfloat16) for x in (q, k, v)]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["moba", "nsa-gates", "nsa-lse"])
def test_gpu_layers_bf16_against_the_reference(kind: str) -> None:
    """The inner modules on CUDA in bf16, forward and backward (q, k, v and the gates),
    within the bf16 tolerance of the float64 reference and 2x a naive bf16 one."""
    q, k, v = _planted(2, 1000, 4, 2, 64, 128)
    gates = torch.sigmoid(torch.randn(2, 1000, 4, 3)).to(torch.bfloat16)
    sizes = dict(compress_block=32, compress_stride=16, select_block=128, topk=2, window=128)
    if kind == "moba":
        layer: nn.Module = BlockSelectedAttention(128, 2)
        inputs = [q, k, v]

        def reference(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return moba_reference(q, k, v, block=128, topk=2, is_causal=True)
    else:
        combine = kind.removeprefix("nsa-")
        layer = CompressedSelectedWindowAttention(**sizes, combine=combine)
        inputs = [q, k, v, gates] if combine == "gates" else [q, k, v]

        def reference(q: Tensor, k: Tensor, v: Tensor, g: Tensor | None = None) -> Tensor:
            return nsa_reference(q, k, v, g, is_causal=True, **sizes)

    dout = torch.randn(2, 1000, 4, 64).to(torch.bfloat16)
    dev = [x.cuda().requires_grad_() for x in inputs]
    extra = {"gates": dev[3]} if len(dev) == 4 else {}
    out = layer(*dev[:3], is_causal=True, **extra)
    grads = torch.autograd.grad(out, dev, dout.cuda())
    results = {}
    for dtype in (F64, torch.bfloat16):
        leaves = [x.cuda().to(dtype).requires_grad_() for x in inputs]
        ref = reference(*leaves)
        results[dtype] = (ref, torch.autograd.grad(ref, leaves, dout.cuda().to(dtype)))
    (want, want_grads), (naive, naive_grads) = results[F64], results[torch.bfloat16]
    assert_close_to_oracle(out, want, naive, name=f"{kind} out")
    for name, got, exact, same in zip("qkvg", grads, want_grads, naive_grads, strict=False):
        assert_close_to_oracle(got, exact, same, name=f"{kind} d{name}", grad=True)


@pytest.mark.gpu
def test_gpu_training_steps_without_host_synchronisation() -> None:
    """A MoBA and an NSA layer's training step (selection, forward, backward, an SGD step) on
    CUDA under ``torch.cuda.set_sync_debug_mode("error")``, after a first step outside it
    (which compiles the kernels)."""
    torch.manual_seed(6)
    layers = [
        create_multihead_dilated_attention(
            "moba", embed_dim=256, num_heads=4, num_kv_heads=2, block_size=128, topk=2,
            device="cuda", dtype=torch.bfloat16,
        ),
        create_multihead_dilated_attention(
            "nsa", embed_dim=256, num_heads=4, num_kv_heads=2, compress_block=32,
            compress_stride=16, select_block=128, topk=2, window=128, device="cuda",
            dtype=torch.bfloat16,
        ),
    ]  # fmt: skip
    x = torch.randn(2, 2048, 256, device="cuda", dtype=torch.bfloat16)
    for layer in layers:
        opt = torch.optim.SGD(layer.parameters(), lr=1e-3)

        def step(layer: nn.Module = layer, opt: torch.optim.Optimizer = opt) -> None:
            loss = layer(x, is_causal=True)[0].float().square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

        step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert all(bool(torch.isfinite(p).all()) for p in layer.parameters())
