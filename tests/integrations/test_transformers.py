"""Dilated attention inside Hugging Face transformers models (``integrations/transformers.py``):
tiny Llama-style (GQA, rotary) and BERT-style models built from configs, in float64.

One branch covering the sequence equals transformers' SDPA; a LongNet schedule equals an eager
reference that runs the float64 oracle in every layer; left and right padding give each row
exactly what it gives alone; cached generation (dynamic and static caches) equals uncached.
Skipped where transformers is not installed (``pip install transformers``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.oracle import oracle_dilated_attention

transformers = pytest.importorskip("transformers")

from dilated_attention.integrations import transformers as dilated_hf  # noqa: E402

VOCAB = 97
SCHEDULE = ([8, 16], [1, 2])


def _llama(**overrides: Any) -> Any:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        attn_implementation="sdpa", **overrides,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double().eval()


def _bert() -> Any:
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=128, attn_implementation="sdpa",
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.BertModel(config, add_pooling_layer=False).double().eval()


def _twin(model: Any, build: Any) -> Any:
    """A second model with ``model``'s weights."""
    other = build()
    other.load_state_dict(model.state_dict())
    return other


def _oracle_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Any, scaling: float | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
    """An eager reference: the float64 oracle of the whole (unpadded) call."""
    assert attention_mask is None or bool(attention_mask.all())
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    groups = q.shape[2] // k.shape[2]
    k, v = (x.repeat_interleave(groups, dim=2) for x in (k, v))
    out, _ = oracle_dilated_attention(
        q, k, v, *SCHEDULE, is_causal=getattr(module, "is_causal", True), scale=scaling
    )
    return out, None


def test_one_branch_over_the_sequence_is_sdpa() -> None:
    ids = torch.randint(0, VOCAB, (2, 40))
    sdpa = _llama()
    dilated = dilated_hf.use_dilated_attention(_twin(sdpa, _llama), [64], [1])
    assert dilated.config._attn_implementation == dilated_hf.NAME
    torch.testing.assert_close(dilated(ids).logits, sdpa(ids).logits, rtol=1e-10, atol=1e-10)
    bert_sdpa = _bert()
    bert = dilated_hf.use_dilated_attention(_twin(bert_sdpa, _bert), [64], [1])
    got, want = bert(ids).last_hidden_state, bert_sdpa(ids).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_a_longnet_schedule_is_the_oracle_in_every_layer() -> None:
    transformers.AttentionInterface.register("dilated_oracle", _oracle_attention)
    ids = torch.randint(0, VOCAB, (2, 37))
    for build, read in ((_llama, "logits"), (_bert, "last_hidden_state")):
        dilated = dilated_hf.use_dilated_attention(build(), *SCHEDULE)
        oracle = _twin(dilated, build)
        oracle.set_attn_implementation("dilated_oracle")
        got, want = getattr(dilated(ids), read), getattr(oracle(ids), read)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
        sdpa = _twin(dilated, build)
        assert not torch.allclose(got, getattr(sdpa(ids), read))  # the schedule matters here


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_rows_equal_each_sequence_alone(side: str) -> None:
    """A padded batch (rotary positions from the mask, as transformers' generate makes them)
    gives each row's real tokens exactly the logits of that sequence alone."""
    model = dilated_hf.use_dilated_attention(_llama(), *SCHEDULE)
    bert = dilated_hf.use_dilated_attention(_bert(), *SCHEDULE)
    ids = torch.randint(0, VOCAB, (3, 33))
    mask = torch.ones(3, 33, dtype=torch.long)
    lengths = [33, 26, 19]
    for row, n in enumerate(lengths):
        if side == "left":
            mask[row, : 33 - n] = 0
        else:
            mask[row, n:] = 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(ids, attention_mask=mask, position_ids=positions).logits
    states = bert(ids, attention_mask=mask).last_hidden_state
    for row in range(3):
        real = mask[row].bool()
        alone = ids[row, real].unsqueeze(0)
        torch.testing.assert_close(logits[row, real], model(alone).logits[0], rtol=1e-9, atol=1e-9)
        if side == "right":  # BERT's positions are the tensor's: only right padding is "alone"
            want = bert(alone).last_hidden_state[0]
            torch.testing.assert_close(states[row, real], want, rtol=1e-9, atol=1e-9)


