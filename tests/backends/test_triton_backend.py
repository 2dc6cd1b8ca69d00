"""The ``triton`` backend and the fused engine (``core/execution/fused.py``).

The registry-wide suites (test_dilated_correctness.py, test_attention_correctness.py) already run
this backend on every small case wherever it is available; this file adds what they miss: GPU-sized
odd shapes (head dims that are not powers of two, ragged rows, GQA, masks) against the float64
oracle, the multi-group path of the fused engine, poisoned buffers that expose rows a kernel fails
to write or writes by mistake, and the clean refusal when Triton or a GPU is missing.

On a machine without a GPU, ``TRITON_INTERPRET=1 pytest tests/backends/test_triton_backend.py``
runs the kernel tests through Triton's interpreter (float32 and float16; slow; needs ``pip install
triton``).
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import pytest
import support.triton
import torch
from support.oracle import branch_positions, masked_attention, oracle_dilated_attention
from support.tolerances import LOW_PRECISION, TOLERANCES, assert_close_to_oracle
from support.triton import (
    INTERPRETING,
    KERNEL_DEVICES,
    poison_new_buffers,
    require_triton,
    skip_without_triton,
)
from torch import Tensor

from dilated_attention import dilated_attention
from dilated_attention.backends import base, get_backend
from dilated_attention.backends import triton as triton_backend
from dilated_attention.backends.registry import choose
from dilated_attention.core.execution import fused, graphs
from dilated_attention.core.execution.fused import BranchSpan, position_groups
from dilated_attention.core.geometry.cells import Cells, add_cells, merge_cells

#: How the forward reads q, k, v rows (Note [Rows through tensor descriptors]): both ways are
#: forced in turn, wherever the layout allows descriptors.
ROW_LOADS = ["pointers", "descriptors"]


def _force_row_loads(monkeypatch: pytest.MonkeyPatch, row_loads: str) -> list[bool]:
    """Force ``row_loads``; returns the list that records, per forward launch, whether it read
    through descriptors."""
    kernels = triton_backend._kernels()
    policy = "never" if row_loads == "pointers" else "always"
    monkeypatch.setattr(kernels, "DESCRIPTOR_POLICY", policy)
    used: list[bool] = []
    real = kernels._use_descriptors

    def spy(*args: Any) -> bool:
        used.append(real(*args))
        return used[-1]

    monkeypatch.setattr(kernels, "_use_descriptors", spy)
    return used


# -- position groups (no kernels) ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("seq_len", "segments", "min_positions"),
    [
        (1000, (8, 16, 32), 64),
        (1000, (8, 16, 32), 1),
        (4096, (2048,), 1024),
        (50, (10, 16), 1),  # lcm 80 > N: one group
        (96, (12, 32), 8),  # lcm 96 = N
        (1 << 20, (2048, 4096, 8192, 16384, 32768), None),
        (300_001, (2048, 4096), None),
        (40, (16, 128), 1),  # a segment longer than the sequence is clipped to N
    ],
)
def test_position_groups_tile_the_sequence_on_common_boundaries(
    seq_len: int, segments: tuple[int, ...], min_positions: int | None
) -> None:
    groups = position_groups(seq_len, segments, min_positions)
    assert groups[0][0] == 0 and groups[-1][1] == seq_len
    assert all(a[1] == b[0] for a, b in itertools.pairwise(groups))
    assert all(start < end for start, end in groups)
    clipped = [min(w, seq_len) for w in segments]
    for start, _ in groups:
        assert all(start % w == 0 for w in clipped), (start, clipped)
    floor = fused.MIN_GROUP_POSITIONS if min_positions is None else min_positions
    assert all(end - start >= floor for start, end in groups[:-1])
    if len(groups) > 1:
        # Groups are bounded so that float32 scratch stays a fraction of the inputs.
        size = groups[0][1] - groups[0][0]
        lcm = math.lcm(*clipped)
        wanted = max(floor, -(-seq_len // fused.GROUPS_PER_SEQUENCE))
        assert size == -(-wanted // lcm) * lcm


@pytest.mark.parametrize(
    ("heads", "kv_group", "rows", "seq_len", "min_positions", "backward", "width"),
    [
        # One group of the whole sequence: a quarter of the heads forward, a sixth backward.
        (16, 1, 1 << 20, 1 << 20, None, False, 4),
        (16, 1, 1 << 20, 1 << 20, None, True, 2),
        (16, 1, 65536, 1 << 20, None, True, 16),  # an ordinary position group: every head
        # LongNet at 64K: two groups of 32K; 8 heads forward, 4 (the floor) backward.
        (16, 1, 32768, 65536, None, False, 8),
        (16, 1, 32768, 65536, None, True, 4),
        (16, 1, 8192, 8192, None, True, 16),  # four heads of MIN_GROUP_POSITIONS rows: all
        (16, 4, 32768, 65536, None, False, 4),  # GQA at 64K: one kv head group (the floor)
        (32, 4, 4 << 20, 4 << 20, None, False, 4),  # GQA: whole kv head groups (4 query heads)
        (6, 3, 1000, 1000, 1, True, 3),  # even one kv head group is over budget
        (12, 1, 120, 120, 1, False, 3),  # budget 120 * 12 / 4 = 360 = 120 * 3
        (8, 2, 100, 400, 1, True, 4),
    ],
)
def test_head_groups_split_whole_kv_groups_within_the_scratch_budget(
    heads: int,
    kv_group: int,
    rows: int,
    seq_len: int,
    min_positions: int | None,
    backward: bool,
    width: int,
) -> None:
    """The float32 scratch of one (position group, head group) takes at most 1/SCRATCH_SHARE of
    the bytes every implementation holds, or four heads of the smallest group, at any length."""
    groups = fused.head_groups(heads, kv_group, rows, seq_len, min_positions, backward)
    widths = {h1 - h0 for h0, h1 in groups}
    assert groups[0][0] == 0 and groups[-1][1] == heads and len(widths) == 1
    assert all(a[1] == b[0] for a, b in itertools.pairwise(groups))
    assert widths == {width}
    assert width % kv_group == 0 and heads % width == 0
    floor = fused.MIN_GROUP_POSITIONS if min_positions is None else min_positions
    share = fused.scratch_fraction(kv_group, backward)
    budget = max(int(seq_len * heads * share), floor * fused.MIN_SCRATCH_HEADS)
    assert rows * width <= budget or width == kv_group
    # The widest such split: the next wider one that divides the heads is over budget.
    wider = [w for w in range(width + kv_group, heads + 1, kv_group) if heads % w == 0]
    assert all(rows * w > budget for w in wider)


# -- refusal without a GPU or without Triton -------------------------------------------------------
@pytest.mark.skipif(INTERPRETING, reason="the interpreter makes the backend run on CPU")
def test_cpu_choice_explains_why_not_triton() -> None:
    choice = choose(
        base.KernelInputs(
            device=torch.device("cpu"),
            dtype=torch.float32,
            head_dim=64,
            num_heads=4,
            num_kv_heads=4,
            query_len=128,
            key_len=128,
            dilated=True,
        )
    )
    assert choice.backend != "triton"
    assert choice.reasons["triton"] == ["runs on ['cuda'], not cpu"]


def test_missing_triton_is_a_reason_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton -> ImportError
    launchers = "dilated_attention.backends.triton_kernels.launchers"
    monkeypatch.delitem(sys.modules, launchers, raising=False)
    triton_backend._kernels.cache_clear()
    try:
        reasons = triton_backend.TritonBackend().import_reasons()
    finally:
        triton_backend._kernels.cache_clear()
    assert len(reasons) == 1
    assert reasons[0].startswith("triton import failed: ModuleNotFoundError")


# -- kernels against the oracle -------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    id: str
    N: int
    H: int
    D: int
    segments: tuple[int, ...]
    rates: tuple[int, ...]
    H_kv: int | None = None
    padding: bool = False
    B: int = 1


SHAPES = [
    # Head dim 40 (padded to 64 inside the kernel), rates 3 and 7 leave ragged rows, N is not a
    # multiple of any segment, GQA 6:2.
    Shape("d40_ragged_gqa", N=1000, H=6, H_kv=2, D=40, segments=(96, 200, 1000), rates=(1, 3, 7)),
    Shape("d128_masked", N=777, H=4, D=128, segments=(64, 256), rates=(1, 4), padding=True, B=2),
    Shape("d256", N=384, H=2, D=256, segments=(128, 384), rates=(1, 2)),
    # One branch with r = 3: two thirds of each head's rows are uncovered (zeros, lse -inf); MQA.
    Shape("single_branch_uncovered_mqa", N=300, H=8, H_kv=1, D=64, segments=(100,), rates=(3,)),
    # Paper-style rates that do not divide their segments.
    Shape("paper_rates", N=768, H=12, D=64, segments=(128, 256, 768), rates=(1, 6, 12)),
]


def _compare(
    shape: Shape,
    dtype: torch.dtype,
    device: str,
    is_causal: bool,
    *,
    groups: int | None = None,
    heads_major: bool = False,
) -> None:
    """The fused path against the float64 oracle; ``heads_major``: q, k, v are (B, N, H, D)
    views of (B, H, N, D) tensors (transformers' layout), which must not be copied."""
    gen = torch.Generator().manual_seed(0)
    kv_heads = shape.H_kv or shape.H

    def draw(heads: int) -> Tensor:
        return torch.randn(shape.B, shape.N, heads, shape.D, generator=gen, dtype=torch.float64)

    q0, dout = draw(shape.H).to(dtype), draw(shape.H).to(dtype)
    k0, v0 = draw(kv_heads).to(dtype), draw(kv_heads).to(dtype)
    mask = (torch.rand(shape.B, shape.N, generator=gen) < 0.25) if shape.padding else None
    q, k, v = (x.to(device).requires_grad_() for x in (q0, k0, v0))
    if heads_major:
        leaves = [x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v)]
        q, k, v = (x.transpose(1, 2) for x in leaves)
    dev_mask = None if mask is None else mask.to(device)
    out, lse = dilated_attention(
        q, k, v, shape.segments, shape.rates, is_causal=is_causal, key_padding_mask=dev_mask,
        backend="triton", return_lse=True,
    )  # fmt: skip
    grads = [g.cpu() for g in torch.autograd.grad(out, (q, k, v), dout.to(device))]
    if heads_major:  # the gradients of the views keep their layout: nothing was copied
        assert all(g.stride() == x.stride() for g, x in zip(grads, (q, k, v), strict=True))
    kwargs = {"is_causal": is_causal, "key_padding_mask": mask}
    leaves64 = [x.to(torch.float64).requires_grad_() for x in (q0, k0, v0)]
    out64, lse64 = oracle_dilated_attention(*leaves64, shape.segments, shape.rates, **kwargs)
    grads64 = torch.autograd.grad(out64, leaves64, dout.to(torch.float64))
    ref_out = ref_lse = None
    ref_grads: tuple[Tensor | None, ...] = (None, None, None)
    if dtype in LOW_PRECISION:
        leaves_low = [x.clone().requires_grad_() for x in (q0, k0, v0)]
        ref_out, ref_lse = oracle_dilated_attention(
            *leaves_low, shape.segments, shape.rates, compute_dtype=dtype, **kwargs
        )
        ref_grads = torch.autograd.grad(ref_out, leaves_low, dout)
    assert_close_to_oracle(out.detach().cpu(), out64, ref_out, name="out", dtype=dtype)
    assert_close_to_oracle(lse.cpu(), lse64, ref_lse, name="lse", dtype=dtype)
    for name, g, g64, gref in zip(("dq", "dk", "dv"), grads, grads64, ref_grads, strict=True):
        assert bool(torch.isfinite(g).all()), name
        assert_close_to_oracle(g, g64, gref, name=name, dtype=dtype, grad=True)
    empty = torch.isneginf(lse64)
    assert torch.equal(torch.isneginf(lse.cpu()), empty)
    assert bool((out.detach().cpu()[empty.transpose(1, 2)] == 0).all())


