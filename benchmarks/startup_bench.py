"""Start-up time: from launching `slipstream serve` to `/ready` answering 200, on an empty compile
cache (cold) and again on the cache that start left behind (warm). Several checkouts can be timed
in one run (e.g. the old main in a git worktree), so their ratio is taken on the same host load.

    .venv/bin/python -m benchmarks.startup_bench [--tree new=. --tree old=/work/old] [-- serve flags]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

from benchmarks.measure import cpu_model


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def time_start(tree: str, cache: str, port: int, flags: list[str], timeout: float) -> float:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    cmd = [sys.executable, "-c", "import sys; from slipstream.server.cli import main; sys.exit(main())",
           "serve", "--port", str(port), "--compile-cache", cache, *flags]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        while not _ready(port):
            if proc.poll() is not None:
                raise RuntimeError(f"{tree}: serve exited with {proc.returncode}: "
                                   f"{proc.stderr.read().decode()[-2000:]}")
            if time.perf_counter() - start > timeout:
                raise TimeoutError(f"{tree}: not ready after {timeout:.0f} s")
            time.sleep(0.25)
        return time.perf_counter() - start
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", default=[], help="label=path of a checkout (default new=.)")
    p.add_argument("--port", type=int, default=8391)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("flags", nargs="*", help="extra serve flags (after --)")
    args = p.parse_args(argv)
    trees = [t.split("=", 1) for t in (args.tree or ["new=."])]
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; load average {os.getloadavg()}", flush=True)
    results = {}
    for label, tree in trees:
        with tempfile.TemporaryDirectory(prefix=f"startup-{label}-") as cache:
            cold = time_start(tree, cache, args.port, args.flags, args.timeout)
            warm = time_start(tree, cache, args.port, args.flags, args.timeout)
        results[label] = {"cold_s": round(cold, 1), "warm_s": round(warm, 1)}
        print(f"{label:>8}: cold {cold:6.1f} s   warm {warm:6.1f} s", flush=True)
    if len(trees) > 1:
        base = results[trees[-1][0]]
        for label, _ in trees[:-1]:
            print(f"{label} / {trees[-1][0]}: cold {results[label]['cold_s'] / base['cold_s']:.2f}x, "
                  f"warm {results[label]['warm_s'] / base['warm_s']:.2f}x")
    print(f"load average after: {os.getloadavg()}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"cpu": cpu_model(), "flags": args.flags, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
