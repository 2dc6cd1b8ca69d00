"""A layer's stored schedule (Note [Schedule in the state dict]) under FSDP2 on 2 gloo ranks: the
sharded and the full state dicts carry it, a full state dict loads into a sharded layer of the
same schedule, and one of another schedule is refused on every rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.distributed_utils import raises_on_rank, run_world
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import fully_shard

from dilated_attention import MultiheadDilatedAttention

pytestmark = pytest.mark.distributed

TIMEOUT_S = 20.0
KEY = "attention._extra_state"


def _layer(segments: list[int]) -> MultiheadDilatedAttention:
    torch.manual_seed(0)
    return MultiheadDilatedAttention(16, 2, segments, [1, 2])


def _fsdp_worker(rank: int, world_size: int) -> None:
    plain = _layer([4, 8])
    expected = plain.state_dict()
    layer = fully_shard(_layer([4, 8]))
    sharded = get_model_state_dict(layer)
    assert torch.equal(sharded[KEY], expected[KEY]), f"rank {rank}: sharded"  # not sharded
    full = get_model_state_dict(layer, options=StateDictOptions(full_state_dict=True))
    assert set(full) == set(expected), f"rank {rank}: {sorted(set(full) ^ set(expected))}"
    for name, tensor in full.items():
        assert torch.equal(tensor, expected[name]), f"rank {rank}: {name}"
    same = fully_shard(_layer([4, 8]))
    set_model_state_dict(same, full, options=StateDictOptions(full_state_dict=True))
    x = torch.randn(2, 8, 16)
    same(x, is_causal=True)[0].sum().backward()
    other = fully_shard(_layer([4, 16]))
    with raises_on_rank(f"rank {rank}: another schedule", r"saved from a layer with segment"):
        set_model_state_dict(other, full, options=StateDictOptions(full_state_dict=True))


def test_fsdp_state_dicts_carry_the_schedule(tmp_path: Path) -> None:
    run_world(_fsdp_worker, 2, tmp_path, timeout_s=TIMEOUT_S)
