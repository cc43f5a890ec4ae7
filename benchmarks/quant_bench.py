"""Decode speed of f32, bf16 and int8 modes on the default model, and sequences per KV budget.

Decode: JaxEngine.generate steps (model + sampling + the host copy) at 1, 8, 32 and 64 occupied
slots with ~256 tokens of context, all modes in one process, interleaved in rounds so that load
from other processes hits every mode alike; median step time after warm-up. The KV pages are not
prefilled (a step's cost does not depend on the values it reads), so no mode pays for prompts.
Run from the repo root (several minutes on 2 CPU cores):
    .venv/bin/python -m benchmarks.quant_bench [--slots 1,8,32,64] [--steps 24] [--out bench.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax
import numpy as np

from benchmarks.perplexity import (PAGE_SIZE, Mode, build_engine, calibration_tokens, kv_bytes_per_token,
                                   load_default_model)
from engine.api import DecodeRow, SlotState
from engine.kv_cache import pages_needed
from engine.request import SamplingParams
from engine.runner import JaxEngine
from models.config import ModelConfig
from quantization import weight_bytes

CONTEXT = 256       # decode positions cycle through [CONTEXT - CYCLE, CONTEXT): one page bucket
CYCLE = 32
WARMUP_STEPS = 3    # after the compile


@dataclasses.dataclass(frozen=True)
class BenchMode:
    name: str
    mode: Mode
    dtype: str           # EngineConfig.dtype


def bench_modes(int8_dtype: str) -> list[BenchMode]:
    return [
        BenchMode("f32", Mode("f32", "none", "auto"), "float32"),
        BenchMode("bf16", Mode("bf16", "none", "auto"), "bfloat16"),
        BenchMode("w8a16", Mode("w8a16", "w8a16", "auto"), int8_dtype),
        BenchMode("w8a8", Mode("w8a8", "w8a8", "auto"), int8_dtype),
        BenchMode("w8a8+int8-kv", Mode("w8a8+int8-kv", "w8a8", "int8"), int8_dtype),
    ]


class DecodeLoop:
    """`slots` sequences decoding greedily on one engine, each on its own pages."""

    def __init__(self, engine: JaxEngine, slots: int) -> None:
        self.engine, self.slots = engine, slots
        self.pages_per_seq = pages_needed(CONTEXT, PAGE_SIZE)
        greedy = SamplingParams(temperature=0.0, max_tokens=CYCLE, ignore_eos=True)
        for s in range(slots):
            engine.insert(s, SlotState([1], [], greedy))
        self.tokens = [1 + s for s in range(slots)]
        self.step_count = 0

    def step(self) -> float:
        """One decode step over all slots; returns its wall time in seconds."""
        pos = CONTEXT - CYCLE + self.step_count % CYCLE
        rows = [DecodeRow(s, self.tokens[s], pos,
                          list(range(1 + s * self.pages_per_seq, 1 + (s + 1) * self.pages_per_seq)))
                for s in range(self.slots)]
        start = time.perf_counter()
        out = self.engine.generate(rows)  # returns host ints: the step is complete
        elapsed = time.perf_counter() - start
        self.tokens = [o.token_id for o in out]
        self.step_count += 1
        return elapsed

    def close(self) -> None:
        for s in range(self.slots):
            self.engine.free(s)


def decode_bench(cfg: ModelConfig, params: dict, modes: list[BenchMode], slot_counts: list[int],
                 steps: int, rounds: int, cal_ids: list[int] | None = None) -> list[dict]:
    max_slots = max(slot_counts)
    engines = {}
    for m in modes:
        engines[m.name] = build_engine(cfg, params, m.mode, dtype=m.dtype, max_slots=max_slots,
                                       num_pages=1 + max_slots * pages_needed(CONTEXT, PAGE_SIZE),
                                       max_seq_len=2 * CONTEXT, prefill_lengths=(16,), calibration_tokens=cal_ids)
    results = []
    for slots in slot_counts:
        loops = {}
        for m in modes:
            loop = loops[m.name] = DecodeLoop(engines[m.name], slots)
            start = time.perf_counter()
            for _ in range(WARMUP_STEPS):
                loop.step()
            print(f"[{slots} slots] {m.name}: compiled + warmed up in {time.perf_counter() - start:.1f} s",
                  file=sys.stderr, flush=True)
        times: dict[str, list[float]] = {m.name: [] for m in modes}
        per_round = -(-steps // rounds)
        for _ in range(rounds):
            for m in modes:
                times[m.name] += [loops[m.name].step() for _ in range(per_round)]
        for m in modes:
            loops[m.name].close()
            med = float(np.median(times[m.name]))
            engine = engines[m.name]
            results.append({"mode": m.name, "slots": slots, "dtype": str(engine.dtype),
                            "kv_dtype": str(engine.cache["k"].dtype), "steps": len(times[m.name]),
                            "median_step_ms": 1e3 * med, "min_step_ms": 1e3 * min(times[m.name]),
                            "tokens_per_s": slots / med, "weight_bytes": weight_bytes(engine.params)})
            print(f"[{slots} slots] {m.name}: {1e3 * med:.1f} ms/step, {slots / med:.1f} tok/s",
                  file=sys.stderr, flush=True)
    return results


def kv_budget(cfg: ModelConfig, params: dict, budget: int, seq_len: int) -> list[dict]:
    """Sequences of `seq_len` tokens that fit in `budget` bytes of KV, per KV dtype (num_pages from the engine)."""
    rows = []
    for name, dtype, kv in (("f32", "float32", "auto"), ("bf16", "bfloat16", "auto"), ("int8", "float32", "int8")):
        engine = build_engine(cfg, params, Mode(name, "none", kv), dtype=dtype, max_slots=1,
                              kv_cache_memory=budget)
        allocated = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(engine.cache))
        if allocated > budget:
            raise RuntimeError(f"{name} KV cache allocated {allocated} bytes, over the {budget}-byte budget")
        rows.append({"kv_dtype": name, "kv_bytes_per_token": kv_bytes_per_token(engine),
                     "num_pages": engine.num_pages, "allocated_bytes": allocated,
                     # page 0 is the reserved padding page
                     "sequences": (engine.num_pages - 1) // pages_needed(seq_len, PAGE_SIZE)})
        del engine
    return rows


def print_tables(decode: list[dict], budget_rows: list[dict], *, budget: int, seq_len: int) -> dict:
    modes = list(dict.fromkeys(r["mode"] for r in decode))
    slot_counts = list(dict.fromkeys(r["slots"] for r in decode))
    cell = {(r["mode"], r["slots"]): r for r in decode}
    print(f"decode tokens/s (median of {decode[0]['steps']} engine.generate steps, context "
          f"{CONTEXT - CYCLE}-{CONTEXT - 1}; backend {jax.default_backend()})")
    header = f"{'mode':14} {'act':9} {'kv':9} {'weights MiB':>11} | " + " | ".join(
        f"{s:>3} slots tok/s (ms)" for s in slot_counts)
    print(header)
    print("-" * len(header))
    for m in modes:
        first = cell[(m, slot_counts[0])]
        cells = " | ".join(f"{cell[(m, s)]['tokens_per_s']:10.1f} ({cell[(m, s)]['median_step_ms']:6.1f})"
                           for s in slot_counts)
        print(f"{m:14} {first['dtype']:9} {first['kv_dtype']:9} {first['weight_bytes'] / 2**20:11.1f} | {cells}")
    summary = {}
    ref_slots = 32 if 32 in slot_counts else slot_counts[-1]
    int8 = [m for m in modes if m.startswith("w8")]
    if "f32" in modes and int8:
        best = max(int8, key=lambda m: cell[(m, ref_slots)]["tokens_per_s"])
        ratio = cell[(best, ref_slots)]["tokens_per_s"] / cell[("f32", ref_slots)]["tokens_per_s"]
        summary = {"slots": ref_slots, "best_int8_mode": best, "speedup_vs_f32": ratio}
        print(f"best int8 mode at {ref_slots} slots: {best}, {ratio:.2f}x f32 decode tokens/s")
    print()
    print(f"KV budget {budget / 2**20:.0f} MiB: concurrent sequences of {seq_len} tokens "
          "(num_pages from the engine)")
    header = (f"{'kv dtype':9} {'B/token':>8} {'num_pages':>9} {'tokens':>7} {'sequences':>9} "
              f"{'vs f32':>7} {'vs bf16':>7}")
    print(header)
    print("-" * len(header))
    by = {r["kv_dtype"]: r for r in budget_rows}
    for r in budget_rows:
        tokens = (r["num_pages"] - 1) * PAGE_SIZE
        print(f"{r['kv_dtype']:9} {r['kv_bytes_per_token']:8.0f} {r['num_pages']:9d} {tokens:7d} {r['sequences']:9d} "
              f"{r['sequences'] / by['f32']['sequences']:6.2f}x {r['sequences'] / by['bf16']['sequences']:6.2f}x")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", default="1,8,32,64", help="comma-separated occupied slot counts")
    parser.add_argument("--steps", type=int, default=24, help="timed steps per mode and slot count (>= 20)")
    parser.add_argument("--rounds", type=int, default=4, help="interleaving rounds the steps are split into")
    parser.add_argument("--modes", default="f32,bf16,w8a16,w8a8,w8a8+int8-kv")
    parser.add_argument("--int8-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="activation dtype of the int8 modes (auto: float32 on CPU)")
    parser.add_argument("--kv-budget-mib", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    all_modes = {m.name: m for m in bench_modes(args.int8_dtype)}
    names = args.modes.split(",")
    unknown = [n for n in names if n not in all_modes]
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {', '.join(all_modes)}")
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be >= 1")
    slot_counts = [int(s) for s in args.slots.split(",")]
    cfg, params, tok = load_default_model()
    budget = args.kv_budget_mib * 2**20
    budget_rows = kv_budget(cfg, params, budget, args.seq_len)
    decode = decode_bench(cfg, params, [all_modes[n] for n in names], slot_counts, args.steps, args.rounds,
                          calibration_tokens(tok))
    summary = print_tables(decode, budget_rows, budget=budget, seq_len=args.seq_len)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
                       "decode": decode, "summary": summary, "kv_budget_bytes": budget,
                       "seq_len": args.seq_len, "kv_budget": budget_rows}, f, indent=2)


if __name__ == "__main__":
    main()
