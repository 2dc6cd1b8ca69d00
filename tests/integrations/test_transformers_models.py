"""Models whose attention calls carry more than a padding mask (``integrations/transformers.py``,
``_transformers_masks.py``): gpt-oss's attention sinks, Llama 4's chunked layers, static caches
in models whose attention gets no position ids (Llama 4, Whisper's decoder), and Llama 4 rows
packed by restarting position ids. Tiny models built from configs, in float64.

A one-branch schedule longer than every input is dense attention, so every model equals its
stock self (SDPA, or eager for gpt-oss, which has no SDPA) within float64 rounding; what dilated
attention cannot compute is refused, or with ``keep_unsupported_layers`` equals the stock model.
Skipped where transformers is not installed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dilated_attention.integrations import transformers as dilated_hf  # noqa: E402

VOCAB = 97
DENSE = ([256], [1])  # one branch longer than every input: dense attention
TIGHT = {"rtol": 1e-10, "atol": 1e-10}
GREEDY = {"do_sample": False, "pad_token_id": 0, "eos_token_id": None}
SIZES = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, num_local_experts=2, max_position_embeddings=256,
    experts_implementation="eager",  # the grouped kernels take no float64
)  # fmt: skip


def _seeded(cls: Any, config: Any) -> Any:
    torch.manual_seed(0)
    return cls(config).double().eval()


def _gpt_oss() -> Any:
    """Layer 0 within an 8-token sliding window, layer 1 full; sinks in both."""
    config = transformers.GptOssConfig(
        **SIZES, intermediate_size=32, num_experts_per_tok=1, sliding_window=8,
        attn_implementation="eager", rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    )  # fmt: skip
    model = _seeded(transformers.GptOssForCausalLM, config)
    with torch.no_grad():  # sinks that matter
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    return model


def _llama4(chunk: int = 8, types: list[str] | None = None) -> Any:
    """Layer 0 chunked (``chunk`` tokens), layer 1 full, unless ``types`` says otherwise."""
    config = transformers.Llama4TextConfig(
        **SIZES, intermediate_size=64, intermediate_size_mlp=64, attention_chunk_size=chunk,
        no_rope_layer_interval=2, layer_types=types, attn_implementation="sdpa",
    )  # fmt: skip
    return _seeded(transformers.Llama4ForCausalLM, config)


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


def _llama() -> Any:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        attn_implementation="sdpa",
    )  # fmt: skip
    return _seeded(transformers.LlamaForCausalLM, config)


def _twin(model: Any, build: Any, schedule: Any = DENSE, **flags: Any) -> Any:
    """``build()`` with ``model``'s weights, on dilated attention."""
    other = build()
    other.load_state_dict(model.state_dict())
    return dilated_hf.use_dilated_attention(other, *schedule, **flags)


def _ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _left_padded(batch: int, length: int, pad: int) -> torch.Tensor:
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, :pad] = 0
    return mask


# -- gpt-oss: attention sinks ----------------------------------------------------------------------
def test_gpt_oss_sinks_are_refused_or_kept_on_its_eager_attention_with_their_gradient() -> None:
    """Sinks are refused by default, naming the layer, the sinks and what to do (gpt-oss has no
    SDPA, so not "sdpa"); kept, logits and every gradient (the sinks' included) equal gpt-oss
    on its eager attention, with a warning that no layer runs dilated."""
    eager = _gpt_oss()
    ids = _ids(2, 20)
    with pytest.raises(ValueError, match=r"GptOssAttention \(layer 0\) adds attention sinks.*"
                                         r"keep_unsupported_layers=True.*its own attention "
                                         r"\(attn_implementation='eager'") as info:  # fmt: skip
        _twin(eager, _gpt_oss)(ids)
    assert "sdpa" not in str(info.value).replace("it has no sdpa", "")
    with pytest.warns(UserWarning, match=r"every attention layer of GptOssForCausalLM \(2 of 2\) "
                                         r"runs on transformers' attention for every call.*"
                                         r"model.layers.0.self_attn \(every call: attention "
                                         r"sinks\)"):  # fmt: skip
        kept = _twin(eager, _gpt_oss, keep_unsupported_layers=True)
    got, want = kept(ids).logits, eager(ids).logits
    torch.testing.assert_close(got, want, **TIGHT)
    got.square().sum().backward()
    want.square().sum().backward()
    for (name, mine), theirs in zip(kept.named_parameters(), eager.parameters(), strict=True):
        assert (mine.grad is None) == (theirs.grad is None), name
        if "sinks" in name:
            assert mine.grad is not None and bool(mine.grad.abs().sum() > 0), name
        if mine.grad is not None:
            torch.testing.assert_close(mine.grad, theirs.grad, **TIGHT, msg=name)


# -- Llama 4: chunked attention --------------------------------------------------------------------
def test_llama4_calls_beyond_one_chunk_are_refused_or_kept_on_sdpa() -> None:
    """A chunked layer (8 tokens) over 30 keys is refused by default; kept, a left-padded
    batch and generation across chunk boundaries (a dynamic cache that drops keys, a static one)
    equal Llama 4 on SDPA; a call within one chunk runs dilated, equal to SDPA."""
    sdpa = _llama4()
    ids, mask = _ids(2, 30), _left_padded(2, 30, 5)
    with pytest.raises(ValueError, match=r"Llama4TextAttention \(layer 0\) attends within chunks "
                                         r"of 8 tokens .*30 keys.*keep_unsupported_layers="
                                         r"True.*or keep the model on sdpa"):  # fmt: skip
        _twin(sdpa, _llama4)(ids)
    within = _ids(2, 8, seed=2)
    torch.testing.assert_close(_twin(sdpa, _llama4)(within).logits, sdpa(within).logits, **TIGHT)
    with pytest.warns(UserWarning, match=r"1 of 2 attention layers of Llama4ForCausalLM.*"
                                         r"model.layers.0.self_attn \(calls beyond its first "
                                         r"8-token chunk\)"):  # fmt: skip
        kept = _twin(sdpa, _llama4, keep_unsupported_layers=True)
    real = mask.bool()
    got, want = kept(ids, attention_mask=mask).logits, sdpa(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[real], want[real], **TIGHT)
    prompt = {"input_ids": ids[:, :6], "attention_mask": _left_padded(2, 6, 2)}
    run = {**GREEDY, "max_new_tokens": 13}
    expected = sdpa.generate(**prompt, **run)
    assert torch.equal(kept.generate(**prompt, **run), expected)
    assert torch.equal(kept.generate(**prompt, cache_implementation="static", **run), expected)


