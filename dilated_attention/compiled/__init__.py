"""``torch.compile``, ``torch.export`` and ``torch.func`` support: the public functions as custom
operators (Note [Custom operators for torch.compile and torch.func] in ``operators.py``).

    tracing.py    when a call runs through the operators (is_traced); the ring functions'
                  refusals (eager_only, reject_traced)
    routing.py    route(), run(): a checked request run eagerly or through its operator
    options.py    a request as an operator's options, and back
    operators.py  the operators: definitions, implementations, fake functions, gradients, and
                  torch.func's autograd around them
    vmap.py       their torch.func.vmap rules: the mapped dimension folded into the batch
"""

from ..pattern_keys import pattern_key
from .routing import route, run
from .tracing import eager_only, is_traced, reject_traced

__all__ = ["eager_only", "is_traced", "pattern_key", "reject_traced", "route", "run"]
