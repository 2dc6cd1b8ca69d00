"""Block-sparse attention through FlashAttention-4's block sparsity (Note [FlashAttention-4 block
sparsity]) against the float64 oracle.

On the CPU a fake ``flash_attn.cute`` stands in for the kernel: it reads only the tile lists,
tile by tile as FA4 does (full tiles whole, partial tiles through the ``mask_mod`` it is given,
rows past the sequence end dropped), and computes attention in float64; rows and keys no tile
reaches come back as NaN, the way uninitialised kernel memory might. So these tests check the
tile lists in both directions, the causal ``mask_mod``, the runner's handling of unreached rows
and keys, and the choice; the GPU tests (marked) run the real kernel. Run-time block masks' lists
(per batch row and query head, made on the device) run through the same fake.
"""

from __future__ import annotations

import itertools
import math
import sys
import types
from typing import Any, NamedTuple

import pytest
import torch
from support.block_sparse import (
    assert_end_aligned_refused,
    check_kernel_result,
    oracle_with_grads,
    token_mask,
)
from support.runtime_masks import runtime_token_mask
from support.triton import poison_new_buffers

import dilated_attention.backends.flash_attn4.chunks as chunk_rule
from dilated_attention import block_sparse_attention
from dilated_attention import patterns as P
from dilated_attention.backends.base import KernelInputs
from dilated_attention.backends.flash_attn4 import FlashAttn4Backend
from dilated_attention.backends.flash_attn4.chunks import accumulator_chunks, head_chunks
from dilated_attention.backends.registry import Selection, get_backend, registry_for
from dilated_attention.block_sparse.fa4 import FlashAttn4BlockSparseRunner, fa4_tiles
from dilated_attention.block_sparse.runtime import check_block_mask
from dilated_attention.core.autograd import run_attention
from dilated_attention.resolve import BLOCK_SPARSE, Request
from dilated_attention.resolve.block_masks import RuntimeMaskStrategy

F64 = torch.float64
TILE = 128
SCALE = 0.3

# (query_len, key_len, block_size, kv_heads, pattern); 4 query heads, D = 8 on the CPU.
CASES = [
    (384, 384, 128, 4, P.LocalWindow(1)),
    (300, 300, 128, 2, P.Random(0.4, seed=3)),  # ragged last tile, GQA
    (256, 520, 128, 1, P.GlobalLocal(1, 0) | P.DilatedBlocks((2,))),  # rectangular, MQA
    (520, 256, 256, 2, P.LocalWindow(0)),  # query longer than key, block of two tiles
    (400, 400, 128, 4, P.Custom(torch.eye(4, dtype=torch.bool).roll(1, 1))),  # empty if causal
]


# -- the fake kernel -------------------------------------------------------------------------------
class _SparseTensors(NamedTuple):
    mask_block_cnt: torch.Tensor
    mask_block_idx: torch.Tensor
    full_block_cnt: torch.Tensor | None = None
    full_block_idx: torch.Tensor | None = None
    cu_total_m_blocks: torch.Tensor | None = None
    cu_block_idx_offsets: torch.Tensor | None = None
    block_size: tuple[int, int] | None = None


def _reach(
    tiles: _SparseTensors, mask_mod: Any, rows: int, cols: int, by_key: bool = False
) -> torch.Tensor:
    """(Bl, Hl, rows, cols) bool: the token pairs the lists of each batch row and head reach
    (rows are the listing side: query tiles, or key tiles when ``by_key``; ``mask_mod`` always
    takes query, then key)."""
    assert tiles.block_size == (TILE, TILE)
    batch, heads = tiles.mask_block_cnt.shape[:2]
    reach = torch.zeros(batch, heads, rows, cols, dtype=torch.bool)
    lists = ((tiles.mask_block_cnt, tiles.mask_block_idx, True),
             (tiles.full_block_cnt, tiles.full_block_idx, False))  # fmt: skip
    for count, index, partial in lists:
        assert count.dtype == index.dtype == torch.int32 and count.shape[:2] == (batch, heads)
        for b, h, r in itertools.product(range(batch), range(heads), range(count.shape[-1])):
            for c in index[b, h, r, : int(count[b, h, r])].tolist():
                rs, cs = slice(r * TILE, (r + 1) * TILE), slice(c * TILE, (c + 1) * TILE)
                assert not bool(reach[b, h, rs, cs].any()), "a tile listed twice"
                block = torch.ones_like(reach[b, h, rs, cs])
                if partial and mask_mod is not None:
                    m = torch.arange(rows)[rs].view(-1, 1)
                    n = torch.arange(cols)[cs].view(1, -1)
                    m, n = (n, m) if by_key else (m, n)
                    block = mask_mod(0, 0, m, n, None, None).expand_as(block)
                reach[b, h, rs, cs] = block
    return reach


