"""Layers of transformers models beyond a decoder's self-attention
(``integrations/_transformers_paths.py``): a decoder's cross-attention in encoder-decoder models
(BART, Whisper, a BERT-to-BERT ``EncoderDecoderModel``), models refused up front (T5), and
layers dilated attention cannot compute (a sliding window shorter than the call, soft-capped
scores), refused or kept on transformers' attention. Tiny models built from configs, in float64.

A one-branch schedule covering the sequence is dense attention, so every model equals its stock
SDPA (or eager) self within float64 rounding; a LongNet schedule is checked against the float64
oracle. Skipped where transformers is not installed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.oracle import oracle_attention, oracle_dilated_attention

transformers = pytest.importorskip("transformers")

from dilated_attention.integrations import _transformers_paths as paths  # noqa: E402
from dilated_attention.integrations import transformers as dilated_hf  # noqa: E402

VOCAB = 97
DENSE = ([128], [1])  # one branch longer than every input: dense attention
SCHEDULE = ([4, 8], [1, 2])
GREEDY = {"max_new_tokens": 10, "do_sample": False, "num_beams": 1}
TIGHT = {"rtol": 1e-10, "atol": 1e-10}


def _seeded(cls: Any, config: Any) -> Any:
    torch.manual_seed(0)
    return cls(config).double().eval()


def _bart() -> Any:
    config = transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=128, init_std=0.3, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, attn_implementation="sdpa",
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2,
        forced_eos_token_id=None,
    )  # fmt: skip
    return _seeded(transformers.BartForConditionalGeneration, config)


def _whisper() -> Any:
    config = transformers.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=8, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, d_model=32, max_source_positions=24, max_target_positions=64,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, init_std=0.3,
        attn_implementation="sdpa", pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1, suppress_tokens=None, begin_suppress_tokens=None,
    )  # fmt: skip
    return _seeded(transformers.WhisperForConditionalGeneration, config)


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
    return _seeded(lambda c: transformers.EncoderDecoderModel(config=c), config)


def _mistral(window: int = 16) -> Any:
    config = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        sliding_window=window, attn_implementation="sdpa",
    )  # fmt: skip
    return _seeded(transformers.MistralForCausalLM, config)


def _qwen2() -> Any:
    """Layer 0 full attention, layer 1 within a 16-token sliding window."""
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        use_sliding_window=True, sliding_window=16, max_window_layers=1,
        attn_implementation="sdpa",
    )  # fmt: skip
    return _seeded(transformers.Qwen2ForCausalLM, config)


def _gemma2() -> Any:
    config = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        sliding_window=16, attn_logit_softcapping=50.0, attn_implementation="eager",
    )  # fmt: skip
    return _seeded(transformers.Gemma2ForCausalLM, config)


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
def test_t5_is_refused_before_any_change() -> None:
    """T5 adds a learned relative position bias to its scores, which dilated attention cannot
    add: refused, the model left as it was (its halves' own config copies included)."""
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        dropout_rate=0.0, attn_implementation="sdpa", decoder_start_token_id=0,
    )  # fmt: skip
    model = _seeded(transformers.T5ForConditionalGeneration, config)
    with pytest.raises(ValueError, match=r"relative position bias .* keep this model on sdpa"):
        dilated_hf.use_dilated_attention(model, *DENSE)
    for held in (model.config, model.encoder.config, model.decoder.config):
        assert held._attn_implementation == "sdpa"
        assert not hasattr(held, dilated_hf.SEGMENTS_ATTR)


def test_what_encoder_decoder_models_cannot_take_is_refused() -> None:
    with pytest.raises(ValueError, match=r"encoder-decoder model.*one schedule for every layer"):
        dilated_hf.use_dilated_attention(_bart(), [[8], [8]], [[1], [1]])
    model = _bart()
    model.model.decoder.layers[1].encoder_attn.is_decoder = False  # no longer marked as cross
    with pytest.raises(ValueError, match=r"layer model.decoder.layers.1.encoder_attn looks like "
                                         r"cross-attention"):  # fmt: skip
        dilated_hf.use_dilated_attention(model, *DENSE)
    assert model.config._attn_implementation == "sdpa"


# -- sliding windows and soft-capping -------------------------------------------------------------
def test_a_sliding_window_longer_than_the_call_runs_dilated() -> None:
    """Mistral's stock window (4096) on 40 tokens is plain causal attention: it runs dilated,
    equal to SDPA with one dense branch and to the oracle with a LongNet schedule."""
    sdpa = _mistral(4096)
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(_twin(sdpa, lambda: _mistral(4096))(ids).logits, sdpa(ids).logits,
                               **TIGHT)  # fmt: skip
    transformers.AttentionInterface.register("dilated_reference", _reference_attention)
    dilated = _twin(sdpa, lambda: _mistral(4096), SCHEDULE)
    reference = _twin(sdpa, lambda: _mistral(4096))
    reference.set_attn_implementation("dilated_reference")
    torch.testing.assert_close(dilated(ids).logits, reference(ids).logits, rtol=1e-9, atol=1e-9)


