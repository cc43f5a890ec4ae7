"""The kernel tool: each hot op of kernels/ alone, against what bounds it, measured in the same run.

    python -m benchmarks.kernel attention [--seqs 32] [--context 384] [--kv-dtypes float32,int8] [--prefill T]
    python -m benchmarks.kernel int8 [--reps 20] [--rows 256]       the group-wise int8 matmul
    python -m benchmarks.kernel f32 [--rows 256 1 32] [--layers 30]  the native f32 matmul
    python -m benchmarks.kernel sampling [--rows 1,32] [--scale 3] [--logits model]
    python -m benchmarks.kernel SUBCOMMAND --help

attention and int8 live in benchmarks/kernel_attention.py and kernel_int8.py; their docstrings say
what they measure.

sampling: The engine's sampling program alone (sample_program.sample_step, its [slots, V] state donated as in
the engine), with the native sampling kernel and with its JAX reference, compiled in one process and
timed in alternation, per sampling setting and row count. Rows are N(0, --scale) logits over the
default model's vocab (49152); flatter rows (smaller scale) put the top-p nucleus past more tokens.
With --logits model the rows are instead the default model's next-token logits after 32 passages of
benchmarks/data/eval.txt (64 tokens each), and the table also gives how many tokens the top-p 0.9
nucleus spans at temperature 1 (median and max over the rows).

f32: The native f32 matmul (kernels/f32_matmul.py) against XLA's f32 dot on the default model's linear
shapes, in GFLOP/s and as a share of the cores' f32 FMA peak (benchmarks/fma_peak.c).

Each case multiplies one input by L distinct weights of one shape in one program (L = the model's
layer count, so the weights stream from memory as they do in a step: the layers' weights together
exceed the last-level cache). Each product is written out whole (an optimization barrier keeps XLA
from fusing its dot into the reduction that follows, which would skip writing the output), and each
product's input depends on the one before, so one output buffer at a time is live, as in the model.
Times: median wall, and the process's CPU time per call spread over the cores (what a quiet machine
would reach; other load on a shared host lowers only the wall rate).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.measure import cpu_model, cpu_timed, fma_peak_gflops
from slipstream.engine.request import SamplingParams
from slipstream.engine.device.sample_program import empty_state, sample_step
from slipstream.engine.device.sampling import DraftRows, SamplingArrays
from slipstream.engine.structured import mask_words
from slipstream.kernels import f32_matmul as fm
from slipstream.kernels import sampling as ks

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
        return jax.jit(lambda *a: sample_step(*a), donate_argnums=(1,)).lower(*args).compile()
    finally:
        ks.native_available = saved


def model_logits(n: int) -> np.ndarray:
    """The default model's (q8_0-a16, bf16 K/V: the CPU default) logits after n 64-token passages."""
    from pathlib import Path

    from benchmarks.perplexity import MODES, PAGE_SIZE, build_engine, load_default_model
    from slipstream.engine.api import SlotState, StepBatch, StepSeq

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


