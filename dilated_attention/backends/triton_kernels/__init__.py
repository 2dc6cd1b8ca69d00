"""Our Triton kernels: their device code, launchers, tiles, compiles and bound launches."""
