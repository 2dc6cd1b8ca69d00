"""Block-sparse attention against the float64 dense masked oracle: outputs, lse and all gradients.

The oracle (``tests/support/oracle.py``) gets the token-level 0/1 mask: the pattern's block mask
expanded to tokens (the last block shorter), AND the top-left causal mask. The GPU tests (marked)
run the FlexAttention path.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from support.block_sparse import (
    assert_end_aligned_refused,
    check_kernel_result,
    chosen_kernel,
    token_mask,
)
from support.block_sparse import oracle_with_grads as _oracle
from support.oracle import masked_attention
from support.tolerances import assert_close_to_oracle

import dilated_attention
import dilated_attention.block_sparse.flex as bs_flex
import dilated_attention.block_sparse.plan as bs_plan
import dilated_attention.block_sparse.tiles as bs_tiles
import dilated_attention.resolve.resolver as resolve_step
import dilated_attention.resolve.strategy as strategies
from dilated_attention import (
    BlockSparseAttention,
    BlockSparseMultiheadAttention,
    MultiheadDilatedAttention,
    block_sparse_attention,
    create_block_sparse_attention,
)
from dilated_attention import patterns as P
from dilated_attention.backends.registry import get_backend

F64 = torch.float64
B, H, D = 2, 4, 8

PATTERNS = {
    "local1": P.LocalWindow(1),
    "local0": P.LocalWindow(0),
    "global_local": P.GlobalLocal(1, 0),
    "dilated": P.DilatedBlocks((2, 3)),
    "random": P.Random(0.35, seed=5),
    "union": P.LocalWindow(0) | P.DilatedBlocks((3,)),
    "intersection": P.Random(0.6, seed=2) & P.LocalWindow(2),
}


def _inputs(
    query_len: int, key_len: int, kv_heads: int, dtype: torch.dtype = F64, seed: int = 0
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(B, query_len, H, D), (B, key_len, kv_heads, D), (B, key_len, kv_heads, D)]
    shapes.append((B, query_len, H, D))
    return [torch.randn(s, generator=gen, dtype=F64).to(dtype) for s in shapes]


def _run(q, k, v, dout, pattern, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = block_sparse_attention(*leaves, pattern, return_lse=True, **kwargs)
    grads = torch.autograd.grad(out, leaves, dout)
    return out, lse, grads


def _check_f64(got, want, case: str) -> None:
    out, lse, grads = got
    ref_out, ref_lse, ref_grads = want
    tight = {"atol": 1e-10, "rtol": 1e-7}
    assert not any(bool(torch.isnan(t).any()) for t in (out, lse, *grads)), f"NaN in {case}"
    torch.testing.assert_close(out, ref_out, **tight, msg=lambda m: f"out {case}: {m}")
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), f"lse -inf rows differ {case}"
    torch.testing.assert_close(lse, ref_lse, **tight, msg=lambda m: f"lse {case}: {m}")
    for name, g, rg in zip("qkv", grads, ref_grads, strict=True):
        torch.testing.assert_close(g, rg, **tight, msg=lambda m, n=name: f"d{n} {case}: {m}")


# -- float64 oracle: every pattern, causal and not, ragged, rectangular, GQA, backends -------------
@pytest.mark.parametrize("backend", [None, "math", "cpu_flash"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("name", list(PATTERNS))
def test_matches_oracle(name: str, is_causal: bool, backend: str | None) -> None:
    pattern = PATTERNS[name]
    for (nq, nk), block_size, kv_heads in [((37, 37), 8, 4), ((40, 40), 8, 2), ((30, 45), 6, 1)]:
        q, k, v, dout = _inputs(nq, nk, kv_heads, seed=nq + nk)
        mask = token_mask(pattern, block_size, nq, nk, is_causal)
        got = _run(q, k, v, dout, pattern, block_size=block_size, is_causal=is_causal,
                   backend=backend)  # fmt: skip
        case = f"{name} causal={is_causal} {backend} N=({nq},{nk}) bs={block_size} Hkv={kv_heads}"
        _check_f64(got, _oracle(q, k, v, dout, mask), case)


def test_query_longer_than_key() -> None:
    q, k, v, dout = _inputs(45, 27, 2, seed=3)
    pattern = P.GlobalLocal(1, 1)
    got = _run(q, k, v, dout, pattern, block_size=8, is_causal=False, scale=0.4)
    want = _oracle(q, k, v, dout, token_mask(pattern, 8, 45, 27, False), scale=0.4)
    _check_f64(got, want, "Nq > Nk")


def test_causal_query_longer_than_key_raises() -> None:
    """A causal query is the last positions of the key sequence (end-aligned): it cannot be
    longer than the key (before: top-left, rows past the keys saw every key)."""
    q, k, v, _ = _inputs(45, 27, 2, seed=3)
    with pytest.raises(ValueError, match=r"cannot be longer than the key.*45, 4, 8.*27, 2, 8"):
        block_sparse_attention(q, k, v, P.GlobalLocal(1, 1), block_size=8, is_causal=True)


@pytest.mark.parametrize("block_size", [1, 5, 16, 64])
def test_block_sizes_including_one_block_and_one_token(block_size: int) -> None:
    q, k, v, dout = _inputs(33, 33, 2, seed=block_size)
    pattern = P.LocalWindow(1) | P.Random(0.3, seed=1)
    for is_causal in (False, True):
        got = _run(q, k, v, dout, pattern, block_size=block_size, is_causal=is_causal)
        want = _oracle(q, k, v, dout, token_mask(pattern, block_size, 33, 33, is_causal))
        _check_f64(got, want, f"block_size={block_size} causal={is_causal}")


def test_dense_pattern_equals_dense_attention() -> None:
    q, k, v, _ = _inputs(29, 29, 2)
    for is_causal in (False, True):
        out = block_sparse_attention(q, k, v, P.LocalWindow(100), block_size=8, is_causal=is_causal)
        ref = dilated_attention.attention(q, k, v, is_causal=is_causal)
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)


def _no_sparse_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("the sparse plan ran for a pattern that keeps every block pair")

    monkeypatch.setattr(bs_plan, "_local_plan", fail)
    monkeypatch.setattr(strategies, "_flex_forward", fail)
    monkeypatch.setattr(strategies, "_triton_lists", fail)


FULL_CASES = [
    # pattern, (Nq, Nk), block_size, Hkv, is_causal
    (P.LocalWindow(100), (37, 37), 8, 2, False),
    (P.LocalWindow(100), (37, 37), 8, 2, True),
    (P.Random(1.0, seed=3), (40, 40), 8, 4, False),
    (P.GlobalLocal(1, 1), (24, 24), 8, 1, False),  # 3 blocks: every pair is global or local
    (P.Custom(torch.ones(5, 5, dtype=torch.bool).tril()), (40, 40), 8, 2, True),
    (P.LocalWindow(0) | P.DilatedBlocks((1,)), (30, 45), 6, 1, True),
    # End-aligned causal: the 13 queries are the last of 27 positions (square 4 x 4 blocks).
    (P.Custom(torch.ones(4, 4, dtype=torch.bool).tril()), (13, 27), 8, 2, True),
]


@pytest.mark.parametrize("backend", [None, "math", "cpu_flash"])
@pytest.mark.parametrize("case", range(len(FULL_CASES)))
def test_patterns_keeping_every_pair_run_dense_attention(
    case: int, backend: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Note [Dense fallback]: no sparse plan runs, and out, lse and every gradient equal the
    float64 oracle; a named kernel is the kernel that runs."""
    pattern, (nq, nk), block_size, kv_heads, is_causal = FULL_CASES[case]
    _no_sparse_plan(monkeypatch)
    q, k, v, dout = _inputs(nq, nk, kv_heads, seed=case)
    kernels: list[str] = []
    original = resolve_step._dense

    def spy(*args: object, **kwargs: object) -> object:
        strategy = original(*args, **kwargs)
        kernels.append(strategy.kernel.backend.name)
        return strategy

    monkeypatch.setattr(resolve_step, "_dense", spy)
    got = _run(q, k, v, dout, pattern, block_size=block_size, is_causal=is_causal,
               backend=backend, scale=0.3)  # fmt: skip
    want = _oracle(q, k, v, dout, token_mask(pattern, block_size, nq, nk, is_causal), scale=0.3)
    _check_f64(got, want, f"full case {case} causal={is_causal} {backend}")
    assert len(kernels) == 1 and (backend is None or kernels == [backend])


