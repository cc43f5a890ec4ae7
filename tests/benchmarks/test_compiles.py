"""Every benchmark module imports: most run only by hand, so a broken one (an unclosed docstring, an
import of a tool that was renamed) would otherwise be found by the next person who needs its numbers."""
from __future__ import annotations

import importlib
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", sorted((REPO / "benchmarks").rglob("*.py")), ids=lambda p: str(p.relative_to(REPO)))
def test_benchmark_imports(path):
    module = ".".join(path.relative_to(REPO).with_suffix("").parts)
    importlib.import_module(module.removesuffix(".__init__"))
