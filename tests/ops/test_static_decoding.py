"""Decoding with a :class:`StaticDilatedKVCache` (Note [A decode step with static shapes] in
``core/decoding/static_cache.py``): a prompt, one-token steps and chunks give every row and lse of
the full causal forward (float64 oracle), with the buffers wrapping around many times, GQA, a
padding mask, and batch rows at different positions; the step compiles into one graph that is reused
at every position; bad input raises before the cache changes."""

from __future__ import annotations

import itertools

import pytest
import torch
from support.backend_params import CPU_BACKENDS, backend_id, skip_unless_runnable
from support.oracle import oracle_dilated_attention
from support.tolerances import TOLERANCES, assert_rows
from support.triton import KERNEL_DEVICES, skip_without_triton

from dilated_attention import DilatedKVCache, StaticDilatedKVCache, dilated_attention
from dilated_attention.backends import get_backend
from dilated_attention.core.decoding.decode import token_slots
from dilated_attention.core.geometry.schedule import Schedule
from dilated_attention.decode_step import decode_at

F64 = torch.float64
TIGHT = {"atol": 1e-10, "rtol": 1e-7}

#: (id, N, H, Hkv, segments, rates, max_length): buffers of max(w) rows wrap around N / max(w)
#: times; a max_length bounds them below the longest segment.
SCHEDULES = [
    ("ragged_w10r3_w16r6", 50, 6, 6, (10, 16), (3, 6), None),
    ("wraps_4x_gqa", 64, 4, 2, (8, 16), (1, 2), None),
    ("w_longer_than_max_length", 40, 4, 2, (16, 128), (1, 4), 40),
    ("rate_above_heads", 37, 2, 1, (8, 32), (1, 4), None),
]


def _tensors(n: int, heads: int, kv_heads: int, seed: int = 0, batch: int = 2) -> list:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, n, heads, 8), (batch, n, kv_heads, 8), (batch, n, kv_heads, 8)]
    return [torch.randn(s, generator=gen, dtype=F64) for s in shapes]


def _decode(cache: object, q, k, v, mask, segs, rates, cuts, backend=None, **scores) -> tuple:  # type: ignore[no-untyped-def]
    """Every position through ``cache``: positions [0, cuts[0]) as a prompt, then one call per
    span [cuts[i], cuts[i+1]) (one token: a step); the rows' outputs and lse joined.
    ``scores``: ``softcap`` and ``sinks``, when given."""
    outs, lses = [], []
    bounds = [0, *cuts, q.shape[1]]
    for lo, hi in itertools.pairwise(bounds):
        out, lse = dilated_attention(
            q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], list(segs), list(rates), is_causal=True,
            key_padding_mask=None if mask is None else mask[:, lo:hi], cache=cache,
            backend=backend, return_lse=True, **scores,
        )  # fmt: skip
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=2)


def _assert_rows(out, lse, want, want_lse) -> None:  # type: ignore[no-untyped-def]
    assert_rows(out, lse, want, want_lse, **TIGHT)


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "mask"])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=[s[0] for s in SCHEDULES])
@pytest.mark.parametrize("backend", CPU_BACKENDS, ids=backend_id)
def test_prompt_steps_and_chunks_equal_the_full_causal_forward(
    schedule: tuple, masked: bool, backend: str | None
) -> None:
    _, n, heads, kv_heads, segs, rates, max_length = schedule
    q, k, v = _tensors(n, heads, kv_heads)
    mask = None
    if masked:
        mask = torch.zeros(2, n, dtype=torch.bool)
        mask[1, :5] = True  # a left-padded row
        mask[0, 7] = True
    skip_unless_runnable(backend, q[:, :1], k, v, is_causal=False, key_padding_mask=mask)
    want, want_lse = oracle_dilated_attention(
        q, k, v, segs, rates, is_causal=True, key_padding_mask=mask
    )
    cache = StaticDilatedKVCache(segs, rates, max_length=max_length)
    cuts = [3, *range(4, 21), 31, *range(32, n)]  # a prompt, steps, a chunk of 11, steps
    with torch.no_grad():
        out, lse = _decode(cache, q, k, v, mask, segs, rates, cuts, backend)
    _assert_rows(out, lse, want, want_lse)
    assert cache.lengths is not None and cache.lengths.tolist() == [n, n]
    assert cache.key is not None and cache.key.shape == (2, cache.ring_rows, kv_heads, 8)


