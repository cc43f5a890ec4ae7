"""The spec phase of benchmarks/device.py (issue 49 on the device), in the phases' process:

- steps: one verification step of K drafts per sequence (K + 1 query tokens, every one sampled) at
  --spec-slots sequences of --context tokens, for each K of --spec-drafts (K = 0 is the plain decode),
  timed round-robin; with the tokens per second it would yield if every draft were accepted, and how many
  tokens a sequence must gain per step for it to beat K = 0;
- identity: --spec-prompts requests (repeat prompts from the bench's repeat dataset, random ones, and
  drawn requests among them in the same batches) through the scheduler without speculation and with
  n-gram speculation: greedy outputs compared token for token, the drafts verified and accepted counted.
  Where one differs, the logits after the shared prefix say whether the two tokens were a near tie
  (bf16 programs of different shapes may round them apart) or not.

Both use one engine (its sampling slots are enough for every sequence's K + 1 rows), so the phase
compiles once.
"""
from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from benchmarks.engine import GREEDY, Setup, fill
from benchmarks.measure import interleaved, median_ms
from slipstream.engine.api import SlotState, StepBatch, StepSeq
from slipstream.engine.kv_cache import pages_needed
from slipstream.engine.request import Request, SamplingParams
from slipstream.engine.speculative import SpeculativeConfig

IDENTITY_K = 4          # num_speculative_tokens of the identity runs (the serve default)
DRAWN_EVERY = 4         # every 4th identity request samples at temperature 0.8 (it speculates too)


