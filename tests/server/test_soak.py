"""The short fault soak (tests/soak/soak.py --short, ~15 s) as part of the suite: disconnects, a 10x
flood, a slow reader and a SIGTERM drain against a MockEngine server in a child process."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_short_soak_passes_its_checks() -> None:
    run = subprocess.run([sys.executable, "-m", "tests.soak.soak", "--short"], cwd=ROOT, capture_output=True,
                         text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    print(json.dumps({k: report[k] for k in ("total_seconds", "requests_sent_under_load", "completed_choices",
                                             "disconnected_choices", "flood_rate_rps", "capacity_rps",
                                             "latency_429_ms", "rss_growth_pct", "sigterm")}))
    # What a pass means, restated so a soak that silently tested nothing fails here too.
    assert report["completed_choices"] > 100 and report["disconnected_choices"] > 0
    assert report["flood_429"] > 0 and report["wrong_count"] == 0
    assert report["sigterm"]["exit_code"] == 0