def test_a_static_step_equals_a_growing_cache_step_for_every_position() -> None:
    """Token by token from the first position: the same rows as ``DilatedKVCache``."""
    segs, rates = (4, 8, 16), (1, 2, 4)
    q, k, v = _tensors(45, 4, 2, seed=5)
    with torch.no_grad():
        static = _decode(StaticDilatedKVCache(segs, rates), q, k, v, None, segs, rates,
                         list(range(1, 45)))  # fmt: skip
        growing = _decode(DilatedKVCache(segs, rates), q, k, v, None, segs, rates,
                          list(range(1, 45)))  # fmt: skip
    _assert_rows(*static, *growing)


def test_rows_at_different_positions_decode_together() -> None:
    """Prompts of different lengths prefilled in caches of their own, loaded as the rows of one
    cache, then stepped together: each row equals its own sequence's full causal forward."""
    segs, rates, heads, kv_heads, n = (6, 12), (1, 3), 6, 3, 40
    q, k, v = _tensors(n, heads, kv_heads, seed=2, batch=3)
    want, want_lse = oracle_dilated_attention(q, k, v, segs, rates, is_causal=True)
    prompts = {0: 7, 1: 19, 2: 7}  # row -> prompt length
    batch = StaticDilatedKVCache(segs, rates)
    outs: dict[int, list] = {row: [] for row in prompts}
    with torch.no_grad():
        for length in sorted(set(prompts.values())):
            rows = torch.tensor([r for r, p in prompts.items() if p == length])
            own = StaticDilatedKVCache(segs, rates)
            out, lse = dilated_attention(
                q[rows, :length], k[rows, :length], v[rows, :length], list(segs), list(rates),
                is_causal=True, cache=own, return_lse=True,
            )  # fmt: skip
            for i, row in enumerate(rows.tolist()):
                outs[row].append((out[i], lse[i]))
            batch.load_rows(rows, own, 3)
        assert batch.lengths is not None and batch.lengths.tolist() == [7, 19, 7]
        for step in range(n - 19):
            pos = torch.tensor([prompts[row] + step for row in range(3)])
            rows = torch.arange(3)
            out, lse = dilated_attention(
                q[rows, pos].unsqueeze(1), k[rows, pos].unsqueeze(1), v[rows, pos].unsqueeze(1),
                list(segs), list(rates), is_causal=True, cache=batch, return_lse=True,
            )  # fmt: skip
            for row in range(3):
                outs[row].append((out[row], lse[row]))
    for row, length in prompts.items():
        got = torch.cat([o for o, _ in outs[row]])
        got_lse = torch.cat([s for _, s in outs[row]], dim=1)
        end = length + n - 19
        _assert_rows(got, got_lse, want[row, :end], want_lse[row, :, :end])


def test_the_step_compiles_once_into_one_graph() -> None:
    """``torch.compile(fullgraph=True)`` of a step: one compilation serves every position (the
    positions are a device tensor, the buffers keep their shapes), with the eager results."""
    segs, rates = (8, 16), (1, 2)
    q, k, v = (x.float() for x in _tensors(40, 4, 2, seed=7))
    compiles = []

    def counting_backend(gm, example_inputs):  # type: ignore[no-untyped-def]
        compiles.append(gm)
        return gm.forward

    cache = StaticDilatedKVCache(segs, rates)

    def step(qt, kt, vt):  # type: ignore[no-untyped-def]
        return dilated_attention(qt, kt, vt, list(segs), list(rates), is_causal=True, cache=cache)

    compiled = torch.compile(step, fullgraph=True, backend=counting_backend)
    eager_cache = StaticDilatedKVCache(segs, rates)
    with torch.no_grad():
        for c in (cache, eager_cache):
            dilated_attention(q[:, :5], k[:, :5], v[:, :5], list(segs), list(rates),
                              is_causal=True, cache=c)  # fmt: skip
        for t in range(5, 40):
            token = (q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1])
            got = compiled(*token)
            want = dilated_attention(*token, list(segs), list(rates), is_causal=True,
                                     cache=eager_cache)  # fmt: skip
            torch.testing.assert_close(got, want)
    assert len(compiles) == 1
    assert cache.lengths is not None and cache.lengths.tolist() == [40, 40]


