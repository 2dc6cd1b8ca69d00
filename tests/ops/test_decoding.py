"""Decoding: queries shorter than the keys are the last positions of the causal call (Note
[Decoding rows] in ``core/decoding/decode.py``). Every row, its lse and every gradient equal the
float64 oracle's rows of the full causal forward over all the keys; ragged segments, ``w > N``, ``r
> H``, GQA, left padding, token-by-token growth and double backward."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from support.backend_params import CPU_BACKENDS, backend_id, skip_unless_runnable
from support.oracle import oracle_dilated_attention
from support.tolerances import assert_close_to_oracle

from dilated_attention import DilatedKVCache, dilated_attention
from dilated_attention.core.decoding import decode
from dilated_attention.core.decoding.decode import DecodeTokenCall, decode_plan, decode_token_plan
from dilated_attention.core.geometry.segment import effective_branches

F64 = torch.float64
TIGHT = {"atol": 1e-10, "rtol": 1e-7}

#: (id, N, H, Hkv, segments, rates)
SCHEDULES = [
    ("ragged_w10r3_w16r6", 50, 6, 6, (10, 16), (3, 6)),
    ("w_longer_than_n", 40, 4, 2, (16, 128), (1, 4)),
    ("rate_above_heads", 37, 2, 1, (8, 32), (1, 4)),
    ("longnet_like", 64, 8, 2, (8, 16, 32, 64), (1, 2, 4, 8)),
]


@pytest.fixture(params=[False, True], ids=["per_branch", "one_call"])
def one_call(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Decode single tokens without gradients per branch, or as one call (Note [One call per
    decoded token]; made on the GPU only, so the CPU suite turns it on to test it here)."""
    if request.param:
        monkeypatch.setattr(decode, "ONE_CALL_DEVICE_TYPES", frozenset({"cpu", "cuda"}))
    return request.param


def _tensors(n: int, heads: int, kv_heads: int, seed: int = 0, dim: int = 8) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(2, n, heads, dim), (2, n, kv_heads, dim), (2, n, kv_heads, dim)]
    return [torch.randn(s, generator=gen, dtype=F64) for s in shapes]


@pytest.mark.parametrize("query_len", [1, 3, 7, 23])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=[s[0] for s in SCHEDULES])
@pytest.mark.parametrize("backend", CPU_BACKENDS, ids=backend_id)
def test_last_rows_equal_the_full_causal_forward(
    schedule: tuple, query_len: int, backend: str | None
) -> None:
    _, n, heads, kv_heads, segs, rates = schedule
    q, k, v = _tensors(n, heads, kv_heads)
    tail = q[:, n - query_len :].clone().requires_grad_()
    keys = [t.clone().requires_grad_() for t in (k, v)]
    skip_unless_runnable(backend, tail, *keys, is_causal=query_len > 1, key_padding_mask=None)
    out, lse = dilated_attention(
        tail, *keys, list(segs), list(rates), is_causal=True, backend=backend, return_lse=True
    )
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (tail, *keys), dout)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    full, full_lse = oracle_dilated_attention(*leaves, segs, rates, is_causal=True)
    want_grads = torch.autograd.grad(full[:, n - query_len :], leaves, dout)
    torch.testing.assert_close(out, full[:, n - query_len :].detach(), **TIGHT)
    want_lse = full_lse[:, :, n - query_len :]
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    torch.testing.assert_close(lse[~torch.isneginf(lse)], want_lse[~torch.isneginf(want_lse)])
    torch.testing.assert_close(grads[0], want_grads[0][:, n - query_len :], **TIGHT)
    for got, want in zip(grads[1:], want_grads[1:], strict=True):
        torch.testing.assert_close(got, want, **TIGHT)


