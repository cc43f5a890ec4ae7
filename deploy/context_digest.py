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


_REGEX_SPECIAL = set(".+()|{}$")  # regex metacharacters with no meaning in a Go filepath.Match pattern


def go_clean(path: str) -> str:
    """Go's filepath.Clean on a slash path: no empty, `.` or resolvable `..` elements."""
    rooted = path.startswith("/")
    out: list[str] = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if out and out[-1] != "..":
                out.pop()
                continue
            if rooted:
                continue
        out.append(part)
    cleaned = "/".join(out)
    return ("/" + cleaned) if rooted else (cleaned or ".")


class Pattern:
    """One .dockerignore line as the builder's matcher (moby/patternmatcher) reads it: `**` spans
    directories (and a leading `**/` matches at the top), `*`, `?` and `[...]` stay within one."""

    def __init__(self, line: str):
        text = line.strip()
        self.exception = text.startswith("!")
        if self.exception:
            text = text[1:].strip()
        if not text:
            raise ValueError(f".dockerignore pattern {line!r}: nothing after '!'")
        text = go_clean(text)
        if len(text) > 1 and text.startswith("/"):  # patterns are relative to the context root
            text = text[1:]
        self.text = text
        self.kind, self.regex = self._compile(text, line)

    @staticmethod
    def _compile(text: str, line: str) -> tuple[str, re.Pattern[str] | None]:
        out, kind, i = ["^"], "exact", 0
        while i < len(text):
            c = text[i]
            if text.startswith("**", i):
                at_start = i == 0
                i += 2
                if text.startswith("/", i):
                    i += 1
                if i < len(text):
                    out.append("(.*/)?")
                    kind = "regex"
                elif kind == "exact":  # trailing `**` after literal text: a plain prefix
                    kind = "prefix"
                else:
                    out.append(".*")
                    kind = "regex"
                if at_start:  # a leading `**`: a suffix, unless a wildcard follows
                    kind = "suffix"
                continue
            if c == "*":
                out.append("[^/]*")
                kind = "regex"
            elif c == "?":
                out.append("[^/]")
                kind = "regex"
            elif c in _REGEX_SPECIAL:
                out.append("\\" + c)
            elif c == "\\":
                if i + 1 < len(text):
                    out.append(re.escape(text[i + 1]))
                    kind = "regex"
                    i += 1
                else:
                    out.append("\\\\")
            elif c in "[]":
                if c == "[" and "]" not in text[i + 1:]:  # Go's filepath.Match: ErrBadPattern
                    raise ValueError(f".dockerignore pattern {line!r}: unclosed '['")
                out.append(c)
                kind = "regex"
            else:
                out.append(c)
            i += 1
        if kind != "regex":
            return kind, None
        try:
            return kind, re.compile("".join(out) + r"\Z")
        except re.error as e:
            raise ValueError(f".dockerignore pattern {line!r}: {e}") from None

    def matches(self, path: str) -> bool:
        if self.kind == "exact":
            return path == self.text
        if self.kind == "prefix":
            return path.startswith(self.text[:-2])
        if self.kind == "suffix":
            suffix = self.text[2:]
            return path.endswith(suffix) or (suffix.startswith("/") and path == suffix[1:])
        return self.regex.match(path) is not None


def parse_ignore(text: str) -> list[Pattern]:
    """The patterns of a .dockerignore file, in order (comments and blank lines dropped)."""
    rules = []
    for line in text.removeprefix("\ufeff").splitlines():
        if line.startswith("#") or not line.strip():
            continue
        rules.append(Pattern(line))
    return rules


def load_ignore(context: Path) -> list[Pattern]:
    path = context / ".dockerignore"
    return parse_ignore(path.read_text()) if path.exists() else []


def ignored(relpath: str, rules: list[Pattern]) -> bool:
    """Whether the builder leaves RELPATH (relative to the context) out: the last pattern that matches
    it or one of its parent directories wins, `!` patterns putting it back."""
    path = go_clean(relpath)
    parts = path.split("/")
    candidates = [path] + ["/".join(parts[:n]) for n in range(1, len(parts))]
    result = False
    for rule in rules:
        if any(rule.matches(p) for p in candidates):
            result = not rule.exception
    return result


def walks_into(reldir: str, rules: list[Pattern]) -> bool:
    """Whether the builder looks inside directory RELDIR: an ignored one only when a `!` pattern
    names a path below it literally. The classic builder skips it otherwise, whatever wildcards
    could match (BuildKit may look), so this is the side a Dockerfile's inputs can rely on."""
    if not ignored(reldir, rules):
        return True
    below = go_clean(reldir) + "/"
    return any(rule.exception and (rule.text + "/").startswith(below) for rule in rules)


def in_context(relpath: str, rules: list[Pattern]) -> bool:
    """Whether file RELPATH reaches the build: not ignored, and under no directory the builder skips."""
    parts = go_clean(relpath).split("/")
    return (all(walks_into("/".join(parts[:n]), rules) for n in range(1, len(parts)))
            and not ignored(relpath, rules))


def digest(context: Path, extra: list[str]) -> str:
    rules = load_ignore(context)
    h = hashlib.sha256()
    for item in extra:
        h.update(b"extra\0" + item.encode() + b"\0")
    for root, dirs, files in os.walk(context):
        rel_root = Path(root).relative_to(context).as_posix()
        # as the builder walks: .venv and .git are skipped unopened, deploy/ is entered for the lock
        dirs[:] = sorted(d for d in dirs if walks_into(d if rel_root == "." else f"{rel_root}/{d}", rules))
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
