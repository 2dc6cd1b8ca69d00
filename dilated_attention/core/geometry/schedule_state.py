"""The schedule a module was built with, stored in its state dict and checked on load.

Note [Schedule in the state dict]
    A dilated module's weights were trained for its schedule (segment lengths and dilation
    rates; a block-sparse module's: pattern and block size), which is a constructor argument,
    not a tensor: without it a state dict loads silently into a layer with another schedule and
    computes something else. Modules with a schedule (:class:`DilatedScheduleState`,
    :class:`BlockSparseScheduleState`) store it as ``nn.Module`` extra state, the state dict
    entry ``<module>._extra_state``: a 1-D uint8 tensor holding the schedule as UTF-8 JSON
    (:func:`encode_schedule`). A tensor, so that every consumer of state dicts that expects
    tensors takes it (``safetensors``, ``torch.distributed.checkpoint``, FSDP's state dicts,
    ``torch.load(weights_only=True)``); JSON, so that a later version can read it.

    A state dict is often cast as a whole (``{k: v.half() for k, v in sd.items()}``, or
    ``.double()``, ``.to(torch.bfloat16)``), which casts this entry too. Its bytes are ASCII
    (0..127), which the integer dtypes and the floating-point ones of 16 bits or more hold
    exactly, so an entry of another dtype loads when each of its values is a whole number in
    0..255 (the cast back to uint8 is then exact). A cast that changed a byte (float8) leaves
    text that is not the schedule, and is refused like any malformed entry; a cast entry of
    another schedule is refused as the uint8 one is.

    Loading an entry that names another schedule raises ``ValueError`` naming both, strict or
    not (``strict`` is about which keys are present; a wrong schedule is never what a load
    means). A state dict without the entry (saved before schedules were stored, or with the
    entry left out on purpose to put the weights under another schedule) loads as before, also
    with ``strict=True``.

A pattern is stored as its ``repr``; a ``Custom`` pattern's mask by shape and CRC-32 (its
``repr`` shows only the shape), and unions and intersections part by part.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ...patterns import Custom, Intersection, Pattern, Union

__all__ = [
    "BlockSparseScheduleState",
    "DilatedScheduleState",
    "ScheduleState",
    "block_sparse_schedule",
    "decode_schedule",
    "describe_schedule",
    "dilated_schedule",
    "encode_schedule",
    "pattern_text",
]

#: torch's suffix of a module's extra state in its state dict (``nn.Module.get_extra_state``).
EXTRA_STATE_KEY = "_extra_state"

Schedule = dict[str, Any]


def pattern_text(pattern: Pattern) -> str:
    """A text equal for two patterns exactly when they keep the same block pairs by the same
    rule: the ``repr``, with a ``Custom`` mask's shape and CRC-32."""
    if isinstance(pattern, Custom):
        mask = pattern.mask
        crc = zlib.crc32(mask.to(torch.uint8).cpu().numpy().tobytes())
        return f"Custom(mask of shape {tuple(mask.shape)}, crc32 {crc:08x})"
    if isinstance(pattern, (Union, Intersection)):
        parts = ", ".join(pattern_text(p) for p in pattern.patterns)
        return f"{type(pattern).__name__}(patterns=({parts}))"
    return repr(pattern)


def dilated_schedule(segment_lengths: Sequence[int], dilation_rates: Sequence[int]) -> Schedule:
    """The stored form of a dilated schedule."""
    return {
        "segment_lengths": [int(w) for w in segment_lengths],
        "dilation_rates": [int(r) for r in dilation_rates],
    }


def block_sparse_schedule(pattern: Pattern, block_size: int) -> Schedule:
    """The stored form of a block-sparse schedule."""
    return {"pattern": pattern_text(pattern), "block_size": int(block_size)}


def describe_schedule(schedule: Mapping[str, Any]) -> str:
    """``segment_lengths=[2048, 4096], dilation_rates=[1, 2]``: for messages."""
    return ", ".join(f"{name}={value}" for name, value in schedule.items())


def encode_schedule(schedule: Mapping[str, Any]) -> torch.Tensor:
    """``schedule`` as a 1-D uint8 CPU tensor of its UTF-8 JSON."""
    data = json.dumps(dict(schedule)).encode()
    return torch.tensor(list(data), dtype=torch.uint8, device="cpu")


