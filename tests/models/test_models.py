"""LongNet language model: causality, training, checkpoints, rotary positions, bad input."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F

from dilated_attention.models import LongNetConfig, LongNetLM, RotaryEmbedding

# Segments (8, 16) with rates (1, 2) over 37 tokens: the last segment of each branch is partial.
SMALL = {
    "vocab_size": 61,
    "embed_dim": 32,
    "num_heads": 4,
    "num_layers": 2,
    "segment_lengths": (8, 16),
    "dilation_rates": (1, 2),
    "ffn_dim": 64,
}


def small_model(seed: int = 0, **overrides: object) -> LongNetLM:
    torch.manual_seed(seed)
    return LongNetLM(LongNetConfig(**{**SMALL, **overrides}))


def lm_loss(model: LongNetLM, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def test_causal_partial_segments() -> None:
    model = small_model().double().eval()
    gen = torch.Generator().manual_seed(1)
    a = torch.randint(0, 61, (2, 37), generator=gen)
    b = a.clone()
    b[:, 20:] = torch.randint(0, 61, (2, 17), generator=gen)
    la, lb = model(a), model(b)
    assert la.shape == (2, 37, 61) and la.dtype == torch.float64
    torch.testing.assert_close(la[:, :20], lb[:, :20], atol=1e-10, rtol=0)
    assert (la[:, 20:] - lb[:, 20:]).abs().max() > 1e-3  # the future does change the future


def test_loss_falls_on_fixed_batch() -> None:
    torch.manual_seed(0)
    cfg = LongNetConfig.from_preset("tiny", num_layers=1)
    model = LongNetLM(cfg)
    tokens = torch.randint(0, 256, (4, 129))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        loss = lm_loss(model, tokens)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]


def test_state_dict_and_checkpoint_round_trip(tmp_path) -> None:
    model = small_model(seed=0).eval()
    tokens = torch.randint(0, 61, (2, 23))
    expected = model(tokens)
    other = small_model(seed=1).eval()
    assert not torch.equal(other(tokens), expected)
    other.load_state_dict(model.state_dict())
    assert torch.equal(other(tokens), expected)

    path = tmp_path / "ckpt.pt"
    torch.save({"config": dataclasses.asdict(model.config), "model": model.state_dict()}, path)
    ckpt = torch.load(path, weights_only=True)
    restored = LongNetLM(LongNetConfig(**ckpt["config"])).eval()
    restored.load_state_dict(ckpt["model"])
    assert restored.config == model.config
    assert torch.equal(restored(tokens), expected)


def test_parameter_names_and_tied_head() -> None:
    model = small_model()
    names = set(model.state_dict())
    for part in ("q_proj", "k_proj", "v_proj", "out_proj", "norm"):
        assert f"blocks.0.attn.mha.{part}.weight" in names
    assert model.lm_head.weight is model.embed.weight
    untied = small_model(tie_embeddings=False)
    assert untied.num_parameters() == model.num_parameters() + 61 * 32


def test_rotary_relative_position() -> None:
    rope = RotaryEmbedding(16).double()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 1, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 1, 1, 16, generator=gen, dtype=torch.float64)

    def score(m: int, n: int) -> torch.Tensor:
        qm = rope(q, torch.tensor([m]))
        kn = rope(k, torch.tensor([n]))
        return (qm * kn).sum()

    for delta in (0, 3, 17):
        ref = score(delta, 0)
        for shift in (5, 1000, 123456):
            torch.testing.assert_close(score(shift + delta, shift), ref, atol=1e-9, rtol=0)
    assert not torch.allclose(score(3, 0), score(4, 0))
    # Rotation preserves norms.
    x = torch.randn(2, 9, 3, 16, generator=gen, dtype=torch.float64)
    rx = rope(x, torch.arange(9))
    torch.testing.assert_close(rx.norm(dim=-1), x.norm(dim=-1))


def test_rotary_shard_offsets_match_full_sequence() -> None:
    rope = RotaryEmbedding(8)
    x = torch.randn(2, 12, 3, 8)
    full = rope(x, torch.arange(12))
    for start in (0, 4, 8):
        shard = rope(x[:, start : start + 4], torch.arange(start, start + 4))
        torch.testing.assert_close(shard, full[:, start : start + 4], atol=0, rtol=0)
    # Through the model: passing positions 0..N-1 is the default.
    model = small_model().eval()
    tokens = torch.randint(0, 61, (1, 19))
    torch.testing.assert_close(model(tokens), model(tokens, positions=torch.arange(19)))
    assert not torch.allclose(model(tokens), model(tokens, positions=torch.arange(19) + 7))


def test_activation_checkpointing_same_loss_and_grads() -> None:
    tokens = torch.randint(0, 61, (2, 30))
    plain = small_model(seed=3, dropout=0.0)
    ckpt = small_model(seed=3, dropout=0.0, activation_checkpointing=True)
    ckpt.load_state_dict(plain.state_dict())
    losses = []
    for model in (plain, ckpt):
        model.train()
        loss = lm_loss(model, tokens)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1], atol=1e-6, rtol=1e-6)
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_grouped_query_attention() -> None:
    model = small_model(num_kv_heads=2)
    assert model.blocks[0].attn.mha.k_proj.weight.shape == (16, 32)
    tokens = torch.randint(0, 61, (2, 21))
    logits = model(tokens)
    assert logits.shape == (2, 21, 61)
    lm_loss(model, tokens).backward()


def test_generate_shape_and_determinism() -> None:
    model = small_model()
    model.train()
    prompt = torch.randint(0, 61, (2, 5))
    outs = [
        model.generate(prompt, 7, top_k=10, generator=torch.Generator().manual_seed(42))
        for _ in range(2)
    ]
    assert outs[0].shape == (2, 12)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0][:, :5], prompt)
    assert int(outs[0].min()) >= 0 and int(outs[0].max()) < 61
    assert model.training  # mode restored
    greedy = model.generate(prompt, 3, temperature=0)
    assert greedy.shape == (2, 8)
    assert model.generate(prompt, 0).shape == (2, 5)


def test_generate_crops_to_max_seq_len() -> None:
    model = small_model(max_seq_len=8)
    out = model.generate(torch.randint(0, 61, (1, 6)), 5, generator=torch.Generator())
    assert out.shape == (1, 11)


def test_generate_refuses_a_context_parallel_model_and_names_the_local_one() -> None:
    """A ring model (``kind="ring"`` or ``context_parallel``) would take each rank's prompt as
    a shard of a longer sequence: generate and stream refuse it before anything runs, and the
    local model the message names generates from the same weights."""
    from dilated_attention.distributed import ContextParallel, context_parallel

    prompt = torch.randint(0, 61, (1, 5), generator=torch.Generator().manual_seed(3))
    ring = small_model(kind="ring").eval()
    parallel = context_parallel(small_model(kind="dilated"), ContextParallel())
    refused = r"generate and stream .*context parallel \(RingDilatedAttention over"
    for model in (ring, parallel):
        with pytest.raises(ValueError, match=refused + r".*kind='dilated'.*load_state_dict"):
            model.generate(prompt, 2)
        with pytest.raises(ValueError, match=refused):
            model.stream(prompt, 2)
    local = LongNetLM(dataclasses.replace(ring.config, kind="dilated"))
    local.load_state_dict(ring.state_dict())
    assert local.generate(prompt, 3, temperature=0).shape == (1, 8)


def test_presets() -> None:
    tiny = LongNetConfig.from_preset("tiny")
    assert (tiny.vocab_size, tiny.embed_dim, tiny.num_heads) == (256, 128, 4)
    base = LongNetConfig.from_preset("base")
    assert (base.embed_dim, base.num_heads, base.num_layers, base.ffn_dim) == (768, 12, 12, 3072)
    assert base.segment_lengths == (2048, 4096, 8192, 16384, 32768)
    assert base.dilation_rates == (1, 2, 4, 6, 12)
    assert base.vocab_size == 100277
    small_base = LongNetConfig.from_preset("base", num_layers=1, vocab_size=300)
    model = LongNetLM(small_base).eval()
    assert model(torch.randint(0, 300, (1, 10))).shape == (1, 10, 300)


def test_unknown_preset() -> None:
    with pytest.raises(ValueError, match=r"unknown preset 'huge'.*tiny"):
        LongNetConfig.from_preset("huge")
    with pytest.raises(ValueError, match="num_layer"):
        LongNetConfig.from_preset("tiny", num_layer=2)


@pytest.mark.parametrize("bad", [-1, 61])
def test_token_ids_out_of_range(bad: int) -> None:
    model = small_model()
    tokens = torch.randint(0, 61, (2, 10))
    tokens[1, 4] = bad
    with pytest.raises(ValueError, match="token ids"):
        model(tokens)
    with pytest.raises(ValueError, match="token ids"):
        model.generate(tokens, 2)


def test_sequence_longer_than_max_seq_len() -> None:
    model = small_model(max_seq_len=16)
    model(torch.randint(0, 61, (1, 16)))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.randint(0, 61, (1, 17)))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.randint(0, 61, (1, 8)), positions=torch.arange(10, 18))


def test_bad_tokens_and_positions() -> None:
    model = small_model()
    with pytest.raises(ValueError, match="tokens"):
        model(torch.zeros(2, 3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="tokens"):
        model(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="positions"):
        model(torch.zeros(2, 3, dtype=torch.long), positions=torch.arange(4))


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"embed_dim": 30}, "embed_dim"),  # not divisible by 4 heads
        ({"embed_dim": 36}, "head_dim"),  # head_dim 9: odd, no rotary pairs
        ({"num_heads": 0}, "num_heads"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"num_layers": -1}, "num_layers"),
        ({"ffn_dim": 2.5}, "ffn_dim"),
        ({"num_kv_heads": 3}, "num_kv_heads"),
        ({"segment_lengths": (8,)}, "segment_lengths"),
        ({"dilation_rates": (1, 0)}, "dilation_rates"),
        ({"dropout": 1.5}, "dropout"),
        ({"max_seq_len": 0}, "max_seq_len"),
        ({"rotary_base": -1.0}, "rotary_base"),
        ({"layer_norm_eps": 0}, "layer_norm_eps"),
        ({"tie_embeddings": "yes"}, "tie_embeddings"),
    ],
)
def test_bad_config(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LongNetConfig(**{**SMALL, **overrides})


def test_config_is_frozen_and_keyword_only() -> None:
    cfg = LongNetConfig(**SMALL)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.embed_dim = 64  # type: ignore[misc]
    with pytest.raises(TypeError):
        LongNetConfig(61, 32, 4, 2, (8,), (1,), 64)  # type: ignore[misc]


def test_top_level_exports() -> None:
    import dilated_attention

    assert dilated_attention.LongNetLM is LongNetLM
    assert dilated_attention.LongNetConfig is LongNetConfig
    assert {"LongNetLM", "LongNetConfig"} <= set(dilated_attention.__all__)


def test_kind_whose_layer_cannot_rotate_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A registered kind whose multihead layer has no ``use_rotary`` is refused at build time with
    what LongNetLM needs, not at the first forward."""
    from torch import nn

    import dilated_attention.factory as factory
    from dilated_attention import DilatedAttention, register_kind

    class NoRotary(nn.Module):
        def __init__(self, **kwargs: object) -> None:
            super().__init__()

    monkeypatch.setattr(factory, "_KINDS", dict(factory._KINDS))
    register_kind("no_rotary", dilated=DilatedAttention, multihead=NoRotary)
    with pytest.raises(
        TypeError, match=r"kind 'no_rotary' built NoRotary, which has no use_rotary"
    ):
        LongNetLM(LongNetConfig(**{**SMALL, "kind": "no_rotary"}))


