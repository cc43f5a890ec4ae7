"""Speculative decoding's acceptance rate for a target and a proposer (a draft model, by default the
target drafting for itself: the upper bound any draft of it can reach; or n-gram) on the bench's
repeat and random datasets, greedy and drawn. Counts only, no timing:

    python -m benchmarks.spec_acceptance [--model M] [--draft D | --ngram] [--k 4] [--prompts 8] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys

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
    args = p.parse_args(argv)

    # a step samples at most max_slots rows: room for every request's k drafts beside its own row
    config = EngineConfig(max_slots=args.prompts * (args.k + 1), max_seq_len=1024, max_num_batched_tokens=256)
    target = engine_for(args.model, config)
    tokenizer = load_tokenizer(resolve_model(args.model))
    if args.ngram:
        spec, proposer = SpeculativeConfig(num_speculative_tokens=args.k, disable_by_batch_size=64), None
    else:
        draft = engine_for(args.draft or args.model, config)  # its own engine: its own KV and slots
        spec = SpeculativeConfig(method="draft_model", model=args.draft or args.model,
                                 num_speculative_tokens=args.k, disable_by_batch_size=64)
        proposer = DraftModelProposer(draft, target.vocab_size)
    datasets = {"repeat": repeat_dataset(tokenizer, num_prompts=args.prompts, passage_len=200, seed=0),
                "random": random_dataset(tokenizer, num_prompts=args.prompts, input_len=256,
                                         output_len=args.output_len, seed=0)}
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


if __name__ == "__main__":
    sys.exit(main())