@pytest.mark.parametrize("schedule", SCHEDULES, ids=[s[0] for s in SCHEDULES])
def test_token_by_token_equals_the_full_forward(
    schedule: tuple, one_call: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Growing the keys one position at a time (each step decodes its one new token) gives every
    row and lse of the full causal forward, the segments following the growing length (``w > N``
    is one segment while the sequence is short), with a left-padded row and an ignored key."""
    _, n, heads, kv_heads, segs, rates = schedule
    q, k, v = _tensors(n, heads, kv_heads, seed=3)
    mask = torch.zeros(2, n, dtype=torch.bool)
    mask[1, :5] = True
    mask[0, 7] = True
    full, full_lse = oracle_dilated_attention(
        q, k, v, segs, rates, is_causal=True, key_padding_mask=mask
    )
    from dilated_attention.core.decoding import decode

    plans: list[int] = []
    monkeypatch.setattr(
        decode, "decode_token_plan",
        lambda *args: plans.append(1) or decode_token_plan(*args),
    )  # fmt: skip
    steps = [
        dilated_attention(
            q[:, t : t + 1], k[:, : t + 1], v[:, : t + 1], list(segs), list(rates),
            is_causal=True, key_padding_mask=mask[:, : t + 1], return_lse=True,
        )
        for t in range(n)
    ]  # fmt: skip
    assert len(plans) == (n - 1 if one_call else 0)  # position 0 is the whole sequence
    torch.testing.assert_close(torch.cat([o for o, _ in steps], dim=1), full, **TIGHT)
    lse = torch.cat([part for _, part in steps], dim=2)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(full_lse))
    torch.testing.assert_close(lse[~torch.isneginf(lse)], full_lse[~torch.isneginf(full_lse)])


def test_one_call_plan_of_a_token_has_one_shape_per_doubling() -> None:
    """The one-call plan of a token (Note [One call per decoded token]) reads, per branch, slots
    of keys at or before the token; a head reads a branch's slots only when its offset class is
    the token's, and every key of its segment and class up to the token. Its branches have the
    layer's geometry at this length, and its shape changes once per doubling of the context
    while the context is shorter than the longest segment (then never)."""
    segs, rates, heads = (16, 32, 64), (1, 4, 8), 8
    shapes = {}
    for key_len in [*range(1, 70), 100, 127, 128, 129, 200, 1000]:
        plan = decode_token_plan(key_len, heads, segs, rates, torch.device("cpu"))
        (call,) = plan.calls
        assert isinstance(call, DecodeTokenCall)
        shapes[key_len] = call.positions.shape
        layer = effective_branches(key_len, heads, segs, rates)
        used = effective_branches(key_len, heads, *zip(*call.branches, strict=True))
        assert used == layer, (key_len, call.branches)  # the same geometry at this length
        widths = [-(-w // r) for w, r in call.branches]
        assert call.positions.shape == (sum(widths),) and call.ignore.shape == (heads, sum(widths))
        assert int(call.positions.max()) == key_len - 1 and int(call.positions.min()) >= 0
        reads = ~call.ignore  # (H, K)
        for (w, r), piece, pos in zip(
            call.branches, reads.split(widths, 1), call.positions.split(widths), strict=True
        ):  # fmt: skip
            t0 = ((key_len - 1) // w) * w
            offset = (key_len - 1 - t0) % r
            want = torch.tensor([h % r == offset for h in range(heads)])
            assert torch.equal(piece.any(dim=1), want)
            keys = pos[piece.any(dim=0)]
            assert torch.equal(keys, torch.arange(t0 + offset, key_len, r))
    assert len({shapes[n] for n in range(1, 65)}) == 7  # 1, 2, 4, ..., 64 positions
    assert len({shapes[n] for n in (64, 65, 100, 128, 200, 1000)}) == 1


def test_left_padding_mask_over_the_keys() -> None:
    """A (B, N) key padding mask (batch 1 left-padded by 5) applies to the decoded rows as to
    the full forward's."""
    _, n, heads, kv_heads, segs, rates = SCHEDULES[3]
    q, k, v = _tensors(n, heads, kv_heads, seed=5)
    mask = torch.zeros(2, n, dtype=torch.bool)
    mask[1, :5] = True
    full, _ = oracle_dilated_attention(q, k, v, segs, rates, is_causal=True, key_padding_mask=mask)
    out = dilated_attention(
        q[:, -4:], k, v, list(segs), list(rates), is_causal=True, key_padding_mask=mask
    )
    torch.testing.assert_close(out, full[:, -4:], **TIGHT)


def test_double_backward_through_decoding() -> None:
    q, k, v = (t[:1, :20, :2].clone().requires_grad_() for t in _tensors(20, 4, 4, seed=7))
    tail = q[:, -2:].detach().clone().requires_grad_()
    assert torch.autograd.gradgradcheck(
        lambda a, b, c: dilated_attention(a, b, c, [8, 16], [1, 2], is_causal=True),
        (tail, k, v),
    )


def test_a_new_token_reads_at_most_w_over_r_keys_per_branch() -> None:
    """At a million positions the plan of one new token reads sum over branches of
    ceil(w / r) keys, built without touching the earlier positions."""
    key_len, heads = 2**20 + 123, 16
    segs, rates = effective_branches(key_len, heads, (2048, 8192, 32768), (1, 4, 16))
    plan = decode_plan(1, key_len, heads, 4, segs, rates, torch.device("cpu"))
    sizes = [call.kv_pos.numel() for call in plan.calls]
    assert len(sizes) == 3
    assert all(size <= math.ceil(w / r) for size, w, r in zip(sizes, segs, rates, strict=True))
    assert all(int(call.kv_pos.max()) == key_len - 1 for call in plan.calls)


def test_a_chunk_is_a_few_calls_per_branch_and_offset_class_whatever_its_length() -> None:
    """Chunked prefill: 4,096 new positions after a million are at most two calls per (branch,
    segment, offset class) (keys before the chunk; the chunk's own keys, causal), each reading
    at most ceil(w / r) keys of its branch, and every (position, head) a branch covers is the
    query of exactly one call that reads its own key (Note [Decoding rows])."""
    key_len, query_len, heads = 2**20 + 4096, 4096, 16
    segs, rates = effective_branches(key_len, heads, (2048, 8192, 32768), (1, 4, 16))
    branches = list(zip(segs, rates, strict=True))
    plan = decode_plan(query_len, key_len, heads, 4, segs, rates, torch.device("cpu"))
    bound = sum(2 * (query_len // w + 2) * min(r, heads) for w, r in branches)
    assert len(plan.calls) <= bound
    longest = max(math.ceil(w / r) for w, r in branches)
    assert all(c.kv_pos.numel() <= longest for c in plan.calls)
    first = key_len - query_len
    covered = torch.zeros(query_len, heads, dtype=torch.long)
    for call in plan.calls:
        if call.causal or call.q_pos.numel() == 1:  # the calls that read the queries' own keys
            rows = call.q_flat.view(-1)
            covered.view(-1).index_add_(0, rows, torch.ones_like(rows))
    pos = torch.arange(first, key_len).view(-1, 1)
    head = torch.arange(heads).view(1, -1)
    expected = sum(((pos % w) % r == head % r).long() for w, r in branches)
    assert torch.equal(covered, expected)


@pytest.mark.parametrize(
    ("query_len", "is_causal", "match"),
    [
        (21, True, r"query may be shorter than key .* but not longer"),
        (3, False, r"needs is_causal=True"),
    ],
)
def test_lengths_that_are_not_decoding_raise(query_len: int, is_causal: bool, match: str) -> None:
    q, k, v = _tensors(20, 2, 2)
    with pytest.raises(ValueError, match=match):
        dilated_attention(
            torch.randn(2, query_len, 2, 8, dtype=F64), k, v, [8], [2], is_causal=is_causal
        )
    with pytest.raises(ValueError, match=r"key_padding_mask"):
        dilated_attention(
            q[:, -1:], k, v, [8], [2], is_causal=True,
            key_padding_mask=torch.zeros(2, 1, dtype=torch.bool),
        )  # fmt: skip


# -- the bounded cache ----------------------------------------------------------------------------
@pytest.mark.parametrize("grad_mode", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=[s[0] for s in SCHEDULES])
def test_cache_chunks_equal_the_full_forward_and_stay_bounded(
    schedule: tuple, grad_mode: bool, one_call: bool
) -> None:
    """Prompt then chunks and single tokens through one ``DilatedKVCache``: every row equals the
    full causal forward, and after each call the cache holds only rows later tokens read (fewer
    than the longest segment), in buffers of at most that plus twice the headroom, or twice it
    plus the longest chunk. Without grad mode rows are written in place; a headroom of 3 makes
    the buffers move and grow often."""
    _, n, heads, kv_heads, segs, rates = schedule
    q, k, v = _tensors(n, heads, kv_heads, seed=11)
    full, _ = oracle_dilated_attention(q, k, v, segs, rates, is_causal=True)
    cache = DilatedKVCache(segs, rates)
    cache.headroom = 3
    chunks = [n // 3, 1, 1, 4, 1, 2, 1, 3, 1, 1, 2, 1, 1]
    chunks.append(n - sum(chunks))
    outs, t = [], 0
    row_bytes = 2 * kv_heads * 8 * 8  # keys and values of one position, float64
    with torch.set_grad_enabled(grad_mode):
        for size in chunks:
            piece = [x[:, t : t + size] for x in (q, k, v)]
            outs.append(dilated_attention(*piece, list(segs), list(rates), is_causal=True,
                                          cache=cache))  # fmt: skip
            t += size
            assert cache.length == t and cache.key is not None and cache.value is not None
            held = cache.key.shape[1]
            assert held == t - cache.start < max(segs), (held, t)
            assert cache.start == min((t // w) * w for w in segs)
            assert torch.equal(cache.key, k[:, cache.start : t])
            assert torch.equal(cache.value, v[:, cache.start : t])
            bound = max(max(segs) + 2 * cache.headroom, 2 * max(segs) + max(chunks))
            assert cache.nbytes <= 2 * bound * row_bytes  # batch 2
    torch.testing.assert_close(torch.cat(outs, dim=1), full, **TIGHT)


@pytest.mark.parametrize("grad_mode", [True, False], ids=["grad", "no_grad"])
def test_cache_keeps_the_masks_of_its_keys(grad_mode: bool, one_call: bool) -> None:
    """Left-padded prompts, then chunks and tokens (one of them masked) through one cache, each
    call with the mask of its new keys: every row equals the full forward under the whole mask,
    and the cache drops its mask rows with its keys."""
    _, n, heads, kv_heads, segs, rates = SCHEDULES[0]
    q, k, v = _tensors(n, heads, kv_heads, seed=13)
    mask = torch.zeros(2, n, dtype=torch.bool)
    mask[1, :7] = True  # the second sequence is left-padded by 7
    mask[0, 30] = True  # and one later key of the first is ignored
    full, _ = oracle_dilated_attention(q, k, v, segs, rates, is_causal=True, key_padding_mask=mask)
    cache, outs, t = DilatedKVCache(segs, rates), [], 0
    cache.headroom = 2
    for size in (12, 1, 2, 1, 1, 9, 1, 17, n - 44):
        piece = [x[:, t : t + size] for x in (q, k, v)]
        chunk_mask = mask[:, t : t + size] if t != 12 else None  # None: none ignored
        with torch.set_grad_enabled(grad_mode):
            outs.append(dilated_attention(*piece, list(segs), list(rates), is_causal=True,
                                          key_padding_mask=chunk_mask, cache=cache))  # fmt: skip
        t += size
        assert cache.key_padding_mask is not None and cache.key is not None
        assert cache.key_padding_mask.shape == cache.key.shape[:2]
        assert torch.equal(cache.key_padding_mask, mask[:, cache.start : t])
    torch.testing.assert_close(torch.cat(outs, dim=1), full, **TIGHT)


def test_cache_moves_between_inference_mode_and_no_grad() -> None:
    """A prompt under ``torch.inference_mode`` then tokens under ``torch.no_grad`` (and back):
    buffers made in inference mode are not written in place outside it."""
    _, n, heads, kv_heads, segs, rates = SCHEDULES[3]
    q, k, v = _tensors(n, heads, kv_heads, seed=19)
    full, _ = oracle_dilated_attention(q, k, v, segs, rates, is_causal=True)
    cache, outs, t = DilatedKVCache(segs, rates), [], 0
    for size, mode in ((30, torch.inference_mode), (1, torch.no_grad), (1, torch.inference_mode),
                       (2, torch.no_grad), (n - 34, torch.no_grad)):  # fmt: skip
        piece = [x[:, t : t + size] for x in (q, k, v)]
        with mode():
            outs.append(dilated_attention(*piece, list(segs), list(rates), is_causal=True,
                                          cache=cache).clone())  # fmt: skip
        t += size
    torch.testing.assert_close(torch.cat(outs, dim=1), full, **TIGHT)


def test_cache_refuses_what_it_cannot_extend() -> None:
    q, k, v = _tensors(12, 4, 2)
    cache = DilatedKVCache([8, 16], [1, 2])
    dilated_attention(q[:, :6], k[:, :6], v[:, :6], [8, 16], [1, 2], is_causal=True, cache=cache)
    cases = [
        ((q[:, 6:], k[:, 6:], v[:, 6:], [8, 32], [1, 2]), {}, r"use one cache per layer"),
        ((q[:1, 6:], k[:1, 6:], v[:1, 6:], [8, 16], [1, 2]), {}, r"another batch or model"),
        ((q[:, 6:], k[:, 6:], v[:, 6:], [8, 16], [1, 2]), {"is_causal": False}, r"is_causal"),
        ((q[:, 11:], k[:, 6:], v[:, 6:], [8, 16], [1, 2]), {}, r"the same length"),
        (
            (q[:, 6:], k[:, 6:], v[:, 6:], [8, 16], [1, 2]),
            {"key_padding_mask": torch.zeros(2, 12, dtype=torch.bool)},
            r"key_padding_mask",
        ),
    ]
    for args, options, match in cases:
        with pytest.raises(ValueError, match=match):
            dilated_attention(*args, **{"is_causal": True, "cache": cache, **options})
    assert cache.length == 6, "a refused call must leave the cache as it was"
    with pytest.raises(TypeError, match=r"cache must be a DilatedKVCache"):
        dilated_attention(q, k, v, [8], [1], is_causal=True, cache={})  # type: ignore[arg-type]


def test_cache_buffers_grow_with_what_they_hold() -> None:
    """Without grad mode the buffers hold the rows kept plus spare rows proportional to them
    (at least 16), not an eighth of the longest segment up front (268 MB after 3 tokens with a
    segment of 2**20): 3 tokens take a few KB, and single tokens past the longest segment grow
    them geometrically (a few reallocations), never beyond the segment plus headroom."""
    q, k, v = _tensors(300, 4, 2, seed=23)
    row_bytes = 2 * 2 * 2 * 8 * 8  # batch 2, keys and values of 2 heads of 8, float64
    cache = DilatedKVCache([2**20], [1])
    with torch.no_grad():
        dilated_attention(q[:, :3], k[:, :3], v[:, :3], [2**20], [1], is_causal=True,
                          cache=cache)  # fmt: skip
    assert cache.nbytes <= (3 + 16) * row_bytes, cache.nbytes
    segs, rates = [8, 64], [1, 2]
    full, _ = oracle_dilated_attention(q, k, v, segs, rates, is_causal=True)
    cache, outs, buffers = DilatedKVCache(segs, rates), [], set()
    with torch.no_grad():
        for t in range(300):
            piece = [x[:, t : t + 1] for x in (q, k, v)]
            outs.append(dilated_attention(*piece, segs, rates, is_causal=True, cache=cache))
            assert cache.key is not None
            held = cache.key.shape[1]
            assert cache.nbytes <= max(2 * held, held + 16, 64 + cache.headroom) * row_bytes
            buffers.add(cache._buffers[0].data_ptr())
    assert len(buffers) <= 4, len(buffers)  # 16, 32, 64 and 128 rows
    torch.testing.assert_close(torch.cat(outs, dim=1), full, **TIGHT)


def test_cache_refuses_rows_no_memory_holds_before_any_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A segment of 2**40 would make the cache hold up to 2**40 rows (4.4 TB up front before):
    its buffers grow with what they hold instead, and a call whose rows the device's memory
    cannot hold (a 16 KB device here) raises ValueError naming ``segment_lengths``, the bytes
    and ``max_length``, leaving the cache as it was. With ``max_length`` the cache is bounded
    by it and decodes as the full forward (the segment is one segment of the sequence); a call
    past it raises."""
    from dilated_attention.core.decoding import kv_cache

    q, k, v = _tensors(24, 4, 2, seed=29)
    cache = DilatedKVCache([8, 2**40], [1, 2])
    with torch.no_grad():
        dilated_attention(q[:, :3], k[:, :3], v[:, :3], [8, 2**40], [1, 2], is_causal=True,
                          cache=cache)  # fmt: skip
    assert cache.nbytes < 20 * 2 * (2 * 2 * 8 * 8 + 1)  # 3 rows and their spares, not 2**40
    monkeypatch.setattr(kv_cache, "device_memory", lambda device: 16 * 1024)
    with pytest.raises(ValueError, match=r"segment_lengths.*bytes.*max_length") as info:
        dilated_attention(q[:, 3:24], k[:, 3:24], v[:, 3:24], [8, 2**40], [1, 2],
                          is_causal=True, cache=cache)  # fmt: skip
    needed = 48 * 2 * (2 * 2 * 8 * 8 + 1)  # twice 24 rows x batch x (keys, values, mask)
    assert f"{needed:,} bytes" in str(info.value), str(info.value)
    assert cache.length == 3 and cache.key.shape[1] == 3
    monkeypatch.undo()
    full, _ = oracle_dilated_attention(q, k, v, [8, 2**40], [1, 2], is_causal=True)
    cache, outs, t = DilatedKVCache([8, 2**40], [1, 2], max_length=24), [], 0
    with torch.no_grad():
        for size in (5, 1, 1, 9, 1, 7):
            piece = [x[:, t : t + size] for x in (q, k, v)]
            outs.append(dilated_attention(*piece, [8, 2**40], [1, 2], is_causal=True,
                                          cache=cache))  # fmt: skip
            t += size
            assert cache.nbytes <= 24 * (2 * 2 * 2 * 8 * 8)
    torch.testing.assert_close(torch.cat(outs, dim=1), full, **TIGHT)
    with pytest.raises(ValueError, match=r"max_length=24"):
        dilated_attention(q[:, :1], k[:, :1], v[:, :1], [8, 2**40], [1, 2], is_causal=True,
                          cache=cache)  # fmt: skip
    assert cache.length == 24
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=r"max_length"):
            DilatedKVCache([8], [1], max_length=bad)  # type: ignore[arg-type]


def test_decoding_reads_a_caches_rows_without_copying_them_whole() -> None:
    """With a batch of 2 a cache's held rows are a non-contiguous view of its buffers; decoding
    gathers each call's rows from that view instead of copying all of it per token."""
    from dilated_attention.resolve.strategy import rows_in_place

    q, k, v = _tensors(30, 4, 2)
    cache = DilatedKVCache([8, 16], [1, 2])
    with torch.no_grad():
        dilated_attention(q[:, :20], k[:, :20], v[:, :20], [8, 16], [1, 2], is_causal=True,
                          cache=cache)  # fmt: skip
        dilated_attention(q[:, 20:21], k[:, 20:21], v[:, 20:21], [8, 16], [1, 2],
                          is_causal=True, cache=cache)  # fmt: skip
    held = cache.key
    assert held is not None and not held.is_contiguous()
    assert rows_in_place(held) is held
    hf_layout = k.transpose(1, 2).contiguous().transpose(1, 2)  # (B, N, H, D) view of (B, H, N, D)
    assert rows_in_place(hf_layout) is not hf_layout


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [None, "sdpa_cudnn", "triton", "flash_attn4"], ids=backend_id)
def test_cuda_cached_decoding_matches_the_oracle(backend: str | None) -> None:
    """On the GPU in bf16: a prompt, chunks and single tokens through a cache (buffers written in
    place, chunks as square causal calls) match the float64 oracle within the bf16 budget, on
    each kernel (FlashAttention-4 where installed: per-branch calls on views, as it takes no
    key mask for the one-call token)."""
    _, n, heads, kv_heads, segs, rates = SCHEDULES[3]
    q, k, v = (t.to(torch.bfloat16) for t in _tensors(n, heads, kv_heads, seed=17, dim=64))
    skip_unless_runnable(backend, *(x.cuda() for x in (q, k, v)), is_causal=True,
                         key_padding_mask=None)  # fmt: skip
    ref, _ = oracle_dilated_attention(q, k, v, segs, rates, is_causal=True)
    low, _ = oracle_dilated_attention(q, k, v, segs, rates, is_causal=True,
                                      compute_dtype=torch.bfloat16)  # fmt: skip
    dev = [t.cuda() for t in (q, k, v)]
    cache = DilatedKVCache(segs, rates)
    cache.headroom = 4
    outs, t = [], 0
    with torch.no_grad():
        for size in (20, 1, 7, 1, 1, 9, 1, n - 40):
            piece = [x[:, t : t + size] for x in dev]
            outs.append(dilated_attention(*piece, list(segs), list(rates), is_causal=True,
                                          cache=cache, backend=backend))  # fmt: skip
            t += size
    got = torch.cat(outs, dim=1).cpu()
    assert_close_to_oracle(got, ref, low, name="out", dtype=torch.bfloat16)


def test_decoding_calls_read_views_for_kernels_that_take_strided_rows() -> None:
    """With ``views`` (a kernel that reads strided rows) a token's calls slice q and k (every
    r-th position and head, their own key/value heads), except where the GQA grouping has no
    strided key/value slice (H = 6, Hkv = 2, r = 2): those gather. Either way the rows equal the
    full forward (the backend tests above run both)."""
    from dilated_attention.core.decoding.decode import DecodeCall, DecodeViewCall

    plan = decode_plan(3, 40, 6, 2, (8, 16), (2, 3), torch.device("cpu"), 0, True)
    kinds = {type(call) for call in plan.calls}
    assert kinds == {DecodeCall, DecodeViewCall}
    k = torch.randn(2, 40, 2, 8)
    for call in plan.calls:
        if isinstance(call, DecodeViewCall):
            assert call.kv_rows(k)._base is k  # a view: nothing gathered
    assert all(
        isinstance(c, DecodeCall)
        for c in decode_plan(3, 40, 6, 2, (8, 16), (2, 3), torch.device("cpu"), 0).calls
    )


@pytest.mark.gpu
def test_cuda_chunked_prefill_memory_is_bounded_by_the_chunk() -> None:
    """A prompt through a cache in chunks allocates, beyond the inputs and the cache, memory of
    the order of a chunk, not of the prompt: a 16x longer prompt than the chunk peaks far below
    one causal forward over all of it."""
    segs, rates, heads, dim, length, chunk = [512, 1024, 2048], [1, 2, 4], 4, 64, 65536, 4096
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, length, heads, dim, device="cuda", dtype=torch.bfloat16,
                           generator=gen) for _ in "qkv")  # fmt: skip
    chunk_bytes = chunk * heads * dim * q.element_size()

    def peak_above_now(fn: Callable[[], object]) -> int:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    cache = DilatedKVCache(segs, rates)

    def chunked() -> None:
        for a in range(0, length, chunk):
            piece = [x[:, a : a + chunk] for x in (q, k, v)]
            dilated_attention(*piece, segs, rates, is_causal=True, cache=cache)

    with torch.no_grad():
        chunked_peak = peak_above_now(chunked)
        full_peak = peak_above_now(lambda: dilated_attention(q, k, v, segs, rates, is_causal=True))
    assert chunked_peak <= cache.nbytes + 16 * chunk_bytes, (chunked_peak, cache.nbytes)
    assert chunked_peak < full_peak / 2, (chunked_peak, full_peak)
