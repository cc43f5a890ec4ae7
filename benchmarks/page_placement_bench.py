"""Page placement in serving: the page tables a churning server builds, and the attention kernel's time on them.

Run from the repo root (serialize timing runs with the other benchmarks):
    flock /tmp/slipstream-bench.lock .venv/bin/python -m benchmarks.page_placement_bench [--requests 400]
        [--steady 300] [--old-rev 80e0c42] [--simulate-only]
A closed loop of `--concurrency` requests (random `--prompt`-token prompts, `--output` tokens, ignore EOS, a new
request as each one finishes) runs through the real StepPlanner and BlockManager, prefix cache on, with the pool
the server gets from --kv-cache-memory 768MiB for SmolLM2-135M (f32 KV: 1092 pages, int8: 4112). At the first step
after `--steady` requests were admitted with every slot busy, the running sequences are noted, and each one's
page table when it finishes (all `prompt + output` tokens) is kept. That runs once with the page allocator and
block manager of `--old-rev` (loaded from git: the LIFO free list) and once with today's, and
benchmarks/attention_bench.py times one decode step over exactly those tables (the cache as large as the pool),
old and new interleaved. Contiguity: the fraction of page-table neighbours that are page id + 1, and how many
ascending runs a sequence's table is split into.

Measured (2026-11-30, AMD EPYC, 2 vCPUs shared with other jobs, load 1.3, AVX-512 VNNI; defaults: 400 requests,
noted after 300, --reps 20, old = 80e0c42; 2 rounds, old first in both: before the ABBA order). Both pools are
full of prefix-cache pages by then.
  f32 KV, pool 1092: neighbours id+1 6.1% (old, 22.6 runs per sequence of 24 pages) -> 100% (new, one run each);
    native attention 42.74, 41.13 -> 31.12, 29.30 ms/step, median 41.94 -> 30.21 (1.39x).
  int8 KV, pool 4112: neighbours id+1 26.6% (17.9 runs) -> 100% (one run each);
    18.62, 18.58 -> 12.32, 12.24 ms/step, median 18.60 -> 12.28 (1.51x).
Scheduling is the same (1679 steps, no preemption, both); the idle prefix-cache pages, mean over the steps after
the noted one, drop 486 -> 271 (f32) and 3506 -> 2287 (int8): admission evicts enough for one open run. The
planner's host time per step (admit, plan, advance, finish; this simulation) goes 118 -> 157 us for both pools.
"""
from __future__ import annotations

import argparse
import dataclasses
import subprocess
import time
import types

import numpy as np

from benchmarks import attention_bench
from engine import block_manager
from engine.kv_cache import kv_bytes_per_token, num_pages_for_budget
from engine.request import Request, SamplingParams
from engine.schedule import StepPlanner
from engine.sequence import Sequence

# SmolLM2-135M, the server's default model: 30 layers, 3 KV heads, head_dim 64.
_MODEL = dict(num_layers=30, n_kv_heads=3, head_dim=64)
_KV_BYTES = {"float32": dict(dtype_bytes=4), "int8": dict(dtype_bytes=1, scale_bytes=4)}


def old_block_manager(rev: str) -> type:
    """BlockManager and PageAllocator as they were at `rev`, as fresh modules (the tree stays as it is)."""
    modules = {}
    for name in ("kv_cache", "block_manager"):
        source = subprocess.run(["git", "show", f"{rev}:engine/{name}.py"], capture_output=True, text=True,
                                check=True).stdout
        module = types.ModuleType(f"{name}@{rev}")
        exec(compile(source, f"{rev}:engine/{name}.py", "exec"), module.__dict__)  # noqa: S102 - our own history
        modules[name] = module
    modules["block_manager"].PageAllocator = modules["kv_cache"].PageAllocator
    return modules["block_manager"].BlockManager


@dataclasses.dataclass
class Served:
    tables: np.ndarray    # [concurrency, pages]: the noted sequences' final page tables
    num_pages: int
    steps: int
    preemptions: int
    cached: float         # prefix-cache pages nobody holds, mean over the steps after the noted one
    host_us: float        # planner time per step (admit + plan + advance + finish), all steps


