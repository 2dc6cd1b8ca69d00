"""LongNetLM with static caches (Note [A decode step with static shapes]) and the captured
decoding step (Note [A captured decoding step]): the same logits as the full forward, one
compiled graph for every step, and ``generate(cuda_graph=True)`` giving the tokens of eager
decoding (on the CPU the step runs without capture; the GPU test captures it)."""

from __future__ import annotations

import pytest
import torch

from dilated_attention.models import LongNetConfig, LongNetLM, generation


def _model(dtype: torch.dtype = torch.float64, device: str = "cpu", **overrides) -> LongNetLM:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    config = LongNetConfig(
        vocab_size=64, embed_dim=32, num_heads=4, num_layers=2, segment_lengths=(8, 16),
        dilation_rates=(1, 2), ffn_dim=64, num_kv_heads=2, **overrides,
    )  # fmt: skip
    return LongNetLM(config).to(device=device, dtype=dtype).eval()


@pytest.fixture
def graphs_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """``cuda_graph=True`` on the CPU: the static path runs, its step without capture."""
    monkeypatch.setattr(generation, "GRAPH_DEVICE_TYPES", frozenset({"cpu", "cuda"}))


def test_static_caches_give_the_full_forward_logits() -> None:
    model = _model()
    tokens = torch.randint(0, 64, (2, 41), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(tokens)
        caches = model.new_caches(static=True)
        parts = [model(tokens[:, :6], caches=caches)]
        parts += [model(tokens[:, t : t + 1], caches=caches) for t in range(6, 30)]
        parts.append(model(tokens[:, 30:35], caches=caches))  # a chunk
        parts += [model(tokens[:, t : t + 1], caches=caches) for t in range(35, 41)]
    torch.testing.assert_close(torch.cat(parts, dim=1), want, atol=1e-10, rtol=1e-8)


def test_the_model_step_compiles_once() -> None:
    model = _model(torch.float32)
    tokens = torch.randint(0, 64, (2, 30), generator=torch.Generator().manual_seed(2))
    compiles = []

    def counting_backend(gm, example_inputs):  # type: ignore[no-untyped-def]
        compiles.append(gm)
        return gm.forward

    caches = model.new_caches(static=True)
    step = torch.compile(
        lambda t: model(t, caches=caches), fullgraph=True, backend=counting_backend
    )
    with torch.no_grad():
        want = model(tokens)
        parts = [model(tokens[:, :4], caches=caches)]
        parts += [step(tokens[:, t : t + 1]) for t in range(4, 30)]
    torch.testing.assert_close(torch.cat(parts, dim=1), want, atol=2e-5, rtol=2e-5)
    assert len(compiles) == 1


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generate_through_the_static_step_gives_the_eager_tokens(
    graphs_here: None, temperature: float
) -> None:
    model = _model(torch.float32)
    prompt = torch.randint(0, 64, (3, 9), generator=torch.Generator().manual_seed(3))
    runs = [
        model.generate(prompt, 20, temperature=temperature, top_k=10, cuda_graph=graph,
                       generator=torch.Generator().manual_seed(4))
        for graph in (False, True)
    ]  # fmt: skip
    assert torch.equal(*runs)


def test_prompts_of_different_lengths_decode_together(graphs_here: None) -> None:
    """Each length group's prompt into caches of its own, their rows loaded into one batch of
    caches at different positions: every sequence as alone, with a stop token."""
    model = _model(torch.float32)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 64, (n,), generator=gen) for n in (5, 13, 5, 2)]
    eager = model.generate(prompts, 18, temperature=0, cuda_graph=False, stop_token=7)
    static = model.generate(prompts, 18, temperature=0, cuda_graph=True, stop_token=7)
    alone = [model.generate(p.unsqueeze(0), 18, temperature=0, cuda_graph=True)[0]
             for p in prompts]  # fmt: skip
    for got, want, single in zip(static, eager, alone, strict=True):
        assert torch.equal(got, want)
        assert torch.equal(got, single[: got.numel()])


