"""A/B serving benchmark of two Slipstream checkouts (e.g. the old main in a git worktree and this
one) in one run, with the same `slipstream bench` client and workload against each server in turn.

    git worktree add /work/old <old commit>
    .venv/bin/python -m benchmarks.ab_serving --tree old=/work/old --tree new=. \\
        --mode f32= --mode w8a8="--quantize w8a8" [--num-prompts 128 --max-concurrency 32]

--tree-flags label="flags" adds serve flags to one tree only (after the mode's): the same tree under
two labels compares settings (--tree b288=. --tree-flags b288="--max-num-batched-tokens 288"), and
trees whose flag names differ still run one mode (--tree-flags old="--quantize w8a8"
--tree-flags new="--quantize q8_0"). --tree-env label="NAME=value ..." sets environment variables for one
tree's server (a kernel's A/B switch: --tree-env all="SLIPSTREAM_KV_LOAD_AHEAD=all").

Each (mode, tree) pair: start `slipstream serve` from that tree (its own code through PYTHONPATH,
this venv's packages), wait for a completion, run the client (random 256 in / 128 out, ignore EOS,
greedy unless --sampling says otherwise), stop the server. Runs alternate trees within a mode so
drift in the host's load hits both. Prints the vLLM-named metrics per run and the new/old ratios; writes JSON per run.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.bench import peers
from benchmarks.startup_bench import cpu_model

METRICS = ("output_throughput", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
           "median_itl_ms", "p99_itl_ms")


def spec(label: str, tree: str, mode: str, flags: str, port_flags: list[str],
         env: dict[str, str] | None = None) -> peers.ServerSpec:
    tree = os.path.abspath(tree)
    argv = [sys.executable, "-c", "import sys; from server.cli import main; sys.exit(main())", "serve",
            "--host", "127.0.0.1", "--port", "{port}", *port_flags, *shlex.split(flags)]
    return peers.ServerSpec(f"{label}-{mode}", f"{label} ({tree}) {flags or 'default flags'}", argv,
                            env={"PYTHONPATH": tree, **(env or {})}, cwd=tree)


def run_client(base_url: str, out_dir: Path, name: str, args: argparse.Namespace) -> dict:
    argv = [sys.executable, "-m", "server.cli", "bench", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
            "--max-concurrency", str(args.max_concurrency), "--ignore-eos", *shlex.split(args.sampling),
            "--num-warmups", str(args.num_warmups), "--seed", str(args.seed), "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--result-dir", str(out_dir), "--result-filename", f"{name}.json"]
    subprocess.run(argv, check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return json.loads((out_dir / f"{name}.json").read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", required=True, help="label=path (first is the baseline)")
    p.add_argument("--mode", action="append", default=None, help='label="serve flags" (default f32=)')
    p.add_argument("--tree-flags", action="append", default=[], help='label="serve flags" for one tree only')
    p.add_argument("--tree-env", action="append", default=[],
                   help='label="NAME=value ..." environment variables for one tree\'s server only')
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-warmups", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sampling", default="--temperature 0",
                   help='the client\'s sampling flags (default greedy), e.g. "--temperature 0.7 --top-p 0.95"')
    p.add_argument("--port", type=int, default=8395)
    p.add_argument("--result-dir", default=f"/tmp/ab-serving-{time.strftime('%Y%m%d-%H%M%S')}")
    args = p.parse_args(argv)
    trees = [t.split("=", 1) for t in args.tree]
    modes = [m.split("=", 1) for m in (args.mode or ["f32="])]
    tree_flags = dict(f.split("=", 1) for f in args.tree_flags)
    tree_env = {label: dict(v.split("=", 1) for v in shlex.split(values))
                for label, values in (e.split("=", 1) for e in args.tree_env)}
    unknown = (set(tree_flags) | set(tree_env)) - {label for label, _ in trees}
    if unknown:
        p.error(f"--tree-flags / --tree-env for unknown tree label(s) {sorted(unknown)}")
    out_dir = Path(args.result_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; load {os.getloadavg()}", flush=True)
    results: dict[tuple[str, str], dict] = {}
    for mode, flags in modes:
        for label, tree in trees:
            s = spec(label, tree, mode, f"{flags} {tree_flags.get(label, '')}".strip(), [], tree_env.get(label))
            server = peers.RunningServer(s, args.port, out_dir / f"{s.name}.log")
            try:
                ready = server.wait_ready()
                print(f"{s.name}: ready after {ready:.0f} s", flush=True)
                results[(mode, label)] = run_client(server.base_url, out_dir, s.name, args)
            finally:
                server.stop()
            r = results[(mode, label)]
            print(f"{s.name}: " + ", ".join(f"{k}={r[k]:.1f}" for k in METRICS), flush=True)
    print(f"\nCPU: {cpu_model()}; {args.num_prompts} prompts at concurrency {args.max_concurrency}, "
          f"random {args.input_len} in / {args.output_len} out, ignore EOS, sampling {args.sampling!r}; "
          f"load {os.getloadavg()}")
    header = "| mode | tree | out tok/s | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | TPOT p50 ms | ITL p50 ms | ITL p99 ms |"
    print(header + "\n|" + "---|" * 9)
    for (mode, label), r in results.items():
        print(f"| {mode} | {label} | " + " | ".join(f"{r[k]:.1f}" for k in METRICS) + " |")
    base = trees[0][0]
    for mode, _ in modes:
        for label, _ in trees[1:]:
            a, b = results[(mode, base)], results[(mode, label)]
            print(f"{mode}: {label}/{base}: out tok/s {b['output_throughput'] / a['output_throughput']:.2f}x, "
                  f"TTFT p50 {b['median_ttft_ms'] / a['median_ttft_ms']:.2f}x, "
                  f"p90 {b['p90_ttft_ms'] / a['p90_ttft_ms']:.2f}x, ITL p99 {b['p99_itl_ms'] / a['p99_itl_ms']:.2f}x")
    (out_dir / "summary.json").write_text(json.dumps({f"{m}/{t}": r for (m, t), r in results.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
