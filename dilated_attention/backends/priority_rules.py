"""The measured backend priorities and the rules that put some kernels first, read from
``priorities.json`` beside this module: per device class (a CUDA compute capability major, or
the host) the ``order`` tried and the ``first`` rules with their thresholds, each entry naming the
benchmark record under benchmarks/results/ that measured it. The registry (``registry.py``)
walks these orders; the rules here only read the table and the call's :class:`KernelInputs`.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any

import torch

from . import slots_thresholds
from .base import KernelInputs

#: The table file, beside this module (package data).
TABLE_FILE = "priorities.json"


@functools.cache
def table() -> dict[str, Any]:
    """The backend priorities and the rules that reorder them, read once from
    ``priorities.json``: per device class (a CUDA compute capability major, or the host) the
    ``order`` tried and the ``first`` rules with their thresholds, each entry with a ``source``
    naming the benchmark record behind it. Not to be modified."""
    package = resources.files(__name__.rpartition(".")[0])
    return json.loads(package.joinpath(TABLE_FILE).read_text(encoding="utf-8"))


def major_key(device: torch.device) -> str:
    """The table's key for a CUDA ``device``: its compute capability major, or for a major the
    table does not list the ``unlisted_major`` fallback (newer or older)."""
    cuda = table()["cuda"]
    major, _ = torch.cuda.get_device_capability(device)
    if str(major) in cuda["majors"]:
        return str(major)
    newer = major > max(int(listed) for listed in cuda["majors"])
    return cuda["unlisted_major"]["newer" if newer else "older"]


def device_class(device: torch.device) -> dict[str, Any]:
    """The table's entry for ``device``: its major's (:func:`major_key`), or the host's."""
    entries = table()
    if device.type != "cuda":
        return entries["host"]
    return entries["cuda"]["majors"][major_key(device)]


def first_rule(entry: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The ``first`` rule ``name`` of a device class's entry, if it has one."""
    return entry.get("first", {}).get(name)


def rule_measured(rule: dict[str, Any] | None, inputs: KernelInputs) -> bool:
    """Whether ``inputs`` lie where ``rule`` was measured: a listed dtype, and a head dim up to
    its ``max_training_head_dim`` when gradients are needed."""
    if rule is None:
        return False
    if "dtypes" in rule and str(inputs.dtype).removeprefix("torch.") not in rule["dtypes"]:
        return False
    limit = rule.get("max_training_head_dim")
    return limit is None or not inputs.requires_grad or inputs.head_dim <= limit


def block_sparse_first(inputs: KernelInputs) -> list[str]:
    """On CUDA: the ``block_sparse`` rule of every major (``priorities.json``: FlashAttention-4's
    block sparsity where it runs, then our block-sparse Triton kernels and FlexAttention, in the
    order measured for training or for calls without gradients); elsewhere the device's list,
    where none of them runs."""
    if inputs.device.type != "cuda":
        return []
    rule = table()["cuda"]["every_major"]["first"]["block_sparse"]
    return list(rule["training" if inputs.requires_grad else "inference"])


def dense_first(inputs: KernelInputs) -> list[str]:
    """The device's ``short_dense`` rule (``priorities.json``; sm90: cuDNN) first for square
    dense kernel calls like those it was measured on (``attention()`` at 4K-8K tokens, where a
    kernel whose Python interface costs more host time ran slower): from its ``min_query_len``
    up to its ``max_query_len`` (``max_training_query_len`` with gradients), in its ``dtypes``,
    up to ``max_heads`` and ``max_head_dim``, with nothing the measured calls lacked (a key
    padding mask, packed documents, a window, soft-capping, sinks); elsewhere the device's
    list."""
    plain = not (inputs.has_mask or inputs.documents or inputs.window or inputs.softcap
                 or inputs.sinks)  # fmt: skip
    if inputs.device.type != "cuda" or inputs.query_len != inputs.key_len or not plain:
        return []
    rule = first_rule(device_class(inputs.device), "short_dense")
    if rule is None or not rule_measured(rule, inputs):  # its dtypes
        return []
    longest = rule["max_training_query_len" if inputs.requires_grad else "max_query_len"]
    measured = (
        rule["min_query_len"] <= inputs.query_len <= longest
        and inputs.num_heads <= rule["max_heads"] and inputs.head_dim <= rule["max_head_dim"]
    )  # fmt: skip
    return list(rule["names"]) if measured else []


def dilated_first(inputs: KernelInputs) -> list[str]:
    """The device's ``dilated_slots`` rule (``priorities.json``; sm90: FlashAttention-4) first
    for dilated calls whose branches write into slots (Note [Branch slots merged once] in
    core/geometry/slots.py), up to its ``max_head_dim``, from the length ``slots_thresholds.json``
    gives the call's cell (Note [The measured slots table] in ``slots_thresholds.py``), where
    bench_dilated measured it faster than our fused Triton kernels; elsewhere the device's list,
    where our fused kernels come first. Where FlashAttention-4 is not installed that is a
    reason, and the fused kernels run. Masked calls keep the ``masked`` rule's kernels first."""
    if inputs.device.type != "cuda" or not inputs.branch_slots or inputs.has_mask:
        return []
    major = major_key(inputs.device)
    rule = first_rule(table()["cuda"]["majors"][major], "dilated_slots")
    if rule is None or inputs.head_dim > rule["max_head_dim"]:
        return []
    least = slots_thresholds.min_query_len(int(major), inputs)
    return [] if least is None or inputs.query_len < least else list(rule["names"])


def puts_slots_first(inputs: KernelInputs) -> bool:
    """Whether the automatic choice puts a kernel that writes into branch slots first for
    ``inputs`` (the device's ``dilated_slots`` rule applies, :func:`dilated_first`)."""
    return bool(dilated_first(inputs))


def float32_share_beside_spanning(device: torch.device) -> float | None:
    """The share of ``device``'s memory that a shard's float32 results may take where its local
    branches write into slots beside branches that span ranks (the ``dilated_slots`` rule's
    ``max_float32_share_beside_spanning``, ``priorities.json``); None where the device has no
    such rule (nothing puts a kernel that writes into slots first)."""
    if device.type != "cuda":
        return None
    rule = first_rule(device_class(device), "dilated_slots")
    return None if rule is None else rule.get("max_float32_share_beside_spanning")


#: The shortest length from which FlashAttention-4 writing into branch slots runs some dilated
#: calls on sm90 ahead of our fused Triton kernels (``slots_thresholds.json``).
FA4_DILATED_MIN_LEN: int | None = slots_thresholds.shortest(9)
