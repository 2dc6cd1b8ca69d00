"""Tile sizes of our Triton kernels per compute capability, head dim and dtype.

Data and lookups only (no ``triton`` import): ``backends/triton.py`` picks a kernel's tiles
here, ``benchmarks/tune_triton.py`` measures them and ``benchmarks/check_tile_fit.py`` checks
that every table fits its GPUs' shared memory.

Note [Tile tables]
    Tiles are chosen from tables measured ahead, never autotuned at run time (an autotuner
    compiles and times every candidate on a call's first use: tens of seconds). A table holds,
    per dtype and head dim, one :class:`TileConfig` per kernel role:

    - ``forward``, ``dq``: the forward and dQ kernels;
    - ``forward_descriptors``, ``forward_descriptors_causal``: the forward when it reads rows
      through tensor descriptors (Hopper or newer only; Note [Rows through tensor descriptors]
      in ``triton_kernels/launchers.py``), and when such a forward is causal
      (:func:`descriptor_forward_config`);
    - ``dkdv``, ``dkdv_causal``, ``dkdv_strided``: the dK/dV kernel at rate 1, when causal,
      and at rate > 1 (:func:`dkdv_config`).

    sm90 is measured on an H100 (the numbers below). Other capabilities have not been timed
    here; their tables keep sm90's tiles where those fit the GPU's shared memory, and otherwise
    the nearest tile that fits (fewer pipeline stages first, then smaller tiles), checked by
    compiling every kernel of a dilated schedule for that capability
    (``benchmarks/results/tile_fit_h200.json``). A capability without a table of its own takes
    the table of the nearest lower one (the smallest table below all of them).

    sm90, float32: 32x32 tiles with 4 warps and 2 stages for every kernel and head dim up to
    128. The 16-bit tiles hold twice the bytes per element in float32 and spill: forward+backward
    of four causal branches at N = 16,384, H = 8, D = 64 took 46.8 ms with them against 10.0 ms
    with 32x32 (64x32: 37.7 ms, 32x64: 27.9 ms). With "tf32x3" products (Note [float32 products]
    in ``triton_kernels/launchers.py``) 32x32 is still best: 4.1 ms against 7.0 ms for 64x32 and
    10.9 ms for 64x64, whose slowest kernels also compile for 5.9 and 9.6 s against 3.2 s.

    sm90, 16-bit, D <= 64, from ``benchmarks/tune_triton.py`` (N = 64K, LongNet schedule:
    forward 64x64 3.77 ms vs 128x64 3.86 and 128x128 5.35; dK/dV 32x64 14.1 ms vs 64x64 14.7).
    D <= 128 from the same script at N = 128K (``benchmarks/results/tune_triton_h100.json``:
    forward 128x64 11.4 ms, within noise of the best; dK/dV 64x64 with 4 warps 49.4 ms and dQ
    128x64 with 8 warps 49.5 ms, forward+backward, against 52-74 ms for 8-warp dK/dV tiles).
    Larger head dims: chosen offline for few register spills (ptxas -v for sm90), not swept.

    sm90 ``dkdv_causal`` / ``dkdv_strided``: from single-branch launches at N = 256K
    (``benchmarks/results/findings_h100.json``, "dK/dV tiles per causality and rate"). Triton
    compiles a rate of 1 as a constant, and that specialisation needs fewer registers: at
    D = 128 the 64x64 tile with 2 stages is best there (17.3 ms against 24.4 for 32x64 at
    w = 2048), while at rate > 1 or causal it spills and 32x64 tiles are 13-28% faster. At
    D = 64 the causal kernel is 13% faster with 64x64 at rate 1 and equal elsewhere.

    sm90 ``forward_descriptors``: from the tile sweep of single-branch launches
    (``benchmarks/results/tma_forward_h100.md``): at D = 128, 128x128 with 8 warps and 3 stages
    is best or within 3% of the best on 7 of 8 branch shapes; at D = 64, 128x64 with 4 warps is
    the one tile good everywhere (0.84-0.94x cuDNN; 8 warps reach 0.96x non-causal but drop to
    0.62x causal).

    sm90 ``forward_descriptors_causal`` and ``dkdv_causal`` at D = 128: from sweeps of
    LongNet's schedule at 4K-256K, calls back to back (``benchmarks/tune_triton.py --schedule
    longnet --steady``, records ``tune_triton_causal_h200``, ``tune_triton_causal4k_h200`` and
    ``tune_triton_noncausal_h200``, and ``findings_h200.json``, "Triton tiles at short
    lengths"; an H200, whose SMs and clocks are the H100's). The 64x64 forward tile with 4 warps
    and 3 stages, which the sweep above did not try, ran causal calls 1.11-1.16x faster than
    128x128 at 4K-64K and 1.04-1.06x at 256K; non-causal ones 0.97-1.07x, so they keep 128x128.
    The causal dK/dV tile with 3 stages instead of 2 was 0-2% faster at every length.

    GQA (16 query heads over 4 key/value heads), causal, D = 128, LongNet's schedule at 8K and
    32K (record ``tune_triton_gqa_h200``, tiles still launched in index order, before Note
    [Heavy tiles first] in ``triton_kernels/device.py``): every dK/dV and dQ candidate was
    slower than the table's tiles or within 1% of them, so GQA keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes and launch options of one kernel."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


Tiles = dict[str, TileConfig]
#: Rows of a table: (dtype class, largest head dim, tiles); the first row that matches is used.
#: The dtype class is ``"float32"``, ``"16-bit"`` or ``"any"``.
Table = tuple[tuple[str, int, Tiles], ...]

_T = TileConfig


def _uniform(tile: TileConfig) -> Tiles:
    return {"forward": tile, "dkdv": tile, "dq": tile}


#: sm90 (H100, 227 KB of shared memory per block): measured (Note [Tile tables]).
SM90: Table = (
    ("float32", 128, _uniform(_T(32, 32, 4, 2))),
    ("16-bit", 64, {
        "forward": _T(64, 64, 4, 3),
        "forward_descriptors": _T(128, 64, 4, 3),
        "dkdv": _T(32, 64, 4, 3),
        "dkdv_causal": _T(64, 64, 4, 2),
        "dq": _T(64, 64, 4, 3),
    }),
    ("16-bit", 128, {
        "forward": _T(128, 64, 8, 3),
        "forward_descriptors": _T(128, 128, 8, 3),
        "forward_descriptors_causal": _T(64, 64, 4, 3),
        "dkdv": _T(64, 64, 4, 2),
        "dkdv_causal": _T(32, 64, 4, 3),
        "dkdv_strided": _T(32, 64, 4, 3),
        "dq": _T(128, 64, 8, 3),
    }),
    ("any", 256, {
        "forward": _T(64, 32, 4, 2),
        "dkdv": _T(32, 32, 4, 2),
        "dq": _T(32, 32, 4, 2),
    }),
)  # fmt: skip


def _with(table: Table, tiles: Tiles) -> Table:
    """``table`` with ``tiles`` in place of its 16-bit D <= 128 row's entries of those roles."""
    return tuple(
        (kind, dim, {**row, **tiles}) if kind == "16-bit" and dim == 128 else (kind, dim, row)
        for kind, dim, row in table
    )


