"""Layers of transformers models beyond plain self-attention
(``integrations/_transformers_paths.py``, ``_transformers_layer.py``): a decoder's
cross-attention in encoder-decoder models (BART, Whisper, a BERT-to-BERT
``EncoderDecoderModel``), T5 (refused up front, or every layer kept on SDPA), hybrid models
whose global layers take a LongNet schedule while local ones keep their windows (with sinks or
soft-capping), chunked calls after a cache, and what no layer computes. Tiny models built from
configs, in float64.

A one-branch schedule covering the sequence is dense attention, so every model equals its stock
SDPA (or eager) self within float64 rounding; a LongNet schedule is checked against the float64
oracle. Skipped where transformers is not installed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.hf_models import seeded, tiny_whisper
from support.oracle import masked_attention, oracle_attention, oracle_dilated_attention

transformers = pytest.importorskip("transformers")

from dilated_attention.integrations import _transformers_paths as paths  # noqa: E402
from dilated_attention.integrations import transformers as dilated_hf  # noqa: E402

VOCAB = 97
DENSE = ([128], [1])  # one branch longer than every input: dense attention
SCHEDULE = ([4, 8], [1, 2])
GREEDY = {"max_new_tokens": 10, "do_sample": False, "num_beams": 1}
TIGHT = {"rtol": 1e-10, "atol": 1e-10}


def _bart() -> Any:
    config = transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=128, init_std=0.3, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, attn_implementation="sdpa",
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2,
        forced_eos_token_id=None,
    )  # fmt: skip
    return seeded(transformers.BartForConditionalGeneration, config)


def _whisper() -> Any:
    return tiny_whisper(VOCAB)


def _bert_to_bert() -> Any:
    sizes = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=128, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    config = transformers.EncoderDecoderConfig.from_encoder_decoder_configs(
        transformers.BertConfig(**sizes),
        transformers.BertConfig(**sizes, is_decoder=True, add_cross_attention=True),
    )
    config.decoder_start_token_id, config.pad_token_id = 1, 0
    config._attn_implementation = "sdpa"
    return seeded(lambda c: transformers.EncoderDecoderModel(config=c), config)


def _twin(model: Any, build: Any, schedule: Any = DENSE, **flags: Any) -> Any:
    """``build()`` with ``model``'s weights, on dilated attention."""
    other = build()
    other.load_state_dict(model.state_dict())
    return dilated_hf.use_dilated_attention(other, *schedule, **flags)


