"""Group-wise int8 (Q8_0) matmul kernel against the machine's read bandwidth and XLA's f32 matmul.

Three measurements in one run, so their ratios share the machine's state:
  1. read bandwidth: an XLA max-reduction (jnp.max) streams a buffer 8x the L3 size once;
  2. one row (decode): every weight of a SmolLM2-135M decode step (30 layers x 4 matrices, q/k/v
     and gate/up fused as the engine runs them, + the 576x49152 LM head, ~150 MB, far beyond L3)
     once per call; the same calls in sequence (each row depends on the previous call's output, as
     in a decode step), split by the kernel's own clock (profile()) into time inside the calls and
     time between them (XLA's); then each shape alone (as many
     distinct copies as fill 2.5x the L3 size, so every call reads its weight from memory, as a decode
     step does); reported as bytes of packed weights + scales (+ offsets) read per second, and as a
     share of (1);
  3. many rows (prefill): each default-model shape at --rows, the kernel vs XLA's f32 matmul on
     the same x, timed alternately; GOP/s = 2*M*K*N / time (the useful work, whatever the parts);
  4. with --amx, on a CPU with AMX: the tile unit's dense peak (benchmarks/amx_peak.c, int8 and bf16) and, at every
     --rows (the tile unit forced at every row count: the crossover), the int8 tile path (q8_0, q8_0-a16, and
     q4-a16: q8_0-a16 with 4-bit packed weights, as the default model's Q4_1 layers load) and
     the bf16 path (q8_0-a16 with its pack_tiles) against the AVX-512 VNNI path, timed alternately;
  5. with --amx --engine: the default model's engine (q8_0-a16, bf16 K/V, 32 slots at 384 tokens of context): a
     32-slot decode step and a 256-token prefill chunk on the VNNI path and on the AMX path as configured (bf16
     tiles only with SLIPSTREAM_AMX_BF16=1), alternated within each rep; the q8 calls' time by the kernel's own
     clock, and the step's attention alone.
  6. with --channel: the per-output-channel kernel (kernels/int8_channel_matmul.py: the int8-channel modes, one
     and two activation parts) at --rows on the default model's layer shapes, on the AMX tile unit (where the CPU
     has it) and on AVX-512 VNNI, against the q8 kernel's q8_0 and q8_0-a16 on their default paths, all timed
     alternately; with AMX, the tile unit's int8 peak (benchmarks/amx_peak.c) measured in the same run.
  7. with --channel-parts, on a CPU with AMX: where one thread's time goes in that kernel's tile path at --rows
     (benchmarks/int8_channel_parts.cc, built against the kernel's source: the row quantization, the tile loop
     alone, + the C tile stores, + the float steps, the whole call), thread CPU time, with the tile unit's int8
     peak per core (benchmarks/amx_peak.c on one thread) measured in the same run.
  8. with --dispatch: the default dispatch (the ISA detected: on AMX the int8 tile path for the rows it is chosen for,
     VNNI for the rest) against AVX-512 VNNI alone, at each --rows, on the default model's decode-step chain (30 layers
     x 4 calls with 4-bit Q4_1 weights and offsets, two parts, the down projection gated, + the 8-bit LM head; each
     call's input from the one before, as in a step), alternated per rep in one process; the chain's time and the
     time inside the q8 calls (the kernel's own clock), and the per-rep ratios' medians. The rows' paths
     (_q8_matmul.route) are printed beside them.
Two forms of the kernel: "q8_0" (weights q * d, int8 activations: llama.cpp's Q8_0 x Q8_0) and
"q8_0-a16" (weights q * d + m, as the default model's Q4_1 blocks load, and two-part activations).
    python -m benchmarks.kernel int8 [--reps 20] [--rows 256] [--prefetch NEAR:FAR,...] [--amx [--engine]] [--channel]
                                     [--channel-parts] [--dispatch]
"""
from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.measure import cpu_model
from slipstream.kernels import native
from slipstream.kernels import q8_matmul as q8

# SmolLM2-135M: hidden 576, MLP 1536, 9 query / 3 KV heads of 64, vocab 49152, 30 layers. The engine
# fuses q/k/v and gate/up into one weight each (engine/layer_stack.py): 4 calls per layer.
LAYER_SHAPES = {"w_qkv": (576, 960), "wo": (576, 576), "w_gate_up": (576, 3072), "w_down": (1536, 576)}
LM_HEAD = (576, 49152)
N_LAYERS = 30
PREFILL_SHAPES = {"q/k/v 576x960": (576, 960), "o 576x576": (576, 576), "k/v 576x192": (576, 192),
                  "gate/up 576x3072": (576, 3072), "down 1536x576": (1536, 576), "lm_head 576x49152": LM_HEAD}


