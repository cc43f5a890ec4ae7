"""Time one decode step of ragged paged attention over all layers against the time to read its K/V once.

Run from the repo root (serialize timing runs with the other benchmarks):
    flock /tmp/slipstream-bench.lock .venv/bin/python -m benchmarks.kernel attention [--seqs 32] [--context 384]
The step is lax.scan over the layers with the cache as the carry (as the model runs it), donated, so
the kernel writes the new K/V in place. The bound is the bytes of K/V (and int8 scales) the step must
read, at the read bandwidth measured in the same run: numpy sums of a 1 GiB array on 1 and on all cores.
Shapes default to SmolLM2-135M: 30 layers, 9 query heads, 3 KV heads, head_dim 64, page_size 16.
--page-order sequential | descending | shared change the page tables (shared: every sequence reads the
same pages, so K/V stay in cache and the time is the compute alone). SLIPSTREAM_KV_HUGE_PAGES=0 keeps the
cache on 4 KiB pages (the kernel's A/B switch). --load-ahead all,scattered,prefetch times the kernel's
load-ahead modes against each other in this run (rounds of reps alternated): every block of K/V touched
right before its compute, only blocks not on one run of page ids (left to the hardware prefetchers), or
only an item's first block with each chunk prefetching the one a block ahead
(SLIPSTREAM_KV_LOAD_AHEAD sets the server's). --prefill T times one sequence's T-token prefill chunk instead (its K/V
written and attended, as a prompt's chunk runs in the engine).
"""
from __future__ import annotations

import argparse
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.measure import cpu_model
from slipstream.kernels import attention, native


def read_bandwidth(threads: int, gib: float = 1.0, reps: int = 5) -> float:
    """Bytes/s of summing a large f32 array, split over `threads` numpy threads (numpy drops the GIL)."""
    a = np.random.default_rng(0).random(int(gib * 2**30) // 4, dtype=np.float32)
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
        from slipstream.kernels import _ragged_paged_attention as ext

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
    `num_pages` replace --page-order's tables (e.g. the tables a served server's allocator built)."""
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
    # right before the timings: the machine is shared
    bw1, bwn = read_bandwidth(1, args.bandwidth_gib), read_bandwidth(cores, args.bandwidth_gib)
    bandwidth = max(bw1, bwn)
    bound_ms = step_bytes / bandwidth * 1e3
    print(f"{kv_dtype:>8} read bandwidth (numpy sum of {args.bandwidth_gib:g} GiB): 1 thread {bw1 / 1e9:.1f} GB/s, "
          f"{cores} threads {bwn / 1e9:.1f} GB/s; the bound uses {bandwidth / 1e9:.1f} GB/s")
    native_ms = float("nan")
    for name, times, cpu_ms in timed_paths(args, cache, operands, kv_dtype):
        ms = float(np.median(times)) * 1e3
        if name.startswith("native") and np.isnan(native_ms):
            native_ms = ms
        huge = ""
        if name.startswith("native") and native.load("ragged_paged_attention", "ragged_paged_attention"):
            from slipstream.kernels import _ragged_paged_attention as ext

            if hasattr(ext, "huge_pages"):  # builds before it lack it
                huge = (f"; cache on huge pages: {ext.huge_pages()['enabled']} (process AnonHugePages "
                        f"{huge_page_kib() >> 10} MiB)")
        print(f"{kv_dtype:>8} {name:>9}: {ms:8.2f} ms/step (min {min(times) * 1e3:.2f}), {ms / nl:6.3f} ms/layer; "
              f"cpu {cpu_ms:7.2f} ms/step; K/V read {step_bytes / 2**20:7.1f} MiB -> bound {bound_ms:7.2f} ms; "
              f"ratio {ms / bound_ms:5.2f}x (min {min(times) * 1e3 / bound_ms:5.2f}x){huge}")
    return native_ms


def machine() -> str:
    """The CPU, its load and which attention kernel path runs."""
    model = cpu_model()
    isa = "unavailable"
    if native.load("ragged_paged_attention", "ragged_paged_attention"):
        from slipstream.kernels import _ragged_paged_attention

        isa = _ragged_paged_attention.isa()
        if hasattr(_ragged_paged_attention, "load_ahead"):
            isa += f" load_ahead={_ragged_paged_attention.load_ahead()}"
    load1 = os.getloadavg()[0]  # other jobs on the cores: the kernel's helper threads then start late or never
    return (f"cpu: {model}, {os.cpu_count()} cores, load average {load1:.2f}; kernel: {native.kernel_paths()} "
            f"isa={isa}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernel attention", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
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
    parser.add_argument("--bandwidth-gib", type=float, default=1.0,
                        help="the array the read bandwidth is measured on (well past the last-level cache)")
    parser.add_argument("--reference", action="store_true", help="also time the pure-JAX reference")
    parser.add_argument("--load-ahead", default="", metavar="MODES",
                        help="comma-separated kernel load-ahead modes to time against each other in this run: all "
                             "(every block of K/V loaded right before its compute), scattered (only blocks not on "
                             "one run of page ids), prefetch (the first block; each chunk prefetches one a block "
                             "ahead); default: the kernel's choice for this CPU")
    parser.add_argument("--prefill", type=int, default=0, metavar="T",
                        help="time one sequence's T-token prefill chunk instead of the decode step")
    args = parser.parse_args(argv)
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