def _prompted(segs=(8, 16), rates=(1, 2), **kwargs) -> tuple:  # type: ignore[no-untyped-def]
    q, k, v = _tensors(12, 4, 2, seed=9)
    cache = StaticDilatedKVCache(segs, rates, **kwargs)
    with torch.no_grad():
        dilated_attention(q[:, :10], k[:, :10], v[:, :10], list(segs), list(rates),
                          is_causal=True, cache=cache)  # fmt: skip
    return cache, q, k, v


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda q, k, v: (q[:1], k[:1], v[:1]), "buffers hold keys of"),
        (lambda q, k, v: (q.float(), k.float(), v.float()), "buffers hold keys of"),
        (lambda q, k, v: (q[..., :4], k[..., :4], v[..., :4]), "buffers hold keys of"),
    ],
    ids=["batch", "dtype", "head_dim"],
)
def test_a_step_of_other_shapes_raises_and_leaves_the_cache(change, match) -> None:  # type: ignore[no-untyped-def]
    cache, q, k, v = _prompted()
    key = cache.key.clone()
    with pytest.raises(ValueError, match=match), torch.no_grad():
        dilated_attention(*change(q[:, 10:11], k[:, 10:11], v[:, 10:11]), [8, 16], [1, 2],
                          is_causal=True, cache=cache)  # fmt: skip
    assert torch.equal(cache.key, key) and cache.lengths.tolist() == [10, 10]


def test_bad_calls_raise_before_the_cache_changes() -> None:
    cache, q, k, v = _prompted(max_length=11)
    token = (q[:, 10:11], k[:, 10:11], v[:, 10:11])
    with pytest.raises(ValueError, match="without gradients"):
        dilated_attention(token[0].requires_grad_(), *token[1:], [8, 16], [1, 2],
                          is_causal=True, cache=cache)  # fmt: skip
    with pytest.raises(ValueError, match="without dropout"), torch.no_grad():
        dilated_attention(*token, [8, 16], [1, 2], is_causal=True, cache=cache, dropout_p=0.1)
    with pytest.raises(ValueError, match="segment_lengths=\\[8, 16\\]"), torch.no_grad():
        dilated_attention(*token, [8, 32], [1, 2], is_causal=True, cache=cache)
    assert cache.lengths.tolist() == [10, 10]
    with torch.no_grad():
        dilated_attention(*token, [8, 16], [1, 2], is_causal=True, cache=cache)
        with pytest.raises(ValueError, match="max_length=11"):
            dilated_attention(*token, [8, 16], [1, 2], is_causal=True, cache=cache)
        with pytest.raises(ValueError, match="max_length=11"):
            dilated_attention(q[:, :2], k[:, :2], v[:, :2], [8, 16], [1, 2], is_causal=True,
                              cache=cache)  # fmt: skip
    assert cache.lengths.tolist() == [11, 11]


def test_rows_at_different_positions_refuse_a_chunk() -> None:
    cache, q, k, v = _prompted()
    cache.lengths[1] += 1  # as after loading rows of another prompt length
    with pytest.raises(ValueError, match="rows are at different positions"), torch.no_grad():
        dilated_attention(q[:, :2], k[:, :2], v[:, :2], [8, 16], [1, 2], is_causal=True,
                          cache=cache)  # fmt: skip


def test_a_prompt_under_torch_compile_raises() -> None:
    cache = StaticDilatedKVCache([8], [1])
    q, k, v = (x.float() for x in _tensors(4, 2, 2))

    def prompt(q, k, v):  # type: ignore[no-untyped-def]
        return dilated_attention(q, k, v, [8], [1], is_causal=True, cache=cache)

    with pytest.raises(Exception, match="runs eagerly"), torch.no_grad():
        torch.compile(prompt, fullgraph=True, backend="eager")(q, k, v)
    assert cache.key is None


