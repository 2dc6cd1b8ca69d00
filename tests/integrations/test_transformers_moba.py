"""MoBA in a transformers model's global layers (``use_dilated_attention(model,
sparse=BlockSelectedConfig(...))``, Note [MoBA in a pretrained model] in
``integrations/_transformers_layer.py``): a tiny Llama (GQA, rotary) built from a config, in
float64. Its logits and parameter gradients equal the same model whose every layer calls
``moba_attention`` directly on that layer's q, k, v; with ``topk`` covering every block they
equal the stock SDPA model (dense causal attention); a Gemma 2's local layer keeps its window
beside a MoBA layer; and what MoBA cannot compute exactly is refused before any work. Skipped
where transformers is not installed."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from support.oracle import oracle_attention  # noqa: E402

from dilated_attention.config import (  # noqa: E402
    BlockSelectedConfig,
    CompressedSelectedWindowConfig,
)
from dilated_attention.integrations import transformers as dilated_hf  # noqa: E402
from dilated_attention.sparse import moba_attention  # noqa: E402

VOCAB = 97
MOBA = BlockSelectedConfig(block_size=4, topk=1)
TIGHT = {"rtol": 1e-10, "atol": 1e-10}


def _llama(**overrides: Any) -> Any:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        attn_implementation="sdpa", **overrides,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double().eval()


def _twin(model: Any) -> Any:
    """A second tiny Llama with ``model``'s weights, on SDPA."""
    other = _llama()
    other.load_state_dict(model.state_dict())
    return other


def _moba_reference(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: Any, scaling: float | None = None,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
    """Each global layer's attention: ``moba_attention`` called directly on its (B, N, H, D) q,
    k, v; a local layer's: the float64 oracle of its window; both with the call's soft-cap and
    sinks."""
    assert attention_mask is None or bool(attention_mask.all())
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    extra = {"scale": scaling, "softcap": kwargs.get("softcap"), "sinks": kwargs.get("s_aux")}
    window = kwargs.get("sliding_window")
    if window is not None:
        local = oracle_attention(q, k, v, window_size=(window - 1, 0), is_causal=True, **extra)
        return local[0], None
    out = moba_attention(q, k, v, block_size=MOBA.block_size, topk=MOBA.topk, **extra)
    return out, None


def _logits_and_grads(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    logits = model(ids).logits
    weights = torch.linspace(-1, 1, logits.numel(), dtype=logits.dtype).view_as(logits)
    (logits * weights).sum().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()]


def test_global_layers_run_moba_on_their_own_q_k_v_with_gradients() -> None:
    transformers.AttentionInterface.register("moba_reference", _moba_reference)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    moba = dilated_hf.use_dilated_attention(_llama(), sparse=MOBA)
    reference = _twin(moba)
    reference.set_attn_implementation("moba_reference")
    got, got_grads = _logits_and_grads(moba, ids)
    want, want_grads = _logits_and_grads(reference, ids)
    torch.testing.assert_close(got, want, **TIGHT)
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got_grad, want_grad, **TIGHT)
    dense = _twin(moba)(ids).logits
    assert not torch.allclose(got, dense, atol=1e-6)  # 4 blocks, at most 2 kept: sparse


def _gemma2() -> Any:
    """Layer 0 within a 6-token sliding window, layer 1 global; soft-capped scores in both."""
    config = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=6,
        attn_logit_softcapping=2.0, final_logit_softcapping=None, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Gemma2ForCausalLM(config).double().eval()


def _gpt_oss() -> Any:
    """Layer 0 within a 6-token sliding window, layer 1 global; sinks in both."""
    config = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
        num_experts_per_tok=1, sliding_window=6, experts_implementation="eager",
        attn_implementation="eager", rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).double().eval()
    with torch.no_grad():
        for block in model.model.layers:
            block.self_attn.sinks.normal_(0.0, 2.0)
    return model


