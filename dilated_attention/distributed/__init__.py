"""Ring attention and ring dilated attention over ``torch.distributed`` (gloo on CPU, NCCL on GPU).

Each rank holds a shard of the sequence (``shard_sequence``); the functions and modules return the
rank's shard of the exact single-process result, with exact gradients.

Every rank of the group must make the same calls: each call first agrees across ranks on its
shapes, options and grad mode, so a mismatched or rejected call raises on every rank. A rank that
never reaches a call (it raised in its own code and goes on) leaves the others waiting until the
process group's timeout: pass ``init_process_group(timeout=...)`` (docs/ring.md, "Timeouts").
"""

from .context import ContextParallel
from .layout.cost import SplitPlan, Topology, plan_context_parallel
from .layout.sharding import sequence_positions, shard_sequence, unshard_sequence
from .modules import (
    RingAttention,
    RingDilatedAttention,
    RingMultiheadAttention,
    RingMultiheadDilatedAttention,
)
from .parallelize import context_parallel
from .rings.block_sparse_ring import block_sparse_ring_attention
from .rings.moba_ring import moba_ring_attention
from .rings.nsa_ring import nsa_ring_attention
from .rings.packed_ring import RingLoad, ring_load
from .rings.ring import ring_attention
from .rings.ring_dilated import ring_dilated_attention

__all__ = [
    "ContextParallel",
    "RingAttention",
    "RingDilatedAttention",
    "RingLoad",
    "RingMultiheadAttention",
    "RingMultiheadDilatedAttention",
    "SplitPlan",
    "Topology",
    "block_sparse_ring_attention",
    "context_parallel",
    "moba_ring_attention",
    "nsa_ring_attention",
    "plan_context_parallel",
    "ring_attention",
    "ring_dilated_attention",
    "ring_load",
    "sequence_positions",
    "shard_sequence",
    "unshard_sequence",
]
