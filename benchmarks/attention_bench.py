"""Time one decode step of ragged paged attention over all layers against the time to read its K/V once.

Run from the repo root (serialize timing runs with the other benchmarks):
    flock /tmp/slipstream-bench.lock .venv/bin/python -m benchmarks.attention_bench [--seqs 32] [--context 384]
The step is lax.scan over the layers with the cache as the carry (as the model runs it), donated, so
the kernel writes the new K/V in place. The bound is the bytes of K/V (and int8 scales) the step must
read, at the read bandwidth measured in the same run: numpy sums of a 1 GiB array on 1 and on all cores.
Shapes default to SmolLM2-135M: 30 layers, 9 query heads, 3 KV heads, head_dim 64, page_size 16.
--page-order sequential | descending | shared change the page tables (shared: every sequence reads the
same pages, so K/V stay in cache and the time is the compute alone). SLIPSTREAM_KV_HUGE_PAGES=0 keeps the
cache on 4 KiB pages (the kernel's A/B switch). --load-ahead all,scattered times the kernel's two
load-ahead modes against each other in this run (rounds of reps alternated): every block of K/V touched
right before its compute, or only blocks not on one run of page ids (left to the hardware prefetchers;
SLIPSTREAM_KV_LOAD_AHEAD sets the server's). benchmarks/page_placement_bench.py times `bench` on the page
tables a serving run's allocator built. --prefill T times one sequence's T-token prefill chunk instead (its K/V
written and attended, as a prompt's chunk runs in the engine).

Measured (2026-11-30, AMD EPYC Zen 4, 2 vCPUs shared with other jobs, AVX-512 VNNI, --reps 20), page
tables in random order. Before the VNNI path, on a quiet machine (load 0.2): f32 KV 29.9 ms/step against
a 12.5 ms bound at 45.4 GB/s, 2.40x; int8 KV 18.7 ms against 4.6 ms at 33.0 GB/s, 4.11x. After (int8 on
vpdpbusd, pages touched once per item), old and new .so in one run at load ~1.6 (other jobs share the
memory bus): f32 40.0 -> 44.0 ms, 2.41x -> 2.64x (the new .so alone ranged 38.4 to 47.6 ms in this run);
int8 23.8 -> 22.6 ms, 7.55x -> 5.23x (the measured bandwidth moved, 47.8 -> 34.7 GB/s). At load ~4,
interleaved A B A B: int8 46.1, 44.6 -> 39.6, 38.0 ms; f32 91.1, 85.8 -> 88.2, 81.6 ms. Profile (perf,
int8): the scores and P x V steps hold 75% of the kernel's samples, and about half of theirs sit on each
chunk's first K/V loads: the L2 prefetches, 4 chunks ahead, do not hide the memory latency (prefetching 2
or 8 chunks ahead, into L1, or only a page's first 4 lines: no clear change). f32 P x V: ~85% of its
samples on its first V loads.

Second session (same machine kind, family 25 model 17; the 2-thread numpy bandwidth swung 25-46 GB/s between
runs, so compare ms/step within a run). Base = 554b643; final = cache on huge pages + the chunk ahead
requested in parts + the same .so; medians of 40 reps, quiet reps of an interleaved run:
  page_size 16: f32 37.8 -> 38.1 ms (2.50x -> 2.36x), int8 20.8 -> 20.1 ms (4.86x -> 4.66x): no clear change;
  page_size 64: f32 35.2 -> 32.7 ms (2.23x -> 2.08x), int8 16.0 -> 15.0 ms (3.53x -> 3.49x).
  So page_size 16 -> 64 with the final .so: f32 ~38 -> 32.7 ms, int8 ~20.5 -> 15.0 ms (128: no better).
Where the rest goes (final .so, page_size 64):
  - compute alone (--page-order shared, K/V in cache): f32 9.1 ms, int8 6.6-7.5 ms per step, so int8 KV
    cannot meet 1.3x (~5.7 ms) without cheaper arithmetic, whatever the memory does;
  - the reads: one KV head's page segment is page_size x head_dim x 4 (f32) or x 1 (int8) bytes, in random
    order. A C probe reading 512 MiB in randomly ordered blocks on 2 threads (huge pages, nothing else to do)
    got 9.7 / 10.5 / 17.9 / 22.6 GB/s for 1 / 4 / 16 / 64 KiB blocks, 15-25 with software prefetch, against
    30-31 in order (another hour: 20 -> 30 for 4 KiB with prefetch, 35 in order); with compute per line the
    reads and the compute mostly add up;
  - consecutive pages (--page-order sequential) are faster: f32 28.5 ms, int8 12.8-13.5; descending ones
    (what the allocator handed out after frees until 24acafa) are no better than random (f32 33.8 ms).
No hardware counters in this VM (perf stat: cycles, dTLB-load-misses, cache-misses "not supported"), so
the TLB and miss-buffer explanations are inferred from these timings, not counted.

Fourth session (same machine kind, load 1.3-2.9 from other engineers' jobs; page_size 16, --reps 20).
Profile first, per part (one run, new .so): int8 KV random 20.6 ms, sequential 13.1, shared (compute
only) 7.55, bound 4.3-4.45 ms; f32 random 62.9 (a loaded rep set; 38 last session), sequential 29.1,
shared 9.6, bound 16-20 ms. So for both, reads and compute add up rather than overlap (int8 sequential
13.1 ~ 7.55 + 4.45; f32 29.1 ~ 9.6 + 16.7), random page order adds 7.5 ms (int8) on top, and int8's
compute alone is 1.7x its bound. Change: int8 K pages word-major (see kernels/attention.py), so the
VNNI scores load each word of 16 keys as it lies instead of transposing 16 rows per chunk. Old and new
.so interleaved (old, new, old, new) in one run, int8 ms/step: shared 6.91 -> 6.81 (a first pair,
disturbed: 14.02 -> 13.00), random 21.21 -> 20.21 and 20.50 -> 19.75, sequential 15.20 -> 11.64 and
14.68 -> 12.46; f32 random (its path unchanged) 45.3 -> 43.9 (a loaded pair). The transpose was not
the compute's big part: perf (cpu-clock samples, shared order, new .so) splits the kernel's samples
pv_i8 27%, softmax 26%, scores 24%, run (the write and the wait) 9%, attend's loop 7%, touch_keys 4%.
Then the AVX-512 softmax skips the horizontal max of a row unless a compare says the max grows (old /
new .so interleaved, int8, the quiet pair: shared 6.66 -> 6.40 ms, random 21.50 -> 19.02; CPU ms/step
of both pairs: shared 13.08 -> 12.58 and 14.07 -> 12.75, random 41.2 -> 36.6 and 37.7 -> 38.8). Next:
the row sums kept as vectors (one horizontal add per item, not per chunk), the p quantization's
per-row max in pv_i8; reads that overlap the compute (the sums above) and pages of one sequence allocated
next to each other (sequential is 1.6x faster than random for int8).

Sixth session (same machine kind, load ~1; --page-order sequential, which is what the allocator hands out
since page placement). Profile first: the kernel's own structure streaming the same bytes with no compute
(every 64th byte of each chunk's K and V rows loaded) took 19.2 ms against a 17.5 ms bound (1.09x), the
f32 step 25.2 and its compute alone (shared order) ~10 ms: reads and compute still add up. perf (shared,
f32): the 16-key scores 43% of the kernel's samples (a 16 x 16 transposing reduction per row and chunk),
P x V 29%, softmax 13%. Changes, each against the .so before it, interleaved in one run:
  - -fno-wrapv (Python's CFLAGS carry -fwrapv): f32 27.8, 27.7 -> 24.7, 25.0 ms; int8 12.2, 11.2 -> 11.5, 11.3.
  - f32 K pages column-major (kernels/attention.py's doc): scores by broadcast FMAs, keys in the lanes, no
    reductions. Against the main of the session's start: f32 32.4, 28.4 -> 21.5, 20.6 ms (1.33x, 1.31x of
    the bound); compute alone 9.5, 10.1 -> 8.0, 8.2 ms; int8 13.2, 12.5 -> 11.4, 11.7; random order f32 40.0, 40.1 ->
    35.0, 38.3.
  - Items whose pages are one run skip touch_keys and the software prefetches (env-switched first: touch
    off alone int8 11.2 -> 10.3-11.4, both off 9.9-10.0; f32 within noise; random int8 18.4 -> 20.7 with
    them off, so they stay for scattered pages): int8 11.4, 12.5 -> 10.4, 10.2 ms; f32 21.5, 17.9 ->
    19.1, 18.8 (1.24x, 1.17x of bounds of 15.5 and 16.1 ms); random order unchanged.
int8 stays at ~2.3-2.5x: its compute alone (shared order, final .so) is 6.2 ms against a 4.1-4.3 ms bound, so
even a full overlap would leave ~1.5x; perf (consecutive pages) puts P x V's hottest samples on the first
shuffle after each V load (the loads wait), scores 24%, P x V 28%, softmax 10%.

Seventh session (same machine kind; runs alternate the session's starting .so (A) and a changed one (B), the
VM's noise is +-10% between runs). perf, int8, shared order: P x V 32%, scores 27%, softmax 22% (40% of it
on the row sum's horizontal add), run 6%, touch_keys 6%. Changes:
  - the chunk loop software-pipelined by one chunk (the next chunk's scores right before this chunk's
    P x V; one chunk's three steps are more instructions than the out-of-order window holds): compute
    alone f32 10.05, 8.85, 8.57 -> 7.65, 7.46, 7.63 ms; int8 6.55, 7.04, 7.12 -> 6.33, 6.38, 7.57;
    sequential int8 12.10, 10.23, 10.12 -> 10.22, 10.02, 9.93, f32 19.90, 19.78, 19.01 -> 20.11, 18.26, 19.44.
  - tried, no gain, reverted: the int8 scores' accumulator chains interleaved across rows (rows inner:
    shared 6.5 -> 6.7-7.9 ms), and the softmax's row sums kept in lanes with one horizontal add per item
    (shared 6.31, 6.62, 6.38 -> 6.42, 6.61, 6.58): the out-of-order core already hid both.

Ninth session: AMD EPYC Zen 3 (family 25 model 1), AVX2 + FMA only, so the kernel runs its AVX2 path, which
had never been tuned (--reps 30, old and new .so alternated, ms/step medians; the VM swung up to 1.7x
between runs). The old AVX2 path: f32 scores by the compiler's vectorization of the portable word-major
loop, int8 K words copied back to row order and widened, scores reduced across lanes per key, P x V one
query row at a time. New: keys-in-lanes scores on word-major K for f32 and int8 (bytes sign-extended by
two shifts in registers), P x V with up to 6 rows per V load (int8 widened in registers), vector k_scale /
v_scale multiplies and the grows-only horizontal max in the softmax:
  - shared (compute alone): f32 32.6, 33.8 -> 17.4, 13.1 ms; int8 40.0, 24.6 -> 12.9, 12.4 (then the softmax
    and scale changes: 13.2, 13.3, 21.8, 15.3 -> 12.7, 12.9, 11.4, 18.0);
  - sequential: f32 55.9, 54.1 -> 40.1, 47.1 ms (bounds 25-32 ms); int8 39.8, 41.7 -> 18.9, 20.3 (bounds 6-8).
perf (cpu-clock, int8, shared): scores 34% of the kernel's samples, P x V 33%, softmax 18%, attend / touch /
run 15%. int8's compute alone (11-13 ms) is ~1.7x its read bound here, so 1.3x needs cheaper int8 arithmetic
than sign-extend + convert + FMA (e.g. pmaddubsw / pmaddwd on a quantized query, as the VNNI path does with
vpdpbusd).
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels import attention, native


def read_bandwidth(threads: int, gib: float = 1.0, reps: int = 5) -> float:
    """Bytes/s of summing a large f32 array, split over `threads` numpy threads (numpy drops the GIL)."""
    a = np.random.default_rng(0).standard_normal(int(gib * 2**30) // 4).astype(np.float32)
    parts = np.array_split(a, threads)
    best = float("inf")
    for _ in range(reps):
        sums = [0.0] * threads

        def run(i: int) -> None:
            sums[i] = float(parts[i].sum())

        workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - start)
    return a.nbytes / best


def huge_page_kib() -> int:
    """This process's anonymous memory on transparent huge pages (AnonHugePages), KiB."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


