"""bench_agreement's own accounting: the CPU the rest of the machine took during a run, and the comparison
over the rounds it did not disturb."""
from __future__ import annotations

import subprocess
import sys
import time

from benchmarks import bench_agreement as ba
from benchmarks.bench import agreement_report as report


def test_agreement_counts_what_other_processes_take_and_compares_the_undisturbed_rounds():
    # On 2 cores another process's busy seconds slow the server's steps up to 2x, so bench_agreement records the
    # CPU the rest of the machine took in each run and compares the rounds where it took little
    client_proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # an idle "client"
    # 1.5 CPU-seconds whatever else runs (a wall-clock loop would take less on a loaded machine)
    burner = subprocess.Popen([sys.executable, "-c", "import time\nwhile time.process_time() < 1.5: pass"])
    try:
        samples = []
        while not samples or burner.poll() is None:  # the window covers the whole burn
            busy, me = ba._busy_cpu_s(), time.process_time()
            samples.append((time.monotonic(), ba._cpu_s(client_proc.pid), 0.0, busy - me))
            time.sleep(0.1)
        busy, me = ba._busy_cpu_s(), time.process_time()
        samples.append((time.monotonic(), ba._cpu_s(client_proc.pid), 0.0, busy - me))
    finally:
        client_proc.kill()
        burner.wait()
    client, server, other = ba.cpu_in_window(samples, samples[0][0], samples[-1][0])
    assert client < 0.5 and server == 0.0
    assert 1.2 < other < 3.0, other  # the burner's ~1.5 s, plus whatever else ran

    def run(who, rnd, share, ttft):
        return {"who": who, "round": rnd, "other_cpu_share": share, **{k: ttft for k in report.KEYS}}

    runs = [run("ours", 0, 0.30, 200.0), run("vllm", 0, 0.0, 100.0),  # round 0: ours was disturbed
            run("vllm", 1, 0.01, 100.0), run("ours", 1, 0.0, 104.0)]
    text = "\n".join(report.undisturbed(runs, 0.02))
    assert "1 of 2 (1)" in text
    assert "| mean_ttft_ms | 104.00 | 100.00 | +4.0% |" in text
    assert "0 of 2" in "\n".join(report.undisturbed(runs, 0.001))
