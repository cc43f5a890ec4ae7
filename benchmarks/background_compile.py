"""A decode step's time while the engine compiles its prompt-scoring and pooling programs in the background, against
the same step once they are done: the serving thread's launches need the GIL, and tracing holds it.

    python -m benchmarks.background_compile --model olmoe-1b-7b --load-format dummy --context 256 \
        --prefill-tokens 512 --out background_compile.json

One process, on the default device (meant for an accelerator: on CPU the engine compiles those programs at first
use, and the compiles share the cores the steps run on):

1. the engine is built (its extended programs lowered before it is up; JaxEngine.compile_extended) and one slot's
   decode steps run back to back while the thread compiles them;
2. 1, 4 and 8 slots once they are done (each step alone, and pipelined as the server runs them);
3. rounds of the extended ladder again (JAX's caches cleared; the persistent cache serves the XLA compiles), in
   turn lowered on the calling thread (the engine's way) and on the compile thread (the way before it), with one
   slot's steps timed while each round's thread works.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import jax

from benchmarks.device import parse_args
from benchmarks.device_phases import load, pipelined_ms
from benchmarks.engine import build, decodes, fill
from benchmarks.measure import cpu_model
from slipstream.engine.api import StepBatch
from slipstream.engine.device.runner import EngineConfig

SLOTS = (1, 4, 8)
STEPS_WHILE_COMPILING = 1000  # the most steps timed in one round (each advances the slot's context one position)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--out", default="background_compile.json")
    p.add_argument("--rounds", type=int, default=2, help="rounds of each way of lowering")
    own, rest = p.parse_known_args(argv)
    args = parse_args(rest)
    jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="bg-compile-cache-"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    config = EngineConfig(dtype=args.dtype, quantize=args.quantize, kv_cache_dtype=args.kv_cache_dtype)
    cfg, params = load(args, config)
    longest = args.context + STEPS_WHILE_COMPILING + 100
    start = time.perf_counter()
    setup = build(cfg, params, slots=max(SLOTS), longest=longest, scratch=args.prefill_tokens, page_size=None,
                  max_seq_len=longest, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, quantize=args.quantize,
                  max_num_batched_tokens=args.prefill_tokens, context=args.context)
    engine = setup.engine
    report = {"device": jax.devices()[0].device_kind, "host": cpu_model(), "model": args.model,
              "ready_s": time.perf_counter() - start, "lowered_before_ready_s": engine.lower_seconds, "rows": []}
    if not engine._extended_compiling:  # on CPU the engine compiles them at first use
        engine.compile_extended()
    fill(setup, seed=0)

    def step(batch: int) -> float:
        t0 = time.perf_counter()
        engine.step(StepBatch(decodes(setup, batch)))
        setup.step += 1
        return (time.perf_counter() - t0) * 1e3

    def while_compiling(label: str, lowered_s: float) -> None:
        compiling = list(engine._extended_compiling.values())
        setup.rewind()
        t0, times = time.perf_counter(), []
        while any(not c.done() for c in compiling) and len(times) < STEPS_WHILE_COMPILING:
            times.append(step(1))
        engine.wait_extended()
        row = {"phase": label, "lowered_on_calling_thread_s": lowered_s, "thread_s": time.perf_counter() - t0,
               "steps": len(times), "step_ms_p50": statistics.median(times) if times else None,
               "step_ms_p90": sorted(times)[int(0.9 * len(times))] if times else None}
        report["rows"].append(row)
        print(json.dumps(row), flush=True)

    while_compiling("after start-up", 0.0)
    for batch in SLOTS:
        setup.rewind()
        for _ in range(3):
            step(batch)
        ms = statistics.median(step(batch) for _ in range(10))
        setup.rewind()
        row = {"phase": "settled", "slots": batch, "step_ms_p50": ms, "pipelined_ms": pipelined_ms(setup, batch, 10)}
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
    keys = sorted(set(engine._extended_exe) | set(engine._extended_compiling), reverse=True)
    for _ in range(own.rounds):
        for on_thread in (True, False):
            engine._extended_exe.clear()
            engine._extended_compiling.clear()
            jax.clear_caches()  # tracing again: JAX's in-memory caches would skip it
            t0 = time.perf_counter()
            if on_thread:  # the way before: traced and lowered on the compile thread
                for key in keys:
                    engine._extended_compiling[key] = engine._compile_thread.submit(engine._compile_extended, key)
            else:
                engine.compile_extended()
            while_compiling(f"ladder again, lowered on the {'compile' if on_thread else 'calling'} thread",
                            time.perf_counter() - t0)
    with open(own.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
