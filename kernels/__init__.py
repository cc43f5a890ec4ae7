"""Hot ops behind one seam each: a pure-JAX reference (the default on GPU and the test oracle), native
CPU kernels (C++ through XLA's FFI) and Pallas TPU kernels (kernels/tpu), chosen per platform. Imports
none of our packages."""
from kernels.native import kernel_paths

__all__ = ["kernel_paths"]
