"""A process-wide count of XLA compilations (incl. persistent-cache loads), from JAX's monitoring events.

Exported as a metric and asserted in tests: it must stay flat once the buckets are compiled.
"""
from __future__ import annotations

import os
import threading

import jax

_EVENT = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()
_count = 0
_installed = False


def _on_event(event: str, duration: float, **_: object) -> None:
    global _count
    if event == _EVENT:
        with _lock:
            _count += 1


def install() -> None:
    global _installed
    with _lock:
        if not _installed:
            jax.monitoring.register_event_duration_secs_listener(_on_event)
            _installed = True


def compiles() -> int:
    install()
    return _count


def enable_compilation_cache(path: str | None) -> None:
    """JAX's persistent compilation cache, so a restart loads executables instead of compiling."""
    if not path:
        return
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
