"""dilated_attention: exact LongNet dilated attention for PyTorch, with a kernel layer that says why
it chose each kernel.

Layout everywhere: (batch, seq_len, num_heads, head_dim).
"""

from .backends.registry import (
    BackendChoice,
    backend_reasons,
    list_backends,
    register_backend,
    use_backend,
)
from .config import DilatedConfig, MultiheadDilatedConfig, longnet_schedule
from .distributed import (
    RingAttention,
    RingDilatedAttention,
    RingMultiheadDilatedAttention,
    ring_attention,
    ring_dilated_attention,
    sequence_positions,
    shard_sequence,
    unshard_sequence,
)
from .factory import (
    KIND_ALIASES,
    create_dilated_attention,
    create_multihead_dilated_attention,
    explain,
    list_kinds,
    register_kind,
)
from .functional import attention, dilated_attention
from .modules import DilatedAttention, MultiheadDilatedAttention

__version__ = "0.1.0"

__all__ = [
    "KIND_ALIASES",
    "BackendChoice",
    "DilatedAttention",
    "DilatedConfig",
    "MultiheadDilatedAttention",
    "MultiheadDilatedConfig",
    "RingAttention",
    "RingDilatedAttention",
    "RingMultiheadDilatedAttention",
    "__version__",
    "attention",
    "backend_reasons",
    "create_dilated_attention",
    "create_multihead_dilated_attention",
    "dilated_attention",
    "explain",
    "list_backends",
    "list_kinds",
    "longnet_schedule",
    "register_backend",
    "register_kind",
    "ring_attention",
    "ring_dilated_attention",
    "sequence_positions",
    "shard_sequence",
    "unshard_sequence",
    "use_backend",
]
