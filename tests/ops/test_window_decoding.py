"""Decoding a layer of local windowed attention with its window cache (Note [A window cache] in
``core/decoding/window_cache.py``): a prompt, chunks and one token at a time through
:class:`WindowKVCache` and :class:`StaticWindowKVCache` give every row and lse of the full
causal windowed forward (the float64 oracle, which shares no code with the caches), with
soft-capping, sinks, GQA, a padding mask, packed prompts and rows at different positions; the
caches never hold more than the window; the static step compiles into one graph; bad input
raises before the cache changes."""

from __future__ import annotations

import itertools

import pytest
import torch
from support.oracle import oracle_attention
from support.tolerances import assert_rows

from dilated_attention import (
    DilatedKVCache,
    StaticDilatedKVCache,
    StaticWindowKVCache,
    WindowKVCache,
    attention,
    dilated_attention,
)

F64 = torch.float64
TIGHT = {"atol": 1e-12, "rtol": 1e-10}
KINDS = [WindowKVCache, StaticWindowKVCache]


def _tensors(n: int, heads: int = 4, kv_heads: int = 2, batch: int = 2, seed: int = 0) -> list:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, n, heads, 8), (batch, n, kv_heads, 8), (batch, n, kv_heads, 8), (heads,)]
    return [torch.randn(s, generator=gen, dtype=F64) for s in shapes]


def _decode(cache, q, k, v, mask, cuts, **options):  # type: ignore[no-untyped-def]
    """Every position through ``cache``: [0, cuts[0]) as a prompt, then one call per span
    [cuts[i], cuts[i+1]) (one token: a step); the outputs and lse joined."""
    outs, lses = [], []
    for lo, hi in itertools.pairwise([0, *cuts, q.shape[1]]):
        out, lse = attention(
            q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], is_causal=True, cache=cache,
            key_padding_mask=None if mask is None else mask[:, lo:hi], return_lse=True,
            **options,
        )  # fmt: skip
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=2)


def _assert_rows(out, lse, want, want_lse) -> None:  # type: ignore[no-untyped-def]
    assert_rows(out, lse, want, want_lse, **TIGHT)


@pytest.mark.parametrize("kind", KINDS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("window", [(5, 0), (3, 2), (0, 0)], ids=str)
@pytest.mark.parametrize("scores", ["plain", "capped_sinks"])
@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "mask"])
@pytest.mark.parametrize("backend", [None, "math"], ids=["auto", "math"])
def test_prompt_chunks_and_tokens_equal_the_full_causal_forward(
    kind: type, window: tuple[int, int], scores: str, masked: bool, backend: str | None
) -> None:
    """A prompt of 4, single tokens, a chunk of 9 (longer than the window), single tokens: the
    ring wraps several times; each row and lse is the oracle's full causal windowed forward."""
    n = 31
    q, k, v, sinks = _tensors(n)
    options = {"window_size": window, "backend": backend}
    if scores == "capped_sinks":
        options |= {"softcap": 1.5, "sinks": sinks}
    mask = None
    if masked:
        mask = torch.zeros(2, n, dtype=torch.bool)
        mask[1, :3] = True  # a left-padded row
        mask[0, [7, 8, 20]] = True
    scored = {name: value for name, value in options.items() if name != "backend"}
    want, want_lse = oracle_attention(q, k, v, is_causal=True, key_padding_mask=mask, **scored)
    cache = kind(window)
    cuts = [4, *range(5, 12), 21, *range(22, n)]
    with torch.no_grad():
        out, lse = _decode(cache, q, k, v, mask, cuts, **options)
    _assert_rows(out, lse, want, want_lse)
    assert cache.length == n


@pytest.mark.parametrize("kind", KINDS, ids=lambda c: c.__name__)
def test_the_cache_never_holds_more_than_the_window(kind: type) -> None:
    """Token by token over 200 positions (and a chunk): the rows held never exceed the window's
    ``left`` (the static ring: ``left + 1`` fixed rows), and the buffers' bytes stop growing
    once the window is full, whatever the length."""
    left, n = 6, 200
    q, k, v, _ = _tensors(n, batch=1)
    cache = kind((left, 0))
    sizes = []
    with torch.no_grad():
        for lo, hi in itertools.pairwise([0, 3, *range(4, 120), 150, *range(151, n + 1)]):
            attention(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], is_causal=True,
                      window_size=(left, 0), cache=cache)  # fmt: skip
            if kind is WindowKVCache:
                assert cache.key is not None and cache.key.shape[1] == min(hi, left)
                assert cache.length - cache.start == min(hi, left)
            else:
                assert cache.key is not None and cache.key.shape[1] == left + 1
            sizes.append(cache.nbytes)
    row_bytes = 2 * 2 * 8 * 8  # keys and values: 2 kv heads of 8 float64
    # The window plus the growing buffers' spare rows, or the ring and its (1,) positions:
    # the same bound at position 10 as at 200.
    bound = (left + 1 + cache.headroom) * row_bytes if kind is WindowKVCache else 7 * row_bytes + 8
    assert max(sizes) <= bound
    assert kind is WindowKVCache or sizes[-1] == sizes[1]


