"""Speculative decoding's acceptance rate for a target and a proposer (a draft model, by default the
target drafting for itself: the upper bound any draft of it can reach; or n-gram) on the bench's
repeat and random datasets, greedy and drawn. Counts only:

    python -m benchmarks.spec_acceptance [--model M] [--draft D | --ngram] [--k 4] [--prompts 8] [--json out.json]

With --identity N, greedy identity instead: N random prompts (every fifth sharing the previous one's first
48 tokens: prefix-cache hits) plus N/5 drawn requests in the same batches, through a KV cache of
--identity-pages pages (preemption), without and with speculation; exits 1 if any greedy output differs:

    python -m benchmarks.spec_acceptance --identity 50 [--ngram | --draft D]

With --time, its speed instead: one engine with the serve defaults, schedulers without and with
speculation taking turns on the same requests (closed loop of --concurrency clients, the order flipped
each round), each round's TPOT p50 (per request: engine time from its first to its last token over
the tokens after the first, as `slipstream bench` reports it) and output tok/s, and their ratios:

    python -m benchmarks.spec_acceptance --time --ngram [--concurrency 1] [--rounds 3] [--prompts 4]
        [--output-len 128] [--datasets repeat,random] [--temperatures 0,0.8]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

from slipstream.engine.device.draft import DraftModelProposer
from slipstream.engine.device.runner import EngineConfig, JaxEngine
from slipstream.engine.request import Request, SamplingParams
from slipstream.engine.scheduler import OutputProcessor, Scheduler, SchedulerConfig
from slipstream.engine.speculative import SpeculativeConfig
from slipstream.models.loader import load_model
from slipstream.models.registry import DEFAULT_MODEL, load_tokenizer, resolve_model
from slipstream.quantization.weights import QUANTIZED_MODES
from slipstream.server.bench.datasets import random_dataset, repeat_dataset


def engine_for(name: str, config: EngineConfig) -> JaxEngine:
    mode = config.weight_mode()
    cfg, model = load_model(resolve_model(name), quantize=mode if mode in QUANTIZED_MODES else "none")
    return JaxEngine(cfg, model, config)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--draft", default=None, help="the draft model (default: --model itself)")
    p.add_argument("--ngram", action="store_true", help="n-gram prompt lookup instead of a draft model")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="the drawn runs' temperature")
    p.add_argument("--json", default=None)
    p.add_argument("--time", action="store_true", help="time speculation against none instead of counting")
    p.add_argument("--concurrency", type=int, default=1, help="--time: clients, each one request at a time")
    p.add_argument("--rounds", type=int, default=3, help="--time: rounds after a warm-up round")
    p.add_argument("--datasets", default="repeat,random", help="--time: of repeat, random")
    p.add_argument("--temperatures", default="0,0.8", help="--time: comma-separated")
    p.add_argument("--identity", type=int, default=0, help="greedy identity over this many random prompts")
    p.add_argument("--identity-pages", type=int, default=96, help="--identity: KV pages (few: preemption)")
    args = p.parse_args(argv)

    # a step samples at most max_slots rows: room for every request's k drafts beside its own row;
    # timing uses the serve defaults
    if args.identity:
        config = EngineConfig(max_slots=32, max_seq_len=1024, max_num_batched_tokens=256, num_pages=args.identity_pages)
    else:
        config = EngineConfig() if args.time else EngineConfig(max_slots=args.prompts * (args.k + 1),
                                                               max_seq_len=1024, max_num_batched_tokens=256)
    target = engine_for(args.model, config)
    tokenizer = load_tokenizer(resolve_model(args.model))
    # counting: every step speculates; timing: as served (no speculation in steps of large batches)
    batch_off = SpeculativeConfig.disable_by_batch_size if args.time else 64  # identity: drafts in every step
    if args.ngram:
        spec, proposer = SpeculativeConfig(num_speculative_tokens=args.k, disable_by_batch_size=batch_off), None
    else:
        draft = engine_for(args.draft or args.model, config)  # its own engine: its own KV and slots
        spec = SpeculativeConfig(method="draft_model", model=args.draft or args.model,
                                 num_speculative_tokens=args.k, disable_by_batch_size=batch_off)
        proposer = DraftModelProposer(draft, target.vocab_size)
    if args.identity:
        return identity(args, target, tokenizer, spec, proposer)
    datasets = {"repeat": repeat_dataset(tokenizer, num_prompts=args.prompts, passage_len=200, seed=0),
                "random": random_dataset(tokenizer, num_prompts=args.prompts, input_len=256,
                                         output_len=args.output_len, seed=0)}
    if args.time:
        return timed(args, target, tokenizer, {k: datasets[k] for k in args.datasets.split(",")}, spec, proposer)
    rows = []
    for name, samples in datasets.items():
        for temperature in (0.0, args.temperature):
            requests = [Request(tokenizer.encode(s.prompt, add_special_tokens=False),
                                SamplingParams(temperature=temperature, seed=i, max_tokens=args.output_len,
                                               ignore_eos=True)) for i, s in enumerate(samples)]
            scheduler = Scheduler(target, OutputProcessor(tokenizer), SchedulerConfig(speculative=spec, proposer=proposer))
            scheduler.start()
            try:
                scheduler.generate(requests)
                stats = scheduler.stats()
            finally:
                scheduler.shutdown()
            rate = stats.spec_accepted_tokens / max(1, stats.spec_draft_tokens)
            per_pos = dict(sorted(stats.spec_accepted_per_pos.items(), key=lambda kv: int(kv[0])))
            rows.append(dict(dataset=name, temperature=temperature, drafts=stats.spec_draft_tokens,
                             accepted=stats.spec_accepted_tokens, rate=rate, per_position=per_pos))
            print(f"{name:7s} T={temperature:<4} drafts {stats.spec_draft_tokens:6d} accepted "
                  f"{stats.spec_accepted_tokens:6d} rate {rate:.3f}; accepted by position "
                  + " ".join(str(v) for v in per_pos.values()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, draft=None if args.ngram else args.draft or args.model, k=args.k,
                           rows=rows), f, indent=1)
    return 0


def identity(args, engine, tokenizer, spec, proposer) -> int:
    """Greedy outputs with and without speculation over the same mixed batch; 0 if all equal."""
    samples = random_dataset(tokenizer, num_prompts=args.identity, input_len=96, output_len=32, range_ratio=0.5,
                             seed=1)
    prompts = [tokenizer.encode(s.prompt, add_special_tokens=False) for s in samples]
    for i in range(5, len(prompts), 5):  # prefix hits: the previous prompt's first 48 tokens, then its own
        prompts[i] = prompts[i - 1][:48] + prompts[i]
    greedy = [Request(p, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)) for p in prompts]
    drawn = [Request(prompts[i], SamplingParams(temperature=0.8, seed=i, max_tokens=32, ignore_eos=True))
             for i in range(0, len(prompts), 5)]
    outputs = {}
    for name, config in (("without", SchedulerConfig()),
                         ("with", SchedulerConfig(speculative=spec, proposer=proposer))):
        scheduler = Scheduler(engine, OutputProcessor(tokenizer), config)
        scheduler.start()
        try:
            results = scheduler.generate([Request(r.prompt_ids, r.params, request_id=f"{name}-{i}")
                                          for i, r in enumerate(greedy + drawn)])
            stats = scheduler.stats()
        finally:
            scheduler.shutdown()
        errors = [r.error for r in results if r.error is not None]
        if errors:
            raise RuntimeError(f"requests failed {name} speculation: {errors[:3]}")
        outputs[name] = [r.token_ids for r in results[:len(greedy)]]
        print(f"{name:7s} speculation: {len(results)} requests, preemptions {stats.preemptions}, prefix hits "
              f"{stats.prefix_hits}, drafts {stats.spec_draft_tokens}, accepted {stats.spec_accepted_tokens}",
              flush=True)
    same = sum(a == b for a, b in zip(outputs["without"], outputs["with"]))
    print(f"greedy outputs identical: {same}/{len(greedy)} ({len(drawn)} drawn requests in the same batches)")
    return 0 if same == len(greedy) else 1


def run_closed_loop(engine, tokenizer, requests: list[Request], spec, proposer, concurrency: int
                    ) -> tuple[list[float], int, float]:
    """Every request through a fresh scheduler, `concurrency` clients each sending its next request when
    the last one ends: each request's TPOT (s), the output tokens and the wall time (s)."""
    scheduler = Scheduler(engine, OutputProcessor(tokenizer), SchedulerConfig(speculative=spec, proposer=proposer))
    metrics = []
    scheduler.add_listener(metrics.append)
    todo = iter(list(enumerate(requests)))
    lock = threading.Lock()
    errors = []

    def client() -> None:
        while True:
            with lock:
                item = next(todo, None)
            if item is None:
                return
            i, r = item
            result = scheduler.submit(Request(r.prompt_ids, r.params, request_id=f"{id(scheduler)}-{i}")).result()
            if result.error is not None:
                errors.append(result.error)

    scheduler.start()
    try:
        started = time.perf_counter()
        clients = [threading.Thread(target=client) for _ in range(concurrency)]
        for t in clients:
            t.start()
        for t in clients:
            t.join()
        wall = time.perf_counter() - started
    finally:
        scheduler.shutdown()
    if errors:
        raise RuntimeError(f"requests failed: {errors[:3]}")
    tpots = [sum(m.tpot_s) / len(m.tpot_s) for m in metrics if m.tpot_s]
    return tpots, sum(m.output_length for m in metrics), wall