def test_load_rows_refuses_another_layer_or_an_empty_cache() -> None:
    cache, *_ = _prompted()
    with pytest.raises(ValueError, match="load caches of one layer"):
        StaticDilatedKVCache([8, 32], [1, 2]).load_rows(torch.tensor([0]), cache, 2)
    with pytest.raises(ValueError, match="holds no tokens"):
        StaticDilatedKVCache([8, 16], [1, 2]).load_rows(
            torch.tensor([0]), StaticDilatedKVCache([8, 16], [1, 2]), 2
        )


def _held(cache: StaticDilatedKVCache) -> list:
    """Copies of a cache's buffers (None before they exist)."""
    held = (cache.key, cache.value, cache.lengths, cache.key_padding_mask)
    return [None if t is None else t.clone() for t in held]


#: (rows, source, batch, target, error, match): the source is a prompted cache of 2 rows (F64,
#: 2 kv heads of 8) unless named; the target a new cache, or one whose buffers a prompt of
#: (batch, dtype) made.
BAD_LOADS = {
    "source": ([0, 1], "a cache", 3, None, TypeError, "source must be a StaticDilatedKVCache"),
    "batch 0": ([0, 1], None, 0, None, ValueError, "batch must be a positive int, got 0"),
    "batch bool": ([0, 1], None, True, None, ValueError, "batch must be a positive int"),
    "other batch": ([0, 1], None, 3, (4, F64), ValueError,
                    r"batch must be the rows of this cache's buffers, 4, got batch=3"),
    "rows list": ([0, 1], None, 3, None, TypeError, r"rows must be a \(2,\) int64 tensor"),
    "rows float": (torch.tensor([0.0, 1.0]), None, 3, None, TypeError, "got dtype torch.float32"),
    "rows short": (torch.tensor([0]), None, 3, None, ValueError,
                   r"one per row of source, got shape \(1,\); pass 2 indices"),
    "rows range": (torch.tensor([0, 3]), None, 3, None, ValueError,
                   r"got \[0, 3\] \(3 is out of range\)"),
    "rows repeat": (torch.tensor([1, 1]), None, 3, None, ValueError, "an index repeats"),
    "other dtype": (torch.tensor([0, 1]), None, 3, (3, torch.float32), ValueError,
                    r"source holds keys of \(kv heads, head_dim, dtype, device\)"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_LOADS))
def test_load_rows_checks_its_arguments_before_any_work(case: str) -> None:
    rows, source, batch, made, error, match = BAD_LOADS[case]
    target = StaticDilatedKVCache([8, 16], [1, 2])
    if made is not None:  # buffers of its own, from a prompt of (batch, dtype)
        x = [t.to(made[1]) for t in _tensors(5, 4, 2, batch=made[0])]
        with torch.no_grad():
            dilated_attention(*x, [8, 16], [1, 2], is_causal=True, cache=target)
    before = _held(target)
    with pytest.raises(error, match=match):
        target.load_rows(rows, _prompted()[0] if source is None else source, batch)
    for got, want in zip(_held(target), before, strict=True):
        assert (got is None and want is None) or torch.equal(got, want)


def test_reset_keeps_the_buffers_and_forgets_the_tokens() -> None:
    cache, q, k, v = _prompted()
    key = cache.key
    cache.reset()
    assert cache.key is key and cache.lengths.tolist() == [0, 0] and cache.length == 0
    with torch.no_grad():
        out = dilated_attention(q[:, :3], k[:, :3], v[:, :3], [8, 16], [1, 2], is_causal=True,
                                cache=cache)  # fmt: skip
    want, _ = oracle_dilated_attention(q[:, :3], k[:, :3], v[:, :3], (8, 16), (1, 2),
                                       is_causal=True)  # fmt: skip
    torch.testing.assert_close(out, want, **TIGHT)
    cache.reset(drop=True)
    assert cache.key is None and cache.nbytes == 0


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCES[dtype]
    finite = ~torch.isneginf(want)
    assert torch.equal(torch.isneginf(got), ~finite)
    torch.testing.assert_close(got.double()[finite], want[finite], atol=tol.atol, rtol=tol.rtol)


