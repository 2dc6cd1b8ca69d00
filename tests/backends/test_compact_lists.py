"""The kernels' lists of a run-time block mask: the one-pass Triton compaction against a
readable loop, and the tile lists of aligned tiles against the prefix-sum classification."""

from __future__ import annotations

import itertools

import pytest
import torch

from dilated_attention.block_sparse.lists import (
    compact_rows,
    kept_mask,
    planned_narrow_lists,
    runtime_tile_lists,
)
from dilated_attention.block_sparse.runtime import (
    BlockIndices,
    kept_blocks,
    kept_indices,
    per_query_head,
    same_document,
)
from dilated_attention.block_sparse.tiles import kernel_tiles
from tests.support.triton import INTERPRETING, skip_without_triton

DEVICES = [pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]
if INTERPRETING:
    DEVICES.append(pytest.param("cpu", id="cpu-interpret"))


def _listed(kept: torch.Tensor, heads: int, repeat: int, causal: int, rows: int, cols: int):
    """The lists by a loop over every (batch row, head, row): its kept columns in order."""
    kept = kept.cpu()
    group = heads // kept.shape[1]
    out = []
    for b in range(kept.shape[0]):
        for h in range(heads):
            for r in range(rows):
                row = []
                for c in range(cols):
                    allowed = {0: True, 1: c < r, 2: c > r}[causal]
                    if allowed and bool(kept[b, h // group, r // repeat, c // repeat]):
                        row.append(c)
                out.append(row)
    return out


def _check(count: torch.Tensor, index: torch.Tensor, expected: list[list[int]]) -> None:
    count, index = count.cpu().flatten(0, -2), index.cpu().flatten(0, -3)
    count, index = count.reshape(-1), index.reshape(-1, index.shape[-1])
    assert count.tolist() == [len(row) for row in expected]
    for got, (n, row) in zip(index, zip(count.tolist(), expected, strict=True), strict=True):
        assert got[:n].tolist() == row
        assert not got[n:].any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("batch", "mask_heads", "heads", "rows", "cols", "repeat", "causal", "transpose"),
    [
        (1, 1, 1, 5, 7, 1, 0, False),
        (2, 2, 4, 37, 301, 1, 0, False),  # GQA heads, columns over several chunks
        (2, 4, 4, 40, 40, 1, 0, True),  # a transposed view: the backward's lists
        (1, 1, 3, 9, 9, 2, 1, False),  # tiles of two per block, before the diagonal
        (1, 2, 2, 9, 9, 3, 2, True),  # after the diagonal, transposed
        (2, 1, 2, 70, 70, 1, 1, False),
    ],
)
def test_device_compaction_matches_loop(
    device, batch, mask_heads, heads, rows, cols, repeat, causal, transpose
) -> None:
    skip_without_triton(device)
    from dilated_attention.backends.triton_kernels.compact import compact

    g = torch.Generator().manual_seed(rows * cols + heads)
    shape = (batch, mask_heads, cols, rows) if transpose else (batch, mask_heads, rows, cols)
    kept = (torch.rand(shape, generator=g) < 0.3).to(device)
    if transpose:
        kept = kept.transpose(-1, -2)
    limit_rows, limit_cols = rows * repeat - (repeat > 1), cols * repeat - (repeat > 1)
    count, index = compact(
        kept, heads=heads, repeat=repeat, causal=causal, rows=limit_rows, cols=limit_cols
    )
    assert count.shape == (batch, heads, limit_rows)
    assert index.shape == (batch, heads, limit_rows, limit_cols)
    _check(count, index, _listed(kept, heads, repeat, causal, limit_rows, limit_cols))


def test_compact_rows_matches_loop_on_cpu() -> None:
    """The torch path (every device but the GPU) against the same loop."""
    g = torch.Generator().manual_seed(3)
    kept = torch.rand(2, 3, 11, 13, generator=g) < 0.4
    count, index = compact_rows(kept.transpose(-1, -2))
    _check(count, index, _listed(kept.transpose(-1, -2), 3, 1, 0, 13, 11))


def _pairs(count: torch.Tensor, index: torch.Tensor) -> set[tuple[int, ...]]:
    """The (batch row, head, row, column) tiles of lists."""
    count, index = count.cpu(), index.cpu()
    return {(*key, int(index[key][j])) for key in map(tuple, torch.nonzero(count >= 0).tolist())
            for j in range(int(count[key]))}  # fmt: skip


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(
    ("block_size", "length", "is_causal", "mask_heads"),
    [(128, 1000, True, 2), (256, 900, True, 1), (256, 700, False, 4), (128, 129, True, 4)],
)
def test_aligned_tile_lists_cover_the_kept_tiles(device, block_size, length, is_causal, mask_heads):
    """Aligned tiles read from the block mask (the torch path on the CPU, the Triton pass on
    the GPU) list exactly the tiles the prefix-sum classification does, each full one full
    there too."""
    g = torch.Generator().manual_seed(length)
    blocks = -(-length // block_size)
    kept = torch.rand(2, mask_heads, blocks, blocks, generator=g) < 0.5
    if is_causal:
        kept &= torch.ones(blocks, blocks, dtype=torch.bool).tril()
    forward, backward = (
        runtime_tile_lists(kept.to(device), block_size=block_size, query_len=length,
                           key_len=length, is_causal=is_causal, num_heads=4, backward=direction)
        for direction in (False, True)
    )  # fmt: skip
    heads = kept if mask_heads == 1 else per_query_head(kept, 4)  # the lists' heads: 1 or H
    full, partial = kernel_tiles(
        heads, block_size=block_size, query_len=length, key_len=length,
        is_causal=is_causal,
    )  # fmt: skip
    transposed = (full.transpose(-1, -2), partial.transpose(-1, -2))
    for lists, (f, p) in ((forward, (full, partial)), (backward, transposed)):
        listed_full = _pairs(lists.full_count, lists.full_index)
        listed = listed_full | _pairs(lists.partial_count, lists.partial_index)
        assert listed == {tuple(t) for t in torch.nonzero(f | p).tolist()}
        assert listed_full <= {tuple(t) for t in torch.nonzero(f).tolist()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("rows", "cols", "topk", "per_row"),
    [(7, 9, 3, False), (40, 300, 15, True), (6, 1000, 3, True), (3, 2100, 5, False)],
)
def test_device_top_blocks_match_the_torch_choice(device, rows, cols, topk, per_row) -> None:
    """The one-pass choice against ``topk`` over the masked affinities (the CPU path): its own
    blocks and the same best candidates, found among the best groups of columns where a row
    has many, a NaN affinity below every number yet still chosen when fewer numbers are
    candidates."""
    skip_without_triton(device)
    from dilated_attention.backends.triton_kernels.selection.top_blocks import top_blocks
    from dilated_attention.sparse.selection import _top_blocks

    g = torch.Generator().manual_seed(rows + cols)
    affinity = torch.randn(2, 3, rows, cols, generator=g)
    affinity[0, 1, 2, 0] = float("nan")
    candidates = torch.rand((2, 1, rows, cols) if per_row else (rows, cols), generator=g) < 0.5
    candidates[..., 2, :] = False
    candidates[..., 2, :2] = True  # row 2: a NaN and a number among two candidates
    own = torch.rand(rows, cols, generator=g) < 0.1
    expected = _top_blocks(affinity, candidates, topk) | own
    got = top_blocks(affinity.to(device), candidates.to(device), own.to(device), topk)
    assert got.dtype == torch.bool and torch.equal(got.cpu(), expected)


def _as_mask(index: torch.Tensor, key_blocks: int) -> torch.Tensor:
    """Sorted kept indices ((..., K), ``key_blocks`` = none) as the bool mask they list,
    checking each row increasing with no repeat."""
    mask = torch.zeros(*index.shape[:-1], key_blocks, dtype=torch.bool)
    for key in itertools.product(*map(range, index.shape[:-1])):
        row = [j for j in index[key].tolist() if j != key_blocks]
        assert row == sorted(set(row)) and index[key].tolist()[len(row):] == [key_blocks] * (
            index.shape[-1] - len(row))
        mask[key][row] = True
    return mask.to(index.device)


def _increasing(count: torch.Tensor, index: torch.Tensor) -> bool:
    count, index = count.cpu().reshape(-1), index.cpu().reshape(-1, index.shape[-1])
    rows = zip(index, count.tolist(), strict=True)
    return all(bool((row[1:n] > row[: max(n - 1, 0)]).all()) for row, n in rows)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(
    ("block_size", "query_len", "key_len", "is_causal", "mask_heads", "documents"),
    [
        (128, 1000, 1000, True, 2, None),
        (256, 900, 900, True, 1, None),
        (256, 700, 500, False, 4, None),  # a short last key block: fewer tiles
        (128, 129, 129, True, 4, None),
        (128, 1024, 1024, True, 2, (0, 384, 1024, 1408, 2048)),  # packed documents
    ],
)
def test_index_lists_match_the_bool_lists(
    device, block_size, query_len, key_len, is_causal, mask_heads, documents
) -> None:
    """Block indices (repeated, -1, out of range, after a causal row, across documents) kept as
    indices list the bool form's kept blocks, and their narrow forward lists (torch operations
    on the CPU, one Triton launch on the GPU) list the same tiles as the bool form's wide ones,
    full and partial alike, each in increasing order and ``min(K r, Tk)`` wide, with the same
    empty rows and read key blocks (Note [Narrow lists of block indices])."""
    mq, mk = -(-query_len // block_size), -(-key_len // block_size)
    g = torch.Generator().manual_seed(query_len + mask_heads)
    indices = torch.randint(-2, mk + 2, (2, mask_heads, mq, 5), generator=g).to(device)
    indices[..., 1] = indices[..., 0]  # a repeat
    geometry = {"block_size": block_size, "query_len": query_len, "key_len": key_len,
                "is_causal": is_causal}  # fmt: skip
    if documents is not None:
        geometry["documents"] = same_document(documents, 2, query_len, block_size,
                                              torch.device(device))  # fmt: skip
    blocks = BlockIndices(indices, **geometry)
    kept = kept_blocks(indices, **geometry)
    assert torch.equal(blocks.as_mask(), kept)
    mk = kept.shape[-1]
    index = kept_indices(blocks)
    assert torch.equal(_as_mask(index, mk), kept)
    (got, empty, read), fill = planned_narrow_lists(blocks, 4)
    assert (fill is None) == (device == "cpu")  # made now on the CPU, by one launch on the GPU
    if fill is not None:
        fill()
    want = runtime_tile_lists(kept, block_size=block_size, query_len=query_len,
                              key_len=key_len, is_causal=is_causal, num_heads=4)  # fmt: skip
    assert got.full_index.shape[-1] == min(5 * (block_size // 128), -(-key_len // 128))
    assert torch.equal(empty, per_query_head(~kept.any(-1), got.full_count.shape[1]))
    assert torch.equal(read, kept.any(-2))
    for field in ("partial", "full"):
        counts = (getattr(got, f"{field}_count"), getattr(want, f"{field}_count"))
        indexes = (getattr(got, f"{field}_index"), getattr(want, f"{field}_index"))
        assert torch.equal(*counts)
        assert _pairs(counts[0], indexes[0]) == _pairs(counts[1], indexes[1])
        assert _increasing(counts[0], indexes[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("rows", "cols", "topk", "own_width"), [(7, 9, 3, 1), (40, 300, 15, 2),
                                                                  (5, 70, 4, 0)])
def test_device_top_blocks_as_indices(device, rows, cols, topk, own_width) -> None:
    """The choice written as block indices (Note [Chosen blocks as indices]): each row's
    indices, -1 dropped, are exactly the columns of the bool choice, each once."""
    skip_without_triton(device)
    from dilated_attention.backends.triton_kernels.selection.top_blocks import top_blocks

    g = torch.Generator().manual_seed(rows * cols)
    affinity = torch.randn(2, 3, rows, cols, generator=g).to(device)
    candidates = (torch.rand(rows, cols, generator=g) < 0.6).to(device)
    first = torch.randint(0, cols - 1, (rows, 1), generator=g)
    run = torch.arange(cols)[None, :] - first
    own = ((run >= 0) & (run < own_width) & (torch.rand(rows, 1, generator=g) < 0.8)).to(device)
    candidates &= ~own
    expected = top_blocks(affinity, candidates, own, topk)
    got = top_blocks(affinity, candidates, own, topk, own_width=own_width)
    assert got.shape == (2, 3, rows, topk + own_width) and got.dtype == torch.int32
    for key in itertools.product(range(2), range(3), range(rows)):
        listed = [j for j in got[key].tolist() if j >= 0]
        assert sorted(listed) == torch.nonzero(expected[key]).flatten().tolist()


#: Block indices on a device: (block size, lengths, causal, mask (batch, heads), documents).
INDEX_FIELDS = ("block_size", "length", "key_len", "is_causal", "mask_shape", "documents")
INDEX_CASES = [
    (128, 1000, 1000, True, (2, 2), None),
    (256, 900, 900, True, (1, 1), None),
    (256, 700, 500, False, (2, 4), None),
    (128, 1024, 1024, True, (1, 2), (0, 384, 1024, 1408, 2048)),
]


def _index_blocks(block_size, length, key_len, is_causal, mask_shape, documents, *, seed):
    """Six block indices per query block on the CPU, out of range, repeated (index 2 is index
    4), with two rows' documents where given."""
    mq, mk = -(-length // block_size), -(-key_len // block_size)
    g = torch.Generator().manual_seed(seed)
    indices = torch.randint(-2, mk + 2, (*mask_shape, mq, 6), generator=g)
    indices[..., 2] = indices[..., 4]
    same = None if documents is None else same_document(documents, 2, length, block_size,
                                                        torch.device("cpu"))  # fmt: skip
    return BlockIndices(indices, block_size, length, key_len, is_causal, same)


def _strided_on(device, blocks):
    """The indices on ``device`` with other strides, and the documents there (or None)."""
    indices = blocks.indices.to(device).transpose(-1, -2).contiguous().transpose(-1, -2)
    same = None if blocks.documents is None else blocks.documents.to(device)
    return indices, same


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(INDEX_FIELDS, INDEX_CASES)
def test_device_index_lists_match_the_torch_path(
    device, block_size, length, key_len, is_causal, mask_shape, documents
) -> None:
    """The one-launch narrow lists (Note [Narrow lists in one launch]) equal the torch
    operations' lists entry for entry, with the same empty rows and read key blocks."""
    skip_without_triton(device)
    from dilated_attention.backends.triton_kernels.index_lists import planned_index_lists

    blocks = _index_blocks(block_size, length, key_len, is_causal, mask_shape, documents,
                           seed=length + mask_shape[1])  # fmt: skip
    want, _ = planned_narrow_lists(blocks, 4)  # the torch operations, on the CPU
    heads = want.lists.full_count.shape[1]
    indices, same = _strided_on(device, blocks)
    planned = planned_index_lists(
        indices, repeat=block_size // 128, key_blocks=-(-key_len // block_size),
        row_tiles=-(-length // 128), key_tiles=-(-key_len // 128), is_causal=is_causal,
        heads=heads, same=same,
    )  # fmt: skip
    for buffer in (*planned.lists, planned.empty, planned.read):  # what the launch must write
        buffer.view(torch.uint8).fill_(0x55)
    planned.launch()
    lists, empty, read = planned.lists, planned.empty, planned.read
    for got, expected in zip((*lists, empty, read), (*want.lists, want.empty, want.read),
                             strict=True):  # fmt: skip
        assert got.shape == expected.shape and torch.equal(got.cpu(), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(INDEX_FIELDS, INDEX_CASES)
def test_device_index_mask_matches_the_torch_path(
    device, block_size, length, key_len, is_causal, mask_shape, documents
) -> None:
    """The kept blocks of block indices in one launch equal ``BlockIndices.as_mask``'s torch
    operations: out of range, after a causal diagonal, in another document, repeated."""
    skip_without_triton(device)
    from dilated_attention.backends.triton_kernels.index_lists import index_mask

    blocks = _index_blocks(block_size, length, key_len, is_causal, mask_shape, documents,
                           seed=length + mask_shape[0])  # fmt: skip
    indices, same = _strided_on(device, blocks)
    got = index_mask(indices, key_blocks=-(-key_len // block_size), is_causal=is_causal,
                     same=same)  # fmt: skip
    assert torch.equal(got.cpu(), blocks.as_mask())
    if device == "cuda":
        on_device = BlockIndices(indices, block_size, length, key_len, is_causal, same)
        assert torch.equal(kept_mask(on_device).cpu(), blocks.as_mask())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("shape", "flag_shape", "block_size"),
                         [((2, 300, 4, 24), (2, 2, 5), 64), ((1, 129, 2, 8), (1, 1, 2), 128)])
def test_device_fill_blocks_matches_masked_fill(device, shape, flag_shape, block_size) -> None:
    """The flagged blocks' rows set, through any strides (an lse view), and nothing else."""
    skip_without_triton(device)
    from dilated_attention.backends.triton_kernels.fill import fill_blocks

    g = torch.Generator().manual_seed(shape[1])
    flags = torch.rand(flag_shape, generator=g) < 0.5
    x = torch.randn(shape[0], shape[2], shape[1], shape[3], generator=g)  # (B, H, N, D)
    expected = x.clone()
    rows = per_query_head(flags, shape[2]).repeat_interleave(block_size, -1)[..., : shape[1]]
    expected.masked_fill_(rows.unsqueeze(-1), -3.5)
    got = x.to(device)
    fill_blocks(got.transpose(1, 2), flags.to(device), block_size, -3.5)
    assert torch.equal(got.cpu(), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("cols", "topk"), [(100, 5), (300, 15), (40, 9)])
def test_device_top_blocks_pick_the_same_blocks_at_every_group_width(device, cols, topk) -> None:
    """The top-k kernel's groups hold every row's best columns whatever their width (Note [Top
    blocks in registers]): each width from one column to the widest gives the row's ``topk``
    best candidates, the lowest columns among equal affinities (many ties here), as a stable
    float64 sort gives them; the default width is among them."""
    skip_without_triton(device)
    from dilated_attention.backends.triton_kernels.selection.top_blocks import (
        group_width,
        scratch_shape,
        top_blocks,
    )

    g = torch.Generator().manual_seed(cols)
    affinity = torch.randint(0, 6, (2, 3, 4, cols), generator=g).float()
    candidates = torch.rand(4, cols, generator=g) < 0.7
    own = torch.zeros(4, cols, dtype=torch.bool)
    score = affinity.double().masked_fill(~candidates, -torch.inf)
    order = torch.sort(-score, dim=-1, stable=True).indices[..., :topk]
    kept = torch.gather(score, -1, order) > -torch.inf
    block, picks = 1 << (cols - 1).bit_length(), 1 << (topk - 1).bit_length()
    widths = [1 << i for i in range(7) if block >> i >= picks]
    assert group_width(cols, topk) in widths and scratch_shape(24, cols, topk)[0] == 24
    for width in widths:
        scratch = torch.empty(24, block // width, device=device)
        got = top_blocks(affinity.to(device), candidates.to(device), own.to(device), topk,
                         own_width=0, scratch=scratch).cpu()  # fmt: skip
        for key in itertools.product(range(2), range(3), range(4)):
            listed = sorted(j for j in got[key].tolist() if j >= 0)
            assert listed == sorted(order[key][kept[key]].tolist()), f"width {width}, {key}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("cols", "topk"), [(40, 7), (1500, 31), (2100, 63)])
def test_device_top_blocks_rank_signed_zeros_subnormals_and_extremes(device, cols, topk) -> None:
    """The kernel ranks each value by its bits turned to order as integers (Note [Top blocks
    in registers]): negative numbers, subnormals of both signs, the largest finite floats and
    ``-0.0`` (equal to ``0.0``: the lower column wins) rank as a stable float64 sort ranks
    them, ``topk`` up to 63."""
    skip_without_triton(device)
    from dilated_attention.backends.triton_kernels.selection.top_blocks import top_blocks

    big, tiny = torch.finfo(torch.float32).max, 1e-40  # 1e-40 is subnormal in float32
    levels = torch.tensor([-big, -2.5, -tiny, -0.0, 0.0, tiny, 1.5, big])
    g = torch.Generator().manual_seed(cols + topk)
    affinity = levels[torch.randint(0, len(levels), (1, 2, 3, cols), generator=g)]
    affinity[0, 1, 0] = levels[3:5][torch.randint(0, 2, (cols,), generator=g)]  # zeros only
    candidates = torch.rand(3, cols, generator=g) < 0.8
    score = affinity.double().masked_fill(~candidates, -torch.inf)
    order = torch.sort(-score, dim=-1, stable=True).indices[..., :topk]
    own = torch.zeros(3, cols, dtype=torch.bool)
    got = top_blocks(affinity.to(device), candidates.to(device), own.to(device), topk,
                     own_width=0).cpu()  # fmt: skip
    for key in itertools.product(range(1), range(2), range(3)):
        assert sorted(got[key].tolist()) == sorted(order[key].tolist()), key