#: sm86 (RTX 30xx, A10, A40; sm89 takes it too: 99 KB of shared memory per block): sm90's tiles
#: but the dQ tile at D <= 128, whose 3 stages take 128 KB there; 2 stages take 96 KB. Not timed
#: (Note [Tile tables]).
SM86: Table = _with(SM90, {"dq": _T(128, 64, 8, 2)})

#: sm120 (RTX 50xx, 99 KB of shared memory per block): sm86's tiles but the descriptor forward
#: at D <= 128, whose 128x128 tiles with 3 stages take 192 KB there; 64x64 with 2 stages is the
#: first that fits (64 KB). The causal one's 64x64 tiles with 3 stages fit (96 KB). Not timed
#: (Note [Tile tables]).
SM120: Table = _with(SM86, {"forward_descriptors": _T(64, 64, 4, 2)})

#: Tables per compute capability (Note [Tile tables]). sm80 (163 KB) and sm100 (227 KB) fit
#: every sm90 tile (``benchmarks/results/tile_fit_h200.json``).
TABLES: dict[tuple[int, int], Table] = {
    (8, 0): SM90,
    (8, 6): SM86,
    (9, 0): SM90,
    (10, 0): SM90,
    (12, 0): SM120,
}


def table_for(capability: tuple[int, int] | None) -> Table:
    """The table of ``capability``: its own, else the nearest lower capability's, else the
    lowest one's. ``None`` (Triton's CPU interpreter) takes sm90's."""
    if capability is None:
        return SM90
    known = sorted(TABLES)
    lower = [c for c in known if c <= capability]
    return TABLES[lower[-1] if lower else known[0]]


def tile_configs(capability: tuple[int, int] | None, head_dim: int, dtype: torch.dtype) -> Tiles:
    """Tiles per kernel role for a GPU of ``capability``, a head dim and a dtype."""
    kind = "float32" if dtype == torch.float32 else "16-bit"
    for row_kind, max_dim, tiles in table_for(capability):
        if row_kind in (kind, "any") and head_dim <= max_dim:
            return tiles
    raise ValueError(f"no Triton tiles for head dim {head_dim} (largest: 256)")


#: Query rows of the split-key forward's tile (:func:`split_key_config`).
SPLIT_KEY_ROWS = 16

#: The most programs a launch grid holds along y and along z (x holds 2**31 - 1): the fused
#: engine's branch and row-delta launches, the slot merges and the block-sparse kernels put the
#: batch rows on one of them (a static cache's decode step puts them on x).
MAX_GRID_Y = 2**16 - 1


def split_key_config(tiles: Tiles) -> TileConfig:
    """The tiles of the split-key forward (at most ``SPLIT_KEY_ROWS`` query rows, Note [Split
    keys for few queries] in ``triton.py``): 16 query rows with the forward's key tile and
    pipeline stages and 4 warps; it needs less shared memory than the forward's tile, so it fits
    wherever that one does. Not swept (Note [Tile tables])."""
    forward = tiles["forward"]
    return TileConfig(SPLIT_KEY_ROWS, forward.block_n, 4, forward.num_stages)


def descriptor_forward_config(tiles: Tiles, *, is_causal: bool) -> TileConfig | None:
    """The forward's tiles when it reads rows through tensor descriptors:
    ``forward_descriptors_causal`` when causal, else ``forward_descriptors`` (``None`` where the
    table has neither: the pointer forward's tiles)."""
    if is_causal and "forward_descriptors_causal" in tiles:
        return tiles["forward_descriptors_causal"]
    return tiles.get("forward_descriptors")


def dkdv_config(tiles: Tiles, *, is_causal: bool, rate: int) -> TileConfig:
    """The dK/dV tiles for a launch: ``dkdv_causal``, ``dkdv_strided`` (rate > 1) or
    ``dkdv``."""
    if is_causal:
        return tiles.get("dkdv_causal", tiles["dkdv"])
    if rate > 1:
        return tiles.get("dkdv_strided", tiles["dkdv"])
    return tiles["dkdv"]


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host-side grids and row counts (``triton.cdiv`` is a constexpr
    function whose host call costs microseconds per launch)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two >= ``n`` (``n >= 1``), on the host."""
    return 1 << max(0, n - 1).bit_length()
