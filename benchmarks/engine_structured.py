"""Structured-output overhead on the default model: decode tok/s at N slots with no row, one row
and every row constrained to a JSON schema, and the host time of the grammars per constrained token.

The engine holds 3N slots: each mode owns N sequences (own slots, pages and grammar state), and the
modes take turns step by step, so every mode sees the same background load. Run from the repo root:
    flock /tmp/slipstream-bench.lock .venv/bin/python -m benchmarks.engine structured [--slots 32]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.measure import cpu_model
from slipstream.engine.api import SlotState, StepBatch, StepSeq
from slipstream.engine.kv_cache import pages_needed
from slipstream.engine.request import SamplingParams
from slipstream.engine.device.runner import EngineConfig, JaxEngine
from slipstream.engine.structured import Constraint, GrammarCompiler
from slipstream.models.loader import load_model
from slipstream.models.registry import DEFAULT_MODEL, load_tokenizer, resolve_model

# Long enough that no row completes its grammar during the run (minItems), varied enough to
# exercise strings, enums, numbers and nesting.
SCHEMA = {"type": "array", "minItems": 40, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "role", "tags"],
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "role": {"enum": ["admin", "user", "guest"]},
                   "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}}}


class Group:
    """N sequences of one mode in slots first_slot.. (bound once), decoding together."""

    def __init__(self, engine, prompt, params_for, n, first_slot, first_page, steps):
        self.engine, self.prompt = engine, prompt
        self.slots = list(range(first_slot, first_slot + n))
        per = pages_needed(len(prompt) + steps + 1, engine.page_size)
        self.pages = [list(range(first_page + i * per, first_page + (i + 1) * per)) for i in range(n)]
        self.out: list[list[int]] = [[] for _ in range(n)]
        self.next_page = first_page + n * per
        for i, slot in enumerate(self.slots):
            engine.insert(slot, SlotState(tuple(prompt), (), params_for(i)))

    def prefill(self):
        per_step = max(1, self.engine.max_num_batched_tokens // len(self.prompt))
        rows = list(range(len(self.slots)))
        for k in range(0, len(rows), per_step):
            part = rows[k:k + per_step]
            batch = StepBatch(tuple(StepSeq(self.slots[i], self.prompt, 0, self.pages[i], True) for i in part))
            for i, s in zip(part, self.engine.step(batch)):
                self.out[i].append(s.token_id)

    def decode(self) -> float:
        n = len(self.prompt)
        batch = StepBatch(tuple(StepSeq(slot, [self.out[i][-1]], n + len(self.out[i]) - 1, self.pages[i], True)
                                for i, slot in enumerate(self.slots)))
        start = time.perf_counter()
        sampled = self.engine.step(batch)  # ends with the host copy of the sampled ids
        seconds = time.perf_counter() - start
        for i, s in enumerate(sampled):
            self.out[i].append(s.token_id)
        return seconds


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.engine structured", description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=32, help="sequences per mode (the engine holds 3x)")
    ap.add_argument("--steps", type=int, default=60, help="timed decode steps per mode")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)

    path = resolve_model(DEFAULT_MODEL)
    tokenizer = load_tokenizer(path)
    cfg, params = load_model(path)
    warmup = 3
    prompt = tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": "List the people in our team as JSON."}]))
    n = args.slots
    per_seq = pages_needed(len(prompt) + args.steps + warmup + 2, 16)
    engine = JaxEngine(cfg, params, EngineConfig(
        max_slots=3 * n, page_size=16, max_seq_len=512, num_pages=1 + 3 * n * per_seq,
        max_num_batched_tokens=max(3 * n, 64)), precompile=False)
    compiler = GrammarCompiler(tokenizer, cfg.vocab_size, engine.eos_token_ids)
    grammar = compiler.compile(Constraint("json_schema", SCHEMA))
    free = SamplingParams(temperature=0.7, seed=0, max_tokens=1 << 20, ignore_eos=True)
    constrained = SamplingParams(temperature=0.7, seed=0, max_tokens=1 << 20, constraint=grammar)

    modes = {"unconstrained": lambda i: free, "one_row": lambda i: constrained if i == 0 else free,
             "all_rows": lambda i: constrained}
    groups, page = {}, 1
    for k, (name, params_for) in enumerate(modes.items()):
        groups[name] = g = Group(engine, prompt, params_for, n, k * n, page, args.steps + warmup)
        page = g.next_page
        g.prefill()
        for _ in range(warmup):  # compiles the decode shapes, warms the grammars' lazy lexers
            g.decode()
    times: dict[str, list[float]] = {name: [] for name in modes}
    host: dict[str, list[float]] = {name: [0.0, 0.0, 0] for name in modes}
    for _ in range(args.steps):
        for name, g in groups.items():
            before = (engine.mask_seconds, engine.grammar.advance_seconds, engine.masked_rows)
            times[name].append(g.decode())
            after = (engine.mask_seconds, engine.grammar.advance_seconds, engine.masked_rows)
            host[name] = [h + a - b for h, a, b in zip(host[name], after, before)]

    cpu = cpu_model()
    results = {"machine": cpu, "slots": n, "model": DEFAULT_MODEL, "steps": args.steps}
    base = n / statistics.median(times["unconstrained"])
    print(f"{cpu}\ndefault model, {n} rows per step, {args.steps} decode steps per mode taken in turns "
          "(median step time)")
    for name in modes:
        tok_s = n / statistics.median(times[name])
        fill, advance, rows = host[name]
        fill_us, advance_us = (1e6 * fill / rows, 1e6 * advance / rows) if rows else (0.0, 0.0)
        results[name] = {"tok_s": tok_s, "ratio": tok_s / base, "step_ms": 1e3 * statistics.median(times[name]),
                         "mask_fill_us_per_token": fill_us, "advance_us_per_token": advance_us}
        print(f"  {name:14s} {tok_s:7.1f} tok/s  x{tok_s / base:.3f}  step {results[name]['step_ms']:6.1f} ms"
              f"  per constrained token: mask fill {fill_us:.0f} us, advance {advance_us:.0f} us")
    print("a constrained row:", repr(tokenizer.decode(groups["all_rows"].out[0])[:100]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