def simulate(blocks_cls: type, *, num_pages: int, args) -> Served:
    rng = np.random.default_rng(args.seed)
    blocks = blocks_cls(num_pages, args.page_size, not args.no_prefix_cache)
    planner = StepPlanner(blocks, max_slots=args.concurrency, token_budget=args.token_budget)
    submitted = preemptions = steps = 0
    noted: list[Sequence] | None = None
    final: dict[int, list[int]] = {}
    cached: list[int] = []

    def submit() -> None:
        nonlocal submitted
        prompt = rng.integers(0, 49152, args.prompt).tolist()
        request = Request(prompt_ids=prompt, params=SamplingParams(max_tokens=args.output, ignore_eos=True))
        planner.enqueue(Sequence(request, tracker=None, order=submitted))
        submitted += 1

    for _ in range(args.concurrency):
        submit()
    start = time.perf_counter()
    while planner.running or planner.waiting:
        for seq in planner.admit().admitted:
            seq.inserted = True
        if noted is None and submitted >= args.steady and len(planner.running) == args.concurrency:
            noted = list(planner.running)
        plan = planner.plan()
        preemptions += len(plan.preempted)
        planner.advance(plan)
        steps += 1
        if noted is not None:
            t0 = time.perf_counter()
            cached.append(planner.pages_cached)  # O(cache): not the planner's time
            start += time.perf_counter() - t0
        for seq in plan.sampled:
            seq.add_sample(1)
            if len(seq.output_ids) >= args.output:
                final[seq.order] = list(seq.pages)
                planner.finish(seq)
                if submitted < args.requests:
                    submit()
    host_us = (time.perf_counter() - start) / steps * 1e6
    if noted is None:
        raise SystemExit(f"no step with {args.concurrency} running after {args.steady} requests: raise --requests")
    return Served(np.array([final[s.order] for s in noted], dtype=np.int32), num_pages, steps, preemptions,
                  float(np.mean(cached)), host_us)


def contiguity(tables: np.ndarray) -> str:
    follows = np.diff(tables, axis=1) == 1
    runs = 1 + (~follows).sum(axis=1)
    return (f"neighbours id+1 {follows.mean():6.1%}, one run {np.mean(runs == 1):6.1%} of seqs, "
            f"runs per seq mean {runs.mean():5.2f} max {runs.max()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--steady", type=int, default=300, help="note the running sequences after this many")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--token-budget", type=int, default=288, help="the server's --max-num-batched-tokens")
    parser.add_argument("--kv-cache-memory", type=int, default=768 << 20)
    parser.add_argument("--old-rev", default="80e0c42", help="a commit with the LIFO free list allocator")
    parser.add_argument("--kv-dtypes", default="float32,int8")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2, help="old/new timing pairs, interleaved (ABBA)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-prefix-cache", action="store_true", help="as the server's flag")
    parser.add_argument("--simulate-only", action="store_true")
    args = parser.parse_args()
    print(attention_bench.machine())
    placements = {"old": old_block_manager(args.old_rev), "new": block_manager.BlockManager}
    served: dict[tuple[str, str], Served] = {}
    for kv_dtype in args.kv_dtypes.split(","):
        per_token = kv_bytes_per_token(**_MODEL, **_KV_BYTES[kv_dtype])
        num_pages = num_pages_for_budget(args.kv_cache_memory, page_size=args.page_size, bytes_per_token=per_token)
        for name, blocks_cls in placements.items():
            s = served[kv_dtype, name] = simulate(blocks_cls, num_pages=num_pages, args=args)
            print(f"{kv_dtype:>8} pool {num_pages} pages, {name}: {s.steps} steps, {s.preemptions} preemptions, "
                  f"{s.cached:.0f} pages cached, planner {s.host_us:.0f} us/step; "
                  f"{contiguity(s.tables)}")
    if args.simulate_only:
        return
    bench_args = argparse.Namespace(seqs=args.concurrency, context=args.prompt + args.output, layers=30, kv_heads=3,
                                    group=3, head_dim=64, page_size=args.page_size, reps=args.reps, reference=False,
                                    page_order="served")
    times: dict[tuple[str, str], list[float]] = {key: [] for key in served}
    for kv_dtype in args.kv_dtypes.split(","):
        for r in range(args.rounds):
            for name in list(placements)[::1 if r % 2 == 0 else -1]:  # old new, new old, ...: no side goes first
                s = served[kv_dtype, name]
                print(f"{name}:", end=" ")
                times[kv_dtype, name].append(attention_bench.bench(kv_dtype, bench_args, table=s.tables,
                                                                   num_pages=s.num_pages))
    for (kv_dtype, name), ms in times.items():
        print(f"{kv_dtype:>8} {name}: ms/step per round {', '.join(f'{m:.2f}' for m in ms)}; "
              f"median {np.median(ms):.2f}")


if __name__ == "__main__":
    main()
