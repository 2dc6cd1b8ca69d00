"""The Triton tile tables (``backends/triton_kernels/tiles.py``): which table a GPU gets, that every
row covers every head dim the backend accepts, and that the committed fit check
(``benchmarks/check_tile_fit.py``) was run on the tables as they are now and found every tile
fitting its GPUs' shared memory. No GPU or Triton needed."""

from __future__ import annotations

import json

import pytest
import torch
from support import REPO

from dilated_attention.backends.triton import TritonBackend
from dilated_attention.backends.triton_kernels.tiles import (
    SM90,
    SM120,
    TABLES,
    TileConfig,
    table_for,
    tile_configs,
)

RECORD = REPO / "benchmarks" / "results" / "tile_fit_h200.json"


@pytest.mark.parametrize(
    ("capability", "expected"),
    [
        (None, SM90),  # the interpreter
        ((9, 0), SM90),
        ((12, 0), SM120),
        ((12, 1), SM120),  # nearest lower
        ((8, 9), TABLES[(8, 6)]),
        ((7, 5), TABLES[min(TABLES)]),  # below every table: the lowest
    ],
)
def test_a_gpu_takes_its_own_table_else_the_nearest_lower(
    capability: tuple[int, int] | None, expected: object
) -> None:
    assert table_for(capability) is expected


@pytest.mark.parametrize("capability", sorted(TABLES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_every_table_covers_every_head_dim_the_backend_accepts(
    capability: tuple[int, int], dtype: torch.dtype
) -> None:
    for head_dim in range(1, TritonBackend.max_head_dim + 1):
        tiles = tile_configs(capability, head_dim, dtype)
        assert {"forward", "dkdv", "dq"} <= set(tiles)
        for tile in tiles.values():
            assert isinstance(tile, TileConfig)
            for block in (tile.block_m, tile.block_n):
                assert block >= 16 and block & (block - 1) == 0
            assert tile.num_warps in (4, 8) and tile.num_stages >= 1
    with pytest.raises(ValueError, match="head dim 257"):
        tile_configs(capability, 257, dtype)


def test_the_committed_fit_check_covers_the_tables_as_they_are() -> None:
    """Re-run ``benchmarks/check_tile_fit.py`` on a GPU after changing a table."""
    rows = json.loads(RECORD.read_text())["results"]
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    checked = set()
    for row in rows:
        capability = (int(row["capability"][2:-1]), int(row["capability"][-1]))
        tiles = tile_configs(capability, row["head_dim"], dtypes[row["dtype"]])
        tile = tiles[row["role"]]
        assert row["tile"] == f"{tile.block_m}x{tile.block_n}x{tile.num_warps}x{tile.num_stages}"
        assert row["fits"] is True, row
        checked.add(capability)
    assert set(TABLES) <= checked
