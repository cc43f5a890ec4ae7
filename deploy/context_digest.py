"""Digest of a container build's inputs: the files of a build context that .dockerignore keeps,
plus any extra strings (Dockerfile path, build args). container-test.sh skips the image build
when it matches the last one; it never decides what goes into the image."""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
from pathlib import Path


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as an anchored regex: `**` spans directories, `*` and `?` do not."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            if pattern.startswith("/", i):  # `**/x` also matches `x` at the top
                out[-1] = "(?:.*/)?"
                i += 1
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = pattern.find("]", i + 1)
            if end < 0:
                raise ValueError(f".dockerignore pattern {pattern!r}: unclosed '['")
            out.append(pattern[i:end + 1])
            i = end
        elif c == "\\" and i + 1 < len(pattern):
            out.append(re.escape(pattern[i + 1]))
            i += 1
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out) + r"\Z")


def load_ignore(context: Path) -> list[tuple[bool, re.Pattern[str]]]:
    """(is_exception, regex) per line of .dockerignore, in order."""
    path = context / ".dockerignore"
    rules = []
    for line in path.read_text().splitlines() if path.exists() else []:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        exception = line.startswith("!")
        cleaned = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
        rules.append((exception, _pattern_regex(cleaned)))
    return rules


def ignored(relpath: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent directories wins."""
    parts = relpath.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    result = False
    for exception, regex in rules:
        if any(regex.match(p) for p in prefixes):
            result = not exception
    return result


def digest(context: Path, extra: list[str]) -> str:
    rules = load_ignore(context)
    h = hashlib.sha256()
    for item in extra:
        h.update(b"extra\0" + item.encode() + b"\0")
    has_exceptions = any(exception for exception, _ in rules)
    for root, dirs, files in os.walk(context):
        rel_root = Path(root).relative_to(context).as_posix()
        # Without `!` patterns nothing under an ignored directory can come back: skip .venv, .git.
        dirs[:] = sorted(d for d in dirs if has_exceptions
                         or not ignored(d if rel_root == "." else f"{rel_root}/{d}", rules))
        for name in sorted(files):
            full = Path(root) / name
            rel = full.relative_to(context).as_posix()
            if ignored(rel, rules):
                continue
            h.update(b"file\0" + rel.encode() + b"\0")
            if full.is_symlink():
                h.update(b"link\0" + os.readlink(full).encode())
            else:
                h.update(b"x" if os.access(full, os.X_OK) else b"-")
                h.update(hashlib.sha256(full.read_bytes()).digest())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("context", type=Path)
    parser.add_argument("extra", nargs="*", help="more inputs to fold in (a Dockerfile's text, build args)")
    args = parser.parse_args(argv)
    print(digest(args.context, args.extra))
    return 0


if __name__ == "__main__":
    sys.exit(main())
