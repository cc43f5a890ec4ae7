"""Speculative sampling keeps the target distribution: a drawn request verifying a draft gets tokens
distributed as without speculation (chi-square over many seeded samples of the tiny model's next
tokens), with temperature, top-k/top-p/min-p and penalties applied to the target; end to end through
the scheduler with n-gram drafts, seeded drawn requests get the very tokens they get without
speculation; verification rows' penalty counts hold only kept tokens."""
from __future__ import annotations

import collections

import numpy as np
import pytest
from scipy.stats import chi2_contingency

from slipstream.engine.api import SlotState, StepBatch, StepSeq
from slipstream.engine.request import SamplingParams
from tests.conftest import TINY_ENGINE

SEQS = 8      # sequences per step: two sample rows each fill the 16 rows a step samples
ROUNDS = 150  # 1200 samples per path
PROMPT = [5, 9, 11, 5, 9, 11, 5]


@pytest.fixture(scope="module")
def engine(tiny_model):
    from slipstream.engine.device.runner import EngineConfig, JaxEngine

    cfg, params = tiny_model
    return JaxEngine(cfg, params, EngineConfig(**{**TINY_ENGINE, "max_slots": 16, "max_num_batched_tokens": 64}),
                     precompile=False)


def _pages(i):
    return (1 + 2 * i, 2 + 2 * i)  # 16 positions per sequence


def _prefill(engine):
    """PROMPT[:-1] into each sequence's pages, unsampled; every later step feeds PROMPT[-1] onwards."""
    for i in range(SEQS):
        engine.insert(i, SlotState(PROMPT, (), SamplingParams(temperature=0.0)))
    engine.step(StepBatch([StepSeq(i, PROMPT[:-1], 0, _pages(i), False) for i in range(SEQS)]))


def _draw(engine, params, fed, num_samples, output_ids=(), seeds=0):
    """ROUNDS x SEQS steps' samples: each sequence feeds PROMPT[-1] and `fed` after it, sampling at its
    last num_samples positions, with a fresh seed (from `seeds` on: each path its own, so the paths'
    samples are independent) and its penalty history reset every round."""
    rows = []
    for r in range(ROUNDS):
        for i in range(SEQS):
            seed = seeds + r * SEQS + i
            engine.insert(i, SlotState(PROMPT, output_ids, SamplingParams(**params, seed=seed)))
        out = engine.step(StepBatch([StepSeq(i, (PROMPT[-1], *fed), len(PROMPT) - 1, _pages(i), True,
                                             num_samples=num_samples) for i in range(SEQS)]))
        tokens = [s.token_id for s in out]
        rows += [tokens[i * num_samples:(i + 1) * num_samples] for i in range(SEQS)]
    return rows


def _same_distribution(a, b):
    """Chi-square p-value that token lists a and b come from one distribution (rare tokens pooled)."""
    ca, cb = collections.Counter(a), collections.Counter(b)
    common = [t for t in set(ca) | set(cb) if ca[t] + cb[t] >= 10]
    table = [[ca[t] for t in common] + [sum(ca.values()) - sum(ca[t] for t in common)],
             [cb[t] for t in common] + [sum(cb.values()) - sum(cb[t] for t in common)]]
    table = [[x, y] for x, y in zip(*table) if x + y]
    return chi2_contingency(np.array(table).T)[1]


@pytest.mark.parametrize("params", [dict(temperature=1.5, top_k=6),
                                    dict(temperature=1.0, top_k=8, top_p=0.6, min_p=0.05, repetition_penalty=1.2,
                                         presence_penalty=-1.5, frequency_penalty=-0.5)],
                         ids=["top_k", "penalties"])  # negative penalties: the draft is likely again after itself
