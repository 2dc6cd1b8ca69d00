"""A module's schedule travels with its weights (Note [Schedule in the state dict]): a state dict
loads into a layer of the same schedule, is refused by one of another schedule with a ValueError
naming both, and a state dict saved before schedules were stored still loads."""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dilated_attention import (
    BlockSparseAttention,
    BlockSparseMultiheadAttention,
    BlockSparseRingAttention,
    BlockSparseRingMultiheadAttention,
    DilatedAttention,
    MultiheadDilatedAttention,
    RingDilatedAttention,
    RingMultiheadDilatedAttention,
    patterns,
)
from dilated_attention.models import (
    CheckpointError,
    LongNetConfig,
    LongNetLM,
    load_checkpoint,
    save_checkpoint,
)

F64 = torch.float64
EYE = torch.eye(4, dtype=torch.bool)
LOCAL, GLOBAL, CUSTOM = patterns.LocalWindow(1), patterns.GlobalLocal, patterns.Custom

#: name -> (build(schedule variant 0 or 1), the variants' texts in the message)
BUILDS: dict[str, tuple[Callable[[int], nn.Module], tuple[str, str]]] = {
    "DilatedAttention": (
        lambda i: DilatedAttention([4, 8 * (i + 1)], [1, 2]),
        ("segment_lengths=[4, 8], dilation_rates=[1, 2]",
         "segment_lengths=[4, 16], dilation_rates=[1, 2]"),
    ),
    "MultiheadDilatedAttention": (
        lambda i: MultiheadDilatedAttention(16, 2, [4, 8], [1, 2 + 2 * i], dtype=F64),
        ("segment_lengths=[4, 8], dilation_rates=[1, 2]",
         "segment_lengths=[4, 8], dilation_rates=[1, 4]"),
    ),
    "RingDilatedAttention": (
        lambda i: RingDilatedAttention([4 + 4 * i], [1]),
        ("segment_lengths=[4], dilation_rates=[1]", "segment_lengths=[8], dilation_rates=[1]"),
    ),
    "RingMultiheadDilatedAttention": (
        lambda i: RingMultiheadDilatedAttention(16, 2, [4, 8 + 8 * i], [1, 2]),
        ("segment_lengths=[4, 8], dilation_rates=[1, 2]",
         "segment_lengths=[4, 16], dilation_rates=[1, 2]"),
    ),
    "BlockSparseAttention": (
        lambda i: BlockSparseAttention(patterns.LocalWindow(1 + i), block_size=4),
        ("pattern=LocalWindow(window=1), block_size=4",
         "pattern=LocalWindow(window=2), block_size=4"),
    ),
    "BlockSparseMultiheadAttention": (
        lambda i: BlockSparseMultiheadAttention(16, 2, LOCAL, block_size=4 + 4 * i),
        ("pattern=LocalWindow(window=1), block_size=4",
         "pattern=LocalWindow(window=1), block_size=8"),
    ),
    "BlockSparseMultiheadAttention Custom": (
        lambda i: BlockSparseMultiheadAttention(16, 2, CUSTOM(EYE ^ bool(i)), block_size=4),
        ("pattern=Custom(mask of shape (4, 4), crc32 3f06e637)",
         "pattern=Custom(mask of shape (4, 4), crc32 811d85d5)"),
    ),
    "BlockSparseRingAttention": (
        lambda i: BlockSparseRingAttention(LOCAL | patterns.DilatedBlocks((2 + i,)), block_size=4),
        ("pattern=Union(patterns=(LocalWindow(window=1), DilatedBlocks(rates=(2,))))",
         "pattern=Union(patterns=(LocalWindow(window=1), DilatedBlocks(rates=(3,))))"),
    ),
    "BlockSparseRingMultiheadAttention": (
        lambda i: BlockSparseRingMultiheadAttention(16, 2, GLOBAL(1, 1 + i), block_size=4),
        ("pattern=GlobalLocal(num_global=1, window=1)",
         "pattern=GlobalLocal(num_global=1, window=2)"),
    ),
}  # fmt: skip