def test_cached_generation_equals_uncached_and_each_prompt_alone() -> None:
    model = dilated_hf.use_dilated_attention(_llama(), *SCHEDULE)
    ids = torch.randint(0, VOCAB, (2, 21))
    greedy = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
    cached = model.generate(ids, **greedy)
    assert torch.equal(cached, model.generate(ids, use_cache=False, **greedy))
    assert torch.equal(cached, model.generate(ids, cache_implementation="static", **greedy))
    mask = torch.ones(2, 21, dtype=torch.long)
    mask[1, :8] = 0  # the second prompt is 13 tokens, left-padded
    padded = model.generate(ids, attention_mask=mask, **greedy)
    alone = model.generate(ids[1:, 8:], **greedy)
    assert torch.equal(padded[1, 21:], alone[0, 13:])
    assert torch.equal(padded[0], cached[0])


def test_what_dilated_attention_cannot_run_raises() -> None:
    model = dilated_hf.use_dilated_attention(_llama(), *SCHEDULE)
    ids = torch.randint(0, VOCAB, (2, 12))
    gaps = torch.ones(2, 12, dtype=torch.long)
    gaps[0, 5] = 0
    with pytest.raises(ValueError, match=r"row 0 of the attention mask has gaps"):
        model(ids, attention_mask=gaps)
    offsets = torch.tensor([0, 6, 12, 24], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"packed sequences .* with a padding mask"):
        model(ids, attention_mask=_left_padded(2, 12), cu_seq_lens_q=offsets,
              cu_seq_lens_k=offsets)  # fmt: skip
    with pytest.raises(ValueError, match=r"cu_seq_lens_q and cu_seq_lens_k must both be given"):
        model(ids, cu_seq_lens_q=offsets, cu_seq_lens_k=offsets[[0, 2]])
    with pytest.raises(ValueError, match=r"layer 1's schedule"):
        dilated_hf.use_dilated_attention(_llama(), [[8], [8, 16]], [[1], [1]])
    with pytest.raises(ValueError, match=r"one list per layer: the model has 2 layers"):
        dilated_hf.use_dilated_attention(_llama(), [[8]] * 3, [[1]] * 3)
    one_layer = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa",
    ))  # fmt: skip
    with pytest.raises(ValueError, match=r"the model has 1 layer, got 2 lists of segment_"):
        dilated_hf.use_dilated_attention(one_layer, [[8]] * 2, [[1]] * 2)
    with pytest.raises(TypeError, match=r"transformers PreTrainedModel"):
        dilated_hf.use_dilated_attention(torch.nn.Linear(2, 2), [8], [1])
    with pytest.raises(TypeError, match=r"check_positions must be a bool"):
        dilated_hf.use_dilated_attention(_llama(), *SCHEDULE, check_positions=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"context_parallel must be a ContextParallel"):
        dilated_hf.use_dilated_attention(_llama(), *SCHEDULE, context_parallel=2)  # type: ignore[arg-type]


