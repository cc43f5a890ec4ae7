"""The user documentation states what the code does: README's quick start, flags and environment variables,
and links in README.md and docs/ that stay inside the repository."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from slipstream.server.flags import build_parser
from slipstream.server.settings import every_setting, flag_variable

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
SHIPPED = ("server", "engine", "models", "quantization", "kernels")


def _section(text: str, heading: str) -> str:
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, f"README has no '## {heading}' section"
    return match.group(1)


def _serve_flags() -> set[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return {o for a in sub.choices["serve"]._actions for o in a.option_strings if o.startswith("--") and o != "--help"}


def test_quick_start_is_the_two_make_targets():
    blocks = re.findall(r"```\n(.*?)```", _section(README, "Quick start"), re.DOTALL)
    assert blocks[0] == "make serve\nmake test\n"
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^serve:", makefile, re.MULTILINE) and re.search(r"^test:", makefile, re.MULTILINE)


def test_every_serve_flag_is_documented_and_every_documented_flag_exists():
    flags = _serve_flags()
    documented = set(re.findall(r"`(--[a-z][a-z0-9-]*)", README))
    assert flags - documented == set(), "serve flags missing from the README"
    table = set(re.findall(r"^\| `(--[a-z0-9-]+)`(?:, `(--[a-z0-9-]+)`)?", _section(README, "Flags"), re.MULTILINE))
    in_table = {f for pair in table for f in pair if f}
    assert in_table and in_table - flags == set(), "the Flags table names flags `slipstream serve` does not have"


def test_every_environment_variable_is_read_through_the_settings_and_documented():
    listed = every_setting(build_parser())
    names = [s.name for s in listed]
    assert "SLIPSTREAM_KERNELS" in names and "SLIPSTREAM_MAX_SLOTS" in names  # the list holds what it should
    assert len(names) == len(set(names)) and all(s.doc for s in listed)
    # Read only through a Setting: no SLIPSTREAM_ name next to os.environ or getenv anywhere else.
    direct = []
    for package in SHIPPED:
        for path in (REPO / package).rglob("*"):
            if path.suffix in (".py", ".cc", ".h"):
                direct += [f"{path.relative_to(REPO)}: {line.strip()}" for line in path.read_text().splitlines()
                           if "SLIPSTREAM_" in line and re.search(r"os\.environ|getenv\(", line)]
    assert direct == [], "SLIPSTREAM_* variables read around server/settings.py"
    flag_variables = {flag_variable(f) for f in _serve_flags()}
    assert {n for n in names if n not in flag_variables} - set(re.findall(r"SLIPSTREAM_[A-Z0-9_]+", README)) == set()
    assert "SLIPSTREAM_<FLAG>" in README  # the flags' own variables (documented with the flags)


@pytest.mark.parametrize("doc", ["README.md", *(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))])
def test_relative_links_point_to_files_inside_the_repository(doc: str):
    path = REPO / doc
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text)]
    for target in (t for t in targets if t and not re.match(r"[a-z]+:", t)):
        resolved = (path.parent / target).resolve()
        assert resolved.is_relative_to(REPO), f"{doc} links outside the repository: {target}"
        assert resolved.exists(), f"{doc} links to a missing file: {target}"
