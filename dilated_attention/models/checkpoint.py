"""Save and load a :class:`LongNetLM` with its configuration, verified by a SHA-256 checksum.

One file holds the model's configuration, its ``state_dict`` and any extra training state the caller
passes (optimizer, scheduler, step, RNG states, ...). :func:`load_checkpoint` checks the file before
unpickling anything and refuses an empty, truncated, corrupted or foreign file with a
:class:`CheckpointError` that names the file, says what is wrong and what to do.

Note [Checkpoint file format]
    Version 1, three parts::

        DILATED-ATTENTION-CHECKPOINT\\n                                     magic line
        {"version": 1, "payload_bytes": N, "sha256": "<64 hex digits>"}\\n  header, one JSON line
        <N bytes>                                                           payload

    The payload is ``torch.save`` of a dict: ``"format"`` (``"LongNetLM"``), ``"config"``
    (``dataclasses.asdict`` of the :class:`LongNetConfig`), ``"model"`` (the state dict),
    ``"dtype"`` (the parameters' dtype, e.g. ``"float32"``), ``"extra"`` (the caller's keyword
    arguments) and ``"versions"`` (the library's and torch's). The checksum is the SHA-256 of the
    payload bytes, so a flipped bit anywhere in the payload, a cut-short copy or bytes appended
    after it are caught before the payload is read; a damaged header fails to parse or no longer
    matches the payload. The payload is read with ``torch.load(weights_only=True)``: a checkpoint
    holds tensors, numbers, strings, bytes, ``None``, dtypes and lists, tuples and dicts of them,
    never arbitrary objects. ``head -c 200 FILE`` shows the header; ``torch.load`` cannot open the
    file directly (use :func:`load_checkpoint`).

Example::

    from dilated_attention.models import LongNetConfig, LongNetLM, load_checkpoint, save_checkpoint

    model = LongNetLM(LongNetConfig.from_preset("tiny"))
    save_checkpoint("outputs/model.pt", model, step=100)
    ckpt = load_checkpoint("outputs/model.pt")
    ckpt.model, ckpt.config, ckpt.extra["step"]   # LongNetLM, LongNetConfig, 100
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import _validation as V
from .._version import __version__
from ..core.devices import resolve_device
from .config import LongNetConfig
from .longnet import LongNetLM

__all__ = [
    "CHECKPOINT_VERSION",
    "Checkpoint",
    "CheckpointError",
    "load_checkpoint",
    "save_checkpoint",
]

#: Version of the layout :func:`save_checkpoint` writes (see Note [Checkpoint file format]).
CHECKPOINT_VERSION = 1
_MAGIC = b"DILATED-ATTENTION-CHECKPOINT\n"
_MAX_HEADER_BYTES = 4096
_FORMAT = "LongNetLM"
_REWRITE = "save it again with dilated_attention.models.save_checkpoint, or use an intact copy"
#: Exact types torch.load(weights_only=True) reads back (subclasses such as torch.__version__'s
#: TorchVersion or defaultdict are refused by it), besides tensors and the containers below.
_LEAVES = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.dtype, torch.device)
_CONTAINERS = (list, tuple, set, torch.Size)


class CheckpointError(ValueError):
    """A file is not a usable checkpoint: empty, truncated, corrupted (checksum mismatch), not a
    checkpoint at all, or holding something :class:`LongNetLM` cannot load. The message names the
    file, what is wrong and what to do."""


@dataclass(frozen=True)
class Checkpoint:
    """What :func:`load_checkpoint` returns.

    Attributes:
        model: the :class:`LongNetLM`, with the saved weights, on the requested device.
        config: its configuration (with any ``overrides`` applied).
        extra: the keyword arguments given to :func:`save_checkpoint` (tensors on the
            requested device).
        path: the file it was read from.
    """

    model: LongNetLM
    config: LongNetConfig
    extra: dict[str, Any]
    path: Path


def _as_path(name: str, path: object) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name} must be a str or os.PathLike file path, got {type(path).__name__}")
    return Path(path)


def _check_storable(value: object, where: str) -> None:
    """Raise TypeError where ``torch.load(weights_only=True)`` could not read ``value`` back."""
    if type(value) in _LEAVES or isinstance(value, torch.Tensor):
        return
    if isinstance(value, (list, tuple, set)) and type(value) in _CONTAINERS:
        for i, item in enumerate(value):
            _check_storable(item, f"{where}[{i}]")
        return
    if isinstance(value, dict) and type(value) in (dict, OrderedDict):
        for key, item in value.items():
            if type(key) not in (str, int, float, bool, type(None), tuple):
                raise TypeError(
                    f"{where} has a key of type {type(key).__name__}; checkpoint dict keys must "
                    f"be str, int, float, bool, None or tuples; convert the key"
                )
            _check_storable(item, f"{where}[{key!r}]")
        return
    raise TypeError(
        f"{where} is a {type(value).__name__}; a checkpoint holds only tensors, numbers, strings, "
        f"bytes, None, dtypes, devices and lists/tuples/sets/dicts of them (it is read back with "
        f"torch.load(weights_only=True)); convert it, e.g. str(torch.__version__), or an "
        f"optimizer to optimizer.state_dict()"
    )


def _unwrap(model: object) -> LongNetLM:
    inner = getattr(model, "_orig_mod", model)  # torch.compile wraps the module
    if not isinstance(inner, LongNetLM):
        raise TypeError(
            f"model must be a LongNetLM (or torch.compile of one), got {type(model).__name__}; "
            f"for DistributedDataParallel pass model.module"
        )
    return inner


def save_checkpoint(path: str | os.PathLike[str], model: LongNetLM, **extra: Any) -> Path:
    """Write ``model``'s configuration and weights, and ``extra``, to ``path`` with a checksum.

    The file is written next to ``path`` under a temporary name, flushed to disk, then renamed
    over ``path``: an interrupted save never leaves a half-written checkpoint at ``path``. Missing
    parent directories are created. See Note [Checkpoint file format].

    Args:
        path: the file to write (conventionally ``*.pt``).
        model: a :class:`LongNetLM` (a ``torch.compile``-d one is unwrapped).
        **extra: further state to store, e.g. ``optimizer=opt.state_dict()``, ``step=100``:
            tensors, numbers, strings, bytes, ``None``, dtypes and lists/tuples/dicts of them.

    Returns:
        ``path`` as a :class:`pathlib.Path`.

    Raises:
        TypeError: ``model`` is not a LongNetLM, ``path`` is not a path, or ``extra`` holds an
            object ``torch.load(weights_only=True)`` could not read back (the message names it).
    """
    path = _as_path("path", path)
    lm = _unwrap(model)
    _check_storable(extra, "extra")
    dtypes = {p.dtype for p in lm.parameters()}
    payload = {
        "format": _FORMAT,
        "config": dataclasses.asdict(lm.config),
        "model": lm.state_dict(),
        "dtype": str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else None,
        "extra": extra,
        "versions": {"dilated_attention": __version__, "torch": str(torch.__version__)},
    }
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getvalue()
    header = {
        "version": CHECKPOINT_VERSION,
        "payload_bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(_MAGIC + json.dumps(header).encode() + b"\n")
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _describe_foreign(data: bytes) -> str:
    """What a file that lacks the checkpoint header looks like."""
    if data.startswith(b"PK\x03\x04"):
        return (
            "a zip archive (a plain torch.save file?), not a file written by save_checkpoint: it "
            "has no checksum to verify. If you trust it, torch.load it (weights_only=True) and "
            "save it again with dilated_attention.models.save_checkpoint"
        )
    if data[:1] == b"\x80":
        return "a pickle file (an old torch.save file?), not a file written by save_checkpoint"
    head = data[:64]
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return f"an unknown binary file starting with {head[:16]!r}, not a checkpoint"
    return f"a text file starting with {text[:40]!r}, not a checkpoint"


def _read_payload(path: Path) -> memoryview:
    """The verified payload of the checkpoint at ``path`` (see Note [Checkpoint file format])."""
    if not path.exists():
        raise FileNotFoundError(
            f"no checkpoint at {path}: check the path (save one with save_checkpoint, "
            f"`python -m dilated_attention demo --save PATH` or examples/train_longnet.py)"
        )
    if path.is_dir():
        raise CheckpointError(f"checkpoint {path} is a directory; give the checkpoint file")
    data = path.read_bytes()
    where = f"checkpoint {path}"
    if not data:
        raise CheckpointError(
            f"{where} is empty (0 bytes): it was never written completely (an interrupted "
            f"copy or a full disk?); {_REWRITE}"
        )
    if not data.startswith(_MAGIC):
        if _MAGIC.startswith(data):
            raise CheckpointError(
                f"{where} is truncated: only {V.counted(len(data), 'byte')}, cut short inside the "
                f"header; "
                f"{_REWRITE}"
            )
        raise CheckpointError(f"{where} is {_describe_foreign(data)}")
    end = data.find(b"\n", len(_MAGIC), len(_MAGIC) + _MAX_HEADER_BYTES)
    if end < 0:
        if len(data) < len(_MAGIC) + _MAX_HEADER_BYTES:
            raise CheckpointError(
                f"{where} is truncated: only {V.counted(len(data), 'byte')}, cut short inside the "
                f"header; "
                f"{_REWRITE}"
            )
        raise CheckpointError(f"{where} is corrupted: its header line has no end; {_REWRITE}")
    try:
        header = json.loads(data[len(_MAGIC) : end])
        version, size, digest = header["version"], header["payload_bytes"], header["sha256"]
        if not (isinstance(version, int) and isinstance(size, int) and isinstance(digest, str)):
            raise TypeError("a header field has the wrong type")
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{where} is corrupted: its header cannot be read ({type(exc).__name__}: {exc}); "
            f"{_REWRITE}"
        ) from None
    if version != CHECKPOINT_VERSION:
        raise CheckpointError(
            f"{where} has format version {version}; this dilated_attention reads version "
            f"{CHECKPOINT_VERSION}: upgrade dilated_attention to read it"
        )
    payload = memoryview(data)[end + 1 :]  # a view: no copy of a large file
    if len(payload) < size:
        raise CheckpointError(
            f"{where} is truncated: the header promises {size:,} payload bytes, the file holds "
            f"{len(payload):,} (an interrupted save or copy?); {_REWRITE}"
        )
    if len(payload) > size:
        raise CheckpointError(
            f"{where} is corrupted: {len(payload) - size:,} unexpected bytes follow the "
            f"{size:,}-byte payload; {_REWRITE}"
        )
    actual = hashlib.sha256(payload).hexdigest()
    if actual != digest:
        raise CheckpointError(
            f"{where} is corrupted: checksum mismatch (SHA-256 of the payload is {actual[:16]}..., "
            f"the header says {digest[:16]}...); the file changed after it was written (a disk "
            f"or transfer error?). Do not use it: {_REWRITE}"
        )
    return payload


#: The config fields that shape the attention the weights were trained for (Note [Hybrid
#: stacks] in ``config.py``): overrides may not change them.
_ATTENTION_FIELDS = (
    "segment_lengths", "dilation_rates", "local_window", "global_every", "softcap", "sinks",
    "sparse",
)  # fmt: skip


def _keeping_schedule(saved: LongNetConfig, config: LongNetConfig, where: str) -> LongNetConfig:
    """``config`` (``saved`` with the overrides), if it keeps the saved attention: the schedule
    (Note [Schedule in the state dict] in core/geometry/schedule_state.py), the local layers,
    soft-cap and sinks, which the weights were trained for.

    Raises:
        ValueError: the overrides change one of them.
    """
    before = (saved.segment_lengths, saved.dilation_rates)
    after = (config.segment_lengths, config.dilation_rates)
    if before != after:
        raise ValueError(
            f"overrides change the attention schedule of {where} from segment_lengths="
            f"{before[0]}, dilation_rates={before[1]} to segment_lengths={after[0]}, "
            f"dilation_rates={after[1]}; its weights were trained for their schedule. To run them "
            f"under another one on purpose, load the checkpoint as saved, build the model with "
            f"the new schedule and copy the weights without their stored schedules: "
            f"new.load_state_dict({{k: v for k, v in ckpt.model.state_dict().items() if not "
            f"k.endswith('_extra_state')}})"
        )
    changed = [
        f"{name}={getattr(saved, name)!r} to {getattr(config, name)!r}"
        for name in _ATTENTION_FIELDS[2:]
        if getattr(saved, name) != getattr(config, name)
    ]
    if changed:
        raise ValueError(
            f"overrides change the attention of {where} from {', '.join(changed)}; its weights "
            f"were trained for its local layers, soft-cap, sinks and selected-block sizes: load "
            f"it as saved"
        )
    return config


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    device: torch.device | str | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Checkpoint:
    """Read a checkpoint written by :func:`save_checkpoint` and rebuild the model.

    The whole file is checked (header, length, SHA-256 of the payload) before anything is
    unpickled, and the payload is read with ``torch.load(weights_only=True)``.

    Args:
        path: the checkpoint file.
        device: where to put the model and the tensors of ``extra`` (default: CPU).
        overrides: :class:`LongNetConfig` fields to change before building the model, for
            settings that do not change the weights, e.g. ``{"activation_checkpointing": True}``
            or ``{"backend": "math"}``.

    Returns:
        A :class:`Checkpoint` with ``.model`` (in training mode, as a new module is), ``.config``,
        ``.extra`` and ``.path``.

    Raises:
        FileNotFoundError: there is no file at ``path``.
        CheckpointError: (a ``ValueError``) the file is empty, truncated, corrupted (checksum
            mismatch), not a checkpoint, or its contents do not fit a :class:`LongNetLM`; the
            message says which and what to do.
        ValueError: ``overrides`` names an unknown field, gives an invalid value or changes
            the attention the weights were trained for (``segment_lengths``,
            ``dilation_rates``, ``local_window``, ``global_every``, ``softcap``, ``sinks``), or
            ``device`` is not a device available here.
        TypeError: ``path`` is not a path.
    """
    path = _as_path("path", path)
    payload_bytes = _read_payload(path)
    where = f"checkpoint {path}"
    map_location = resolve_device("cpu" if device is None else device)
    try:
        payload = torch.load(
            io.BytesIO(payload_bytes), map_location=map_location, weights_only=True
        )
    except Exception as exc:  # the checksum matched, so the writer stored something unreadable
        raise CheckpointError(
            f"{where} passed its checksum but its payload cannot be read with "
            f"torch.load(weights_only=True) ({type(exc).__name__}: {exc}); it was written by "
            f"another program or version: {_REWRITE}"
        ) from exc
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
        raise CheckpointError(f"{where} does not hold a LongNetLM (no 'format': {_FORMAT!r})")
    missing = sorted({"config", "model", "extra"} - set(payload))
    if missing:
        raise CheckpointError(f"{where} lacks {missing}; {_REWRITE}")
    try:
        config = LongNetConfig(**payload["config"])
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{where} holds an invalid LongNetConfig: {exc}") from exc
    if overrides:
        known = {f.name for f in dataclasses.fields(LongNetConfig)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(
                f"overrides names unknown LongNetConfig fields {unknown}; fields: {sorted(known)}"
            )
        config = _keeping_schedule(config, dataclasses.replace(config, **overrides), where)
    model = LongNetLM(config)
    if payload.get("dtype"):
        model.to(getattr(torch, payload["dtype"]))
    try:
        model.load_state_dict(payload["model"])
    except (RuntimeError, ValueError) as exc:  # ValueError: a stored schedule not the config's
        raise CheckpointError(
            f"{where}: its weights do not fit the LongNetLM its config describes ({exc})"
        ) from exc
    return Checkpoint(
        model=model.to(map_location), config=config, extra=payload["extra"], path=path
    )
