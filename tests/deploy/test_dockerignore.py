""".dockerignore keeps every file the Dockerfile reads (COPY sources, paths named in RUN lines, what
`pip install .` builds from), matched the way the builder matches (deploy/context_digest.py)."""
from __future__ import annotations

import ast
import fnmatch
import json
import re
import shlex
import tomllib

import pytest

from tests.deploy.conftest import REPO_ROOT
from tests.deploy.test_context_digest import context_digest

# what `pip install .` reads inside a package: sources, native kernel sources/headers, package data
_PACKAGE_SUFFIXES = (".py", ".cc", ".h", ".proto")


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per Dockerfile line, continuation lines joined, comments dropped."""
    text = (REPO_ROOT / "Dockerfile").read_text()
    text = re.sub(r"^\s*#.*\n", "", text, flags=re.M)
    text = re.sub(r"\\\n", " ", text)
    return [(m.group(1).upper(), m.group(2).strip())
            for m in re.finditer(r"^\s*([A-Za-z]+)\s+(.*)$", text, re.M)]


def project_inputs() -> set[str]:
    """Files `pip install .` reads: pyproject.toml, setup.py, the readme and the packages' files."""
    meta = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    files = {"pyproject.toml", "setup.py", meta["project"]["readme"]}
    # setup.py installs these top-level directories as slipstream.<dir>
    product = ast.literal_eval(re.search(r"^PRODUCT = (\(.*?\))$", (REPO_ROOT / "setup.py").read_text(), re.M).group(1))
    for top in sorted(REPO_ROOT.iterdir()):
        if not top.is_dir() or top.name not in product:
            continue
        for path in top.rglob("*"):
            if path.suffix in _PACKAGE_SUFFIXES and "__pycache__" not in path.parts and path.is_file():
                files.add(path.relative_to(REPO_ROOT).as_posix())
    return files


def dockerfile_inputs() -> set[str]:
    """Context paths the Dockerfile reads, with `.` in a RUN line (pip install .) expanded."""
    inputs: set[str] = set()
    for name, args in instructions():
        if name in ("COPY", "ADD"):
            words = json.loads(args) if args.startswith("[") else shlex.split(args)
            flags = [w for w in words if w.startswith("--")]
            if any(f.startswith("--from") for f in flags):
                continue  # from another stage, not the context
            sources = [w for w in words if not w.startswith("--")][:-1]
            inputs.update(s for s in sources if s != ".")  # `.` is the whole context, whatever it keeps
        elif name == "RUN":
            words = [w for w in shlex.split(args) if not w.startswith("--mount")]
            for word in words:
                if word == ".":
                    inputs |= project_inputs()
                elif not word.startswith(("-", "/", "$")) and (REPO_ROOT / word).exists():
                    inputs.add(word)
    return inputs


def test_every_file_the_dockerfile_reads_enters_the_build_context():
    inputs = dockerfile_inputs()
    # the parse found what the build needs: the lock, the project, the native kernels' sources
    assert "deploy/requirements.lock" in inputs
    assert {"pyproject.toml", "setup.py", "server/cli.py"} <= inputs
    assert any(p.startswith("kernels/cpu/csrc/") and p.endswith(".cc") for p in inputs)
    rules = context_digest.load_ignore(REPO_ROOT)
    left_out = sorted(p for p in inputs if not context_digest.in_context(p, rules))
    assert left_out == [], f".dockerignore leaves out files the Dockerfile reads: {left_out}"


def test_the_context_stays_small():
    rules = context_digest.load_ignore(REPO_ROOT)
    for path in (".git/HEAD", ".venv/bin/python", "tests/deploy/conftest.py", "deploy/helm/slipstream/Chart.yaml",
                 "deploy/container-test.sh", "server/__pycache__/cli.cpython-311.pyc", "benchmarks/results/x.json"):
        assert not context_digest.in_context(path, rules), path
    assert not context_digest.walks_into(".venv", rules)  # not even listed
    assert context_digest.walks_into("deploy", rules)     # entered for the lock alone


@pytest.mark.parametrize("patterns, path, expected", [
    (["deploy"], "deploy/requirements.lock", True),                   # a directory takes its files
    (["deploy", "!deploy/requirements.lock"], "deploy/requirements.lock", False),
    (["deploy", "!deploy/requirements.lock"], "deploy/helm/Chart.yaml", True),
    (["!a.txt", "*.txt"], "a.txt", True),                             # the last match wins
    (["*.txt", "!a.txt"], "a.txt", False),
    (["*.log"], "debug.log", True),
    (["*.log"], "server/debug.log", False),                           # `*` stays in one directory
    (["*/*.log"], "server/debug.log", True),
    (["**/*.log"], "a/b/c.log", True),
    (["**/*.log"], "c.log", True),                                    # `**/` also matches at the top
    (["**/__pycache__"], "__pycache__/x.pyc", True),
    (["**/__pycache__"], "a/__pycache__/x.pyc", True),
    (["dir/**"], "dir/a/b", True),
    (["dir/**"], "dirt/a", False),
    (["dir**"], "dirt/a", True),                                      # a trailing `**`: a plain prefix
    (["a/**/b"], "a/b", True),
    (["a/**/b"], "a/x/y/b", True),
    (["/build"], "build/lib/x.py", True),                             # a leading `/` is dropped
    (["docs/../build/"], "build/x", True),                            # the pattern is cleaned
    (["build"], "buildx/y", False),
    (["fil?.txt"], "file.txt", True),
    (["fil?.txt"], "fil/.txt", False),                                # `?` is never `/`
    (["[a-c].py"], "b.py", True),
    (["[a-c].py"], "d.py", False),
    (["[^a].py"], "a.py", False),
    (["x.py"], "xypy", False),                                        # `.` is literal
    (["\\*.py"], "*.py", True),                                       # `\` escapes
    (["\\*.py"], "a.py", False),
])
def test_matcher_follows_the_builders_rules(patterns, path, expected):
    rules = context_digest.parse_ignore("\n".join(patterns))
    assert context_digest.ignored(path, rules) is expected


def test_an_ignored_directory_is_entered_only_for_a_literal_exception_below_it():
    rules = context_digest.parse_ignore("deploy\n!deploy/requirements.lock\ndocs\n!**/keep.md\n")
    assert context_digest.in_context("deploy/requirements.lock", rules)
    assert not context_digest.in_context("deploy/helm/Chart.yaml", rules)
    assert not context_digest.ignored("docs/keep.md", rules)     # the pattern alone would keep it,
    assert not context_digest.in_context("docs/keep.md", rules)  # but the classic builder skips docs/


def test_comments_blank_lines_and_bad_patterns():
    rules = context_digest.parse_ignore("# deploy\n\n  \nkeep/../tests\n")
    assert [r.text for r in rules] == ["tests"]
    with pytest.raises(ValueError, match="nothing after"):
        context_digest.parse_ignore("!\n")
