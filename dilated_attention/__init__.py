"""dilated_attention: exact LongNet dilated attention for PyTorch, with a kernel layer that says why
it chose each kernel.

Layout everywhere: (batch, seq_len, num_heads, head_dim).
"""

from .backends.registry import backend_reasons, list_backends
from .functional import attention, dilated_attention
from .modules import DilatedAttention, MultiheadDilatedAttention

__version__ = "0.1.0"

__all__ = [
    "DilatedAttention",
    "MultiheadDilatedAttention",
    "__version__",
    "attention",
    "backend_reasons",
    "dilated_attention",
    "list_backends",
]