def _padded_encoder_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """(3, 20) tokens and mask: a full row, a right-padded one (12 real), a short one (5)."""
    ids = torch.randint(3, VOCAB, (3, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[1, 12:] = 0
    mask[2, 5:] = 0
    return ids, mask


# -- cross-attention ------------------------------------------------------------------------------
def test_bart_equals_sdpa_with_padded_encoder_rows_and_any_decoder_length() -> None:
    """Decoder positions past an encoder row's real length still read that row's encoder
    tokens (a zero cross-attention there was the bug), and a decoder shorter or longer than
    the encoder runs."""
    sdpa = _bart()
    dilated = _twin(sdpa, _bart)
    ids, mask = _padded_encoder_batch()
    for length in (20, 9, 31):
        dec = torch.randint(3, VOCAB, (3, length), generator=torch.Generator().manual_seed(2))
        run = {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": dec}
        torch.testing.assert_close(dilated(**run).logits, sdpa(**run).logits, **TIGHT)


def test_greedy_generation_equals_sdpa_for_bart_and_whisper() -> None:
    """Cached greedy decoding reads the encoder's keys from the cache, padded rows included."""
    sdpa = _bart()
    ids, mask = _padded_encoder_batch()
    want = sdpa.generate(ids, attention_mask=mask, **GREEDY)
    assert torch.equal(_twin(sdpa, _bart).generate(ids, attention_mask=mask, **GREEDY), want)
    whisper = _whisper()
    gen = torch.Generator().manual_seed(3)
    features = torch.randn(2, 8, 48, dtype=torch.float64, generator=gen)
    generate = transformers.GenerationMixin.generate  # Whisper's own needs a real generation config
    want = generate(whisper, features, **GREEDY)
    assert torch.equal(generate(_twin(whisper, _whisper), features, **GREEDY), want)
    dec = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(4))
    got = _twin(whisper, _whisper)(input_features=features, decoder_input_ids=dec).logits
    torch.testing.assert_close(got, whisper(input_features=features, decoder_input_ids=dec).logits,
                               **TIGHT)  # fmt: skip


def test_every_config_copy_gets_the_schedule_encoder_decoder_model() -> None:
    """An EncoderDecoderModel's halves hold configs of their own; both get the schedule, and
    BERT's cross-attention layers run dense over the encoder's keys."""
    sdpa = _bert_to_bert()
    dilated = _twin(sdpa, _bert_to_bert)
    for half in (dilated.encoder, dilated.decoder):
        assert getattr(half.config, dilated_hf.SEGMENTS_ATTR) == DENSE[0]
        assert half.config._attn_implementation == dilated_hf.NAME
    ids, mask = _padded_encoder_batch()
    dec = torch.randint(3, VOCAB, (3, 9), generator=torch.Generator().manual_seed(2))
    run = {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": dec}
    torch.testing.assert_close(dilated(**run).logits, sdpa(**run).logits, **TIGHT)


def _reference_attention(module: Any, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, attention_mask: Any, scaling: float | None = None,
                         **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
    """Float64 oracles: dense over the keys for cross-attention, dilated otherwise (no
    padding here)."""
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    if paths.is_cross_attention(module):
        return oracle_attention(q, k, v, scale=scaling)[0], None
    causal = bool(getattr(module, "is_causal", True))
    return oracle_dilated_attention(q, k, v, *SCHEDULE, is_causal=causal, scale=scaling)[0], None


def test_a_longnet_schedule_is_dilated_in_self_attention_and_dense_in_cross_attention() -> None:
    transformers.AttentionInterface.register("dilated_reference", _reference_attention)
    dilated = _twin(_bart(), _bart, SCHEDULE)
    reference = _twin(dilated, _bart)
    reference.set_attn_implementation("dilated_reference")
    ids = torch.randint(3, VOCAB, (2, 23), generator=torch.Generator().manual_seed(5))
    dec = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(6))
    got = dilated(input_ids=ids, decoder_input_ids=dec).logits
    torch.testing.assert_close(got, reference(input_ids=ids, decoder_input_ids=dec).logits,
                               rtol=1e-9, atol=1e-9)  # fmt: skip
    assert not torch.allclose(got, _bart()(input_ids=ids, decoder_input_ids=dec).logits)


def test_cross_attention_of_the_attention_function_is_the_dense_oracle_with_gradients() -> None:
    """Decoder queries (9) over encoder keys (14) with GQA and a padded encoder row: outputs and
    gradients of q, k and v equal the float64 dense oracle with the encoder's padding."""
    config = type("Config", (), {dilated_hf.SEGMENTS_ATTR: [4], dilated_hf.RATES_ATTR: [2]})
    module = type("BartAttention", (), {"config": config(), "is_decoder": True,
                                        "is_causal": False})()  # fmt: skip
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(2, 4, 9, 8, generator=gen, dtype=torch.float64).requires_grad_()
    k, v = (torch.randn(2, 2, 14, 8, generator=gen, dtype=torch.float64).requires_grad_()
            for _ in "kv")  # fmt: skip
    mask = torch.ones(2, 14, dtype=torch.bool)
    mask[1, 6:] = False
    out, _ = dilated_hf.attention_forward(module, q, k, v, mask, scaling=0.3)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_in = [x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v)]
    ref, _ = oracle_attention(*ref_in, scale=0.3, key_padding_mask=~mask)
    ref_grads = torch.autograd.grad(ref, ref_in, dout)
    torch.testing.assert_close(out, ref, **TIGHT)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want.transpose(1, 2), **TIGHT)


# -- refused up front -----------------------------------------------------------------------------
def _t5() -> Any:
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        dropout_rate=0.0, attn_implementation="sdpa", decoder_start_token_id=0,
    )  # fmt: skip
    return seeded(transformers.T5ForConditionalGeneration, config)


