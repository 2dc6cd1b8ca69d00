"""The segmenting engine, the (out, lse) merge and the readable reference attention."""