def test_rows_at_different_positions_decode_together() -> None:
    """Prompts of different lengths prefilled in static caches of their own, loaded as rows of
    one cache, then stepped together (each row at its own position, a ring that is full for
    one row and not yet for another): each row equals its own sequence's oracle."""
    window, n = (7, 0), 30
    q, k, v, sinks = _tensors(n, batch=3, seed=2)
    options = {"window_size": window, "softcap": 2.0, "sinks": sinks}
    want, want_lse = oracle_attention(q, k, v, is_causal=True, **options)
    prompts = {0: 3, 1: 12, 2: 3}  # row -> prompt length
    batch = StaticWindowKVCache(window)
    rows_out: dict[int, list] = {row: [] for row in prompts}
    with torch.no_grad():
        for length in sorted(set(prompts.values())):
            rows = torch.tensor([r for r, p in prompts.items() if p == length])
            own = StaticWindowKVCache(window)
            out, lse = attention(q[rows, :length], k[rows, :length], v[rows, :length],
                                 is_causal=True, cache=own, return_lse=True, **options)  # fmt: skip
            for i, row in enumerate(rows.tolist()):
                rows_out[row].append((out[i], lse[i]))
            batch.load_rows(rows, own, 3)
        for step in range(n - 12):
            pos = torch.tensor([prompts[row] + step for row in range(3)])
            token = [x[torch.arange(3), pos].unsqueeze(1) for x in (q, k, v)]
            out, lse = attention(*token, is_causal=True, cache=batch, return_lse=True, **options)
            for row in range(3):
                rows_out[row].append((out[row], lse[row]))
    for row, length in prompts.items():
        got = torch.cat([o for o, _ in rows_out[row]])
        got_lse = torch.cat([s for _, s in rows_out[row]], dim=1)
        end = length + n - 12
        _assert_rows(got, got_lse, want[row, :end], want_lse[row, :, :end])


@pytest.mark.parametrize("kind", KINDS, ids=lambda c: c.__name__)
def test_a_packed_prompt_continues_each_rows_last_document(kind: type) -> None:
    """``cu_seqlens`` with an empty cache: each document as if alone, and the cache takes each
    row's last document, which the next tokens continue exactly."""
    q, k, v, sinks = _tensors(24, seed=3)
    options = {"window_size": (4, 0), "softcap": 3.0, "sinks": sinks, "is_causal": True}
    cu = [0, 5, 14, 19, 28]  # row 0: documents of 5 and 9; row 1: 5 and 9 (last of 9 each)
    cache = kind((4, 0))
    with torch.no_grad():
        prompt = attention(q[:, :14], k[:, :14], v[:, :14], cu_seqlens=cu, cache=cache, **options)
        steps = [attention(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], cache=cache,
                           **options) for t in range(14, 24)]  # fmt: skip
    tail = [x[:, 5:24] for x in (q, k, v)]  # each row's last document and its continuation
    want, _ = oracle_attention(*tail, **options)
    torch.testing.assert_close(torch.cat([prompt[:, 5:], *steps], dim=1), want, **TIGHT)
    first, _ = oracle_attention(q[:, :5], k[:, :5], v[:, :5], **options)
    torch.testing.assert_close(prompt[:, :5], first, **TIGHT)


def test_gradients_through_a_growing_window_cache() -> None:
    """With gradients on, a prompt and a chunk through a WindowKVCache differentiate exactly:
    q, k, v and the sinks get the full forward's gradients."""
    q, k, v, sinks = _tensors(17, seed=4)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    options = {"window_size": (3, 0), "softcap": 2.0, "is_causal": True}
    cache = WindowKVCache((3, 0))
    parts = [attention(*(x[:, lo:hi] for x in leaves[:3]), sinks=leaves[3], cache=cache,
                       **options) for lo, hi in ((0, 6), (6, 11), (11, 12), (12, 17))]  # fmt: skip
    dout = torch.randn(2, 17, 4, 8, dtype=F64, generator=torch.Generator().manual_seed(5))
    grads = torch.autograd.grad(torch.cat(parts, dim=1), leaves, dout)
    ins64 = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    want, _ = oracle_attention(*ins64[:3], sinks=ins64[3], **options)
    want_grads = torch.autograd.grad(want, ins64, dout)
    for got, expected in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, expected, **TIGHT)