@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_the_triton_kernel_reads_the_buffers_in_place(
    device: str, dtypes: list[torch.dtype], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Our kernel of the step (Note [A decode kernel reading the buffers in place]): GQA, a head
    dim that is no power of two, a padding mask, wrapping buffers, rows at different positions;
    each row and lse against the float64 oracle."""
    skip_without_triton(device)
    backend = get_backend("triton")
    calls: list[int] = []
    real = backend.decode_step
    monkeypatch.setattr(backend, "decode_step", lambda *a: calls.append(1) or real(*a))
    segs, rates, n = (10, 16), (3, 6), 44
    q, k, v = _tensors(n, 6, 3, seed=11, batch=3)
    q, k, v = (torch.nn.functional.pad(x, (0, 16)) + 0.1 for x in (q, k, v))  # D = 24
    mask = torch.zeros(3, n, dtype=torch.bool)
    mask[1, :5] = True
    mask[2, 9] = True
    want, want_lse = oracle_dilated_attention(
        q, k, v, segs, rates, is_causal=True, key_padding_mask=mask
    )
    prompts = (6, 6, 17)
    for dtype in dtypes:
        qd, kd, vd = (x.to(device=device, dtype=dtype) for x in (q, k, v))
        md = mask.to(device)
        batch = StaticDilatedKVCache(segs, rates)
        rows_out: dict[int, list] = {0: [], 1: [], 2: []}
        with torch.no_grad():
            for length, rows in ((6, [0, 1]), (17, [2])):
                own = StaticDilatedKVCache(segs, rates)
                index = torch.tensor(rows, device=device)
                dilated_attention(qd[index, :length], kd[index, :length], vd[index, :length],
                                  list(segs), list(rates), is_causal=True, cache=own,
                                  key_padding_mask=md[index, :length])  # fmt: skip
                batch.load_rows(index, own, 3)
            for step in range(n - 17):
                pos = torch.tensor([p + step for p in prompts], device=device)
                rows = torch.arange(3, device=device)
                token = [x[rows, pos].unsqueeze(1) for x in (qd, kd, vd)]
                out, lse = dilated_attention(
                    *token, list(segs), list(rates), is_causal=True, cache=batch,
                    key_padding_mask=md[rows, pos].unsqueeze(1), backend="triton",
                    return_lse=True,
                )  # fmt: skip
                for row in range(3):
                    rows_out[row].append((out[row, 0].cpu(), lse[row, :, 0].cpu()))
        for row, first in enumerate(prompts):
            got = torch.stack([o for o, _ in rows_out[row]])
            got_lse = torch.stack([s for _, s in rows_out[row]], dim=1)
            span = slice(first, first + n - 17)
            _close(got, want[row, span], dtype)
            _close(got_lse, want_lse[row, :, span], dtype)
    assert len(calls) == len(dtypes) * (n - 17)


@pytest.mark.gpu
def test_a_captured_step_replays_at_every_position() -> None:
    """The step captured once in a CUDA graph, replayed at later positions: each replay equals
    the eager step there (the positions live on the device; nothing is read on the host)."""
    segs, rates = (16, 64), (1, 4)
    q, k, v = (x.to("cuda", torch.bfloat16) for x in _tensors(90, 8, 2, seed=12))
    caches = [StaticDilatedKVCache(segs, rates) for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            dilated_attention(q[:, :20], k[:, :20], v[:, :20], list(segs), list(rates),
                              is_causal=True, cache=cache)  # fmt: skip
        static = [torch.zeros_like(x[:, :1]) for x in (q, k, v)]

        def step() -> torch.Tensor:
            return dilated_attention(*static, list(segs), list(rates), is_causal=True,
                                     cache=caches[0])  # fmt: skip

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            before = caches[0].lengths.clone()
            step()
            caches[0].lengths.copy_(before)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        for t in range(20, 90):
            for buffer, x in zip(static, (q, k, v), strict=True):
                buffer.copy_(x[:, t : t + 1])
            graph.replay()
            token = (q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1])
            want = dilated_attention(*token, list(segs), list(rates), is_causal=True,
                                     cache=caches[1])  # fmt: skip
            torch.testing.assert_close(out, want)
    assert caches[0].lengths.tolist() == [90, 90]


@pytest.mark.parametrize(
    ("device", "backend"),
    [pytest.param("cpu", None, id="cpu"),
     *[pytest.param(p.values[0], "triton", marks=p.marks, id=f"{p.id}-triton")
       for p in KERNEL_DEVICES]],
)  # fmt: skip
def test_rows_shifted_by_their_padding_read_their_own_positions(device: str, backend) -> None:  # type: ignore[no-untyped-def]
    """``decode_at`` over buffers someone else keeps (a transformers cache): row ``b``'s
    position ``x`` at slot ``x + pad_b`` (left padding), each row at its own position; the
    rows equal the oracle's full causal forward of each row's own sequence."""
    if backend is not None:
        skip_without_triton(device)
    segs, rates, n, pads = (4, 8), (1, 2), 21, [0, 5, 2]
    q, k, v = (x.float() for x in _tensors(n, 4, 2, seed=13, batch=3))
    want, _ = oracle_dilated_attention(*(x.double() for x in (q, k, v)), segs, rates,
                                       is_causal=True)  # fmt: skip
    slots = n + max(pads)
    buffers = [torch.zeros(3, slots, 2, 8) for _ in "kv"]
    for b, pad in enumerate(pads):
        for buffer, x in zip(buffers, (k, v), strict=True):
            buffer[b, pad : pad + n] = x[b]
    positions = torch.tensor([n - 1, 13, 7])
    token = q[torch.arange(3), positions].unsqueeze(1)
    with torch.no_grad():
        out = decode_at(*(x.to(device) for x in (token, *buffers, positions)),
                        Schedule(segs, rates), row_offsets=torch.tensor(pads).to(device),
                        backend=backend)  # fmt: skip
    torch.testing.assert_close(out[:, 0].double().cpu(), want[torch.arange(3), positions],
                               atol=1e-5, rtol=1e-5)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(16, 16, 128), (8, 2, 64)],
                         ids=["mha-d128", "gqa-d64"])  # fmt: skip
def test_the_decode_kernel_at_model_shapes_matches_the_oracle(
    dtype: torch.dtype, heads: int, kv_heads: int, dim: int
) -> None:
    """Our Triton step at the shapes models decode with (half precision, D 64 and 128, GQA; the
    interpreter tests run D 8-24 in float32, and tiles of other sizes compile differently):
    rows at different positions equal the float64 oracle's causal forward there."""
    segs, rates, n = (64, 256), (1, 4), 300
    gen = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(2, n, h, dim, generator=gen).to(dtype)
               for h in (heads, kv_heads, kv_heads))  # fmt: skip
    want, _ = oracle_dilated_attention(*(x.double() for x in (q, k, v)), segs, rates,
                                       is_causal=True)  # fmt: skip
    positions = torch.tensor([n - 1, 200])
    token = q[torch.arange(2), positions].unsqueeze(1)
    with torch.no_grad():
        out = decode_at(*(x.cuda() for x in (token, k, v, positions)), Schedule(segs, rates),
                        backend="triton")  # fmt: skip
    _close(out[:, 0].cpu(), want[torch.arange(2), positions], dtype)


