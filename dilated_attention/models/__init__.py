"""Models built on dilated attention: the LongNet decoder-only language model.

``import dilated_attention.models`` (not re-exported from the top-level package).
"""

from .longnet import PRESETS, LongNetAttention, LongNetBlock, LongNetConfig, LongNetLM
from .rotary import RotaryEmbedding

__all__ = [
    "PRESETS",
    "LongNetAttention",
    "LongNetBlock",
    "LongNetConfig",
    "LongNetLM",
    "RotaryEmbedding",
]