# -- decoding with per-layer caches ----------------------------------------------------------------
def test_cached_forward_in_chunks_equals_the_full_forward() -> None:
    """``forward(tokens, caches=...)`` over a prompt, single tokens and a chunk gives the full
    forward's logits (float64), rotary positions continuing from the caches."""
    model = LongNetLM(LongNetConfig(**{**SMALL, "num_kv_heads": 2})).double().eval()
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 45))
    with torch.no_grad():
        full = model(tokens)
        caches = model.new_caches()
        pieces = [model(tokens[:, a:b], caches=caches) for a, b in ((0, 19), (19, 20), (20, 21),
                                                                   (21, 45))]  # fmt: skip
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-10, rtol=1e-8)
    assert all(c.length == 45 and c.start > 0 for c in caches)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_generate_with_caches_equals_recomputing(temperature: float) -> None:
    """``generate`` (cached) picks the same tokens as recomputing the whole forward each step,
    greedy and sampled with the same generator; with ``max_seq_len`` reached it recomputes."""
    model = LongNetLM(LongNetConfig(**SMALL)).double().eval()
    prompt = torch.randint(0, SMALL["vocab_size"], (2, 11))
    got = model.generate(prompt, 20, temperature=temperature, top_k=7,
                         generator=torch.Generator().manual_seed(3))  # fmt: skip
    out, gen = prompt.clone(), torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _ in range(20):
            logits = model(out)[:, -1].float()
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                kth = torch.topk(logits, 7, dim=-1).values[:, -1:]
                probs = torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)
                nxt = torch.multinomial(probs, 1, generator=gen)
            out = torch.cat([out, nxt], dim=1)
    assert torch.equal(got, out)


