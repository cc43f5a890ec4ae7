"""Where a decode step's wall time goes on the serving path: device busy against host-only time.

Runs the real Scheduler over the default model (same flags as `slipstream serve`) with N running
sequences in steady decode, and times each step from the engine thread:
  - gap: from the moment step N's samples reached the host until step N+1's model program was
    called (0 when step N+1 was launched before them). Without overlap the device is idle for all
    of it (scheduler loop, planner, runner host work, output hand-off), and also for most of the
    model program call (argument handling before XLA runs), listed apart.
  - wall: model program call to model program call; busy = wall - gap.
Per-part host times (planner, step_inputs, output thread, ...) are summed from wrappers, per step.
    .venv/bin/python -m benchmarks.host_overhead [--running 1,32] [--steps 96] [serve flags...]

Measured (AMD EPYC, 2 cores, default q8_0-a16, other jobs loading the host), ms per decode step,
before (one step at a time) -> after (one step in flight), two pairs run in opposite orders:
  1 running:  wall 17.8 -> 10.4 and 9.3 -> 11.9; gap 0.34/0.26 -> 0; model program call 1.4-3.8
  32 running: wall 101.9 -> 70.3 and 60.8 -> 57.9; gap 0.61/0.62 -> 0; model program call 1.4-4.8
Host parts per step before: output thread 0.06/0.33, planner 0.04/0.15, step_inputs 0.1/0.3, applying
samples 0.04/0.14 (1/32 running). Wall differences within a pair are mostly the host's load.
"""
from __future__ import annotations

import argparse
import collections
import functools
import statistics
import sys
import threading
import time

import jax

from benchmarks.startup_bench import cpu_model
from engine.request import Request, SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig


class Probe:
    """Timestamps taken on the engine thread; host-part durations summed per name."""

    def __init__(self) -> None:
        self.returned: list[float] = []    # a step's samples reached the host
        self.dispatched: list[float] = []  # a model program was called
        self.parts: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()

    def timed(self, name: str, fn):
        @functools.wraps(fn)
        def wrapper(*a, **kw):
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                with self.lock:
                    self.parts[name] += time.perf_counter() - start
        return wrapper


def instrument(engine, scheduler: Scheduler, probe: Probe):
    """Wraps the engine's model programs, jax.device_get and the host parts; returns the undo."""
    exes, step_inputs = dict(engine._model_exe), engine.step_inputs
    for t, exe in list(engine._model_exe.items()):
        def call(*a, _exe=exe, **kw):
            probe.dispatched.append(time.perf_counter())
            return _exe(*a, **kw)
        engine._model_exe[t] = probe.timed("model program call", call)
    real_get = jax.device_get

    def device_get(x):
        out = real_get(x)
        if threading.current_thread().name == "slipstream-engine":
            probe.returned.append(time.perf_counter())
        return out
    jax.device_get = device_get
    planner = scheduler._planner
    planner.plan = probe.timed("planner.plan", planner.plan)
    planner.admit = probe.timed("planner.admit", planner.admit)
    engine.step_inputs = probe.timed("runner.step_inputs", engine.step_inputs)
    scheduler._apply = probe.timed("scheduler._apply", scheduler._apply)
    out = scheduler._output
    out._handle = probe.timed("output thread", out._handle)

    def undo() -> None:
        engine._model_exe.update(exes)
        engine.step_inputs = step_inputs
        jax.device_get = real_get
    return undo


def measure(engine, tokenizer, running: int, steps: int, prompt_len: int) -> dict:
    scheduler = Scheduler(engine, tokenizer, SchedulerConfig())
    probe = Probe()
    undo = instrument(engine, scheduler, probe)
    scheduler.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=steps + 16, ignore_eos=True)
        # a few ids from the middle of the vocabulary; distinct per sequence (no prefix hits)
        streams = [scheduler.submit(Request([1000 + 7 * i + j for j in range(prompt_len)], params))
                   for i in range(running)]
        for s in streams:
            s.result(timeout=600)
    finally:
        scheduler.shutdown(timeout=30)
        undo()
    # steady decode: skip the prefill steps and the first few decodes, and the tail where some finish
    n = min(len(probe.returned), len(probe.dispatched))
    first = 1 + 4 + (prompt_len * running) // engine.max_num_batched_tokens
    gaps, walls = [], []
    for i in range(first, first + steps - 8):
        if i + 1 >= n:
            break
        gaps.append(max(0.0, probe.dispatched[i + 1] - probe.returned[i]))
        walls.append(probe.dispatched[i + 1] - probe.dispatched[i])
    iters = len(probe.returned)
    return {"running": running, "steps": len(gaps),
            "wall_ms": statistics.median(walls) * 1e3, "gap_ms": statistics.median(gaps) * 1e3,
            "parts_ms": {k: v / iters * 1e3 for k, v in sorted(probe.parts.items())}}


def main(argv: list[str] | None = None) -> int:
    from server.cli import build_engine, build_parser

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--running", default="1,32", help="running sequences, comma-separated")
    p.add_argument("--steps", type=int, default=96, help="decode steps per run")
    p.add_argument("--prompt-len", type=int, default=16)
    args, serve_flags = p.parse_known_args(argv)
    serve = build_parser().parse_args(["serve", *serve_flags])
    engine, tokenizer, _ = build_engine(serve)
    print(f"CPU: {cpu_model()}; weights {engine.weight_mode}; serve flags {serve_flags or 'defaults'}")
    print("| running | steps | wall ms/step | device idle (gap) ms/step | busy ms/step | host parts ms/iteration |")
    print("|---|---|---|---|---|---|")
    for running in (int(x) for x in args.running.split(",")):
        r = measure(engine, tokenizer, running, args.steps, args.prompt_len)
        parts = ", ".join(f"{k} {v:.2f}" for k, v in r["parts_ms"].items())
        print(f"| {running} | {r['steps']} | {r['wall_ms']:.2f} | {r['gap_ms']:.2f} | "
              f"{r['wall_ms'] - r['gap_ms']:.2f} | {parts} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
