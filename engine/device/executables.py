"""The engine's compiled programs on disk, beside JAX's compilation cache, so a warm start skips
tracing too.

JAX's persistent cache is keyed by the lowered program, so even a warm start traces and lowers
every bucket in Python before each lookup (on a TPU, ~1 s a program: most of a warm start's
"compile"). On TPUs and GPUs this store keys whole executables by what they are built from instead,
and loads them without tracing:

- the source of every module of the installed package (any code change is a new key),
- jax and jaxlib versions, the backend and its version, the engine's devices,
- the environment's SLIPSTREAM_*, XLA_*, LIBTPU_* and JAX_* variables,
- what the engine passes: its configs and every argument's shape, dtype and sharding.

A key that misses (or a file that fails to load) falls back to lowering and compiling, then writes
the executable. The programs of all but the latest `KEEP_VERSIONS` code versions are removed.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pickle
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import jax
import jaxlib
from jax._src import config as jax_config  # its enable_compilation_cache context (thread-local)
from jax.experimental import serialize_executable

from slipstream.kernels import native

log = logging.getLogger(__name__)

SUBDIR = "slipstream-executables"
KEEP_VERSIONS = 3  # code versions whose programs are kept (each with every configuration it compiled)
_ENV_PREFIXES = ("SLIPSTREAM_", "XLA_", "LIBTPU_", "JAX_", "TPU_")
_PACKAGE = Path(__file__).resolve().parents[2]  # the slipstream package's root (server/, engine/, ...)
_LAYERS = ("server", "engine", "models", "quantization", "kernels")


@functools.cache
def source_digest() -> str:
    """sha256 over the package's Python and C++ sources and built modules (names and bytes)."""
    h = hashlib.sha256()
    for layer in _LAYERS:
        for path in sorted((_PACKAGE / layer).rglob("*")):
            if path.is_file() and path.suffix in (".py", ".cc", ".h", ".so", ".json"):
                h.update(str(path.relative_to(_PACKAGE)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


_root: str | None = None


def enable(path: str | None) -> None:
    """Engines built from now on in this process load and save whole programs under `path` (the
    server's --compile-cache; None or "": off)."""
    global _root
    _root = path or None


def avals(tree) -> str:
    """Shapes, dtypes and shardings of a pytree of arrays or ShapeDtypeStructs, with its structure."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    parts = [str(treedef)]
    for x in leaves:
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            parts.append(f"{tuple(x.shape)}:{x.dtype}:{getattr(x, 'sharding', None)}")
        else:
            parts.append(repr(x))
    return "|".join(parts)


class ExecutableStore:
    """Compiled programs of one engine configuration, loaded and saved by name, under
    SUBDIR/<code version>/<configuration>/ (a code version: the package's sources and jax's)."""

    def __init__(self, root: str | os.PathLike, devices: list, identity: str):
        self.devices = list(devices)
        backend = self.devices[0].client
        code = "\n".join([source_digest(), jax.__version__, jaxlib.__version__, backend.platform,
                          backend.platform_version])
        env = sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES))
        config = "\n".join([repr([(d.id, d.device_kind) for d in self.devices]), repr(env), identity])
        self.root = Path(root) / SUBDIR
        self.version_dir = self.root / hashlib.sha256(code.encode()).hexdigest()[:16]
        self.dir = self.version_dir / hashlib.sha256(config.encode()).hexdigest()[:32]
        self.loaded = 0

    @classmethod
    def enabled(cls, devices: list, identity: Callable[[], str]) -> ExecutableStore | None:
        """The store under the directory `enable` named, or None: not enabled (the default: engines
        trace), on CPU, or the engine spans processes (each process compiles its own part). `identity`
        (the engine's configuration as text) is asked only for a store."""
        if _root is None or jax.process_count() > 1 or devices[0].platform == "cpu":
            # XLA:CPU: an executable loaded this way can fail when it runs ("Function wrapped_iota not
            # found"); CPU programs trace in seconds, and JAX's own cache still serves them
            return None
        return cls(_root, devices, identity())

    def replay_kernels(self) -> bool:
        """Before loading: the kernel choices the saved programs were traced with (native modules
        registered with XLA, their ISA settings; the start-up line and /metrics name them). False when
        nothing is saved yet or a native module those programs call is unavailable now."""
        path = self.dir / "kernels.json"
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            return False
        return native.replay(record)

    def save_kernels(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / "kernels.json").write_text(json.dumps(native.decisions()))
        except OSError as e:
            log.warning("kernel choices of %s not saved: %s", self.dir, e)

    @staticmethod
    def compile(lowered):
        """A program compiled here, for `save`: never one JAX's own cache loaded (on XLA:CPU such an
        executable, serialized again, missed the functions of its fusions when it ran; unverified on TPU,
        so the store keeps only what it compiled itself)."""
        with jax_config.enable_compilation_cache(False):  # thread-local: this compile only
            return lowered.compile()

    def _path(self, name: str) -> Path:
        return self.dir / f"{name}.exe"

    def load_all(self, names: list[str]) -> dict | None:
        """name -> the compiled program saved under it, for every name; or None when any is missing or
        unreadable (an unreadable file is deleted: the engine compiles them all and saves them again).
        The files are read in turn and loaded onto the device a thread each."""
        paths = [self._path(name) for name in names]
        if not all(p.exists() for p in paths):
            return None

        def load(path: Path):
            with open(path, "rb") as f:
                payload, in_tree, out_tree = pickle.load(f)
            return serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, backend=self.devices[0].client, execution_devices=self.devices)

        with ThreadPoolExecutor(max_workers=min(len(paths), os.cpu_count() or 1) or 1) as pool:
            futures = {name: pool.submit(load, path) for name, path in zip(names, paths)}
        out = {}
        for (name, future), path in zip(futures.items(), paths):
            try:
                out[name] = future.result()
            except Exception as e:  # a truncated or foreign file
                log.warning("compiled program %s unreadable (%s: %s); compiling them all again", path,
                            type(e).__name__, e)
                path.unlink(missing_ok=True)
                return None
        self.loaded = len(out)
        return out

    def save(self, name: str, compiled) -> None:
        """Writes `compiled` (atomically); a program that can't be serialized is skipped with a log line."""
        try:
            payload, in_tree, out_tree = serialize_executable.serialize(compiled)
            data = pickle.dumps((payload, in_tree, out_tree), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            log.info("compiled program %s not saved (%s: %s)", name, type(e).__name__, e)
            return
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self._path(name))
        except OSError as e:  # a full disk, or another process pruning this version just now
            log.warning("compiled program %s not saved: %s", name, e)

    def prune(self, keep: int = KEEP_VERSIONS) -> None:
        """Removes the programs of all but the `keep` most recently used code versions (this one is the
        newest): an upgrade's old programs go, every configuration of the current code stays."""
        try:
            os.utime(self.version_dir)
            versions = sorted((p for p in self.root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime,
                              reverse=True)
        except OSError:
            return
        for old in versions[keep:]:
            shutil.rmtree(old, ignore_errors=True)