def make_step(layers: int, *, sm_scale: float, use_reference: bool):
    attend = attention.ragged_paged_attention_reference if use_reference else attention.ragged_paged_attention

    def step(cache, q, k_new, v_new, kv_lens, page_indices, cu_q_lens, num_seqs):
        def layer(carry, i):
            out, carry = attend(q, k_new, v_new, carry, i, kv_lens, page_indices, cu_q_lens, num_seqs,
                                sm_scale=sm_scale)
            return carry, out[0, 0, 0]

        cache, outs = jax.lax.scan(layer, cache, jnp.arange(layers, dtype=jnp.int32))
        return cache, outs

    return jax.jit(step, donate_argnums=0)


def time_steps(step, cache, operands, reps: int, label: str) -> tuple[dict, list[float], float]:
    """Runs the donated step once, then `reps` timed times: (cache, wall seconds per rep, CPU ms per rep)."""
    cache, _ = step(cache, *operands)
    jax.block_until_ready(cache)
    ptrs = [a.unsafe_buffer_pointer() for a in cache.values()]
    times = []
    cpu0 = time.process_time()
    for _ in range(reps):
        start = time.perf_counter()
        cache, outs = step(cache, *operands)
        jax.block_until_ready((cache, outs))
        times.append(time.perf_counter() - start)
    if [a.unsafe_buffer_pointer() for a in cache.values()] != ptrs:
        print(f"{label:>8} note: the cache buffers moved between steps")
    return cache, times, (time.process_time() - cpu0) / reps * 1e3