def l3_bytes() -> int:
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            text = f.read().strip()
        return int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]]
    except (OSError, ValueError, KeyError):
        return 32 << 20


FORMS = {"q8_0": dict(parts=1, offsets=False), "q8_0-a16": dict(parts=2, offsets=True)}


def random_q8(rng: np.random.Generator, k: int, n: int, offsets: bool = False) -> tuple:
    """(packed, scales, offsets or None) of a random [k, n] weight."""
    q = rng.integers(-127, 128, (n, k), dtype=np.int8)
    d = (rng.random((n, -(-k // q8.GROUP))) * 1e-2).astype(np.float32)
    m = (rng.standard_normal(d.shape) * 1e-2).astype(np.float32) if offsets else None
    arrays = q8.pack(q, d, m)
    return tuple(jnp.asarray(a) for a in arrays) + ((None,) if m is None else ())


def random_q4(rng: np.random.Generator, k: int, n: int) -> tuple:
    """(packed, scales, offsets) of a random [k, n] weight with values in 0..15 and offsets (GGUF's Q4_1), packed at
    4 bits."""
    q = rng.integers(0, 16, (n, k), dtype=np.int8)
    d = (rng.random((n, -(-k // q8.GROUP))) * 1e-2).astype(np.float16).astype(np.float32)
    m = (rng.standard_normal(d.shape) * 1e-2).astype(np.float16).astype(np.float32)
    return tuple(jnp.asarray(a) for a in q8.pack(q, d, m, bits=4))


def copies_beyond_l3(k: int, n: int, offsets: bool) -> int:
    """How many distinct [k, n] weights fill 2.5x the L3 size (at least 4)."""
    per_copy = k * n * (1 + (2 if offsets else 1) * 4 / q8.GROUP)
    return max(4, int(2.5 * l3_bytes() / per_copy) + 1)


def probe_call() -> tuple:
    """(jitted read, its args, bytes): a buffer 8x the L3 size, read once per call by a max-reduction."""
    data = jax.device_put(np.random.default_rng(1).integers(0, 255, 8 * l3_bytes(), dtype=np.uint8))
    return jax.jit(jnp.max), (data,), data.nbytes


def one_row_call(weights: list[tuple], parts: int) -> tuple:
    """(jitted step, its args, bytes): one row through every weight in `weights` (packed, scales,
    offsets, n), as a decode step runs them."""
    def step(x, ws):
        total = jnp.zeros((), jnp.float32)
        for (packed, scales, offsets), n in zip(ws, ns):
            y = q8.q8_matmul(x[: packed.shape[1] // q8.TILE], packed, scales, offsets, n=n, parts=parts)
            total = total + y[0]  # keeps every call live; x stays the same row
        return total

    ns = [w[-1] for w in weights]
    ws = [w[:-1] for w in weights]
    x = jax.device_put(np.random.default_rng(2).standard_normal(1536).astype(np.float32))
    return jax.jit(step), (x, ws), sum(a.nbytes for w in ws for a in w if a is not None)


def chained_call(weights: list[tuple], parts: int) -> tuple:
    """Like one_row_call, but each call's row depends on the previous call's output, so the calls run
    one after another as a decode step runs them (one_row_call's calls are independent: XLA runs two
    at once, each on one thread, and hides what happens between calls)."""
    def step(x, ws):
        for (packed, scales, offsets), n in zip(ws, ns):
            y = q8.q8_matmul(x[:, : packed.shape[1] // q8.TILE], packed, scales, offsets, n=n, parts=parts)
            x = x + y[0, 0] * 1e-20  # a tiny XLA op between calls, as the decode step has its own
        return x

    ns = [w[-1] for w in weights]
    ws = [w[:-1] for w in weights]
    x = jax.device_put(np.random.default_rng(2).standard_normal((1, 1536)).astype(np.float32))
    return jax.jit(step), (x, ws), sum(a.nbytes for w in ws for a in w if a is not None)


def in_sequence(ext, probe: tuple, call: tuple, reps: int) -> dict:
    """Times `call` (a chained_call) paired with the probe, and splits each rep by the kernel's own clock
    (ext.profile): time inside the calls and time between them. Returns per-rep arrays."""
    (pf, pargs, pbytes), (fn, args, nbytes) = probe, call
    jax.block_until_ready(fn(*args))
    out = {key: np.empty(reps) for key in ("bw", "step", "inside")}
    for rep in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(pf(*pargs))
        out["bw"][rep] = pbytes / (time.perf_counter() - start)
        ext.profile(True)
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        out["step"][rep] = time.perf_counter() - start
        calls = ext.profile(False)
        out["inside"][rep] = sum(end - begin for begin, end, _, _ in calls) / 1e9
    out["calls"] = len(calls)
    return out


def paired_rates(calls: list[tuple], reps: int) -> list[np.ndarray]:
    """Bytes per second of each (fn, args, bytes) call, timed round-robin rep by rep, so that the
    ratios between them see the same machine state (other processes come and go on shared hosts)."""
    jax.block_until_ready([fn(*args) for fn, args, _ in calls])  # compile + warm
    rates = [np.empty(reps) for _ in calls]
    for rep in range(reps):
        for (fn, args, nbytes), rate in zip(calls, rates):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            rate[rep] = nbytes / (time.perf_counter() - start)
    return rates


def many_rows(rng: np.random.Generator, k: int, n: int, m: int, reps: int) -> list[np.ndarray]:
    """Seconds per rep of x [m, k] @ w [k, n]: XLA f32, then each of FORMS, timed round-robin."""
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.float32)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    calls = [(jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)), (x, w))]
    for form in FORMS.values():
        weight = random_q8(rng, k, n, form["offsets"])
        fn = jax.jit(lambda x, p, s, o, parts=form["parts"]: q8.q8_matmul(x, p, s, o, n=n, parts=parts))
        calls.append((fn, (x, *weight)))
    jax.block_until_ready([fn(*args) for fn, args in calls])
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(reps):
        for (fn, args), t in zip(calls, times):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            t.append(time.perf_counter() - start)
    return [np.asarray(t) for t in times]


def prefetch_ab(ext, call: tuple, settings: str, reps: int, form: str) -> None:
    """The chained decode step at each one-row prefetch setting ("near:far,near:far", bytes into L1 and
    L2), alternated within each rep; prints medians and the per-rep time ratio to the first setting."""
    (fn, args, nbytes), pairs = call, [tuple(int(v) for v in s.split(":")) for s in settings.split(",")]
    prev = ext.prefetch()
    times = np.empty((len(pairs), reps))
    try:
        for rep in range(reps):
            for i, pair in enumerate(pairs):
                ext.prefetch(*pair)
                start = time.perf_counter()
                jax.block_until_ready(fn(*args))
                times[i, rep] = time.perf_counter() - start
    finally:
        ext.prefetch(*prev)
    for pair, t in zip(pairs, times):
        print(f"    {form:9} {'  prefetch near %d far %d' % pair:34} {nbytes / 2**20:6.1f} MiB: step "
              f"{np.median(t) * 1e3:.2f} ms, {nbytes / np.median(t) / 1e9:.1f} GB/s; x{np.median(t / times[0]):.3f} "
              f"the time at near {pairs[0][0]} far {pairs[0][1]}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernel int8", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rows", default="256", help="comma-separated row counts for the f32 comparison")
    parser.add_argument("--prefetch", default="", metavar="NEAR:FAR,...",
                        help="also time the chained decode step at these one-row prefetch distances (bytes into "
                             "L1 and L2; the CPU's own setting is printed first)")
    parser.add_argument("--amx", action="store_true", help="only [4]: the tile unit against the VNNI path")
    parser.add_argument("--engine", action="store_true", help="with --amx, only [5]: engine steps on each path")
    parser.add_argument("--channel", action="store_true", help="only [6]: the per-channel kernel against q8_0(-a16)")
    parser.add_argument("--channel-parts", action="store_true",
                        help="only [7]: where one thread's time goes in the per-channel kernel's tile path")
    parser.add_argument("--dispatch", action="store_true",
                        help="only [8]: the default dispatch against VNNI alone on the decode-step chain at --rows")
    args = parser.parse_args(argv)
    if not native.load("q8_matmul", "q8_matmul"):
        raise SystemExit("the native kernel is not available (see the log above); nothing to measure")
    import slipstream.kernels._q8_matmul as ext

    print(f"cpu: {cpu_model()} ({os.cpu_count()} logical CPUs, L3 {l3_bytes() >> 20} MiB); kernel isa: "
          f"{ext.isa()}; one-row prefetch near/far {ext.prefetch()} bytes; jax {jax.__version__}, backend {jax.default_backend()}; medians of {args.reps}")
    rng = np.random.default_rng(0)
    if args.channel_parts or args.channel:
        from benchmarks.kernel_int8_channel import channel_parts, channel_rows

        rows = [int(r) for r in args.rows.split(",")]
        return channel_parts(rows, args.reps) if args.channel_parts else channel_rows(rng, rows, args.reps)
    if args.dispatch or args.amx:
        from benchmarks.kernel_int8_amx import amx_engine, amx_rows, dispatch_rows

        if args.dispatch:
            return dispatch_rows(ext, rng, [int(r) for r in args.rows.split(",")], args.reps)
        if args.engine:
            return amx_engine(ext, args.reps)
        return amx_rows(ext, rng, [int(r) for r in args.rows.split(",")], args.reps)
    probe = probe_call()
    print(f"\n[1] read bandwidth (jnp.max over {probe[2] >> 20} MiB) and [2] one row: packed weights + "
          "scales (+ offsets) read per second; each kernel run is paired with a probe run right before "
          "it, and the share is the median of the per-pair ratios")
    for form, opts in FORMS.items():
        step_weights = [(*random_q8(rng, k, n, opts["offsets"]), n)
                        for _ in range(N_LAYERS) for k, n in LAYER_SHAPES.values()]
        step_weights.append((*random_q8(rng, *LM_HEAD), LM_HEAD[1]))  # the LM head is Q8_0 in the GGUF
        sets = [("decode step: 30 layers + LM head", lambda: step_weights)]
        for shape, (k, n) in PREFILL_SHAPES.items():
            copies = copies_beyond_l3(k, n, opts["offsets"])
            sets.append((f"{shape}, {copies} copies",
                         lambda k=k, n=n, c=copies: [(*random_q8(rng, k, n, opts["offsets"]), n) for _ in range(c)]))
        chain = chained_call(step_weights, opts["parts"])
        t = in_sequence(ext, probe, chain, args.reps)
        between = (t["step"] - t["inside"]) / t["calls"]
        print(f"    {form:9} {'decode step, calls in sequence':34} {chain[2] / 2**20:6.1f} MiB: step share "
              f"{np.median(chain[2] / t['step'] / t['bw']):4.0%}; inside the {t['calls']} calls "
              f"{np.median(chain[2] / t['inside'] / t['bw']):4.0%} of the probe ({np.median(t['inside']) * 1e3:.2f} of "
              f"{np.median(t['step']) * 1e3:.2f} ms); between calls {np.median(between) * 1e6:.1f} us per call",
              flush=True)
        if args.prefetch:
            prefetch_ab(ext, chain, args.prefetch, args.reps, form)
        del chain
        for name, make in sets:
            ws = make()
            call = one_row_call(ws, opts["parts"])
            bw, rate = paired_rates([probe, call], args.reps)
            print(f"    {form:9} {name:34} {call[2] / 2**20:6.1f} MiB: {np.median(rate) / 1e9:5.1f} GB/s; probe "
                  f"{np.median(bw) / 1e9:5.1f} GB/s; share {np.median(rate / bw):4.0%} "
                  f"(quartiles {np.percentile(rate / bw, 25):.0%}-{np.percentile(rate / bw, 75):.0%})", flush=True)
            del ws, call
        del step_weights

    print("\n[3] many rows: XLA f32 matmul vs the kernel (GOP/s = 2*M*K*N / median time; speed-up: median of "
          "per-rep f32/kernel time ratios)")
    cells = " | ".join(f"{form + ' ms':>14} {'GOP/s':>6} {'x f32':>6}" for form in FORMS)
    print(f"    {'shape':20} {'M':>4} | {'f32 ms':>8} {'GFLOP/s':>8} | {cells}")
    for m in (int(r) for r in args.rows.split(",")):
        for name, (k, n) in PREFILL_SHAPES.items():
            t_f32, *t_forms = many_rows(rng, k, n, m, args.reps)
            ops = 2.0 * m * k * n
            # speed-up: median over reps of the f32 / kernel time ratio within the same rep
            row = " | ".join(f"{np.median(t) * 1e3:14.3f} {ops / np.median(t) / 1e9:6.1f} "
                             f"{np.median(t_f32 / t):5.2f}x" for t in t_forms)
            print(f"    {name:20} {m:>4} | {np.median(t_f32) * 1e3:8.3f} {ops / np.median(t_f32) / 1e9:8.1f} | {row}",
                  flush=True)

