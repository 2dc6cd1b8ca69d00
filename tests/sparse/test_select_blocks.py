"""``select_blocks``: MoBA's gate per query block, against a readable float64 re-implementation
(loops over rows, heads and blocks) and the selection's properties: the own block kept when
causal, nothing after a causal query, exactly ``min(topk, candidates)`` more blocks, a planted
matching block found; GQA per query head and per key/value head, partial last blocks, packed
documents, end-aligned causal queries; bad arguments; no value read on the host.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import Tensor

from dilated_attention.sparse import select_blocks


def _mean(rows: list[Tensor]) -> Tensor:
    return sum(rows) / len(rows)


def _document_of(cu_seqlens: list[int] | None, row: int, seq_len: int, position: int) -> int:
    """The index of the document holding ``position`` of batch row ``row`` (0 if unpacked)."""
    if cu_seqlens is None:
        return 0
    flat = row * seq_len + position
    return max(d for d, start in enumerate(cu_seqlens[:-1]) if start <= flat)


def oracle(
    q: Tensor,
    k: Tensor,
    bs: int,
    topk: int,
    is_causal: bool,
    cu_seqlens: list[int] | None = None,
    per: str = "head",
) -> Tensor:
    """The mask as the docstring states it, one (row, head, query block) at a time in float64:
    affinity = mean over the block's queries of q . (mean of the key block), summed over a
    group's query heads for ``per="kv_head"``; the own blocks (those holding the query block's
    positions) when causal, plus the ``topk`` visible others of highest affinity in the query
    block's document."""
    q, k = q.double(), k.double()
    batch, nq, heads, _ = q.shape
    nk, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    mq, mk = math.ceil(nq / bs), math.ceil(nk / bs)
    shift = nk - nq if is_causal else 0
    n_sel = heads if per == "head" else kv_heads
    mask = torch.zeros(batch, n_sel, mq, mk, dtype=torch.bool)
    for b in range(batch):
        for s in range(n_sel):
            q_heads = [s] if per == "head" else list(range(s * group, (s + 1) * group))
            kv = q_heads[0] // group
            for i in range(mq):
                rows = list(range(i * bs, min((i + 1) * bs, nq)))
                positions = [shift + r for r in rows]
                doc = _document_of(cu_seqlens, b, nq, rows[0])
                own = {p // bs for p in positions} if is_causal else set()
                others = []
                for j in range(mk):
                    visible = not is_causal or j * bs <= positions[-1]
                    if visible and j not in own and _document_of(cu_seqlens, b, nk, j * bs) == doc:
                        keys = [k[b, t, kv] for t in range(j * bs, min((j + 1) * bs, nk))]
                        k_mean = _mean(keys)
                        score = sum(
                            _mean([q[b, r, h] @ k_mean for r in rows]) for h in q_heads
                        )
                        others.append((float(score), j))
                chosen = [j for _, j in sorted(others, reverse=True)[:topk]]
                for j in [*own, *chosen]:
                    mask[b, s, i, j] = True
    return mask


def _inputs(batch: int, nq: int, nk: int, heads: int, kv_heads: int, dim: int = 8,
            dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor]:  # fmt: skip
    return (torch.randn(batch, nq, heads, dim, dtype=dtype),
            torch.randn(batch, nk, kv_heads, dim, dtype=dtype))  # fmt: skip


CASES = {
    # name: (batch, Nq, Nk, H, Hkv, block_size, topk, is_causal)
    "square-causal": (2, 32, 32, 2, 2, 4, 2, True),
    "square-noncausal": (2, 32, 32, 2, 2, 4, 3, False),
    "partial-last-block": (1, 13, 13, 2, 1, 4, 1, True),
    "partial-noncausal-cross": (1, 9, 23, 2, 2, 5, 2, False),
    "noncausal-longer-query": (1, 30, 11, 2, 1, 4, 2, False),
    "gqa-4-to-2": (1, 40, 40, 4, 2, 8, 2, True),
    "topk-above-blocks": (1, 20, 20, 1, 1, 4, 10, True),
    "topk-0-causal": (1, 16, 16, 1, 1, 4, 0, True),
    "end-aligned": (2, 8, 24, 2, 1, 4, 2, True),  # Nk - Nq a multiple of the block
    "end-aligned-straddling": (1, 10, 27, 2, 2, 4, 2, True),  # it is not
    "decode-one-row": (2, 1, 29, 2, 2, 4, 3, True),
    "one-block": (1, 3, 3, 1, 1, 8, 2, True),
}


def _as_mask(indices: Tensor, key_blocks: int) -> Tensor:
    """(..., K) block indices, -1 = none, as the (..., Mk) bool mask they list; no block
    listed twice."""
    mask = torch.zeros(*indices.shape[:-1], key_blocks, dtype=torch.bool)
    for key in torch.nonzero(indices >= 0).tolist():
        block = int(indices[tuple(key)])
        assert not mask[(*key[:-1], block)], "a block listed twice"
        mask[(*key[:-1], block)] = True
    return mask


def _selected(q: Tensor, k: Tensor, bs: int, indices: bool, **options) -> Tensor:
    """select_blocks' bool mask, or its block indices as the mask they list (their width
    checked: topk and the own blocks)."""
    chosen = select_blocks(q, k, block_size=bs, return_indices=indices, **options)
    if not indices:
        assert chosen.dtype == torch.bool
        return chosen
    mk = math.ceil(k.shape[1] / bs)
    own = 0 if not options["is_causal"] else 1 if (k.shape[1] - q.shape[1]) % bs == 0 else 2
    assert chosen.dtype == torch.int32 and chosen.shape[-1] == min(options["topk"], mk) + own
    return _as_mask(chosen.cpu(), mk)


@pytest.mark.parametrize("indices", [False, True], ids=["bool", "indices"])
@pytest.mark.parametrize("per", ["head", "kv_head"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_the_float64_oracle(case: tuple, per: str, indices: bool) -> None:
    batch, nq, nk, heads, kv_heads, bs, topk, causal = case
    q, k = _inputs(batch, nq, nk, heads, kv_heads)
    mask = _selected(q, k, bs, indices, topk=topk, is_causal=causal, per=per)
    expected = oracle(q, k, bs, topk, causal, per=per)
    assert mask.shape == expected.shape
    assert torch.equal(mask, expected)


def _own_and_visible(nq: int, nk: int, bs: int) -> tuple[Tensor, Tensor]:
    """(Mq, Mk) bool: the key blocks holding each causal query block's positions, and the key
    blocks that start at or before its last position (end-aligned)."""
    mq, mk = math.ceil(nq / bs), math.ceil(nk / bs)
    own = torch.zeros(mq, mk, dtype=torch.bool)
    visible = torch.zeros(mq, mk, dtype=torch.bool)
    for i in range(mq):
        positions = range(nk - nq + i * bs, nk - nq + min((i + 1) * bs, nq))
        for p in positions:
            own[i, p // bs] = True
        visible[i, : positions[-1] // bs + 1] = True
    return own, visible


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("nq", "nk"), [(64, 64), (61, 61), (20, 64), (1, 50), (23, 50)])
@pytest.mark.parametrize("topk", [0, 1, 3, 100])
def test_causal_properties(nq: int, nk: int, topk: int, dtype: torch.dtype) -> None:
    """Own block kept, nothing after a causal query, exactly min(topk, candidates) more blocks,
    in every (row, head, query block), for any dtype (ties or rounding may change which
    blocks, never how many)."""
    bs = 8
    q, k = _inputs(2, nq, nk, 4, 2, dtype=dtype)
    mask = select_blocks(q, k, block_size=bs, topk=topk, is_causal=True)
    own, visible = _own_and_visible(nq, nk, bs)
    assert mask[..., own].all(), "a causal query block lost its own block"
    assert not mask[..., ~visible].any(), "a block after a causal query block was kept"
    candidates = (visible & ~own).sum(-1)  # (Mq,)
    extra = (mask & ~own).sum(-1)  # (B, H, Mq)
    assert torch.equal(extra, torch.minimum(candidates, torch.tensor(topk)).expand_as(extra))


@pytest.mark.parametrize("topk", [1, 2, 7])
def test_noncausal_count(topk: int) -> None:
    q, k = _inputs(2, 17, 40, 2, 2, dtype=torch.float32)
    mask = select_blocks(q, k, block_size=8, topk=topk, is_causal=False)
    assert mask.shape == (2, 2, 3, 5)
    assert torch.equal(mask.sum(-1), torch.full((2, 2, 3), min(topk, 5)))


@pytest.mark.parametrize("is_causal", [True, False])
def test_a_planted_matching_block_is_found(is_causal: bool) -> None:
    """Keys of block 2 point where the queries of block 5 point (and nowhere else does): with
    topk=1, block 5 chooses block 2, in every head."""
    bs, dim = 4, 16
    q, k = _inputs(1, 32, 32, 2, 2, dim=dim, dtype=torch.float32)
    q, k = 0.1 * q, 0.1 * k
    direction = torch.zeros(dim)
    direction[3] = 1.0
    q[0, 5 * bs : 6 * bs] += direction
    k[0, 2 * bs : 3 * bs] += 5 * direction
    mask = select_blocks(q, k, block_size=bs, topk=1, is_causal=is_causal)
    expected = torch.zeros(2, 8, dtype=torch.bool)
    expected[:, 2] = True
    expected[:, 5] = is_causal  # the own block
    assert torch.equal(mask[0, :, 5], expected)


def test_a_partial_last_block_is_the_mean_of_its_real_rows() -> None:
    """Key block 2 is one row, u; block 1 is four rows of u / 2. Its mean is u (not u / 4, a
    mean over padding), so the query u prefers it with topk=1."""
    dim = 4
    u = torch.tensor([1.0, 0.0, 0.0, 0.0])
    k = torch.zeros(1, 9, 1, dim)
    k[0, 4:8, 0] = u / 2
    k[0, 8, 0] = u
    q = u.expand(1, 3, 1, dim).clone()
    mask = select_blocks(q, k, block_size=4, topk=1, is_causal=False)
    assert mask[0, 0].tolist() == [[False, False, True]]


def test_per_kv_head_sums_the_groups_affinities() -> None:
    """Query heads 0 and 1 (kv head 0) disagree; their choices per head differ, and the shared
    choice is the block of the larger summed affinity, which is also what the oracle says."""
    dim = 4
    e0, e1 = torch.eye(dim, dtype=torch.float64)[:2]
    k = torch.zeros(1, 12, 1, dim, dtype=torch.float64)
    k[0, 0:4, 0] = e0
    k[0, 4:8, 0] = e1
    q = torch.zeros(1, 12, 2, dim, dtype=torch.float64)
    q[0, 8:, 0] = 2 * e0
    q[0, 8:, 1] = 3 * e1
    per_head = select_blocks(q, k, block_size=4, topk=1, is_causal=True)
    shared = select_blocks(q, k, block_size=4, topk=1, is_causal=True, per="kv_head")
    assert per_head.shape == (1, 2, 3, 3) and shared.shape == (1, 1, 3, 3)
    assert per_head[0, :, 2].tolist() == [[True, False, True], [False, True, True]]
    assert shared[0, 0, 2].tolist() == [False, True, True]
    assert torch.equal(shared, oracle(q, k, 4, 1, True, per="kv_head"))


def test_a_block_of_nan_affinity_ranks_last_and_still_counts() -> None:
    """A key block holding NaN has no real affinity: it ranks below every other block, yet is
    chosen when ``topk`` asks for every candidate (the count stays exact)."""
    q, k = _inputs(1, 4, 12, 1, 1, dtype=torch.float32)
    k[0, 5, 0, 0] = torch.nan
    two = select_blocks(q, k, block_size=4, topk=2, is_causal=False)
    three = select_blocks(q, k, block_size=4, topk=3, is_causal=False)
    assert two[0, 0, 0].tolist() == [True, False, True]
    assert three[0, 0, 0].tolist() == [True, True, True]


PACKED = {
    # name: (batch, N, block_size, cu_seqlens)
    "one-row": (1, 40, 4, [0, 8, 20, 24, 40]),
    "two-rows-partial-ends": (2, 18, 4, [0, 8, 18, 22, 36]),
    "one-block-documents": (1, 12, 4, [0, 4, 8, 12]),
    "tensor-offsets": (2, 16, 8, torch.tensor([0, 8, 16, 32], dtype=torch.int32)),
}


@pytest.mark.parametrize("indices", [False, True], ids=["bool", "indices"])
@pytest.mark.parametrize("per", ["head", "kv_head"])
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("case", PACKED.values(), ids=PACKED.keys())
def test_packed_documents(case: tuple, is_causal: bool, per: str, indices: bool) -> None:
    batch, n, bs, cu_seqlens = case
    q, k = _inputs(batch, n, n, 4, 2)
    mask = _selected(q, k, bs, indices, topk=2, is_causal=is_causal, cu_seqlens=cu_seqlens,
                     per=per)  # fmt: skip
    offsets = cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else cu_seqlens
    expected = oracle(q, k, bs, 2, is_causal, cu_seqlens=offsets, per=per)
    assert torch.equal(mask, expected)
    m = math.ceil(n / bs)
    document = torch.tensor([[_document_of(offsets, b, n, j * bs) for j in range(m)]
                             for b in range(batch)])  # fmt: skip
    crossing = document[:, None, :, None] != document[:, None, None, :]
    assert not mask[crossing.expand_as(mask)].any(), "a block pair crosses documents"


def test_misaligned_documents_are_refused() -> None:
    q, k = _inputs(2, 16, 16, 2, 2)
    with pytest.raises(ValueError, match=r"multiple of block_size=4.*position 6 of row 1"):
        select_blocks(q, k, block_size=4, topk=1, is_causal=True, cu_seqlens=[0, 16, 22, 32])


def test_no_gradient_flows_through_the_choice() -> None:
    """Nothing is saved for a backward: the selection runs under no_grad."""
    q, k = _inputs(1, 16, 16, 2, 2, dtype=torch.float32)
    q.requires_grad_(True)
    k.requires_grad_(True)
    saved: list[Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        mask = select_blocks(q, k, block_size=4, topk=1, is_causal=True)
    assert saved == [] and not mask.requires_grad and mask.grad_fn is None


def test_reads_no_value_on_the_host() -> None:
    """On the meta device (tensors without data) every value read on the host fails: the
    selection, packed documents included, reads none (Note [Selection without host
    synchronisation])."""
    q, k = _inputs(2, 24, 24, 4, 2, dtype=torch.float32)
    for per in ("head", "kv_head"):
        for offsets in (None, [0, 8, 24, 40, 48]):
            mask = select_blocks(q.to("meta"), k.to("meta"), block_size=8, topk=1,
                                 is_causal=True, cu_seqlens=offsets, per=per)  # fmt: skip
            assert mask.device.type == "meta" and mask.shape[-2:] == (3, 3)


@pytest.mark.gpu
@pytest.mark.parametrize("offsets", [None, [0, 128, 512, 768, 1024]])
def test_no_host_synchronisation_on_cuda(offsets: list[int] | None) -> None:
    q = torch.randn(2, 512, 4, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 512, 2, 64, device="cuda", dtype=torch.bfloat16)
    expected = oracle(q.cpu(), k.cpu(), 64, 2, True, cu_seqlens=offsets)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mask = select_blocks(q, k, block_size=64, topk=2, is_causal=True, cu_seqlens=offsets)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert mask.device == q.device
    # The oracle ranks in float64, the selection in float32: a near-tie may swap one pair.
    assert (mask.cpu() != expected).sum() <= 2


def test_an_empty_batch_or_no_heads_gives_an_empty_mask() -> None:
    q, k = _inputs(0, 8, 8, 2, 1)
    assert select_blocks(q, k, block_size=4, topk=1, is_causal=True).shape == (0, 2, 2, 2)
    q, k = _inputs(1, 8, 8, 0, 0)
    assert select_blocks(q, k, block_size=4, topk=1, is_causal=True).shape == (1, 0, 2, 2)


BAD = {
    # name: (change to the good call, error type, message)
    "query-not-a-tensor": ({"query": [1.0]}, TypeError, "query must be a torch.Tensor"),
    "key-3d": ({"key": torch.randn(1, 8, 4)}, ValueError, "key must have shape"),
    "int-query": ({"query": torch.ones(1, 8, 2, 4, dtype=torch.int64)}, TypeError,
                  "floating-point"),
    "dtypes-differ": ({"key": torch.randn(1, 8, 2, 4, dtype=torch.float64)}, TypeError,
                      "same dtype as query"),
    "devices-differ": ({"key": torch.randn(1, 8, 2, 4, device="meta")}, ValueError,
                       "same device as query"),
    "heads-not-a-multiple": ({"key": torch.randn(1, 8, 3, 4)}, ValueError,
                             "multiple of key/value heads"),
    "head-dims-differ": ({"key": torch.randn(1, 8, 2, 5)}, ValueError, "same head_dim"),
    "bhnd-layout": ({"query": torch.randn(1, 2, 8, 4), "key": torch.randn(1, 2, 16, 4),
                     "is_causal": False}, ValueError, "transpose\\(1, 2\\)"),
    "block-size-0": ({"block_size": 0}, ValueError, "block_size must be a positive int"),
    "block-size-float": ({"block_size": 4.0}, TypeError, "block_size must be a positive int"),
    "topk-negative": ({"topk": -1}, ValueError, "topk must be >= 1.*is negative"),
    "topk-0-noncausal": ({"topk": 0, "is_causal": False}, ValueError, "selects no block"),
    "topk-bool": ({"topk": True}, TypeError, "topk must be an int"),
    "is-causal-int": ({"is_causal": 1}, TypeError, "is_causal must be True or False"),
    "per-unknown": ({"per": "query"}, ValueError, "per must be one of"),
    "per-not-a-str": ({"per": 1}, TypeError, "per must be one of"),
    "return-indices-str": ({"return_indices": "yes"}, TypeError,
                           "return_indices must be True or False"),
    "causal-query-longer": ({"key": torch.randn(1, 4, 2, 4)}, ValueError,
                            "cannot be longer than the key"),
    "packed-lengths-differ": ({"key": torch.randn(1, 12, 2, 4), "cu_seqlens": [0, 8]},
                              ValueError, "query of the key's length"),
    "packed-bad-end": ({"cu_seqlens": [0, 4, 9]}, ValueError, "end at B \\* N"),
    "packed-floats": ({"cu_seqlens": [0.0, 8.0]}, TypeError, "cu_seqlens must hold ints"),
}  # fmt: skip


@pytest.mark.parametrize(("change", "error", "message"), BAD.values(), ids=BAD.keys())
def test_bad_arguments(change: dict, error: type, message: str) -> None:
    arguments = {"query": torch.randn(1, 8, 2, 4), "key": torch.randn(1, 8, 2, 4),
                 "block_size": 4, "topk": 1, "is_causal": True, **change}  # fmt: skip
    with pytest.raises(error, match=message):
        select_blocks(arguments.pop("query"), arguments.pop("key"), **arguments)


@pytest.mark.gpu
@pytest.mark.parametrize("per", ["head", "kv_head"])
def test_cuda_choice_in_chunks_matches_the_oracle(
    monkeypatch: pytest.MonkeyPatch, per: str
) -> None:
    """The GPU's one-pass choice, its query blocks a few at a time (a tiny affinity budget),
    against the float64 oracle."""
    from dilated_attention.sparse import device_choice

    monkeypatch.setattr(device_choice, "AFFINITY_BYTES", 4 * 4 * 24 * 3)  # 1-3 query blocks a chunk
    q = torch.randn(2, 1536, 4, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 1536, 2, 64, device="cuda", dtype=torch.bfloat16)
    for is_causal, indices in itertools.product((True, False), (False, True)):
        mask = _selected(q, k, 64, indices, topk=3, is_causal=is_causal, per=per)
        expected = oracle(q.cpu(), k.cpu(), 64, 3, is_causal, per=per)
        # The oracle ranks in float64, the selection in float32: a near-tie may swap a pair.
        assert mask.shape == expected.shape and (mask.cpu() != expected).sum() <= 4


@pytest.mark.gpu
@pytest.mark.parametrize("per", ["head", "kv_head"])
def test_cuda_affinities_on_tensor_cores_keep_float32_accuracy(per: str) -> None:
    """The GPU's affinities from bfloat16 parts (Note [Affinities on tensor cores]) against
    float64: within 2^-14 of the products' magnitudes, where one bfloat16 product is 2^-9 off."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from dilated_attention.sparse.selection import _affinity

    g = torch.Generator().manual_seed(0)
    q_mean = torch.randn(2, 50, 4, 128, generator=g)
    k_mean = torch.randn(2, 70, 2, 128, generator=g) * 1e3
    got = _affinity(q_mean.cuda(), k_mean.cuda(), per)

    def exact(q: Tensor, k: Tensor) -> Tensor:  # (B, H or Hkv, Mq, Mk) in float64
        products = torch.einsum("bihd,bjhd->bhij", q.double(), k.double().repeat_interleave(2, 2))
        return products if per == "head" else products.view(2, 2, 2, 50, 70).sum(2)

    want, size = exact(q_mean, k_mean), exact(q_mean.abs(), k_mean.abs()).max()
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert float((got.cpu().double() - want).abs().max() / size) < 2**-14


@pytest.mark.gpu
@pytest.mark.parametrize("per", ["head", "kv_head"])
def test_cuda_choice_from_tiles_matches_the_stored_product(
    monkeypatch: pytest.MonkeyPatch, per: str
) -> None:
    """The choice from affinities made a tile at a time (Note [Affinities a tile at a time]),
    its query blocks in chunks, against the choice from the stored product: the same blocks
    but for a near tie (the two sum the parts' products in different orders)."""
    from dilated_attention.backends.triton_kernels.selection import affinity_tiles
    from dilated_attention.sparse import device_choice

    monkeypatch.setattr(device_choice, "AFFINITY_BYTES", 300_000)  # several chunks in both
    q = torch.randn(2, 4000, 4, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 4100, 2, 64, device="cuda", dtype=torch.bfloat16)
    calls = []
    run = affinity_tiles.top_blocks_from_parts
    monkeypatch.setattr(affinity_tiles, "top_blocks_from_parts",
                        lambda *a, **kw: calls.append(1) or run(*a, **kw))  # fmt: skip
    for is_causal, indices in itertools.product((True, False), (False, True)):
        options = {"topk": 5, "is_causal": is_causal, "per": per}
        monkeypatch.setattr(affinity_tiles, "MIN_COLUMNS", {})  # the stored product
        want = _selected(q, k, 16, indices, **options)
        monkeypatch.setattr(affinity_tiles, "MIN_COLUMNS", {16: 1, 32: 1})  # tiles
        before = len(calls)
        got = _selected(q, k, 16, indices, **options)
        assert len(calls) > before + 1  # the tiles ran, in more than one chunk
        assert got.shape == want.shape and (got != want).sum() <= 8
