"""Packed documents through the layers: a packed batch equals each document in its own row.

The multihead layer projects every token alone, so with packed documents (Note [Packed
documents] in ``core/geometry/documents.py``) its output and every parameter's gradient must equal
those of the documents run one per row; with rotary, each document's positions start at 0 as they do
in its own row. Compared in float64 against the unpacked layer (itself checked against the
oracle by the layer suites).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from dilated_attention import (
    BlockSparseMultiheadAttention,
    DilatedAttention,
    DilatedKVCache,
    MultiheadDilatedAttention,
)
from dilated_attention.models import LongNetConfig, LongNetLM
from dilated_attention.patterns import LocalWindow

E, H, HKV = 32, 4, 2
SEGS, RATES = (8, 16), (1, 2)


def _layer(rotary: bool) -> MultiheadDilatedAttention:
    torch.manual_seed(0)
    layer = MultiheadDilatedAttention(E, H, SEGS, RATES, num_kv_heads=HKV, dtype=torch.float64)
    return layer.use_rotary() if rotary else layer


def _alone(layer, x: torch.Tensor, rows: list[list[int]], is_causal: bool) -> torch.Tensor:
    """Each document in its own row of one, concatenated back in the packed layout."""
    out = []
    for b, row in enumerate(rows):
        starts = [0, *itertools.accumulate(row)]
        parts = [layer(x[b : b + 1, a:e], is_causal=is_causal)[0]
                 for a, e in itertools.pairwise(starts)]  # fmt: skip
        out.append(torch.cat(parts, dim=1))
    return torch.cat(out)


@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("rows", [[[1, 6, 20, 13]], [[5, 35], [40]]], ids=["one-row", "two-rows"])
def test_packed_multihead_layer_equals_documents_in_their_own_rows(rotary, is_causal, rows):
    layer = _layer(rotary)
    offsets = [0, *itertools.accumulate(n for row in rows for n in row)]
    x = torch.randn(len(rows), sum(rows[0]), E, dtype=torch.float64, requires_grad=True)
    packed, _ = layer(x, is_causal=is_causal, cu_seqlens=offsets)
    alone = _alone(layer, x, rows, is_causal)
    torch.testing.assert_close(packed, alone, atol=1e-12, rtol=1e-10)
    weight = torch.randn_like(packed)
    params = [x, *layer.parameters()]
    got = torch.autograd.grad((packed * weight).sum(), params)
    want = torch.autograd.grad((alone * weight).sum(), params)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-10)


def test_dilated_attention_module_takes_packed_documents() -> None:
    module = DilatedAttention(SEGS, RATES)
    q = torch.randn(1, 30, H, 8, dtype=torch.float64)
    k = v = torch.randn(1, 30, HKV, 8, dtype=torch.float64)
    out = module(q, k, v, is_causal=True, cu_seqlens=[0, 11, 30])
    first = module(q[:, :11], k[:, :11], v[:, :11], is_causal=True)
    second = module(q[:, 11:], k[:, 11:], v[:, 11:], is_causal=True)
    torch.testing.assert_close(out, torch.cat([first, second], dim=1), atol=0, rtol=0)


def test_a_layer_without_packed_documents_refuses_them() -> None:
    layer = BlockSparseMultiheadAttention(E, H, LocalWindow(1), block_size=8)
    x = torch.randn(1, 16, E)
    with pytest.raises(ValueError, match=r"cu_seqlens .* needs a layer whose inner module takes"):
        layer(x, cu_seqlens=[0, 8, 16])


def test_a_packed_prompt_through_the_layer_continues_its_last_document() -> None:
    """Rotary positions restart at the last document, and the tokens after the prompt continue
    them: what they get after that document alone (Note [A packed prompt])."""
    layer = _layer(rotary=True)
    packed, alone = DilatedKVCache(SEGS, RATES), DilatedKVCache(SEGS, RATES)
    x = torch.randn(1, 30, E, dtype=torch.float64)
    y, _ = layer(x, is_causal=True, cache=packed, cu_seqlens=[0, 4, 30])
    y_alone, _ = layer(x[:, 4:], is_causal=True, cache=alone)
    torch.testing.assert_close(y[:, 4:], y_alone, atol=1e-12, rtol=1e-10)
    for _ in range(3):
        new = torch.randn(1, 1, E, dtype=torch.float64)
        got = layer(new, is_causal=True, cache=packed)[0]
        torch.testing.assert_close(got, layer(new, is_causal=True, cache=alone)[0],
                                   atol=1e-12, rtol=1e-10)  # fmt: skip
    with pytest.raises(ValueError, match="caches must be empty"):
        layer(x, is_causal=True, cache=packed, cu_seqlens=[0, 4, 30])


def _logits_alone(model: LongNetLM, tokens: torch.Tensor, rows: list[list[int]]) -> torch.Tensor:
    """Each document's logits in a row of its own, concatenated back in the packed layout."""
    out = []
    for b, row in enumerate(rows):
        starts = [0, *itertools.accumulate(row)]
        out.append(torch.cat([model(tokens[b : b + 1, a:e])
                              for a, e in itertools.pairwise(starts)], dim=1))  # fmt: skip
    return torch.cat(out)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("rows", [[[7, 18]], [[7, 18], [2, 5, 18]]], ids=["one-row", "two-rows"])
