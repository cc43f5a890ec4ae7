"""Every benchmark script at least compiles: most run only by hand, so a broken one (an unclosed
docstring, say) would otherwise be found by the next person who needs its numbers."""
from __future__ import annotations

import pathlib
import py_compile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.parametrize("path", sorted(ROOT.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_benchmark_compiles(path, tmp_path):
    py_compile.compile(str(path), cfile=str(tmp_path / "out.pyc"), doraise=True)
