"""deploy/context_digest.py: container-test.sh skips the image build only when nothing that
enters the build context (per .dockerignore) or the build arguments changed."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.deploy.conftest import DEPLOY

_spec = importlib.util.spec_from_file_location("context_digest", DEPLOY / "context_digest.py")
context_digest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(context_digest)


@pytest.fixture
def context(tmp_path: Path) -> Path:
    files = {
        ".dockerignore": "# comment\n.venv\n**/__pycache__\n*.log\n!keep.log\nbuild\n",
        "pyproject.toml": "[project]\nname = 'x'\n",
        "server/app.py": "print('hi')\n",
        "server/__pycache__/app.pyc": "bytecode",
        ".venv/lib/site.py": "venv",
        "debug.log": "noise",
        "keep.log": "kept",
        "server/trace.log": "nested logs are not matched by a top-level *.log",
        "build/lib/x.py": "artifact",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_ignore_rules_follow_docker_semantics(context):
    rules = context_digest.load_ignore(context)
    kept = {p: not context_digest.ignored(p, rules) for p in (
        "pyproject.toml", "server/app.py", "server/__pycache__/app.pyc", "__pycache__/x.pyc",
        ".venv/lib/site.py", "debug.log", "keep.log", "server/trace.log", "build/lib/x.py", "buildx/y")}
    assert kept == {"pyproject.toml": True, "server/app.py": True, "server/__pycache__/app.pyc": False,
                    "__pycache__/x.pyc": False, ".venv/lib/site.py": False, "debug.log": False,
                    "keep.log": True, "server/trace.log": True, "build/lib/x.py": False, "buildx/y": True}


def test_digest_changes_with_inputs_and_only_with_inputs(context):
    before = context_digest.digest(context, ["FROM base", "--build-arg=A=1"])
    (context / "debug.log").write_text("more noise")
    (context / ".venv/lib/site.py").write_text("reinstalled")
    (context / "server/__pycache__/other.pyc").write_text("new bytecode")
    assert context_digest.digest(context, ["FROM base", "--build-arg=A=1"]) == before
    assert context_digest.digest(context, ["FROM base", "--build-arg=A=2"]) != before
    (context / "server/app.py").write_text("print('changed')\n")
    assert context_digest.digest(context, ["FROM base", "--build-arg=A=1"]) != before


def test_new_file_and_executable_bit_count(context):
    before = context_digest.digest(context, [])
    (context / "server/new.py").write_text("")
    after_new = context_digest.digest(context, [])
    assert after_new != before
    (context / "server/new.py").chmod(0o755)
    assert context_digest.digest(context, []) != after_new


def test_unclosed_bracket_is_reported(tmp_path):
    (tmp_path / ".dockerignore").write_text("file[ab\n")
    with pytest.raises(ValueError, match="unclosed"):
        context_digest.load_ignore(tmp_path)
