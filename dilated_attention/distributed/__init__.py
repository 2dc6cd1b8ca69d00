"""Ring attention and ring dilated attention over ``torch.distributed`` (gloo on CPU, NCCL on GPU).

Each rank holds a shard of the sequence (``shard_sequence``); the functions and modules return the
rank's shard of the exact single-process result, with exact gradients.
"""

from .modules import RingAttention, RingDilatedAttention, RingMultiheadDilatedAttention
from .ring import ring_attention
from .ring_dilated import ring_dilated_attention
from .sharding import sequence_positions, shard_sequence, unshard_sequence

__all__ = [
    "RingAttention",
    "RingDilatedAttention",
    "RingMultiheadDilatedAttention",
    "ring_attention",
    "ring_dilated_attention",
    "sequence_positions",
    "shard_sequence",
    "unshard_sequence",
]
