"""``MultiheadDilatedAttention`` as a drop-in ``self_attn`` / ``multihead_attn`` of torch's stock
``nn.TransformerEncoderLayer``, ``nn.TransformerEncoder`` and ``nn.TransformerDecoderLayer``.

With one branch covering the sequence (``segment_lengths=[N]``, ``dilation_rates=[1]``),
``layer_norm=False`` and a stock layer's weights, dilated attention is plain attention, so a
swapped model must compute what the stock one does, in training and in every inference mode
(where torch would take its fused fast paths for stock attention). With a real dilated schedule,
the layer must still be what runs: torch's fused kernels, which would compute dense attention
with our weights, are patched to raise.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import pytest
import torch
from torch import nn

from dilated_attention import MultiheadDilatedAttention

B, N, E, H, FF = 3, 12, 16, 2, 32
F64 = torch.float64
CLOSE64 = {"atol": 1e-10, "rtol": 1e-7}
SEGMENTS, RATES = [4, 12], [1, 2]  # a real dilated schedule: differs from dense attention


# ----------------------------------------------------------------------------------------- helpers


def _from_stock(
    stock: nn.MultiheadAttention,
    segments: list[int] | None = None,
    rates: list[int] | None = None,
) -> MultiheadDilatedAttention:
    """A dilated layer with ``stock``'s weights and layout (full branch unless told otherwise)."""
    layer = MultiheadDilatedAttention(
        E, H, segments or [N], rates or [1], layer_norm=False, batch_first=stock.batch_first,
        dtype=stock.out_proj.weight.dtype,
    )  # fmt: skip
    with torch.no_grad():
        for i, proj in enumerate((layer.q_proj, layer.k_proj, layer.v_proj)):
            proj.weight.copy_(stock.in_proj_weight[i * E : (i + 1) * E])
            proj.bias.copy_(stock.in_proj_bias[i * E : (i + 1) * E])
        layer.out_proj.load_state_dict(stock.out_proj.state_dict())
    return layer


def _swap(
    model: nn.Module, segments: list[int] | None = None, rates: list[int] | None = None
) -> int:
    """Replace every stock attention of ``model`` in place; return how many were replaced."""
    stock = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.MultiheadAttention)
    ]
    for parent, name, child in stock:
        setattr(parent, name, _from_stock(child, segments, rates))
    return len(stock)


def _encoder_layer(norm_first: bool, batch_first: bool = True) -> nn.TransformerEncoderLayer:
    return nn.TransformerEncoderLayer(
        E, H, FF, dropout=0.0, batch_first=batch_first, norm_first=norm_first, dtype=F64
    )


def _decoder_layer(norm_first: bool) -> nn.TransformerDecoderLayer:
    return nn.TransformerDecoderLayer(
        E, H, FF, dropout=0.0, batch_first=True, norm_first=norm_first, dtype=F64
    )


