"""Builds the native CPU kernels (kernels/cpu/csrc/*.cc, one extension module each) against the XLA FFI
headers that jaxlib ships. The build is optional: a failure is reported here and again, loudly, at
run time (kernels.native logs which path each kernel takes), and the pure-JAX references run."""
import glob
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class ParallelBuildExt(build_ext):
    """Compiles the kernels side by side, one per core (they are independent translation units)."""

    def finalize_options(self):
        super().finalize_options()
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1


def _extensions() -> list[Extension]:
    import jax.ffi  # build-system.requires pins jax/jaxlib to the runtime's version

    # -fno-wrapv undoes the -fwrapv of Python's own CFLAGS, which setuptools puts first: signed overflow
    # defined as wrapping costs the attention kernel's loops (AMD Zen 4, f32 32 x 384 step, consecutive
    # pages: 27.8 -> 24.9 ms; the f32 matmul unchanged)
    flags = ["-O3", "-std=c++17", "-fvisibility=hidden", "-fno-math-errno", "-fno-wrapv"]
    if os.environ.get("SLIPSTREAM_KERNELS_DEBUG"):
        flags = ["-O0", "-g", "-std=c++17"]
    return [Extension(f"kernels._{os.path.splitext(os.path.basename(src))[0]}", [src],
                      include_dirs=[jax.ffi.include_dir()], extra_compile_args=flags,
                      depends=sorted(glob.glob("kernels/cpu/csrc/**/*.h", recursive=True)),
                      language="c++", optional=True)
            for src in sorted(glob.glob("kernels/cpu/csrc/*.cc"))]


setup(ext_modules=_extensions(), cmdclass={"build_ext": ParallelBuildExt})
