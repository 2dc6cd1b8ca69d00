"""Check that the Triton tile tables fit each compute capability's shared memory.

For every capability with a table in ``dilated_attention/backends/triton_kernels/tiles.py`` (and the
GPUs that share it), every dtype and head-dim row: record the kernels of a causal and a
non-causal dilated schedule (rates 1 to 16), compile each for that capability (no launch, so one
GPU of any kind compiles for all of them) and compare the shared memory Triton reports with what
a block may use there. ``--propose`` instead walks each role's candidates (the sm90 tile, then
fewer pipeline stages, then smaller tiles) and reports the first that fits: how the tables of
capabilities not timed here were made (Note [Tile tables]).

    python benchmarks/check_tile_fit.py  # -> benchmarks/results/tile_fit_<device>.{json,md}
    python benchmarks/check_tile_fit.py --propose 86 120  # print candidate tables
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import environment, markdown_table, record_header, record_path, write_record

from dilated_attention.backends import get_backend
from dilated_attention.backends import triton as triton_backend
from dilated_attention.backends.triton_kernels.compile import answer_device_queries
from dilated_attention.backends.triton_kernels.tiles import (
    SM90,
    TABLES,
    TileConfig,
    Tiles,
    table_for,
    tile_configs,
)
from dilated_attention.core.autograd import Inputs
from dilated_attention.core.execution.fused_runner import FusedRunner

#: Shared memory a block may use (opt-in bytes) per capability checked, and the GPUs with it.
SHARED_MEMORY = {
    (8, 0): (166912, "A100, A30"),
    (8, 6): (101376, "RTX 30xx, A10, A40 (sm89 L4, L40, RTX 40xx: same limit and instructions)"),
    (9, 0): (232448, "H100, H200"),
    (10, 0): (232448, "B200, GB200"),
    (12, 0): (101376, "RTX 50xx, RTX PRO 6000"),
}
#: (dtype, head dim) rows checked: one per table row.
SHAPES = [
    (torch.float32, 64), (torch.float32, 128), (torch.bfloat16, 64), (torch.bfloat16, 128),
    (torch.bfloat16, 256),
]  # fmt: skip
BRANCHES = ((512, 1), (1024, 2), (2048, 4), (4096, 16))
SEQ_LEN, HEADS = 4096, 4

_LAUNCHES: list[Any] = []  # read by forked compile workers


def _role(launch: Any) -> str | None:
    """The table role a recorded launch's tiles came from (``None``: a kernel without tiles)."""
    name = getattr(launch.kernel, "fn", launch.kernel).__name__
    kwargs = dict(launch.kwargs)
    if name == "_forward_kernel":
        if not any(hasattr(a, "block_shape") for a in launch.args):
            return "forward"
        return "forward_descriptors_causal" if kwargs["CAUSAL"] else "forward_descriptors"
    if name == "_dq_kernel":
        return "dq"
    if name == "_dkdv_kernel":
        rate = launch.args[launch.kernel.arg_names.index("rate")]
        return "dkdv_causal" if kwargs["CAUSAL"] else "dkdv_strided" if rate > 1 else "dkdv"
    return None


def _key(tiles: Tiles, role: str) -> str:
    """The table entry a role's tiles come from (a missing variant falls back to its base)."""
    if role in tiles:
        return role
    if role.startswith("dkdv"):
        return "dkdv"
    return "forward_descriptors" if role.startswith("forward_") and "forward_descriptors" in tiles \
        else "forward"  # fmt: skip


def _record(capability: tuple[int, int], dtype: torch.dtype, dim: int, tiles: Tiles) -> list:
    """The launches of a causal and a non-causal schedule with ``tiles``, as on ``capability``."""
    from dilated_attention.backends.triton_kernels import launchers as kernels

    recorded: list[Any] = []
    saved = kernels._capability, kernels.compile_launches, triton_backend._tiles
    kernels._capability = lambda index: capability
    kernels.compile_launches = lambda launches, workers=None: recorded.extend(launches)
    triton_backend._tiles = lambda x: tiles
    backend = get_backend("triton")
    try:
        q, k, v = (torch.randn(1, SEQ_LEN, HEADS, dim, device="cuda", dtype=dtype) for _ in "qkv")
        for causal in (False, True):
            backend._families.clear()
            runner = FusedRunner(BRANCHES, backend, causal, dim**-0.5)
            runner.compile_ahead(Inputs(q, k, v, None), needs_grad=True)
    finally:
        kernels._capability, kernels.compile_launches, triton_backend._tiles = saved
    distinct = {launch.specialization(): launch for launch in recorded if _role(launch)}
    return list(distinct.values())


def _compile_shared(args: tuple[int, tuple[int, int]]) -> tuple[int, int | str]:
    """In a forked worker: compile launch ``index`` for ``capability``; its shared memory."""
    from triton.backends.compiler import GPUTarget

    index, capability = args
    answer_device_queries(0, GPUTarget("cuda", capability[0] * 10 + capability[1], 32))
    try:
        return index, int(_LAUNCHES[index].compile().metadata.shared)
    except Exception as exc:
        return index, f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"