@pytest.mark.parametrize("build", [_gemma2, _gpt_oss], ids=["gemma2", "gpt_oss"])
def test_local_layers_keep_their_window_and_moba_takes_the_softcap_and_sinks(build: Any) -> None:
    """Logits and gradients (the sinks' included) equal the reference's: MoBA in the global
    layer, the window's oracle in the local one, both with the model's soft-cap or sinks; with
    every block kept, the model's own eager attention (within Gemma 2's float32 softmax)."""
    transformers.AttentionInterface.register("moba_reference", _moba_reference)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))
    moba = dilated_hf.use_dilated_attention(build(), sparse=MOBA)
    reference = build()
    reference.load_state_dict(moba.state_dict())
    reference.set_attn_implementation("moba_reference")
    got, got_grads = _logits_and_grads(moba, ids)
    want, want_grads = _logits_and_grads(reference, ids)
    torch.testing.assert_close(got, want, **TIGHT)
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got_grad, want_grad, **TIGHT)
    every = BlockSelectedConfig(block_size=4, topk=3)  # 4 blocks: all kept
    every = dilated_hf.use_dilated_attention(build(), sparse=every)
    eager = build()  # Gemma 2's eager softmax runs in float32
    torch.testing.assert_close(every(ids).logits, eager(ids).logits, rtol=1e-5, atol=1e-6)
    assert (got - eager(ids).logits).abs().max() > 1e-3  # 4 blocks, at most 2 kept: sparse


def _context_parallel(rank: int, world: int) -> None:
    """Each rank's logits are its shard of the one-process MoBA model's, and the parameter
    gradients (sinks included) summed over the ranks are the one-process ones: Llama over the
    world's process group, Gemma 2 (soft-capped scores, a local window beside MoBA) and gpt-oss
    (sinks) over a ContextParallel's ring. Shards that are not whole blocks raise on every
    rank; a head all-to-all is refused."""
    import torch.distributed as dist
    from support.distributed_utils import raises_on_rank

    from dilated_attention.distributed import ContextParallel, sequence_positions, shard_sequence

    ids = torch.randint(0, VOCAB, (2, 8 * world), generator=torch.Generator().manual_seed(4))
    positions = sequence_positions(8)[None]
    ring = ContextParallel(ring=dist.group.WORLD)
    for build, cp in ((_llama, dist.group.WORLD), (_gemma2, ring), (_gpt_oss, ring)):
        single = dilated_hf.use_dilated_attention(build(), sparse=MOBA)
        want = single(ids).logits
        want_grads = torch.autograd.grad(want.square().sum(), list(single.parameters()))
        model = build()
        model.load_state_dict(single.state_dict())
        dilated_hf.use_dilated_attention(model, sparse=MOBA, context_parallel=cp)
        logits = model(shard_sequence(ids), position_ids=positions).logits
        name = build.__name__
        torch.testing.assert_close(logits, shard_sequence(want).detach(), **TIGHT, msg=name)
        grads = torch.autograd.grad(logits.square().sum(), list(model.parameters()))
        for (param, _), got, expected in zip(model.named_parameters(), grads, want_grads,
                                             strict=True):  # fmt: skip
            total = got.clone()
            dist.all_reduce(total)
            close = TIGHT
            if build is _gemma2:  # its RMSNorm runs in float32: shares summed in another order
                close = {"rtol": 0.0, "atol": 1e-6 * float(expected.abs().max())}
            torch.testing.assert_close(total, expected, **close, msg=f"{name} {param}")
    with raises_on_rank("shards not whole blocks", r"whole blocks", within_s=10):
        model(shard_sequence(ids)[:, :6], position_ids=positions[:, :6])
    with raises_on_rank("a head all-to-all", r"no head all-to-all"):
        dilated_hf.use_dilated_attention(
            _llama(), sparse=MOBA, context_parallel=ContextParallel(heads=dist.group.WORLD)
        )


@pytest.mark.distributed
def test_moba_runs_context_parallel(tmp_path: Any) -> None:
    from support.distributed_utils import run_world

    run_world(_context_parallel, 2, tmp_path, timeout_s=60)