@pytest.mark.parametrize("row_loads", ROW_LOADS)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=[s.id for s in SHAPES])
@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_fused_matches_oracle(
    shape: Shape,
    is_causal: bool,
    row_loads: str,
    device: str,
    dtypes: list[torch.dtype],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    skip_without_triton(device)
    used = _force_row_loads(monkeypatch, row_loads)
    for dtype in dtypes:
        _compare(shape, dtype, device, is_causal)
    # Every shape has a 16-bit run and a branch whose rate divides N: both ways really ran.
    assert any(used) == (row_loads == "descriptors")


def _split_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the fused engine split small inputs into position and head groups, as it does very
    long ones: no smallest group, scratch at most q / 1000."""
    monkeypatch.setattr(fused, "MIN_GROUP_POSITIONS", 1)
    monkeypatch.setattr(fused, "SCRATCH_SHARE", 1000)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_fused_engine_across_many_position_groups(
    is_causal: bool, device: str, dtypes: list[torch.dtype], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Groups of 128 positions (lcm of the segments) instead of one: same answer."""
    skip_without_triton(device)
    monkeypatch.setattr(fused, "MIN_GROUP_POSITIONS", 1)
    monkeypatch.setattr(fused, "GROUPS_PER_SEQUENCE", 1000)
    shape = Shape(
        "groups", N=700, H=4, H_kv=2, D=64, segments=(32, 64, 128), rates=(1, 2, 4), padding=True
    )
    assert len(position_groups(shape.N, shape.segments)) == 6
    for dtype in dtypes:
        _compare(shape, dtype, device, is_causal)


@pytest.mark.parametrize("row_loads", ROW_LOADS)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_fused_engine_across_head_groups(
    is_causal: bool,
    row_loads: str,
    device: str,
    dtypes: list[torch.dtype],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Scratch split by heads (what very long sequences get): launches on head slices start at
    layer head ``head0``, so offsets (head mod rate) and kv heads must still be the layer's."""
    skip_without_triton(device)
    _force_row_loads(monkeypatch, row_loads)
    _split_scratch(monkeypatch)
    shape = Shape(
        "heads", N=300, H=8, H_kv=4, D=32, segments=(60, 150, 300), rates=(1, 3, 4), padding=True
    )
    assert len(fused.head_groups(shape.H, 2, shape.N, shape.N)) == 4
    for dtype in dtypes:
        _compare(shape, dtype, device, is_causal)


@pytest.mark.parametrize("row_loads", ROW_LOADS)
@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_fused_engine_never_sums_unwritten_scratch(
    row_loads: str, device: str, dtypes: list[torch.dtype], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rate-1 branch runs last and merges from float32 scratch that the other branches wrote
    only in part, straight into the output; backward it runs first and writes every row of the
    gradient scratch that the others add to (Note [Fused branch engine]): with every new buffer
    NaN-filled, no NaN may reach the output or the gradients."""
    skip_without_triton(device)
    _force_row_loads(monkeypatch, row_loads)
    poison_new_buffers(monkeypatch)
    shape = Shape(
        "nan_scratch", N=300, H=4, H_kv=2, D=32, segments=(60, 150, 300), rates=(4, 1, 3),
        padding=True,
    )  # fmt: skip
    for dtype in dtypes:
        for is_causal in (False, True):
            _compare(shape, dtype, device, is_causal)


@pytest.mark.parametrize(
    "shape",
    [
        Shape("positions", N=700, H=4, H_kv=2, D=32, segments=(32, 64, 128), rates=(1, 2, 4),
              padding=True),
        Shape("heads", N=300, H=8, H_kv=4, D=32, segments=(60, 150, 300), rates=(1, 3, 4),
              padding=True),
    ],
    ids=["positions", "heads"],
)  # fmt: skip
@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_fused_engine_results_do_not_depend_on_grouping(
    shape: Shape, device: str, dtypes: list[torch.dtype], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Position and head groups decide which launch computes a row, never how (Note [Fused
    branch engine]): one group and many give the same bits, forward and backward. Small inputs
    stay in one head group: their scratch is below four heads of the smallest group."""
    skip_without_triton(device)
    widths: list[int] = []
    real = fused.head_groups

    def spy(*args: Any, **kwargs: Any) -> list[tuple[int, int]]:
        groups = real(*args, **kwargs)
        widths.append(len(groups))
        return groups

    monkeypatch.setattr(fused, "head_groups", spy)
    gen = torch.Generator().manual_seed(3)
    kv_heads = shape.H_kv or shape.H
    mask = (torch.rand(shape.B, shape.N, generator=gen) < 0.25).to(device)
    for dtype in dtypes:
        q, dout = (torch.randn(shape.B, shape.N, shape.H, shape.D, generator=gen) for _ in "qo")
        k, v = (torch.randn(shape.B, shape.N, kv_heads, shape.D, generator=gen) for _ in "kv")
        leaves = [x.to(device, dtype).requires_grad_() for x in (q, k, v)]
        dout = dout.to(device, dtype)

        def run(leaves: list[Tensor] = leaves, dout: Tensor = dout) -> list[Tensor]:
            out, lse = dilated_attention(
                *leaves, shape.segments, shape.rates, is_causal=True, key_padding_mask=mask,
                backend="triton", return_lse=True,
            )  # fmt: skip
            return [out.detach(), lse, *torch.autograd.grad(out, leaves, dout)]

        run()  # a new shape family first compiles ahead, through a dry run of the engine
        # Plans are kept per shapes and limits (Note [A fused call planned once]): made afresh,
        # each position group asks head_groups once.
        fused._plan.cache_clear()
        widths.clear()

        # One call of head_groups per position group, forward and backward.
        whole = run()
        assert widths == [1, 1]
        widths.clear()
        with monkeypatch.context() as patch:
            _split_scratch(patch)
            split = run()
        assert len(widths) > 2 if shape.id == "positions" else min(widths) > 1
        widths.clear()
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), whole, split, strict=True):
            assert torch.equal(a, b), name


@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_causal_results_do_not_depend_on_the_order_of_tiles(
    device: str, dtypes: list[torch.dtype], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Causal launches start their heaviest tiles first (Note [Heavy tiles first]): the same
    bits as the tiles in index order, forward and backward, with GQA and a ragged last segment
    of fewer tiles than the others (32 rows against 256 in branch (256, 1))."""
    skip_without_triton(device)
    from dilated_attention.backends.triton_kernels.launch import clear_bound

    kernels = triton_backend._kernels()
    real_grid = kernels._grid
    orders: list[bool] = []

    def spy(tiles: int, groups: int, batch: int, is_causal: bool) -> tuple[Any, bool]:
        grid, outer = real_grid(tiles, groups, batch, is_causal)
        orders.append(outer)
        return grid, outer

    def index_order(tiles: int, groups: int, batch: int, is_causal: bool) -> tuple[Any, bool]:
        orders.append(False)
        return (tiles, groups, batch), False  # the layout before Note [Heavy tiles first]

    gen = torch.Generator().manual_seed(5)
    for dtype in dtypes:
        q, dout = (torch.randn(2, 800, 8, 32, generator=gen) for _ in "qo")
        k, v = (torch.randn(2, 800, 2, 32, generator=gen) for _ in "kv")
        leaves = [x.to(device, dtype).requires_grad_() for x in (q, k, v)]
        dout = dout.to(device, dtype)

        def run(leaves: list[Tensor] = leaves, dout: Tensor = dout) -> list[Tensor]:
            out, lse = dilated_attention(
                *leaves, (256, 400, 800), (1, 2, 4), is_causal=True, backend="triton",
                return_lse=True,
            )  # fmt: skip
            return [out.detach(), lse, *torch.autograd.grad(out, leaves, dout)]

        def ordered(grid: Any, outer: bool) -> list[Tensor]:
            graphs.clear()  # replayed graphs and bound launches keep the grids they were made with
            clear_bound()
            orders.clear()
            with monkeypatch.context() as patch:
                patch.setattr(kernels, "_grid", grid)
                results = run()
            assert orders and set(orders) == {outer}  # every launch took the layout asked
            return results

        heavy_first = ordered(spy, True)
        in_order = ordered(index_order, False)
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), heavy_first, in_order, strict=True):
            assert torch.equal(a, b), name


def test_causal_grids_put_tiles_on_y_where_they_fit() -> None:
    """The grid's layout per launch (Note [Heavy tiles first]): causal launches put their tiles
    on y, unless more than y holds; other launches keep them on x unless their (segment, head)
    groups pass y's limit; a launch that fits neither way, or too many batch rows for z, is a
    clear error before any launch."""
    pytest.importorskip("triton")
    grid = triton_backend._kernels()._grid
    most = 2**16 - 1
    assert grid(32, 64, 2, True) == ((64, 32, 2), True)
    assert grid(32, 64, 2, False) == ((32, 64, 2), False)
    assert grid(most, 3, 1, True) == ((3, most, 1), True)
    assert grid(most + 1, 3, 1, True) == ((most + 1, 3, 1), False)
    assert grid(8, most + 1, 1, False) == ((most + 1, 8, 1), True)  # groups past y: tiles on y
    assert grid(8, most, 1, False) == ((8, most, 1), False)
    for tiles, groups, batch in ((most + 1, most + 1, 1), (8, 3, most + 1)):
        with pytest.raises(ValueError, match="does not fit a CUDA grid") as caught:
            grid(tiles, groups, batch, True)
        assert f"{batch} batch rows" in str(caught.value) and "backend='sdpa'" in str(caught.value)


def _random_cells(seq_len: int, heads: int, gen: torch.Generator) -> Cells:
    rows, cell_heads = torch.nonzero(torch.rand(seq_len, heads, generator=gen) < 0.3).T
    return Cells.of([rows], [cell_heads], heads)[0]


@pytest.mark.parametrize(
    "branches",
    [((60, 1), (150, 3)), ((150, 3), (300, 4)), ((60, 1),), ((150, 3),)],
    ids=["rate1_last", "no_rate1", "single_rate1", "single_strided"],
)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_fused_engine_merges_extra_results_before_rounding(
    branches: tuple[tuple[int, int], ...],
    is_causal: bool,
    device: str,
    dtypes: list[torch.dtype],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``extra`` (ring dilated attention's spanning branches, Note [Compact cell results]):
    compact float32 results for some (row, head) cells join the running values of each
    (position group, head group) before the one rounding. Forward equals the float64 oracle
    merged with those results; backward adds the given compact gradients. New buffers are
    NaN-filled, so unwritten scratch rows must get weight zero unread."""
    skip_without_triton(device)
    _split_scratch(monkeypatch)
    poison_new_buffers(monkeypatch)
    batch, seq_len, heads, kv_heads, dim = 2, 600, 4, 2, 32
    segs, rates = zip(*branches, strict=True)
    assert len(position_groups(seq_len, segs, 1)) > 1  # several position groups
    gen = torch.Generator().manual_seed(0)
    q_cells, kv_cells = _random_cells(seq_len, heads, gen), _random_cells(seq_len, kv_heads, gen)
    m, m_kv = q_cells.rows.numel(), kv_cells.rows.numel()
    cell_out = torch.randn(batch, m, dim, generator=gen, dtype=torch.float64)
    cell_lse = torch.randn(batch, m, generator=gen, dtype=torch.float64) + 3
    cell_dq = torch.randn(batch, m, dim, generator=gen)
    cell_dkv = torch.randn(2, batch, m_kv, dim, generator=gen)
    shapes = [(batch, seq_len, h, dim) for h in (heads, kv_heads, kv_heads, heads)]
    q0, k0, v0, dout0 = (torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes)
    backend = get_backend("triton")
    on_device = functools.partial(Tensor.to, device=device)
    q_dev, kv_dev = q_cells.to(device), kv_cells.to(device)
    merge = functools.partial(
        merge_cells, q_dev, on_device(cell_out.float()), on_device(cell_lse.float())
    )

    def add(dq: Tensor, dk: Tensor, dv: Tensor, start: int, end: int, h0: int, h1: int) -> None:
        add_cells(q_dev, on_device(cell_dq), dq, start, end, h0, h1)
        for grad, cell_grad in zip((dk, dv), cell_dkv, strict=True):
            add_cells(kv_dev, on_device(cell_grad), grad, start, end, h0 // 2, h1 // 2)

    for dtype in dtypes:
        q, k, v, dout = (x.to(device, dtype) for x in (q0, k0, v0, dout0))
        options = {"is_causal": is_causal, "scale": dim**-0.5}
        out, lse = fused.fused_forward(q, k, v, None, branches, backend, extra=merge, **options)
        exact = [x.to(dtype).double() for x in (q0, k0, v0)]
        want, want_lse = oracle_dilated_attention(*exact, segs, rates, is_causal=is_causal)
        rows, cell_heads = q_cells.rows, q_cells.heads
        old_lse = want_lse[:, cell_heads, rows]
        new_lse = torch.logaddexp(old_lse, cell_lse)
        want[:, rows, cell_heads] = want[:, rows, cell_heads] * (old_lse - new_lse).exp().unsqueeze(
            -1
        ) + cell_out * (cell_lse - new_lse).exp().unsqueeze(-1)
        want_lse[:, cell_heads, rows] = new_lse
        tol = TOLERANCES[dtype]
        torch.testing.assert_close(out.cpu().double(), want, atol=tol.atol, rtol=tol.rtol)
        torch.testing.assert_close(lse.cpu().double(), want_lse, atol=tol.atol, rtol=tol.rtol)
        plain = fused.fused_backward(dout, q, k, v, out, lse, None, branches, backend, **options)
        grads = fused.fused_backward(
            dout, q, k, v, out, lse, None, branches, backend, extra=add, **options
        )
        added = [cell_dq, *cell_dkv]
        for got, base_grad, cells, extra_grad in zip(
            grads, plain, (q_cells, kv_cells, kv_cells), added, strict=True
        ):
            want_grad = base_grad.cpu().double()
            want_grad[:, cells.rows, cells.heads] += extra_grad.double()
            torch.testing.assert_close(
                got.cpu().double(), want_grad, atol=tol.grad_atol, rtol=tol.grad_rtol
            )


@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_heads_major_views_run_without_copies(
    device: str, dtypes: list[torch.dtype], monkeypatch: pytest.MonkeyPatch
) -> None:
    """(B, N, H, D) views of (B, H, N, D) tensors (how transformers passes them) run on the fused
    kernels as they are: the results match the oracle, no input is copied whole, and the
    gradients come back in the views' layout."""
    skip_without_triton(device)
    copies: list[tuple[int, ...]] = []
    real = torch.Tensor.contiguous

    def spy(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if not x.is_contiguous() and x.dim() == 4:
            copies.append(tuple(x.shape))
        return real(x, *args, **kwargs)

    shape = Shape("heads_major", N=300, H=4, H_kv=2, D=64, segments=(100, 300), rates=(1, 2))
    for dtype in dtypes:
        for is_causal in (False, True):
            monkeypatch.setattr(torch.Tensor, "contiguous", spy)
            _compare(shape, dtype, device, is_causal, heads_major=True)
            monkeypatch.setattr(torch.Tensor, "contiguous", real)
    big = {(shape.B, shape.N, h, shape.D) for h in (shape.H, shape.H_kv)}
    assert not big & set(copies), copies


@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_64_bit_row_offsets(
    device: str, dtypes: list[torch.dtype], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ``WIDE`` variant (64-bit offsets, used past 2**31 elements) on a small shape."""
    skip_without_triton(device)
    kernels = triton_backend._kernels()
    monkeypatch.setattr(kernels, "_wide", lambda *args: True)
    shape = Shape("wide", N=200, H=4, H_kv=2, D=32, segments=(40, 200), rates=(1, 3), padding=True)
    for dtype in dtypes:
        for is_causal in (False, True):
            _compare(shape, dtype, device, is_causal)


def test_skips_for_a_missing_triton_package_say_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CPU wheels of torch come without ``triton``: the skip says to install it (and how the
    kernels then run on a CPU), not only that the import failed."""
    monkeypatch.setattr(support.triton, "triton_installed", lambda: False)
    message = r"triton is not installed: pip install triton .*TRITON_INTERPRET=1"
    with pytest.raises(pytest.skip.Exception, match=message):
        require_triton()
    for device in ("cpu", "cuda"):
        with pytest.raises(pytest.skip.Exception, match=message):
            skip_without_triton(device)


def test_descriptor_rows_only_where_the_layout_allows() -> None:
    """Tensor descriptors need 16-bit data, 16-byte aligned base and positive strides, and a
    length the rate divides; anything else reads through pointers."""
    require_triton()
    view_ok = triton_backend._kernels()._descriptor_view_ok
    x = torch.zeros(1, 64, 4, 32, dtype=torch.float16)
    assert view_ok(x, 1) and view_ok(x, 4)
    assert not view_ok(x, 3)  # 64 positions are not whole rows of 3
    assert not view_ok(x.float(), 1)  # not 16-bit
    assert not view_ok(x.flatten()[1 : 1 + 63 * 128].view(1, 63, 4, 32), 1)  # base 2 bytes in
    assert not view_ok(x[:, :, :1].expand(1, 64, 4, 32), 1)  # stride 0 over heads
    assert view_ok(x[:, :, 2:], 1)  # a head slice 128 bytes in


def _recorded_launches(monkeypatch: pytest.MonkeyPatch, **launchers: Any) -> dict[str, Any]:
    """The backend's kernels replaced by ``launchers`` (which record what they are given), each
    call site run at once, and the D = 128 table's tiles with every role's tile told apart by
    its stage count (a table may give two roles the same tile), so a test sees which role a
    launch took; returns those tiles."""
    fake_kernels = SimpleNamespace(
        Branch=lambda *geometry: geometry,
        site_key=lambda *args: args,
        run_bound=lambda site, roles, body, constants=(): body(),
        DESCRIPTOR_POLICY=None,
        **launchers,
    )
    monkeypatch.setattr(triton_backend, "_kernels", lambda: fake_kernels)
    table = triton_backend._tiles(torch.zeros(1, 1, 1, 128, dtype=torch.bfloat16))
    tiles = {role: replace(tile, num_stages=10 + i) for i, (role, tile) in enumerate(table.items())}
    monkeypatch.setattr(triton_backend, "_tiles", lambda x: tiles)
    return tiles


def test_dkdv_tiles_follow_causality_and_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dK/dV launch takes ``dkdv_causal`` tiles when causal, ``dkdv_strided`` at rate > 1
    and ``dkdv`` otherwise (Triton compiles a rate of 1 as a constant;
    ``triton_kernels/tiles.py``)."""
    launched: list[Any] = []
    tiles = _recorded_launches(
        monkeypatch,
        backward_branch=lambda *args, **kwargs: launched.append(kwargs["config_dkdv"]),
    )
    x = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 8)
    backend = get_backend("triton")
    for is_causal, rate in ((False, 1), (False, 2), (True, 1), (True, 4)):
        backend.backward_branch(
            x, x, x, x, lse, lse, None, x, x, x, BranchSpan(0, 8, 8, rate), delta_row0=0,
            grad_row0=0, scale=1.0, is_causal=is_causal, accumulate=True,
        )  # fmt: skip
    expected = ["dkdv", "dkdv_strided", "dkdv_causal", "dkdv_causal"]
    assert launched == [tiles[name] for name in expected]


def test_descriptor_forward_tiles_follow_causality(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward that reads rows through tensor descriptors takes ``forward_descriptors_causal``
    tiles when causal and ``forward_descriptors`` otherwise, in the fused engine's branches and
    in dense calls alike; the pointer forward takes ``forward`` either way
    (``triton_kernels/tiles.py``)."""
    launched: list[tuple[Any, Any]] = []
    tiles = _recorded_launches(
        monkeypatch,
        forward_branch=lambda *args, **kwargs: launched.append(
            (kwargs["config"], kwargs["descriptor_config"])
        ),
    )
    monkeypatch.setattr(triton_backend, "key_splits", lambda *args: 1)
    assert {"forward_descriptors", "forward_descriptors_causal"} <= set(tiles)
    x = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 8)
    backend = get_backend("triton")
    for is_causal in (False, True):
        backend.forward_branch(
            x, x, x, x, lse, None, BranchSpan(0, 8, 8, 2), out_row0=0, scale=1.0,
            is_causal=is_causal, merge=False,
        )  # fmt: skip
        backend._forward(x, x, x, scale=1.0, is_causal=is_causal, key_mask=None, dropout_p=0.0)
    names = ["forward_descriptors"] * 2 + ["forward_descriptors_causal"] * 2
    assert launched == [(tiles["forward"], tiles[name]) for name in names]


# -- split keys (few queries) ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("query_len", "key_len", "heads", "kv_heads", "mask"),
    [
        (1, 1000, 4, 2, None),  # one decoded token, GQA; runs of 1000 / S keys, a short last one
        (1, 777, 2, 2, "per-head"),  # the one-call decoding mask: heads read different keys
        (5, 600, 2, 1, "padding"),  # a few query rows (repeated per run), padded keys
        (16, 513, 1, 1, "per-head"),  # the most rows a split call takes; 513 keys, odd runs
    ],
)
@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_split_key_forward_matches_oracle(
    device: str,
    dtypes: list[torch.dtype],
    query_len: int,
    key_len: int,
    heads: int,
    kv_heads: int,
    mask: str | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call of few query rows against many keys splits its keys into runs merged by one kernel
    (Note [Split keys for few queries]): out and lse equal the float64 oracle's, rows whose keys
    are all masked give 0 and -inf, a key run that is all masked weighs nothing, and the
    NaN-poisoned buffers show no unwritten row."""
    skip_without_triton(device)
    poison_new_buffers(monkeypatch)
    splits = []
    real = triton_backend.key_splits
    monkeypatch.setattr(
        triton_backend, "key_splits", lambda *a: splits.append(real(*a)) or splits[-1]
    )
    dim, gen = 32, torch.Generator().manual_seed(query_len + key_len)
    q = torch.randn(2, query_len, heads, dim, generator=gen)
    k, v = (torch.randn(2, key_len, kv_heads, dim, generator=gen) for _ in "kv")
    ignore = None
    if mask == "padding":
        ignore = torch.rand(2, 1, key_len, generator=gen) < 0.3
        ignore[1, :, : key_len // 2] = True  # a run of keys wholly masked
    elif mask == "per-head":
        ignore = torch.rand(2, heads, key_len, generator=gen) < 0.5
        ignore[0, 0] = True  # a row that sees no key
    backend = get_backend("triton")
    for dtype in dtypes:
        res = backend.forward(
            *(x.to(device, dtype) for x in (q, k, v)), scale=dim**-0.5,
            key_mask=None if ignore is None else ignore.to(device),
        )  # fmt: skip
        assert splits[-1] > 1, "the call was not split"
        weight = torch.ones(2, heads, query_len, key_len, dtype=torch.int64)
        if ignore is not None:
            weight = weight * ~ignore.unsqueeze(2)
        want, want_lse = masked_attention(*(x.to(dtype) for x in (q, k, v)), weight)
        low = masked_attention(*(x.to(dtype) for x in (q, k, v)), weight, compute_dtype=dtype)
        assert_close_to_oracle(res.out.cpu(), want, low[0], name="out", dtype=dtype)
        assert_close_to_oracle(res.lse.cpu(), want_lse, low[1], name="lse", dtype=dtype)


@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_split_key_forward_gradients_match_oracle(
    device: str, dtypes: list[torch.dtype], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through ``attention`` (one query row against 1,000 keys, GQA, padded keys, a run of keys
    wholly masked) the split forward's merged out and lse feed the backward: every gradient
    equals the float64 oracle's."""
    from dilated_attention import attention

    skip_without_triton(device)
    splits: list[int] = []
    real = triton_backend.key_splits
    monkeypatch.setattr(
        triton_backend, "key_splits", lambda *a: splits.append(real(*a)) or splits[-1]
    )
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(2, 1, 4, 32, generator=gen)
    k, v = (torch.randn(2, 1000, 2, 32, generator=gen) for _ in "kv")
    dout = torch.randn(2, 1, 4, 32, generator=gen)
    mask = torch.rand(2, 1000, generator=gen) < 0.3
    mask[1, :500] = True
    weight = torch.ones(2, 4, 1, 1000, dtype=torch.int64) * ~mask[:, None, None, :]
    for dtype in dtypes:
        leaves = [x.to(device, dtype).requires_grad_() for x in (q, k, v)]
        out = attention(*leaves, key_padding_mask=mask.to(device), backend="triton")
        assert splits[-1] > 1, "the call was not split"
        grads = torch.autograd.grad(out, leaves, dout.to(device, dtype))
        results = []
        for cdt in (torch.float64, dtype):
            ref = [x.to(dtype).to(cdt).requires_grad_() for x in (q, k, v)]
            want, _ = masked_attention(*ref, weight, compute_dtype=cdt)
            results.append((want, torch.autograd.grad(want, ref, dout.to(dtype).to(cdt))))
        (want, want_grads), (low, low_grads) = results
        assert_close_to_oracle(out.detach().cpu(), want, low, name="out", dtype=dtype)
        for name, got, ref, same in zip("qkv", grads, want_grads, low_grads, strict=True):
            assert_close_to_oracle(got.cpu(), ref, same, name=f"d{name}", dtype=dtype, grad=True)


@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_split_key_forward_carries_nan(device: str, dtypes: list[torch.dtype]) -> None:
    """A NaN key in one run makes the rows that read it NaN (out and lse), not a finite mix of
    the other runs (Note [NaN through the kernels])."""
    skip_without_triton(device)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 1, 2, 32, generator=gen)
    k, v = (torch.randn(1, 1024, 1, 32, generator=gen) for _ in "kv")
    k[0, 900] = float("nan")
    for dtype in dtypes:
        res = get_backend("triton").forward(*(x.to(device, dtype) for x in (q, k, v)), scale=1.0)
        assert triton_backend.key_splits(q.to(device), 1024, False) > 1
        assert bool(res.out.isnan().all()) and bool(res.lse.isnan().all())


def test_key_splits_only_for_few_non_causal_rows_that_leave_the_gpu_idle() -> None:
    """Causal calls, calls of more than ``SPLIT_KEY_ROWS`` rows, calls with too few keys and
    calls whose (head, batch) programs already fill the GPU are not split; a split leaves no
    empty run."""
    require_triton()
    splits = triton_backend.key_splits
    one = torch.zeros(1, 1, 2, 8)
    assert splits(one, 4096, True) == 1
    assert splits(torch.zeros(1, triton_backend.SPLIT_KEY_ROWS + 1, 2, 8), 4096, False) == 1
    assert splits(one, triton_backend.SPLIT_MIN_KEYS, False) == 1
    busy = torch.zeros(triton_backend.SPLIT_PROGRAMS_INTERPRETED, 1, 1, 8)
    assert splits(busy, 4096, False) == 1
    for key_len in (256, 1000, 1025, 4096):
        count = splits(one, key_len, False)
        run = -(-key_len // count)
        assert count > 1 and (count - 1) * run < key_len, (key_len, count)


# -- poisoned buffers ------------------------------------------------------------------------------
@pytest.mark.parametrize("row_loads", ROW_LOADS)
@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_rows_of_the_next_segment_never_leak_into_a_segment(
    row_loads: str, device: str, dtypes: list[torch.dtype], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tile of key rows may run past a head's last row into the next segment (Note [Rows
    through tensor descriptors]). With k and v NaN at one position, exactly the rows that attend
    to it may turn NaN: segment 0's heads whose tiles read that position past their end stay
    finite."""
    skip_without_triton(device)
    used = _force_row_loads(monkeypatch, row_loads)
    seq_len, heads, dim, segment, rate, poisoned = 300, 3, 32, 100, 3, 101
    attends = torch.zeros(seq_len, heads, dtype=torch.bool)
    for h in range(heads):
        for positions in branch_positions(seq_len, segment, rate, h):
            if poisoned in positions:
                attends[positions, h] = True
    gen = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        q, k, v = (torch.randn(1, seq_len, n, dim, generator=gen) for n in (heads, 1, 1))
        k[:, poisoned] = v[:, poisoned] = float("nan")
        out = dilated_attention(
            *(x.to(device, dtype) for x in (q, k, v)), [segment], [rate], backend="triton"
        )
        assert torch.equal(out[0].isnan().any(-1).cpu(), attends), dtype
    assert any(used) == (row_loads == "descriptors")


def _covered(seq_len: int, heads: int, segment: int, rate: int) -> Tensor:
    """(N, H) bool: which (position, head) rows the branch covers (from the oracle's geometry)."""
    covered = torch.zeros(seq_len, heads, dtype=torch.bool)
    for h in range(heads):
        for positions in branch_positions(seq_len, segment, rate, h):
            covered[positions, h] = True
    return covered


@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_kernels_write_exactly_the_covered_rows(device: str, dtypes: list[torch.dtype]) -> None:
    """NaN-filled outputs: every covered row becomes finite, every other row stays NaN."""
    skip_without_triton(device)
    backend = get_backend("triton")
    seq_len, heads, kv_heads, dim, segment, rate = 50, 6, 3, 32, 16, 3
    span = BranchSpan(0, seq_len, segment, rate)
    covered_q = _covered(seq_len, heads, segment, rate)
    covered_kv = covered_q.view(seq_len, kv_heads, heads // kv_heads).any(-1)
    for dtype in dtypes:
        q = torch.randn(1, seq_len, heads, dim, device=device, dtype=dtype)
        k = torch.randn(1, seq_len, kv_heads, dim, device=device, dtype=dtype)
        v, dout = torch.randn_like(k), torch.randn_like(q)
        out = torch.full(q.shape, float("nan"), device=device, dtype=torch.float32)
        lse = torch.full((1, heads, seq_len), float("nan"), device=device)
        for is_causal in (False, True):
            backend.forward_branch(
                q, k, v, out, lse, None, span, out_row0=0, scale=0.2, is_causal=is_causal,
                merge=False,
            )  # fmt: skip
            assert torch.equal(out[0].isfinite().all(-1).cpu(), covered_q)
            assert torch.equal(lse[0].isfinite().t().cpu(), covered_q)
            grads = [torch.full(x.shape, float("nan"), device=device) for x in (q, k, v)]
            delta = torch.empty(1, heads, seq_len, device=device)
            backend.row_delta(out.to(dtype), dout, 0, seq_len, delta)
            backend.backward_branch(
                dout, q, k, v, lse, delta, None, *grads, span, delta_row0=0, grad_row0=0,
                scale=0.2, is_causal=is_causal, accumulate=False,
            )  # fmt: skip
            dq, dk, dv = (g[0].isfinite().all(-1).cpu() for g in grads)
            assert torch.equal(dq, covered_q)
            assert torch.equal(dk, covered_kv) and torch.equal(dv, covered_kv)


@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_fused_gradients_under_create_graph_are_the_kernels_gradients(
    device: str, dtypes: list[torch.dtype]
) -> None:
    """Under ``create_graph=True`` the fused path recomputes its gradients differentiably from
    the schedule's row groups (Note [Double backward]); they must be the kernels' own."""
    skip_without_triton(device)
    gen = torch.Generator().manual_seed(3)
    mask = torch.zeros(2, 41, dtype=torch.bool)
    mask[1, -6:] = True
    dtype = dtypes[0]
    shapes = [(2, 41, 4, 16), (2, 41, 2, 16), (2, 41, 2, 16)]
    leaves = [torch.randn(s, generator=gen).to(device, dtype).requires_grad_() for s in shapes]
    dout = torch.randn(shapes[0], generator=gen).to(device, dtype)
    mask = mask.to(device)

    def grads(create_graph: bool) -> tuple[Tensor, ...]:
        out = dilated_attention(
            *leaves, [8, 24], [1, 3], is_causal=True, key_padding_mask=mask, backend="triton"
        )
        return torch.autograd.grad(out, leaves, dout, create_graph=create_graph)

    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for kernel, recomputed in zip(grads(False), grads(True), strict=True):
        torch.testing.assert_close(recomputed.float(), kernel.float(), **tol)


# -- first calls -----------------------------------------------------------------------------------
@pytest.mark.gpu
def test_a_new_shape_family_compiles_only_ahead_and_a_new_length_not_at_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every kernel of a family's first call is compiled by ``compile_ahead`` (in parallel)
    before anything launches; the launches then compile nothing, nor does a new length."""
    skip_without_triton("cuda")
    from triton import knobs

    kernels = triton_backend._kernels()
    ahead = {"active": False}
    compiled_outside: list[str] = []
    compile_launches = kernels.compile_launches

    def recording(*args: Any, **kwargs: Any) -> None:
        ahead["active"] = True
        try:
            compile_launches(*args, **kwargs)
        finally:
            ahead["active"] = False

    def hook(**kwargs: Any) -> None:
        if not ahead["active"]:
            compiled_outside.append(getattr(kwargs.get("fn"), "name", "?"))

    monkeypatch.setattr(kernels, "compile_launches", recording)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", hook)
    for seq_len in (777, 1000):  # a family no other test uses: H = 6, Hkv = 3, D = 48
        q = torch.randn(1, seq_len, 6, 48, device="cuda", dtype=torch.float16, requires_grad=True)
        k, v = (
            torch.randn(1, seq_len, 3, 48, device="cuda", dtype=torch.float16, requires_grad=True)
            for _ in "kv"
        )
        mask = torch.zeros(1, seq_len, dtype=torch.bool, device="cuda")
        out = dilated_attention(
            q, k, v, [128, 256], [1, 2], is_causal=True, key_padding_mask=mask, backend="triton"
        )
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        assert compiled_outside == [], (seq_len, compiled_outside)
