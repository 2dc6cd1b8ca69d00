"""Content-selected sparsity: block masks and compressed keys chosen from the queries and keys
at run time, the parts of MoBA- and NSA-style attention that come before the attention itself.

- :func:`select_blocks`: each query block's key blocks by MoBA's gate (its queries against
  each key block's mean key), a bool block mask ``(B, H or Hkv, Mq, Mk)`` on the inputs'
  device, made without host synchronisation (Note [MoBA's gate for a block of queries] in
  ``selection.py``).
- :func:`compress_kv`, :func:`compressed_key_mask`: NSA's compressed keys and values (windows
  of positions mean-pooled) and which of them each query sees (Note [Compressed keys] in
  ``compression.py``).

Example (MoBA with 3 chosen blocks besides each query block's own)::

    mask = select_blocks(q, k, block_size=128, topk=3, is_causal=True)  # (B, H, Mq, Mk)
"""

from .compression import compress_kv, compressed_key_mask
from .selection import select_blocks

__all__ = ["compress_kv", "compressed_key_mask", "select_blocks"]
