"""benchmarks/results.py: RESULTS.md is rebuilt from the per-machine files, and the committed one matches them."""
from pathlib import Path

import pytest

from benchmarks import results

ZEN4 = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"


def test_machine_name_known_and_unknown_cpus():
    assert results.machine_name(ZEN4) == "amd-zen4"
    assert results.machine_name(ZEN4 + "processor\t: 1\ncpu family\t: 99\n") == "amd-zen4"  # first CPU's fields
    other = ZEN4.replace(": 17", ": 160")
    assert results.machine_name(other) == "amd-family25-model160"
    assert results.machine_name("processor\t: 0\nCPU architecture: 8\n") == "cpu-8"


def test_build_nests_reports_under_their_machine(tmp_path: Path):
    (tmp_path / "b-cpu.md").write_text("# B CPU\n\n## Engine\n\n```\n# not a heading\n```\n")
    (tmp_path / "a-cpu.md").write_text("# A CPU\n\nsee [agreement](../AGREEMENT.md)\n")
    (tmp_path / "a-cpu.compare.md").write_text("# Serving comparison\n\n## Results\n\n![plot](a-cpu.compare.png)\n")
    text = results.build(tmp_path)
    lines = text.splitlines()
    order = [line for line in lines if line.startswith("#") and line != "# not a heading"]
    assert order == ["# Benchmark results", "## A CPU", "### Serving comparison", "#### Results", "## B CPU",
                     "### Engine"]
    assert "# not a heading" in lines  # code stays as it is
    assert "![plot](results.d/a-cpu.compare.png)" in text
    assert "see [agreement](AGREEMENT.md)" in text
    assert "- [A CPU](#a-cpu)" in text


def test_build_refuses_a_report_without_its_machine(tmp_path: Path):
    (tmp_path / "a-cpu.md").write_text("# A CPU\n")
    (tmp_path / "z-cpu.compare.md").write_text("# Serving comparison\n")
    with pytest.raises(ValueError, match="z-cpu.compare.md"):
        results.build(tmp_path)


def test_build_refuses_an_unclosed_code_fence(tmp_path: Path):
    (tmp_path / "a-cpu.md").write_text("# A CPU\n\n```\nno end\n")
    with pytest.raises(ValueError, match="not closed"):
        results.build(tmp_path)


def test_committed_results_md_is_the_generated_one():
    assert results.OUTPUT.read_text() == results.build(), (
        "benchmarks/RESULTS.md differs from benchmarks/results.d/: edit results.d/ and run "
        "`python -m benchmarks.results`")
