"""Our Triton kernels of ``select_blocks``: the block means' bfloat16 parts and the choice of
each query block's top key blocks."""
