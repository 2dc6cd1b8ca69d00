"""Branch geometry (``core/geometry/segment.py``) and the (out, lse) merge (``core/merge.py``)."""

from __future__ import annotations

import pytest
import torch

from dilated_attention.core.geometry.segment import gather_rows, plan_branches, scatter_rows
from dilated_attention.core.merge import merge_partial


@pytest.mark.parametrize(
    ("seq_len", "heads", "segs", "rates"),
    [(37, 4, (8, 16, 32), (1, 2, 4)), (50, 6, (16, 10), (6, 3)), (7, 2, (100,), (4,))],
)
def test_plan_covers_each_branch_rows_exactly(seq_len, heads, segs, rates) -> None:
    """Each branch's groups cover exactly the (position, head) pairs of DESIGN section 1, once."""
    plan = plan_branches(seq_len, heads, segs, rates)
    for w, r in zip(segs, rates, strict=True):
        w_eff = min(w, seq_len)
        expected = {
            (t0 + h % r + r * m, h)
            for t0 in range(0, seq_len, w_eff)
            for h in range(heads)
            for m in range(w_eff)
            if t0 + h % r + r * m < min(t0 + w_eff, seq_len)
        }
        got: list[tuple[int, int]] = []
        for g in plan:
            if g.rate != r or g.segment_len not in (w_eff, seq_len % w_eff):
                continue
            for s in range(g.num_segments):
                t0 = g.start + s * g.segment_len
                got += [
                    (t0 + o + r * m, h)
                    for h, o in zip(g.heads, g.offsets, strict=True)
                    for m in range(g.rows)
                ]
        assert len(got) == len(set(got)) and set(got) == expected
    assert len(plan) <= 4 * len(segs)


def test_gather_scatter_round_trip() -> None:
    x = torch.randn(2, 37, 4, 3)
    for group in plan_branches(37, 4, (10, 37), (3, 1)):
        index = None if group.is_dense else group.index(group.heads, 4, x.device)
        rows = gather_rows(x, group, index)
        assert rows.shape == (2 * group.num_segments, group.rows, len(group.heads), 3)
        dest = torch.zeros_like(x)
        scatter_rows(dest, group, index, rows, accumulate=False)
        covered = dest != 0
        assert torch.equal(dest[covered], x[covered])


def test_merge_matches_joint_softmax_and_handles_empty_sides() -> None:
    scores = torch.randn(5, 12, dtype=torch.float64)
    values = torch.randn(12, 3, dtype=torch.float64)

    def part(sl: slice) -> tuple[torch.Tensor, torch.Tensor]:
        s = scores[:, sl]
        return torch.softmax(s, -1) @ values[sl], torch.logsumexp(s, -1)

    out, lse = merge_partial(*part(slice(0, 5)), *part(slice(5, 12)))
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ values)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))
    empty = (
        torch.zeros(5, 3, dtype=torch.float64),
        torch.full((5,), float("-inf"), dtype=torch.float64),
    )
    out2, lse2 = merge_partial(*empty, *empty)
    assert torch.equal(out2, torch.zeros(5, 3, dtype=torch.float64)) and bool(
        torch.isinf(lse2).all()
    )
    out3, lse3 = merge_partial(*empty, *part(slice(0, 12)))
    torch.testing.assert_close(out3, torch.softmax(scores, -1) @ values)
    torch.testing.assert_close(lse3, torch.logsumexp(scores, -1))


@pytest.mark.gpu
def test_fused_ring_merge_matches_joint_softmax() -> None:
    """The ring's one-kernel Triton merge (CUDA) equals the float64 joint softmax, in place on a
    row slice of the accumulators, with empty sides on either or both ends and a 16-bit part."""
    from dilated_attention.backends.triton_kernels.merge import merge_into

    batch, seq_len, heads, dim, keys = 2, 37, 3, 40, 24
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(batch, seq_len, heads, keys, dtype=torch.float64, generator=gen)
    values = torch.randn(batch, keys, heads, dim, dtype=torch.float64, generator=gen)
    scores[0, 3, 1, :10] = float("-inf")  # side a empty for this row
    scores[1, 7, 2, 10:] = float("-inf")  # side b empty
    scores[1, 9, 0] = float("-inf")  # both empty: zeros, lse -inf

    def part(keep: slice) -> tuple[torch.Tensor, torch.Tensor]:
        s = scores[..., keep]
        lse = torch.logsumexp(s, -1)
        probs = torch.nan_to_num(torch.exp(s - lse.unsqueeze(-1)), nan=0.0)
        return torch.einsum("bnhk,bkhd->bnhd", probs, values[:, keep]), lse

    (out_a, lse_a), (out_b, lse_b) = part(slice(0, 10)), part(slice(10, keys))
    out = torch.full((batch, seq_len + 5, heads, dim), 7.0, device="cuda")
    lse = torch.full((batch, seq_len + 5, heads), 7.0, device="cuda")
    rows = slice(2, 2 + seq_len)
    out[:, rows], lse[:, rows] = out_a.float().cuda(), lse_a.float().cuda()
    part_lse = lse_b.float().cuda().transpose(1, 2).contiguous().transpose(1, 2)  # (B,H,n) storage
    merge_into(out[:, rows], lse[:, rows], out_b.to(torch.bfloat16).cuda(), part_lse)
    want_lse = torch.logsumexp(scores, -1)
    want_out = torch.nan_to_num(torch.einsum(
        "bnhk,bkhd->bnhd", torch.exp(scores - want_lse.unsqueeze(-1)), values
    ), nan=0.0)  # fmt: skip
    torch.testing.assert_close(out[:, rows].double().cpu(), want_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse[:, rows].double().cpu(), want_lse, atol=1e-5, rtol=1e-5)
    assert float(out[1, 2 + 9, 0].abs().max()) == 0.0
    assert bool((out[:, :2] == 7.0).all()) and bool((out[:, 2 + seq_len :] == 7.0).all())
    assert bool((lse[:, :2] == 7.0).all()) and bool((lse[:, 2 + seq_len :] == 7.0).all())
