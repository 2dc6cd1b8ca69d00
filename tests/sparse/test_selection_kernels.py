"""The selection's Triton kernels against its torch operations: the choice with candidates by
position against the same choice reading their masks, and the block means' bfloat16 parts made
in one launch against the torch parts."""

from __future__ import annotations

import pytest
import torch

from dilated_attention.sparse.selection import CandidateRanges, _parts
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