def timed(args, engine, tokenizer, datasets, spec, proposer) -> int:
    """--time: speculation on vs off on one engine, taking turns request by request at concurrency 1 (so
    the two sides of each pair see the same load on a shared machine), else set by set; the order flips
    every turn. Per round: TPOT p50 of each side and output tok/s, and their ratios."""
    rows = []
    print(f"concurrency {args.concurrency}, {args.prompts} prompts x {args.output_len} tokens, k {args.k}, "
          f"{'n-gram' if proposer is None else 'draft model'}", flush=True)
    for name, samples in datasets.items():
        for temperature in (float(t) for t in args.temperatures.split(",")):
            requests = [Request(tokenizer.encode(s.prompt, add_special_tokens=False),
                                SamplingParams(temperature=temperature, seed=i, max_tokens=args.output_len,
                                               ignore_eos=True)) for i, s in enumerate(samples)]
            groups = [[r] for r in requests] if args.concurrency == 1 else [requests]
            ratios, throughput = [], []
            turn = 0
            for rnd in range(args.rounds + 1):  # round 0 warms up (compiles) and is not counted
                got = {"on": ([], 0, 0.0), "off": ([], 0, 0.0)}
                for group in groups:
                    turn += 1
                    for label in (("off", "on") if turn % 2 else ("on", "off")):
                        tpots, tokens, wall = run_closed_loop(engine, tokenizer, group,
                                                              spec if label == "on" else None,
                                                              proposer if label == "on" else None, args.concurrency)
                        t0, n0, w0 = got[label]
                        got[label] = (t0 + tpots, n0 + tokens, w0 + wall)
                if rnd == 0:
                    continue
                on_tpot, off_tpot = (statistics.median(got[k][0]) for k in ("on", "off"))
                on_tps, off_tps = (got[k][1] / got[k][2] for k in ("on", "off"))
                ratios.append(on_tpot / off_tpot)
                throughput.append(on_tps / off_tps)
                rows.append(dict(dataset=name, temperature=temperature, round=rnd, tpot_on_ms=on_tpot * 1e3,
                                 tpot_off_ms=off_tpot * 1e3, tok_s_on=on_tps, tok_s_off=off_tps))
                print(f"{name:7s} T={temperature:<4} round {rnd}: TPOT p50 {on_tpot * 1e3:.2f} / {off_tpot * 1e3:.2f} ms"
                      f" = {on_tpot / off_tpot:.3f}; output tok/s {on_tps:.1f} / {off_tps:.1f} = "
                      f"{on_tps / off_tps:.3f}", flush=True)
            print(f"{name:7s} T={temperature:<4} median of rounds: TPOT ratio {statistics.median(ratios):.3f}, "
                  f"tok/s ratio {statistics.median(throughput):.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, concurrency=args.concurrency, k=args.k, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
