"""The hybrid families on this library (``integrations/_transformers_layer.py``): Mistral (a
32-token window on 128 tokens), Qwen2 (a global and a local layer), Gemma 2 (soft-capped scores,
local and global layers), Gemma 3 (local and global layers), gpt-oss (local and global layers,
attention sinks) and Llama 4 (32-token chunks), tiny models built from their configs, in float32.

With a dense schedule (one branch longer than every input) every layer computes exactly what
the model's eager attention computes: logits, every parameter's gradient (the sinks' included),
padded batches, packed batches, calls after a cache and greedy generation with dynamic and
static caches, with no ``keep_unsupported_layers``: a spy sees every layer reach the library
with its window, chunk, soft-cap and sinks. Skipped where transformers is not installed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dilated_attention.integrations import _transformers_layer as layer_module  # noqa: E402
from dilated_attention.integrations import transformers as dilated_hf  # noqa: E402

VOCAB = 128
DENSE = ([256], [1])  # one branch longer than every input: dense attention
LOGITS = {"rtol": 1e-4, "atol": 1e-4}
GRADS = {"rtol": 1e-3, "atol": 1e-5}
SIZES = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
    attn_implementation="eager",
)  # fmt: skip


def _mistral() -> Any:
    return transformers.MistralForCausalLM(transformers.MistralConfig(**SIZES, sliding_window=32))


def _qwen2() -> Any:
    """Layer 0 global, layer 1 within a 32-token window."""
    config = transformers.Qwen2Config(
        **SIZES, use_sliding_window=True, sliding_window=32, max_window_layers=1,
        layer_types=["full_attention", "sliding_attention"],
    )  # fmt: skip
    return transformers.Qwen2ForCausalLM(config)


def _gemma2() -> Any:
    config = transformers.Gemma2Config(
        **SIZES, sliding_window=32, attn_logit_softcapping=2.0, final_logit_softcapping=None
    )
    return transformers.Gemma2ForCausalLM(config)


def _gemma3() -> Any:
    config = transformers.Gemma3TextConfig(
        **{**SIZES, "num_hidden_layers": 3}, sliding_window=32,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )  # fmt: skip
    return transformers.Gemma3ForCausalLM(config)


def _gpt_oss() -> Any:
    config = transformers.GptOssConfig(
        **SIZES, num_local_experts=2, num_experts_per_tok=1, sliding_window=32,
        experts_implementation="eager",
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    )  # fmt: skip
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():  # sinks that matter
        for block in model.model.layers:
            block.self_attn.sinks.normal_(0.0, 2.0)
    return model


def _llama4() -> Any:
    config = transformers.Llama4TextConfig(
        **SIZES, intermediate_size_mlp=64, num_local_experts=2, attention_chunk_size=32,
        no_rope_layer_interval=2,
    )  # fmt: skip
    return transformers.Llama4ForCausalLM(config)


LOCAL, GLOBAL = ((31, 0), None, None, False), (None, None, None, False)
#: Each family and what its layers pass the library: window_size, the chunk, softcap, sinks.
FAMILIES: dict[str, tuple[Callable[[], Any], list[tuple[Any, ...]]]] = {
    "mistral": (_mistral, [LOCAL, LOCAL]),
    "qwen2": (_qwen2, [GLOBAL, LOCAL]),
    "gemma2": (_gemma2, [((31, 0), None, 2.0, False), (None, None, 2.0, False)]),
    "gemma3": (_gemma3, [LOCAL, GLOBAL, LOCAL]),
    "gpt_oss": (_gpt_oss, [((31, 0), None, None, True), (None, None, None, True)]),
    "llama4": (_llama4, [(None, 32, None, False), GLOBAL]),
}


def _pair(family: str) -> tuple[Any, Any]:
    """The family's eager model and its twin on this library (the same weights)."""
    build = FAMILIES[family][0]
    torch.manual_seed(0)
    eager = build().float().eval()
    torch.manual_seed(0)
    twin = build().float().eval()
    twin.load_state_dict(eager.state_dict())
    return eager, dilated_hf.use_dilated_attention(twin, *DENSE)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """What each library call of the integration's layers received: (window_size, chunk,
    softcap, sinks given)."""
    seen: list[tuple[Any, ...]] = []

    def spying(function: Any, dilated: bool) -> Any:
        def spy(q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> Any:
            chunk = args[0][0] if dilated and args[0] != DENSE[0] else None
            window = kwargs.get("window_size")
            seen.append((window, chunk, kwargs.get("softcap"), kwargs.get("sinks") is not None))
            return function(q, k, v, *args, **kwargs)

        return spy

    monkeypatch.setattr(layer_module, "attention", spying(layer_module.attention, False))
    monkeypatch.setattr(
        layer_module, "dilated_attention", spying(layer_module.dilated_attention, True)
    )
    return seen


def _ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_every_gradient_equal_eager(family: str, calls: list[Any]) -> None:
    """128 tokens (windows and chunks of 32): logits and every parameter's gradient equal the
    eager model's; every layer reached the library with its window, chunk, soft-cap and sinks;
    a left-padded batch gives the eager logits at every real token."""
    eager, dilated = _pair(family)
    ids = _ids(2, 128)
    got, want = dilated(ids).logits, eager(ids).logits
    assert calls == FAMILIES[family][1]
    torch.testing.assert_close(got, want, **LOGITS)
    got.square().mean().backward()
    want.square().mean().backward()
    for (name, mine), theirs in zip(dilated.named_parameters(), eager.parameters(), strict=True):
        assert mine.grad is not None and theirs.grad is not None, name
        torch.testing.assert_close(mine.grad, theirs.grad, **GRADS, msg=name)
        if "sinks" in name:
            assert bool(mine.grad.abs().min() > 0), name
    mask = torch.ones(2, 128, dtype=torch.long)
    mask[1, :37] = 0
    real = mask.bool()
    with torch.no_grad():
        got, want = dilated(ids, attention_mask=mask).logits, eager(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[real], want[real], **LOGITS)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_tokens_equal_eager_with_dynamic_and_static_caches(family: str) -> None:
    """A left-padded batch of 16-token prompts and 24 new tokens: the windows and chunks are
    crossed, and the sliding caches drop keys; the tokens equal the eager model's."""
    eager, dilated = _pair(family)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :5] = 0
    run = {"attention_mask": mask, "max_new_tokens": 24, "do_sample": False, "pad_token_id": 0}
    ids = _ids(2, 16, seed=2)
    with torch.no_grad():
        want = eager.generate(ids, **run)
        assert torch.equal(dilated.generate(ids, **run), want)
        assert torch.equal(dilated.generate(ids, cache_implementation="static", **run), want)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_calls_after_a_cache_equal_eager(family: str, cache: str) -> None:
    """A left-padded prompt fed in calls of 20, 30 and 25 tokens: later calls cross window and
    chunk boundaries over keys a sliding cache dropped (Note [Chunks after a cache]); each
    call's logits equal the eager model's at every real token."""
    eager, dilated = _pair(family)
    ids = _ids(2, 75, seed=3)
    mask = torch.ones(2, 75, dtype=torch.long)
    mask[0, :9] = 0
    caches = []
    for model in (eager, dilated):
        if cache == "static":
            caches.append(transformers.StaticCache(config=model.config, max_cache_len=96))
        else:
            caches.append(transformers.DynamicCache(config=model.config))
    with torch.no_grad():
        for lo, hi in ((0, 20), (20, 50), (50, 75)):
            out = [
                model(ids[:, lo:hi], attention_mask=mask[:, :hi], cache=held, use_cache=True,
                      position_ids=(mask.cumsum(1) - 1).clamp(min=0)[:, lo:hi]).logits
                for model, held in zip((eager, dilated), caches, strict=True)
            ]  # fmt: skip
            real = mask[:, lo:hi].bool()
            torch.testing.assert_close(out[1][real], out[0][real], **LOGITS)


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_rows_equal_each_sequence_alone(family: str, flash_kwargs: bool) -> None:
    """DataCollatorWithFlattening packs sequences of 40, 70, 1 and 45 tokens into one row: each
    sequence's logits equal the eager model's on it alone (its window, chunks and segments from
    its own first token), and so do the gradients of the summed squares."""
    eager, dilated = _pair(family)
    sequences = [_ids(1, n, seed=n)[0].tolist() for n in (40, 70, 1, 45)]
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    batch = collate([{"input_ids": ids} for ids in sequences])
    got = dilated(**batch, use_cache=False).logits
    want = torch.cat([eager(torch.tensor([ids])).logits for ids in sequences], dim=1)
    torch.testing.assert_close(got, want, **LOGITS)
    got.square().mean().backward()
    want.square().mean().backward()
    for (name, mine), theirs in zip(dilated.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, **GRADS, msg=name)