def sampling(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernel sampling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
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
        drafts = jax.tree.map(jnp.asarray, DraftRows.none(b))
        settings = {name: jax.tree.map(jnp.asarray,
                                       SamplingArrays.from_params([params] * b, list(range(b)), [0] * b, b))
                    for name, params in SETTINGS.items()}
        # one program per path for every setting: the settings are arrays, not static arguments
        shapes = (logits, empty_state(slots, v), slot_ids, active, settings["greedy"], no_mask, drafts)
        programs = {"native": compiled(shapes, True), "reference": compiled(shapes, False)}
        for name, sarrays in settings.items():
            state = empty_state(slots, v)
            times: dict[str, list[float]] = {k: [] for k in programs}
            for rep in range(args.reps + 2):
                for path, exe in programs.items():
                    start = time.perf_counter()
                    result, state = exe(logits, state, slot_ids, active, sarrays, no_mask, drafts)
                    jax.block_until_ready(result.token)
                    if rep >= 2:  # warm-up
                        times[path].append((time.perf_counter() - start) * 1e3)
            nat, ref = statistics.median(times["native"]), statistics.median(times["reference"])
            print(f"| {name} | {b} | {nat:.3f} | {ref:.3f} | {nat / ref:.2f}x |", flush=True)
    return 0



# SmolLM2-135M: hidden 576, intermediate 1536, 9 heads x 64 (q 576), 3 KV heads x 64 (k/v 192)
SHAPES = {"q/k/v fused": (576, 960), "q, o": (576, 576), "k, v": (576, 192),
          "gate/up fused": (576, 3072), "gate, up": (576, 1536), "down": (1536, 576)}


def f32(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernel f32", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[256, 1, 32])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args(argv)
    if not fm.native_available():
        print("slipstream.kernels._f32_matmul is not built (or SLIPSTREAM_KERNELS=reference)")
        return 1
    import slipstream.kernels._f32_matmul as ext

    cores = os.cpu_count() or 1
    peak = fma_peak_gflops(cores)
    print(f"CPU: {cpu_model()}, {cores} cores; kernel isa {ext.isa()}; jax {jax.__version__}; "
          f"load {os.getloadavg()}; f32 FMA peak {peak:.0f} GFLOP/s" if peak else "")
    rng = np.random.default_rng(0)
    print(f"{'shape':>14} {'K':>5} {'N':>5} {'M':>4} | {'XLA wall':>9} {'cpu':>9} {'GF/s':>6} {'%pk':>4} | "
          f"{'native wall':>11} {'cpu':>9} {'GF/s':>6} {'%pk':>4} | {'GB/s':>5} | speed-up (cpu)")
    for m in args.rows:
        for label, (k, n) in SHAPES.items():
            ws = rng.standard_normal((args.layers, k, n), np.float32) * 0.02
            dense = [jnp.asarray(w) for w in ws]
            packed = jnp.asarray(fm.pack(ws))
            x = jnp.asarray(rng.standard_normal((m, k), np.float32))

            def chain(matmul, x):
                # each product's input depends on the previous product, so they run in order and each
                # output dies before the next is written (as in the model's layer loop)
                total = jnp.zeros((), jnp.float32)
                for i in range(args.layers):
                    y = jax.lax.optimization_barrier(matmul(x + total * 0.0, i))
                    total = total + y.sum()
                return total

            xla = jax.jit(lambda ws, x: chain(lambda x, i: jnp.dot(x, ws[i]), x))
            native = jax.jit(lambda packed, x: chain(lambda x, i: fm.f32_matmul(x, packed, n=n, layer=i), x))

            flops = 2.0 * m * k * n * args.layers
            xw, xc = cpu_timed(lambda: xla(dense, x), args.reps)
            nw, nc = cpu_timed(lambda: native(packed, x), args.reps)
            pk = lambda s: f"{flops / s / 1e9 / peak:4.0%}" if peak else "   -"  # noqa: E731
            print(f"{label:>14} {k:5d} {n:5d} {m:4d} | {xw * 1e3:7.2f}ms {xc * 1e3:7.2f}ms {flops / xc / 1e9:6.1f} {pk(xc)} | "
                  f"{nw * 1e3:9.2f}ms {nc * 1e3:7.2f}ms {flops / nc / 1e9:6.1f} {pk(nc)} | "
                  f"{ws.nbytes / nw / 1e9:5.1f} | x{xc / nc:.2f} (wall x{xw / nw:.2f})")
    return 0



def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command == "attention":
        from benchmarks.kernel_attention import main as attention

        attention(rest)
        return 0
    if command == "int8":
        from benchmarks.kernel_int8 import main as int8

        int8(rest)
        return 0
    if command == "f32":
        return f32(rest)
    if command == "sampling":
        return sampling(rest)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