def test_cuda_graph_arguments_are_checked() -> None:
    model = _model(torch.float32, max_seq_len=12)
    prompt = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="needs the model and prompt on a CUDA device"):
        model.generate(prompt, 3, cuda_graph=True)
    with pytest.raises(ValueError, match="cuda_graph must be True, False or None"):
        model.generate(prompt, 3, cuda_graph="yes")  # type: ignore[arg-type]


def test_cuda_graph_needs_decoding_caches(graphs_here: None) -> None:
    model = _model(torch.float32, max_seq_len=12)
    with pytest.raises(ValueError, match="within max_seq_len=12"):
        model.generate(torch.zeros(1, 4, dtype=torch.long), 9, cuda_graph=True)
    assert model.generate(torch.zeros(1, 4, dtype=torch.long), 9).shape == (1, 13)


@pytest.mark.parametrize(
    ("graph_devices", "max_seq_len", "captured"),
    [(frozenset({"cuda"}), None, False),  # the CPU: eager steps
     (frozenset({"cpu", "cuda"}), None, True),  # where graphs run: captured
     (frozenset({"cpu", "cuda"}), 12, False)],  # past max_seq_len: eager (recomputed) steps
    ids=["no-graphs-here", "graphs-here", "no-caches"],
)  # fmt: skip
def test_the_default_captures_wherever_it_can(
    monkeypatch: pytest.MonkeyPatch, graph_devices: frozenset, max_seq_len: int | None,
    captured: bool,
) -> None:
    """``cuda_graph=None`` (the default) takes the captured step exactly where ``True`` would
    run, with the same tokens as eager steps, and never raises where ``True`` would."""
    monkeypatch.setattr(generation, "GRAPH_DEVICE_TYPES", graph_devices)
    model = _model(torch.float32, max_seq_len=max_seq_len)
    took = []
    sample_static = model._sample_static
    monkeypatch.setattr(model, "_sample_static", lambda *a: took.append(1) or sample_static(*a))
    prompt = torch.randint(0, 64, (2, 4), generator=torch.Generator().manual_seed(8))
    default = model.generate(prompt, 9, temperature=0)
    assert bool(took) == captured
    assert torch.equal(default, model.generate(prompt, 9, temperature=0, cuda_graph=False))


def test_static_caches_refuse_positions_and_mixed_kinds() -> None:
    model = _model(torch.float32)
    tokens = torch.zeros(1, 3, dtype=torch.long)
    caches = model.new_caches(static=True)
    with pytest.raises(ValueError, match="pass positions=None"), torch.no_grad():
        model(tokens, caches=caches, positions=torch.arange(3))
    mixed = [model.new_caches(static=True)[0], model.new_caches()[0]]
    with pytest.raises(ValueError, match=r"caches\[1\] must be a StaticDilatedKVCache"):
        model(tokens, caches=mixed)


@pytest.mark.gpu
def test_captured_generation_gives_the_eager_tokens_on_the_gpu() -> None:
    """The captured CUDA graph replays the step: greedy tokens equal eager decoding's, for
    prompts of one length and of several, and in a later call reusing the kept step."""
    model = _model(torch.float32, device="cuda")
    prompt = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(6)).cuda()
    eager = model.generate(prompt, 24, temperature=0, cuda_graph=False)
    captured = model.generate(prompt, 24, temperature=0, cuda_graph=True)
    assert torch.equal(eager, captured)
    kept = model.__dict__[generation._KEPT]
    longer = torch.randint(0, 64, (2, 30), generator=torch.Generator().manual_seed(7)).cuda()
    eager = model.generate(longer, 24, temperature=0, cuda_graph=False)
    assert torch.equal(model.generate(longer, 24, temperature=0, cuda_graph=True), eager)
    assert model.__dict__[generation._KEPT] is kept  # replayed, not recorded again
    prompts = [prompt[0, :3], prompt[1]]
    eager_list = model.generate(prompts, 24, temperature=0, cuda_graph=False)
    captured_list = model.generate(prompts, 24, temperature=0, cuda_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(eager_list, captured_list, strict=True))