def _without_schedule(state: dict[str, Any]) -> dict[str, Any]:
    """A state dict as saved before schedules were stored."""
    return {k: v for k, v in state.items() if not k.endswith("_extra_state")}


@pytest.mark.parametrize("name", list(BUILDS))
def test_state_dict_refuses_another_schedule(name: str) -> None:
    build, (saved_text, other_text) = BUILDS[name]
    torch.manual_seed(0)
    saved, same, other = build(0), build(0), build(1)
    state = saved.state_dict()
    assert [k for k in state if k.endswith("_extra_state")], f"{name}: no stored schedule"
    assert str(same.load_state_dict(state)) == "<All keys matched successfully>"
    for left, right in zip(saved.state_dict().values(), same.state_dict().values(), strict=True):
        assert torch.equal(left, right)
    before = copy.deepcopy(other.state_dict())
    for strict in (True, False):
        with pytest.raises(ValueError, match="saved from a layer with") as info:
            other.load_state_dict(state, strict=strict)
        message = str(info.value)
        # Both schedules named, the saved one first; how to load on purpose.
        assert message.index(saved_text) < message.rindex(other_text), message
        assert "_extra_state" in message and "on purpose" in message, message
    # A state dict saved before schedules were stored loads into any schedule, strict or not.
    for strict in (True, False):
        result = other.load_state_dict(_without_schedule(state), strict=strict)
        assert not result.missing_keys and not result.unexpected_keys, (name, strict, result)
    after = other.state_dict()
    assert [k for k in after if k.endswith("_extra_state")] == [
        k for k in before if k.endswith("_extra_state")
    ]
    for key, tensor in after.items():  # the weights are the saved ones, the schedule its own
        want = before[key] if key.endswith("_extra_state") else state[key]
        assert torch.equal(tensor, want), key


def test_schedule_entry_is_a_readable_tensor() -> None:
    state = MultiheadDilatedAttention(16, 2, [4, 8], [1, 2]).state_dict()
    entry = state["attention._extra_state"]
    assert entry.dtype == torch.uint8 and entry.dim() == 1 and entry.device.type == "cpu"
    text = bytes(entry.tolist()).decode()
    assert text == '{"segment_lengths": [4, 8], "dilation_rates": [1, 2]}'
    # On the meta device too (a model built there, e.g. before FSDP materialises it).
    with torch.device("meta"):
        meta = MultiheadDilatedAttention(16, 2, [4, 8], [1, 2])
    assert torch.equal(meta.state_dict()["attention._extra_state"], entry)


def test_malformed_schedule_entry_raises() -> None:
    layer = DilatedAttention([4], [1])
    for bad in (torch.zeros(3), torch.tensor([1, 2], dtype=torch.uint8), "segment_lengths=[4]"):
        with pytest.raises(ValueError, match=r"_extra_state must hold the layer's schedule"):
            layer.load_state_dict({"_extra_state": bad})


#: The "cast the checkpoint" idiom's casts, applied to every entry of a state dict.
CASTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "double": lambda v: v.double(), "half": lambda v: v.half(),
    "bfloat16": lambda v: v.to(torch.bfloat16), "float32": lambda v: v.float(),
}  # fmt: skip


@pytest.mark.parametrize("cast", list(CASTS))
@pytest.mark.parametrize("name", list(BUILDS))
def test_a_cast_state_dict_loads_and_another_schedule_is_still_refused(name, cast) -> None:
    """A state dict cast as a whole (its schedule entry too) loads into a layer of its schedule,
    with the cast weights, and is refused by a layer of another schedule."""
    build, (saved_text, _) = BUILDS[name]
    torch.manual_seed(0)
    saved, same, other = build(0), build(0), build(1)
    state = {k: CASTS[cast](v) for k, v in saved.state_dict().items()}
    assert str(same.load_state_dict(state)) == "<All keys matched successfully>"
    for key, tensor in same.state_dict().items():
        want = saved.state_dict()[key] if key.endswith("_extra_state") else state[key]
        assert torch.equal(tensor, want.to(tensor.dtype)), key
    with pytest.raises(ValueError, match="saved from a layer with " + re.escape(saved_text)):
        other.load_state_dict(state)


