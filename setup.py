"""Installs the repository's top-level directories under one import namespace (`server/` is
`slipstream.server`, ...: no installed name can clash with another distribution's), and builds the
native CPU kernels (kernels/cpu/csrc/*.cc, one extension module each) against the XLA FFI headers that
jaxlib ships. The kernel build is optional: a failure is reported here and again, loudly, at run time
(slipstream.kernels.native logs which path each kernel takes), and the pure-JAX references run."""
import glob
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# The directories that make up the product (benchmarks/ and tests/ are the lab: run from a clone).
PRODUCT = ("server", "engine", "models", "quantization", "kernels")


class ParallelBuildExt(build_ext):
    """Compiles the kernels side by side, one per core (they are independent translation units)."""

    def finalize_options(self):
        super().finalize_options()
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1


def _packages() -> dict[str, str]:
    """slipstream.<dir>[.<sub>...] -> its directory: each top-level directory, and every folder below
    with an __init__.py. kernels/ has no __init__.py: run from the repository root (tests, benchmarks),
    the bare name `kernels` must still find Hugging Face's `kernels` package (transformers imports it),
    and a directory without __init__.py never shadows a regular package later on sys.path."""
    found = {}
    for top in PRODUCT:
        for root, dirs, files in os.walk(top):
            dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
            if root == top or "__init__.py" in files:
                found["slipstream." + root.replace(os.sep, ".")] = root
    return found


# A kernel whose float steps must be the same operations on every path (its outputs bit for bit equal whichever
# unit formed the integer sums): no mul + add contracted into an fma behind its back.
OWN_FLAGS = {"int8_channel_matmul": ["-ffp-contract=off"]}


def _name(src: str) -> str:
    return os.path.splitext(os.path.basename(src))[0]


def _extensions() -> list[Extension]:
    import jax.ffi  # build-system.requires pins jax/jaxlib to the runtime's version

    # -fno-wrapv undoes the -fwrapv of Python's own CFLAGS, which setuptools puts first: signed overflow
    # defined as wrapping costs the attention kernel's loops (AMD Zen 4, f32 32 x 384 step, consecutive
    # pages: 27.8 -> 24.9 ms; the f32 matmul unchanged)
    flags = ["-O3", "-std=c++17", "-fvisibility=hidden", "-fno-math-errno", "-fno-wrapv"]
    if os.environ.get("SLIPSTREAM_KERNELS_DEBUG"):
        flags = ["-O0", "-g", "-std=c++17"]
    return [Extension(f"slipstream.kernels._{_name(src)}", [src],
                      include_dirs=[jax.ffi.include_dir(), "kernels/cpu/csrc"],
                      extra_compile_args=flags + OWN_FLAGS.get(_name(src), []),
                      depends=sorted(glob.glob("kernels/cpu/csrc/**/*.h", recursive=True)),
                      language="c++", optional=True)
            for src in sorted(glob.glob("kernels/cpu/csrc/*.cc"))]


PACKAGES = _packages()
setup(packages=sorted(PACKAGES), package_dir=PACKAGES, ext_modules=_extensions(),
      cmdclass={"build_ext": ParallelBuildExt})
