"""From how many positions a dilated call runs on the kernel that writes into branch slots.

Note [The measured slots table]
    On sm90 a dilated call whose branches write into slots (Note [Branch slots merged once] in
    ``core/geometry/slots.py``) has two fast paths: FlashAttention-4 writing into the slots, and our
    fused Triton kernels. Which is faster depends on the length, the head dim, causality, whether
    the call needs gradients (forward only, or forward and backward) and whether key/value heads are
    shared (GQA): FlashAttention-4's Python interface costs about half a millisecond a call, and a
    plan cut into position groups to bound its memory makes more calls, so FlashAttention-4 wins
    from some length on, a different one per cell. ``slots_thresholds.json`` beside this module
    holds, per device class and cell, the shortest measured length from which FlashAttention-4
    was faster, by a margin, at that length and at every longer one measured (``null``: at
    none). Each time is the median over several benchmark processes: FlashAttention-4's times
    near the thresholds move by up to 2x between processes, so one run's table would follow
    the noise. It is written by ``benchmarks/tune_dilated_choice.py`` from ``bench_dilated.py``
    records, which it names beside the medians it read; nothing here is edited by hand. A head
    dim takes the cell of the smallest measured head dim at least as large.

    FlashAttention-4's slotted calls replay from CUDA graphs once a call repeats at the same
    addresses (Note [A slotted call's launches from a CUDA graph] in
    ``core/execution/executor.py``), which removes the host time that decided below 128K tokens:
    ``min_query_len`` is measured so (at 8K-256K; the older records, whose FlashAttention-4
    times include that host time, at the lengths the newer ones did not measure), and
    ``min_query_len_without_graphs``, from the older records alone, applies where
    ``DILATED_ATTENTION_CUDA_GRAPHS=0`` turns the graphs off. A call at addresses that never
    repeat runs FlashAttention-4's calls one by one, as without graphs.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any

from ..core.execution import graphs
from .base import KernelInputs

#: The table file, beside this module (package data).
TABLE_FILE = "slots_thresholds.json"


@functools.cache
def table() -> dict[str, Any]:
    """The measured table (Note [The measured slots table]), read once."""
    package = resources.files(__name__.rpartition(".")[0])
    return json.loads(package.joinpath(TABLE_FILE).read_text(encoding="utf-8"))


def cell_key(kv_shared: bool, training: bool, head_dim: int, causal: bool) -> str:
    """A cell's name in the table: ``"gqa/training/d128/causal"``, ``"mha/forward/d64/full"``."""
    return "/".join(
        ("gqa" if kv_shared else "mha", "training" if training else "forward", f"d{head_dim}",
         "causal" if causal else "full")
    )  # fmt: skip


@functools.cache
def _head_dims(major: int) -> tuple[int, ...]:
    """The head dims measured on ``major``, ascending (none where the major has no table)."""
    cells = table()["majors"].get(str(major), {})
    return tuple(sorted({int(key.split("/")[2][1:]) for key in cells}))


def min_query_len(major: int, inputs: KernelInputs) -> int | None:
    """The positions from which ``inputs`` run on the slots kernel on compute capability
    ``major`` (Note [The measured slots table]); None where no length was measured faster, the
    head dim is above every measured one, or the major has no table."""
    dim = next((d for d in _head_dims(major) if d >= inputs.head_dim), None)
    if dim is None:
        return None
    shared = inputs.num_kv_heads < inputs.num_heads
    key = cell_key(shared, inputs.requires_grad, dim, inputs.is_causal)
    entry = table()["majors"][str(major)].get(key)
    return None if entry is None else entry[_column()]


def _column() -> str:
    """The thresholds that apply now: with the graphs, or without (the environment's say)."""
    return "min_query_len" if graphs.enabled() else "min_query_len_without_graphs"


def shortest(major: int) -> int | None:
    """The shortest length from which any cell of ``major`` runs on the slots kernel."""
    column = _column()
    lengths = [c[column] for c in table()["majors"].get(str(major), {}).values()]
    found = [n for n in lengths if n is not None]
    return min(found) if found else None
