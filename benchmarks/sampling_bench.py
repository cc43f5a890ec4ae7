"""The engine's sampling program alone (JaxEngine._sample_step, its [slots, V] state donated as in
the engine), with the native sampling kernel and with its JAX reference, compiled in one process and
timed in alternation, per sampling setting and row count. Rows are N(0, --scale) logits over the
default model's vocab (49152); flatter rows (smaller scale) put the top-p nucleus past more tokens.
With --logits model the rows are instead the default model's next-token logits after 32 passages of
benchmarks/data/eval.txt (64 tokens each), and the table also gives how many tokens the top-p 0.9
nucleus spans at temperature 1 (median and max over the rows). Run from the repo root:
    .venv/bin/python -m benchmarks.sampling_bench [--rows 1,32] [--scale 3] [--reps 30] [--logits model]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.startup_bench import cpu_model
from engine.request import SamplingParams
from engine.runner import JaxEngine
from engine.sampling import SamplingArrays
from engine.structured import mask_words
from kernels import sampling as ks

SETTINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 1": SamplingParams(temperature=1.0),
    "top_k 50": SamplingParams(temperature=1.0, top_k=50),
    "top_p 0.9": SamplingParams(temperature=1.0, top_p=0.9),
    "top_k 40 + top_p 0.95": SamplingParams(temperature=0.7, top_k=40, top_p=0.95),
    "min_p 0.05": SamplingParams(temperature=1.0, min_p=0.05),
    "greedy + logprobs 5": SamplingParams(temperature=0.0, logprobs=5),
    "repetition_penalty 1.2": SamplingParams(temperature=0.0, repetition_penalty=1.2),
}


def compiled(args, native: bool):
    """The sampling program lowered with the kernel seam's choice pinned (it is read while tracing)."""
    saved = ks.native_available
    ks.native_available = (lambda: saved()) if native else (lambda: False)
    try:
        # a fresh function: JAX reuses a traced function's program, whatever the seam answers now
        return jax.jit(lambda *a: JaxEngine._sample_step(*a), donate_argnums=(1,)).lower(*args).compile()
    finally:
        ks.native_available = saved


def model_logits(n: int) -> np.ndarray:
    """The default model's (q8_0-a16, bf16 K/V: the CPU default) logits after n 64-token passages."""
    from pathlib import Path

    from benchmarks.perplexity import MODES, PAGE_SIZE, build_engine, load_default_model
    from engine.api import SlotState, StepBatch, StepSeq

    cfg, params, tokenizer = load_default_model("q8_0-a16")
    engine = build_engine(cfg, params, MODES["q8_0-a16+bf16-kv"], dtype="float32", max_slots=n,
                          max_num_batched_tokens=64 * n)
    text = (Path(__file__).parent / "data" / "eval.txt").read_text()
    ids = tokenizer.encode(text)
    length, pages = 64, 64 // PAGE_SIZE
    passages = [ids[i * length:(i + 1) * length] for i in range(n)]
    for slot, prompt in enumerate(passages):
        engine.insert(slot, SlotState(prompt, [], SamplingParams(temperature=0.0)))
    batch = StepBatch([StepSeq(s, p, 0, list(range(1 + s * pages, 1 + (s + 1) * pages)), True)
                       for s, p in enumerate(passages)])
    return engine.model_logits(batch).astype(np.float32)


def nucleus(logits: np.ndarray, top_p: float) -> tuple[int, int]:
    """Tokens in each row's top-p nucleus at temperature 1: (median, max)."""
    z = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    p = np.sort(np.exp(z) / np.exp(z).sum(-1, keepdims=True), -1)[:, ::-1]
    sizes = (np.cumsum(p, -1) < top_p).sum(-1) + 1
    return int(np.median(sizes)), int(sizes.max())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,32")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--scale", type=float, default=3.0)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--logits", choices=("normal", "model"), default="normal")
    args = p.parse_args(argv)
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; load average {os.getloadavg()}; "
          f"sampling kernel native: {ks.native_available()}", flush=True)
    rows = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    model_rows = model_logits(max(rows)) if args.logits == "model" else None
    v = model_rows.shape[1] if model_rows is not None else args.vocab
    slots = 33
    if model_rows is not None:
        print(f"model logits: top-p 0.9 nucleus at temperature 1 spans {nucleus(model_rows, 0.9)} tokens "
              f"(median, max over {len(model_rows)} rows)")
    print("| setting | rows | native ms | reference ms | ratio |\n|---|---:|---:|---:|---:|")
    for b in rows:
        logits = jnp.asarray(model_rows[:b] if model_rows is not None else
                             (rng.normal(size=(b, v)) * args.scale).astype(np.float32))
        slot_ids, active = jnp.arange(b, dtype=jnp.int32), jnp.ones(b, bool)
        no_mask = jnp.full((b, mask_words(v)), 0xFFFFFFFF, jnp.uint32)
        for name, params in SETTINGS.items():
            sarrays = jax.tree.map(jnp.asarray, SamplingArrays.from_params([params] * b, list(range(b)), [0] * b, b))
            state = (jnp.zeros((slots, v), jnp.int32), jnp.zeros((slots, v), bool))
            shapes = (logits, state, slot_ids, active, sarrays, no_mask)
            programs = {"native": compiled(shapes, True), "reference": compiled(shapes, False)}
            times: dict[str, list[float]] = {k: [] for k in programs}
            for rep in range(args.reps + 2):
                for path, exe in programs.items():
                    start = time.perf_counter()
                    result, state = exe(logits, state, slot_ids, active, sarrays, no_mask)
                    jax.block_until_ready(result.token)
                    if rep >= 2:  # warm-up
                        times[path].append((time.perf_counter() - start) * 1e3)
            nat, ref = statistics.median(times["native"]), statistics.median(times["reference"])
            print(f"| {name} | {b} | {nat:.3f} | {ref:.3f} | {nat / ref:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