def test_a_cast_that_changes_the_schedule_bytes_is_refused() -> None:
    """float8 cannot hold every byte of the entry: the text is no schedule, and the message
    names the casts that keep it and how to cast the weights alone."""
    state = DilatedAttention([4, 8], [1, 2]).state_dict()
    for bad in (state["_extra_state"].to(torch.float8_e4m3fn), state["_extra_state"] + 0.5):
        with pytest.raises(ValueError, match=r"a cast of it that keeps every byte.*"
                           r"v\.is_floating_point\(\)"):  # fmt: skip
            DilatedAttention([4, 8], [1, 2]).load_state_dict({"_extra_state": bad})


def test_ring_and_local_layers_share_checkpoints() -> None:
    """The ring layer stores the same schedule as the local one: checkpoints move between."""
    torch.manual_seed(0)
    ring = RingMultiheadDilatedAttention(16, 2, [4, 8], [1, 2], dtype=F64)
    local = MultiheadDilatedAttention(16, 2, [4, 8], [1, 2], dtype=F64)
    local.load_state_dict(ring.state_dict())
    ring.load_state_dict(local.state_dict())
    x = torch.randn(2, 8, 16, dtype=F64)
    assert torch.equal(ring(x, is_causal=True)[0], local(x, is_causal=True)[0])


def test_deepcopy_and_compile_keep_the_schedule() -> None:
    torch.manual_seed(0)
    layer = MultiheadDilatedAttention(16, 2, [4, 8], [1, 2], dtype=F64)
    twin = copy.deepcopy(layer)
    assert torch.equal(
        twin.state_dict()["attention._extra_state"], layer.state_dict()["attention._extra_state"]
    )
    compiled = torch.compile(copy.deepcopy(layer), backend="eager")
    x = torch.randn(2, 8, 16, dtype=F64)
    compiled(x, is_causal=True)[0].sum().backward()
    state = compiled.state_dict()  # keys under _orig_mod.
    other = torch.compile(MultiheadDilatedAttention(16, 2, [4, 16], [1, 2], dtype=F64))
    with pytest.raises(ValueError, match=r"_orig_mod\.attention\._extra_state: the state dict"):
        other.load_state_dict(state)
    compiled.load_state_dict(state)
    torch.testing.assert_close(compiled(x, is_causal=True)[0], layer(x, is_causal=True)[0])