def timed_paths(args, cache, operands, label: str):
    """(name, wall seconds per rep, CPU ms per rep) of the native kernel, then (--reference) the pure-JAX
    reference, over the same donated cache. With --load-ahead A,B the native kernel runs under each mode,
    alternating rounds of reps (so both see the same machine), as native[A], native[B]."""
    modes = [m for m in (getattr(args, "load_ahead", "") or "").split(",") if m]
    if modes and native.load("ragged_paged_attention", "ragged_paged_attention"):
        from kernels import _ragged_paged_attention as ext

        step = make_step(args.layers, sm_scale=args.head_dim ** -0.5, use_reference=False)
        times = {m: [] for m in modes}
        cpu = {m: 0.0 for m in modes}
        per_round = max(5, args.reps // 4)
        for _ in range(-(-args.reps // per_round)):
            for m in modes:
                ext.load_ahead(m)
                cache, t, cpu_ms = time_steps(step, cache, operands, per_round, label)
                times[m] += t
                cpu[m] += cpu_ms * per_round
        ext.load_ahead("default")
        for m in modes:
            yield f"native[{m}]", times[m], cpu[m] / len(times[m])
    for name, use_reference in (("native", False), ("reference", True)):
        if (name == "reference" and not args.reference) or (name == "native" and modes):
            continue
        step = make_step(args.layers, sm_scale=args.head_dim ** -0.5, use_reference=use_reference)
        cache, times, cpu_ms = time_steps(step, cache, operands, args.reps, label)
        yield name, times, cpu_ms


def bench_prefill(kv_dtype: str, args) -> None:
    """One sequence's first --prefill tokens as one chunk (a prompt's prefill, as the engine runs it): the
    kernel writes their K/V and attends each token over the keys up to it. Prints ms per step."""
    rng = np.random.default_rng(0)
    t, kvh, g, hd, ps, nl = args.prefill, args.kv_heads, args.group, args.head_dim, args.page_size, args.layers
    pages = -(-t // ps)
    shape = (nl, kvh, pages + 1, ps, hd)
    if kv_dtype == "int8":
        cache = {"k": jnp.zeros(shape, jnp.int8), "v": jnp.zeros(shape, jnp.int8),
                 "k_scale": jnp.zeros(shape[:4], jnp.float32), "v_scale": jnp.zeros(shape[:4], jnp.float32)}
    else:
        cache = {"k": jnp.zeros(shape, kv_dtype), "v": jnp.zeros(shape, kv_dtype)}
    q = jnp.asarray(rng.standard_normal((t, kvh * g, hd), dtype=np.float32))
    kv_new = jnp.asarray(rng.standard_normal((t, kvh, hd), dtype=np.float32))
    operands = (q, kv_new, kv_new, jnp.asarray([t], jnp.int32), jnp.arange(1, pages + 1, dtype=jnp.int32)[None],
                jnp.asarray([0, t], jnp.int32), jnp.asarray([1], jnp.int32))
    for name, times, cpu_ms in timed_paths(args, cache, operands, kv_dtype):
        ms = float(np.median(times)) * 1e3
        print(f"{kv_dtype:>8} {name:>9}: prefill of {t} tokens {ms:8.2f} ms/step (min {min(times) * 1e3:.2f}), "
              f"{ms / nl:6.3f} ms/layer; cpu {cpu_ms:7.2f} ms/step")


def bench(kv_dtype: str, args, table: np.ndarray | None = None, num_pages: int | None = None) -> float:
    """Prints the step's times; returns the native kernel's median ms/step. `table` [seqs, pages] and the pool's
    `num_pages` replace --page-order's tables (benchmarks/page_placement_bench.py passes a served server's)."""
    rng = np.random.default_rng(0)
    s, ctx, kvh, g, hd, ps, nl = args.seqs, args.context, args.kv_heads, args.group, args.head_dim, \
        args.page_size, args.layers
    pages_per_seq = -(-ctx // ps)
    if table is None:
        num_pages = s * pages_per_seq + 1
        if args.page_order == "shared":  # every sequence reads the same pages: K/V stay in cache, compute only
            order = np.tile(rng.permutation(pages_per_seq), s)
        else:
            order = rng.permutation(s * pages_per_seq) if args.page_order == "random" else np.arange(s * pages_per_seq)
        table = (1 + order).reshape(s, pages_per_seq).astype(np.int32)
        if args.page_order == "descending":  # consecutive pages, each sequence's in descending order
            table = table[:, ::-1].copy()
    if table.shape != (s, pages_per_seq) or num_pages is None or table.max() >= num_pages:
        raise ValueError(f"page table {table.shape} (ids < {num_pages}) does not fit {s} seqs x {pages_per_seq} pages")
    shape = (nl, kvh, num_pages, ps, hd)
    if kv_dtype == "int8":
        cache = {"k": jnp.asarray(rng.integers(-127, 128, shape, dtype=np.int8)),
                 "v": jnp.asarray(rng.integers(-127, 128, shape, dtype=np.int8)),
                 "k_scale": jnp.full(shape[:4], 0.01, jnp.float32), "v_scale": jnp.full(shape[:4], 0.01, jnp.float32)}
        bytes_per_key = 2 * kvh * (hd + 4)
    else:
        cache = {"k": jnp.asarray(rng.standard_normal(shape, dtype=np.float32), kv_dtype),
                 "v": jnp.asarray(rng.standard_normal(shape, dtype=np.float32), kv_dtype)}
        bytes_per_key = 2 * kvh * hd * jnp.dtype(kv_dtype).itemsize
    q = jnp.asarray(rng.standard_normal((s, kvh * g, hd), dtype=np.float32))
    kv_new = jnp.asarray(rng.standard_normal((s, kvh, hd), dtype=np.float32))
    operands = (q, kv_new, kv_new, jnp.full((s,), ctx, jnp.int32), jnp.asarray(table),
                jnp.arange(s + 1, dtype=jnp.int32), jnp.asarray([s], jnp.int32))
    step_bytes = nl * s * ctx * bytes_per_key
    cores = os.cpu_count() or 1
    bw1, bwn = read_bandwidth(1), read_bandwidth(cores)  # right before the timings: the machine is shared
    bandwidth = max(bw1, bwn)
    bound_ms = step_bytes / bandwidth * 1e3
    print(f"{kv_dtype:>8} read bandwidth (numpy sum of 1 GiB): 1 thread {bw1 / 1e9:.1f} GB/s, {cores} threads "
          f"{bwn / 1e9:.1f} GB/s; the bound uses {bandwidth / 1e9:.1f} GB/s")
    native_ms = float("nan")
    for name, times, cpu_ms in timed_paths(args, cache, operands, kv_dtype):
        ms = float(np.median(times)) * 1e3
        if name.startswith("native") and np.isnan(native_ms):
            native_ms = ms
        huge = ""
        if name.startswith("native") and native.load("ragged_paged_attention", "ragged_paged_attention"):
            from kernels import _ragged_paged_attention as ext

            if hasattr(ext, "huge_pages"):  # builds before it lack it
                huge = (f"; cache on huge pages: {ext.huge_pages()['enabled']} (process AnonHugePages "
                        f"{huge_page_kib() >> 10} MiB)")
        print(f"{kv_dtype:>8} {name:>9}: {ms:8.2f} ms/step (min {min(times) * 1e3:.2f}), {ms / nl:6.3f} ms/layer; "
              f"cpu {cpu_ms:7.2f} ms/step; K/V read {step_bytes / 2**20:7.1f} MiB -> bound {bound_ms:7.2f} ms; "
              f"ratio {ms / bound_ms:5.2f}x (min {min(times) * 1e3 / bound_ms:5.2f}x){huge}")
    return native_ms


def machine() -> str:
    """The CPU, its load and which attention kernel path runs."""
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")),
                 platform.processor())
    isa = "unavailable"
    if native.load("ragged_paged_attention", "ragged_paged_attention"):
        from kernels import _ragged_paged_attention

        isa = _ragged_paged_attention.isa()
        if hasattr(_ragged_paged_attention, "load_ahead"):
            isa += f" load_ahead={_ragged_paged_attention.load_ahead()}"
    load1 = os.getloadavg()[0]  # other jobs on the cores: the kernel's helper threads then start late or never
    return (f"cpu: {model}, {os.cpu_count()} cores, load average {load1:.2f}; kernel: {native.kernel_paths()} "
            f"isa={isa}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--context", type=int, default=384)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--group", type=int, default=3, help="query heads per KV head")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--page-order", choices=("random", "sequential", "descending", "shared"), default="random",
                        help="page tables: a random permutation (a long-running server), consecutive pages (ascending or "
                             "descending), or "
                             "one sequence's pages shared by all (K/V cached: the compute-only time)")
    parser.add_argument("--kv-dtypes", default="float32,int8", help="comma-separated: float32, bfloat16, int8")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--reference", action="store_true", help="also time the pure-JAX reference")
    parser.add_argument("--load-ahead", default="", metavar="MODES",
                        help="comma-separated kernel load-ahead modes to time against each other in this run: all "
                             "(every block of K/V loaded right before its compute), scattered (only blocks not on "
                             "one run of page ids); default: the kernel's choice for this CPU")
    parser.add_argument("--prefill", type=int, default=0, metavar="T",
                        help="time one sequence's T-token prefill chunk instead of the decode step")
    args = parser.parse_args()
    print(machine())
    if args.prefill > 0:
        print(f"step: one sequence's {args.prefill}-token prefill chunk, {args.layers} layers, "
              f"{args.kv_heads * args.group} q heads / {args.kv_heads} KV heads, head_dim {args.head_dim}, "
              f"page_size {args.page_size}")
        for kv_dtype in args.kv_dtypes.split(","):
            bench_prefill(kv_dtype, args)
        return
    print(f"step: {args.seqs} seqs x context {args.context}, {args.layers} layers, {args.kv_heads * args.group} "
          f"q heads / {args.kv_heads} KV heads, head_dim {args.head_dim}, page_size {args.page_size}, "
          f"page order {args.page_order}")
    for kv_dtype in args.kv_dtypes.split(","):
        bench(kv_dtype, args)


if __name__ == "__main__":
    main()
