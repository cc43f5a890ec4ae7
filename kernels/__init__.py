"""Hot ops behind one seam each: a pure-JAX reference (the default on GPU/TPU and the test oracle)
and native CPU kernels (C++ through XLA's FFI), chosen per platform. Imports none of our packages."""
from kernels.native import kernel_paths

__all__ = ["kernel_paths"]
