"""Whole compiled programs in the compile cache (engine/device/executables.py). Loading them runs on
TPUs and GPUs only (benchmarks/device.py --startup checks a warm server there against the cold one);
on CPU these tests check the keys, the pruning, and that engines keep tracing."""
from __future__ import annotations

import os

import jax
import pytest

from slipstream.engine.device import executables
from slipstream.engine.device.executables import ExecutableStore
from slipstream.engine.device.runner import EngineConfig, JaxEngine
from tests.conftest import TINY_ENGINE


def _store(root, identity="model A, 4 slots"):
    return ExecutableStore(root, jax.devices()[:1], identity)


def test_the_key_follows_the_configuration_and_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("SLIPSTREAM_KERNELS", raising=False)
    a, again = _store(tmp_path), _store(tmp_path)
    assert a.dir == again.dir
    other = _store(tmp_path, "model A, 8 slots")
    assert other.dir != a.dir and other.version_dir == a.version_dir  # one code version, two configurations
    monkeypatch.setenv("SLIPSTREAM_KERNELS", "reference")  # kernels chosen otherwise: other programs
    assert _store(tmp_path).dir != a.dir


def test_a_missing_or_unreadable_program_loads_none(tmp_path):
    store = _store(tmp_path)
    assert store.load_all(["model-1"]) is None
    store.dir.mkdir(parents=True)
    (store.dir / "model-1.exe").write_bytes(b"not a program")
    assert store.load_all(["model-1"]) is None
    assert not (store.dir / "model-1.exe").exists()  # deleted: compiled and saved again next time
    assert store.loaded == 0


def test_old_code_versions_are_pruned(tmp_path):
    root = tmp_path / executables.SUBDIR
    for i in range(5):
        (root / f"old{i}" / "cfg").mkdir(parents=True)
        os.utime(root / f"old{i}", (1000 + i, 1000 + i))
    store = _store(tmp_path)
    store.version_dir.mkdir(parents=True)
    store.prune(keep=3)
    assert sorted(p.name for p in root.iterdir()) == sorted([store.version_dir.name, "old4", "old3"])


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU rule")
def test_cpu_engines_trace_even_with_the_store_enabled(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(executables, "_root", str(tmp_path))
    cfg, params = tiny_model
    engine = JaxEngine(cfg, params, EngineConfig(**TINY_ENGINE))
    assert engine.programs_loaded == 0
    assert not (tmp_path / executables.SUBDIR).exists()