def test_caches_are_checked() -> None:
    model = LongNetLM(LongNetConfig(**SMALL))
    tokens = torch.randint(0, SMALL["vocab_size"], (1, 5))
    with pytest.raises(ValueError, match=r"caches must be a list of 2 DilatedKVCache"):
        model(tokens, caches=model.new_caches()[:1])


def test_one_cache_for_two_layers_or_a_step_ahead_is_refused_before_any_work() -> None:
    """The same cache for two layers (which took every layer's keys as more tokens: 20 tokens
    seen after 10, logits off by units), a cache another step has advanced, one of another
    schedule or another batch, something that is no cache, or positions other than the caches'
    next ones: a ValueError naming ``caches`` (or ``positions``) before any cache changes. The
    caches then decode every token as the full forward does."""
    from dilated_attention import DilatedKVCache

    model = LongNetLM(LongNetConfig(**SMALL)).double().eval()
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 10))
    with torch.no_grad():
        full = model(tokens)
        shared = DilatedKVCache(SMALL["segment_lengths"], SMALL["dilation_rates"])
        with pytest.raises(ValueError, match=r"caches\[1\] is caches\[0\]"):
            model(tokens[:, :1], caches=[shared, shared])
        assert shared.length == 0 and shared.key is None
        ahead = model.new_caches()
        model(tokens[:, :3], caches=ahead)  # both advanced to 3
        mixed = [model.new_caches()[0], ahead[1]]
        with pytest.raises(ValueError, match=r"caches\[1\] has seen 3 tokens and caches\[0\] 0"):
            model(tokens[:, :1], caches=mixed)
        other = [DilatedKVCache([8, 32], [1, 2]), model.new_caches()[1]]
        with pytest.raises(ValueError, match=r"caches\[0\] holds a layer with segment_lengths"):
            model(tokens[:, :1], caches=other)
        with pytest.raises(ValueError, match=r"caches\[1\] must be a DilatedKVCache"):
            model(tokens[:, :1], caches=[model.new_caches()[0], {}])
        with pytest.raises(ValueError, match=r"caches hold keys of a batch of 2"):
            model(tokens[:1, 3:4], caches=ahead)
        with pytest.raises(ValueError, match=r"positions must be the 1 position after the 3"):
            model(tokens[:, 3:4], caches=ahead, positions=torch.tensor([5]))
        assert [c.length for c in ahead] == [3, 3] and mixed[0].length == 0
        caches = model.new_caches()
        steps = [model(tokens[:, p : p + 1], caches=caches) for p in range(10)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-10, rtol=1e-8)
    assert [c.length for c in caches] == [10, 10]