def _scores(q, k, reach):
    heads = q.shape[2]
    kd = k.double().repeat_interleave(heads // k.shape[2], dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kd) * SCALE
    return s.masked_fill(~reach, float("-inf")), kd


def _by_row(unreached: torch.Tensor) -> torch.Tensor:
    """(Bl, Hl, N) -> (Bl, N, Hl, 1), to poison (B, N, H, D) rows."""
    return unreached.transpose(1, 2).unsqueeze(-1)


def _install_fake_fa4(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    calls: dict[str, Any] = {}

    def _flash_attn_fwd(q, k, v, softmax_scale=None, causal=False, mask_mod=None,
                        block_sparse_tensors=None, pack_gqa=None, return_lse=False,
                        out=None, lse=None):  # fmt: skip
        calls["fwd"] = dict(locals())
        assert softmax_scale == SCALE and causal is False and pack_gqa is False and return_lse
        reach = _reach(block_sparse_tensors, mask_mod, q.shape[1], k.shape[1])
        s, _ = _scores(q, k, reach)
        lse_ = torch.logsumexp(s, dim=-1)
        heads = q.shape[2]
        vd = v.double().repeat_interleave(heads // v.shape[2], dim=2)
        o = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), vd)
        empty = ~reach.any(-1)  # poison what no tile reaches
        o, lse_ = o.masked_fill(_by_row(empty), float("nan")), lse_.masked_fill(empty, math.nan)
        return o.to(q.dtype), lse_.to(torch.promote_types(q.dtype, torch.float32))

    def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False,
                        mask_mod=None, block_sparse_tensors=None, pack_gqa=None, dq=None,
                        dk=None, dv=None):  # fmt: skip
        calls["bwd"] = dict(locals())
        calls.setdefault("bwd chunks", []).append(calls["bwd"])
        assert causal is False and pack_gqa is False
        by_key = _reach(block_sparse_tensors, mask_mod, k.shape[1], q.shape[1], by_key=True)
        reach = by_key.transpose(-1, -2)
        s, kd = _scores(q, k, reach)
        heads, kv_heads = q.shape[2], k.shape[2]
        p = torch.exp(s - lse.double().unsqueeze(-1)).nan_to_num(0.0)
        do = dout.double()
        vd = v.double().repeat_interleave(heads // kv_heads, dim=2)
        dp = torch.einsum("bqhd,bkhd->bhqk", do, vd)
        delta = (do * out.double()).sum(-1).transpose(1, 2).unsqueeze(-1)
        ds = p * (dp - delta)
        dq_ = torch.einsum("bhqk,bkhd->bqhd", ds, kd) * softmax_scale
        dk_ = torch.einsum("bhqk,bqhd->bkhd", ds, q.double()) * softmax_scale
        dv_ = torch.einsum("bhqk,bqhd->bkhd", p, do)
        b, n = k.shape[:2]
        dk_ = dk_.view(b, n, kv_heads, heads // kv_heads, -1).sum(3)
        dv_ = dv_.view(b, n, kv_heads, heads // kv_heads, -1).sum(3)
        read = reach.any(-2)  # (Bl, Hl, Nk): keys some query of the head reads
        if read.shape[1] > 1:  # a key/value head's keys: read by a head of its group
            read = read.view(read.shape[0], kv_heads, -1, read.shape[-1]).any(2)
        dq_ = dq_.masked_fill(_by_row(~reach.any(-1)), math.nan)  # poison what no tile writes
        # A key tile no query tile of the call visits: zeros (FA4's block-sparse backward writes
        # them, and grouped heads' float32 accumulators start at zero), which a group's later
        # parts are added to; a test may have it left as something else.
        unvisited = calls.get("unvisited key tiles", 0.0)
        dk_, dv_ = (g.masked_fill(_by_row(~read), unvisited) for g in (dk_, dv_))
        dq.copy_(dq_), dk.copy_(dk_), dv.copy_(dv_)
        return dq, dk, dv

    def jit(func):
        return func

    def install(name: str, **attrs: Any) -> None:
        mod = types.ModuleType(name)
        for key, value in attrs.items():
            setattr(mod, key, value)
        monkeypatch.setitem(sys.modules, name, mod)

    install("flash_attn")
    install("flash_attn.cute")
    install("flash_attn.cute.interface", _flash_attn_fwd=_flash_attn_fwd,
            _flash_attn_bwd=_flash_attn_bwd)  # fmt: skip
    install("flash_attn.cute.block_sparsity", BlockSparseTensorsTorch=_SparseTensors)
    install("cutlass")
    install("cutlass.cute", jit=jit)
    return calls


@pytest.fixture(autouse=True)
def _fresh_mask_mod():
    """The causal mask_mod is made once per process: made again around each test, so that one
    made by a fake ``cutlass.cute`` never reaches the real kernel, nor the other way round."""
    import dilated_attention.backends.flash_attn4 as fa4_module

    fa4_module._top_left_causal.cache_clear()
    yield
    fa4_module._top_left_causal.cache_clear()


@pytest.fixture(params=["by the share", "per kv head", "per query head"])
def chunked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The backward in the chunks the rule gives past a floor of 0 (block-sparse: calls whose
    query heads share no key/value head), forced into one call per key/value head (grouped
    heads in one call), or into one per query head (a share no chunk meets: each later query
    head of a group writes its dk and dv into the sums, added after) (Note
    [FlashAttention-4's accumulators by head chunks])."""
    monkeypatch.setattr(chunk_rule, "MIN_CHUNKED_ACCUMULATOR_BYTES", 0)  # tiny tensors too
    if request.param == "per kv head":
        monkeypatch.setattr(chunk_rule, "accumulator_chunks", lambda q, k, *rule: k.shape[2])
    if request.param == "per query head":
        monkeypatch.setattr(chunk_rule, "ACCUMULATOR_SHARE", 0.0)
    return request.param


def _backward_calls(chunked: str, q: torch.Tensor, k: torch.Tensor) -> int:
    """How many backward calls the ``chunked`` fixture's chunks make."""
    forced = {"per kv head": k.shape[2], "per query head": q.shape[2]}
    return forced.get(chunked, accumulator_chunks(q, k, ungrouped=True))


def _inputs(nq: int, nk: int, kv_heads: int, dtype: torch.dtype = F64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(2, nq, 4, 8), (2, nk, kv_heads, 8), (2, nk, kv_heads, 8), (2, nq, 4, 8)]
    return [torch.randn(s, generator=gen, dtype=F64).to(dtype) for s in shapes]


def _run_fake(q, k, v, dout, pattern, block_size, is_causal, create_graph=False):
    tiles = fa4_tiles(pattern, block_size, q.shape[1], k.shape[1], is_causal, q.device)
    runner = FlashAttn4BlockSparseRunner(FlashAttn4Backend(), tiles, block_size, is_causal, SCALE)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = run_attention(*leaves, None, runner)
    grads = torch.autograd.grad(out, leaves, dout, create_graph=create_graph)
    return out, lse, grads, leaves


# -- CPU: the fake kernel --------------------------------------------------------------------------
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_tile_lists_and_runner_match_oracle(
    case: int, is_causal: bool, chunked: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outputs, lse and every gradient against the float64 oracle; unreached rows give 0 and
    -inf, unreached rows and keys zero gradients (the fake poisons unreached rows with NaN)."""
    calls = _install_fake_fa4(monkeypatch)
    nq, nk, block_size, kv_heads, pattern = CASES[case]
    q, k, v, dout = _inputs(nq, nk, kv_heads, seed=case)
    out, lse, grads, _ = _run_fake(q, k, v, dout, pattern, block_size, is_causal)
    # The runner's own contract: top-left causal over the rows it is given.
    mask = token_mask(pattern, block_size, nq, nk, is_causal, query_start=0)
    ref_out, ref_lse, ref_grads = oracle_with_grads(q, k, v, dout, mask, scale=SCALE)
    tight = {"atol": 1e-10, "rtol": 1e-7}
    torch.testing.assert_close(out, ref_out, **tight)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    torch.testing.assert_close(lse, ref_lse, **tight)
    for name, g, rg in zip("qkv", grads, ref_grads, strict=True):
        torch.testing.assert_close(g, rg, **tight, msg=lambda m, n=name: f"d{n}: {m}")
    # Non-causal calls of blocks made of whole tiles have no partial tile, hence no mask_mod.
    assert (calls["fwd"]["mask_mod"] is None) == (not is_causal)
    assert len(calls["bwd chunks"]) == _backward_calls(chunked, q, k)


@pytest.mark.parametrize("case", [0, 1])  # MHA, GQA
def test_chunked_backward_from_a_release_returning_its_own_grads(
    case: int, chunked: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A release whose backward returns tensors of its own instead of writing dq, dk and dv:
    each chunk's gradients are copied into its heads' rows, the whole against the oracle."""
    calls = _install_fake_fa4(monkeypatch)
    interface = sys.modules["flash_attn.cute.interface"]
    writes = interface._flash_attn_bwd

    def returns_own(q, k, v, out, dout, lse, softmax_scale=None, causal=False, mask_mod=None,
                    block_sparse_tensors=None, pack_gqa=None):  # fmt: skip
        own = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        return writes(q, k, v, out, dout, lse, softmax_scale, causal, mask_mod,
                      block_sparse_tensors, pack_gqa, *own)  # fmt: skip

    monkeypatch.setattr(interface, "_flash_attn_bwd", returns_own)
    nq, nk, block_size, kv_heads, pattern = CASES[case]
    q, k, v, dout = _inputs(nq, nk, kv_heads, seed=case)
    _, _, grads, _ = _run_fake(q, k, v, dout, pattern, block_size, True)
    assert len(calls["bwd chunks"]) == _backward_calls(chunked, q, k)
    mask = token_mask(pattern, block_size, nq, nk, True, query_start=0)
    _, _, ref_grads = oracle_with_grads(q, k, v, dout, mask, scale=SCALE)
    for name, g, rg in zip("qkv", grads, ref_grads, strict=True):
        torch.testing.assert_close(g, rg, atol=1e-10, rtol=1e-7, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize("fill", [True, False], ids=["filled", "without the fill"])
def test_keys_no_row_reads_get_zero_gradients_from_any_release(
    fill: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A release whose backward leaves the key tiles no query tile visits unwritten (NaN here):
    the runner sets the key blocks no row reads to zero in dk and dv, so one call's gradients
    still match the oracle; without that fill they would hold the NaN."""
    import dilated_attention.block_sparse.fa4 as runner_module

    calls = _install_fake_fa4(monkeypatch)
    calls["unvisited key tiles"] = math.nan
    if not fill:
        monkeypatch.setattr(runner_module, "fill_blocks", lambda *args: None)
    nq, nk, block_size, kv_heads, pattern = CASES[4]  # causal: key blocks 1-3 unread
    q, k, v, dout = _inputs(nq, nk, kv_heads, seed=4)
    _, _, grads, _ = _run_fake(q, k, v, dout, pattern, block_size, True)
    assert len(calls["bwd chunks"]) == 1
    mask = token_mask(pattern, block_size, nq, nk, True, query_start=0)
    _, _, ref_grads = oracle_with_grads(q, k, v, dout, mask, scale=SCALE)
    for name, g, rg in zip("kv", grads[1:], ref_grads[1:], strict=True):
        if not fill:  # the unread key blocks keep what the release left
            assert g[:, block_size:].isnan().all()
            continue
        torch.testing.assert_close(g, rg, atol=1e-10, rtol=1e-7, msg=lambda m, n=name: f"d{n}: {m}")


def test_unreached_rows_and_keys_are_marked() -> None:
    """The Custom case (block row i keeps key block i + 1, and row 3 block 0): causal keeps
    only (3, 0), so block rows 0-2 are empty and key blocks 1-3 unread."""
    pattern = CASES[4][4]
    tiles = fa4_tiles(pattern, 128, 400, 400, True, torch.device("cpu"))
    assert tiles.empty_rows is not None and tiles.unread_keys is not None
    assert tiles.empty_rows.tolist() == [[[True, True, True, False]]]  # (1, 1, Mq) blocks
    assert tiles.unread_keys.tolist() == [[[False, True, True, True]]]
    full = fa4_tiles(P.LocalWindow(1), 128, 384, 384, False, torch.device("cpu"))
    assert full.empty_rows is None and full.unread_keys is None


def test_index_lists_are_compact() -> None:
    """FA4 reads only the first ``count`` indices of a row: the lists keep no more columns than
    the longest row needs, so a banded pattern at length N costs O(N) list memory, not O(N^2)."""
    tiles = fa4_tiles(P.LocalWindow(1), 128, 128 * 64, 128 * 64, False, torch.device("cpu"))
    for lists in (tiles.forward, tiles.backward):
        assert lists.full_index.shape == (1, 1, 64, 3)
        assert lists.partial_index.shape == (1, 1, 64, 1)  # at least one column
        assert int(lists.full_count.sum()) == 64 * 3 - 2
        for index in (lists.full_index, lists.partial_index):  # the kernel checks the strides
            assert index.stride()[-2:] == (index.shape[-1], 1)


def test_double_backward_matches_oracle(monkeypatch: pytest.MonkeyPatch) -> None:
    """create_graph=True: the recompute over the fallback's calls for the same block pairs."""
    _install_fake_fa4(monkeypatch)
    nq, nk, block_size, kv_heads, pattern = CASES[1]
    q, k, v, dout = _inputs(nq, nk, kv_heads, seed=7)
    _, _, grads, leaves = _run_fake(q, k, v, dout, pattern, block_size, True, create_graph=True)
    second = torch.autograd.grad(sum(g.square().sum() for g in grads), leaves)
    ref_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = block_sparse_attention(*ref_leaves, pattern, block_size=block_size, is_causal=True,
                                 scale=SCALE, backend="math")  # fmt: skip
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout, create_graph=True)
    ref_second = torch.autograd.grad(sum(g.square().sum() for g in ref_grads), ref_leaves)
    for got, want in zip(second, ref_second, strict=True):
        torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-7)


# (query heads, key/value heads, calls by the share, calls by the share sharing no kv head)
CHUNK_RULES = [(16, 16, 2, 2), (16, 4, 8, 8), (16, 8, 8, 8), (16, 1, 16, 16), (8, 2, 8, 8)]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "chunks", "ungrouped"),
    [*CHUNK_RULES, (4, 4, 2, 2), (32, 4, 4, 8), (32, 2, 8, 16)],
)
def test_backward_accumulators_by_head_chunks(
    heads: int, kv_heads: int, chunks: int, ungrouped: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Note [FlashAttention-4's accumulators by head chunks]: the fewest calls whose float32
    accumulators (dq's, and dk's and dv's with grouped heads, plus a later part's dk and dv)
    take at most ACCUMULATOR_SHARE of q, k, v, out, dout, dq, dk and dv: whole groups of
    key/value heads, else parts of each group; calls that cover each query head once, with
    its own key/value head; one call below MIN_CHUNKED_ACCUMULATOR_BYTES of accumulators."""
    q = torch.empty(1, 64, heads, 8, dtype=torch.bfloat16)
    k = torch.empty(1, 64, kv_heads, 8, dtype=torch.bfloat16)
    accumulators = 4 * q.numel() + (8 * k.numel() if heads > kv_heads else 0)
    monkeypatch.setattr(chunk_rule, "MIN_CHUNKED_ACCUMULATOR_BYTES", accumulators + 1)
    assert accumulator_chunks(q, k) == len(head_chunks(q, k)) == 1
    monkeypatch.setattr(chunk_rule, "MIN_CHUNKED_ACCUMULATOR_BYTES", accumulators)
    assert accumulator_chunks(q, k) == chunks
    parts = head_chunks(q, k)
    assert len(parts) == chunks
    query_heads = [h for part, _ in parts for h in range(heads)[part]]
    assert query_heads == list(range(heads))
    group = heads // kv_heads
    for part, kv_part in parts:
        assert {h // group for h in range(heads)[part]} == set(range(kv_heads)[kv_part])
    unavoidable = 4 * (q.numel() + k.numel()) * 2
    share = chunk_rule.ACCUMULATOR_SHARE
    call_heads, call_kv = len(range(heads)[parts[0][0]]), len(range(kv_heads)[parts[0][1]])
    assert chunk_rule._call_bytes(q, k, call_heads, call_kv) <= share * unavoidable or (
        call_heads == 1
    )
    # Block-sparse: no query heads share a key/value head, members of each group per call.
    members = head_chunks(q, k, ungrouped=True)
    assert accumulator_chunks(q, k, ungrouped=True) == len(members) == ungrouped
    assert sorted(h for part, _ in members for h in range(heads)[part]) == list(range(heads))
    for part, kv_part in members:
        assert [h // group for h in range(heads)[part]] == list(range(kv_heads)[kv_part])
    call_heads = len(range(heads)[members[0][0]])
    assert chunk_rule._call_bytes(q, k, call_heads, call_heads) <= share * unavoidable or (
        call_heads == 1
    )


def test_backward_chunks_count_the_lists_made_for_each_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lists a run-time mask's backward makes per call count against the share: lists of
    a few bytes leave halves of each group (16 / 4 heads); lists that take a half over the
    share make one call per query head, each within it."""
    monkeypatch.setattr(chunk_rule, "MIN_CHUNKED_ACCUMULATOR_BYTES", 0)
    q = torch.empty(1, 64, 16, 8, dtype=torch.bfloat16)
    k = torch.empty(1, 64, 4, 8, dtype=torch.bfloat16)
    budget = chunk_rule.ACCUMULATOR_SHARE * 4 * (q.numel() + k.numel()) * 2
    halves = chunk_rule._call_bytes(q, k, 2, 1)
    assert accumulator_chunks(q, k, lambda heads, kv: heads) == 8
    per_head = int(budget - halves) // 2 + 1  # two heads' lists: a half over the share
    lists = lambda heads, kv: heads * per_head  # noqa: E731
    assert accumulator_chunks(q, k, lists) == len(head_chunks(q, k, lists)) == 16
    assert chunk_rule._call_bytes(q, k, 2, 1, lists) > budget
    assert chunk_rule._call_bytes(q, k, 1, 1, lists) <= budget


# (tokens, key/value heads of 16 query heads, calls, replayable): 16 query heads, D = 128, bf16.
REPLAYED_CHUNKS = [(16384, 4, 1, True), (65536, 4, 8, True), (65536, 16, 2, True),
                   (131072, 4, 8, True), (131072, 16, 2, False), (262144, 4, 8, False)]  # fmt: skip


@pytest.mark.parametrize(("tokens", "kv_heads", "calls", "replays"), REPLAYED_CHUNKS)
def test_a_whole_backward_replays_its_chunks_below_the_pool_bound(
    tokens: int, kv_heads: int, calls: int, replays: bool
) -> None:
    """Note [A whole call's launches from a CUDA graph]: a dense backward replays from a graph
    in one call, or in chunks that each add fewer than MAX_REPLAYED_CHUNK_BYTES beside the
    gradients (float32 dq; float32 dk and dv where query heads share key/value heads; a
    later part of a group's dk and dv), written out here per call; larger chunks launch as
    usual."""
    q = torch.empty(1, tokens, 16, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, tokens, kv_heads, 128, dtype=torch.bfloat16, device="meta")
    chunks = head_chunks(q, k)
    assert len(chunks) == calls
    heads, kv = 16 // calls, max(1, kv_heads // calls)
    added = 4 * tokens * heads * 128 + (8 * tokens * kv * 128 if heads > kv else 0)
    added += 4 * tokens * kv * 128 if heads < 16 // kv_heads * kv else 0
    assert (calls == 1 or added < chunk_rule.MAX_REPLAYED_CHUNK_BYTES) == replays
    assert chunk_rule.replayable(q, k, chunks) == replays


@pytest.mark.parametrize("mask_heads", [1, 2, 4], ids=["shared", "per kv head", "per head"])
@pytest.mark.parametrize(
    ("length", "block_size", "is_causal"),
    [(384, 128, True), (300, 128, False), (384, 64, True)],
    ids=["aligned", "ragged", "blocks of 64"],
)
def test_backward_list_bytes_are_the_bytes_made(
    mask_heads: int, length: int, block_size: int, is_causal: bool
) -> None:
    """What a run-time mask's tiles say a backward call's lists take is what
    ``backward_lists`` makes for that call (two batch rows, 4 query heads on 2 key/value
    heads, chunks of 1, 2 and 4 query heads); a pattern's lists are held whole: none."""
    from dilated_attention.block_sparse.fa4 import runtime_fa4_tiles

    m = -(-length // block_size)
    kept = torch.rand(2, mask_heads, m, m, generator=torch.Generator().manual_seed(1)) < 0.5
    tiles = runtime_fa4_tiles(kept, block_size, length, length, is_causal, 2, 4)
    for heads, kv in [(slice(0, 1), slice(0, 1)), (slice(2, 4), slice(1, 2)),
                      (slice(0, 4), slice(0, 2))]:  # fmt: skip
        made = sum(t.nbytes for t in tiles.backward_lists(heads, kv))
        assert tiles.made_bytes(heads.stop - heads.start, kv.stop - kv.start) == made
    pattern_tiles = fa4_tiles(P.LocalWindow(1), 128, 384, 384, True, torch.device("cpu"))
    assert pattern_tiles.made_bytes(4, 2) == 0


# -- the choice, on a fake sm90 CUDA device -------------------------------------------------------
def _sparse_inputs(**overrides: Any) -> KernelInputs:
    fields = dict(
        device=torch.device("cuda", 0), dtype=torch.bfloat16, head_dim=128, num_heads=16,
        num_kv_heads=16, query_len=65536, key_len=65536, is_causal=False, requires_grad=True,
        block_size=128,
    )  # fmt: skip
    fields.update(overrides)
    return KernelInputs(**fields)


@pytest.mark.parametrize(
    ("cc", "overrides", "expected"),
    [
        ((9, 0), {}, None),
        ((9, 0), {"is_causal": True, "query_len": 1000}, None),  # rectangular causal: exact
        ((9, 0), {"block_size": 256}, None),
        ((9, 0), {"block_size": 64}, "not a multiple of 128"),
        ((9, 0), {"head_dim": 256}, "head_dim 256 > 128"),
        ((9, 0), {"dtype": torch.float32}, "dtype float32"),
        ((10, 0), {}, "set up for sm90"),
    ],
)
def test_block_sparse_reasons(cc, overrides, expected, monkeypatch: pytest.MonkeyPatch) -> None:
    _install_fake_fa4(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **kw: cc)
    monkeypatch.setattr(FlashAttn4Backend, "availability_reasons", lambda self, device: [])
    reasons = registry_for("block_sparse").reasons("flash_attn4", _sparse_inputs(**overrides))
    if expected is None:
        assert reasons == []
    else:
        assert any(expected in r for r in reasons), reasons


def test_fa4_without_block_sparsity_is_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    _install_fake_fa4(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **kw: (9, 0))
    monkeypatch.setattr(FlashAttn4Backend, "availability_reasons", lambda self, device: [])
    interface = sys.modules["flash_attn.cute.interface"]
    monkeypatch.setattr(interface, "_flash_attn_fwd",
                        lambda q, k, v, softmax_scale=None, causal=False, return_lse=False: None)
    reasons = registry_for("block_sparse").reasons("flash_attn4", _sparse_inputs())
    assert reasons and "no block sparsity" in reasons[0]


def test_cpu_rejects_fa4_by_name() -> None:
    q, k, v, _ = _inputs(256, 256, 4)
    with pytest.raises(ValueError, match=r"flash_attn4.*cannot run"):
        block_sparse_attention(q, k, v, P.LocalWindow(0), block_size=128, backend="flash_attn4")


# -- GPU: the real kernel --------------------------------------------------------------------------
def _needs_fa4_block_sparsity(block_size: int = 128) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    q = torch.empty(1, 256, 4, 64, device="cuda", dtype=torch.bfloat16)
    inputs = KernelInputs.from_tensors(q, q, requires_grad=True, block_size=block_size)
    reasons = get_backend("flash_attn4").block_sparse_reasons(inputs)
    if reasons:
        pytest.skip(f"flash_attn4 (FlashAttention-4) block sparsity cannot run here: {reasons}")


GPU_CASES = [
    (1024, 1024, 128, 4, 64, P.LocalWindow(1) | P.Random(0.3, seed=1)),
    (1000, 1000, 128, 2, 128, P.Random(0.4, seed=2)),  # ragged, GQA
    (640, 1152, 256, 1, 64, P.GlobalLocal(1, 0) | P.DilatedBlocks((2,))),  # rectangular, MQA
    (1152, 640, 128, 4, 128, P.LocalWindow(0)),  # query longer than key
    (896, 896, 128, 4, 96, P.Custom(torch.eye(7, dtype=torch.bool).roll(1, 1))),  # empty rows
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", range(len(GPU_CASES)))
def test_fa4_block_sparse_matches_oracle(
    case: int, is_causal: bool, dtype: torch.dtype, chunked: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real kernel by name against the float64 oracle (computed on the CPU from the same
    rounded inputs): out, lse, dq, dk, dv, with bf16/fp16 error within 2x a naive same-dtype
    reference; every new buffer starts NaN-filled (what the kernel leaves unwritten shows). The
    backward in chunks of heads by the share, one call per key/value head, and one per query
    head."""
    nq, nk, block_size, kv_heads, dim, pattern = GPU_CASES[case]
    _needs_fa4_block_sparsity(block_size)
    if is_causal and nq != nk:
        assert_end_aligned_refused(nq, nk, pattern, block_size, "flash_attn4", "cuda")
        return
    gen = torch.Generator().manual_seed(case)
    shapes = [(2, nq, 4, dim), (2, nk, kv_heads, dim), (2, nk, kv_heads, dim), (2, nq, 4, dim)]
    q, k, v, dout = (torch.randn(s, generator=gen).to(dtype) for s in shapes)
    dev = [t.cuda().requires_grad_() for t in (q, k, v)]
    poison_new_buffers(monkeypatch)
    out, lse = block_sparse_attention(*dev, pattern, block_size=block_size, is_causal=is_causal,
                                      return_lse=True, backend="flash_attn4")  # fmt: skip
    grads = [g.cpu() for g in torch.autograd.grad(out, dev, dout.cuda())]
    mask = token_mask(pattern, block_size, nq, nk, is_causal)
    check_kernel_result(q, k, v, dout, mask, out.detach().cpu(), lse.cpu(), grads)


@pytest.mark.gpu
def test_fa4_block_sparse_is_the_automatic_choice_for_training() -> None:
    _needs_fa4_block_sparsity()
    q = torch.randn(1, 1024, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    inputs = KernelInputs.from_tensors(q, q, requires_grad=True, block_size=128)
    choice = registry_for("block_sparse").choose(inputs)
    assert choice.backend == "flash_attn4" and choice.runs_plan, choice


# -- run-time block masks: per batch row and head, lists made on the device ------------------------
# (query_len, key_len, block_size, kv_heads, mask batch, mask heads, index lists)
RUNTIME_CASES = [
    (384, 384, 128, 2, 2, 4, False),  # per query head
    (300, 300, 128, 2, 1, 2, False),  # per key/value head (expanded to the query heads), ragged
    (256, 520, 128, 1, 2, 1, False),  # rectangular, MQA, shared by every head
    (512, 512, 256, 4, 1, 4, True),  # index lists, blocks of two tiles
]
# Causal calls of a query shorter than the key are end-aligned: the fallback runs them
# (tests/ops/test_block_sparse_runtime.py).
RUNTIME_PARAMS = [
    (case, causal) for case, c in enumerate(RUNTIME_CASES) for causal in (False, True)
    if not causal or c[0] == c[1]
]


@pytest.mark.parametrize(("case", "is_causal"), RUNTIME_PARAMS)
def test_run_time_masks_through_the_strategy(
    case: int, is_causal: bool, chunked: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The strategy of a run-time mask on FA4 (its fake): per-(batch row, query head) tile
    lists in both directions, unreached rows and keys per row and head; out, lse and every
    gradient against the float64 oracle."""
    calls = _install_fake_fa4(monkeypatch)
    nq, nk, block_size, kv_heads, mask_batch, mask_heads, indices = RUNTIME_CASES[case]
    q, k, v, dout = _inputs(nq, nk, kv_heads, seed=case)
    mq, mk = -(-nq // block_size), -(-nk // block_size)
    gen = torch.Generator().manual_seed(case)
    if indices:
        mask = torch.randint(-1, mk, (mask_batch, mask_heads, mq, 2), generator=gen)
    else:
        mask = torch.rand(mask_batch, mask_heads, mq, mk, generator=gen) < 0.5
    layout = check_block_mask(mask, q, k, block_size)
    request = Request.of(BLOCK_SPARSE, q, k, v, block_mask=layout, block_size=block_size,
                         is_causal=is_causal, scale=SCALE)  # fmt: skip
    selection = Selection(FlashAttn4Backend(), runs_plan=True)
    strategy = RuntimeMaskStrategy(request, selection, "block_sparse", None, "FA4")
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = strategy.run(*leaves, mask, None)
    grads = torch.autograd.grad(out, leaves, dout)
    tokens = runtime_token_mask(mask, block_size, batch=2, heads=4, query_len=nq, key_len=nk,
                                is_causal=is_causal)  # fmt: skip
    ref_out, ref_lse, ref_grads = oracle_with_grads(q, k, v, dout, tokens, scale=SCALE)
    tight = {"atol": 1e-10, "rtol": 1e-7}
    torch.testing.assert_close(out, ref_out, **tight)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    torch.testing.assert_close(lse, ref_lse, **tight)
    for name, g, rg in zip("qkv", grads, ref_grads, strict=True):
        torch.testing.assert_close(g, rg, **tight, msg=lambda m, n=name: f"d{n}: {m}")
    forward = calls["fwd"]["block_sparse_tensors"]
    heads = 1 if mask_heads == 1 else 4  # FA4 takes 1 or H heads: a key/value-head mask repeated
    assert forward.mask_block_cnt.shape == (mask_batch, heads, -(-nq // TILE))
    chunks = calls["bwd chunks"]  # one backward call per chunk of heads, each head once
    assert len(chunks) == _backward_calls(chunked, q, k)
    assert sum(c["q"].shape[2] for c in chunks) == 4
    for chunk in chunks:  # a chunk's lists: 1 or its query heads
        lists = chunk["block_sparse_tensors"].full_block_idx
        chunk_heads = 1 if mask_heads == 1 or lists.shape[1] == 1 else chunk["q"].shape[2]
        assert lists.shape == (mask_batch, chunk_heads, -(-nk // TILE), -(-nq // TILE))


@pytest.mark.parametrize("indices", [False, True], ids=["bool", "indices"])
@pytest.mark.parametrize("per_query_head", [False, True], ids=["kv-head rows", "query-head rows"])
@pytest.mark.parametrize("forced", [2, 4], ids=["members of 4 kv heads", "members of 2 kv heads"])
def test_chunks_of_group_members(
    forced: int, per_query_head: bool, indices: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block-sparse backward in calls of one query head of each group (query heads 0, 2, 4,
    6 on key/value heads 0-3, a stepped slice of q, dq and the lists' rows), over a run-time
    mask of one row per key/value head or per query head and batch row (the rows each chunk's
    lists come from are a strided slice): out and every gradient against the float64
    oracle."""
    calls = _install_fake_fa4(monkeypatch)
    monkeypatch.setattr(chunk_rule, "accumulator_chunks", lambda q, k, *rule: forced)
    nq, block_size, heads, kv_heads = 384, 128, 8, 4
    gen = torch.Generator().manual_seed(5)
    q, dout = (torch.randn(2, nq, heads, 8, generator=gen, dtype=F64) for _ in "qo")
    k, v = (torch.randn(2, nq, kv_heads, 8, generator=gen, dtype=F64) for _ in "kv")
    m, mask_heads = nq // block_size, heads if per_query_head else kv_heads
    if indices:
        mask = torch.randint(-1, m, (2, mask_heads, m, 2), generator=gen)
    else:
        mask = torch.rand(2, mask_heads, m, m, generator=gen) < 0.5
    layout = check_block_mask(mask, q, k, block_size)
    request = Request.of(BLOCK_SPARSE, q, k, v, block_mask=layout, block_size=block_size,
                         is_causal=True, scale=SCALE)  # fmt: skip
    strategy = RuntimeMaskStrategy(request, Selection(FlashAttn4Backend(), runs_plan=True),
                                   "block_sparse", None, "FA4")  # fmt: skip
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, _ = strategy.run(*leaves, mask, None)
    grads = torch.autograd.grad(out, leaves, dout)
    chunks = calls["bwd chunks"]
    assert [c["q"].shape[2] for c in chunks] == [heads // forced] * forced
    assert all(c["q"].stride(2) == 2 * 8 for c in chunks)  # every other query head
    tokens = runtime_token_mask(mask, block_size, batch=2, heads=heads, query_len=nq,
                                key_len=nq, is_causal=True)  # fmt: skip
    ref_out, _, ref_grads = oracle_with_grads(q, k, v, dout, tokens, scale=SCALE)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-7)
    for name, g, rg in zip("qkv", grads, ref_grads, strict=True):
        torch.testing.assert_close(g, rg, atol=1e-10, rtol=1e-7, msg=lambda m, n=name: f"d{n}: {m}")