def decode_schedule(state: object, where: str) -> Schedule:
    """The schedule stored by :func:`encode_schedule`.

    Raises:
        ValueError: ``state`` is not such a tensor (``where`` names the entry).
    """
    data = _schedule_bytes(state)
    if data is not None:
        try:
            schedule = json.loads(data.decode())
        except (UnicodeDecodeError, json.JSONDecodeError):
            schedule = None
        if isinstance(schedule, dict):
            return schedule
    shown = f"{type(state).__name__}" + (
        f" of dtype {state.dtype} and shape {tuple(state.shape)}"
        if isinstance(state, torch.Tensor)
        else ""
    )
    raise ValueError(
        f"{where} must hold the layer's schedule as saved by this library's state_dict() (a 1-D "
        f"uint8 tensor of JSON, or a cast of it that keeps every byte, such as .double(), "
        f".half() or .to(torch.bfloat16)), got {shown}; save the state dict again with "
        f"state_dict(), cast only its floating-point entries ({{k: v.half() if "
        f"v.is_floating_point() else v for k, v in sd.items()}}), or leave the entry out to load "
        f"the weights without checking their schedule"
    )


def _schedule_bytes(state: object) -> bytes | None:
    """The bytes of a stored schedule: a 1-D uint8 tensor, or a cast of one whose values are
    all whole numbers in 0..255 (Note [Schedule in the state dict]); None for anything else."""
    if not isinstance(state, torch.Tensor) or state.dim() != 1:
        return None
    if state.dtype in (torch.bool, torch.complex64, torch.complex128, torch.complex32):
        return None
    if state.dtype != torch.uint8:
        values = state.detach().cpu().double()
        exact = (values >= 0) & (values <= 255) & (values == values.round())
        if not bool(exact.all()):
            return None
        state = values.to(torch.uint8)
    return bytes(state.cpu().tolist())


class ScheduleState:
    """Mixin for an ``nn.Module`` with a schedule: stores it in the state dict and refuses to
    load another (Note [Schedule in the state dict]). Subclasses say what the schedule is."""

    def _stored_schedule(self) -> Schedule:
        raise NotImplementedError

    def get_extra_state(self) -> torch.Tensor:
        """The schedule, as a 1-D uint8 tensor (:func:`encode_schedule`)."""
        return encode_schedule(self._stored_schedule())

    def set_extra_state(self, state: Any) -> None:
        """Check that ``state`` holds this module's schedule (nothing else is loaded).

        Raises:
            ValueError: it holds another schedule, or is not a stored schedule.
        """
        self._check_saved_schedule(state, EXTRA_STATE_KEY)

    def _check_saved_schedule(self, state: object, where: str) -> None:
        saved, mine = decode_schedule(state, where), self._stored_schedule()
        if saved != mine:
            raise ValueError(
                f"{where}: the state dict was saved from a layer with {describe_schedule(saved)}, "
                f"but this {type(self).__name__} has {describe_schedule(mine)}; its weights "
                f"were trained for their schedule: build the layer with that schedule, or, to "
                f"load the weights under another schedule on purpose, leave out the state "
                f"dict's '{EXTRA_STATE_KEY}' entries (e.g. {{k: v for k, v in sd.items() if not "
                f"k.endswith('{EXTRA_STATE_KEY}')}})"
            )

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """``nn.Module``'s, checking the stored schedule under its full key first, and taking a
        state dict without one (Note [Schedule in the state dict])."""
        key = prefix + EXTRA_STATE_KEY
        if key in state_dict:
            self._check_saved_schedule(state_dict[key], key)
        super()._load_from_state_dict(  # type: ignore[misc]
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if key not in state_dict and key in missing_keys:
            missing_keys.remove(key)


class DilatedScheduleState(ScheduleState):
    """:class:`ScheduleState` of a module with ``segment_lengths`` and ``dilation_rates``."""

    segment_lengths: tuple[int, ...]
    dilation_rates: tuple[int, ...]

    def _stored_schedule(self) -> Schedule:
        return dilated_schedule(self.segment_lengths, self.dilation_rates)


class BlockSparseScheduleState(ScheduleState):
    """:class:`ScheduleState` of a module with a block-sparse ``pattern`` and ``block_size``."""

    pattern: Pattern
    block_size: int

    def _stored_schedule(self) -> Schedule:
        return block_sparse_schedule(self.pattern, self.block_size)
