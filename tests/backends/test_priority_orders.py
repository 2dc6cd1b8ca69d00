"""The order the backend registry walks, pinned for a grid of inputs on every device class.

``priority_orders.json`` (next to this file) holds the order each operation's registry
(``registry_for(op).order``) and :func:`~dilated_attention.backends.registry.priority` give on
CUDA compute capability majors 6, 7, 8, 9, 10 and 12 (capability faked, as in test_selection.py)
and on the CPU, for every combination of the fields that rank backends: dtype, key padding mask,
gradients, head dim, branch slots, causality, shared key/value heads and sequence length on both
sides of the FlashAttention-4 thresholds. It was written from the registry as it was before its
priorities moved into ``dilated_attention/backends/priorities.json``; a change to any order
shows up here as a failure naming the inputs, and, if intended, in the diff of the regenerated
file:

    python tests/backends/test_priority_orders.py --write
"""

from __future__ import annotations

import itertools
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from dilated_attention.backends import priority_rules, registry
from dilated_attention.backends.base import KernelInputs

PINNED = Path(__file__).with_name("priority_orders.json")
#: Device classes: "cpu", or "cuda:<capability major>" (12 and 6 lie outside the table's majors).
DEVICES = ("cpu", "cuda:6", "cuda:7", "cuda:8", "cuda:9", "cuda:10", "cuda:12")
DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}
HEAD_DIMS = (64, 128, 256)
#: Either side of the FlashAttention-4 dilated thresholds (``slots_thresholds.json``) and of
#: the ``short_dense`` rule's lengths (``priorities.json``).
LENGTHS = (4095, 4096, 8191, 8192, 16383, 16384, 32767, 32768, 65535, 65536, 131071, 131072,
           262143, 262144, 524287, 524288, 1048576)  # fmt: skip
_PRIORITY_FLAGS = [f"dilated={d}/masked={m}" for d in (False, True) for m in (False, True)]


def _grid() -> list[tuple[str, dict[str, Any]]]:
    """(case name, KernelInputs fields other than the device) for every combination."""
    cases = []
    for dtype, mask, grad, head_dim, slots, n, causal, kv_heads in itertools.product(
        DTYPES, (False, True), (False, True), HEAD_DIMS, (False, True), LENGTHS, (False, True),
        (8, 2),
    ):  # fmt: skip
        name = (
            f"{dtype}/{'mask' if mask else 'nomask'}/{'grad' if grad else 'nograd'}/"
            f"d{head_dim}/{'slots' if slots else 'noslots'}/n{n}/"
            f"{'causal' if causal else 'full'}/kv{kv_heads}"
        )
        fields = dict(
            dtype=DTYPES[dtype], has_mask=mask, requires_grad=grad, head_dim=head_dim,
            branch_slots=slots, query_len=n, key_len=n, num_heads=8, num_kv_heads=kv_heads,
            is_causal=causal,
        )  # fmt: skip
        cases.append((name, fields))
    return cases


def _device(name: str, monkeypatch: pytest.MonkeyPatch) -> torch.device:
    if name == "cpu":
        return torch.device("cpu")
    major = int(name.split(":")[1])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))
    return torch.device("cuda", 0)


