"""Hybrid LongNet stacks (Note [Hybrid stacks] in ``models/config.py``): local sliding-window
layers among global dilated ones (``local_window``, ``global_every``), soft-capping and
learnable sinks in every layer. The local layers see only their window; every layer decodes
with its own kind of cache (a local layer's holds only its window), dynamic or static, to the
full forward's logits; generate and the captured step (run eagerly on the CPU, captured in a
CUDA graph on the GPU: ``gpu`` tests) give the eager tokens; checkpoints keep the new fields;
bad configurations are clear errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from dilated_attention import (
    DilatedAttention,
    DilatedKVCache,
    LocalAttention,
    StaticDilatedKVCache,
    StaticWindowKVCache,
    WindowKVCache,
)
from dilated_attention.models import (
    LongNetConfig,
    LongNetLM,
    generation,
    load_checkpoint,
    save_checkpoint,
)

HYBRID = dict(
    vocab_size=64, embed_dim=32, num_heads=4, num_kv_heads=2, num_layers=3,
    segment_lengths=(8, 16), dilation_rates=(1, 2), ffn_dim=64, local_window=5, global_every=3,
    softcap=4.0, sinks=True,
)  # fmt: skip


def _model(dtype: torch.dtype = torch.float64, device: str = "cpu", **overrides) -> LongNetLM:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = LongNetLM(LongNetConfig(**{**HYBRID, **overrides})).to(device=device, dtype=dtype)
    with torch.no_grad():  # sinks away from their initial 0, so that they matter
        for block in model.blocks:
            sinks = block.attn.mha.attention.sinks
            if sinks is not None:
                sinks.uniform_(-1.0, 1.0)
    return model.eval()


@pytest.fixture
def graphs_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """``cuda_graph=True`` on the CPU: the static path runs, its step without capture."""
    monkeypatch.setattr(generation, "GRAPH_DEVICE_TYPES", frozenset({"cpu", "cuda"}))


def test_layers_are_placed_and_carry_their_options() -> None:
    """Every third layer global (dilated), the others local windows of 5 tokens; soft-cap and
    one learnable sink per head in each; the caches of each layer's kind."""
    model = _model(num_layers=6)
    inner = [block.attn.mha.attention for block in model.blocks]
    assert [type(m) for m in inner] == [LocalAttention, LocalAttention, DilatedAttention] * 2
    assert all(m.window_size == (4, 0) for m in inner if isinstance(m, LocalAttention))
    assert all(m.softcap == 4.0 and m.sinks.shape == (4,) for m in inner)
    assert sum(name.endswith("attention.sinks") for name in model.state_dict()) == 6
    kinds = [type(c) for c in model.new_caches()]
    assert kinds == [WindowKVCache, WindowKVCache, DilatedKVCache] * 2
    statics = [type(c) for c in model.new_caches(static=True)]
    assert statics == [StaticWindowKVCache, StaticWindowKVCache, StaticDilatedKVCache] * 2
    assert [model.config.is_global(i) for i in range(6)] == [False, False, True] * 2
    everyone_local = _model(global_every=None)
    assert all(isinstance(b.attn.mha.attention, LocalAttention) for b in everyone_local.blocks)


def test_local_layers_see_only_their_window() -> None:
    """Two local layers of 4 tokens: position p depends on tokens p - 6 .. p only (3 back per
    layer), so changing token 0 leaves every logit from position 7 on unchanged, and changes
    position 6."""
    model = _model(num_layers=2, local_window=4, global_every=None)
    tokens = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(1))
    other = tokens.clone()
    other[0, 0] = (tokens[0, 0] + 1) % 64
    with torch.no_grad():
        a, b = model(tokens), model(other)
    torch.testing.assert_close(a[:, 7:], b[:, 7:], atol=1e-12, rtol=0)
    assert (a[:, 6] - b[:, 6]).abs().max() > 1e-6


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
def test_decoding_gives_the_full_forward_logits(static: bool) -> None:
    """A prompt, tokens, a chunk and tokens through ``new_caches()``: the full forward's logits
    (the local layers' caches wrap their window many times; every row at its position)."""
    model = _model()
    tokens = torch.randint(0, 64, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(tokens)
        caches = model.new_caches(static=static)
        parts = [model(tokens[:, :6], caches=caches)]
        parts += [model(tokens[:, t : t + 1], caches=caches) for t in range(6, 18)]
        parts.append(model(tokens[:, 18:25], caches=caches))  # a chunk
        parts += [model(tokens[:, t : t + 1], caches=caches) for t in range(25, 30)]
    torch.testing.assert_close(torch.cat(parts, dim=1), want, atol=1e-10, rtol=1e-8)
    if not static:
        local = caches[0]
        assert isinstance(local, WindowKVCache) and local.key is not None
        assert local.key.shape[1] == 4  # only the window's keys


def test_a_packed_prompt_fills_every_kind_of_cache() -> None:
    """``cu_seqlens`` with empty caches: each row's last document continues exactly."""
    model = _model()
    tokens = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(3))
    cu = [0, 4, 12, 16, 24]  # each row: a document of 4, then one of 8 that continues
    with torch.no_grad():
        caches = model.new_caches()
        prompt = model(tokens[:, :12], caches=caches, cu_seqlens=cu)
        steps = [model(tokens[:, t : t + 1], caches=caches) for t in range(12, 20)]
        want = model(tokens[:, 4:20])
    torch.testing.assert_close(torch.cat([prompt[:, 4:], *steps], dim=1), want, atol=1e-10,
                               rtol=1e-8)  # fmt: skip