@pytest.fixture
def kept_steps(graphs_here: None, monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Steps made on the CPU stand for captured ones (their ``graph`` set, run eagerly), so the
    model keeps them (Note [A captured step kept across calls]); the list of steps made."""
    made: list[object] = []

    class Recorded(generation.CapturedStep):
        def __init__(self, *args) -> None:  # type: ignore[no-untyped-def]
            super().__init__(*args)
            self.graph = "recorded"  # type: ignore[assignment]
            made.append(self)

        def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
            return self._eager(tokens)

    monkeypatch.setattr(generation, "CapturedStep", Recorded)
    return made


def test_a_kept_step_serves_the_next_call_of_its_batch(kept_steps: list[object]) -> None:
    """Later calls of the batch size reuse the first's step and caches (reset, then the new
    prompts, of one length or several): the tokens of eager decoding each time; another batch
    size or new parameters (``to()``) record a new step."""
    import copy
    import pickle

    model = _model(torch.float32)
    gen = torch.Generator().manual_seed(8)
    first, second = (torch.randint(0, 64, (2, n), generator=gen) for n in (9, 23))
    for prompt in (first, second, first):
        eager = model.generate(prompt, 12, temperature=0, cuda_graph=False)
        assert torch.equal(model.generate(prompt, 12, temperature=0, cuda_graph=True), eager)
    assert len(kept_steps) == 1
    kept = model.__dict__[generation._KEPT]
    assert copy.deepcopy(model).__dict__.get(generation._KEPT) is None
    assert generation._KEPT not in pickle.loads(pickle.dumps(model)).__dict__
    prompts = [second[0, :4], second[1]]
    eager_list = model.generate(prompts, 12, temperature=0, cuda_graph=False)
    got = model.generate(prompts, 12, temperature=0, cuda_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(got, eager_list, strict=True))
    assert len(kept_steps) == 1 and model.__dict__[generation._KEPT] is kept
    model.generate(second[:1], 12, temperature=0, cuda_graph=True)  # another batch size
    assert len(kept_steps) == 2 and model.__dict__[generation._KEPT] is not kept
    model.to(torch.float64)
    eager = model.generate(first[:1], 12, temperature=0, cuda_graph=False)
    assert torch.equal(model.generate(first[:1], 12, temperature=0, cuda_graph=True), eager)
    assert len(kept_steps) == 3
    model.release_captured_step()
    assert generation._KEPT not in model.__dict__
    # A kept CUDA graph reads the schedule's slot tables: they are never evicted from their cache.
    from dilated_attention.core.decoding.decode import token_slots

    assert token_slots.cache_info().maxsize is None


def test_overlapping_calls_do_not_share_a_kept_step(kept_steps: list[object]) -> None:
    """Two streams of one batch size interleaved (and a generate while one is paused): each
    records or reuses a step of its own, never the caches another call is decoding in."""
    model = _model(torch.float32)
    gen = torch.Generator().manual_seed(9)
    a, b, c = (torch.randint(0, 64, (2, n), generator=gen) for n in (7, 15, 11))
    model.generate(a, 4, temperature=0, cuda_graph=True)  # a kept step to start from
    want = [model.generate(p, 10, temperature=0, cuda_graph=False) for p in (a, b, c)]
    first = model.stream(a, 10, temperature=0, cuda_graph=True)
    second = model.stream(b, 10, temperature=0, cuda_graph=True)
    got_a, got_b = [next(first)], [next(second)]
    middle = model.generate(c, 10, temperature=0, cuda_graph=True)
    for _ in range(9):
        got_a.append(next(first))
        got_b.append(next(second))
    assert torch.equal(torch.cat([a, *got_a], dim=1), want[0])
    assert torch.equal(torch.cat([b, *got_b], dim=1), want[1])
    assert torch.equal(middle, want[2])
    assert generation._KEPT in model.__dict__
