"""The selection's Triton kernels against its torch operations: the choice with candidates by
position against the same choice reading their masks, the block means' bfloat16 parts made in
one launch against the torch parts, the parts made from the rows against float64 block means,
and the choice from those parts against the float64 choice."""

from __future__ import annotations

import pytest
import torch

from dilated_attention.block_sparse.runtime import same_document
from dilated_attention.core.execution import graphs
from dilated_attention.sparse import device_choice, select_blocks, selection
from dilated_attention.sparse.selection import CandidateRanges, _parts, own_blocks_width
from tests.support.graphs import count_replays, keep
from tests.support.triton import INTERPRETING, skip_without_triton

DEVICES = [pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]
if INTERPRETING:
    DEVICES.append(pytest.param("cpu", id="cpu-interpret"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("own_width", [None, 1, 2], ids=["bool", "indices", "indices-wide"])
@pytest.mark.parametrize(
    ("query_len", "key_len", "block_size", "is_causal", "first_row", "rows"),
    [
        (640, 640, 64, True, 0, 10),  # aligned: one own block per row
        (600, 700, 64, True, 0, 10),  # end-aligned, straddling: two own blocks
        (640, 640, 64, True, 3, 5),  # a ring rank's rows, from query block 3
        (500, 2100, 32, True, 2, 14),  # many columns, a short last key block
        (300, 450, 64, False, 1, 4),  # not causal: every block a candidate, none own
    ],
)
def test_candidates_by_position_match_their_masks(
    device, own_width, query_len, key_len, block_size, is_causal, first_row, rows
) -> None:
    """The choice given :class:`RowRanges` (Note [Candidates by position]) is the choice given
    :func:`candidate_blocks`' masks for the same rows, bool and as indices, NaN included."""
    skip_without_triton(device)
    from dilated_attention.backends.triton_kernels.selection.top_blocks import RowRanges, top_blocks

    if own_width is not None and not is_causal:
        own_width = 0
    ranges = CandidateRanges(query_len, key_len, block_size, is_causal, first_row=first_row)
    candidates, own = (m.to(device) for m in ranges.masks(rows, torch.device("cpu")))
    g = torch.Generator().manual_seed(query_len + first_row)
    affinity = torch.randn(2, 3, rows, candidates.shape[-1], generator=g)
    affinity[0, 1, -1, 0] = float("nan")
    affinity = affinity.to(device)
    by_position = RowRanges(first_row, key_len - query_len, block_size, key_len, is_causal)
    want = top_blocks(affinity, candidates, own, 5, own_width=own_width)
    got = top_blocks(affinity, by_position, None, 5, own_width=own_width)
    if own_width is not None:  # the same blocks, in any order within a row
        want, got = want.sort(-1).values, got.sort(-1).values
    assert got.shape == want.shape and torch.equal(got.cpu(), want.cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("heads", "group", "dim", "blocks", "transposed"),
    [(4, 1, 64, 37, False), (8, 4, 48, 5, True), (2, 2, 128, 16, False), (3, 1, 16, 0, False)],
)
def test_mean_parts_match_the_torch_parts(device, heads, group, dim, blocks, transposed) -> None:
    """One launch's parts (Note [Parts in one launch]) are the torch parts of the group's sum,
    for both orders, any strides and head dims that are not powers of two."""
    skip_without_triton(device)
    from dilated_attention.backends.triton_kernels.selection.mean_parts import mean_parts

    g = torch.Generator().manual_seed(heads * dim + blocks)
    x = torch.randn(2, heads, blocks, dim, generator=g) * 1e3
    if blocks:  # a NaN and an inf mean stay NaN and inf in both
        x[0, 1, 0, 3], x[1, 0, -1, 2] = float("nan"), float("inf")
    x = x.transpose(1, 2) if transposed else x.transpose(1, 2).contiguous()  # (B, M, H, D)
    summed = x.unflatten(2, (heads // group, group)).sum(3)  # (B, M, H / g, D)
    for low_at, order in ((2, (0, 0, 1)), (1, (0, 1, 0))):
        got = mean_parts(x.to(device), group, low_at)
        want = _parts(summed.permute(0, 2, 1, 3), order)
        assert got.shape == (2, heads // group, blocks, 3 * dim) and got.dtype == torch.bfloat16
        if group == 1:  # no sum: bit for bit
            torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, equal_nan=True)
        else:  # the group's sum in another order: within float32 rounding, part by part
            parts = got.cpu().float().unflatten(-1, (3, dim))
            high, low = parts[..., 0, :], parts[..., low_at, :]
            exact = summed.permute(0, 2, 1, 3)
            finite = exact.isfinite()
            torch.testing.assert_close(high[~finite], exact[~finite], equal_nan=True)
            torch.testing.assert_close((high + low)[finite], exact[finite], rtol=2**-15,
                                       atol=0)  # fmt: skip


def _rows(shape: tuple[int, int, int, int], dtype: torch.dtype, layout: str,
          g: torch.Generator) -> torch.Tensor:  # fmt: skip
    """Random rows (B, N, H, D) of ``dtype``: contiguous, head-major (a transposed (B, H, N, D)
    tensor) or a view into a NaN-filled buffer with more rows, heads and columns (any read
    outside the rows shows as NaN)."""
    batch, length, heads, dim = shape
    x = (torch.randn(shape, generator=g) * 4).to(dtype)
    if layout == "head-major":
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "padded":
        buffer = torch.full((batch, length + 9, heads + 1, dim + 16), float("nan"), dtype=dtype)
        buffer[:, :length, :heads, :dim] = x
        return buffer[:, :length, :heads, :dim]
    return x


def _block_parts64(x: torch.Tensor, block_size: int, group: int) -> torch.Tensor:
    """The fused parts' values in float64: each block's mean over its real rows (the last may
    be shorter), summed over ``group`` consecutive heads: (B, H / group, M, D)."""
    means = [x[:, start : start + block_size].double().mean(1)
             for start in range(0, x.shape[1], block_size)]  # fmt: skip
    summed = torch.stack(means, 1) if means else x[:, :0].double()
    return summed.unflatten(2, (x.shape[2] // group, group)).sum(3).transpose(1, 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("heads", "group", "length", "block_size", "dim", "dtype", "layout"),
    [
        (4, 1, 300, 64, 64, torch.bfloat16, "contiguous"),  # a partial last block
        (8, 4, 100, 32, 48, torch.float32, "padded"),  # GQA sums, D 48, strided
        (4, 2, 20, 64, 128, torch.bfloat16, "head-major"),  # N < block_size
        (3, 1, 256, 128, 128, torch.float16, "padded"),  # whole blocks of two chunks
        (2, 1, 250, 100, 128, torch.bfloat16, "contiguous"),  # a chunk partly in the block
        (4, 2, 77, 5, 32, torch.bfloat16, "padded"),  # blocks of 5: many a program
        (2, 2, 0, 16, 32, torch.bfloat16, "contiguous"),  # no rows: no blocks
        (12, 2, 200, 64, 128, torch.bfloat16, "padded"),  # 6 heads: a partial tile of heads
    ],
)
def test_block_parts_match_the_float64_means(
    device, heads, group, length, block_size, dim, dtype, layout
) -> None:
    """The parts made from the rows in one launch (Note [Block means in the parts' launch])
    against float64 block means summed over the group: ``hi + lo`` within float32 rounding,
    ``lo`` below half of ``hi``'s last bit, ``hi`` in both of its slots, in either order; a
    NaN or inf row makes its block's mean NaN or inf and no other."""
    skip_without_triton(device)
    from dilated_attention.backends.triton_kernels.selection.mean_parts import mean_parts

    g = torch.Generator().manual_seed(length + dim)
    x = _rows((2, length, heads, dim), dtype, layout, g)
    if length > block_size:  # a NaN in the first block, an inf in the last
        x[0, 1, 0, 3], x[1, -1, heads - 1, 2] = float("nan"), float("inf")
    exact = _block_parts64(x, block_size, group)
    scale = _block_parts64(x.abs(), block_size, group)  # the sums' terms' size
    blocks = -(-length // block_size)
    for low_at, high_at in ((2, (0, 1)), (1, (0, 2))):
        got = mean_parts(x.to(device), group, low_at, block_size).cpu()
        assert got.shape == (2, heads // group, blocks, 3 * dim) and got.dtype == torch.bfloat16
        assert got.is_contiguous()
        parts = got.double().unflatten(-1, (3, dim))
        high, low = parts[..., high_at[0], :], parts[..., low_at, :]
        torch.testing.assert_close(parts[..., high_at[1], :], high, rtol=0, atol=0,
                                   equal_nan=True)  # fmt: skip
        finite = exact.isfinite()
        torch.testing.assert_close(high[~finite], exact[~finite], rtol=0, atol=0, equal_nan=True)
        assert bool((low[finite].abs() <= high[finite].abs() * 2**-8).all())
        # hi + lo holds 16 bits of the float32 mean, whose sum of block_size rows and then
        # group heads rounds up to (block_size + group) float32 ulps of the terms' size
        bound = 2**-16 * exact.abs() + (block_size + group) * 2**-24 * scale
        assert bool(((high + low) - exact)[finite].abs().le(bound[finite]).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("groups", "rows", "chunk", "cols", "depth"),
                         [(1, 70, None, 90, 192), (4, 33, (5, 29), 130, 96), (2, 200, None, 7, 48)])
def test_parts_product_matches_the_float64_product(device, groups, rows, chunk, cols,
                                                   depth) -> None:  # fmt: skip
    """The parts' product in Triton (Note [The parts' product in Triton]), its rows a chunk of
    each group's (a strided view), against the float64 product: bfloat16 inputs, float32
    accumulation, within float32's rounding of the sum; nothing outside ``out`` written."""
    skip_without_triton(device)
    from dilated_attention.backends.triton_kernels.selection.parts_product import parts_product

    g = torch.Generator().manual_seed(rows + cols)
    left = torch.randn(3, groups, rows, depth, generator=g).bfloat16()
    right = torch.randn(3, cols, depth, generator=g).bfloat16()
    part = left if chunk is None else left[:, :, chunk[0]:chunk[1]]
    count = part.shape[2]
    want = torch.einsum("ngrk,nck->ngrc", part.double(), right.double()).flatten(1, 2)
    store = torch.full((3 * groups * count * cols + 5,), float("nan"), device=device)
    out = store[: 3 * groups * count * cols].view(3, groups * count, cols)
    got = parts_product(part.to(device), right.to(device), out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got.cpu().double(), want, rtol=0, atol=2e-5 * depth**0.5)
    assert store[-5:].isnan().all()


def _indices_mask(indices: torch.Tensor, cols: int) -> torch.Tensor:
    """(..., K) int32 block indices, -1 = none, as the (..., cols) bool mask they list."""
    mask = torch.zeros(*indices.shape[:-1], cols + 1, dtype=torch.bool)
    return mask.scatter_(-1, indices.long().where(indices >= 0, cols), True)[..., :cols]


def _clear_rows(q: torch.Tensor, k: torch.Tensor, bs: int, topk: int, is_causal: bool,
                per: str, cu_seqlens: list[int] | None) -> torch.Tensor:  # fmt: skip
    """(B, Hs, Mq) bool: the rows whose choice is clear in float64: every candidate chosen, or
    the ``topk``-th best candidate's affinity and the next one's (or -inf) apart by more than
    2^-10 of the row's largest affinity."""
    affinity = selection._affinity(q.double(), k.double(), per, bs)
    cand, _ = selection.candidate_blocks(q.shape[1], k.shape[1], bs, is_causal, q.device)
    if cu_seqlens is not None:
        cand = cand & same_document(tuple(cu_seqlens), q.shape[0], q.shape[1], bs, q.device)
    ranked = affinity.masked_fill(~cand, -torch.inf).sort(-1, descending=True).values
    ranked = torch.nn.functional.pad(ranked, (0, 1), value=-torch.inf)
    size = affinity.abs().amax(-1)
    every = cand.sum(-1) <= topk
    return (ranked[..., topk - 1] - ranked[..., topk] > 2**-10 * size) | every | (size == 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("route", ["tiles", "product"])
@pytest.mark.parametrize(
    ("batch", "nq", "nk", "heads", "kv_heads", "bs", "topk", "is_causal", "per", "cu_seqlens"),
    [
        (2, 640, 640, 4, 2, 16, 3, True, "head", None),  # aligned
        (1, 500, 660, 4, 2, 32, 2, True, "kv_head", None),  # end-aligned, straddling; GQA sums
        (1, 450, 520, 2, 1, 16, 4, False, "kv_head", None),  # not causal, partial last blocks
        (2, 640, 640, 4, 2, 16, 3, True, "kv_head", [0, 128, 512, 640, 1024, 1280]),  # packed
        (1, 1024, 1024, 2, 1, 16, 20, True, "head", None),  # 32 slots a row
    ],
)
def test_choice_from_the_rows_parts_matches_the_float64_choice(
    monkeypatch, device, route, batch, nq, nk, heads, kv_heads, bs, topk, is_causal, per,
    cu_seqlens,
) -> None:  # fmt: skip
    """``select_blocks`` with the means made on the way to the parts from the rows, one launch
    per operand (Note [Block means in the parts' launch]; never :func:`block_means`), picks the
    blocks of the float64 choice in every row whose choice is clear (bf16 rows: the means and
    the parts' products in float32), as a bool mask and as indices. On the CPU the GPU's path
    runs through Triton's interpreter; packed documents (their candidates as masks) take the
    stored product."""
    skip_without_triton(device)
    from dilated_attention.backends.triton_kernels.selection import affinity_tiles

    if cu_seqlens is not None and route == "tiles":
        pytest.skip("packed documents' candidates are masks: the stored product takes them")
    g = torch.Generator().manual_seed(nq + nk)
    q = torch.randn(batch, nq, heads, 64, generator=g).bfloat16()
    k = torch.randn(batch, nk, kv_heads, 64, generator=g).bfloat16()
    options = {"block_size": bs, "topk": topk, "is_causal": is_causal, "per": per,
               "cu_seqlens": cu_seqlens}  # fmt: skip
    want = select_blocks(q.double(), k.double(), **options)
    clear = _clear_rows(q, k, bs, topk, is_causal, per, cu_seqlens)
    assert clear.float().mean() > 0.9  # most rows are a clear choice
    if device == "cpu":  # the GPU's route on the CPU
        monkeypatch.setattr(device_choice, "on_tensor_cores", lambda x: x.dtype != torch.float64)
    monkeypatch.setattr(affinity_tiles, "MIN_COLUMNS", {16: 1, 32: 1} if route == "tiles" else {})
    monkeypatch.setattr(affinity_tiles, "_WITHOUT_ROOM", set())
    monkeypatch.setattr(selection, "block_means", None)  # the means are not made apart
    # Seven query blocks at a time: the product's rows a strided chunk of each head group's.
    words = affinity_tiles.scratch_per_row(topk) if route == "tiles" else -(-nk // bs)
    per_row = 4 * batch * (heads if per == "head" else kv_heads) * words
    monkeypatch.setattr(device_choice, "AFFINITY_BYTES", 7 * per_row)
    got = select_blocks(q.to(device), k.to(device), **options).cpu()
    assert got.shape == want.shape and torch.equal(got[clear], want[clear])
    indices = select_blocks(q.to(device), k.to(device), return_indices=True, **options).cpu()
    assert torch.equal(_indices_mask(indices, want.shape[-1])[clear], want[clear])
    assert not affinity_tiles._WITHOUT_ROOM  # every program the choice launched fit the device


def _affinity64(left: torch.Tensor, right: torch.Tensor, dim: int) -> torch.Tensor:
    """The parts' products in float64, as the tiles make them: ``hi.hi + hi.lo + lo.hi``,
    (B Hs, Mq, D') x (B Hkv, Mk, D') -> (B Hs, Mq, Mk), query head ``h`` on key head
    ``h // (Hs / Hkv)``."""
    keys = right.double().repeat_interleave(left.shape[0] // right.shape[0], dim=0)
    return left.double() @ keys.transpose(-1, -2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("as_indices", [False, True], ids=["bool", "indices"])
@pytest.mark.parametrize(
    ("query_len", "key_len", "block_size", "is_causal", "first_row", "rows", "topk", "dim"),
    [
        (2560, 2560, 8, True, 0, 70, 5, 32),  # aligned, a row tile and a part
        (2500, 2600, 8, True, 0, 40, 3, 48),  # end-aligned, straddling; head dim 48
        (2560, 2560, 8, True, 200, 20, 7, 16),  # a ring rank's rows: many candidates
        (1000, 1400, 8, False, 3, 10, 4, 32),  # not causal: every block a candidate
        (2600, 2600, 4, True, 500, 12, 3, 16),  # 650 key blocks, 4 groups held: many given up
        (2560, 2560, 8, True, 100, 70, 20, 32),  # 32 slots, their rows ranked 64 at a time
        (1000, 1400, 8, False, 3, 10, 31, 32),  # 32 slots, not causal
        (4096, 4096, 4, True, 600, 40, 63, 16),  # 64 slots of 1,024 key blocks, 32 rows at a time
    ],
)
@pytest.mark.parametrize("keys", ["random", "rising", "equal"])
def test_choice_from_tiles_keeps_the_best_blocks(
    device, as_indices, query_len, key_len, block_size, is_causal, first_row, rows, topk, dim, keys
) -> None:
    """The choice made from the means' parts a tile at a time (Note [Affinities a tile at a
    time]) keeps, in every row, blocks of the best affinities (float64 products of the same
    parts; a near tie may go either way), only candidates, ``min(topk, candidates)`` of them,
    and the row's own blocks; NaN means included; GQA heads on their key head. Keys whose
    affinity rises with the column make every group better than those held before it; equal
    keys tie everywhere, and the lowest blocks are kept."""
    skip_without_triton(device)
    from dilated_attention.backends.triton_kernels.selection.affinity_tiles import (
        top_blocks_from_parts,
    )
    from dilated_attention.backends.triton_kernels.selection.top_blocks import RowRanges

    own_width = own_blocks_width(query_len, key_len, block_size, is_causal) if as_indices else None
    ranges = CandidateRanges(query_len, key_len, block_size, is_causal, first_row=first_row)
    candidates, own = ranges.masks(rows, torch.device("cpu"))
    cols = candidates.shape[-1]
    g = torch.Generator().manual_seed(query_len + rows)
    batch, heads, kv_heads = 2, 4, 2
    left = _parts(torch.randn(batch * heads, rows, dim, generator=g), (0, 0, 1))
    means = torch.randn(batch * kv_heads, cols, dim, generator=g)
    if keys == "rising":  # with positive queries, each column's affinity above the last's
        left = left.abs()
        means = (1 + torch.arange(cols) / 8).view(1, cols, 1).expand_as(means)
    elif keys == "equal":
        means = means[:, :1].expand_as(means)
    right = _parts(means, (0, 1, 0))
    left[1, 2, :dim] = float("nan")  # a NaN row: its affinities rank below every number
    width = cols if own_width is None else topk + own_width
    out = torch.empty(batch, heads, rows, width, device=device,
                      dtype=torch.bool if own_width is None else torch.int32)  # fmt: skip
    top_blocks_from_parts(left.to(device), right.to(device),
                          ranges.kernel_rows(0, RowRanges), topk, out,
                          own_width=own_width)  # fmt: skip
    chosen = out.cpu()
    if own_width is not None:  # indices -> a bool mask (-1: none)
        chosen = _indices_mask(chosen, cols)
    chosen = chosen.view(batch * heads, rows, cols)
    affinity = _affinity64(left, right, dim).nan_to_num(nan=-1e300)
    assert torch.equal(chosen & own, own.expand_as(chosen))  # every own block kept
    picks = chosen & ~own
    assert not (picks & ~candidates).any()  # nothing else but candidates
    count = candidates.sum(-1).clamp(max=topk)
    assert torch.equal(picks.sum(-1), count.expand_as(picks[..., 0]))
    best = affinity.masked_fill(~candidates, -torch.inf).sort(-1, descending=True).values
    got = affinity.masked_fill(~picks, -torch.inf).sort(-1, descending=True).values
    slots = torch.arange(cols) < count[:, None]
    torch.testing.assert_close(got.where(slots, 0), best.where(slots, 0), rtol=1e-5, atol=1e-5)
    if keys == "equal":  # the lowest candidates
        lowest = candidates & (candidates.cumsum(-1) <= count[:, None])
        assert torch.equal(picks[0], lowest)


@pytest.mark.parametrize("device", DEVICES)
def test_a_choice_whose_tiles_do_not_fit_the_device_takes_the_product(monkeypatch, device) -> None:
    """Where the tiles kernel's program asks more shared memory than the device has (Triton
    raises ``OutOfResources`` at its first launch, before it runs), the choice is the stored
    product's, and later choices with as many slots on that device skip the tiles; other
    slots still take them."""
    skip_without_triton(device)
    from triton.runtime.errors import OutOfResources

    from dilated_attention.backends.triton_kernels.selection import affinity_tiles

    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 640, 2, 64, generator=g).bfloat16()
    k = torch.randn(1, 640, 1, 64, generator=g).bfloat16()
    options = {"block_size": 16, "topk": 3, "is_causal": True}
    want = select_blocks(q.double(), k.double(), **options)
    clear = _clear_rows(q, k, 16, 3, True, "head", None)
    if device == "cpu":  # the GPU's route on the CPU
        monkeypatch.setattr(device_choice, "on_tensor_cores", lambda x: x.dtype != torch.float64)
    monkeypatch.setattr(affinity_tiles, "MIN_COLUMNS", {16: 1, 32: 1})
    monkeypatch.setattr(affinity_tiles, "_WITHOUT_ROOM", set())
    tried = []

    def launch(kernel, grid, args, options):
        if kernel is affinity_tiles._choice_kernel:
            tried.append(options["PICKS"])
            raise OutOfResources(262144, 232448, "shared memory")
        return real(kernel, grid, args, options)

    real = affinity_tiles.launch
    monkeypatch.setattr(affinity_tiles, "launch", launch)
    q, k = q.to(device), k.to(device)
    for _ in range(2):
        got = select_blocks(q, k, **options).cpu()
        assert torch.equal(got[clear], want[clear])
    assert tried == [4]  # the first choice tried the tiles once; the second did not
    assert not affinity_tiles.takes(40, 3, q.device, 64)
    assert affinity_tiles.takes(40, 5, q.device, 64)  # 8 slots were never refused
    assert affinity_tiles.takes(40, 3, q.device, 32)  # nor another head dim


def test_the_tiles_take_up_to_32_slots_from_their_measured_widths() -> None:
    """The choice takes the tiles where they were measured faster than the stored product
    (Note [Affinities a tile at a time]): up to 16 slots a row from 1,024 key blocks, 32 slots
    from 8,192, never 64."""
    pytest.importorskip("triton")
    from dilated_attention.backends.triton_kernels.selection.affinity_tiles import takes

    cpu = torch.device("cpu")
    assert takes(1024, 15, cpu, 128) and takes(1024, 1, cpu, 128)
    assert not takes(1023, 15, cpu, 128) and not takes(1024, 0, cpu, 128)
    assert takes(8192, 17, cpu, 128) and takes(8192, 32, cpu, 128)
    assert not takes(8191, 31, cpu, 128) and not takes(16384, 33, cpu, 128)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "documents", [None, [0, 256, 512, 640, 1024]], ids=["by-position", "packed"]
)
@pytest.mark.parametrize("return_indices", [False, True], ids=["bool", "indices"])
def test_choice_launches_replay_with_the_new_tensors(documents, return_indices) -> None:
    """The choice's launches (block means' parts, top blocks) are bound on the first call of a
    layout and replayed after (Note [Bound launches]): a later call on other tensors gives the
    bits a fresh call gives, not the first call's."""
    skip_without_triton("cuda")
    from dilated_attention.backends.triton_kernels import launch as L

    def choose(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return select_blocks(q, k, block_size=64, topk=3, is_causal=True, cu_seqlens=documents,
                             return_indices=return_indices)  # fmt: skip

    g = torch.Generator(device="cuda").manual_seed(0)
    q1, q2 = (torch.randn(2, 512, 8, 64, device="cuda", generator=g) for _ in range(2))
    k1, k2 = (torch.randn(2, 512, 2, 64, device="cuda", generator=g) for _ in range(2))
    L.clear_bound()
    first = choose(q1.bfloat16(), k1.bfloat16())
    names = {site[0] for site in L._BOUND}
    assert {"mean_parts", "top_blocks"} <= names
    replayed = choose(q2.bfloat16(), k2.bfloat16())
    L.clear_bound()
    fresh = choose(q2.bfloat16(), k2.bfloat16())
    assert torch.equal(replayed, fresh)
    assert not torch.equal(replayed, first)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "documents", [None, [0, 256, 512, 640, 1024]], ids=["by-position", "packed"]
)
@pytest.mark.parametrize("route", ["tiles", "product"])
@pytest.mark.parametrize("return_indices", [False, True], ids=["bool", "indices"])
def test_repeated_choices_replay_their_launches_from_one_graph(
    monkeypatch, documents, route, return_indices
) -> None:
    """Once a choice repeats at the same addresses its launches (the parts, the product or
    the tiles, the top-k) replay from one CUDA graph (Note [A choice's launches in one graph]),
    and each replay chooses from what q and k hold now, bit for bit the choice of the launches
    without graphs."""
    skip_without_triton("cuda")
    from dilated_attention.backends.triton_kernels.selection import affinity_tiles

    if documents is not None and route == "tiles":
        pytest.skip("packed documents' candidates are masks: the stored product takes them")
    monkeypatch.setattr(affinity_tiles, "MIN_COLUMNS", {16: 1, 32: 1} if route == "tiles" else {})
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.empty(2, 512, 8, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.empty(2, 512, 2, 64, device="cuda", dtype=torch.bfloat16)
    contents = [[torch.randn(x.shape, device="cuda", generator=g).bfloat16() for x in (q, k)]
                for _ in range(4)]  # fmt: skip

    def choose(values: list[torch.Tensor]) -> torch.Tensor:
        q.copy_(values[0])
        k.copy_(values[1])
        return select_blocks(q, k, block_size=64, topk=3, is_causal=True, cu_seqlens=documents,
                             return_indices=return_indices)  # fmt: skip

    monkeypatch.setenv(graphs.ENV_VAR, "0")
    expected = [choose(values).clone() for values in contents]
    monkeypatch.delenv(graphs.ENV_VAR)
    replays = count_replays(monkeypatch)
    stored = [torch.empty_like(x) for x in expected]
    for values, into in zip(contents, stored, strict=True):
        keep([choose(values)], [into])
    assert all(torch.equal(a, b) for a, b in zip(stored, expected, strict=True))
    assert len({tuple(x.flatten().tolist()) for x in expected}) > 1  # the contents matter
    assert len(replays) >= 3, f"{len(replays)} replays in four choices"
