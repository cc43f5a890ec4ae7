"""Draft-model speculative decoding (engine/device/draft.py): greedy output equals the output without
it, token for token, for a random draft and for the target drafting for itself, mixed with drawn and
non-drafting requests in the same batches, with prefix-cache hits and preemption; the draft's slots and
pages come back; the config and its errors."""
from __future__ import annotations

import random

import pytest

from slipstream.engine.request import FinishReason, Request, SamplingParams
from slipstream.engine.scheduler import OutputProcessor, Scheduler, SchedulerConfig
from slipstream.engine.speculative import SpeculativeConfig, Speculator
from tests.conftest import TINY_ENGINE, build_tiny_hf
from tests.engine.test_scheduler_real import _Detok, _greedy_alone, _SmallBudget
from tests.engine.test_speculative_engine import _prompts, prefix_sharing_requests

ENGINE = {**TINY_ENGINE, "max_slots": 16, "max_num_batched_tokens": 64}
SPEC = SpeculativeConfig(method="draft_model", model="draft", num_speculative_tokens=3, disable_by_batch_size=16)


@pytest.fixture(scope="module")
def target(tiny_model):
    from slipstream.engine.device.runner import EngineConfig, JaxEngine

    cfg, params = tiny_model
    return JaxEngine(cfg, params, EngineConfig(**ENGINE))


@pytest.fixture(scope="module", params=["self", "random"])
def draft(request, tiny_model, tmp_path_factory):
    """A draft engine: the target's own model (every draft right, up to rounding) or another random one."""
    from slipstream.engine.device.runner import EngineConfig, JaxEngine
    from slipstream.models.loader import load_hf_dir

    if request.param == "self":
        cfg, params = tiny_model
    else:
        cfg, params = load_hf_dir(build_tiny_hf(str(tmp_path_factory.mktemp("draft")), seed=3))
    return request.param, JaxEngine(cfg, params, EngineConfig(**{**ENGINE, "num_pages": 128}))


def _run(engine, requests, proposer, **config):
    spec = SPEC if proposer is not None else None
    scheduler = Scheduler(engine, OutputProcessor(_Detok()), SchedulerConfig(speculative=spec, proposer=proposer, **config))
    scheduler.start()
    try:
        return scheduler.generate([Request(r.prompt_ids, r.params) for r in requests]), scheduler.stats()
    finally:
        scheduler.shutdown(timeout=5)


def test_draft_model_greedy_equals_greedy_mixed_with_drawn_and_short(target, draft, tiny_model):
    from slipstream.engine.device.draft import DraftModelProposer

    kind, draft_engine = draft
    proposer = DraftModelProposer(draft_engine, target.vocab_size)
    rnd = random.Random(21)
    requests = []
    for i, prompt in enumerate(_prompts(rnd, 20)):
        # drawn requests draft too; max_tokens 1 never drafts (its first token ends it)
        params = [dict(temperature=0.0, max_tokens=rnd.randint(2, 24)), dict(temperature=0.9, seed=i, max_tokens=12),
                  dict(temperature=0.0, max_tokens=1)][i % 4 % 3]
        requests.append(Request(prompt, SamplingParams(**params, ignore_eos=True)))
    base, _ = _run(target, requests, None)
    spec, stats = _run(target, requests, proposer)
    for req, a, b in zip(requests, base, spec):
        assert b.error is None and b.finish_reason == FinishReason.LENGTH
        assert len(b.token_ids) == req.params.max_tokens
        if req.params.temperature == 0.0:
            assert b.token_ids == a.token_ids, req.prompt_ids
    assert stats.spec_draft_tokens > 0
    if kind == "self":  # the target drafting for itself, greedy: the upper bound, every draft accepted
        _, greedy = _run(target, [r for r in requests if r.params.temperature == 0.0], proposer)
        assert greedy.spec_accepted_tokens >= 0.95 * greedy.spec_draft_tokens > 0
    # finished sequences give the draft slot and pages back at the next call
    assert proposer.draft([]) == [] and proposer.num_sequences == 0
    assert proposer.pages.num_free == draft_engine.num_pages - 1


def test_draft_model_with_prefix_hits_and_preemption_matches_greedy_alone(target, draft, tiny_model):
    from slipstream.engine.device.draft import DraftModelProposer

    cfg, params = tiny_model
    _, draft_engine = draft
    rnd = random.Random(11)
    requests = prefix_sharing_requests(rnd)
    engine = _SmallBudget(target, num_pages=14)  # 13 usable pages of 8 tokens: preemption
    results, stats = _run(engine, requests, DraftModelProposer(draft_engine, target.vocab_size),
                          max_num_batched_tokens=24)
    for req, res in zip(requests, results):
        assert res.error is None, res.error
        assert res.token_ids == _greedy_alone(cfg, params, req.prompt_ids, req.params.max_tokens), req
    assert stats.preemptions > 0 and stats.prefix_hits > 0 and stats.spec_draft_tokens > 0


def test_draft_model_config_and_errors():
    assert SpeculativeConfig.from_json('{"model": "m", "num_speculative_tokens": 2}') == SpeculativeConfig(
        method="draft_model", model="m", num_speculative_tokens=2)
    for text in ('{"method": "draft_model"}', '{"method": "ngram", "model": "m"}', '{"model": ""}'):
        with pytest.raises(ValueError, match="speculative config: .*model"):
            SpeculativeConfig.from_json(text)
    with pytest.raises(ValueError, match="needs its proposer built from the draft model"):
        Speculator(SPEC, max_seq_len=64)


def test_draft_vocabulary_must_be_the_targets(tiny_engine):
    from slipstream.engine.device.draft import DraftModelProposer

    with pytest.raises(ValueError, match=r"draft model's vocabulary \(256 tokens\) must be the target model's \(300\)"):
        DraftModelProposer(tiny_engine, 300)


def test_serve_builds_the_draft_proposer_on_the_targets_settings(tiny_engine, tiny_llama_dir):
    import json

    from slipstream.server.cli import build_draft_proposer, build_parser

    spec = json.dumps({"model": tiny_llama_dir, "num_speculative_tokens": 2})
    args = build_parser().parse_args(["serve", "--model", tiny_llama_dir, "--speculative-config", spec])
    proposer = build_draft_proposer(args, [tiny_engine], multihost=False)
    assert proposer.engine.config == tiny_engine.config and proposer.engine.vocab_size == tiny_engine.vocab_size
    with pytest.raises(ValueError, match="a draft model serves one replica on one host"):
        build_draft_proposer(args, [tiny_engine, tiny_engine], multihost=False)
    ngram = build_parser().parse_args(["serve", "--speculative-config", '{"method": "ngram"}'])
    assert build_draft_proposer(ngram, [tiny_engine], multihost=False) is None
