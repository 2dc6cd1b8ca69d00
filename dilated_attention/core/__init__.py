"""The one executor of kernel-call plans, branch geometry, the (out, lse) merge and the readable
reference attention."""
