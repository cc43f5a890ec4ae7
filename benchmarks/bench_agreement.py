"""`slipstream bench` against `vllm bench serve` on ONE server, same workload, alternating order.

    flock /tmp/slipstream-bench.lock .venv/bin/python -m benchmarks.bench_agreement --rounds 4

Starts one Slipstream server (default flags, `--max-slots 32`) on a loopback port, runs one unmeasured
settling run (a whole run's prompts by default), then runs both clients `--rounds` times in the order ours, vllm / vllm, ours / ... (so a
drift over time favours neither), each run with its own prompts (no run's prompts are in the server's
prefix cache from an earlier run). Both clients run as subprocesses with the same flags.

The server runs under benchmarks/bench/trace_server.py, which stamps every request by the server's clock
(the clients' clock too): when the app got it and when each chunk was written. So each run's median/p99
TTFT and ITL are also computed as the server saw them, and each client's numbers less the server's
(`client_minus_server_*`) say what that client adds: its transport (connect, send, receive). That is
what a client can get wrong, and it does not move with the server: at 32 concurrent the server's own
median TTFT flips by a whole step between runs (its steady state locks into one of two phases for long
stretches), so two runs of the SAME client can differ by 15-20% there, more than the clients do.
Per run it also records the client's and the server's CPU seconds, the share of the machine's CPU time that
everything else took (`other_cpu_share`: on 2 cores another process's few busy seconds slow the server's steps up to
2x, which moves one client's numbers and not the other's; the summary also compares only the rounds where that
share stayed under `--max-other-cpu` in both runs), the prompt tokens the server
prefilled and served from its prefix cache (equal workloads), and where TTFT went per request
(`LABEL-requests.json`: deliver, server, receive).

`--identical` makes each round an A/A run: both clients send the same prompts (our generator) with the same
`--seed`, and `slipstream bench` draws a seed's arrival times exactly as `vllm bench serve` does, so with
`--request-rate R` (open loop) the server gets the same requests at the same moments from either client; it
runs without its prefix cache so the second run of a round is not served from the first. Closed loop
(`--request-rate inf`, the default) the server itself flips between phases from run to run (see the README).
`--simultaneous` runs the two clients of a round at the same time, each with half the concurrency and
prompts: both then measure the server in the same state, except that vLLM's CLI starts seconds later than
ours, so closed loop whichever client's first wave reaches the server first takes the earlier prefills, and
its p99 TTFT and throughput come out better.
`--same-prompts` feeds both clients prompts from our random generator (vLLM's through its `custom`
dataset); `--server-tree DIR` serves from a copy of the repository (`git archive HEAD` unpacked, with
kernels/*.so copied in), so edits in progress in this tree cannot change the server mid-measurement.

It does not take the bench lock itself: run it under `flock` (above). The server it starts is stopped
(its process group, by PID) at the end, also on Ctrl-C. Takes minutes: not part of `make test`.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench import peers  # noqa: E402
from benchmarks.bench.agreement_report import KEYS, table  # noqa: E402
from benchmarks.bench.trace_server import join_trace, read_trace, server_view  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

SCRAPED = ("slipstream_prompt_tokens", "slipstream_prefilled_tokens", "slipstream_prefix_cache_hit_tokens",
           "jetstream_time_to_first_token_sum", "jetstream_time_to_first_token_count",
           "jetstream_queue_duration_sum", "jetstream_queue_duration_count",
           "jetstream_request_input_length_sum", "jetstream_request_input_length_count")


def scrape(base_url: str) -> dict[str, float]:
    """The server's counters and histogram sums that tell what workload it got and how long it took (summed over
    label sets, such as data-parallel replicas)."""
    text = httpx.get(f"{base_url}/metrics", trust_env=False, timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(\w+?)(?:_total)?(?:\{[^}]*\})?\s+(\S+)$", line)
        if m and m.group(1) in SCRAPED:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def _cpu_s(pid: int) -> float | None:
    """utime + stime of one process, in seconds (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy (all CPUs: /proc/stat's total less idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def run_client(cmd: list[str], log_path: Path, cwd: Path, server_pid: int,
               env: dict[str, str] | None = None) -> list[tuple[float, float, float, float]]:
    """Runs a client to completion, sampling every 0.1 s (time.monotonic, the client's CPU seconds, the server's
    CPU seconds, and the CPU seconds of everything else on the machine: busy time less client, server and this
    process); perf_counter in the clients is the same clock, so the samples line up with their timestamps."""
    peers.log("$ " + shlex.join(cmd))
    samples = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env)
        while proc.poll() is None:
            client, server, busy, me = _cpu_s(proc.pid), _cpu_s(server_pid), _busy_cpu_s(), time.process_time()
            if client is not None and server is not None:
                samples.append((time.monotonic(), client, server, busy - client - server - me))
            time.sleep(0.1)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}; see {log_path}")
    return samples