def test_topk_covering_every_block_is_the_dense_causal_model() -> None:
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    every = BlockSelectedConfig(block_size=4, topk=3)  # 4 blocks: all kept
    moba = dilated_hf.use_dilated_attention(_llama(), sparse=every)
    sdpa = _twin(moba)
    got, got_grads = _logits_and_grads(moba, ids)
    want, want_grads = _logits_and_grads(sdpa, ids)
    torch.testing.assert_close(got, want, **TIGHT)
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got_grad, want_grad, **TIGHT)


def test_a_saved_moba_model_reloads_with_its_settings(tmp_path: Any) -> None:
    model = dilated_hf.use_dilated_attention(_llama(), sparse=MOBA)
    ids = torch.randint(0, VOCAB, (1, 13), generator=torch.Generator().manual_seed(2))
    before = model(ids).logits
    model.save_pretrained(tmp_path)
    cls = transformers.LlamaForCausalLM
    loaded = dilated_hf.load_dilated_pretrained(cls, tmp_path, dtype=torch.float64)
    assert getattr(loaded.config, dilated_hf.SELECTED_ATTR) == MOBA.kwargs()
    assert torch.equal(loaded(ids).logits, before)
    # a dilated schedule set afterwards replaces MoBA
    dilated_hf.use_dilated_attention(loaded, [64], [1])
    torch.testing.assert_close(loaded(ids).logits, _twin(model)(ids).logits, **TIGHT)


def test_what_moba_cannot_run_in_a_pretrained_model_is_refused_before_any_change() -> None:
    model = _llama()
    cases = [
        (dict(sparse=CompressedSelectedWindowConfig()), ValueError, r"NSA.*gate projections"),
        (dict(sparse=MOBA, segment_lengths=[8], dilation_rates=[1]), ValueError,
         r"a dilated schedule as well"),
        (dict(sparse=BlockSelectedConfig(block_size=4, topk=1, scale=0.5)), ValueError,
         r"scale=0.5: the layers keep the model's own softmax scale"),
        (dict(sparse={"block_size": 4}), TypeError, r"sparse must be a .*BlockSelectedConfig"),
        ({}, ValueError, r"needs segment_lengths and dilation_rates .* or sparse="),
    ]  # fmt: skip
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            dilated_hf.use_dilated_attention(model, **kwargs)
    assert model.config._attn_implementation == "sdpa"
    bart = transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=16,
        decoder_ffn_dim=16, max_position_embeddings=32,
    ))  # fmt: skip
    with pytest.raises(ValueError, match=r"encoder-decoder model \(BartForConditionalGeneration"):
        dilated_hf.use_dilated_attention(bart, sparse=MOBA)


def test_calls_moba_cannot_compute_exactly_raise_naming_the_layer_and_the_fix() -> None:
    model = dilated_hf.use_dilated_attention(_llama(), sparse=MOBA)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    padded = torch.ones(2, 12, dtype=torch.long)
    padded[1, :3] = 0
    with pytest.raises(ValueError, match=r"LlamaAttention \(layer 0\) runs MoBA.*padding mask"):
        model(ids, attention_mask=padded)
    packed = torch.cat([torch.arange(8), torch.arange(4)])[None].expand(2, -1)
    with pytest.raises(ValueError, match=r"layer 0\) runs MoBA.*packed sequences"):
        model(ids, position_ids=packed)
    with pytest.raises(ValueError, match=r"1 queries after a cache of 13 keys.*use_cache=False"):
        model.generate(ids, max_new_tokens=2, do_sample=False)
    out = model.generate(ids, max_new_tokens=2, do_sample=False, use_cache=False)
    assert out.shape == (2, 14)
    layer = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 8, 8, dtype=torch.float64)
    kv = torch.randn(1, 2, 8, 8, dtype=torch.float64)
    refused = [
        ({"is_causal": False}, r"non-causal \(an encoder's\)"),
        ({"dropout": 0.1}, r"no attention dropout, got dropout=0.1"),
    ]
    for kwargs, match in refused:
        with pytest.raises(ValueError, match=r"LlamaAttention \(layer 0\).*" + match):
            dilated_hf.attention_forward(layer, q, kv, kv, None, **kwargs)