def test_caches_of_the_wrong_kind_are_refused() -> None:
    model = _model()
    tokens = torch.zeros(1, 2, dtype=torch.long)
    swapped = model.new_caches()
    swapped[0], swapped[2] = swapped[2], swapped[0]
    with pytest.raises(ValueError, match=r"caches\[0\] must be a WindowKVCache"):
        model(tokens, caches=swapped)
    other = model.new_caches()
    other[1] = WindowKVCache((2, 0))
    held = r"caches\[1\] holds a layer with window_size=\(2, 0\), but the model's layer 1 has"
    with pytest.raises(ValueError, match=held + r" window_size=\(4, 0\)"):
        model(tokens, caches=other)
    mixed = model.new_caches(static=True)
    mixed[1] = model.new_caches()[1]
    with pytest.raises(ValueError, match=r"caches\[1\] must be a StaticWindowKVCache"):
        model(tokens, caches=mixed)
    with pytest.raises(ValueError, match="caches must be a list of 3 DilatedKVCache / Window"):
        model(tokens, caches=model.new_caches()[:2])


def test_generate_through_the_captured_step_gives_the_eager_tokens(graphs_here: None) -> None:
    """The static path (the step CapturedStep records; eager on the CPU) with soft-capping and
    sinks in every layer, for one prompt length and several: the eager tokens (past the local
    layers' window of 5)."""
    model = _model(torch.float32, num_layers=2, global_every=2)
    prompt = torch.randint(0, 64, (2, 4), generator=torch.Generator().manual_seed(4))
    eager = model.generate(prompt, 9, temperature=0, cuda_graph=False)
    assert torch.equal(model.generate(prompt, 9, temperature=0, cuda_graph=True), eager)
    prompts = [prompt[0, :2], prompt[1]]
    eager_list = model.generate(prompts, 9, temperature=0, cuda_graph=False)
    static_list = model.generate(prompts, 9, temperature=0, cuda_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(eager_list, static_list, strict=True))


def test_the_dilated_model_with_sinks_and_softcap_decodes_statically(graphs_here: None) -> None:
    """Soft-capping and sinks in the dilated layers' static step (no local layers): the
    captured path's tokens are the eager ones."""
    model = _model(torch.float32, local_window=None, global_every=None, num_layers=2)
    assert all(isinstance(b.attn.mha.attention, DilatedAttention) for b in model.blocks)
    prompt = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(5))
    eager = model.generate(prompt, 10, temperature=0, cuda_graph=False)
    assert torch.equal(model.generate(prompt, 10, temperature=0, cuda_graph=True), eager)


@pytest.mark.slow  # a compile of the model's step: seconds on a CPU
def test_the_hybrid_step_compiles_once() -> None:
    """Without soft-capping and sinks (the operators do not carry them yet) the static step of
    a hybrid model compiles into one graph for every position."""
    model = _model(torch.float32, softcap=None, sinks=False, num_layers=2, global_every=2)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(6))
    compiles = []

    def counting_backend(gm, example_inputs):  # type: ignore[no-untyped-def]
        compiles.append(gm)
        return gm.forward

    caches = model.new_caches(static=True)
    step = torch.compile(lambda t: model(t, caches=caches), fullgraph=True,
                         backend=counting_backend)  # fmt: skip
    with torch.no_grad():
        want = model(tokens)
        parts = [model(tokens[:, :4], caches=caches)]
        parts += [step(tokens[:, t : t + 1]) for t in range(4, 12)]
    torch.testing.assert_close(torch.cat(parts, dim=1), want, atol=2e-5, rtol=2e-5)
    assert len(compiles) == 1


