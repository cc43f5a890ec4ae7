"""The import graph of the installed packages: one namespace, imports pointing one way, no cycles.

`python -m pytest tests/test_import_graph.py` is the check; every import counts, including those
inside functions and under TYPE_CHECKING.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
# Highest layer first: a package may import only itself and the packages after it.
LAYERS = ("server", "engine", "models", "quantization", "kernels")
# engine's rooms: the host side (engine/*.py) must not reach into the device or distributed rooms.
ENGINE_ROOMS = ("device", "distributed")
NO_JAX = ("engine/scheduler.py", "engine/step_loop.py", "engine/kv_cache.py", "engine/prefix_cache.py",
          "engine/block_manager.py", "engine/schedule.py", "engine/step_plan.py", "engine/lora_registry.py")


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["slipstream", *parts])


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for top in LAYERS for p in sorted((REPO / top).rglob("*.py"))}


def _imports(path: pathlib.Path, name: str, modules: frozenset[str] = frozenset()) -> set[str]:
    """What the file imports: `from P import m` counts as an import of the module P.m when that is a
    module, else of P (a package's __init__ runs on any import below it, so it is no edge of its own)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            subs = {f"{base}.{a.name}" for a in node.names} & modules
            found.update(subs)
            if len(subs) < len(node.names):
                found.add(base)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        graph[name] = {m for m in _imports(path, name, frozenset(mods)) if m in mods and m != name}
    return graph


def _layer(module: str) -> int:
    return LAYERS.index(module.split(".")[1])


def test_every_module_uses_the_slipstream_namespace():
    offenders = []
    for path in sorted(REPO.rglob("*.py")):
        if any(part.startswith(".") or part in ("build", "__pycache__") for part in path.relative_to(REPO).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            offenders += [f"{path.relative_to(REPO)}:{node.lineno} {n}" for n in names if n.split(".")[0] in LAYERS]
    assert not offenders, "imports of the bare top-level names (use slipstream.*):\n" + "\n".join(offenders)


def test_no_import_goes_up_a_layer():
    up = [f"{a} -> {b}" for a, deps in _graph().items() for b in deps if _layer(b) < _layer(a)]
    assert not up, "\n".join(up)


def test_the_engine_host_side_does_not_import_its_device_or_distributed_rooms():
    bad = []
    for a, deps in _graph().items():
        parts = a.split(".")
        if parts[1:2] == ["engine"] and (len(parts) < 4 or parts[2] not in ENGINE_ROOMS):
            bad += [f"{a} -> {b}" for b in deps if b.split(".")[1:3] in (["engine", r] for r in ENGINE_ROOMS)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("rel", NO_JAX)
def test_host_bookkeeping_imports_no_jax(rel):
    path = REPO / rel
    imported = _imports(path, _module_name(path))
    assert not {m for m in imported if m.split(".")[0] in ("jax", "flax", "jaxlib")}


def test_there_are_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "\n".join(cycles)