def test_a_sliding_window_as_long_as_the_call_runs_dilated_one_token_longer_is_refused() -> None:
    """HF's ``sliding_window=W`` lets each query see the W keys ending at itself: a call of W
    keys is plain causal attention and runs dilated, equal to SDPA; W + 1 keys is refused."""
    sdpa = _mistral()
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(9))
    dilated = _twin(sdpa, _mistral)
    torch.testing.assert_close(dilated(ids[:, :16]).logits, sdpa(ids[:, :16]).logits, **TIGHT)
    with pytest.raises(ValueError, match=r"sliding window of 16 tokens, and this call has 17 keys"):
        dilated(ids)


def _left_padded(batch: int, length: int, short: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(10))
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, : length - short] = 0
    return {"input_ids": ids, "attention_mask": mask}


def test_a_shorter_sliding_window_is_refused_or_kept_on_sdpa() -> None:
    """A 16-token window on 40 tokens: refused by default, naming the flag; kept, the padded
    batch and cached generation across the window equal Mistral on SDPA."""
    sdpa = _mistral()
    run = _left_padded(2, 40, 31)
    with pytest.raises(ValueError, match=r"sliding window of 16 tokens, and this call has 40 "
                                         r"keys.*keep_unsupported_layers=True.*or keep the "
                                         r"model on sdpa"):  # fmt: skip
        _twin(sdpa, _mistral)(**run)
    with pytest.warns(UserWarning, match=r"2 of 2 attention layers of MistralForCausalLM run on "
                                         r"transformers' attention for the calls named.*"
                                         r"model.layers.1.self_attn \(calls of more than 16 "
                                         r"keys: a sliding window\)"):  # fmt: skip
        kept = _twin(sdpa, _mistral, keep_unsupported_layers=True)
    real = run["attention_mask"].bool()
    torch.testing.assert_close(kept(**run).logits[real], sdpa(**run).logits[real], **TIGHT)
    prompt = _left_padded(2, 10, 7)  # 10 + 12 tokens cross the window while decoding
    greedy = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(kept.generate(**prompt, **greedy), sdpa.generate(**prompt, **greedy))


def test_soft_capped_layers_are_kept_on_the_models_eager_attention() -> None:
    """Gemma2 soft-caps every layer's scores: refused by default; kept, equal to Gemma2 on its
    eager attention, in a forward and in cached generation."""
    eager = _gemma2()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(11))
    with pytest.raises(ValueError, match=r"Gemma2Attention \(layer 0\) soft-caps its attention "
                                         r"scores \(softcap=50.0\).*keep the model on its own "
                                         r"attention \(attn_implementation='eager'; it has no "
                                         r"sdpa\)"):  # fmt: skip
        _twin(eager, _gemma2)(ids)
    with pytest.warns(UserWarning, match=r"every attention layer of Gemma2ForCausalLM \(2 of 2\) "
                                         r"runs on transformers' attention for every call, so "
                                         r"none runs dilated attention: model.layers.0.self_attn "
                                         r"\(every call: soft-capped scores, softcap=50.0\); "
                                         r"model.layers.1.self_attn"):  # fmt: skip
        kept = _twin(eager, _gemma2, keep_unsupported_layers=True)
    torch.testing.assert_close(kept(ids).logits, eager(ids).logits, **TIGHT)
    greedy = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(kept.generate(ids, **greedy), eager.generate(ids, **greedy))


def test_only_the_calls_a_window_does_not_cover_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen2 with a full layer (0) and a 16-token sliding one (1): on 40 tokens only layer 1 is
    kept, on 12 none is; the results equal Qwen2 on SDPA."""
    sdpa = _qwen2()
    kept_layers: list[int] = []
    kept_attention = paths.kept_attention

    def spy(module: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        kept_layers.append(module.layer_idx)
        return kept_attention(module, *args, **kwargs)

    monkeypatch.setattr(paths, "kept_attention", spy)
    with pytest.warns(UserWarning, match=r"1 of 2 attention layers of Qwen2ForCausalLM.*: "
                                         r"model.layers.1.self_attn \(calls of more than 16 "
                                         r"keys: a sliding window\)$"):  # fmt: skip
        model = _twin(sdpa, _qwen2, keep_unsupported_layers=True)
    for length, want in ((40, [1]), (12, [])):
        kept_layers.clear()
        ids = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(12))
        torch.testing.assert_close(model(ids).logits, sdpa(ids).logits, **TIGHT)
        assert kept_layers == want