def test_state_dict_consumers_take_the_entry(tmp_path: Path) -> None:
    """safetensors and torch.distributed.checkpoint (single process) store and restore it."""
    safetensors = pytest.importorskip("safetensors.torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    torch.manual_seed(0)
    layer = MultiheadDilatedAttention(16, 2, [4, 8], [1, 2])
    other = MultiheadDilatedAttention(16, 2, [4, 16], [1, 2])
    safetensors.save_file(layer.state_dict(), tmp_path / "layer.safetensors")
    loaded = safetensors.load_file(tmp_path / "layer.safetensors")
    MultiheadDilatedAttention(16, 2, [4, 8], [1, 2]).load_state_dict(loaded)
    with pytest.raises(ValueError, match="saved from a layer with segment_lengths=\\[4, 8\\]"):
        other.load_state_dict(loaded)
    dcp.save(layer.state_dict(), checkpoint_id=tmp_path / "dcp")
    fresh = MultiheadDilatedAttention(16, 2, [4, 8], [1, 2])
    target = fresh.state_dict()
    dcp.load(target, checkpoint_id=tmp_path / "dcp")
    fresh.load_state_dict(target)
    assert torch.equal(fresh.q_proj.weight, layer.q_proj.weight)


# -- LongNetLM and its checkpoint files ------------------------------------------------------------


def _model(**overrides: object) -> LongNetLM:
    torch.manual_seed(0)
    config = dict(vocab_size=61, embed_dim=32, num_heads=4, num_layers=2, ffn_dim=64,
                  segment_lengths=(8, 16), dilation_rates=(1, 2))  # fmt: skip
    return LongNetLM(LongNetConfig(**{**config, **overrides}))


def test_longnet_state_dict_refuses_another_schedule() -> None:
    model = _model()
    state = model.state_dict()
    stored = [k for k in state if k.endswith("_extra_state")]
    assert stored == [f"blocks.{i}.attn.mha.attention._extra_state" for i in range(2)]
    with pytest.raises(ValueError, match=re.escape(
        "blocks.0.attn.mha.attention._extra_state: the state dict was saved from a layer with "
        "segment_lengths=[8, 16], dilation_rates=[1, 2], but this DilatedAttention has "
        "segment_lengths=[8, 32], dilation_rates=[1, 2]"
    )):  # fmt: skip
        _model(segment_lengths=(8, 32)).load_state_dict(state)
    _model(segment_lengths=(8, 32)).load_state_dict(_without_schedule(state))  # on purpose


@pytest.mark.parametrize("cast", ["double", "half", "bfloat16"])
def test_longnet_loads_a_cast_state_dict(cast: str) -> None:
    """The cast-the-checkpoint idiom, and a model cast with .half() / .to(bfloat16) whose
    state dict goes to a model cast alike; another schedule is still refused."""
    model = _model()
    state = {k: CASTS[cast](v) for k, v in model.state_dict().items()}
    twin = _model().to(state["embed.weight"].dtype)
    assert str(twin.load_state_dict(state)) == "<All keys matched successfully>"
    assert torch.equal(twin.embed.weight, state["embed.weight"])
    with pytest.raises(ValueError, match="saved from a layer with segment_lengths=\\[8, 16\\]"):
        _model(segment_lengths=(8, 32)).load_state_dict(state)
    dtype = state["embed.weight"].dtype
    cast_model, loaded = _model().to(dtype), _model().to(dtype)
    nn.init.normal_(cast_model.embed.weight)  # weights the load must bring over
    assert str(loaded.load_state_dict(cast_model.state_dict())) == "<All keys matched successfully>"
    for key, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, cast_model.state_dict()[key]), key


def test_checkpoint_keeps_the_schedule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    path = save_checkpoint(tmp_path / "model.pt", model)
    tokens = torch.randint(0, 61, (1, 20))
    assert torch.equal(load_checkpoint(path).model.eval()(tokens), model.eval()(tokens))
    # Overrides that change the schedule are refused before anything is built.
    with pytest.raises(ValueError, match=re.escape(
        "overrides change the attention schedule of checkpoint " + str(path) + " from "
        "segment_lengths=(8, 16), dilation_rates=(1, 2) to segment_lengths=(8, 32), "
        "dilation_rates=(1, 2)"
    )):  # fmt: skip
        load_checkpoint(path, overrides={"segment_lengths": (8, 32)})
    # A file written before schedules were stored loads as before.
    with monkeypatch.context() as patch:
        patch.setattr(
            LongNetLM, "state_dict", lambda self: _without_schedule(nn.Module.state_dict(self))
        )
        old = save_checkpoint(tmp_path / "old.pt", model)
    assert torch.equal(load_checkpoint(old).model.eval()(tokens), model.eval()(tokens))
    # A file whose stored schedules contradict its config is not a usable checkpoint.
    with monkeypatch.context() as patch:
        real = dataclasses.asdict
        patch.setattr(
            "dilated_attention.models.checkpoint.dataclasses.asdict",
            lambda c: {**real(c), "segment_lengths": (8, 32)},
        )
        forged = save_checkpoint(tmp_path / "forged.pt", model)
    with pytest.raises(
        CheckpointError, match="saved from a layer with segment_lengths=\\[8, 16\\]"
    ):
        load_checkpoint(forged)
