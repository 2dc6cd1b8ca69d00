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
- :mod:`.selected`: :class:`BlockSelectedAttention` (MoBA-style, kind ``"moba"``) and
  :class:`CompressedSelectedWindowAttention` (NSA-style, kind ``"nsa"``), blocks selected from
  the content; the factory's constructors of those kinds (``SELECTED_KINDS``).

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
from .selected import FACTORY_KINDS as SELECTED_KINDS
from .selected import BlockSelectedAttention, CompressedSelectedWindowAttention

__all__ = [
    "FACTORY_KINDS",
    "LAYER_ARGUMENTS",
    "SELECTED_KINDS",
    "BlockSelectedAttention",
    "BlockSparseAttention",
    "BlockSparseMultiheadAttention",
    "CompressedSelectedWindowAttention",
    "DilatedAttention",
    "LocalAttention",
    "MultiheadAttention",
    "MultiheadDilatedAttention",
    "build_block_sparse_kind",
    "build_local",
    "build_local_multihead",
]
