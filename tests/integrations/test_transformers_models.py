"""Models whose attention calls carry more than a padding mask (``integrations/transformers.py``,
``_transformers_masks.py``): context parallel chunked and local layers with sinks, compiled
decoding with chunks, windows, soft-capping and sinks, static caches in models whose attention
gets no position ids (Llama 4, Whisper's decoder), and Llama 4 rows packed by restarting
position ids. Tiny models built from configs, in float64.

A one-branch schedule longer than every input is dense attention, so every model equals its
stock self (SDPA, or eager where it has none) within float64 rounding. Skipped where
transformers is not installed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.hf_models import seeded, tiny_whisper

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


def _gpt_oss() -> Any:
    """Layer 0 within an 8-token sliding window, layer 1 full; sinks in both."""
    config = transformers.GptOssConfig(
        **SIZES, intermediate_size=32, num_experts_per_tok=1, sliding_window=8,
        attn_implementation="eager", rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    )  # fmt: skip
    model = seeded(transformers.GptOssForCausalLM, config)
    with torch.no_grad():  # sinks that matter
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    return model


def _gemma2() -> Any:
    """Layer 0 within an 8-token sliding window, layer 1 full; soft-capped scores in both."""
    config = transformers.Gemma2Config(
        **{k: v for k, v in SIZES.items() if "expert" not in k}, intermediate_size=64,
        sliding_window=8, attn_logit_softcapping=2.0, attn_implementation="eager",
    )  # fmt: skip
    return seeded(transformers.Gemma2ForCausalLM, config)


def _llama4(chunk: int = 8, types: list[str] | None = None) -> Any:
    """Layer 0 chunked (``chunk`` tokens), layer 1 full, unless ``types`` says otherwise."""
    config = transformers.Llama4TextConfig(
        **SIZES, intermediate_size=64, intermediate_size_mlp=64, attention_chunk_size=chunk,
        no_rope_layer_interval=2, layer_types=types, attn_implementation="sdpa",
    )  # fmt: skip
    return seeded(transformers.Llama4ForCausalLM, config)


def _whisper() -> Any:
    return tiny_whisper(VOCAB)


def _llama() -> Any:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        attn_implementation="sdpa",
    )  # fmt: skip
    return seeded(transformers.LlamaForCausalLM, config)


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


# -- context parallel ------------------------------------------------------------------------------
def _context_parallel(rank: int, world: int) -> None:
    """Llama 4's chunked layer (chunks of 8 over 24 tokens) runs on the ring as the branch
    (8, 1), gpt-oss's local layer (a window of 8) as a windowed ring, both its layers with their
    sinks: each rank's logits are its shard of the one-process logits, and the parameter
    gradients (the sinks' included), summed over ranks, equal the one-process ones."""
    import torch.distributed as dist

    from dilated_attention.distributed import ContextParallel, sequence_positions, shard_sequence

    cp = ContextParallel(ring=dist.group.WORLD)
    positions = sequence_positions(12, group=cp)
    ids = _ids(2, 12 * world)
    for build in (_llama4, _gpt_oss):
        single = _twin(build(), build)
        want = single(ids).logits
        want_grads = torch.autograd.grad(want.square().sum(), list(single.parameters()))
        model = _twin(single, build, context_parallel=cp)
        logits = model(shard_sequence(ids, group=cp), position_ids=positions[None]).logits
        torch.testing.assert_close(logits, want[:, positions].detach(), **TIGHT)
        grads = torch.autograd.grad(logits.square().sum(), list(model.parameters()))
        for (name, _), got, expected in zip(model.named_parameters(), grads, want_grads,
                                            strict=True):  # fmt: skip
            total = got.clone()
            dist.all_reduce(total)
            torch.testing.assert_close(total, expected, **TIGHT, msg=name)


def test_context_parallel_runs_chunks_windows_and_sinks(tmp_path: Any) -> None:
    from support.distributed_utils import run_world

    run_world(_context_parallel, 2, tmp_path)


# -- compiled decoding with windows, sinks and chunks ---------------------------------------------
def _static_decode(model: Any, step: Any, cache: Any, new: int = 13) -> torch.Tensor:
    """Greedy decoding of a left-padded 11-token batch, one token per ``step(cache, token,
    position, slots)`` after an eager prompt."""
    ids, mask = _ids(2, 11, seed=4), _left_padded(2, 11, 4)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    slots = torch.cat([mask, torch.zeros(2, 48 - 11, dtype=torch.long)], dim=1)
    logits = model(ids, cache=cache, position_ids=positions, attention_mask=mask).logits
    tokens = [logits[:, -1:].argmax(-1)]
    for i in range(new):
        slots[:, 11 + i] = 1
        seen = slots if isinstance(cache, transformers.StaticCache) else slots[:, : 12 + i]
        logits = step(cache, tokens[-1], positions[:, -1:] + 1 + i, seen)
        tokens.append(logits[:, -1:].argmax(-1))
    return torch.cat(tokens, dim=1)


def _stepper(model: Any) -> Any:
    """One decoding step of ``model``: ``step(cache, token, position, slots) -> logits``."""

    def step(cache: Any, token: torch.Tensor, position: Any, slots: torch.Tensor) -> Any:
        return model(token, cache=cache, position_ids=position, attention_mask=slots).logits

    return step


@pytest.mark.slow
def test_compiled_static_decoding_with_chunks_windows_and_sinks() -> None:
    """Under ``torch.compile`` Llama 4's chunked layer (chunks of 8, a static sliding cache
    that drops keys) stays in the graph (``fullgraph=True``: the static decode step, Note
    [Chunks after a cache]); gpt-oss's windows and sinks run eagerly between graphs (Note [What
    each layer computes]), and ``fullgraph=True`` raises naming what breaks the graph and the
    fix. The tokens equal eager decoding with a dynamic cache."""
    for build, fullgraph, new in ((_llama4, True, 13), (_gemma2, False, 4)):
        model = _twin(build(), build)
        torch._dynamo.reset()
        compiled = torch.compile(_stepper(model), fullgraph=fullgraph, backend="eager")
        with torch.no_grad():
            dynamic = transformers.DynamicCache(config=model.config)
            want = _static_decode(model, _stepper(model), dynamic, new)
            static = transformers.StaticCache(config=model.config, max_cache_len=48)
            assert torch.equal(_static_decode(model, compiled, static, new), want), build.__name__
    torch._dynamo.reset()
    static = transformers.StaticCache(config=model.config, max_cache_len=48)
    eager = r"local window, soft-capped scores, attention sinks or MoBA eagerly under torch.compile"
    fix = r".*compile without fullgraph=True"
    with torch.no_grad(), pytest.raises(Exception, match=eager + fix):
        step = torch.compile(_stepper(model), fullgraph=True, backend="eager")
        _static_decode(model, step, static, new=1)


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