# -- static caches without position ids ------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama4", "whisper", "llama"])
def test_static_cache_generation_equals_the_dynamic_cache_and_sdpa(family: str) -> None:
    """Greedy generation with a static cache (whose unfilled slots follow the tokens) gives the
    tokens of a dynamic cache and of SDPA, unpadded and left-padded; Llama 4 and Whisper's
    decoder give the attention no position ids, so the filled length comes from the mask
    function."""
    run = {**GREEDY, "max_new_tokens": 12}
    if family == "whisper":
        sdpa = _whisper()
        gen = torch.Generator().manual_seed(3)
        features = torch.randn(2, 8, 48, dtype=torch.float64, generator=gen)
        generate = transformers.GenerationMixin.generate  # Whisper's own needs a generation config
        dilated = _twin(sdpa, _whisper)
        want = generate(sdpa, features, **run)
        assert torch.equal(generate(dilated, features, **run), want)
        assert torch.equal(generate(dilated, features, cache_implementation="static", **run), want)
        return
    build = (lambda: _llama4(chunk=256)) if family == "llama4" else _llama
    sdpa = build()
    dilated = _twin(sdpa, build)
    ids = _ids(2, 17)
    for mask in (None, _left_padded(2, 17, 6)):
        want = sdpa.generate(ids, attention_mask=mask, **run)
        assert torch.equal(dilated.generate(ids, attention_mask=mask, **run), want)
        static = dilated.generate(ids, attention_mask=mask, cache_implementation="static", **run)
        assert torch.equal(static, want)


# -- Llama 4: rows packed by restarting position ids ----------------------------------------------
def test_llama4_rows_packed_by_position_ids_equal_each_sequence_alone() -> None:
    """Llama 4's attention gets no position ids: the packing comes from the mask function
    (transformers finds it without a cache, use_cache=False): every token's logits equal
    SDPA's on the packed row and those of its sequence alone."""
    sdpa = _llama4(chunk=256)
    dilated = _twin(sdpa, lambda: _llama4(chunk=256))
    lengths = (7, 19, 1, 13)
    sequences = [_ids(1, n, seed=n)[0].tolist() for n in lengths]
    collate = transformers.DataCollatorWithFlattening()
    batch = collate([{"input_ids": ids} for ids in sequences])
    assert "position_ids" in batch and "cu_seq_lens_q" not in batch
    got = dilated(**batch, use_cache=False).logits
    torch.testing.assert_close(got, sdpa(**batch, use_cache=False).logits, **TIGHT)
    alone = torch.cat([dilated(torch.tensor([ids])).logits for ids in sequences], dim=1)
    torch.testing.assert_close(got, alone, rtol=1e-7, atol=1e-7)  # rotary tables in float32


@pytest.mark.slow
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
def test_llama4_static_cache_decoding_compiles_to_one_graph(padded: bool) -> None:
    """Llama 4's attention gets no position ids: under ``torch.compile(fullgraph=True)`` the
    one-token step on a static cache takes each row's position from the mask function's slots
    (Note [What the mask function passes on]), one graph for every token, the tokens of eager
    decoding with a dynamic cache."""
    model = dilated_hf.use_dilated_attention(
        _llama4(types=["full_attention", "full_attention"]), [4, 8], [1, 2]
    )
    ids = _ids(2, 11, seed=4)
    mask = _left_padded(2, 11, 4 if padded else 0)
    positions = (mask.cumsum(1) - 1).clamp(min=0)

    def decode(step: Any, cache: Any) -> torch.Tensor:
        slots = torch.cat([mask, torch.zeros(2, 32 - 11, dtype=torch.long)], dim=1)
        padding = {"attention_mask": mask} if padded else {}
        logits = model(ids, cache=cache, position_ids=positions, **padding).logits
        tokens = [logits[:, -1:].argmax(-1)]
        for i in range(12):
            slots[:, 11 + i] = 1
            seen = slots if isinstance(cache, transformers.StaticCache) else slots[:, : 12 + i]
            logits = step(cache, tokens[-1], positions[:, -1:] + 1 + i, seen)
            tokens.append(logits[:, -1:].argmax(-1))
        return torch.cat(tokens, dim=1)

    def step(cache: Any, token: torch.Tensor, position: torch.Tensor, slots: torch.Tensor) -> Any:
        padding = {"attention_mask": slots} if padded else {}
        return model(token, cache=cache, position_ids=position, **padding).logits

    graphs = []

    def counting_backend(gm: Any, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=counting_backend)
    with torch.no_grad():
        want = decode(step, transformers.DynamicCache(config=model.config))
        got = decode(compiled, transformers.StaticCache(config=model.config, max_cache_len=32))
    assert torch.equal(got, want)
    assert len(graphs) == 1
