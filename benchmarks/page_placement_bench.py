"""Page placement in serving: the page tables a churning server builds, and the attention kernel's time on them.

Run from the repo root (serialize timing runs with the other benchmarks):
    flock /tmp/slipstream-bench.lock .venv/bin/python -m benchmarks.page_placement_bench [--requests 400]
        [--steady 300] [--old-rev 80e0c42] [--head-rev 00c7880] [--shared 0.5] [--simulate-only]
A closed loop of `--concurrency` requests (random `--prompt`-token prompts, `--output` tokens, ignore EOS, a new
request as each one finishes) runs through the real StepPlanner and BlockManager, prefix cache on, with the pool
the server gets from --kv-cache-memory 768MiB for SmolLM2-135M (f32 KV: 1092 pages, int8: 4112). At the first step
after `--steady` requests were admitted with every slot busy, the running sequences are noted, and each one's
page table when it finishes (all `prompt + output` tokens) is kept. That runs with the page allocator and block
manager of `--old-rev` (loaded from git: the LIFO free list), of `--head-rev` (one run per sequence, admission
evicting LRU pages until one is open) and today's (evicting the cached pages of one chosen window), and
benchmarks/attention_bench.py times one decode step over exactly those tables (the cache as large as the pool),
the three interleaved. Contiguity: the fraction of page-table neighbours that are page id + 1, and how many
ascending runs a sequence's table is split into. A second, untimed loop has `--shared` of the prompts start with
one of `--shared-k` fixed 128-token heads, for the prefix-cache hit tokens.

Measured (2026-11-30 22:05, AMD EPYC, 2 vCPUs shared with other jobs, load 0.8, AVX-512 VNNI; defaults: 400
requests, noted after 300, --reps 20, 2 rounds old head new / new head old). Both pools are full of prefix-cache
pages by then; scheduling is the same in all (1679 steps, no preemption). Idle cached: prefix-cache pages no
sequence holds, mean over the steps after the noted one. Planner: host time per step (admit, plan, advance,
finish) in this simulation, +-20% from run to run.
                 neighbours id+1  runs/seq  idle cached  planner us  attention ms/step (rounds; median)
  f32  old           6.1%          22.59        486          134      39.39, 39.56; 39.47
       head        100.0%           1.00        271          206      31.46, 29.58; 30.52
       new         100.0%           1.00        290          195      29.34, 29.37; 29.36
  int8 old          26.6%          17.88       3506          129      20.87, 18.87; 19.87
       head        100.0%           1.00       2287          167      11.54, 13.55; 12.54
       new         100.0%           1.00       2294          253      12.16, 12.54; 12.35
  50% of prompts on one of 64 shared heads:  idle cached, prompt tokens from the cache, sequences in one run
  f32  old 498, 7776, 0%; head 213, 6144, 91%; new 368, 7552, 81%
  int8 old 3518, 16768, 0%; head 2247, 14976, 50%; new 2638, 16128, 78%
One run per sequence caps what the cache holds: a finished sequence leaves its 16 prompt pages cached and its 8
decode pages free between them, and a new run of 24 fits those 8-page gaps only by evicting 16 cached pages; so a
third or more of the pages no sequence holds stay free (old: all but ~16 are cached). Choosing the window
recovers what over-eviction lost, most where prompts share heads.
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
_KV_BYTES = {"float32": dict(dtype_bytes=4), "bfloat16": dict(dtype_bytes=2), "int8": dict(dtype_bytes=1, scale_bytes=4)}


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
    hit_tokens: int       # prompt tokens taken from the prefix cache, all requests


def simulate(blocks_cls: type, *, num_pages: int, args, shared: float = 0.0) -> Served:
    """`shared`: the fraction of prompts that start with one of `--shared-k` fixed `--shared-tokens`-token
    heads (picked uniformly; the rest of the prompt random), so cached heads come back after a while."""
    rng = np.random.default_rng(args.seed)
    heads = rng.integers(0, 49152, (args.shared_k, args.shared_tokens)).tolist()
    blocks = blocks_cls(num_pages, args.page_size, not args.no_prefix_cache)
    planner = StepPlanner(blocks, max_slots=args.concurrency, token_budget=args.token_budget)
    submitted = preemptions = steps = 0
    noted: list[Sequence] | None = None
    final: dict[int, list[int]] = {}
    cached: list[int] = []

    def submit() -> None:
        nonlocal submitted
        prompt = rng.integers(0, 49152, args.prompt).tolist()
        if rng.random() < shared:
            prompt[:args.shared_tokens] = heads[rng.integers(args.shared_k)]
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
                  float(np.mean(cached)), host_us, blocks.prefix.hit_tokens if blocks.prefix else 0)


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
    parser.add_argument("--head-rev", default="00c7880",
                        help="a commit whose admission evicts LRU pages (up to 2x its want) for one run")
    parser.add_argument("--shared", type=float, default=0.5,
                        help="a second, untimed workload: this fraction of prompts start with a shared head")
    parser.add_argument("--shared-k", type=int, default=64, help="how many distinct shared heads")
    parser.add_argument("--shared-tokens", type=int, default=128, help="tokens in a shared head")
    parser.add_argument("--kv-dtypes", default="float32,int8")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2, help="timing rounds, interleaved (old head new, new head old, ...)")
    parser.add_argument("--placements", default="old,head,new",
                        help="allocators to simulate and time: old (LIFO free list), head (--head-rev), new (this tree)")
    parser.add_argument("--load-ahead", default="", metavar="MODES",
                        help="time the kernel under each load-ahead mode (attention_bench --load-ahead)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-prefix-cache", action="store_true", help="as the server's flag")
    parser.add_argument("--simulate-only", action="store_true")
    args = parser.parse_args()
    print(attention_bench.machine())
    choices = {"old": lambda: old_block_manager(args.old_rev), "head": lambda: old_block_manager(args.head_rev),
               "new": lambda: block_manager.BlockManager}
    placements = {name: choices[name]() for name in args.placements.split(",")}
    served: dict[tuple[str, str], Served] = {}
    for shared in (0.0, args.shared) if args.shared else (0.0,):
        print(f"prompts: {shared:.0%} start with one of {args.shared_k} shared {args.shared_tokens}-token heads"
              + ("" if shared else " (the timed tables)"))
        for kv_dtype in args.kv_dtypes.split(","):
            per_token = kv_bytes_per_token(**_MODEL, **_KV_BYTES[kv_dtype])
            num_pages = num_pages_for_budget(args.kv_cache_memory, page_size=args.page_size,
                                             bytes_per_token=per_token)
            for name, blocks_cls in placements.items():
                s = simulate(blocks_cls, num_pages=num_pages, args=args, shared=shared)
                if not shared:
                    served[kv_dtype, name] = s
                print(f"{kv_dtype:>8} pool {num_pages} pages, {name:>4}: {s.steps} steps, {s.preemptions} preempted, "
                      f"{s.cached:.0f} pages cached, {s.hit_tokens} hit tokens, planner {s.host_us:.0f} us/step; "
                      f"{contiguity(s.tables)}")
    if args.simulate_only:
        return
    bench_args = argparse.Namespace(seqs=args.concurrency, context=args.prompt + args.output, layers=30, kv_heads=3,
                                    group=3, head_dim=64, page_size=args.page_size, reps=args.reps, reference=False,
                                    page_order="served", load_ahead=args.load_ahead)
    times: dict[tuple[str, str], list[float]] = {key: [] for key in served}
    for kv_dtype in args.kv_dtypes.split(","):
        for r in range(args.rounds):
            for name in list(placements)[::1 if r % 2 == 0 else -1]:  # ABC, CBA, ...: no side goes first
                s = served[kv_dtype, name]
                print(f"{name}:", end=" ")
                times[kv_dtype, name].append(attention_bench.bench(kv_dtype, bench_args, table=s.tables,
                                                                   num_pages=s.num_pages))
    for (kv_dtype, name), ms in times.items():
        print(f"{kv_dtype:>8} {name}: ms/step per round {', '.join(f'{m:.2f}' for m in ms)}; "
              f"median {np.median(ms):.2f}")


if __name__ == "__main__":
    main()