@pytest.mark.slow
def test_compiles_to_one_graph_without_the_position_check() -> None:
    """With ``check_positions=False`` a Llama-style model compiles to one graph
    (``fullgraph=True``), padded batches included, whose logits equal eager ones at the real
    tokens; the default checks read the position ids and masks, which breaks the graph."""
    model = dilated_hf.use_dilated_attention(_llama().float(), *SCHEDULE, check_positions=False)
    ids = torch.randint(0, VOCAB, (3, 40), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(3, 40, dtype=torch.long)
    mask[1, :9] = 0  # left-padded
    mask[2, 31:] = 0  # right-padded
    padded = {"attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)}
    real = mask.bool()
    for run in ({}, padded):
        torch._dynamo.reset()
        with torch.no_grad():
            eager = model(ids, **run).logits
            explained = torch._dynamo.explain(model)(ids, **run)
            compiled = torch.compile(model, fullgraph=True)(ids, **run).logits
        assert explained.graph_count == 1 and explained.graph_break_count == 0, run.keys()
        torch.testing.assert_close(compiled[real], eager[real], atol=1e-5, rtol=1e-5)
    checked = dilated_hf.use_dilated_attention(_llama().float(), *SCHEDULE)
    with torch.no_grad():
        assert torch._dynamo.explain(checked)(ids).graph_break_count > 0
        assert torch._dynamo.explain(checked)(ids, **padded).graph_break_count > 0
        # fullgraph=True: an error that names the read and the fix, not torch's guard error
        for run in ({}, padded):
            torch._dynamo.reset()
            with pytest.raises(Exception, match=r"dilated attention reads .* on the host.*"
                                                r"check_positions=False"):  # fmt: skip
                torch.compile(checked, fullgraph=True)(ids, **run)
        offsets = torch.tensor([0, 10, 40, 80, 120])
        torch._dynamo.reset()
        with pytest.raises(Exception, match=r"reads cu_seq_lens_q / cu_seq_lens_k on the host"
                                            r".*run packed batches eagerly"):  # fmt: skip
            torch.compile(model, fullgraph=True)(ids, cu_seq_lens_q=offsets, cu_seq_lens_k=offsets)


def test_output_attentions_is_refused() -> None:
    """Dilated attention computes no weights: ``output_attentions=True`` raises instead of
    returning an empty tuple."""
    model = dilated_hf.use_dilated_attention(_llama(), *SCHEDULE)
    with pytest.raises(ValueError, match=r"output_attentions=True: LlamaAttention runs dilated "
                                         r"attention.*attn_implementation='eager'"):  # fmt: skip
        model(torch.randint(0, VOCAB, (1, 12)), output_attentions=True)


def test_a_saved_model_reloads_dilated_by_one_line_and_never_silently_on_sdpa(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``load_dilated_pretrained`` gives the logits of the model before saving; a plain
    ``from_pretrained`` raises transformers' ValueError, whose quote of the saved
    implementation names ``load_dilated_pretrained`` (as in a fresh process: the saved name is
    never registered; it ran SDPA silently before); an explicit ``attn_implementation`` is
    obeyed."""
    model = dilated_hf.use_dilated_attention(
        _llama(), [[8, 16], [64]], [[1, 2], [1]], keep_unsupported_layers=True
    )
    ids = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(4))
    before = model(ids).logits
    model.save_pretrained(tmp_path)
    cls = transformers.LlamaForCausalLM
    loaded = dilated_hf.load_dilated_pretrained(cls, tmp_path, dtype=torch.float64)
    assert torch.equal(loaded(ids).logits, before)
    assert getattr(loaded.config, dilated_hf.KEEP_ATTR) is True
    sdpa = cls.from_pretrained(tmp_path, dtype=torch.float64, attn_implementation="sdpa")
    assert not torch.allclose(sdpa(ids).logits, before)
    load_with = r"load with dilated_attention.integrations.transformers.load_dilated_pretrained"
    with pytest.raises(ValueError, match=load_with):  # transformers' message quotes the name
        cls.from_pretrained(tmp_path)
    for interface in (transformers.AttentionInterface,
                      transformers.masking_utils.AttentionMaskInterface):  # fmt: skip
        monkeypatch.delitem(interface._global_mapping, dilated_hf.NAME)
    with pytest.raises(ValueError, match=load_with):
        cls.from_pretrained(tmp_path)
    with pytest.raises(TypeError, match=r"load_dilated_pretrained sets attn_implementation"):
        dilated_hf.load_dilated_pretrained(cls, tmp_path, attn_implementation="sdpa")
    _llama().save_pretrained(tmp_path / "plain")

    def no_weights(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("weights loaded before the schedule was checked")

    monkeypatch.setattr(cls, "from_pretrained", no_weights)
    with pytest.raises(ValueError, match=r"holds no dilated_segment_lengths"):
        dilated_hf.load_dilated_pretrained(cls, tmp_path / "plain")


def test_a_model_built_from_the_same_config_stays_as_it_was() -> None:
    """``use_dilated_attention`` gives the model its own config copy: another model built from
    the same config object, before or after, keeps its attention (SDPA), and the config holds
    no schedule."""
    config = _llama().config

    def build() -> Any:
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).double().eval()

    before = build()
    dilated = dilated_hf.use_dilated_attention(build(), *SCHEDULE)
    after = build()
    ids = torch.randint(0, VOCAB, (1, 30))
    for other in (before, after):
        assert other.config is config
        assert other.config._attn_implementation == "sdpa"
        assert not hasattr(config, dilated_hf.SEGMENTS_ATTR)
        assert not torch.allclose(other(ids).logits, dilated(ids).logits)
    assert dilated.config is not config and dilated.model.config is dilated.config
    reference = _llama()
    torch.testing.assert_close(before(ids).logits, reference(ids).logits, rtol=0, atol=0)
    torch.testing.assert_close(after(ids).logits, reference(ids).logits, rtol=0, atol=0)


def test_per_layer_schedules_are_read_at_each_layer() -> None:
    """A per-layer schedule equal in every layer is the uniform one; mixed, it differs from
    either of its layers' schedules used everywhere."""
    base = _llama()
    ids = torch.randint(0, VOCAB, (1, 30))

    def logits(segments: Any, rates: Any) -> torch.Tensor:
        model = dilated_hf.use_dilated_attention(_twin(base, _llama), segments, rates)
        return model(ids).logits

    assert torch.equal(logits([[8, 16]] * 2, [[1, 2]] * 2), logits([8, 16], [1, 2]))
    mixed = logits([[64], [8, 16]], [[1], [1, 2]])
    assert not torch.allclose(mixed, logits([64], [1]))
    assert not torch.allclose(mixed, logits([8, 16], [1, 2]))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_the_attention_function_on_padded_rows_matches_the_oracle_with_gradients(
    causal: bool,
) -> None:
    """``attention_forward`` itself, on transformers' (B, H, N, D) layout with a left- and a
    right-padded row: each row's real positions equal the float64 oracle on that row's tokens
    alone, outputs and the gradients of q, k and v; padded positions give zeros and no
    gradient."""
    config = type("Config", (), {dilated_hf.SEGMENTS_ATTR: [8, 16], dilated_hf.RATES_ATTR: [1, 2]})
    module = type("Attention", (), {"config": config(), "is_causal": causal})()
    gen = torch.Generator().manual_seed(7)
    n, heads, kv_heads, dim = 30, 4, 2, 8
    q = torch.randn(2, heads, n, dim, generator=gen, dtype=torch.float64).requires_grad_()
    k, v = (torch.randn(2, kv_heads, n, dim, generator=gen, dtype=torch.float64).requires_grad_()
            for _ in "kv")  # fmt: skip
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[0, :7] = False  # left-padded
    mask[1, 23:] = False  # right-padded
    out, _ = dilated_hf.attention_forward(module, q, k, v, mask)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for row in range(2):
        real = mask[row]
        pick = [x[row : row + 1, :, real].detach().transpose(1, 2).requires_grad_()
                for x in (q, k, v)]  # fmt: skip
        group = heads // kv_heads
        ref, _ = oracle_dilated_attention(
            pick[0], *(x.repeat_interleave(group, dim=2) for x in pick[1:]), *SCHEDULE,
            is_causal=causal,
        )  # fmt: skip
        ref_grads = torch.autograd.grad(ref, pick, dout[row : row + 1, real])
        torch.testing.assert_close(out[row, real], ref[0].detach(), rtol=1e-9, atol=1e-9)
        assert bool((out[row, ~real] == 0).all())
        for got, want in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(got[row, :, real], want[0].transpose(0, 1))
            assert bool((got[row, :, ~real] == 0).all())


def _left_padded(batch: int, n: int) -> torch.Tensor:
    mask = torch.ones(batch, n, dtype=torch.long)
    mask[:, :2] = 0
    return mask


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
def test_a_flattened_batch_gives_each_sequence_its_own_losses(flash_kwargs: bool) -> None:
    """DataCollatorWithFlattening packs sequences into one row (position ids restarting, or
    FlashAttention's cu_seq_lens): every token's logits and loss, and every gradient, equal
    those of the sequences run one per row."""
    model = dilated_hf.use_dilated_attention(_llama(), *SCHEDULE)
    gen = torch.Generator().manual_seed(5)
    sequences = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 21, 1, 13)]
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    batch = collate([{"input_ids": ids} for ids in sequences])
    packed = model(**batch)
    loss = torch.nn.functional.cross_entropy(
        packed.logits[0, :-1], batch["labels"][0, 1:], ignore_index=-100, reduction="sum"
    )
    alone_logits, alone_loss = [], torch.zeros((), dtype=torch.float64)
    for ids in sequences:
        logits = model(input_ids=torch.tensor([ids])).logits[0]
        alone_logits.append(logits)
        target = torch.tensor(ids[1:], dtype=torch.long)
        alone_loss = alone_loss + torch.nn.functional.cross_entropy(
            logits[:-1], target, reduction="sum"
        )
    torch.testing.assert_close(packed.logits[0], torch.cat(alone_logits), atol=1e-10, rtol=1e-8)
    torch.testing.assert_close(loss, alone_loss, atol=1e-10, rtol=1e-8)
    # A mask that hides nothing leaves the packing as it is.
    unmasked = model(**batch, attention_mask=torch.ones_like(batch["input_ids"])).logits
    torch.testing.assert_close(unmasked, packed.logits, atol=1e-12, rtol=1e-10)
    params = [p for p in model.parameters() if p.requires_grad]
    got = torch.autograd.grad(loss, params, allow_unused=True)
    want = torch.autograd.grad(alone_loss, params, allow_unused=True)
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        if g is not None:
            torch.testing.assert_close(g, w, atol=1e-10, rtol=1e-8)


@pytest.mark.slow
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
def test_static_cache_decoding_compiles_to_one_graph_for_every_token(padded: bool) -> None:
    """A static cache's decoding step under ``torch.compile(fullgraph=True)``: the attention
    runs the static decode step from the position ids and the padding mask (Note [Decoding
    with transformers' caches]), so one graph serves every token, with the tokens of eager
    generation, a left-padded row included."""
    model = dilated_hf.use_dilated_attention(_llama().float(), *SCHEDULE)
    ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 11, dtype=torch.long)
    if padded:
        mask[1, :4] = 0
    want = model.generate(ids, attention_mask=mask, max_new_tokens=20, min_new_tokens=20,
                          do_sample=False, pad_token_id=0)  # fmt: skip
    cache = transformers.StaticCache(config=model.config, max_cache_len=48)
    compiles = []

    def counting_backend(gm: Any, example_inputs: Any) -> Any:
        compiles.append(gm)
        return gm.forward

    def step(
        token: torch.Tensor, position: torch.Tensor, slot: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        run = {"attention_mask": slots} if padded else {}
        return model(token, past_key_values=cache, position_ids=position, cache_position=slot,
                     use_cache=True, **run).logits  # fmt: skip

    compiled = torch.compile(step, fullgraph=True, backend=counting_backend)
    torch._dynamo.reset()
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    slots = torch.cat([mask, torch.zeros(2, 48 - 11, dtype=torch.long)], dim=1)
    with torch.no_grad():
        prompt = {"attention_mask": mask} if padded else {}
        logits = model(ids, past_key_values=cache, use_cache=True, position_ids=positions,
                       **prompt).logits  # fmt: skip
        tokens = [logits[:, -1:].argmax(-1)]
        for i in range(19):
            slots[:, 11 + i] = 1
            position = positions[:, -1:] + 1 + i
            slot = torch.tensor([11 + i])
            tokens.append(compiled(tokens[-1], position, slot, slots)[:, -1:].argmax(-1))
    assert torch.equal(torch.cat([ids, *tokens], dim=1), want)
    assert len(compiles) == 1
