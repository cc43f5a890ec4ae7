"""Rebuilds benchmarks/RESULTS.md from benchmarks/results.d/: one section per machine (<machine>.md), each
followed by the reports that tools wrote for it (<machine>.<tool>.md), so a run replaces only its own file."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
SECTIONS = HERE / "results.d"
OUTPUT = HERE / "RESULTS.md"

# (vendor, cpu family, model) -> section name, for the CPUs measured so far; others get a name from the ids.
KNOWN_CPUS = {
    ("AuthenticAMD", 25, 1): "amd-zen3",
    ("AuthenticAMD", 25, 17): "amd-zen4",
    ("AuthenticAMD", 26, 2): "amd-zen5",
    ("GenuineIntel", 6, 106): "intel-ice-lake",
    ("GenuineIntel", 6, 167): "intel-xeon-amx",
    ("GenuineIntel", 6, 207): "intel-emerald-rapids",
}

HEADER = """# Benchmark results

One section per machine (`benchmarks/results.d/<machine>.md`), followed by the reports tools wrote on it
(`<machine>.<tool>.md`); every number comes with the command that produced it, and its date. This file is
generated: after a run has replaced its file in `benchmarks/results.d/`, rebuild it with

```
.venv/bin/python -m benchmarks.results
```

The serving comparison against llama.cpp and vLLM (`.venv/bin/python -m benchmarks.compare`) writes its report
for the machine it runs on to `results.d/<machine>.compare.md` and rebuilds this file.

Commands of engine and kernel micro-benchmarks are recorded as they were run; see `benchmarks/` for today's tools.
"""


def machine_name(cpuinfo: str) -> str:
    """The section name for the CPU described by /proc/cpuinfo's text."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    vendor, family, model = fields.get("vendor_id", ""), fields.get("cpu family"), fields.get("model")
    if family is None or model is None or not family.isdigit() or not model.isdigit():
        arch = fields.get("CPU architecture") or fields.get("model name") or "unknown"
        return "cpu-" + re.sub(r"[^a-z0-9]+", "-", arch.lower()).strip("-")
    known = KNOWN_CPUS.get((vendor, int(family), int(model)))
    if known:
        return known
    short = {"AuthenticAMD": "amd", "GenuineIntel": "intel"}.get(vendor, vendor.lower() or "cpu")
    return f"{short}-family{family}-model{model}"


def this_machine() -> str:
    return machine_name(Path("/proc/cpuinfo").read_text())


def _relink(m: re.Match) -> str:
    target = m.group(1)
    return f"]({target[3:]})" if target.startswith("../") else f"]({SECTIONS.name}/{target})"


def demote(text: str, source: str, levels: int) -> str:
    """Headings `levels` down (a file's `#` title becomes `##` or `###`), outside fenced code; links and
    images relative to the file are made relative to RESULTS.md."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            if line.startswith("#"):
                line = "#" * levels + line
            line = re.sub(r"\]\((?!https?:|/|#)([^)]+)\)", _relink, line)
        out.append(line)
    if fenced:
        raise ValueError(f"{source}: a ``` code fence is not closed")
    return "\n".join(out).strip() + "\n"


def _title(path: Path, text: str) -> str:
    first = next((line for line in text.splitlines() if line.startswith("# ")), None)
    if first is None:
        raise ValueError(f"{path}: the file must start with a '# title' line")
    return first[2:].strip()


def build(sections_dir: Path = SECTIONS) -> str:
    machines = sorted(f for f in sections_dir.glob("*.md") if "." not in f.stem)
    reports = sorted(f for f in sections_dir.glob("*.md") if "." in f.stem)
    if not machines:
        raise FileNotFoundError(f"no machine sections (<machine>.md) in {sections_dir}")
    names = {f.stem for f in machines}
    if orphans := [f.name for f in reports if f.stem.split(".")[0] not in names]:
        raise ValueError(f"reports without a machine section ({', '.join(orphans)}): add "
                         f"{sections_dir.name}/<machine>.md with a '# <CPU or TPU>' title")
    parts, contents = [HEADER], []
    for f in machines:
        text = f.read_text()
        title = _title(f, text)
        anchor = re.sub(r"[^a-z0-9 -]", "", title.lower()).replace(" ", "-")
        contents.append(f"- [{title}](#{anchor})")
        parts.append(demote(text, str(f), 1))
        for r in reports:
            if r.stem.split(".")[0] == f.stem:
                _title(r, r.read_text())
                parts.append(demote(r.read_text(), str(r), 2))
    parts.insert(1, "Machines:\n\n" + "\n".join(contents) + "\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.results", description=__doc__)
    p.add_argument("--machine", action="store_true", help="print this machine's section name and exit")
    p.add_argument("--sections", default=str(SECTIONS))
    p.add_argument("--output", default=str(OUTPUT))
    args = p.parse_args(argv)
    if args.machine:
        print(this_machine())
        return 0
    Path(args.output).write_text(build(Path(args.sections)))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