def _measure(capability: tuple[int, int], dtype: torch.dtype, dim: int, tiles: Tiles) -> dict:
    """Per table entry: the largest shared memory of its launches, or a compile error."""
    _LAUNCHES[:] = _record(capability, dtype, dim, tiles)
    context = multiprocessing.get_context("fork")
    with context.Pool(min(16, os.cpu_count() or 1)) as pool:
        shared = dict(pool.map(_compile_shared, [(i, capability) for i in range(len(_LAUNCHES))]))
    roles: dict[str, list[int | str]] = {}
    for i, launch in enumerate(_LAUNCHES):
        roles.setdefault(_key(tiles, _role(launch)), []).append(shared[i])
    return {
        role: max(values, key=lambda s: (isinstance(s, str), s if isinstance(s, int) else 0))
        for role, values in roles.items()
    }


def _candidates(tile: TileConfig) -> Iterator[TileConfig]:
    """The tile, then 2 stages, then halved tiles (the larger side first) down to 32x32."""
    yield tile
    m, n, warps = tile.block_m, tile.block_n, tile.num_warps
    if tile.num_stages > 2:
        yield TileConfig(m, n, warps, 2)
    while max(m, n) > 32:
        m, n = (m // 2, n) if m >= n else (m, n // 2)
        warps = 4 if m * n <= 64 * 64 else warps
        yield TileConfig(m, n, warps, 2)


def check(capabilities: list[tuple[int, int]]) -> list[dict[str, Any]]:
    rows = []
    for capability in capabilities:
        limit, gpus = SHARED_MEMORY[capability]
        for dtype, dim in SHAPES:
            tiles = tile_configs(capability, dim, dtype)
            used = _measure(capability, dtype, dim, tiles)
            for role, shared in sorted(used.items()):
                rows.append({
                    "capability": "sm{}{}".format(*capability), "gpus": gpus,
                    "dtype": str(dtype).removeprefix("torch."), "head_dim": dim, "role": role,
                    "tile": "x".join(map(str, vars(tiles[role]).values())),
                    "shared_bytes": shared, "limit_bytes": limit,
                    "fits": isinstance(shared, int) and shared <= limit,
                })  # fmt: skip
                print(rows[-1], flush=True)
    return rows


def propose(capability: tuple[int, int]) -> None:
    """Print, per dtype/head-dim row, the first candidate per role that fits ``capability``."""
    limit, _ = SHARED_MEMORY[capability]
    for dtype, dim in SHAPES:
        base = tile_configs((9, 0), dim, dtype)
        candidates = {role: list(_candidates(tile)) for role, tile in base.items()}
        chosen: dict[str, TileConfig] = {}
        for step in range(max(map(len, candidates.values()))):
            trial = {role: c[min(step, len(c) - 1)] for role, c in candidates.items()}
            trial.update(chosen)
            used = _measure(capability, dtype, dim, trial)
            for role, shared in used.items():
                if role not in chosen and isinstance(shared, int) and shared <= limit:
                    chosen[role] = trial[role]
            if all(role in chosen for role in used):
                break
        print(f"sm{capability[0]}{capability[1]} {dtype} D={dim}: {chosen} (used {used})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--propose", nargs="*", default=None, metavar="SM",
                        help="capabilities to propose tables for, e.g. 86 120")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.propose is not None:
        for sm in args.propose:
            propose((int(sm[:-1]), int(sm[-1])))
        return
    capabilities = sorted(SHARED_MEMORY)
    rows = check(capabilities)
    tables = {f"sm{c[0]}{c[1]}": "sm90" if table_for(c) is SM90 else "own" for c in capabilities}
    notes = (
        "Shared memory per block of every tiled Triton kernel of a causal and a non-causal "
        f"schedule (N = {SEQ_LEN}, H = {HEADS}, branches {list(BRANCHES)}), compiled for each "
        f"capability with the tiles its table gives (tables: {tables}; known: "
        f"{sorted(f'sm{a}{b}' for a, b in TABLES)}); limit = opt-in shared memory per block."
    )
    columns = ["capability", "dtype", "head_dim", "role", "tile", "shared_bytes", "limit_bytes",
               "fits"]  # fmt: skip
    path, env = record_path("tile_fit", args.out), environment()
    write_record(path.with_suffix(".json"), env, rows, columns=columns, notes=notes)
    table = markdown_table(rows, columns)
    path.with_suffix(".md").write_text(record_header(env) + notes + "\n\n" + table + "\n")
    bad = [r for r in rows if not r["fits"]]
    print(markdown_table(rows, columns))
    print(f"{len(bad)} of {len(rows)} do not fit" if bad else "every tile fits")


if __name__ == "__main__":
    main()