def cpu_in_window(samples, t0: float, t1: float) -> tuple[float, ...]:
    """(client, server, everything else) CPU seconds between t0 and t1, from the samples nearest inside the
    window."""
    inside = [s for s in samples if t0 <= s[0] <= t1]
    if len(inside) < 2:
        return (float("nan"),) * (len(samples[0]) - 1 if samples else 3)
    scale = (t1 - t0) / (inside[-1][0] - inside[0][0])
    return tuple((b - a) * scale for a, b in zip(inside[0][1:], inside[-1][1:]))


def main(argv: list[str] | None = None) -> int:
    from models.registry import DEFAULT_MODEL, resolve_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-warmups", type=int, default=0,
                   help="passed to both clients (vllm bench serve warms up with the first measured prompt)")
    p.add_argument("--seed", type=int, default=1000)
    p.add_argument("--port", type=int, default=18150)
    p.add_argument("--server-args", default="--max-slots 32", help="extra `slipstream serve` flags")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--no-trace", dest="trace", action="store_false",
                   help="serve without benchmarks/bench/trace_server (no per-request split of TTFT)")
    p.add_argument("--server-tree", default=None,
                   help="serve from this copy of the repository (say `git archive HEAD` unpacked, kernels/*.so copied "
                        "in) instead of this working tree, so edits in progress here cannot change the server")
    p.add_argument("--same-prompts", action="store_true",
                   help="both clients send prompts from our random generator (vLLM through its `custom` dataset, a "
                        "JSONL file per run, each run its own seed), not each its own random dataset")
    p.add_argument("--settle-prompts", type=int, default=None,
                   help="prompts of the unmeasured settling run before round 0, with the measured runs' arrivals "
                        "(default: a whole run's --num-prompts)")
    p.add_argument("--identical", action="store_true",
                   help="an A/A run: both clients of a round send the SAME prompts (our generator) with the same --seed, so "
                        "the same requests at the same moments, to a server without its prefix cache (--no-prefix-cache): "
                        "the server does the same work for both, and what differs between their numbers is the client "
                        "and the server's timing noise")
    p.add_argument("--simultaneous", action="store_true",
                   help="run the two clients of a round at the same time, each with half the concurrency and prompts, "
                        "so both see the server in the same state (the raw numbers are then comparable run by run)")
    p.add_argument("--request-rate", default="inf",
                   help="requests per second (both clients; with one --seed both send at the same moments, open loop), "
                        "or inf: all at once, as many in flight as --concurrency allows (closed loop)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps (1: Poisson)")
    p.add_argument("--ours-flags", default="", help="extra `slipstream bench` flags")
    p.add_argument("--vllm-flags", default="", help="extra `vllm bench serve` flags")
    p.add_argument("--max-other-cpu", type=float, default=0.02,
                   help="a round is undisturbed when, in both its runs, the rest of the machine took at most this share "
                        "of all CPUs' time; the summary also compares the undisturbed rounds alone")
    args = p.parse_args(argv)
    if args.identical:
        if args.simultaneous:
            p.error("--identical sends each request twice at the same moment; it needs sequential runs")
        args.same_prompts = True
        if "--no-prefix-cache" not in shlex.split(args.server_args):
            args.server_args += " --no-prefix-cache"

    gguf = resolve_model(DEFAULT_MODEL)
    vllm_bin = peers.ensure_vllm()
    hf_dir = peers.ensure_hf_export(gguf, vllm_bin)
    result_dir = Path(args.result_dir or REPO / "benchmarks" / "results" /
                      ("agreement-" + datetime.now().strftime("%Y%m%d-%H%M%S"))).resolve()
    result_dir.mkdir(parents=True, exist_ok=True)
    trace = result_dir / "trace.jsonl"
    serve = ([sys.executable, "-m", "benchmarks.bench.trace_server"] if args.trace
             else [str(Path(sys.executable).parent / "slipstream")])
    tree = Path(args.server_tree).resolve() if args.server_tree else REPO
    env = {"SLIPSTREAM_TRACE": str(trace), "SLIPSTREAM_TRACE_STEPS": str(result_dir / "steps.jsonl")} if args.trace else {}
    if args.server_tree:
        env["PYTHONPATH"] = str(tree)  # ahead of the editable install's finder, which points here
    spec = peers.ServerSpec("slipstream", "Slipstream, default flags",
                            [*serve, "serve", "--host", "127.0.0.1", "--port", "{port}", *shlex.split(args.server_args)],
                            env=env, cwd=str(tree))
    c, n = args.concurrency, args.num_prompts
    random = ["--dataset-name", "random", "--random-input-len", str(args.input_len),
              "--random-output-len", str(args.output_len)]
    rate = args.request_rate
    if args.simultaneous:  # each client gets half of the load, at the same time
        c, n = c // 2, n // 2
        rate = rate if float(rate) == float("inf") else str(float(rate) / 2)
    common = ["--max-concurrency", str(c), "--request-rate", rate, "--burstiness", str(args.burstiness),
              "--ignore-eos",
              "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
              "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", str(result_dir)]

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    server = peers.RunningServer(spec, args.port, result_dir / "slipstream.log")
    runs: list[dict] = []
    try:
        peers.log(f"server pid {server.proc.pid} ready in {server.wait_ready():.0f}s")
        base = server.base_url
        model = httpx.get(f"{base}/v1/models", trust_env=False).json()["data"][0]["id"]

        def dataset(label: str, seed: int, num: int) -> list[str]:
            if not args.same_prompts:
                return random
            from server.bench.datasets import random_dataset
            from server.bench.run import load_tokenizer

            path = result_dir / f"{label}-prompts.jsonl"
            reqs = random_dataset(load_tokenizer(gguf), num_prompts=num, input_len=args.input_len,
                                  output_len=args.output_len, seed=seed)
            path.write_text("".join(json.dumps({"prompt": q.prompt}) + "\n" for q in reqs))
            return ["--dataset-name", "custom", "--dataset-path", str(path), "--skip-chat-template", "--disable-shuffle",
                    "--custom-output-len", str(args.output_len)]

        def ours(label: str, seed: int, num: int, warmups: int) -> list[str]:
            return [sys.executable, "-m", "server.cli", "bench", "--base-url", base, "--model", model,
                    "--tokenizer", gguf, *dataset(label, seed, num + warmups), *common, "--num-prompts", str(num),
                    "--num-warmups", str(warmups), "--seed", str(seed), "--result-filename", f"{label}.json", "--request-id-prefix", f"{label}-",
                    *shlex.split(args.ours_flags)]

        def vllm(label: str, seed: int) -> list[str]:
            return [str(vllm_bin / "vllm"), "bench", "serve", "--backend", "openai", "--base-url", base,
                    "--endpoint", "/v1/completions", "--model", model, "--tokenizer", str(hf_dir),
                    *dataset(label, seed, n), *common,
                    "--num-prompts", str(n), "--num-warmups", str(args.num_warmups), "--seed", str(seed),
                    "--result-filename", f"{label}.json", "--request-id-prefix", f"{label}-",
                    *shlex.split(args.vllm_flags)]

        # unmeasured first: the KV pages' first touch, caches, and the page free list's order. With only one wave
        # before it, the first measured run (ours, in round 0) ran 10-30% faster than the runs after it in two
        # of three A/A sets, an order effect that favoured whichever client goes first
        settle = ours("settle", args.seed + 999, args.settle_prompts or n, 0)
        subprocess.run([a for a in settle if a != "--save-result"], check=True, cwd=REPO,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for r in range(args.rounds):
            # with the same generator, the two clients of a round must not send the same prompts (prefix cache),
            # unless --identical, where the server has none and both send the same requests
            seeds = {"ours": args.seed + 2 * r,
                     "vllm": args.seed + 2 * r + (1 if args.same_prompts and not args.identical else 0)}
            order = ("ours", "vllm") if r % 2 == 0 else ("vllm", "ours")
            if args.simultaneous:
                runs += run_together(order, r, seeds, ours, vllm, n, result_dir, trace, args)
                continue
            for who in order:
                label = f"{who}-{r}"
                cmd = ours(label, seeds[who], n, args.num_warmups) if who == "ours" else vllm(label, seeds[who])
                before = scrape(base)
                # vLLM's venv must not see this repository (PYTHONPATH): transformers would import its `kernels`
                env = None if who == "ours" else {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
                samples = run_client(cmd, result_dir / f"{label}.out", REPO if who == "ours" else peers.PEERS,
                                     server.proc.pid, env)
                after = scrape(base)
                d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
                res = json.loads((result_dir / f"{label}.json").read_text())
                count = d.get("jetstream_time_to_first_token_count") or 1
                t0 = min(res["start_times"])
                t1 = max(s + lat for s, lat in zip(res["start_times"], res["latencies"]))
                client_cpu, server_cpu, other_cpu = cpu_in_window(samples, t0, t1)
                # when each process took its CPU (the first wave's prefills are where a client's own work shows)
                (result_dir / f"{label}-cpu.json").write_text(json.dumps(
                    {"columns": ["t_s", "client_cpu_s", "server_cpu_s", "other_cpu_s"],
                     "rows": [[s[0] - t0, *s[1:]] for s in samples]}))
                mean_ttft_ms = res.get("mean_ttft_ms")
                server_ttft_ms = 1000 * d.get("jetstream_time_to_first_token_sum", 0) / count
                joined = join_trace(res, f"{label}-", read_trace(trace, f"{label}-"))
                (result_dir / f"{label}-requests.json").write_text(json.dumps([
                    {k: v for k, v in j.items() if k != "server_itl_ms"} for j in joined]))
                split = {f"median_{part}_ms": float(np.median([j[f"{part}_ms"] for j in joined])) if joined else float("nan")
                         for part in ("deliver", "read", "server", "receive")}
                runs.append({"who": who, "round": r, "label": label, "command": shlex.join(cmd), "client_cpu_s": client_cpu,
                             "server_cpu_s": server_cpu,
                             # CPU the rest of the machine took during the run, as a share of all its CPUs' time:
                             # on 2 cores, another process's few busy seconds slow the server's steps up to 2x
                             "other_cpu_share": other_cpu / ((t1 - t0) * (os.cpu_count() or 1)),
                             # the workload as the server saw it: a prompt-token or prefix-hit difference between the
                             # clients is a different workload, not a different measurement
                             "server_prompt_tokens": d.get("slipstream_prompt_tokens", 0),
                             "server_prefilled_tokens": d.get("slipstream_prefilled_tokens", 0),
                             "prefix_hit_tokens": d.get("slipstream_prefix_cache_hit_tokens", 0),
                             "server_mean_ttft_ms": server_ttft_ms,
                             "server_mean_queue_ms": 1000 * d.get("jetstream_queue_duration_sum", 0) /
                             (d.get("jetstream_queue_duration_count") or 1),
                             # what the client adds to the server's own TTFT (arrival to first token): the same
                             # quantity for both clients whatever the server's speed in that run
                             "client_minus_server_mean_ttft_ms": mean_ttft_ms - server_ttft_ms,
                             **split, "connections": len({j["conn"] for j in joined}),
                             **server_view(joined, res),
                             **{k: res.get(k) for k in KEYS}})
                peers.log(f"{label}: " + ", ".join(f"{k}={runs[-1][k]:.1f}" for k in
                                                   ("p99_ttft_ms", "median_ttft_ms", "output_throughput", "client_cpu_s",
                                                    "server_mean_ttft_ms", "median_deliver_ms", "median_server_ms",
                                                    "server_prompt_tokens", "prefix_hit_tokens")))
    finally:
        server.stop()
    (result_dir / "runs.json").write_text(json.dumps(runs, indent=1))
    text = table(runs, c, n, args)
    print(text)
    (result_dir / "agreement.md").write_text(text + "\n")
    return 0


def run_together(order, r: int, seeds: dict, ours, vllm, n: int, result_dir: Path, trace: Path, args) -> list[dict]:
    """Both clients at once on the one server, each with half the concurrency and prompts: whatever state
    the server is in during the round (its TTFT phase, other load on the host), both see it."""
    procs = []
    for who in order:
        label = f"{who}-{r}"
        cmd = ours(label, seeds[who], n, 0) if who == "ours" else vllm(label, seeds[who])
        env = None if who == "ours" else {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        peers.log("$ " + shlex.join(cmd))
        log = open(result_dir / f"{label}.out", "w")
        procs.append((who, label, cmd, log, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                             cwd=REPO if who == "ours" else peers.PEERS, env=env)))
    runs = []
    for who, label, cmd, log, proc in procs:
        if proc.wait() != 0:
            raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}; see {result_dir / f'{label}.out'}")
        log.close()
        res = json.loads((result_dir / f"{label}.json").read_text())
        joined = join_trace(res, f"{label}-", read_trace(trace, f"{label}-"))
        runs.append({"who": who, "round": r, "label": label, "command": shlex.join(cmd),
                     **server_view(joined, res), **{k: res.get(k) for k in KEYS}})
        peers.log(f"{label}: " + ", ".join(f"{k}={runs[-1][k]:.1f}" for k in
                                           ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "output_throughput")))
    return runs


if __name__ == "__main__":
    sys.exit(main())
