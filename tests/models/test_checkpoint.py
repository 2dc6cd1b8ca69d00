"""Checkpoints of LongNetLM (``dilated_attention.models.checkpoint``): an exact round trip, and a
clear CheckpointError (a ValueError naming the file and the problem) for every damaged file."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from dilated_attention.models import (
    CHECKPOINT_VERSION,
    CheckpointError,
    LongNetConfig,
    LongNetLM,
    load_checkpoint,
    save_checkpoint,
)

_MAGIC = b"DILATED-ATTENTION-CHECKPOINT\n"


def small_model(seed: int = 0, **overrides: object) -> LongNetLM:
    torch.manual_seed(seed)
    config = LongNetConfig(
        vocab_size=61, embed_dim=32, num_heads=2, num_layers=2, segment_lengths=(8, 16),
        dilation_rates=(1, 2), ffn_dim=64, **overrides,
    )  # fmt: skip
    return LongNetLM(config)


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, LongNetLM]:
    model = small_model()
    return save_checkpoint(tmp_path / "model.pt", model, step=7), model


def _logits(model: LongNetLM) -> torch.Tensor:
    tokens = torch.arange(40).remainder(61).view(2, 20)
    with torch.no_grad():
        return model.eval()(tokens)


def test_round_trip_is_exact(tmp_path: Path) -> None:
    model = small_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 61, (1, 16))).sum().backward()
    optimizer.step()
    extra = {
        "optimizer": optimizer.state_dict(), "step": 3, "losses": [1.5, 1.25],
        "evals": [(0, 2.5)], "rng": torch.get_rng_state(), "note": "hello", "blob": b"\x00\x01",
    }  # fmt: skip
    path = save_checkpoint(tmp_path / "sub" / "dir" / "model.pt", model, **extra)
    assert path == tmp_path / "sub" / "dir" / "model.pt"
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.pt"]  # no temporary left
    assert path.read_bytes().startswith(_MAGIC)

    ckpt = load_checkpoint(path)
    assert ckpt.path == path and ckpt.config == model.config
    assert isinstance(ckpt.model, LongNetLM) and ckpt.model.training  # like a new module
    assert torch.equal(_logits(ckpt.model), _logits(model))
    for name, tensor in model.state_dict().items():
        assert torch.equal(ckpt.model.state_dict()[name], tensor), name
    assert ckpt.model.lm_head.weight is ckpt.model.embed.weight  # still tied
    assert ckpt.extra["step"] == 3 and ckpt.extra["losses"] == [1.5, 1.25]
    assert ckpt.extra["evals"] == [(0, 2.5)] and ckpt.extra["note"] == "hello"
    assert torch.equal(ckpt.extra["rng"], extra["rng"]) and ckpt.extra["blob"] == b"\x00\x01"
    restored = torch.optim.AdamW(ckpt.model.parameters(), lr=1e-3)
    restored.load_state_dict(ckpt.extra["optimizer"])


def test_round_trip_keeps_dtype_and_applies_overrides(tmp_path: Path) -> None:
    model = small_model().double()
    path = save_checkpoint(str(tmp_path / "m.pt"), model)  # a str path works too
    ckpt = load_checkpoint(path, overrides={"activation_checkpointing": True})
    assert next(ckpt.model.parameters()).dtype == torch.float64
    assert ckpt.config.activation_checkpointing and not model.config.activation_checkpointing
    assert torch.equal(_logits(ckpt.model), _logits(model))
    with pytest.raises(ValueError, match="unknown LongNetConfig fields \\['nope'\\]"):
        load_checkpoint(path, overrides={"nope": 1})


def test_compiled_model_is_unwrapped(tmp_path: Path) -> None:
    model = small_model()

    class Wrapper(torch.nn.Module):  # what torch.compile returns: the module as ._orig_mod
        def __init__(self) -> None:
            super().__init__()
            self._orig_mod = model

    path = save_checkpoint(tmp_path / "m.pt", Wrapper())
    assert torch.equal(_logits(load_checkpoint(path).model), _logits(model))


def _expect_error(path: Path, *words: str) -> str:
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert str(path) in message, message
    for word in words:
        assert word in message, message
    return message


def test_flipped_byte_in_the_middle_is_refused(saved: tuple[Path, LongNetLM]) -> None:
    path, _ = saved
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    message = _expect_error(path, "corrupted", "checksum mismatch", "save it again")
    assert "SHA-256" in message


def test_flipped_byte_in_the_header_is_refused(saved: tuple[Path, LongNetLM]) -> None:
    path, _ = saved
    data = path.read_bytes()
    header_end = data.index(b"\n", len(_MAGIC))
    digest_at = data.index(b'"sha256": "', len(_MAGIC)) + len(b'"sha256": "')
    flipped = bytearray(data)
    flipped[digest_at] = ord("0") if data[digest_at] != ord("0") else ord("1")
    path.write_bytes(bytes(flipped))
    _expect_error(path, "checksum mismatch")
    broken = bytearray(data)
    broken[len(_MAGIC)] = ord("[")  # the JSON header no longer parses as an object
    path.write_bytes(bytes(broken))
    _expect_error(path, "corrupted", "header")
    assert header_end < len(data)


def test_truncated_file_is_refused(saved: tuple[Path, LongNetLM]) -> None:
    path, _ = saved
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    _expect_error(path, "truncated", "payload bytes")
    path.write_bytes(data[:10])  # cut inside the magic line
    _expect_error(path, "truncated", "header")
    path.write_bytes(data[: len(_MAGIC) + 5])  # cut inside the header line
    _expect_error(path, "truncated", "header")


def test_appended_bytes_are_refused(saved: tuple[Path, LongNetLM]) -> None:
    path, _ = saved
    path.write_bytes(path.read_bytes() + b"junk")
    _expect_error(path, "corrupted", "unexpected bytes")


def test_empty_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "empty.pt"
    path.write_bytes(b"")
    _expect_error(path, "is empty", "0 bytes")


def test_text_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "notes.pt"
    path.write_text("these are my notes, not weights\n")
    _expect_error(path, "text file", "not a checkpoint")


def test_plain_torch_save_file_is_refused(tmp_path: Path) -> None:
    model = small_model()
    path = tmp_path / "plain.pt"
    torch.save({"config": dataclasses.asdict(model.config), "model": model.state_dict()}, path)
    _expect_error(path, "zip archive", "save_checkpoint")


def test_newer_format_version_is_refused(saved: tuple[Path, LongNetLM]) -> None:
    path, _ = saved
    data = path.read_bytes()
    end = data.index(b"\n", len(_MAGIC))
    header = json.loads(data[len(_MAGIC) : end])
    header["version"] = CHECKPOINT_VERSION + 1
    path.write_bytes(_MAGIC + json.dumps(header).encode() + data[end:])
    _expect_error(path, f"format version {CHECKPOINT_VERSION + 1}", "upgrade")


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at .*missing\.pt"):
        load_checkpoint(tmp_path / "missing.pt")
    with pytest.raises(CheckpointError, match="is a directory"):
        load_checkpoint(tmp_path)


def test_bad_arguments(tmp_path: Path) -> None:
    model = small_model()
    with pytest.raises(TypeError, match="model must be a LongNetLM"):
        save_checkpoint(tmp_path / "m.pt", torch.nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"extra\['stuff'\] is a object"):
        save_checkpoint(tmp_path / "m.pt", model, stuff=object())
    with pytest.raises(TypeError, match=r"extra\['version'\] is a TorchVersion"):
        save_checkpoint(tmp_path / "m.pt", model, version=torch.__version__)
    with pytest.raises(TypeError, match=r"path must be a str or os\.PathLike"):
        save_checkpoint(3, model)  # type: ignore[arg-type]
    assert not (tmp_path / "m.pt").exists()
    path = save_checkpoint(tmp_path / "m.pt", model)
    with pytest.raises(ValueError, match="device='junk' is not a device"):
        load_checkpoint(path, device="junk")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device is available here"):
            load_checkpoint(path, device="cuda")
