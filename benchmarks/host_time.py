"""The server's host time per step at many streams, apart from the model's: `slipstream serve` with a
2-layer, 64-wide Llama (dummy weights: its device step is a few ms on a CPU) under `slipstream bench` at
128 concurrent (requests at the server's default temperature), so what is left is the host's Python work
per step (planning, step inputs, samples, detokenizing, one SSE event per stream).

    python -m benchmarks.host_time [--concurrency 128] [--rounds 2]
    python -m benchmarks.host_time --launch [--reps 200] [--preset llama-3.2-1b]


Per round: output tok/s, TPOT p50, and the server's CPU seconds per 1000 output tokens (user + system,
from /proc: less sensitive than wall time to other work on a shared machine), of them the event loop's
(the main thread's: the HTTP side, every stream's events); then the full decode steps'
plan-to-plan interval (benchmarks.bench.trace_server steps). For an A/B run it in each tree, alternating.

--launch: in this process, the host time of JaxEngine.launch alone (from the call to its return: building
the step's host arrays and dispatching its programs; the device work is not waited for) over the same tiny
model (or an architecture preset's, --preset), for a 1024-token prefill chunk and a 32-slot decode step (fed PREVIOUS_SAMPLE), medians of --reps
interleaved launches, each after the previous step's samples came back: the calling thread's CPU time
(time.thread_time: XLA's threads running the launched programs on the other cores are not counted) and
the wall time; and the host arrays each launch hands its compiled programs (each one its own
host->device transfer: on a TPU ~50-150 us apiece).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import statistics
import time

import numpy as np

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


def _launch_engine(preset: str | None):
    """An engine over dummy weights under the engine's defaults (weight format, dtypes), 33 slots (32 decoding, one
    prefilling) and 1024-token steps: of the architecture preset `preset`, or TINY (a 2-layer Llama 64 wide)."""
    from slipstream.engine.device.runner import EngineConfig, JaxEngine
    from slipstream.models.config import ModelConfig
    from slipstream.models.dummy import dummy_model

    with open(os.path.join(PRESET_DIR, f"{preset or 'llama-3.2-1b'}.json")) as f:
        cfg = ModelConfig.from_hf_dict({**json.load(f), **({} if preset else TINY)})
    config = EngineConfig(max_slots=33, max_seq_len=1280, max_num_batched_tokens=1024, num_pages=512)
    # as `slipstream serve --load-format dummy` draws them: already in the engine's weight format
    return JaxEngine(cfg, dummy_model(cfg, dtype=config.activation_dtype(), quantize=config.weight_mode()), config)


def _host_arrays(engine, launch) -> list[tuple[str, list[str]]]:
    """(program, its host arrays as dtype[shape]) for each compiled call one launch makes."""
    import jax

    names = {}
    for attr in ("_model_exe", "_generated_exe", "_sample_exe"):
        for shape, exe in getattr(engine, attr, {}).items():
            names[id(exe)] = f"{attr.strip('_').replace('_exe', '')}-{shape}"
    calls = []
    original = jax.stages.Compiled.__call__

    def counted(self, *args, **kwargs):
        host = [f"{np.asarray(x).dtype}{list(np.shape(x))}" for x in jax.tree.leaves((args, kwargs))
                if isinstance(x, (np.ndarray, np.generic))]
        calls.append((names.get(id(self), "other"), host))
        return original(self, *args, **kwargs)

    jax.stages.Compiled.__call__ = counted
    try:
        launch().result()
    finally:
        jax.stages.Compiled.__call__ = original
    return calls


def launch_main(args) -> int:
    import jax
    import jax.numpy as jnp

    from slipstream.engine.api import PREVIOUS_SAMPLE, SlotState, StepBatch, StepSeq
    from slipstream.engine.kv_cache import pages_needed
    from slipstream.engine.request import SamplingParams

    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores); device: {jax.devices()[0].device_kind}", flush=True)
    engine = _launch_engine(args.preset)
    print(f"engine: weights {engine.weight_mode}, activations {jnp.dtype(engine.dtype).name}, "
          f"K/V {jnp.dtype(engine.kv_dtype).name}, hybrid prompt weights {engine.prompt_w16}", flush=True)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(3, engine.vocab_size, 1024)]
    context = 64  # slots 0-31 decode after 64 tokens, each on its own pages; slot 32 prefills beyond them
    for slot in range(32):
        engine.insert(slot, SlotState(prompt[:context], [], SamplingParams(seed=slot)))
    engine.insert(32, SlotState(prompt, [], SamplingParams(seed=32)))
    per_slot = pages_needed(context + 1, engine.page_size)
    pages = [list(range(1 + s * per_slot, 1 + (s + 1) * per_slot)) for s in range(32)]
    first = 1 + 32 * per_slot
    prefill = StepBatch([StepSeq(32, prompt, 0, list(range(first, first + pages_needed(1024, engine.page_size))),
                                 True)])
    engine.step(StepBatch([StepSeq(s, [5], context, pages[s], True) for s in range(32)]))  # a sample per slot
    decode = StepBatch([StepSeq(s, [PREVIOUS_SAMPLE], context, pages[s], True) for s in range(32)])
    steps = {"prefill 1024 tokens": prefill, "decode 32 slots": decode}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    wall: dict[str, list[float]] = {name: [] for name in steps}
    for rep in range(args.reps + 5):  # the first 5 warm up
        for name, batch in steps.items():
            start, start_cpu = time.perf_counter(), time.thread_time()
            launched = engine.launch(batch)
            elapsed, elapsed_cpu = time.perf_counter() - start, time.thread_time() - start_cpu
            launched.result()
            if rep >= 5:
                cpu[name].append(elapsed_cpu)
                wall[name].append(elapsed)
    for name, batch in steps.items():
        calls = _host_arrays(engine, lambda: engine.launch(batch))
        total = sum(len(host) for _, host in calls)
        print(f"{name}: launch thread CPU {statistics.median(cpu[name]) * 1e3:.3f} ms, wall "
              f"{statistics.median(wall[name]) * 1e3:.3f} ms (medians of {args.reps}); {len(calls)} compiled calls, "
              f"{total} host arrays")
        for program, host in calls:
            print(f"  {program}: {len(host)} host arrays: {' '.join(host)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--launch", action="store_true", help="time JaxEngine.launch in this process (see above)")
    p.add_argument("--reps", type=int, default=200, help="--launch: launches of each step timed")
    p.add_argument("--preset", help="--launch: this architecture preset (dummy weights) instead of the tiny model")
    args = p.parse_args(argv)
    if args.launch:
        return launch_main(args)
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