def test_a_checkpoint_keeps_the_hybrid_fields(tmp_path: Path) -> None:
    model = _model(torch.float32)
    path = save_checkpoint(tmp_path / "hybrid.pt", model)
    ckpt = load_checkpoint(path)
    assert ckpt.config == model.config
    assert (ckpt.config.local_window, ckpt.config.global_every) == (5, 3)
    assert (ckpt.config.softcap, ckpt.config.sinks) == (4.0, True)
    tokens = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert torch.equal(ckpt.model.eval()(tokens), model(tokens))
    with pytest.raises(ValueError, match=r"change the attention of .* local_window=5 to 7"):
        load_checkpoint(path, overrides={"local_window": 7})
    with pytest.raises(ValueError, match=r"softcap=4.0 to None"):
        load_checkpoint(path, overrides={"softcap": None})
    assert load_checkpoint(path, overrides={"backend": "math"}).config.backend == "math"


def test_the_hybrid_preset() -> None:
    config = LongNetConfig.from_preset("tiny_hybrid", num_layers=3)
    assert (config.local_window, config.global_every, config.sinks) == (64, 3, True)
    model = LongNetLM(config).eval()
    assert model(torch.randint(0, 256, (1, 70))).shape == (1, 70, 256)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(local_window=None), "global_every=3 places global layers .* local_window is None"),
        (dict(global_every=4), "global_every=4 is more than num_layers=3"),
        (dict(local_window=0), "local_window must be a positive int"),
        (dict(global_every=1.5), "global_every must be a positive int"),
        (dict(softcap=-2.0), "softcap must be a positive finite float"),
        (dict(softcap="4"), "softcap must be a positive float"),
        (dict(sinks=1), "sinks must be True or False"),
        (dict(kind="ring"), "kind='ring' with local_window=5: the local layers have no ring"),
    ],
)
def test_bad_configurations_are_clear_errors(overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LongNetConfig(**{**HYBRID, **overrides})


def test_a_ring_world_refuses_local_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """``kind="auto"`` in a process group of several ranks would build ring layers, and the
    local layers have no ring form: a clear error before any layer is built."""
    dist = torch.distributed
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(ValueError, match=r"kind='auto' picks ring attention .* 2 ranks"):
        LongNetLM(LongNetConfig(**HYBRID))
    ring = LongNetConfig(**{**HYBRID, "local_window": None, "global_every": None, "kind": "ring"})
    assert ring.softcap == 4.0 and ring.sinks  # the ring layers take soft-caps and sinks


def test_context_parallel_global_layers_beside_local_ones_are_refused() -> None:
    """``context_parallel`` refuses a model with local layers (they have no ring layer yet and
    would read a shard as a sequence), before it changes any layer."""
    from dilated_attention.distributed import ContextParallel, context_parallel

    model = _model()
    kinds = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=r"local \(sliding-window\) layer, which has no ring"):
        context_parallel(model, ContextParallel())
    assert [type(m) for m in model.modules()] == kinds


@pytest.mark.gpu
@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "dilated"])
def test_the_captured_step_with_sinks_and_softcap_on_the_gpu(hybrid: bool) -> None:
    """The step captured in a CUDA graph (soft-capping and sinks in every layer, the local
    layers' ring of fixed rows): greedy tokens equal eager decoding's, for one prompt length
    and several, and a replay's logits equal the eager step's."""
    layout = {} if hybrid else {"local_window": None, "global_every": None}
    model = _model(torch.float32, device="cuda", **layout)
    prompt = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(8)).cuda()
    eager = model.generate(prompt, 24, temperature=0, cuda_graph=False)
    assert torch.equal(model.generate(prompt, 24, temperature=0, cuda_graph=True), eager)
    kept = model.__dict__[generation._KEPT]
    assert kept.step.graph is not None  # captured, not run eagerly
    prompts = [prompt[0, :3], prompt[1]]
    eager_list = model.generate(prompts, 24, temperature=0, cuda_graph=False)
    captured_list = model.generate(prompts, 24, temperature=0, cuda_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(eager_list, captured_list, strict=True))
    with torch.no_grad():
        caches = model.new_caches(static=True)
        model(prompt, caches=caches)
        step = generation.CapturedStep(model, caches, 2, torch.device("cuda"))
        twins = model.new_caches(static=True)
        model(prompt, caches=twins)
        for t in range(20):
            token = torch.full((2, 1), t % 64, device="cuda")
            torch.testing.assert_close(
                step(token), model(token, caches=twins)[:, -1], atol=1e-4, rtol=1e-4
            )


def test_dataclass_replace_keeps_validation() -> None:
    config = LongNetConfig(**HYBRID)
    with pytest.raises(ValueError, match="global_every"):
        dataclasses.replace(config, global_every=0)