@pytest.mark.parametrize(
    "mask, is_causal",
    [
        (torch.ones(5, 5, dtype=torch.bool).tril(), False),  # full only under causal
        (~torch.eye(5, dtype=torch.bool), False),
        (torch.ones(5, 5, dtype=torch.bool).tril() & ~torch.eye(5, dtype=torch.bool), True),
    ],
)
def test_patterns_missing_a_pair_keep_the_sparse_plan(
    mask: torch.Tensor, is_causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    planned: list[int] = []
    original = bs_plan._local_plan

    def spy(*args: object) -> object:
        planned.append(1)
        return original(*args)

    monkeypatch.setattr(bs_plan, "_local_plan", spy)
    pattern = P.Custom(mask)
    q, k, v, dout = _inputs(40, 40, 2, seed=7)
    got = _run(q, k, v, dout, pattern, block_size=8, is_causal=is_causal)
    _check_f64(got, _oracle(q, k, v, dout, token_mask(pattern, 8, 40, 40, is_causal)), "sparse")
    assert planned == [1]


def test_keeps_every_pair() -> None:
    full, lower = torch.ones(4, 3, dtype=torch.bool), torch.ones(4, 3, dtype=torch.bool).tril()
    keeps = resolve_step.keeps_every_pair
    assert keeps(full, False) and keeps(full, True)
    assert keeps(lower, True) and not keeps(lower, False)
    lower[3, 2] = False
    assert not keeps(lower, True)


def test_forced_flex_is_not_replaced_by_dense() -> None:
    """backend="flex" keeps FlexAttention even at full density (it cannot run on the CPU)."""
    q, k, v, _ = _inputs(16, 16, 2)
    with pytest.raises(ValueError, match="flex"):
        block_sparse_attention(q.float(), k.float(), v.float(), P.LocalWindow(10), block_size=8,
                               backend="flex")  # fmt: skip


def test_flex_kernel_options_only_for_measured_devices() -> None:
    cpu = torch.device("cpu")
    assert bs_flex.flex_kernel_options(cpu, 128, torch.bfloat16) is None


def test_empty_rows_give_zeros_and_no_nan_gradients() -> None:
    """Query blocks with no allowed key (by the pattern, or only future keys under causal)."""
    mask = torch.tensor(
        [[1, 0, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 1, 0], [0, 1, 0, 0, 0], [0, 0, 0, 0, 0]],
        dtype=torch.bool,
    )
    pattern = P.Custom(mask)
    q, k, v, dout = _inputs(36, 36, 2)
    for is_causal in (False, True):
        got = _run(q, k, v, dout, pattern, block_size=8, is_causal=is_causal)
        tokens = token_mask(pattern, 8, 36, 36, is_causal)
        _check_f64(got, _oracle(q, k, v, dout, tokens), f"empty rows causal={is_causal}")
        out, lse, (dq, _, _) = got
        empty = tokens.sum(1) == 0
        assert bool(empty.any())
        assert torch.equal(out[:, empty], torch.zeros_like(out[:, empty]))
        assert bool(torch.isneginf(lse[:, :, empty]).all())
        assert torch.equal(dq[:, empty], torch.zeros_like(dq[:, empty]))


def test_all_empty_pattern() -> None:
    pattern = P.Custom(torch.zeros(3, 3, dtype=torch.bool))
    q, k, v, dout = _inputs(20, 20, 4)
    out, lse, grads = _run(q, k, v, dout, pattern, block_size=8)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_causal", [False, True])
def test_low_precision(dtype: torch.dtype, is_causal: bool) -> None:
    pattern = P.GlobalLocal(1, 1) | P.Random(0.2, seed=4)
    q, k, v, dout = _inputs(50, 50, 2, dtype=dtype, seed=11)
    out, lse, grads = _run(q, k, v, dout, pattern, block_size=8, is_causal=is_causal)
    mask = token_mask(pattern, 8, 50, 50, is_causal)
    ref_out, ref_lse, ref_grads = _oracle(q, k, v, dout, mask)
    same = None
    if dtype == torch.bfloat16:  # the naive same-dtype reference for the ratio check
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        o, lo = masked_attention(*leaves, mask.expand(H, -1, -1), compute_dtype=dtype)
        same = (o, lo, *torch.autograd.grad(o, leaves, dout))
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close_to_oracle(out, ref_out, same and same[0], name="out")
    assert_close_to_oracle(lse, ref_lse, same and same[1], name="lse", dtype=dtype)
    for i, (name, g, rg) in enumerate(zip("qkv", grads, ref_grads, strict=True)):
        assert g.dtype == dtype
        assert_close_to_oracle(g, rg, same and same[i + 2], name=f"d{name}", grad=True)


def test_plain_tensor_when_return_lse_false() -> None:
    q, k, v, _ = _inputs(16, 16, 4)
    out = block_sparse_attention(q, k, v, P.LocalWindow(1), block_size=4)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape


def test_non_contiguous_inputs() -> None:
    q, k, v, dout = _inputs(24, 24, 2)
    views = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    assert not views[0].is_contiguous()
    pattern = P.DilatedBlocks((2,))
    got = _run(*views, dout, pattern, block_size=4, is_causal=True)
    _check_f64(got, _oracle(q, k, v, dout, token_mask(pattern, 4, 24, 24, True)), "strided")


# -- cost: only allowed blocks are computed (Note [Block-sparse plan]) -----------------------------
def _spy_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int, bool]]:
    kernel = get_backend("math")
    calls: list[tuple[int, int, int, bool]] = []
    original = kernel.forward

    def spy(q, k, v, **kwargs):
        calls.append((q.shape[0], q.shape[1], k.shape[1], kwargs["is_causal"]))
        return original(q, k, v, **kwargs)

    monkeypatch.setattr(kernel, "forward", spy)
    return calls


