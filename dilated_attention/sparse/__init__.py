"""Content-selected sparsity: block masks and compressed keys chosen from the queries and keys
at run time, and the MoBA- and NSA-style attention built on them and the library's kernels.

- :func:`select_blocks`: each query block's key blocks by MoBA's gate (its queries against
  each key block's mean key), a bool block mask ``(B, H or Hkv, Mq, Mk)`` on the inputs'
  device, made without host synchronisation (Note [MoBA's gate for a block of queries] in
  ``selection.py``).
- :func:`compress_kv`, :func:`compressed_key_mask`: NSA's compressed keys and values (windows
  of positions mean-pooled) and which of them each query sees (Note [Compressed keys] in
  ``compression.py``).
- :func:`moba_attention`: MoBA, the selected blocks attended on the block-sparse engine.
- :func:`nsa_attention`: NSA's three branches (compressed keys, selected blocks, a sliding
  window) combined by gates or merged exactly (Note [NSA's three branches] in ``nsa.py``,
  Note [Gated branches] and Note [A differentiable log-sum-exp] in ``branches.py``).

Example (MoBA with 3 chosen blocks besides each query block's own)::

    mask = select_blocks(q, k, block_size=128, topk=3, is_causal=True)  # (B, H, Mq, Mk)
    out = moba_attention(q, k, v, block_size=128, topk=3)  # the same blocks, attended
"""

from .compression import compress_kv, compressed_key_mask
from .moba import moba_attention
from .nsa import nsa_attention
from .selection import select_blocks

__all__ = [
    "compress_kv", "compressed_key_mask", "moba_attention", "nsa_attention", "select_blocks",
]  # fmt: skip