def _stock_encoder(norm_first: bool) -> nn.TransformerEncoder:
    """Two stock layers; with post-norm torch enables its nested-tensor inference path."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # norm_first=True: "enable_nested_tensor is True, but..."
        return nn.TransformerEncoder(_encoder_layer(norm_first), 2)


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*(shape or (B, N, E)), dtype=F64)


def _padding() -> torch.Tensor:
    """Right padding (left-aligned, as torch's nested path needs), no fully padded sequence."""
    mask = torch.zeros(B, N, dtype=torch.bool)
    mask[0, -4:] = True
    mask[2, -1:] = True
    return mask


def _causal(form: str, n: int = N) -> torch.Tensor:
    """The causal mask, float (generate_square_subsequent_mask) or bool (True = masked)."""
    if form == "float":
        return nn.Transformer.generate_square_subsequent_mask(n, dtype=F64)
    return torch.ones(n, n, dtype=torch.bool).triu(1)


MODES: dict[str, Callable[[], AbstractContextManager[Any]]] = {
    "train": nullcontext,
    "eval": nullcontext,
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
}


def _run(model: nn.Module, mode: str, *args: Any, **kwargs: Any) -> torch.Tensor:
    model.train(mode == "train")
    with MODES[mode]():
        out = model(*args, **kwargs)
    return out.detach().clone() if mode != "inference_mode" else out.clone()


def _manual_encoder_layer(
    layer: nn.TransformerEncoderLayer, x: torch.Tensor, **attn_kwargs: Any
) -> torch.Tensor:
    """The encoder layer's math written out, calling its ``self_attn`` directly."""

    def sa(h: torch.Tensor) -> torch.Tensor:
        return layer.self_attn(h, h, h, need_weights=False, **attn_kwargs)[0]

    def ff(h: torch.Tensor) -> torch.Tensor:
        return layer.linear2(layer.activation(layer.linear1(h)))

    if layer.norm_first:
        x = x + sa(layer.norm1(x))
        return x + ff(layer.norm2(x))
    x = layer.norm1(x + sa(x))
    return layer.norm2(x + ff(x))


@pytest.fixture
def no_fused_kernels(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """torch's fused encoder-layer kernel and its nested-tensor conversion raise if called."""

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("torch fast path taken")

    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", boom)
    monkeypatch.setattr(torch, "_nested_tensor_from_mask", boom)
    monkeypatch.setattr(torch, "_native_multi_head_attention", boom)
    yield


# ------------------------------------------------------------------------- call and attributes


def test_forward_signature_is_torchs() -> None:
    """Same parameter names, in the same (positional) order, as nn.MultiheadAttention.forward;
    ours adds only keyword-only ``positions`` (rotary), ``cache`` (decoding), ``cu_seqlens``
    (packed documents) and ``block_mask`` (a block-sparse layer's run-time mask) after them."""
    params = inspect.signature(MultiheadDilatedAttention.forward).parameters
    torchs = list(inspect.signature(nn.MultiheadAttention.forward).parameters)
    ours = ["positions", "cache", "cu_seqlens", "block_mask"]
    assert list(params)[: len(torchs)] == torchs
    assert list(params)[len(torchs) :] == ours
    for name in ours:
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
        assert params[name].default is None


def test_positional_call_like_torch() -> None:
    """``layer(q, k, v, key_padding_mask, need_weights, attn_mask)`` means what torch means."""
    layer = MultiheadDilatedAttention(E, H, SEGMENTS, RATES, dtype=F64)
    x, mask = _x(), _padding()
    out, weights = layer(x, x, x, mask, False, _causal("float"))
    assert weights is None
    expected, _ = layer(x, key_padding_mask=mask, is_causal=True)
    torch.testing.assert_close(out, expected, atol=0.0, rtol=0.0)
    assert not torch.allclose(out, layer(x, key_padding_mask=mask)[0])  # the mask was used


def test_attributes_read_by_torch_layers() -> None:
    """The attributes torch's Transformer layers read from ``self_attn`` exist and are right."""
    layer = MultiheadDilatedAttention(E, H, SEGMENTS, RATES, num_kv_heads=1)
    assert layer.batch_first is True
    assert MultiheadDilatedAttention(E, H, SEGMENTS, RATES, batch_first=False).batch_first is False
    assert (layer.embed_dim, layer.num_heads, layer.kdim, layer.vdim) == (E, H, E, E)
    assert layer._qkv_same_embed_dim is False  # q/k/v are not packed
    assert isinstance(layer.out_proj, nn.Linear)
    # The packed-projection placeholders make torch decline its fused paths ...
    assert torch.overrides.has_torch_function((layer.in_proj_weight, layer.in_proj_bias))
    # ... and fail loudly, pointing at the real projections, if anything uses them.
    with pytest.raises(TypeError, match="q_proj"):
        torch.cat([layer.in_proj_weight])
    with pytest.raises(AttributeError, match="q_proj"):
        _ = layer.in_proj_weight.shape
    assert "in_proj" not in "".join(layer.state_dict())


def test_batch_first_must_be_bool() -> None:
    with pytest.raises(TypeError, match="batch_first"):
        MultiheadDilatedAttention(E, H, SEGMENTS, RATES, batch_first="yes")  # type: ignore[arg-type]


def test_need_weights() -> None:
    """need_weights defaults to False here; True is refused, saying what to pass."""
    layer = MultiheadDilatedAttention(E, H, SEGMENTS, RATES, dtype=F64)
    x = _x()
    assert layer(x, x, x)[1] is None
    with pytest.raises(ValueError, match="need_weights=False"):
        layer(x, x, x, need_weights=True)


def test_nested_input_rejected() -> None:
    layer = MultiheadDilatedAttention(E, H, SEGMENTS, RATES, dtype=F64)
    nested = torch.nested.nested_tensor([_x(5, E), _x(7, E)], layout=torch.jagged)
    with pytest.raises(ValueError, match="nested"):
        layer(nested)


# ------------------------------------------------------------------------------------------ masks


@pytest.mark.parametrize("hint", [False, True], ids=["mask_only", "mask_and_is_causal"])
@pytest.mark.parametrize("form", ["float", "bool"])
def test_causal_attn_mask_recognised(form: str, hint: bool) -> None:
    """The causal attn_mask (float or bool, with or without is_causal=True) is is_causal=True."""
    layer = MultiheadDilatedAttention(E, H, SEGMENTS, RATES, dtype=F64)
    x, y = _x(), _x()
    out = layer(x, y, y, attn_mask=_causal(form), is_causal=hint)[0]
    torch.testing.assert_close(out, layer(x, y, y, is_causal=True)[0], atol=0.0, rtol=0.0)
    assert not torch.allclose(out, layer(x, y, y)[0])  # control: causality changes the output


def _not_causal() -> dict[str, torch.Tensor]:
    causal = _causal("float")
    return {
        "float_random": torch.randn(N, N, dtype=F64),
        "float_zeros": torch.zeros(N, N, dtype=F64),
        "float_finite_neg": causal.clamp(min=-1e9),  # not exactly -inf: refused, not guessed
        "float_lower": causal.T.contiguous(),
        "float_nan": causal.masked_fill(torch.eye(N, dtype=torch.bool), float("nan")),
        "bool_diagonal": torch.eye(N, dtype=torch.bool),
        "bool_inverted": torch.ones(N, N, dtype=torch.bool).tril(),  # True = keep, wrong meaning
        "bool_window": torch.ones(N, N, dtype=torch.bool).triu(1)
        | torch.ones(N, N, dtype=torch.bool).tril(-3),
    }


@pytest.mark.parametrize("hint", [False, True], ids=["mask_only", "mask_and_is_causal"])
@pytest.mark.parametrize("name", list(_not_causal()))
def test_non_causal_attn_mask_rejected(name: str, hint: bool) -> None:
    """Any other pattern raises ValueError naming attn_mask and the fix, even with the hint."""
    layer = MultiheadDilatedAttention(E, H, SEGMENTS, RATES, dtype=F64)
    x = _x()
    with pytest.raises(ValueError, match="attn_mask") as excinfo:
        layer(x, x, x, attn_mask=_not_causal()[name], is_causal=hint)
    message = str(excinfo.value)
    for needle in ("causal mask", "is_causal=True", "key_padding_mask", "generate_square"):
        assert needle in message, (needle, message)


@pytest.mark.parametrize(
    "mask",
    [
        _causal("float").expand(B * H, N, N),  # per-head 3-D, even though causal
        _causal("float")[None],
        _causal("float", N - 1),
        torch.ones(N, N, dtype=torch.int64).triu(1),
    ],
    ids=["3d_per_head", "3d_single", "wrong_size", "int"],
)
def test_attn_mask_wrong_form_rejected(mask: torch.Tensor) -> None:
    layer = MultiheadDilatedAttention(E, H, SEGMENTS, RATES, dtype=F64)
    with pytest.raises(ValueError, match="attn_mask") as excinfo:
        layer(_x(), attn_mask=mask)
    assert "is_causal=True" in str(excinfo.value)


def test_attn_mask_not_a_tensor() -> None:
    layer = MultiheadDilatedAttention(E, H, SEGMENTS, RATES, dtype=F64)
    with pytest.raises(TypeError, match="attn_mask"):
        layer(_x(), attn_mask=[[0.0]])  # type: ignore[arg-type]


def test_float_key_padding_mask_as_torch_passes_it() -> None:
    """torch's layers turn a bool key_padding_mask into 0 / -inf floats: same result."""
    layer = MultiheadDilatedAttention(E, H, SEGMENTS, RATES, dtype=F64)
    x, mask = _x(), _padding()
    as_float = torch.zeros(B, N, dtype=F64).masked_fill(mask, float("-inf"))
    expected = layer(x, key_padding_mask=mask)[0]
    torch.testing.assert_close(layer(x, key_padding_mask=as_float)[0], expected, atol=0, rtol=0)
    assert not torch.allclose(layer(x)[0], expected)  # control: the mask matters
    with pytest.raises(ValueError, match="key_padding_mask"):
        layer(x, key_padding_mask=as_float.masked_fill(mask, -5.0))  # an additive bias


# --------------------------------------------------------------------- equality with stock models


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")  # the stock side's
@pytest.mark.parametrize("masks", ["none", "causal", "padding", "causal_padding"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
def test_encoder_equals_stock(norm_first: bool, mode: str, masks: str) -> None:
    """A stock encoder, swapped after construction, computes what it did (torch's fast and
    nested paths included, for the stock side), in training and every inference mode."""
    stock = _stock_encoder(norm_first)
    swapped = copy.deepcopy(stock)
    assert _swap(swapped) == 2
    x, padding = _x(), _padding()
    kwargs: dict[str, Any] = {}
    if "causal" in masks:  # torch wants one mask type: bool when padding comes along
        kwargs["mask"] = _causal("bool" if "padding" in masks else "float")
    if "padding" in masks:
        kwargs["src_key_padding_mask"] = padding
    got = _run(swapped, mode, x, **kwargs)
    expected = _run(stock, mode, x, **kwargs)
    # torch's nested path returns zeros at padded positions: compare the real tokens.
    keep = ~padding if "padding" in masks else torch.ones(B, N, dtype=torch.bool)
    torch.testing.assert_close(got[keep], expected[keep], **CLOSE64)
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
@pytest.mark.parametrize("form", ["float", "bool"])
def test_decoder_layer_equals_stock(form: str, norm_first: bool) -> None:
    """Decoder layer: causal self-attention (mask form as given, is_causal hint) and
    cross-attention over a memory of the same length, both swapped, padding on both sides (in
    the mask's form: the decoder layer passes masks through as they are)."""
    stock = _decoder_layer(norm_first)
    swapped = copy.deepcopy(stock)
    assert _swap(swapped) == 2
    tgt, memory, padding = _x(), _x(), _padding()
    if form == "float":
        padding = torch.zeros(B, N, dtype=F64).masked_fill(padding, float("-inf"))
    kwargs = {
        "tgt_mask": _causal(form),
        "tgt_is_causal": True,
        "tgt_key_padding_mask": padding,
        "memory_key_padding_mask": padding.flip(0),
    }
    for mode in ("train", "no_grad"):
        got = _run(swapped, mode, tgt, memory, **kwargs)
        expected = _run(stock, mode, tgt, memory, **kwargs)
        torch.testing.assert_close(got, expected, **CLOSE64)


def test_decoder_memory_of_another_length_rejected() -> None:
    """Cross-attention needs memory as long as the target: a clear error otherwise."""
    layer = _decoder_layer(norm_first=False)
    _swap(layer)
    with pytest.raises(ValueError, match="seq_len of query") as excinfo:
        layer(_x(), _x(B, N + 4, E))
    assert "nn.MultiheadAttention" in str(excinfo.value)


def test_encoder_rejects_non_causal_mask() -> None:
    """An arbitrary mask given to a swapped encoder reaches the layer and is refused."""
    encoder = _stock_encoder(norm_first=False)
    _swap(encoder)
    with pytest.raises(ValueError, match="attn_mask"):
        encoder(_x(), mask=torch.randn(N, N, dtype=F64))


@pytest.mark.parametrize("mode", ["train", "no_grad"])
def test_seq_first_layer(mode: str) -> None:
    """A stock layer built with batch_first=False passes (N, B, E): the swapped layer built with
    batch_first=False handles it (key_padding_mask stays (B, N), as in torch)."""
    stock = _encoder_layer(norm_first=False, batch_first=False)
    swapped = copy.deepcopy(stock)
    _swap(swapped)
    assert swapped.self_attn.batch_first is False
    x, padding = _x(N, B, E), _padding()
    kwargs = {"src_mask": _causal("bool"), "is_causal": True, "src_key_padding_mask": padding}
    got = _run(swapped, mode, x, **kwargs)
    expected = _run(stock, mode, x, **kwargs)
    assert got.shape == (N, B, E)
    torch.testing.assert_close(got, expected, **CLOSE64)


def test_batch_first_false_is_a_transpose() -> None:
    seq_first = MultiheadDilatedAttention(E, H, SEGMENTS, RATES, batch_first=False, dtype=F64)
    batch_first = MultiheadDilatedAttention(E, H, SEGMENTS, RATES, dtype=F64)
    batch_first.load_state_dict(seq_first.state_dict())
    x, mask = _x(), _padding()
    out = seq_first(x.transpose(0, 1), key_padding_mask=mask, is_causal=True)[0]
    expected = batch_first(x, key_padding_mask=mask, is_causal=True)[0]
    torch.testing.assert_close(out.transpose(0, 1), expected, atol=0.0, rtol=0.0)


def test_batch_first_layer_in_seq_first_model_is_caught() -> None:
    """A batch-first layer inside a seq-first stock layer, with padding: the error says why."""
    layer = _encoder_layer(norm_first=False, batch_first=False)
    layer.self_attn = MultiheadDilatedAttention(E, H, [N], [1], dtype=F64)
    with pytest.raises(ValueError, match="batch_first=False"):
        layer(_x(N, B, E), src_key_padding_mask=_padding())


# ------------------------------------------------------------------- our layer is what runs


@pytest.mark.parametrize("masks", ["padding", "causal", "none"])
@pytest.mark.parametrize("mode", ["eval", "no_grad", "inference_mode"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
def test_inference_runs_the_dilated_layer(
    no_fused_kernels: None, norm_first: bool, mode: str, masks: str
) -> None:
    """With a real dilated schedule (and the sub-LayerNorm), inference output is what the layer
    itself computes; torch's fused kernels (which would compute dense attention) never run."""
    encoder = _stock_encoder(norm_first)
    dense = copy.deepcopy(encoder)
    _swap(encoder, SEGMENTS, RATES)
    for layer in encoder.layers:
        layer.self_attn.norm = nn.LayerNorm(E, dtype=F64)  # the default layer's sub-LN too
    x, padding = _x(), _padding()
    kwargs: dict[str, Any] = {}
    attn_kwargs: dict[str, Any] = {}
    if masks == "padding":
        kwargs["src_key_padding_mask"] = attn_kwargs["key_padding_mask"] = padding
    if masks == "causal":
        kwargs["mask"] = _causal("float")
        attn_kwargs["is_causal"] = True
    got = _run(encoder, mode, x, **kwargs)
    with torch.no_grad():
        expected = x
        for layer in encoder.layers:
            expected = _manual_encoder_layer(layer, expected, **attn_kwargs)
    torch.testing.assert_close(got, expected, **CLOSE64)
    dense.train()  # stock attention in training mode takes no fused path
    with torch.no_grad():
        assert not torch.allclose(got, dense(x, **kwargs))  # control: not dense attention


def test_fused_kernel_guard_catches_stock(no_fused_kernels: None) -> None:
    """Control for the test above: the guard does stop a stock encoder in inference."""
    encoder = _stock_encoder(norm_first=False).eval()
    with torch.no_grad(), pytest.raises(AssertionError, match="fast path"):
        encoder(_x(), src_key_padding_mask=_padding())
    with torch.no_grad(), pytest.raises(AssertionError, match="fast path"):
        encoder.layers[0](_x())


def test_encoder_built_around_swapped_layer(no_fused_kernels: None) -> None:
    """nn.TransformerEncoder(layer_with_dilated_self_attn, n) works too (torch then turns off
    its nested-tensor path, and warns that it does)."""
    layer = _encoder_layer(norm_first=False)
    _swap(layer, SEGMENTS, RATES)
    with pytest.warns(UserWarning, match="_qkv_same_embed_dim"):
        encoder = nn.TransformerEncoder(layer, 2)
    x, padding = _x(), _padding()
    with torch.inference_mode():
        got = encoder.eval()(x, src_key_padding_mask=padding)
        expected = x
        for mod in encoder.layers:
            expected = _manual_encoder_layer(mod, expected, key_padding_mask=padding)
    torch.testing.assert_close(got, expected, **CLOSE64)


# --------------------------------------------------------------------------------------- training


def _model(kind: str, norm_first: bool) -> nn.Module:
    if kind == "encoder":
        return _stock_encoder(norm_first)
    return _decoder_layer(norm_first)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
@pytest.mark.parametrize("kind", ["encoder", "decoder_layer"])
def test_training_steps(kind: str, norm_first: bool) -> None:
    """A few AdamW steps with a dilated schedule, causal mask and padding: finite gradients on
    every parameter (the dilated layers' included) and a falling loss."""
    torch.manual_seed(0)
    model = _model(kind, norm_first)
    _swap(model, SEGMENTS, RATES)
    head = nn.Linear(E, E, dtype=F64)
    params = [*model.parameters(), *head.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    x, padding, target = _x(), _padding(), _x()
    causal = _causal("bool")
    losses = []
    model.train()
    for _ in range(6):
        if kind == "encoder":
            h = model(x, mask=causal, src_key_padding_mask=padding)
        else:
            h = model(x, x.flip(1), tgt_mask=causal, tgt_is_causal=True,
                      tgt_key_padding_mask=padding)  # fmt: skip
        loss = (head(h) - target)[~padding].square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        for name, p in model.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
        optimizer.step()
        losses.append(loss.item())
    dilated = [m for m in model.modules() if isinstance(m, MultiheadDilatedAttention)]
    assert len(dilated) == 2
    assert all(m.q_proj.weight.grad.abs().sum() > 0 for m in dilated)
    assert losses[-1] < losses[0], losses