def identity_requests(tokenizer, prompts: int, output_len: int, passage_len: int, vocab: int) -> list[Request]:
    """Half repeat prompts (input-grounded: the n-gram proposer finds drafts in them), half random ones;
    every DRAWN_EVERY-th request draws (seeded) instead of greedy. ignore_eos: every output is output_len."""
    from slipstream.server.bench.datasets import random_dataset, repeat_dataset

    n_repeat = (prompts + 1) // 2
    chat = tokenizer.chat_template is not None
    repeat = [s.prompt for s in repeat_dataset(tokenizer, num_prompts=n_repeat, passage_len=passage_len, seed=0,
                                               chat_template=chat)]
    other = [s.prompt for s in random_dataset(tokenizer, num_prompts=prompts - n_repeat, input_len=passage_len,
                                              output_len=output_len, seed=1)]
    order = [(repeat if i % 2 == 0 else other)[i // 2] for i in range(prompts)]  # alternating
    requests = []
    for i, text in enumerate(order):
        ids = [t for t in tokenizer.encode(text, add_special_tokens=False) if t < vocab]
        drawn = i % DRAWN_EVERY == DRAWN_EVERY - 1
        requests.append(Request(ids, SamplingParams(temperature=0.8 if drawn else 0.0, seed=i, max_tokens=output_len,
                                                    ignore_eos=True)))
    return requests


def build_engine(args: argparse.Namespace, cfg, params, requests: list[Request]):
    """(engine, pages of the step timing's sequences): sampling slots for the largest batch's K + 1 rows
    each and for every identity request's, pages for both (the scheduler takes them all afterwards)."""
    from benchmarks.engine import engine_page_size
    from slipstream.engine.device.runner import EngineConfig, JaxEngine

    page = engine_page_size(args.page_size)
    batch, k_max = max(args.spec_slots), max(args.spec_drafts)
    longest_request = max(len(r.prompt_ids) for r in requests) + args.spec_output_len
    longest = max(args.context + k_max + 1, longest_request + IDENTITY_K + 1)
    per_seq = pages_needed(longest, page)
    num_pages = 1 + max(batch * per_seq, len(requests) * per_seq)
    rows = max(batch * (k_max + 1), len(requests) * (IDENTITY_K + 1))
    budget = rows  # >= max_slots; the fewest programs to compile (a repeat prompt is a few chunks)
    config = EngineConfig(max_slots=rows, max_seq_len=longest, page_size=page, num_pages=num_pages,
                          dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, quantize=args.quantize,
                          max_num_batched_tokens=budget)
    start = time.perf_counter()
    # an accelerator compiles every step shape up front, in parallel; a CPU (the dry run of the tests)
    # compiles only the shapes the phase uses, as it meets them
    engine = JaxEngine(cfg, params, config, precompile=jax.default_backend() != "cpu")
    ready = time.perf_counter() - start
    print(f"spec engine ready in {ready:.1f} s ({engine.num_programs} programs, {rows} sampling slots)", flush=True)
    pages = [list(range(1 + s * per_seq, 1 + (s + 1) * per_seq)) for s in range(batch)]
    return engine, pages, {"ready_s": ready, "programs": engine.num_programs, "sampling_slots": rows,
                           "token_budget": budget, "page_size": page}


def step_times(args: argparse.Namespace, engine, pages: list[list[int]]) -> list[dict]:
    """Each batch size's verification steps for every K, round-robin. Every step feeds the same positions
    (context .. context + K): the same work each time, the KV there overwritten."""
    setup = Setup(engine, pages, args.context)
    fill(setup, seed=0)  # every slot's context, bound for greedy sampling
    rng = np.random.default_rng(2)
    rows = []
    for batch in sorted(set(args.spec_slots)):
        fns = {}
        for k in sorted(set(args.spec_drafts)):
            step = StepBatch([StepSeq(s, [int(t) for t in rng.integers(3, engine.vocab_size, k + 1)], args.context,
                                      pages[s], True, num_samples=k + 1) for s in range(batch)])
            fns[k] = lambda step=step: engine.step(step)
        times = interleaved(fns, args.steps, args.warmup)
        base = median_ms(times[min(fns)])
        for k, t in times.items():
            ms = median_ms(t)
            row = {"slots": batch, "drafts": k, "query_tokens": batch * (k + 1), "step_ms": ms,
                   "over_k0": ms / base, "tok_s_all_accepted": batch * (k + 1) / ms * 1e3}
            rows.append(row)
            print(f"  spec step: {batch} seq x {k + 1} query tokens: {ms:.3f} ms ({ms / base:.2f}x K=0), "
                  f"{row['tok_s_all_accepted']:.0f} tok/s if all accepted", flush=True)
    for s in range(len(pages)):
        engine.free(s)
    return rows


def _run(engine, tokenizer, requests: list[Request], spec: SpeculativeConfig | None):
    from slipstream.engine.scheduler import OutputProcessor, Scheduler, SchedulerConfig

    scheduler = Scheduler(engine, OutputProcessor(tokenizer), SchedulerConfig(speculative=spec))
    scheduler.start()
    try:
        start = time.perf_counter()
        results = scheduler.generate([Request(r.prompt_ids, r.params) for r in requests])
        return results, scheduler.stats(), time.perf_counter() - start
    finally:
        scheduler.shutdown(timeout=30)


def near_tie(engine, prompt: list[int], pages: list[int], a: int, b: int) -> dict:
    """The greedy logits after `prompt` (one fresh sequence, chunks of the token budget, slot 0):
    top two, the logits of tokens a and b, and their gap relative to the largest logit."""
    chunk = engine.max_num_batched_tokens
    engine.insert(0, SlotState(prompt, [], GREEDY))
    try:
        for start in range(0, len(prompt), chunk):
            part = prompt[start:start + chunk]
            logits = engine.model_logits(StepBatch([StepSeq(0, part, start, pages, start + chunk >= len(prompt))]))
    finally:
        engine.free(0)
    row = np.asarray(logits[-1], np.float32)
    top = np.argsort(row)[::-1][:2]
    return {"argmax": int(top[0]), "second": int(top[1]), "logit_a": float(row[a]), "logit_b": float(row[b]),
            "relative_gap": float(abs(row[a] - row[b]) / max(abs(float(row[top[0]])), 1e-9))}


def identity(args: argparse.Namespace, engine, tokenizer, requests: list[Request]) -> dict:
    spec = SpeculativeConfig(num_speculative_tokens=IDENTITY_K, disable_by_batch_size=len(requests) + 1)
    base, base_stats, base_s = _run(engine, tokenizer, requests, None)
    fast, stats, fast_s = _run(engine, tokenizer, requests, spec)
    greedy = [i for i, r in enumerate(requests) if r.params.temperature == 0.0]
    mismatches = []
    errors = [r.error for r in base + fast if r.error is not None]
    if errors:
        raise RuntimeError(f"identity requests failed: {errors[:3]}")
    per_seq = pages_needed(engine.max_seq_len, engine.page_size)
    for i in greedy:
        a, b = base[i].token_ids, fast[i].token_ids
        if a == b:
            continue
        at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        row = {"request": i, "at": at, "without": a[at] if at < len(a) else None,
               "with": b[at] if at < len(b) else None}
        if row["without"] is not None and row["with"] is not None:
            row.update(near_tie(engine, list(requests[i].prompt_ids) + list(a[:at]), list(range(1, 1 + per_seq)),
                                row["without"], row["with"]))
        mismatches.append(row)
    per_pos = dict(sorted(stats.spec_accepted_per_pos.items(), key=lambda kv: int(kv[0])))
    return {"requests": len(requests), "greedy": len(greedy), "identical": len(greedy) - len(mismatches),
            "drawn": len(requests) - len(greedy), "output_len": args.spec_output_len, "k": IDENTITY_K,
            "prompt_tokens": [len(r.prompt_ids) for r in requests],
            "drafts": stats.spec_draft_tokens, "accepted": stats.spec_accepted_tokens,
            "acceptance_rate": stats.spec_accepted_tokens / max(1, stats.spec_draft_tokens),
            "accepted_per_position": per_pos, "drafts_without": base_stats.spec_draft_tokens,
            "generated_without": base_stats.generated_tokens, "generated_with": stats.generated_tokens,
            "seconds_without": base_s, "seconds_with": fast_s, "mismatches": mismatches}


def spec_phase(args: argparse.Namespace, cfg, params) -> None:
    from benchmarks.device import record
    from slipstream.models.registry import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(args.model, args.load_format))
    requests = identity_requests(tokenizer, args.spec_prompts, args.spec_output_len, args.spec_passage_len,
                                 cfg.vocab_size)
    engine, pages, about = build_engine(args, cfg, params, requests)
    record(args, "spec_engine", {**about, "context": args.context})
    record(args, "spec_steps", step_times(args, engine, pages), shown="done")
    record(args, "spec_identity", identity(args, engine, tokenizer, requests))

