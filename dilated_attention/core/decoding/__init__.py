"""Decoding: caches of keys and values and the calls of queries at the last positions."""
