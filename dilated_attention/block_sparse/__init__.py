"""Block-sparse attention: dense attention restricted to the block pairs a pattern keeps.

Block ``i`` holds tokens ``[i * block_size, (i + 1) * block_size)`` (the last block may be
shorter). Query token ``p`` in block ``i`` attends key token ``t`` in block ``j`` when the
pattern keeps ``(i, j)`` and, for a causal call, ``t <= p`` (a causal query shorter than the key
is its last positions: Note [End-aligned causal blocks] in ``resolve/resolver.py``). For 4 blocks
of 2 tokens, ``LocalWindow(0)`` and ``is_causal=True``::

    key         0 1 2 3 4 5 6 7
    query 0     x . . . . . . .
    query 1     x x . . . . . .
    query 2     . . x . . . . .
    query 3     . . x x . . . .
    ...

Four kernels compute it: the fallback, FlashAttention-4's block sparsity (Note [FlashAttention-4
block sparsity] in ``backends/flash_attn4/__init__.py``), FlexAttention, and our block-sparse
Triton kernels (Note [Block-sparse Triton kernels] in
``backends/triton_kernels/block_sparse.py``); the resolve step chooses among them
(``resolve/resolver.py``), and ``block_sparse_attention`` in ``functional.py`` is the public
function.

In place of a pattern, a call may give a run-time block mask, per batch row and head, on the
inputs' device (Note [Run-time block masks] in ``runtime.py``).

The package: ``plan.py`` (block geometry and kernel calls, which the one executor runs on any
dense kernel), ``runtime.py`` (run-time masks: checks, kept pairs, lists made on the device),
``rows.py`` (a run-time mask on any dense kernel), ``tiles.py`` (the 128 x 128 tiles
FlexAttention and FA4 walk), ``fa4.py`` (FA4's tile lists and runner), ``flex.py``
(FlexAttention block masks), ``triton_autograd.py`` (our block-sparse Triton kernels).
"""

from .plan import SparseCall, plan_calls

__all__ = ["SparseCall", "plan_calls"]