def test_drafts_keep_the_target_distribution(engine, params):
    _prefill(engine)
    try:
        plain = [r[0] for r in _draw(engine, params, (), 1)]
        # the draft: the target's most likely next token, so that both acceptance and rejection happen
        draft = collections.Counter(plain).most_common(1)[0][0]
        spec = _draw(engine, params, (draft,), 2, seeds=10_000)
        first = [r[0] for r in spec]
        accepted = sum(t == draft for t in first)
        assert 0.1 * len(spec) < accepted < 0.9 * len(spec), accepted
        assert _same_distribution(plain, first) > 1e-3
        # after an accepted draft, the bonus row samples the token after it: as sampling there without
        # speculation, with the draft counted as an output token by the penalties
        after = _draw(engine, params, (draft,), 1, output_ids=(draft,), seeds=20_000)
        assert _same_distribution([r[0] for r in after], [r[1] for r in spec if r[0] == draft]) > 1e-3
    finally:
        for i in range(SEQS):
            engine.free(i)


def test_penalty_counts_hold_only_kept_tokens(engine):
    """A rejected draft leaves no trace in the slot's counts: after a verification step, sampling again
    with a presence penalty sees only the kept tokens."""
    _prefill(engine)
    try:
        greedy = SamplingParams(temperature=0.0, presence_penalty=2.0)
        for i in range(2):
            engine.insert(i, SlotState(PROMPT, (), greedy))
        top = engine.step(StepBatch([StepSeq(0, (PROMPT[-1],), len(PROMPT) - 1, _pages(0), True)]))[0].token_id
        engine.insert(0, SlotState(PROMPT, (), greedy))
        wrong = (top + 1) % 256
        # slot 0: the draft is rejected (greedy keeps the argmax `top`); counts must hold `top` only
        kept = engine.step(StepBatch([StepSeq(0, (PROMPT[-1], wrong), len(PROMPT) - 1, _pages(0), True,
                                              num_samples=2)]))
        assert kept[0].token_id == top
        counts = np.asarray(engine.output_counts[0])
        assert counts[top] == 1 and counts[wrong] == 0 and counts.sum() == 1
    finally:
        for i in range(SEQS):
            engine.free(i)


def test_scheduler_seeded_drawn_outputs_are_unchanged_by_ngram_drafts(tiny_model):
    """End to end through the scheduler: seeded drawn requests on a repetitive prompt (n-gram drafts
    accepted and rejected) give token for token the outputs they give without speculation."""
    from slipstream.engine.device.runner import EngineConfig, JaxEngine
    from slipstream.engine.request import Request
    from slipstream.engine.scheduler import OutputProcessor, Scheduler, SchedulerConfig
    from slipstream.engine.speculative import SpeculativeConfig
    from tests.engine.test_scheduler_real import _Detok, _greedy_alone

    cfg, params = tiny_model
    engine = JaxEngine(cfg, params, EngineConfig(**{**TINY_ENGINE, "max_slots": 16, "max_num_batched_tokens": 64}))
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3,
                             disable_by_batch_size=16)
    # the model's own greedy continuation in the prompt: n-gram drafts the model likes
    prompt = [5, 9, 11] + _greedy_alone(cfg, params, [5, 9, 11], 30)

    def outputs(speculative, seeds):
        scheduler = Scheduler(engine, OutputProcessor(_Detok()), SchedulerConfig(speculative=speculative))
        scheduler.start()
        try:
            out = []
            for group in range(0, len(seeds), 4):  # 4 at a time: room for every request's drafts
                out += [c.token_ids for c in scheduler.generate(
                    [Request(prompt, SamplingParams(temperature=1.5, top_k=3, seed=s, max_tokens=4, ignore_eos=True))
                     for s in seeds[group:group + 4]])]
            return out, scheduler.stats()
        finally:
            scheduler.shutdown(timeout=5)

    base, _ = outputs(None, range(200))
    fast, stats = outputs(spec, range(200))
    assert stats.spec_draft_tokens > stats.spec_accepted_tokens > 50
    assert stats.spec_draft_tokens - stats.spec_accepted_tokens > 50  # rejections too
    assert len({tuple(o) for o in base}) > 20  # the outputs vary with the seed
    assert fast == base