def test_longnet_generates_after_a_packed_prompt_as_after_its_last_document(rows, static):
    """Every document of the prompt gets its logits alone, and the tokens after it continue
    each row's last document (rows of one batch, documents in both)."""
    torch.manual_seed(0)
    model = LongNetLM(LongNetConfig(vocab_size=61, embed_dim=E, num_heads=H, num_layers=2,
                                    segment_lengths=SEGS, dilation_rates=RATES, ffn_dim=64))
    model = model.double().eval()
    tokens = torch.randint(0, 61, (len(rows), 25))
    offsets = [0, *itertools.accumulate(n for row in rows for n in row)]
    packed, alone = model.new_caches(static=static), model.new_caches(static=static)
    with torch.no_grad():
        logits = model(tokens, cu_seqlens=offsets, caches=packed)
        torch.testing.assert_close(logits, _logits_alone(model, tokens, rows),
                                   atol=1e-12, rtol=1e-10)  # fmt: skip
        torch.testing.assert_close(logits[:, 7:], model(tokens[:, 7:], caches=alone),
                                   atol=1e-12, rtol=1e-10)  # fmt: skip
        for _ in range(3):
            nxt = logits[:, -1:].argmax(-1)
            logits = model(nxt, caches=packed)
            torch.testing.assert_close(logits, model(nxt, caches=alone), atol=1e-12, rtol=1e-10)
    with pytest.raises(ValueError, match="caches must be empty"):
        model(tokens, cu_seqlens=offsets, caches=packed)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "checkpointed"])
@pytest.mark.parametrize("rows", [[[3, 17, 1, 19]], [[3, 17], [1, 12, 7]]],
                         ids=["one-row", "two-rows"])  # fmt: skip
def test_a_packed_training_batch_of_longnet_gives_each_document_its_own_losses(
    checkpointing, rows
):
    """Per-token losses and every gradient of a packed batch equal those of the documents in
    rows of their own (float64, dropout off), with documents in every row of the batch."""
    config = LongNetConfig(
        vocab_size=61, embed_dim=E, num_heads=H, num_layers=2, segment_lengths=SEGS,
        dilation_rates=RATES, ffn_dim=64, activation_checkpointing=checkpointing,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LongNetLM(config).double().train()
    offsets = [0, *itertools.accumulate(n for row in rows for n in row)]
    tokens = torch.randint(0, 61, (len(rows), sum(rows[0])))
    # Each token's logits scored against the token itself (a stand-in target: the point is
    # that every token's loss and gradient is the one it has alone).
    logits = model(tokens, cu_seqlens=offsets)
    alone_logits = _logits_alone(model, tokens, rows)
    torch.testing.assert_close(logits, alone_logits, atol=1e-12, rtol=1e-10)
    packed = F.cross_entropy(logits.flatten(0, 1), tokens.flatten(), reduction="none")
    alone = F.cross_entropy(alone_logits.flatten(0, 1), tokens.flatten(), reduction="none")
    params = list(model.parameters())
    got = torch.autograd.grad(packed.sum(), params)
    want = torch.autograd.grad(alone.sum(), params)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-11, rtol=1e-9)


def test_an_empty_packed_batch_through_the_layer_and_longnet_is_empty() -> None:
    """A batch of 0 sequences packs no documents (cu_seqlens=[0]): empty results and gradients,
    as unpacked, for training and for a packed prompt into caches."""
    layer = _layer(rotary=True)
    x = torch.randn(0, 10, E, dtype=torch.float64, requires_grad=True)
    out, _ = layer(x, is_causal=True, cu_seqlens=[0])
    assert out.shape == x.shape and torch.autograd.grad(out.sum(), x)[0].shape == x.shape
    torch.manual_seed(0)
    model = LongNetLM(LongNetConfig(vocab_size=61, embed_dim=E, num_heads=H, num_layers=2,
                                    segment_lengths=SEGS, dilation_rates=RATES, ffn_dim=64,
                                    max_seq_len=32))  # fmt: skip
    tokens = torch.zeros(0, 10, dtype=torch.long)
    assert model(tokens, cu_seqlens=[0]).shape == (0, 10, 61)
    caches = model.new_caches()
    assert model(tokens, cu_seqlens=[0], caches=caches).shape == (0, 10, 61)
    assert [c.length for c in caches] == [10, 10]
    with pytest.raises(ValueError, match=r"a batch of 0 sequences holds no documents"):
        model(tokens, cu_seqlens=[0, 10])


def test_longnet_refuses_positions_with_packed_documents() -> None:
    torch.manual_seed(0)
    model = LongNetLM(LongNetConfig(vocab_size=61, embed_dim=E, num_heads=H, num_layers=1,
                                    segment_lengths=SEGS, dilation_rates=RATES, ffn_dim=64))
    tokens = torch.randint(0, 61, (1, 10))
    with pytest.raises(ValueError, match="positions and cu_seqlens cannot be combined"):
        model(tokens, positions=torch.arange(10), cu_seqlens=[0, 4, 10])