@pytest.mark.parametrize("name", ["local1", "random", "global_local"])
def test_work_proportional_to_allowed_blocks(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Non-causal: the score elements computed equal the allowed token pairs exactly; causal:
    at most the allowed pairs plus the diagonal blocks' upper halves. No call sees N x N."""
    pattern = PATTERNS[name]
    n, block_size = 64, 8
    q, k, v, _ = _inputs(n, n, 2)
    for is_causal in (False, True):
        calls = _spy_calls(monkeypatch)
        block_sparse_attention(q, k, v, pattern, block_size=block_size, is_causal=is_causal,
                               backend="math")  # fmt: skip
        computed = sum(g * lq * lk for g, lq, lk, _ in calls) // B
        allowed = int(token_mask(pattern, block_size, n, n, is_causal).sum())
        if is_causal:
            assert allowed <= computed <= allowed + (n // block_size) * block_size**2 // 2 + n
        else:
            assert computed == allowed, (computed, allowed)
        assert all(lk * lq < n * n for _, lq, lk, _ in calls)
        assert all(g // B * lk <= max(n, bs_plan.MIN_KV_ROWS_PER_CALL) or g == B
                   for g, _, lk, _ in calls)  # fmt: skip


def test_calls_are_chunked_to_the_key_row_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bs_plan, "MIN_KV_ROWS_PER_CALL", 1)
    calls = _spy_calls(monkeypatch)
    pattern = P.Random(0.5, seed=9)
    q, k, v, dout = _inputs(48, 48, 2)
    got = _run(q, k, v, dout, pattern, block_size=4, backend="math", is_causal=True)
    assert all(g // B * lk <= 48 or g == B for g, _, lk, _ in calls)
    assert len(calls) > 2
    _check_f64(got, _oracle(q, k, v, dout, token_mask(pattern, 4, 48, 48, True)), "chunked")


def test_plan_groups_query_blocks_into_few_calls() -> None:
    mask = P.LocalWindow(1).block_mask(16, 16)
    calls = bs_plan.plan_calls(mask, block_size=8, query_len=128, key_len=128, is_causal=False)
    # Two edge blocks with 2 neighbours and fourteen with 3: two stacked calls.
    assert sorted(c.q_index.shape[0] for c in calls) == [2, 14]


# -- FlexAttention block masks, checked on the CPU (Note [FlexAttention block masks]) --------------
def _flex_reach(block_mask, query_len: int, key_len: int) -> torch.Tensor:
    """The token pairs the compiled kernel attends: full tiles whole, partial tiles where
    ``mask_mod`` allows, nothing else."""
    tile = bs_tiles.KERNEL_TILE
    reach = torch.zeros(query_len, key_len, dtype=torch.bool)
    allowed = block_mask.mask_mod(
        0, 0, torch.arange(query_len).view(-1, 1), torch.arange(key_len).view(1, -1)
    )
    lists = (
        (block_mask.kv_num_blocks, block_mask.kv_indices, True),
        (block_mask.full_kv_num_blocks, block_mask.full_kv_indices, False),
    )
    for nums, indices, partial in lists:
        for a in range(nums.shape[-1]):
            for b in indices[0, 0, a, : int(nums[0, 0, a])].tolist():
                rows, cols = slice(a * tile, (a + 1) * tile), slice(b * tile, (b + 1) * tile)
                reach[rows, cols] |= allowed[rows, cols] if partial else True
    return reach


@pytest.mark.parametrize("block_size", [16, 48, 100, 128, 256])
@pytest.mark.parametrize("is_causal", [False, True])
def test_flex_block_mask_covers_exactly_the_allowed_pairs(block_size: int, is_causal: bool) -> None:
    pytest.importorskip("torch.nn.attention.flex_attention")
    for (nq, nk), pattern in [
        ((300, 300), P.LocalWindow(1)),
        ((257, 300), P.Random(0.3, seed=2)),
        ((300, 129), P.GlobalLocal(1, 0) | P.DilatedBlocks((3,))),
    ]:
        block_mask, empty_rows = bs_flex.flex_block_mask(
            pattern, block_size, nq, nk, is_causal, torch.device("cpu")
        )
        # The kernel's own contract: top-left causal over the rows it is given.
        want = token_mask(pattern, block_size, nq, nk, is_causal, query_start=0).bool()
        assert block_mask.seq_lengths == (nq, nk)
        assert torch.equal(_flex_reach(block_mask, nq, nk), want), (block_size, nq, nk, pattern)
        assert torch.equal(empty_rows, ~want.any(1))


def test_flex_block_mask_full_tiles_skip_the_mask_mod() -> None:
    """A block size that is a multiple of the tile: non-causal tiles are all full."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    block_mask, _ = bs_flex.flex_block_mask(
        P.LocalWindow(1), 256, 1024, 1024, False, torch.device("cpu")
    )
    assert int(block_mask.kv_num_blocks.sum()) == 0
    assert int(block_mask.full_kv_num_blocks.sum()) == (4 * 3 - 2) * 4


# -- modules and factory -------------------------------------------------------------------------
def test_module_equals_functional() -> None:
    module = BlockSparseAttention(P.GlobalLocal(1, 1), block_size=8, scale=0.3, backend="math")
    q, k, v, _ = _inputs(30, 30, 2)
    for is_causal in (False, True):
        ref = block_sparse_attention(q, k, v, P.GlobalLocal(1, 1), block_size=8,
                                     is_causal=is_causal, scale=0.3)  # fmt: skip
        out = module(q, k, v, is_causal=is_causal)
        assert out.shape == q.shape
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    assert "GlobalLocal" in repr(module)
    assert list(module.state_dict()) == ["_extra_state"]  # its schedule, and no weights


def test_module_rejects_key_padding_mask() -> None:
    module = BlockSparseAttention(P.LocalWindow(1), block_size=4)
    q, k, v, _ = _inputs(8, 8, 4)
    with pytest.raises(ValueError, match="key_padding_mask"):
        module(q, k, v, key_padding_mask=torch.zeros(B, 8, dtype=torch.bool))


def test_multihead_shape_functional_and_state_dict() -> None:
    torch.manual_seed(0)
    pattern = P.LocalWindow(1) | P.DilatedBlocks((4,))
    layer = BlockSparseMultiheadAttention(32, 4, pattern, block_size=4, num_kv_heads=2, dtype=F64)
    x = torch.randn(2, 26, 32, dtype=F64)
    out, weights = layer(x, is_causal=True)
    assert out.shape == x.shape and weights is None
    # The layer is projections + the functional + sub-LayerNorm + output projection.
    q = layer.q_proj(x).view(2, 26, 4, 8)
    k = layer.k_proj(x).view(2, 26, 2, 8)
    v = layer.v_proj(x).view(2, 26, 2, 8)
    attn = block_sparse_attention(q, k, v, pattern, block_size=4, is_causal=True)
    ref = layer.out_proj(layer.norm(attn.reshape(2, 26, 32)))
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    # state_dict: round trip, and the same keys as MultiheadDilatedAttention.
    other = BlockSparseMultiheadAttention(32, 4, pattern, block_size=4, num_kv_heads=2, dtype=F64)
    other.load_state_dict(layer.state_dict())
    torch.testing.assert_close(other(x, is_causal=True)[0], out, atol=0, rtol=0)
    dense = MultiheadDilatedAttention(32, 4, [8], [1], num_kv_heads=2, dtype=F64)
    assert set(dense.state_dict()) == set(layer.state_dict())
    out.sum().backward()
    assert all(p.grad is not None for p in layer.parameters())


def test_multihead_rejects_need_weights_and_masks() -> None:
    layer = BlockSparseMultiheadAttention(16, 2, P.LocalWindow(1), block_size=4)
    x = torch.randn(1, 8, 16)
    with pytest.raises(ValueError, match="need_weights"):
        layer(x, need_weights=True)
    with pytest.raises(ValueError, match="key_padding_mask"):
        layer(x, key_padding_mask=torch.zeros(1, 8, dtype=torch.bool))


def test_factory_builds_block_sparse_modules() -> None:
    module = create_block_sparse_attention(P.LocalWindow(1), block_size=8)
    assert type(module) is BlockSparseAttention and module.block_size == 8
    module = create_block_sparse_attention(P.LocalWindow(1), kind="block_sparse", backend="math",
                                           scale=0.5)  # fmt: skip
    assert module.backend == "math" and module.scale == 0.5
    layer = create_block_sparse_attention(P.preset("sparse_25"), embed_dim=32, num_heads=4,
                                          num_kv_heads=2)  # fmt: skip
    assert type(layer) is BlockSparseMultiheadAttention and layer.num_kv_heads == 2
    ring = create_block_sparse_attention(P.LocalWindow(1), kind="block_sparse_ring", block_size=8)
    assert type(ring) is dilated_attention.BlockSparseRingAttention
    assert {"block_sparse", "block_sparse_ring"} <= set(dilated_attention.list_kinds())


def test_factory_bad_arguments() -> None:
    with pytest.raises(TypeError, match="pattern"):
        create_block_sparse_attention("local")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kind"):
        create_block_sparse_attention(P.LocalWindow(1), kind="dilated")
    with pytest.raises(ValueError, match="num_heads"):
        create_block_sparse_attention(P.LocalWindow(1), embed_dim=32)
    with pytest.raises(ValueError, match="block_size"):
        create_block_sparse_attention(P.LocalWindow(1), block_size=0)
    with pytest.raises(ValueError, match="math"):
        create_block_sparse_attention(P.LocalWindow(1), backend="nope")


# -- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [0, -4])
def test_block_size_below_one(block_size: int) -> None:
    q, k, v, _ = _inputs(8, 8, 4)
    with pytest.raises(ValueError, match="block_size"):
        block_sparse_attention(q, k, v, P.LocalWindow(1), block_size=block_size)
    with pytest.raises(ValueError, match="block_size"):
        BlockSparseAttention(P.LocalWindow(1), block_size=block_size)


def test_block_size_not_an_int() -> None:
    q, k, v, _ = _inputs(8, 8, 4)
    with pytest.raises(TypeError, match="block_size"):
        block_sparse_attention(q, k, v, P.LocalWindow(1), block_size=4.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("pattern", ["local", None])
def test_pattern_that_is_not_a_pattern(pattern: object) -> None:
    """Neither a pattern nor a tensor (a run-time block mask: tests/ops/test_block_sparse_runtime.py
    holds its checks)."""
    q, k, v, _ = _inputs(8, 8, 4)
    with pytest.raises(TypeError, match=r"Pattern.*or a run-time block mask"):
        block_sparse_attention(q, k, v, pattern, block_size=4)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Pattern"):
        BlockSparseAttention(pattern)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Pattern"):
        BlockSparseAttention(torch.ones(2, 2, dtype=torch.bool))  # type: ignore[arg-type]


def test_custom_mask_of_other_block_count() -> None:
    q, k, v, _ = _inputs(20, 20, 4)
    pattern = P.Custom(torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\(4, 4\).*\(3, 3\)"):
        block_sparse_attention(q, k, v, pattern, block_size=8)
    block_sparse_attention(q, k, v, pattern, block_size=5)  # 4 x 4 blocks: fine


def test_bad_tensors_flags_and_backend() -> None:
    q, k, v, _ = _inputs(8, 8, 4)
    with pytest.raises(ValueError, match="query"):
        block_sparse_attention(q[0], k, v, P.LocalWindow(1), block_size=4)
    with pytest.raises(ValueError, match="heads"):
        block_sparse_attention(q[:, :, :3], k, v, P.LocalWindow(1), block_size=4)
    with pytest.raises(TypeError, match="is_causal"):
        block_sparse_attention(q, k, v, P.LocalWindow(1), is_causal=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="return_lse"):
        block_sparse_attention(q, k, v, P.LocalWindow(1), return_lse="y")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="scale"):
        block_sparse_attention(q, k, v, P.LocalWindow(1), scale=-1.0)
    with pytest.raises(ValueError, match="math"):
        block_sparse_attention(q, k, v, P.LocalWindow(1), backend="nope")
    with pytest.raises(ValueError, match="flex"):  # CPU: FlexAttention cannot run (no lse, grad)
        block_sparse_attention(q, k, v, P.LocalWindow(1), backend="flex")


# -- GPU: the FlexAttention path against the float64 oracle ---------------------------------------
GPU_CASES = [
    # (Nq, Nk, block_size, kv_heads, pattern)
    (512, 512, 128, 4, P.LocalWindow(1)),
    (300, 300, 64, 2, P.Random(0.3, seed=3) | P.LocalWindow(0)),
    (333, 333, 256, 1, P.GlobalLocal(1, 0)),
    (384, 256, 128, 2, P.DilatedBlocks((2,))),
    (200, 200, 48, 4, P.Custom(torch.eye(5, dtype=torch.bool).roll(1, 1))),  # empty rows if causal
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("case", range(len(GPU_CASES)))
def test_flex_path_matches_oracle(case: int, is_causal: bool, dtype: torch.dtype) -> None:
    """The FlexAttention path (by name: on CUDA our Triton kernels come first where they run)
    against the float64 oracle, computed on the CPU from the same rounded inputs; bf16/fp16 error
    within 2x a naive same-dtype reference (tests/support/tolerances.py)."""
    nq, nk, block_size, kv_heads, pattern = GPU_CASES[case]
    device = torch.device("cuda")
    if is_causal and nq != nk:
        assert_end_aligned_refused(nq, nk, pattern, block_size, "flex", device)
        return
    gen = torch.Generator().manual_seed(case)
    shapes = [(2, nq, 4, 64), (2, nk, kv_heads, 64), (2, nk, kv_heads, 64), (2, nq, 4, 64)]
    q, k, v, dout = (torch.randn(s, generator=gen).to(dtype) for s in shapes)
    dev = [t.to(device).requires_grad_() for t in (q, k, v)]
    chosen = chosen_kernel(
        dev[0], dev[1], is_causal=is_causal, block_size=block_size, needs_grad=True,
        backend="flex",
    )  # fmt: skip
    assert chosen.runs_plan and chosen.backend.name == "flex", "FlexAttention not taken on CUDA"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # return_lse's deprecation notice
        out, lse = block_sparse_attention(
            *dev,
            pattern,
            block_size=block_size,
            is_causal=is_causal,
            return_lse=True,
            backend="flex",
        )
    grads = [g.cpu() for g in torch.autograd.grad(out, dev, dout.to(device))]
    mask = token_mask(pattern, block_size, nq, nk, is_causal)
    check_kernel_result(q, k, v, dout, mask, out.detach().cpu(), lse.cpu(), grads)


@pytest.mark.gpu
def test_cuda_full_pattern_runs_dense_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [Dense fallback] on CUDA: no FlexAttention, same result as dense attention."""
    _no_sparse_plan(monkeypatch)
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 384, 4, 64, generator=gen).to(device, torch.bfloat16)
               for _ in range(3))  # fmt: skip
    for is_causal in (False, True):
        out = block_sparse_attention(q, k, v, P.LocalWindow(2), block_size=128, is_causal=is_causal)
        ref = dilated_attention.attention(q, k, v, is_causal=is_causal)
        torch.testing.assert_close(out, ref, atol=0, rtol=0)


