"""Block-sparse attention on run-time block masks (Note [Run-time block masks]) against the
float64 oracle: out, lse and every gradient (and the sinks'), for bool masks of every shape
(B or 1, H, Hkv or 1), index lists with -1, duplicates and entries out of range, causal and not,
end-aligned, GQA, partial last blocks, packed documents, empty rows, soft-capping and sinks, on
the CPU's kernels (the fallback of Note [Run-time masks on a dense kernel]); the checks of bad
masks; no value read on the host (masks on the meta device); explain, the modules and the
multihead layer. Our Triton kernels, FlashAttention-4 (its fake on the CPU) and FlexAttention
have their own tests (tests/backends/test_block_sparse_triton.py,
tests/ops/test_block_sparse_fa4.py, and the GPU tests at the end of this file).

The oracle's token mask is built by loops over blocks in ``tests/support/runtime_masks.py``.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from support.runtime_masks import runtime_oracle, runtime_token_mask

import dilated_attention.block_sparse.rows as bs_rows
from dilated_attention import (
    BlockSparseAttention,
    BlockSparseMultiheadAttention,
    MultiheadDilatedAttention,
    block_sparse_attention,
    explain,
)
from dilated_attention import patterns as P
from dilated_attention.backends.registry import Selection, get_backend, registry_for
from dilated_attention.block_sparse.fa4 import runtime_fa4_tiles
from dilated_attention.block_sparse.flex import runtime_flex_block_mask
from dilated_attention.block_sparse.lists import compact_rows
from dilated_attention.block_sparse.runtime import check_block_mask, kept_blocks
from dilated_attention.resolve import BLOCK_SPARSE, Request
from dilated_attention.resolve import block_masks as resolve_masks
from dilated_attention.resolve.block_masks import RuntimeMaskStrategy
from dilated_attention.resolve.request import kernel_inputs
from dilated_attention.sparse import select_blocks

F64 = torch.float64
B, H, D = 2, 4, 8
TIGHT = {"atol": 1e-10, "rtol": 1e-7}


def _inputs(nq: int, nk: int, kv_heads: int, dtype: torch.dtype = F64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(B, nq, H, D), (B, nk, kv_heads, D), (B, nk, kv_heads, D), (B, nq, H, D)]
    return [torch.randn(s, generator=gen, dtype=F64).to(dtype) for s in shapes]


def _bool_mask(shape: tuple[int, ...], seed: int, density: float = 0.45) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=gen) < density


def _run(q, k, v, dout, mask, sinks=None, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if sinks is not None:
        leaves.append(sinks.detach().clone().requires_grad_())
        kwargs["sinks"] = leaves[3]
    out, lse = block_sparse_attention(*leaves[:3], mask, return_lse=True, **kwargs)
    return out, lse, torch.autograd.grad(out, leaves, dout)


def _check(got, want, case: str) -> None:
    out, lse, grads = got
    ref_out, ref_lse, ref_grads = want
    assert not any(bool(torch.isnan(t).any()) for t in (out, lse, *grads)), f"NaN in {case}"
    torch.testing.assert_close(out, ref_out, **TIGHT, msg=lambda m: f"out {case}: {m}")
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), f"lse -inf rows differ {case}"
    torch.testing.assert_close(lse, ref_lse, **TIGHT, msg=lambda m: f"lse {case}: {m}")
    for name, g, rg in zip(("q", "k", "v", "sinks"), grads, ref_grads, strict=False):
        torch.testing.assert_close(g, rg, **TIGHT, msg=lambda m, n=name: f"d{n} {case}: {m}")


def _oracle(q, k, v, dout, mask, block_size, is_causal, **kwargs):
    tokens = runtime_token_mask(
        mask, block_size, batch=B, heads=H, query_len=q.shape[1], key_len=k.shape[1],
        is_causal=is_causal, cu_seqlens=kwargs.pop("cu_seqlens", None),
    )  # fmt: skip
    return runtime_oracle(q, k, v, dout, tokens, **kwargs)


# -- float64 oracle: every mask shape, causal and not, the CPU's kernels -------------------------
MASK_SHAPES = {"B,H": (B, H), "1,H": (1, H), "B,Hkv": (B, 2), "1,Hkv": (1, 2), "B,1": (B, 1),
               "1,1": (1, 1)}  # fmt: skip


@pytest.mark.parametrize("backend", [None, "math", "cpu_flash"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", list(MASK_SHAPES))
def test_bool_masks_of_every_shape_match_oracle(
    shape: str, is_causal: bool, backend: str | None
) -> None:
    """37 tokens in blocks of 8 (a partial last block), GQA (2 key/value heads)."""
    nq = nk = 37
    q, k, v, dout = _inputs(nq, nk, 2, seed=len(shape))
    mask = _bool_mask((*MASK_SHAPES[shape], 5, 5), seed=3)
    got = _run(q, k, v, dout, mask, block_size=8, is_causal=is_causal, backend=backend)
    want = _oracle(q, k, v, dout, mask, 8, is_causal)
    _check(got, want, f"{shape} causal={is_causal} {backend}")


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_index_lists_with_none_duplicates_and_out_of_range(is_causal: bool) -> None:
    """-1 keeps nothing, a repeated index counts once, an index outside [0, Mk) keeps nothing
    (Note [Run-time block masks]); the same call as its bool mask."""
    q, k, v, dout = _inputs(37, 37, 2, seed=5)
    indices = torch.tensor([
        [[0, -1, 0], [1, 1, 1], [-1, -1, -1], [3, 0, 5], [4, 2, -7]],
        [[2, 2, -1], [0, 4, 1], [1, 9, -1], [-1, 3, 3], [0, 1, 2]],
    ]).view(2, 1, 5, 3)  # (B, 1, Mq, K): shared by every head
    got = _run(q, k, v, dout, indices, block_size=8, is_causal=is_causal)
    _check(got, _oracle(q, k, v, dout, indices, 8, is_causal), f"indices causal={is_causal}")
    as_bool = torch.zeros(2, 1, 5, 5, dtype=torch.bool)
    for b, i, j in itertools.product(range(2), range(5), range(3)):
        if 0 <= indices[b, 0, i, j] < 5:
            as_bool[b, 0, i, indices[b, 0, i, j]] = True
    out = block_sparse_attention(q, k, v, as_bool, block_size=8, is_causal=is_causal)
    torch.testing.assert_close(got[0], out, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.int64])
def test_index_dtypes_and_per_query_head_lists(dtype: torch.dtype) -> None:
    q, k, v, dout = _inputs(40, 40, 1, seed=8)  # MQA
    gen = torch.Generator().manual_seed(4)
    indices = torch.randint(-1, 5, (B, H, 5, 2), generator=gen).to(dtype)
    got = _run(q, k, v, dout, indices, block_size=8, is_causal=True, scale=0.4)
    _check(got, _oracle(q, k, v, dout, indices, 8, True, scale=0.4), f"{dtype}")


def test_index_lists_of_no_entries() -> None:
    """K = 0: every row attends nothing, as an all-False mask."""
    q, k, v, dout = _inputs(20, 20, 2)
    out, lse, grads = _run(q, k, v, dout, torch.zeros(1, 1, 3, 0, dtype=torch.long),
                           block_size=8)  # fmt: skip
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


@pytest.mark.parametrize(
    ("nq", "nk", "is_causal"),
    [(13, 29, True), (9, 40, True), (30, 45, False), (45, 27, False)],
    ids=["end-aligned", "end-aligned-one-block", "shorter", "longer"],
)
def test_query_and_key_lengths_that_differ(nq: int, nk: int, is_causal: bool) -> None:
    """A causal query shorter than the key holds the last positions (end-aligned at the token;
    its mask rows are its own rows' blocks, so a block may straddle two key blocks)."""
    q, k, v, dout = _inputs(nq, nk, 2, seed=nq)
    mask = _bool_mask((B, 2, math.ceil(nq / 8), math.ceil(nk / 8)), seed=nk, density=0.6)
    got = _run(q, k, v, dout, mask, block_size=8, is_causal=is_causal)
    _check(got, _oracle(q, k, v, dout, mask, 8, is_causal), f"Nq={nq} Nk={nk}")


@pytest.mark.parametrize("block_size", [1, 5, 64])
def test_block_sizes_of_one_token_and_one_block(block_size: int) -> None:
    q, k, v, dout = _inputs(33, 33, 2, seed=block_size)
    m = math.ceil(33 / block_size)
    mask = _bool_mask((1, H, m, m), seed=block_size, density=0.5)
    for is_causal in (False, True):
        got = _run(q, k, v, dout, mask, block_size=block_size, is_causal=is_causal)
        want = _oracle(q, k, v, dout, mask, block_size, is_causal)
        _check(got, want, f"block_size={block_size} causal={is_causal}")


def test_empty_rows_give_zeros_lse_minus_inf_and_zero_gradients() -> None:
    q, k, v, dout = _inputs(36, 36, 2)
    mask = _bool_mask((B, H, 5, 5), seed=9, density=0.5)
    mask[0, 1, 2] = False  # one row of blocks, one head: nothing
    mask[1, :, 4] = False  # the partial last query block of row 1: nothing, every head
    mask[:, :, 0, 0] = False  # causal: block 0 sees nothing but itself
    for is_causal in (False, True):
        got = _run(q, k, v, dout, mask, block_size=8, is_causal=is_causal)
        _check(got, _oracle(q, k, v, dout, mask, 8, is_causal), f"empty causal={is_causal}")
        out, lse, (dq, _, _) = got
        assert torch.equal(out[0, 16:24, 1], torch.zeros_like(out[0, 16:24, 1]))
        assert bool(torch.isneginf(lse[1, :, 32:]).all())
        assert torch.equal(dq[1, 32:], torch.zeros_like(dq[1, 32:]))


@pytest.mark.parametrize(("batch", "heads"), [(0, H), (B, 0)])
def test_no_query_rows(batch: int, heads: int) -> None:
    """A batch of 0, or 0 heads: empty results and gradients, a mask shared by every row."""
    q = torch.randn(batch, 16, heads, D, dtype=F64, requires_grad=True)
    k = torch.randn(batch, 16, heads // 2, D, dtype=F64, requires_grad=True)
    out, lse = block_sparse_attention(q, k, k, torch.ones(1, 1, 2, 2, dtype=torch.bool),
                                      block_size=8, is_causal=True, return_lse=True)  # fmt: skip
    assert out.shape == q.shape and lse.shape == (batch, heads, 16)
    dq, dk = torch.autograd.grad(out.sum(), (q, k))
    assert dq.shape == q.shape and dk.shape == k.shape


def test_all_empty_mask() -> None:
    q, k, v, dout = _inputs(20, 20, 4)
    mask = torch.zeros(B, H, 3, 3, dtype=torch.bool)
    out, lse, grads = _run(q, k, v, dout, mask, block_size=8, is_causal=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_softcap_and_sinks(is_causal: bool) -> None:
    """Soft-capped scores and the sinks' gradient; an empty row's lse is its sink."""
    q, k, v, dout = _inputs(37, 37, 2, seed=12)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=F64)
    mask = _bool_mask((B, 2, 5, 5), seed=12)
    mask[0, 0, 1] = False  # rows 8-15 of heads 0 and 1 of batch row 0: only the sink
    got = _run(q, k, v, dout, mask, sinks=sinks, block_size=8, is_causal=is_causal,
               softcap=3.0)  # fmt: skip
    want = _oracle(q, k, v, dout, mask, 8, is_causal, softcap=3.0, sinks=sinks)
    _check(got, want, f"softcap+sinks causal={is_causal}")
    torch.testing.assert_close(got[1][0, 0, 8:16], torch.full((8,), 0.5, dtype=F64))


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_packed_documents(is_causal: bool) -> None:
    """Documents start at blocks in their rows; no pair crosses documents; the same as the
    oracle of each row's documents."""
    q, k, v, dout = _inputs(40, 40, 2, seed=21)
    cu_seqlens = [0, 16, 40, 48, 80]  # row 0: 16 + 24; row 1: 8 + 32
    mask = _bool_mask((B, H, 5, 5), seed=21, density=0.7)
    got = _run(q, k, v, dout, mask, block_size=8, is_causal=is_causal, cu_seqlens=cu_seqlens)
    want = _oracle(q, k, v, dout, mask, 8, is_causal, cu_seqlens=cu_seqlens)
    _check(got, want, f"packed causal={is_causal}")


def test_packed_documents_must_start_at_blocks() -> None:
    q, k, v, _ = _inputs(40, 40, 2)
    mask = torch.ones(1, 1, 5, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"multiple of block_size=8.*position 12 of row 0"):
        block_sparse_attention(q, k, v, mask, block_size=8, cu_seqlens=[0, 12, 40, 80])


def test_low_precision_float32_fallback() -> None:
    q, k, v, dout = _inputs(50, 50, 2, dtype=torch.float32, seed=2)
    mask = select_blocks(q, k, block_size=8, topk=2, is_causal=True)
    out, lse, grads = _run(q, k, v, dout, mask, block_size=8, is_causal=True)
    ref_out, ref_lse, ref_grads = _oracle(q, k, v, dout, mask, 8, True)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    for got, want in zip((out, lse, *grads), (ref_out, ref_lse, *ref_grads), strict=True):
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


def test_the_mask_gets_no_gradient_and_is_left_as_it_is() -> None:
    """A bool or int mask cannot require a gradient (a float one is refused), and the call
    leaves it unchanged."""
    q, k, v, dout = _inputs(24, 24, 2)
    mask = _bool_mask((B, H, 3, 3), seed=1)
    before = mask.clone()
    _run(q, k, v, dout, mask, block_size=8, is_causal=True)
    assert torch.equal(mask, before) and not mask.requires_grad
    with pytest.raises(TypeError, match=r"bool .* or int block indices.*got dtype torch.float"):
        block_sparse_attention(q, k, v, mask.double().requires_grad_(), block_size=8)


def test_first_order_only_raises_clearly() -> None:
    q, k, v, dout = _inputs(24, 24, 2)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = block_sparse_attention(*leaves, _bool_mask((B, H, 3, 3), seed=2), block_size=8)
    grads = torch.autograd.grad(out, leaves, dout, create_graph=True)
    with pytest.raises(RuntimeError, match="run-time block mask has no higher-order gradients"):
        torch.autograd.grad(sum(g.square().sum() for g in grads), leaves)


def test_fallback_calls_score_one_block_row_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [Run-time masks on a dense kernel]: Mq calls (2 Mq - 1 causal), none of Nq x Nk."""
    kernel, calls = get_backend("math"), []
    original = kernel.forward

    def spy(q, k, v, **kwargs):
        calls.append((q.shape[1], k.shape[1], kwargs["is_causal"], kwargs["key_mask"].shape))
        return original(q, k, v, **kwargs)

    monkeypatch.setattr(kernel, "forward", spy)
    q, k, v, _ = _inputs(37, 37, 2)
    mask = _bool_mask((B, 2, 5, 5), seed=4)
    block_sparse_attention(q, k, v, mask, block_size=8, backend="math")
    assert [c[:3] for c in calls] == [(8, 37, False)] * 4 + [(5, 37, False)]
    assert all(c[3] == (B, H, 37) for c in calls)  # per query head: a key/value-head mask
    calls.clear()
    block_sparse_attention(q, k, v, mask, block_size=8, is_causal=True, backend="math")
    assert len(calls) == 9 and all(lq * lk < 37 * 37 for lq, lk, _, _ in calls)


# -- no value read on the host: the meta device ---------------------------------------------------
@pytest.mark.parametrize("indices", [False, True])
def test_lists_are_made_without_reading_the_mask(indices: bool) -> None:
    """Meta tensors hold no values: every step from the checks to each kernel's lists runs on
    them, so none reads the mask on the host (which on CUDA would synchronise)."""
    meta = torch.device("meta")
    q = torch.empty(B, 300, H, 32, device=meta)
    k = torch.empty(B, 300, 2, 32, device=meta)
    if indices:
        mask = torch.empty(B, 2, 3, 2, dtype=torch.long, device=meta)
    else:
        mask = torch.empty(1, H, 3, 3, dtype=torch.bool, device=meta)
    layout = check_block_mask(mask, q, k, 128)
    assert (layout.indices, layout.batch, layout.heads) == (indices, mask.shape[0], mask.shape[1])
    kept = kept_blocks(mask, block_size=128, query_len=300, key_len=300, is_causal=True)
    assert kept.device == meta and kept.shape[-2:] == (3, 3)
    count, index = compact_rows(kept)
    assert count.shape == kept.shape[:-1] and index.shape == kept.shape
    tiles = runtime_fa4_tiles(kept, 128, 300, 300, True, 2, H)
    assert tiles.forward.full_index.device == meta and tiles.empty_rows is not None
    block_mask, empty = runtime_flex_block_mask(kept, 128, 300, 300, True, H)
    assert block_mask.kv_indices.device == meta and empty.shape[-1] == 300
    plan = bs_rows.row_plan(300, 300, 128, True)
    rows = kept.expand(B, *kept.shape[1:])
    assert all(call.key_mask(rows).device == meta for call in plan.calls)


# -- FlexAttention's BlockMask on the CPU -----------------------------------------------------
def _reached(block_mask, batch: int, heads: int, nq: int, nk: int, by_key: bool = False):
    """(B, H, Nq, Nk) bool: the pairs a ``BlockMask``'s lists reach (full tiles whole, partial
    ones through its ``mask_mod``), from its kv lists or, ``by_key``, its transposed q lists."""
    tile = 128
    lists = ((block_mask.q_num_blocks, block_mask.q_indices, True),
             (block_mask.full_q_num_blocks, block_mask.full_q_indices, False)) if by_key else (
            (block_mask.kv_num_blocks, block_mask.kv_indices, True),
            (block_mask.full_kv_num_blocks, block_mask.full_kv_indices, False))  # fmt: skip
    reach = torch.zeros(batch, heads, nq, nk, dtype=torch.bool)
    for count, index, partial in lists:
        for b, h in itertools.product(range(batch), range(heads)):
            cb, ch = min(b, count.shape[0] - 1), min(h, count.shape[1] - 1)
            for r in range(count.shape[-1]):
                for c in index[cb, ch, r, : int(count[cb, ch, r])].tolist():
                    m, n = (c, r) if by_key else (r, c)
                    rows = torch.arange(m * tile, min((m + 1) * tile, nq)).view(-1, 1)
                    cols = torch.arange(n * tile, min((n + 1) * tile, nk)).view(1, -1)
                    keep = torch.ones(rows.shape[0], cols.shape[1], dtype=torch.bool)
                    if partial:
                        keep = block_mask.mask_mod(torch.tensor(b), torch.tensor(h), rows, cols)
                    reach[b, h, rows, cols] = keep
    return reach


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("block_size", "shape"), [(128, (B, 2)), (64, (1, H)), (256, (B, 1))])
def test_flex_block_mask_reaches_the_kept_pairs(
    block_size: int, shape: tuple[int, int], is_causal: bool
) -> None:
    """Its tile lists in both directions, and its ``mask_mod`` on partial tiles (block sizes
    that are not the tile's too), reach exactly the oracle's pairs; rows that see no key are
    marked."""
    n = 300
    m = math.ceil(n / block_size)
    mask = _bool_mask((*shape, m, m), seed=block_size, density=0.5)
    kept = kept_blocks(mask, block_size=block_size, query_len=n, key_len=n, is_causal=is_causal)
    block_mask, empty = runtime_flex_block_mask(kept, block_size, n, n, is_causal, H)
    tokens = runtime_token_mask(mask, block_size, batch=B, heads=H, query_len=n, key_len=n,
                                is_causal=is_causal).bool()  # fmt: skip
    assert torch.equal(_reached(block_mask, B, H, n, n), tokens)
    assert torch.equal(_reached(block_mask, B, H, n, n, by_key=True), tokens)
    assert torch.equal(empty.expand(B, H, n), ~tokens.any(-1))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_strategy_runs_the_mask_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """The strategy's FlexAttention branch, run by eager FlexAttention on the CPU (forward
    only there): the BlockMask made from the call's mask, GQA, empty rows' lse."""
    from torch.nn.attention.flex_attention import flex_attention

    import dilated_attention.backends.flex as flex_backend

    def eager(q, k, v, *, block_mask, scale, kernel_options=None, static_shapes=False):
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, return_lse=True,
                              enable_gqa=q.shape[1] != k.shape[1])  # fmt: skip

    monkeypatch.setattr(flex_backend, "compiled_flex_attention", eager)
    q, k, v, dout = _inputs(300, 300, 2, seed=30)
    mask = _bool_mask((B, 2, 3, 3), seed=30)
    mask[1, 0, 2] = False  # the last rows of row 1, heads 0 and 1: nothing
    layout = check_block_mask(mask, q, k, 128)
    request = Request.of(BLOCK_SPARSE, q, k, v, block_mask=layout, block_size=128,
                         is_causal=True, scale=0.3)  # fmt: skip
    strategy = RuntimeMaskStrategy(
        request, Selection(get_backend("flex"), runs_plan=True), "block_sparse", None, "flex"
    )
    with torch.no_grad():
        out, lse = strategy.run(q, k, v, mask, None)
    ref_out, ref_lse, _ = _oracle(q, k, v, dout, mask, 128, True, scale=0.3)
    torch.testing.assert_close(out, ref_out, **TIGHT)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-6, rtol=1e-6)  # float32, as Flex's


# -- bad masks ------------------------------------------------------------------------------------
BAD = [
    # (mask, error, message)
    (torch.ones(2, H, 5, 5, dtype=torch.uint8), TypeError, r"got dtype torch.uint8.*mask.bool\(\)"),
    (torch.ones(2, H, 5, 5), TypeError, r"got dtype torch.float32"),
    (torch.ones(5, 5, dtype=torch.bool), ValueError, r"must be 4-D.*\(5, 5\).*patterns.Custom"),
    (torch.ones(1, 2, H, 5, 5, dtype=torch.bool), ValueError, r"must be 4-D"),
    (torch.ones(3, H, 5, 5, dtype=torch.bool), ValueError, r"dim 0 is 3, expected .* 2 or 1"),
    (torch.ones(2, 3, 5, 5, dtype=torch.bool), ValueError, r"dim 1 is 3, expected 4 .* 2 .* 1"),
    (torch.ones(2, H, 4, 5, dtype=torch.bool), ValueError, r"dim 2 is 4, expected Mq=5"),
    (torch.ones(2, H, 5, 6, dtype=torch.bool), ValueError, r"dim 3 is 6, expected Mk=5"),
    (torch.ones(2, H, 6, 3, dtype=torch.long), ValueError, r"dim 2 is 6, expected Mq=5"),
    (torch.ones(2, H, 5, 5, dtype=torch.bool, device="meta"), ValueError,
     r"inputs' device cpu, got pattern.device=meta.*\.to\(query.device\)"),
]  # fmt: skip


@pytest.mark.parametrize(("mask", "error", "message"), BAD, ids=range(len(BAD)))
def test_bad_masks_raise_before_any_work(
    mask: torch.Tensor, error: type, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("work started before the mask was checked")

    monkeypatch.setattr(resolve_masks, "kept_blocks", fail)
    monkeypatch.setattr(resolve_masks, "row_plan", fail)
    q, k, v, _ = _inputs(37, 37, 2)
    with pytest.raises(error, match=message) as raised:
        block_sparse_attention(q, k, v, mask, block_size=8)
    assert "pattern" in str(raised.value)


def test_end_aligned_query_refuses_the_block_sparse_kernels_by_name() -> None:
    q, k, v, _ = _inputs(13, 29, 2)
    mask = torch.ones(1, 1, 2, 4, dtype=torch.bool)
    for name in ("triton", "flex", "flash_attn4"):
        with pytest.raises(ValueError, match=rf"{name}.*query shorter than the key"):
            block_sparse_attention(q, k, v, mask, block_size=8, is_causal=True, backend=name)


def test_a_named_kernel_that_cannot_run_says_why() -> None:
    q, k, v, _ = _inputs(16, 16, 2)
    mask = torch.ones(1, 1, 2, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"'flex'.*cannot run.*block_sparse attention"):
        block_sparse_attention(q, k, v, mask, block_size=8, backend="flex")


# -- explain, the modules -----------------------------------------------------------------------
def test_explain_describes_the_run_time_mask_and_the_kernels_refused() -> None:
    choice = explain(device="cpu", block_mask=True, seq_len=1000, num_heads=4, head_dim=32,
                     block_size=128, is_causal=True)  # fmt: skip
    text = str(choice)
    assert choice.operation == "block_sparse" and not choice.runs_plan
    assert "run-time block mask, bool (1, 4, Mq, Mk=8), block_size 128" in text
    assert "one query block at a time" in text
    for name in ("triton", "flex", "flash_attn4"):  # why the block-sparse kernels refuse
        assert choice.reasons.get(name)
    with pytest.raises(ValueError, match="block_mask=True explains block-sparse"):
        explain(device="cpu", block_mask=True, operation="dense")


def test_module_takes_a_block_mask_per_call() -> None:
    q, k, v, _ = _inputs(24, 24, 2)
    module = BlockSparseAttention(P.LocalWindow(0), block_size=8)
    mask = _bool_mask((B, 2, 3, 3), seed=6)
    got = module(q, k, v, is_causal=True, block_mask=mask)
    want = block_sparse_attention(q, k, v, mask, block_size=8, is_causal=True)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    pattern = block_sparse_attention(q, k, v, P.LocalWindow(0), block_size=8, is_causal=True)
    torch.testing.assert_close(module(q, k, v, is_causal=True), pattern, atol=0, rtol=0)


def test_multihead_layer_passes_the_block_mask_on() -> None:
    torch.manual_seed(0)
    layer = BlockSparseMultiheadAttention(32, 4, P.LocalWindow(0), block_size=8, num_kv_heads=2)
    x = torch.randn(2, 24, 32)
    mask = _bool_mask((2, 2, 3, 3), seed=7)
    out, _ = layer(x, is_causal=True, block_mask=mask)
    inner = layer.attention
    seen: list[torch.Tensor | None] = []
    original = inner.forward

    def spy(*args, block_mask=None, **kwargs):
        seen.append(block_mask)
        return original(*args, block_mask=block_mask, **kwargs)

    inner.forward = spy
    again, _ = layer(x, is_causal=True, block_mask=mask)
    assert seen == [mask] and torch.equal(out, again)
    assert not torch.allclose(out, layer(x, is_causal=True)[0])  # the pattern's blocks differ
    dilated = MultiheadDilatedAttention(32, 4, [8], [1])
    with pytest.raises(ValueError, match=r"block_mask .* needs a layer whose inner module"):
        dilated(x, block_mask=mask)


# -- GPU: every kernel against the oracle, and no host synchronisation -----------------------------
def _cuda_case(dtype: torch.dtype, nq: int, kv_heads: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(2, nq, 4, 64), (2, nq, kv_heads, 64), (2, nq, kv_heads, 64), (2, nq, 4, 64)]
    return [torch.randn(s, generator=gen).to(dtype) for s in shapes]


GPU_KERNELS = ["triton", "flex", "flash_attn4", "math"]


def _skip_unless_runs(name: str, q: torch.Tensor, mask: torch.Tensor) -> None:
    """Skip, with its reasons, where the block-sparse kernel ``name`` cannot run a training
    call on q (B, N, H, D) (``math`` runs the fallback everywhere)."""
    layout = check_block_mask(mask, q, q[:, :, :2], 128)
    request = Request.of(BLOCK_SPARSE, q, q, q, block_mask=layout, block_size=128,
                         requires_grad=True)  # fmt: skip
    reasons = registry_for("block_sparse").reasons(name, kernel_inputs(request, block_size=128))
    if reasons and name != "math":
        pytest.skip(f"{name} cannot run here: {reasons}")


def _index_rows(mask: torch.Tensor) -> torch.Tensor:
    """A bool (Bm, Hm, Mq, Mk) mask as block indices, each row's kept blocks in decreasing
    order, its first listed twice, then -1 and an index past Mk."""
    count, index = compact_rows(mask)
    width = mask.shape[-1]
    rows = torch.full((*mask.shape[:-1], width + 3), -1, dtype=torch.int64)
    for key in itertools.product(*map(range, mask.shape[:-1])):
        kept = index[key][: count[key]].flip(0).tolist()
        listed = kept + kept[:1] + [width + 2]
        rows[key][: len(listed)] = torch.tensor(listed)
    return rows


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["bool", "indices"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", GPU_KERNELS)
def test_gpu_kernels_match_oracle(name: str, is_causal: bool, form: str) -> None:
    """Each kernel by name on bf16 (B, 1, Hkv and per-head masks, a ragged length, GQA)
    against the float64 oracle, error within 2x a naive same-dtype reference; lists made on
    the device, from a bool mask or from block indices (unordered, repeated, out of range:
    FlashAttention-4's narrow lists)."""
    from support.block_sparse import check_kernel_result

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    q, k, v, dout = _cuda_case(torch.bfloat16, 1000, 2, seed=3)
    for shape in ((2, 4), (1, 2), (2, 1)):
        mask = _bool_mask((*shape, 8, 8), seed=sum(shape), density=0.4)
        given = mask if form == "bool" else _index_rows(mask)
        dev = [t.cuda().requires_grad_() for t in (q, k, v)]
        _skip_unless_runs(name, dev[0], given.cuda())
        out, lse = block_sparse_attention(*dev, given.cuda(), block_size=128,
                                          is_causal=is_causal, return_lse=True,
                                          backend=name)  # fmt: skip
        grads = [g.cpu() for g in torch.autograd.grad(out, dev, dout.cuda())]
        tokens = runtime_token_mask(mask, 128, batch=2, heads=4, query_len=1000, key_len=1000,
                                    is_causal=is_causal)  # fmt: skip
        check_kernel_result(q, k, v, dout, tokens, out.detach().cpu(), lse.cpu(), grads)


@pytest.mark.gpu
@pytest.mark.parametrize("indices", [False, True], ids=["bool", "indices"])
@pytest.mark.parametrize("name", ["triton", "flex", "flash_attn4", None])
def test_gpu_select_forward_backward_without_host_synchronisation(
    name: str | None, indices: bool
) -> None:
    """A training step's attention: select_blocks on the GPU (a bool mask or block indices),
    the forward and backward on its mask, under ``torch.cuda.set_sync_debug_mode("error")``
    (a first step outside it compiles the kernels)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    q, k, v, dout = (t.cuda() for t in _cuda_case(torch.bfloat16, 2048, 2, seed=5))
    mask = select_blocks(q, k, block_size=128, topk=3, is_causal=True, per="kv_head",
                         return_indices=indices)  # fmt: skip
    if name is not None:
        _skip_unless_runs(name, q, mask)

    def step(x: torch.Tensor) -> list[torch.Tensor]:
        leaves = [t.detach().requires_grad_() for t in (x, k, v)]
        blocks = select_blocks(leaves[0], leaves[1], block_size=128, topk=3, is_causal=True,
                               per="kv_head", return_indices=indices)  # fmt: skip
        out = block_sparse_attention(*leaves, blocks, block_size=128, is_causal=True,
                                     backend=name)  # fmt: skip
        return list(torch.autograd.grad(out, leaves, dout))

    step(q)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grads = step(q * 1.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(bool(torch.isfinite(g).all()) for g in grads)


@pytest.mark.gpu
def test_gpu_flex_takes_a_new_mask_without_recompiling() -> None:
    """A new mask of the same shape each step: a new BlockMask, the same compiled kernel (Note
    [FlexAttention block masks])."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    q, k, v, dout = (t.cuda() for t in _cuda_case(torch.bfloat16, 1024, 2, seed=7))
    masks = [_bool_mask((2, 2, 8, 8), seed=s).cuda() for s in range(3)]
    _skip_unless_runs("flex", q, masks[0])

    def step(mask: torch.Tensor) -> torch.Tensor:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = block_sparse_attention(*leaves, mask, block_size=128, backend="flex")
        return torch.autograd.grad(out, leaves, dout)[0]

    first = step(masks[0])
    with torch._dynamo.config.patch(error_on_recompile=True):
        others = [step(mask) for mask in masks[1:]]
    assert not torch.equal(first, others[0])  # each step ran its own mask
