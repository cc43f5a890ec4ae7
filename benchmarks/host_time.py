"""The server's host time per step at many streams, apart from the model's: `slipstream serve` with a
2-layer, 64-wide Llama (dummy weights: its device step is a few ms on a CPU) under `slipstream bench` at
128 concurrent (requests at the server's default temperature), so what is left is the host's Python work
per step (planning, step inputs, samples, detokenizing, one SSE event per stream).

    python -m benchmarks.host_time [--concurrency 128] [--rounds 2]

Per round: output tok/s, TPOT p50, and the server's CPU seconds per 1000 output tokens (user + system,
from /proc: less sensitive than wall time to other work on a shared machine), of them the event loop's
(the main thread's: the HTTP side, every stream's events); then the full decode steps'
plan-to-plan interval (benchmarks.bench.trace_server steps). For an A/B run it in each tree, alternating.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from benchmarks.device import _ready, stop_server
from benchmarks.measure import cpu_model
from slipstream.models.registry import PRESET_DIR

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 8192, "bos_token_id": 1, "eos_token_id": [2]}


def _cpu_seconds(pid: int, tid: int | None = None) -> float:
    """The process's CPU seconds (user + system), or one thread's."""
    with open(f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="slip-host-")
    with open(os.path.join(PRESET_DIR, "llama-3.2-1b.json")) as f:
        config = {**json.load(f), **TINY}
    os.makedirs(os.path.join(work, "model"))
    with open(os.path.join(work, "model", "config.json"), "w") as f:
        json.dump(config, f)
    uds, steps = os.path.join(work, "s.sock"), os.path.join(work, "steps.jsonl")
    cmd = [sys.executable, "-m", "benchmarks.bench.trace_server", "serve", "--uds", uds, "--model",
           os.path.join(work, "model"), "--load-format", "dummy", "--max-slots", str(args.concurrency),
           "--max-seq-len", str(args.input_len + args.output_len + 1)]
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores)", flush=True)
    with open(os.path.join(work, "serve.log"), "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "SLIPSTREAM_TRACE_STEPS": steps})
    try:
        start = time.perf_counter()
        while not _ready(uds):
            if proc.poll() is not None or time.perf_counter() - start > 300:
                raise RuntimeError(f"the server did not get ready; see {work}/serve.log")
            time.sleep(0.5)
        for r in range(args.rounds):
            before, loop_before = _cpu_seconds(proc.pid), _cpu_seconds(proc.pid, proc.pid)
            done = subprocess.run(
                [sys.executable, "-m", "slipstream.server.cli", "bench", "--base-url", f"unix:{uds}",
                 "--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
                 str(args.output_len), "--ignore-eos", "--num-prompts", str(args.prompts), "--max-concurrency",
                 str(args.concurrency), "--tokenizer", os.path.join(work, "model", "config.json"),
                 "--disable-tqdm", "--seed", str(r + 1)], capture_output=True, text=True, check=True)
            cpu = _cpu_seconds(proc.pid) - before
            loop_cpu = _cpu_seconds(proc.pid, proc.pid) - loop_before  # the main thread runs the event loop
            tok_s = re.search(r"Output token throughput \(tok/s\):\s+([\d.]+)", done.stdout).group(1)
            tpot = re.search(r"Median TPOT \(ms\):\s+([\d.]+)", done.stdout).group(1)
            print(f"round {r + 1}: {tok_s} output tok/s, TPOT p50 {tpot} ms, server CPU "
                  f"{1000 * cpu / (args.prompts * args.output_len):.3f} s per 1000 output tokens (event loop "
                  f"{1000 * loop_cpu / (args.prompts * args.output_len):.3f})", flush=True)
    finally:
        stop_server(proc)
    return subprocess.run([sys.executable, "-m", "benchmarks.bench.trace_server", "steps", steps,
                           str(args.concurrency)]).returncode


if __name__ == "__main__":
    sys.exit(main())