def test_a_layer_refuses_positions_its_cache_is_past() -> None:
    """A multihead layer given ``positions`` with a cache: they must be the cache's next ones
    (a cache another layer has used this step is past them), checked before any work."""
    from dilated_attention import DilatedKVCache

    layer = LongNetLM(LongNetConfig(**SMALL)).double().eval().blocks[0].attn.mha
    x = torch.randn(2, 4, SMALL["embed_dim"], dtype=torch.float64)
    cache = DilatedKVCache(SMALL["segment_lengths"], SMALL["dilation_rates"])
    with torch.no_grad():
        layer(x[:, :3], is_causal=True, cache=cache, positions=torch.arange(3))
        with pytest.raises(ValueError, match=r"positions must be the 1 position after the 3"):
            layer(x[:, 3:], is_causal=True, cache=cache, positions=torch.tensor([2]))
        assert cache.length == 3
        layer(x[:, 3:], is_causal=True, cache=cache, positions=torch.tensor([3]))
    assert cache.length == 4


def test_generate_with_a_segment_longer_than_any_memory_and_max_seq_len() -> None:
    """A segment of 2**40 (one segment: global attention) with ``max_seq_len``: the caches are
    bounded by ``max_seq_len`` rows, and cached generation equals recomputing."""
    config = LongNetConfig(**{**SMALL, "segment_lengths": (8, 2**40), "max_seq_len": 40})
    model = LongNetLM(config).double().eval()
    prompt = torch.randint(0, SMALL["vocab_size"], (2, 9))
    got = model.generate(prompt, 12, temperature=0.0)
    out = prompt.clone()
    with torch.no_grad():
        for _ in range(12):
            out = torch.cat([out, model(out)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(got, out)
    assert all(c.max_length == 40 for c in model.new_caches())


def test_stream_yields_generates_tokens_one_step_at_a_time() -> None:
    """``stream`` yields (B, 1) steps whose concatenation is ``generate``'s continuation; the
    model is in eval mode while it runs and back in training mode once it is exhausted or
    closed."""
    model = small_model()
    model.train()
    prompt = torch.randint(0, 61, (2, 9))
    steps = model.stream(prompt, 6, top_k=5, generator=torch.Generator().manual_seed(7))
    first = next(steps)
    assert first.shape == (2, 1) and first.dtype == torch.int64
    assert not model.training  # sampling runs in eval mode
    rest = list(steps)
    assert len(rest) == 5 and model.training
    expected = model.generate(prompt, 6, top_k=5, generator=torch.Generator().manual_seed(7))
    assert torch.equal(torch.cat([prompt, first, *rest], dim=1), expected)
    closed = model.stream(prompt, 6)
    next(closed)
    closed.close()
    assert model.training


def test_stop_token_ends_each_sequence_and_the_stream_when_all_have_stopped() -> None:
    """A sequence that produced ``stop_token`` continues with it; the others are unaffected (a
    batch row never reads another); generation ends at the step where the last one stops."""
    model = small_model().double().eval()
    prompt = torch.randint(0, 61, (3, 7), generator=torch.Generator().manual_seed(2))
    free = model.generate(prompt, 12, temperature=0)[:, 7:]
    stop = int(free[0, 2])  # row 0 stops at step 2 (or earlier if it produced it before)
    hits = [(row == stop).nonzero().flatten().tolist() for row in free]
    first = [h[0] if h else None for h in hits]
    got = model.generate(prompt, 12, temperature=0, stop_token=stop)[:, 7:]
    steps = 12 if None in first else max(first) + 1
    assert got.shape == (3, steps)
    for row, at in enumerate(first):
        end = steps if at is None else at + 1
        assert torch.equal(got[row, :end], free[row, :end])
        assert bool((got[row, end:] == stop).all())
    alone = model.generate(prompt[:1], 12, temperature=0, stop_token=stop)
    assert torch.equal(alone[:, 7:], free[:1, : first[0] + 1])  # ends at its stop token


@pytest.mark.parametrize("bad", [-1, 61, 2.0, True, "eos"])
def test_stop_token_is_checked_when_the_stream_is_made(bad: object) -> None:
    model = small_model()
    with pytest.raises(ValueError, match=r"stop_token must be a token id in \[0, 61\)"):
        model.stream(torch.randint(0, 61, (1, 4)), 3, stop_token=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"max_new_tokens must be >= 0"):
        model.stream(torch.randint(0, 61, (1, 4)), -1)


def test_prompts_of_different_lengths_are_each_sampled_as_alone() -> None:
    """A list of prompts of different lengths: each continuation equals generating that
    prompt alone (greedy), with the rows of one length batched; ``stream`` yields (B, 1) steps
    in the list's order; with ``stop_token`` each result ends at its own stop token."""
    model = small_model().double().eval()
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 61, (n,), generator=gen) for n in (5, 12, 5, 30)]
    alone = [model.generate(p.unsqueeze(0), 9, temperature=0)[0] for p in prompts]
    got = model.generate(prompts, 9, temperature=0)
    assert isinstance(got, list) and len(got) == 4
    for g, a in zip(got, alone, strict=True):
        assert torch.equal(g, a)
    steps = torch.cat(list(model.stream(prompts, 9, temperature=0)), dim=1)
    assert torch.equal(steps, torch.stack([a[-9:] for a in alone]))

    stop = int(alone[1][12 + 3])  # the second prompt's fourth sample
    ended = model.generate(prompts, 9, temperature=0, stop_token=stop)
    for e, a, p in zip(ended, alone, prompts, strict=True):
        sampled = a[p.numel() :]
        hits = (sampled == stop).nonzero()
        end = int(hits[0]) + 1 if hits.numel() else 9
        assert torch.equal(e, a[: p.numel() + end])


