"""Loads the native CPU kernels (extension modules built from kernels/cpu/csrc) and registers their XLA
FFI targets. kernels/ holds the hot ops behind one seam each: a pure-JAX reference (the test oracle),
the native CPU kernels and Pallas TPU kernels (kernels/tpu), chosen per platform; it imports none of
our packages, and it has no __init__.py (see setup.py). Which path each kernel takes is logged once and exposed through kernel_paths(), so a
failed build or an explicit SLIPSTREAM_KERNELS=reference is never silent."""
from __future__ import annotations

import importlib
import logging

import jax

from slipstream.kernels import settings

log = logging.getLogger(__name__)

_modules: dict[str, str] = {}     # kernel -> its native module, for those that loaded
_paths: dict[str, str] = {}       # kernel -> "native" | "pallas" | "reference", once asked for
_registered: dict[str, bool] = {}  # extension module -> loaded and registered


def reference_forced() -> bool:
    return settings.KERNELS.get() == "reference"


def load(kernel: str, module: str) -> bool:
    """True when `kernel` runs natively on CPU: the extension kernels._<module> imports and its FFI
    targets (module.targets(): name -> PyCapsule) are registered with XLA for the CPU platform."""
    if kernel in _paths:
        return _paths[kernel] == "native"
    ok = False
    if reference_forced():
        log.warning("kernel %s: pure-JAX reference (SLIPSTREAM_KERNELS=reference)", kernel)
    else:
        ok = _register(module)
        if ok:
            ext = importlib.import_module(f"slipstream.kernels._{module}")
            if hasattr(ext, "set_isa"):
                _cap_isa(ext)
            isa = ext.isa() if hasattr(ext, "isa") else "?"
            if hasattr(ext, "load_ahead"):  # the attention kernel's K/V load policy for this CPU
                _attention_env(ext)
                isa += f", load_ahead={ext.load_ahead()}"
            log.info("kernel %s: native CPU (kernels._%s, %s)", kernel, module, isa)
            _modules[kernel] = module
    _paths[kernel] = "native" if ok else "reference"
    return ok


ISAS = ("portable", "avx2", "avx512", "avx512_vnni", "amx")  # each implies the ones before it


def _cap_isa(ext) -> None:
    """SLIPSTREAM_CPU_ISA: the module runs its best path at or below the asked instruction set."""
    asked = settings.CPU_ISA.get()
    if asked is None:
        return
    if asked not in ISAS:
        log.warning("SLIPSTREAM_CPU_ISA=%r is not one of %s: using this CPU's best", asked, ", ".join(ISAS))
        return
    for isa in reversed(ISAS[:ISAS.index(asked) + 1]):
        try:
            ext.set_isa(isa)
            return
        except ValueError:  # this module has no such path, or this CPU cannot run it
            continue


def _attention_env(ext) -> None:
    """The attention kernel's K/V settings from the environment (the C++ reads none):
    SLIPSTREAM_KV_LOAD_AHEAD=all|scattered|prefetch and SLIPSTREAM_KV_HUGE_PAGES=0."""
    asked = settings.KV_LOAD_AHEAD.get()
    if asked in ("all", "scattered", "prefetch"):
        ext.load_ahead(asked)
    elif asked is not None:
        log.warning("SLIPSTREAM_KV_LOAD_AHEAD=%r is not 'all', 'scattered' or 'prefetch': using this CPU's default (%s)",
                    asked, ext.load_ahead())
    if not settings.KV_HUGE_PAGES.get():
        ext.huge_pages(False)


def _register(module: str) -> bool:
    if module not in _registered:
        try:
            ext = importlib.import_module(f"slipstream.kernels._{module}")
            for name, capsule in ext.targets().items():
                jax.ffi.register_ffi_target(name, capsule, platform="cpu")
            _registered[module] = True
        except (ImportError, AttributeError, OSError) as exc:
            log.error("native CPU kernel module kernels._%s is unavailable (%s): the pure-JAX reference "
                      "runs instead, several times slower on CPU. Rebuild with `pip install -e .`.",
                      module, exc)
            _registered[module] = False
    return _registered[module]


def use_pallas(kernel: str) -> bool:
    """True when `kernel` runs as its Pallas TPU kernel (the merged KV layout's path on TPU); logged once.
    SLIPSTREAM_KERNELS=reference forces the pure-JAX reference."""
    if kernel not in _paths:
        if reference_forced():
            log.warning("kernel %s: pure-JAX reference (SLIPSTREAM_KERNELS=reference)", kernel)
            _paths[kernel] = "reference"
        else:
            log.info("kernel %s: Pallas TPU (kernels/tpu)", kernel)
            _paths[kernel] = "pallas"
    return _paths[kernel] == "pallas"


def note_reference(kernel: str, why: str) -> None:
    """Record (and log once) that `kernel` runs as the pure-JAX reference, and why."""
    if kernel not in _paths:
        log.warning("kernel %s: pure-JAX reference (%s)", kernel, why)
        _paths[kernel] = "reference"


def decisions() -> dict[str, list]:
    """kernel -> [path, native module or None]: what tracing chose so far, to be replayed (`replay`) by a
    process that loads the compiled programs instead of tracing them."""
    return {kernel: [path, _modules.get(kernel)] for kernel, path in sorted(_paths.items())}


def replay(record: dict[str, list]) -> bool:
    """Make the choices of `decisions()` again (load and register the native modules, set their ISA and
    K/V settings, log each path); False when a native module that was used then is unavailable now."""
    ok = True
    for kernel, (path, module) in record.items():
        if path == "native":
            ok = load(kernel, module) and ok
        elif path == "pallas":
            use_pallas(kernel)
        else:
            note_reference(kernel, "as when the loaded programs were compiled")
    return ok


def kernel_isas() -> dict[str, str]:
    """kernel name -> the instruction set its native CPU kernel runs now ("amx", "avx512_vnni", "avx2", ...),
    for every kernel that runs natively (/metrics)."""
    out = {}
    for kernel, module in sorted(_modules.items()):
        ext = importlib.import_module(f"slipstream.kernels._{module}")
        if _paths.get(kernel) == "native" and hasattr(ext, "isa"):
            out[kernel] = ext.isa()
    return out


def kernel_paths() -> dict[str, str]:
    """kernel name -> "native", "pallas" or "reference", for every kernel asked for so far (logs, /metrics)."""
    return dict(_paths)