@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_the_decode_kernel_skips_blocks_no_head_of_a_program_reads(
    device: str, dtypes: list[torch.dtype], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks of 16 slots, two blocks a run, a block mixing two branches: a program skips the
    blocks none of its heads reads (a branch of rate 4 is read by 1 in 4 heads; each key/value
    head serves 2) and still gives every row and lse of the float64 oracle, the positions
    chosen so that each branch is read by other heads."""
    from dilated_attention.backends.triton_kernels import decode as _triton_decode

    skip_without_triton(device)
    monkeypatch.setattr(_triton_decode, "_TILE_BYTES", 1)  # 16 slots a block
    monkeypatch.setattr(_triton_decode, "_runs_wanted", lambda device, rows: 2)
    segs, rates, n = (40, 96), (1, 4), 120  # 40 + 24 slots: 4 blocks, 2 runs
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(4, n, h, 32, generator=gen) for h in (6, 3, 3))
    want, want_lse = oracle_dilated_attention(*(x.double() for x in (q, k, v)), segs, rates,
                                              is_causal=True)  # fmt: skip
    positions = torch.tensor([119, 97, 58, 40])  # rate-4 offset classes 3, 1, 2, 0
    rows = torch.arange(4)
    for dtype in dtypes:
        token, kd, vd = (x.to(device=device, dtype=dtype) for x in (q[rows, positions], k, v))
        slots = token_slots(6, segs, rates, torch.device(device))
        out, lse = _triton_decode.decode_step(token.unsqueeze(1), kd, vd, None,
                                              positions.to(device), slots, 32**-0.5)  # fmt: skip
        _close(out[:, 0].cpu(), want[rows, positions], dtype)
        _close(lse[..., 0].cpu(), want_lse[rows, :, positions], dtype)


@pytest.mark.gpu
def test_a_step_compiled_with_cuda_graphs_equals_the_eager_step() -> None:
    """``torch.compile(mode="reduce-overhead")`` (CUDA graph trees, which refuse tensors their
    pool holds but does not track) of the static step: every replay equals the eager step."""
    segs, rates = (16, 64), (1, 4)
    q, k, v = (x.to("cuda", torch.bfloat16) for x in _tensors(60, 8, 2, seed=14))
    caches = [StaticDilatedKVCache(segs, rates) for _ in range(2)]

    def step(cache: StaticDilatedKVCache, *token: torch.Tensor) -> torch.Tensor:
        return dilated_attention(*token, list(segs), list(rates), is_causal=True, cache=cache)

    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for cache in caches:
            step(cache, q[:, :20], k[:, :20], v[:, :20])
        for t in range(20, 60):
            token = [x[:, t : t + 1] for x in (q, k, v)]
            got = compiled(caches[0], *token).clone()
            torch.testing.assert_close(got, step(caches[1], *token))
    assert caches[0].lengths.tolist() == [60, 60]


# -- soft-capping and sinks ------------------------------------------------------------------------
@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_the_triton_step_takes_softcap_and_sinks(
    device: str, dtypes: list[torch.dtype], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With soft-capping and sinks the static step still runs our one-launch kernel (the cap
    before the heads' masks, the sinks as one more run of the merge): every token's out and lse
    equal the float64 oracle's causal forward at its position (GQA, a padding mask, a head dim
    that is no power of two)."""
    skip_without_triton(device)
    backend = get_backend("triton")
    calls: list[int] = []
    real = backend.decode_step
    monkeypatch.setattr(backend, "decode_step", lambda *a: calls.append(1) or real(*a))
    segs, rates, n, prompt = (16, 48), (1, 3), 70, 20
    q, k, v = (torch.nn.functional.pad(x, (0, 16)) + 0.1 for x in _tensors(n, 6, 2, seed=2))
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(2), dtype=F64)
    mask = torch.zeros(2, n, dtype=torch.bool)
    mask[1, 3:9] = True
    for dtype in dtypes:
        exact = [x.to(dtype).to(F64) for x in (q, k, v)]
        want, want_lse = oracle_dilated_attention(
            *exact, segs, rates, is_causal=True, key_padding_mask=mask, softcap=3.0, sinks=sinks
        )
        cache = StaticDilatedKVCache(segs, rates, max_length=n)
        calls.clear()
        tensors = (x.to(device, dtype) for x in exact)
        with torch.no_grad():
            out, lse = _decode(cache, *tensors, mask.to(device), segs, rates,
                               list(range(prompt, n)), backend="triton",
                               softcap=3.0, sinks=sinks.to(device, torch.float32))  # fmt: skip
        assert len(calls) == n - prompt, "a step did not run the decode kernel"
        _close(out.cpu(), want, dtype)
        _close(lse.cpu(), want_lse, dtype)


def test_a_step_refuses_sinks_that_need_a_gradient() -> None:
    """The static step runs without autograd (its buffers are written in place): sinks that
    need a gradient are refused like a query that does, before the cache changes, never given
    none silently."""
    q, k, v = _tensors(12, 2, 2, seed=1, batch=1)
    learned = torch.zeros(2, dtype=F64, requires_grad=True)
    cache = StaticDilatedKVCache([4], [1], max_length=12)
    with torch.no_grad():
        dilated_attention(q[:, :11], k[:, :11], v[:, :11], [4], [1], is_causal=True,
                          cache=cache, sinks=learned)  # fmt: skip
    assert cache.lengths is not None
    before = cache.lengths.clone()
    with pytest.raises(ValueError, match="decodes without gradients"):
        dilated_attention(q[:, 11:], k[:, 11:], v[:, 11:], [4], [1], is_causal=True,
                          cache=cache, sinks=learned)  # fmt: skip
    assert torch.equal(cache.lengths, before)
