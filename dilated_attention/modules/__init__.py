"""``nn.Module`` layers: :class:`MultiheadAttention` (the one multihead layer) and the inner
modules it wraps.

- :mod:`.multihead`: :class:`MultiheadAttention`, projections q/k/v, optional rotary positions,
  an inner (B, N, H, D) module, sub-LayerNorm and the output projection, with
  ``nn.MultiheadAttention``'s call.
- :mod:`.torch_compat`: what torch's Transformer layers pass to the layer and read from it.
- :mod:`.dilated`: :class:`DilatedAttention` and :class:`MultiheadDilatedAttention`.
- :mod:`.block_sparse`: :class:`BlockSparseAttention`, :class:`BlockSparseMultiheadAttention`
  and the factory's constructors of kind ``"block_sparse"`` (``FACTORY_KINDS``).
- :mod:`.local`: :class:`LocalAttention` (sliding windows) and the factory's constructors of
  kind ``"local"`` (the library's :class:`MultiheadAttention` around it).

Nothing here imports :mod:`dilated_attention.distributed`: the ring layers wrap these from outside.
"""

from .block_sparse import (
    FACTORY_KINDS,
    BlockSparseAttention,
    BlockSparseMultiheadAttention,
    build_block_sparse_kind,
)
from .dilated import DilatedAttention, MultiheadDilatedAttention
from .local import LocalAttention, build_local, build_local_multihead
from .multihead import LAYER_ARGUMENTS, MultiheadAttention

__all__ = [
    "FACTORY_KINDS",
    "LAYER_ARGUMENTS",
    "BlockSparseAttention",
    "BlockSparseMultiheadAttention",
    "DilatedAttention",
    "LocalAttention",
    "MultiheadAttention",
    "MultiheadDilatedAttention",
    "build_block_sparse_kind",
    "build_local",
    "build_local_multihead",
]
