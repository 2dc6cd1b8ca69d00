"""dilated_attention: exact LongNet dilated attention for PyTorch, with a kernel layer that says why
it chose each kernel; ring and block-sparse variants on the same engine.

Layout everywhere: (batch, seq_len, num_heads, head_dim).
"""

from . import patterns
from ._version import __version__
from .backends.registry import (
    BackendChoice,
    backend_reasons,
    list_backends,
    register_backend,
    use_backend,
)
from .config import (
    BlockSelectedConfig,
    CompressedSelectedWindowConfig,
    DilatedConfig,
    MultiheadDilatedConfig,
    longnet_schedule,
)
from .core.decoding.kv_cache import DilatedKVCache
from .core.decoding.static_cache import StaticDilatedKVCache
from .core.decoding.window_cache import StaticWindowKVCache, WindowKVCache
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
from .distributed.rings.block_sparse_ring import (
    BlockSparseRingAttention,
    BlockSparseRingDilatedAttention,
    BlockSparseRingMultiheadAttention,
    BlockSparseRingMultiheadDilatedAttention,
    block_sparse_ring_attention,
)
from .factory import (
    KIND_ALIASES,
    create_block_sparse_attention,
    create_dilated_attention,
    create_multihead_dilated_attention,
    explain,
    list_kinds,
    register_kind,
)
from .functional import attention, block_sparse_attention, dilated_attention
from .models import LongNetConfig, LongNetLM
from .modules import (
    BlockSelectedAttention,
    BlockSparseAttention,
    BlockSparseMultiheadAttention,
    CompressedSelectedWindowAttention,
    DilatedAttention,
    LocalAttention,
    MultiheadAttention,
    MultiheadDilatedAttention,
)

__all__ = [
    "KIND_ALIASES",
    "BackendChoice",
    "BlockSelectedAttention",
    "BlockSelectedConfig",
    "BlockSparseAttention",
    "BlockSparseMultiheadAttention",
    "BlockSparseRingAttention",
    "BlockSparseRingDilatedAttention",
    "BlockSparseRingMultiheadAttention",
    "BlockSparseRingMultiheadDilatedAttention",
    "CompressedSelectedWindowAttention",
    "CompressedSelectedWindowConfig",
    "DilatedAttention",
    "DilatedConfig",
    "DilatedKVCache",
    "LocalAttention",
    "LongNetConfig",
    "LongNetLM",
    "MultiheadAttention",
    "MultiheadDilatedAttention",
    "MultiheadDilatedConfig",
    "RingAttention",
    "RingDilatedAttention",
    "RingMultiheadDilatedAttention",
    "StaticDilatedKVCache",
    "StaticWindowKVCache",
    "WindowKVCache",
    "__version__",
    "attention",
    "backend_reasons",
    "block_sparse_attention",
    "block_sparse_ring_attention",
    "create_block_sparse_attention",
    "create_dilated_attention",
    "create_multihead_dilated_attention",
    "dilated_attention",
    "explain",
    "list_backends",
    "list_kinds",
    "longnet_schedule",
    "patterns",
    "register_backend",
    "register_kind",
    "ring_attention",
    "ring_dilated_attention",
    "sequence_positions",
    "shard_sequence",
    "unshard_sequence",
    "use_backend",
]