def test_t5_is_refused_before_any_change_or_kept_on_sdpa_naming_every_layer() -> None:
    """T5 adds a learned relative position bias to its scores, which dilated attention cannot
    add: refused, the model left as it was (its halves' own config copies included); with
    ``keep_unsupported_layers`` every layer, cross-attention included, runs on SDPA with its
    bias (padded encoder rows, a forward and cached generation equal T5 on SDPA), with a
    warning that names them."""
    model = _t5()
    with pytest.raises(ValueError, match=r"relative position bias .* keep this model on sdpa "
                                         r"\(keep_unsupported_layers=True runs every layer "
                                         r"there\)"):  # fmt: skip
        dilated_hf.use_dilated_attention(model, *DENSE)
    for held in (model.config, model.encoder.config, model.decoder.config):
        assert held._attn_implementation == "sdpa"
        assert not hasattr(held, dilated_hf.SEGMENTS_ATTR)
    with pytest.warns(UserWarning, match=r"6 of 6 attention layers of T5ForConditionalGeneration "
                                         r"add a learned position bias .* so none runs on "
                                         r"dilated attention: encoder.block.0.layer.0."
                                         r"SelfAttention, .*decoder.block.1.layer.1."
                                         r"EncDecAttention$"):  # fmt: skip
        kept = _twin(model, _t5, keep_unsupported_layers=True)
    ids, mask = _padded_encoder_batch()
    dec = torch.randint(3, VOCAB, (3, 9), generator=torch.Generator().manual_seed(2))
    run = {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": dec}
    torch.testing.assert_close(kept(**run).logits, model(**run).logits, **TIGHT)
    want = model.generate(ids, attention_mask=mask, **GREEDY)
    assert torch.equal(kept.generate(ids, attention_mask=mask, **GREEDY), want)


def test_what_encoder_decoder_models_cannot_take_is_refused() -> None:
    with pytest.raises(ValueError, match=r"encoder-decoder model.*one schedule for every layer"):
        dilated_hf.use_dilated_attention(_bart(), [[8], [8]], [[1], [1]])
    model = _bart()
    model.model.decoder.layers[1].encoder_attn.is_decoder = False  # no longer marked as cross
    with pytest.raises(ValueError, match=r"layer model.decoder.layers.1.encoder_attn looks like "
                                         r"cross-attention"):  # fmt: skip
        dilated_hf.use_dilated_attention(model, *DENSE)
    assert model.config._attn_implementation == "sdpa"


# -- local and global layers ----------------------------------------------------------------------
def _hybrid_reference(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Any, scaling: float | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
    """Float64 oracles of a hybrid model (no padding): a local layer's window, a global layer's
    dilated schedule, each with the call's soft-cap and sinks."""
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    window, sinks = kwargs.get("sliding_window"), kwargs.get("s_aux")
    extra = {"scale": scaling, "softcap": kwargs.get("softcap"), "sinks": sinks, "is_causal": True}
    if window is not None:
        return oracle_attention(q, k, v, window_size=(window - 1, 0), **extra)[0], None
    return oracle_dilated_attention(q, k, v, *SCHEDULE, **extra)[0], None


def _gpt_oss() -> Any:
    """Layer 0 within a 16-token sliding window, layer 1 global; sinks in both."""
    config = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
        num_experts_per_tok=1, sliding_window=16, experts_implementation="eager",
        attn_implementation="eager", rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    )  # fmt: skip
    model = seeded(transformers.GptOssForCausalLM, config)
    with torch.no_grad():
        for block in model.model.layers:
            block.self_attn.sinks.normal_(0.0, 2.0)
    return model


def _gemma2() -> Any:
    """Layer 0 within a 16-token sliding window, layer 1 global; soft-capped scores in both."""
    config = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=16,
        attn_logit_softcapping=2.0, attn_implementation="eager",
    )  # fmt: skip
    return seeded(transformers.Gemma2ForCausalLM, config)