@pytest.mark.parametrize(
    ("prompts", "match"),
    [
        ([], r"non-empty list of 1-D token id tensors"),
        ([torch.zeros(2, 3, dtype=torch.long)], r"prompt\[0\] must be a non-empty 1-D tensor"),
        ([torch.zeros(3, dtype=torch.long), torch.zeros(0, dtype=torch.long)], r"prompt\[1\]"),
        ([torch.zeros(3, dtype=torch.long), torch.full((2,), 61)], r"token ids"),
    ],
)
def test_bad_prompt_lists_raise_before_sampling(prompts: list, match: str) -> None:
    model = small_model()
    with pytest.raises(ValueError, match=match):
        model.stream(prompts, 3)


@pytest.mark.parametrize("shape", [(5,), (1, 1, 5)], ids=["1-D", "3-D"])
def test_a_prompt_tensor_of_another_rank_is_told_the_accepted_forms(shape) -> None:  # type: ignore[no-untyped-def]
    """A 1-D prompt (one sequence) is told that a (batch, seq_len) tensor or a list of 1-D
    prompts is accepted, and how to pass it."""
    model = small_model()
    prompt = torch.zeros(shape, dtype=torch.long)
    with pytest.raises(ValueError, match=re.escape(
        f"prompt must be a (batch, seq_len) tensor of token ids or a list of 1-D token id "
        f"tensors (prompts of any lengths), got a {len(shape)}-D tensor of shape {shape}; for one "
        f"prompt pass prompt.unsqueeze(0) (or [prompt], which returns a list)"
    )):  # fmt: skip
        model.generate(prompt, 3)
    if len(shape) == 1:  # the fixes run
        assert model.generate(prompt.unsqueeze(0), 2, temperature=0).shape == (1, 7)
        assert model.generate([prompt], 2, temperature=0)[0].shape == (7,)
