"""The linear-weight seam: quantization/ imports only kernels/ (and itself), and the models reach every
weight form through quantization.ops, never through the form's own methods."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_quantization_imports_point_down_only():
    for path in sorted((ROOT / "quantization").glob("*.py")):
        ours = _imports(path) & {"server", "engine", "models", "benchmarks"}
        assert not ours, f"{path.name} imports {sorted(ours)}: quantization/ may import only kernels/"


def test_models_do_not_call_weight_forms_directly():
    # the forms' own entry points (pick, linears, gated_down, matmul) are quantization.ops' business
    for path in sorted((ROOT / "models").glob("*.py")):
        text = path.read_text(encoding="utf-8")
        for needle in (".pick(", ".linears(", ".gated_down(", "hasattr(w", "QuantizedWeight", "Int8Weight"):
            hits = [line for line in text.splitlines() if needle in line and "ops." + needle.lstrip(".") not in line]
            assert not hits, f"models/{path.name} reaches a weight form directly: {hits}"
