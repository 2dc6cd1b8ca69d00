"""Models built on dilated attention: the LongNet decoder-only language model, and checkpoints.

The model is :class:`LongNetLM` (``longnet.py``): configured by :class:`LongNetConfig`
(``config.py``), built of blocks (:class:`LongNetBlock`, ``blocks.py``), sampled by its
``generate`` and ``stream`` (``generation.py``).

``LongNetLM`` and ``LongNetConfig`` are also exported by the top-level package
(``from dilated_attention import LongNetLM``). Save and load a model with :func:`save_checkpoint` /
:func:`load_checkpoint` (checksummed; see :mod:`dilated_attention.models.checkpoint`).
"""

from ..rotary import RotaryEmbedding
from .blocks import LongNetAttention, LongNetBlock
from .checkpoint import (
    CHECKPOINT_VERSION,
    Checkpoint,
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
)
from .config import PRESETS, LongNetConfig
from .longnet import LongNetLM

__all__ = [
    "CHECKPOINT_VERSION",
    "PRESETS",
    "Checkpoint",
    "CheckpointError",
    "LongNetAttention",
    "LongNetBlock",
    "LongNetConfig",
    "LongNetLM",
    "RotaryEmbedding",
    "load_checkpoint",
    "save_checkpoint",
]
