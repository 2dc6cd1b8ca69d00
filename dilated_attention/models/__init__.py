"""Models built on dilated attention: the LongNet decoder-only language model, and checkpoints.

``LongNetLM`` and ``LongNetConfig`` are also exported by the top-level package
(``from dilated_attention import LongNetLM``). Save and load a model with :func:`save_checkpoint` /
:func:`load_checkpoint` (checksummed; see :mod:`dilated_attention.models.checkpoint`).
"""

from ..rotary import RotaryEmbedding
from .checkpoint import (
    CHECKPOINT_VERSION,
    Checkpoint,
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
)
from .longnet import PRESETS, LongNetAttention, LongNetBlock, LongNetConfig, LongNetLM

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