def test_the_static_step_compiles_once_into_one_graph() -> None:
    """``torch.compile(fullgraph=True)`` of a step: one graph serves every position (nothing
    read on the host), and its rows equal the eager step's."""
    q, k, v, _ = _tensors(40, seed=6)
    q, k, v = (x.float() for x in (q, k, v))
    caches = [StaticWindowKVCache((5, 0)) for _ in range(2)]
    compiles = []

    def counting_backend(gm, example_inputs):  # type: ignore[no-untyped-def]
        compiles.append(gm)
        return gm.forward

    def step(cache, q, k, v):  # type: ignore[no-untyped-def]
        return attention(q, k, v, is_causal=True, window_size=(5, 0), cache=cache)

    compiled = torch.compile(step, fullgraph=True, backend=counting_backend)
    with torch.no_grad():
        for cache in caches:
            step(cache, q[:, :3], k[:, :3], v[:, :3])
        for t in range(3, 40):
            token = (q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1])
            torch.testing.assert_close(compiled(caches[0], *token), step(caches[1], *token))
    assert len(compiles) == 1
    assert caches[0].lengths is not None and caches[0].lengths.tolist() == [40, 40]


def test_a_compiled_step_with_softcap_or_sinks_runs_eagerly() -> None:
    """Under torch.compile the operators take no soft-cap or sinks yet: the step runs eagerly
    between graphs (the eager rows), and ``fullgraph=True`` names the reason before the cache
    changes (a CUDA graph captures the eager step with them instead)."""
    q, k, v, sinks = (x.float() for x in _tensors(8))
    caches = [StaticWindowKVCache((3, 0)) for _ in range(3)]

    def step(cache, q, k, v):  # type: ignore[no-untyped-def]
        return attention(q, k, v, is_causal=True, window_size=(3, 0), cache=cache, sinks=sinks,
                         softcap=2.0)  # fmt: skip

    with torch.no_grad():
        for cache in caches:
            step(cache, q[:, :5], k[:, :5], v[:, :5])
        before = caches[0].key.clone()  # type: ignore[union-attr]
        with pytest.raises(Exception, match=r"run eagerly under torch\.compile"):
            torch.compile(step, fullgraph=True, backend="eager")(caches[0], q[:, 5:6], k[:, 5:6],
                                                                 v[:, 5:6])  # fmt: skip
        assert caches[0].length == 5 and torch.equal(caches[0].key, before)
        compiled = torch.compile(step, backend="eager")
        for t in range(5, 8):
            token = (q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1])
            torch.testing.assert_close(compiled(caches[1], *token), step(caches[2], *token))


def test_the_traced_dilated_step_refuses_softcap_and_sinks() -> None:
    """Where the static dilated step itself is traced (a torch.func transform: nothing runs
    eagerly inside one), soft-capping and sinks are a clear error before the cache changes;
    eagerly the same step applies them (the CUDA graph's path)."""
    q, k, v, sinks = (x.float() for x in _tensors(9))
    cache = StaticDilatedKVCache([4, 8], [1, 2])
    options = {"is_causal": True, "cache": cache, "softcap": 2.0, "sinks": sinks}
    with torch.no_grad():
        dilated_attention(q[:, :8], k[:, :8], v[:, :8], [4, 8], [1, 2], **options)

        def step(q, k, v):  # type: ignore[no-untyped-def]
            return dilated_attention(q, k, v, [4, 8], [1, 2], **options)

        with pytest.raises(ValueError, match="softcap and sinks are not supported in a compiled"):
            torch.func.vmap(step, in_dims=(None, None, 0))(q[:, 8:], k[:, 8:], v[:, 8:][None])
        assert cache.length == 8
        got = step(q[:, 8:], k[:, 8:], v[:, 8:])
    want = dilated_attention(q, k, v, [4, 8], [1, 2], is_causal=True, softcap=2.0, sinks=sinks)
    torch.testing.assert_close(got, want[:, 8:], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (dict(window_size=(2, 0)), ValueError, r"cache holds a layer with window_size=\(3, 0\)"),
        (dict(window_size=None), ValueError, r"got window_size=None"),
        (dict(is_causal=False), ValueError, "needs is_causal=True"),
        (dict(cache=DilatedKVCache([4], [1])), TypeError,
         "cache= of attention must be a WindowKVCache or a StaticWindowKVCache"),
        (dict(cache="cache"), TypeError, "cache must be a DilatedKVCache"),
        (dict(longer_key=True), ValueError, "the same length"),
    ],
    ids=["other_window", "no_window", "not_causal", "dilated_cache", "no_cache", "lengths"],
)  # fmt: skip
@pytest.mark.parametrize("kind", KINDS, ids=lambda c: c.__name__)
def test_bad_calls_raise_before_the_cache_changes(kind: type, call: dict, error, match) -> None:  # type: ignore[no-untyped-def]
    q, k, v, _ = _tensors(6)
    cache = kind((3, 0))
    with torch.no_grad():
        attention(q[:, :4], k[:, :4], v[:, :4], is_causal=True, window_size=(3, 0), cache=cache)
    options = {"is_causal": True, "window_size": (3, 0), "cache": cache}
    call = dict(call)
    keys = k[:, 4:] if call.pop("longer_key", False) else k[:, 4:5]
    options.update(call)
    with pytest.raises(error, match=match), torch.no_grad():
        attention(q[:, 4:5], keys, v[:, 4 : 4 + keys.shape[1]], **options)
    assert cache.length == 4


