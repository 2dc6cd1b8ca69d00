"""The kernels' lists of a run-time block mask: the one-pass Triton compaction against a
readable loop, and the tile lists of aligned tiles against the prefix-sum classification."""

from __future__ import annotations

import pytest
import torch

from dilated_attention.block_sparse.lists import compact_rows, runtime_tile_lists
from dilated_attention.block_sparse.runtime import per_query_head
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
    from dilated_attention.backends.triton_kernels.top_blocks import top_blocks
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
