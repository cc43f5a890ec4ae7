"""What a start-up log says about the hardware: the device jax serves on (its default backend: an
accelerator whenever its plugin is installed) and the path each kernel takes there."""
from __future__ import annotations

import jax


def device_summary() -> str:
    devices = jax.devices()
    return f"{len(devices)} x {devices[0].device_kind} ({jax.default_backend()} backend, jax {jax.__version__})"


def kernel_paths_here() -> dict[str, str]:
    """Each kernel's path on the default backend. kernels.native's "native" kernels are CPU-only (the
    programs pick them with lax.platform_dependent), so on another backend that op runs the pure-JAX
    reference; other paths are reported as the kernels record them."""
    from slipstream.kernels.native import kernel_paths

    cpu = jax.default_backend() == "cpu"
    return {k: v if cpu or v != "native" else "reference" for k, v in kernel_paths().items()}


def kernel_summary() -> str:
    """"cpu: q8_matmul native, ..." for every kernel asked for so far (log after compiling)."""
    paths = kernel_paths_here()
    return f"{jax.default_backend()}: " + (", ".join(f"{k} {v}" for k, v in sorted(paths.items())) or "none")