@pytest.mark.gpu
def test_flex_path_with_tuned_kernel_options_matches_fallback() -> None:
    """D = 128 in bf16 takes the pinned kernel options on an sm90 GPU (defaults elsewhere)."""
    device = torch.device("cuda")
    options = bs_flex.flex_kernel_options(device, 128, torch.bfloat16)
    if torch.cuda.get_device_capability() == (9, 0):
        assert options is not None and options["fwd_BLOCK_M"] == 128
    pattern = P.LocalWindow(1) | P.Random(0.3, seed=4)
    gen = torch.Generator().manual_seed(2)
    q, k, v, dout = (torch.randn(1, 640, 4, 128, generator=gen).to(device) for _ in range(4))
    low = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        out = block_sparse_attention(*low, pattern, block_size=128, is_causal=True,
                                     backend="flex")  # fmt: skip
    grads = torch.autograd.grad(out, low, dout.to(torch.bfloat16))
    ref_leaves = [t.to(torch.bfloat16).float().requires_grad_() for t in (q, k, v)]
    ref = block_sparse_attention(*ref_leaves, pattern, block_size=128, is_causal=True,
                                 backend="math")  # fmt: skip
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout.to(torch.bfloat16).float())
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    for g, rg in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g.float(), rg, atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
def test_cuda_fallback_by_name_matches_flex() -> None:
    """backend="math" on CUDA runs the fallback; it agrees with the FlexAttention path."""
    device = torch.device("cuda")
    pattern = P.LocalWindow(1) | P.Random(0.2, seed=1)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 320, 4, 64, generator=gen).to(device) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        flex = block_sparse_attention(q, k, v, pattern, block_size=64, is_causal=True)
    math = block_sparse_attention(q, k, v, pattern, block_size=64, is_causal=True, backend="math")
    torch.testing.assert_close(flex, math, atol=1e-4, rtol=1e-4)
