"""The ring operations: the one ring template and every attention run over it (dense, dilated,
packed, block-sparse, run-time masks, MoBA, NSA, windows, a head all-to-all).
"""
