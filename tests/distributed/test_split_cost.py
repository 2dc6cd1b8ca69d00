"""Context parallelism without processes: the cost model of the splits (Note [Choosing the
context-parallel split] in ``distributed/layout/cost.py``: what it refuses and why, what it picks),
``ContextParallel.from_mesh`` and what ``context_parallel`` refuses."""

from __future__ import annotations

import pytest
import torch

from dilated_attention import longnet_schedule
from dilated_attention.core.geometry.schedule import Schedule
from dilated_attention.distributed import ContextParallel, context_parallel
from dilated_attention.distributed.layout.cost import Shape, Topology, plan_split, split_volume


def test_dilated_rows_cost_far_less_than_dense_blocks() -> None:
    """At 1M tokens on 8 ranks, ring dilated attention sends a few percent of what dense ring
    attention and the head all-to-all send, and the model picks the ring."""
    dilated = Shape(1, 1 << 20, 16, 16, 128, torch.bfloat16, True,
                    schedule=Schedule(*longnet_schedule(1 << 20)))  # fmt: skip
    dense = Shape(1, 1 << 20, 16, 16, 128, torch.bfloat16, True)
    ring = split_volume(dilated, 8, 1)
    assert ring.forward < 0.01 * split_volume(dense, 8, 1).forward
    assert ring.forward < 0.05 * split_volume(dilated, 1, 8).forward
    plan = plan_split(dilated, 8)
    assert (plan.chosen.ring, plan.chosen.heads) == (8, 1)
    assert "ring 8 (the fastest predicted)" in plan.describe()


def test_dense_attention_across_nodes_takes_the_head_all_to_all_inside_them() -> None:
    """Dense causal attention of 32K tokens over 16 ranks of 8 per node: the ring's blocks cross
    the network at 50 GB/s slower than their steps compute; head groups inside a node cut that
    traffic, so a hybrid wins (at 256K the steps' compute hides the ring's transfers)."""
    dense = Shape(1, 1 << 15, 32, 8, 128, torch.bfloat16, True)
    plan = plan_split(dense, 16, Topology(ranks_per_node=8))
    assert plan.chosen.heads > 1 and plan.chosen.ring > 1, plan.describe()
    assert "head all-to-all 16: " in str(plan) and "repeated 2x" in str(plan)  # 8 kv heads
    longer = plan_split(Shape(1, 1 << 18, 32, 8, 128, torch.bfloat16, True), 16)
    assert (longer.chosen.ring, longer.chosen.heads) == (16, 1), longer.describe()


def test_splits_the_functions_refuse_are_refused_with_the_reason() -> None:
    shape = Shape(1, 4096, 12, 4, 64)  # 12 heads do not split over 8
    plan = plan_split(shape, 8)
    refused = {s.name: s.refused for s in plan.splits if s.refused}
    assert "head all-to-all 8" in refused and "divisible by 8" in refused["head all-to-all 8"]
    assert plan.chosen.refused is None
    with pytest.raises(ValueError, match="no split of 8 ranks runs this call"):
        plan_split(Shape(1, 4100, 12, 4, 64), 8)  # 4100 positions over 8 chunks


def test_context_parallel_from_a_mesh_names_its_dimensions() -> None:
    class Mesh:  # the two things from_mesh reads of a DeviceMesh
        mesh_dim_names = ("dp", "cp")

        def get_group(self, name: str) -> str:
            return f"group {name}"

    cp = ContextParallel.from_mesh(Mesh(), heads="cp")
    assert (cp.ring, cp.heads) == (None, "group cp")
    with pytest.raises(ValueError, match="name the mesh dimension"):
        ContextParallel.from_mesh(Mesh())
    with pytest.raises(ValueError, match=r"the mesh has dimensions \('dp', 'cp'\), got 'tp'"):
        ContextParallel.from_mesh(Mesh(), ring="tp")


def test_context_parallel_refuses_what_ring_layers_cannot_run() -> None:
    """Dropout, or block-sparse layers over zigzag shards: refused, the model unchanged."""
    from dilated_attention import BlockSparseAttention, patterns

    model = torch.nn.Sequential(BlockSparseAttention(patterns.LocalWindow(1), block_size=4))
    with pytest.raises(ValueError, match="block-sparse, which runs over contiguous shards"):
        context_parallel(model, None, layout="zigzag")
    assert type(model[0]) is BlockSparseAttention
    with pytest.raises(ValueError, match="layout must be one of"):
        context_parallel(model, None, layout="striped")
    with pytest.raises(TypeError, match=r"group must be a ContextParallel, a torch\.distributed"):
        context_parallel(model, "cp")  # type: ignore[arg-type]