def _orders(device_name: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """``{"<operation>/<case>": order}`` and ``{"priority/<flags>": order}`` on one device."""
    device = _device(device_name, monkeypatch)
    out: dict[str, list[str]] = {}
    for operation in registry.OPERATIONS:
        walk = registry.registry_for(operation)
        for case, fields in _grid():
            out[f"{operation}/{case}"] = walk.order(KernelInputs(device=device, **fields))
    for flags in _PRIORITY_FLAGS:
        dilated, masked = (part.endswith("True") for part in flags.split("/"))
        out[f"priority/{flags}"] = registry.priority(device, dilated=dilated, masked=masked)
    return out


def _all_orders() -> dict[str, dict[str, list[str]]]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        return {device: _orders(device, monkeypatch) for device in DEVICES}


def _encode(orders: dict[str, dict[str, list[str]]]) -> str:
    """The pinned file's text: the distinct orders once, then per device and operation the index
    of each case's order, in the grid's order (one line each)."""
    distinct: list[list[str]] = []
    lines = []
    for device, by_case in orders.items():
        groups: dict[str, list[int]] = {}
        for case, order in by_case.items():
            if order not in distinct:
                distinct.append(order)
            groups.setdefault(case.split("/")[0], []).append(distinct.index(order))
        body = ",\n".join(f"  {json.dumps(g)}: {json.dumps(ix)}" for g, ix in groups.items())
        lines.append(f" {json.dumps(device)}: {{\n{body}\n }}")
    listed = ",\n".join(f"  {json.dumps(order)}" for order in distinct)
    cases = ",\n".join(lines)
    return f'{{"orders": [\n{listed}\n],\n"cases": {{\n{cases}\n}}}}\n'


def _decode(pinned: dict[str, Any], device: str) -> dict[str, list[str]]:
    """``{"<operation>/<case>": order}`` of one device from the pinned file."""
    out = {}
    for group, indices in pinned["cases"][device].items():
        names = [c for c, _ in _grid()] if group in registry.OPERATIONS else _PRIORITY_FLAGS
        assert len(names) == len(indices), f"{device}/{group}: the grid changed; regenerate"
        for name, index in zip(names, indices, strict=True):
            out[f"{group}/{name}"] = pinned["orders"][index]
    return out


def test_registry_walks_the_pinned_order_for_every_input(monkeypatch: pytest.MonkeyPatch) -> None:
    pinned = json.loads(PINNED.read_text())
    for device in DEVICES:
        got = _orders(device, monkeypatch)
        want = _decode(pinned, device)
        assert set(got) == set(want), f"{device}: the grid changed; regenerate {PINNED.name}"
        wrong = [case for case in want if got[case] != want[case]]
        assert not wrong, (
            f"{device}: {len(wrong)} of {len(want)} orders changed, e.g. {wrong[0]}: "
            f"{got[wrong[0]]} instead of {want[wrong[0]]}"
        )


def test_pinned_grid_covers_every_rule() -> None:
    """The pinned file tells the rules apart: on sm90 the dense list, the fused kernels first for
    dilated and for masked 16-bit calls, and FlashAttention-4 first for long slotted dilated
    calls and for block-sparse calls all appear, so a rule that stopped applying would fail."""
    pinned = json.loads(PINNED.read_text())
    firsts = {(case.split("/")[0], order[0]) for case, order in _decode(pinned, "cuda:9").items()}
    assert ("dense", "flash_attn3") in firsts
    assert {("dilated", "flash_attn4"), ("dilated", "triton"), ("dense", "triton")} <= firsts
    assert ("block_sparse", "flash_attn4") in firsts


def _entries(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """(path, entry) of every table entry: the dicts that hold ``names``, ``training`` or
    ``newer`` (an order, a rule, the unlisted-major fallback)."""
    if not isinstance(node, dict):
        return []
    found = [(path, node)] if {"names", "training", "newer"} & set(node) else []
    for key, child in node.items():
        found += _entries(child, f"{path}/{key}")
    return found


def test_every_table_entry_names_its_source() -> None:
    """Every order and rule of ``priorities.json`` carries a ``source`` in words, every benchmark
    record it names exists under benchmarks/results/, and every kernel it lists is registered."""
    entries = _entries(priority_rules.table())
    assert len(entries) >= 10, [path for path, _ in entries]
    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    for path, entry in entries:
        source = entry.get("source")
        assert isinstance(source, str) and len(source.split()) >= 8, (path, source)
        for record in re.findall(r"\b[\w-]+\.(?:json|md)\b", source):
            assert (results / record).is_file(), f"{path}: {record} is not in {results}"
        names = [*entry.get("names", []), *entry.get("training", []), *entry.get("inference", [])]
        unknown = set(names) - set(registry.list_backends())
        assert not unknown, f"{path}: {sorted(unknown)} are not registered backends"


def test_table_is_read_once() -> None:
    assert priority_rules.table() is priority_rules.table()


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(f"usage: python {sys.argv[0]} --write  (rewrites {PINNED.name})")
    PINNED.write_text(_encode(_all_orders()))
    print(f"wrote {PINNED}")