@pytest.mark.parametrize("build", [_gpt_oss, _gemma2], ids=["gpt_oss", "gemma2"])
def test_global_layers_take_the_schedule_and_local_layers_keep_their_window(build: Any) -> None:
    """A LongNet schedule on 40 tokens: the global layer is the dilated oracle, the local one
    the oracle of its 16-token window, both with the model's sinks or soft-cap; logits and every
    gradient (the sinks' included) equal those oracles' in float64."""
    transformers.AttentionInterface.register("hybrid_reference", _hybrid_reference)
    dilated = _twin(build(), build, SCHEDULE)
    reference = _twin(dilated, build)
    reference.set_attn_implementation("hybrid_reference")
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(9))
    got, want = dilated(ids).logits, reference(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert not torch.allclose(got, _twin(dilated, build)(ids).logits)  # the schedule matters
    got.square().sum().backward()
    want.square().sum().backward()
    pairs = zip(dilated.named_parameters(), reference.parameters(), strict=True)
    for (name, mine), theirs in pairs:
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-8, atol=1e-9, msg=name)


def _attention_module(**config: Any) -> Any:
    """A stand-in for a transformers attention module: layer 0 of a config with ``config``."""
    settings = {dilated_hf.SEGMENTS_ATTR: [64], dilated_hf.RATES_ATTR: [1], **config}
    return type("Attention", (), {"config": type("Config", (), settings)(), "layer_idx": 0,
                                  "is_causal": True})()  # fmt: skip


def test_a_chunked_call_after_a_cache_that_dropped_keys_equals_the_chunked_oracle() -> None:
    """A chunked layer (8 tokens) called with the last 6 of 30 positions as keys and 3 queries
    (Note [Chunks after a cache]): row 1, left-padded by 5, has its chunk start among the
    dropped keys; each real query sees the keys of its chunk that the call holds, outputs and
    gradients as the float64 oracle."""
    module = _attention_module(layer_types=["chunked_attention"], attention_chunk_size=8)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 3, 8, generator=gen, dtype=torch.float64).requires_grad_()
    k, v = (torch.randn(2, 2, 6, 8, generator=gen, dtype=torch.float64).requires_grad_()
            for _ in "kv")  # fmt: skip
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[1, :5] = False
    out, _ = dilated_hf.attention_forward(module, q, k, v, mask)
    q_abs, k_abs = torch.arange(27, 30)[:, None], torch.arange(24, 30)[None]
    first = torch.tensor([0, 5])[:, None, None]
    visible = (k_abs <= q_abs) & ((k_abs - first) // 8 == (q_abs - first) // 8)  # (B, 3, 6)
    pick = [x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v)]
    want, _ = masked_attention(*pick, visible[:, None].expand(2, 4, 3, 6).long())
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(out, want, **TIGHT)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for got, expected in zip(grads, torch.autograd.grad(want, pick, dout), strict=True):
        torch.testing.assert_close(got, expected.transpose(1, 2), **TIGHT)


def test_what_no_layer_computes_is_refused() -> None:
    """A bidirectional window (each model defines its width in its own mask) and sinks that are
    not one logit per query head raise, naming the layer."""
    module = _attention_module()
    module.is_causal = False
    q = k = v = torch.randn(1, 4, 6, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"Attention \(layer 0\) attends within a bidirectional "
                                         r"sliding window of 4 tokens"):  # fmt: skip
        dilated_hf.attention_forward(module, q, k, v, None, sliding_window=4)
    module.is_causal = True
    with pytest.raises(ValueError, match=r"sinks of shape \(1, 4, 6, 1\); dilated attention "
                                         r"takes one logit per query head, shape \(4,\)"):
        dilated_hf.attention_forward(module, q, k, v, None, sinks=torch.zeros(1, 4, 6, 1))
