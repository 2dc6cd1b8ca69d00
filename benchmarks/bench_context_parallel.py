"""Context parallelism: bytes each rank sends per layer for every split of W ranks (ring, head
all-to-all, both), from the plans the functions run, and the split the cost model picks.

Computed, not measured: no process group is needed, so any world size runs on one CPU. The
bytes are what ``dilated_attention.distributed.layout.cost.split_volume`` counts from the same plans
the ring functions run (a gloo test checks them against the bytes really sent,
``tests/distributed/test_context_parallel.py``); the predicted times are the model's
(Note [Choosing the context-parallel split] in ``distributed/layout/cost.py``; ``Topology``'s
defaults: 8 ranks per node, 400 GB/s inside a node, 50 GB/s between nodes, 400 TFLOP/s).

Rows: the LongNet schedule over ``--seq-len`` tokens (``longnet_schedule``: w = 2048 doubling
to N, r = 1 doubling), causal, H = 16, D = 128, bf16, B = 1, at each of ``--worlds``, for every
split; and the pure ring of dense causal attention at the same shape, the reference.

    python benchmarks/bench_context_parallel.py  # -> results/context_parallel_cpu.{json,md}
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import OUT_HELP, environment, markdown_table, record_header, record_path, write_record

from dilated_attention import longnet_schedule
from dilated_attention.core.geometry.schedule import Schedule
from dilated_attention.distributed.layout.cost import Shape, plan_split, split_volume

MIB = 2**20


def rows_for(world: int, seq_len: int) -> list[dict]:
    """Every split of ``world`` ranks for the LongNet schedule, and dense attention's ring."""
    schedule = Schedule(*longnet_schedule(seq_len))
    dilated = Shape(1, seq_len, 16, 16, 128, torch.bfloat16, True, schedule=schedule)
    plan = plan_split(dilated, world)
    dense = split_volume(Shape(1, seq_len, 16, 16, 128, torch.bfloat16, True), world, 1)
    rows = []
    for split in plan.splits:
        row = {
            "world": world, "attention": "dilated", "split": split.name, "ring": split.ring,
            "heads": split.heads, "chosen": split is plan.chosen,
        }  # fmt: skip
        if split.refused is not None:
            row["refused"] = split.refused
        if split.volume is not None:
            row["forward_mib"] = split.volume.forward / MIB
            row["backward_mib"] = split.volume.backward / MIB
            row["vs_dense_ring"] = (split.volume.forward + split.volume.backward) / (
                dense.forward + dense.backward
            )
            row["predicted_ms"] = split.predicted_ms
        rows.append(row)
    rows.append({
        "world": world, "attention": "dense", "split": f"ring {world}", "ring": world,
        "heads": 1, "chosen": False, "forward_mib": dense.forward / MIB,
        "backward_mib": dense.backward / MIB, "vs_dense_ring": 1.0,
    })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=1 << 20)
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--out", type=Path, default=None, help=OUT_HELP)
    args = parser.parse_args()
    rows = [row for world in args.worlds for row in rows_for(world, args.seq_len)]
    columns = ["world", "attention", "split", "chosen", "forward_mib", "backward_mib",
               "vs_dense_ring", "predicted_ms", "refused"]  # fmt: skip
    notes = (
        f"bytes one rank sends per layer call (the most loaded rank), LongNet schedule over "
        f"{args.seq_len} tokens, causal, H = 16, D = 128, bf16, B = 1, counted from the ring "
        f"functions' plans; vs_dense_ring: forward + backward bytes over the pure ring of "
        f"dense causal attention at the same shape; predicted_ms: the cost model's forward + "
        f"backward per layer; chosen: the split plan_split picks"
    )
    env = environment()
    out = record_path("context_parallel", args.out)
    write_record(out.with_suffix(".json"), env, rows, columns=columns, notes=notes)
    table = record_header(env) + markdown_table(rows, columns)
    out.with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