def test_a_window_cache_is_refused_by_dilated_attention() -> None:
    q = torch.randn(1, 3, 2, 4)
    with pytest.raises(TypeError, match="cache= of dilated_attention must be a DilatedKVCache"):
        dilated_attention(q, q, q, [4], [1], is_causal=True, cache=WindowKVCache((2, 0)))


@pytest.mark.parametrize(
    ("window", "error", "match"),
    [((-1, 0), ValueError, "window_size must bound the left side"),
     (None, ValueError, "window_size must bound the left side"),
     ((2,), TypeError, "window_size must be None or a pair"),
     ((2, -3), ValueError, "window_size sides must be >= 0")],
)  # fmt: skip
@pytest.mark.parametrize("kind", KINDS, ids=lambda c: c.__name__)
def test_bad_windows_at_construction(kind: type, window, error, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=match):
        kind(window)


def test_a_static_cache_refuses_dropout_gradients_and_a_traced_prompt() -> None:
    q, k, v, _ = (x.float() for x in _tensors(4))
    cache = StaticWindowKVCache((2, 0))
    options = {"is_causal": True, "window_size": (2, 0), "cache": cache}
    with pytest.raises(ValueError, match="decodes without dropout"):
        attention(q, k, v, dropout_p=0.1, **options)
    with pytest.raises(ValueError, match="decodes without gradients"):
        attention(q.requires_grad_(), k, v, **options)
    q = q.detach()
    with pytest.raises(ValueError, match="runs eagerly"):  # a prompt under a torch.func transform
        torch.func.vmap(lambda x: attention(x, k, v, **options))(q[None])
    assert cache.key is None
    with pytest.raises(ValueError, match=r"was made for max_length=3 tokens"), torch.no_grad():
        attention(q, k, v, **{**options, "cache": StaticWindowKVCache((2, 0), max_length=3)})
    with pytest.raises(ValueError, match=r"was made for max_length=3 tokens"), torch.no_grad():
        attention(q, k, v, **{**options, "cache": WindowKVCache((2, 0), max_length=3)})


@pytest.mark.gpu
@pytest.mark.parametrize("scores", ["plain", "capped_sinks"])
@pytest.mark.parametrize("kind", ["window", "dilated"])
def test_a_captured_step_replays_at_every_position(kind: str, scores: str) -> None:
    """The static step (a window cache's ring, or a dilated cache's, with soft-capping and
    sinks) captured once in a CUDA graph and replayed at later positions: each replay equals
    the eager step there (positions on the device, nothing read on the host)."""
    q, k, v, sinks = (x.to("cuda", torch.bfloat16) for x in _tensors(70, heads=8, seed=12))
    options: dict = {"is_causal": True}
    options |= {"softcap": 3.0, "sinks": sinks.float()} if scores == "capped_sinks" else {}
    if kind == "window":
        caches: list = [StaticWindowKVCache((15, 0)) for _ in range(2)]

        def call(cache, *x):  # type: ignore[no-untyped-def]
            return attention(*x, window_size=(15, 0), cache=cache, **options)
    else:
        caches = [StaticDilatedKVCache((16, 32), (1, 2)) for _ in range(2)]

        def call(cache, *x):  # type: ignore[no-untyped-def]
            return dilated_attention(*x, [16, 32], [1, 2], cache=cache, **options)

    with torch.no_grad():
        for cache in caches:
            call(cache, q[:, :20], k[:, :20], v[:, :20])
        static = [torch.zeros_like(x[:, :1]) for x in (q, k, v)]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            before = caches[0].lengths.clone()
            call(caches[0], *static)
            caches[0].lengths.copy_(before)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call(caches[0], *static)
        for t in range(20, 70):
            for buffer, x in zip(static, (q, k, v), strict=True):
                buffer.copy_(x[:, t : t + 1])
            graph.replay()
            want = call(caches[1], q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1])
            torch.testing.assert_close(out, want)
    assert caches[0].lengths.tolist() == [70, 70]
