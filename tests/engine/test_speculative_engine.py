"""Speculative decoding end to end (n-gram drafts verified in the ragged step): greedy output is the
output without it, token for token, mixed with sampled requests, with prefix-cache hits, preemption,
stop tokens and stop strings, and the acceptance counters move."""
from __future__ import annotations

import random

import pytest

from slipstream.engine.api import SlotState, StepBatch, StepSeq
from slipstream.engine.request import FinishReason, Request, SamplingParams
from slipstream.engine.scheduler import OutputProcessor, Scheduler, SchedulerConfig
from slipstream.engine.speculative import SpeculativeConfig
from slipstream.server.metrics import Metrics
from tests.conftest import TINY_ENGINE
from tests.engine.test_scheduler_real import _Detok, _greedy_alone, _SmallBudget

# the step samples at most max_slots rows: room for drafts beside the running sequences' own rows
SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1,
                         disable_by_batch_size=16)


@pytest.fixture(scope="module")
def spec_engine(tiny_model):
    from slipstream.engine.device.runner import EngineConfig, JaxEngine

    cfg, params = tiny_model
    return JaxEngine(cfg, params, EngineConfig(**{**TINY_ENGINE, "max_slots": 16, "max_num_batched_tokens": 64}),
                     precompile=False)


def _run(engine, requests, spec, *, metrics=None, **config):
    scheduler = Scheduler(engine, OutputProcessor(_Detok()), SchedulerConfig(speculative=spec, **config))
    registry = Metrics(scheduler, lambda: 0)
    scheduler.start()
    try:
        # resubmitted copies: a Request may be submitted once per scheduler
        results = scheduler.generate([Request(r.prompt_ids, r.params, request_id=r.request_id + "-x")
                                      for r in requests])
        if metrics is not None:
            metrics.append(registry.render().decode())
        return results, scheduler.stats()
    finally:
        scheduler.shutdown(timeout=5)


def _prompts(rnd, n):
    """Half repetitive (so drafts get accepted), half random."""
    out = []
    for i in range(n):
        if i % 2:
            motif = [rnd.randrange(3, 256) for _ in range(rnd.randint(2, 6))]
            out.append((motif * 8)[:rnd.randint(6, 40)])
        else:
            out.append([rnd.randrange(3, 256) for _ in range(rnd.randint(1, 30))])
    return out


def test_engine_samples_every_verified_position(spec_engine, tiny_model):
    """num_samples rows per sequence: the argmax after each of the chunk's last positions."""
    cfg, params = tiny_model
    prompt = [5, 9, 11, 5, 9, 11, 5]
    ref = _greedy_alone(cfg, params, prompt, 4)
    engine = spec_engine
    engine.insert(0, SlotState(prompt, (), SamplingParams(temperature=0.0)))
    try:
        first = engine.step(StepBatch([StepSeq(0, prompt, 0, (1,), True)]))
        assert first[0].token_id == ref[0]
        # feed the true next token plus three drafts: the first two right, the third wrong
        drafts = (ref[1], ref[2], (ref[3] + 1) % cfg.vocab_size)
        out = engine.step(StepBatch([StepSeq(0, (ref[0], *drafts), len(prompt), (1, 2), True, num_samples=4)]))
        assert [s.token_id for s in out[:3]] == ref[1:4]
    finally:
        engine.free(0)


def test_greedy_equal_with_and_without_speculation_mixed_with_sampled(spec_engine):
    rnd = random.Random(3)
    requests = []
    for i, prompt in enumerate(_prompts(rnd, 24)):
        sampled = i % 5 == 4
        params = SamplingParams(temperature=0.9 if sampled else 0.0, seed=i, max_tokens=rnd.randint(1, 30),
                                ignore_eos=True)
        requests.append(Request(prompt, params))
    base, base_stats = _run(spec_engine, requests, None)
    scraped = []
    spec, stats = _run(spec_engine, requests, SPEC, metrics=scraped)
    for req, a, b in zip(requests, base, spec):
        assert b.error is None and b.finish_reason == FinishReason.LENGTH
        assert len(b.token_ids) == req.params.max_tokens
        if req.params.temperature == 0.0:
            assert b.token_ids == a.token_ids, req.prompt_ids
    assert base_stats.spec_draft_tokens == 0 and base_stats.spec_accepted_tokens == 0
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens > 0
    assert sum(stats.spec_accepted_per_pos.values()) == stats.spec_accepted_tokens
    assert set(stats.spec_accepted_per_pos) <= {"0", "1", "2"}
    assert stats.generated_tokens == base_stats.generated_tokens
    text = scraped[0]
    assert f'slipstream_spec_decode_num_draft_tokens_total{{replica="0"}} {float(stats.spec_draft_tokens)}' in text
    assert (f'slipstream_spec_decode_num_accepted_tokens_total{{replica="0"}} '
            f'{float(stats.spec_accepted_tokens)}') in text
    assert (f'slipstream_spec_decode_num_accepted_tokens_per_pos_total{{position="0",replica="0"}} '
            f'{float(stats.spec_accepted_per_pos["0"])}') in text


def prefix_sharing_requests(rnd) -> list[Request]:
    """30 greedy requests, two in three opening with one of two shared 16-token prefixes (prefix hits)."""
    shared = [(m * 6)[:16] for m in ([7, 8, 9], [20, 21, 22, 23])]
    requests = []
    for i in range(30):
        prompt = (rnd.choice(shared) if i % 3 else []) + _prompts(rnd, 2)[i % 2][:12]
        requests.append(Request(prompt, SamplingParams(temperature=0.0, max_tokens=rnd.randint(1, 24),
                                                       ignore_eos=True)))
    return requests


def test_speculation_with_prefix_hits_and_preemption_matches_greedy_alone(spec_engine, tiny_model):
    cfg, params = tiny_model
    rnd = random.Random(11)
    engine = _SmallBudget(spec_engine, num_pages=14)  # 13 usable pages of 8 tokens
    requests = prefix_sharing_requests(rnd)
    results, stats = _run(engine, requests, SPEC, max_num_batched_tokens=24)
    for req, res in zip(requests, results):
        assert res.error is None, res.error
        assert res.token_ids == _greedy_alone(cfg, params, req.prompt_ids, req.params.max_tokens), req
    assert stats.preemptions > 0 and stats.prefix_hits > 0
    assert stats.spec_accepted_tokens > 0


def test_stop_tokens_and_strings_apply_per_accepted_token(spec_engine, tiny_model):
    cfg, params = tiny_model
    rnd = random.Random(5)
    requests = []
    for prompt in _prompts(rnd, 12)[1::2]:  # the repetitive ones
        ref = _greedy_alone(cfg, params, prompt, 24)
        stop_at = ref[rnd.randint(3, 20)]
        requests.append(Request(prompt, SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=(stop_at,))))
        # _Detok's text is the ids joined by spaces: a stop string of one id in the middle
        word = f" {ref[rnd.randint(3, 20)]} "
        requests.append(Request(prompt, SamplingParams(temperature=0.0, max_tokens=24, stop=(word,))))
    base, _ = _run(spec_engine, requests, None)
    spec, stats = _run(spec_engine, requests, SPEC)
    assert stats.spec_accepted_tokens > 0
    for req, a, b in zip(requests, base, spec):
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason), req
    assert any(r.finish_reason == FinishReason.STOP for r in spec)


def test_large_batches_do_not_speculate(spec_engine):
    rnd = random.Random(9)
    requests = [Request(p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
                for p in _prompts(rnd, 8)[1::2]]
    off = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, disable_by_batch_size=1)
    _, stats = _run(spec_engine, requests, off)
    assert stats.spec_draft_tokens == 0


PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a can of oil "
           "and a cloth for the great lens. He counted the steps aloud, one hundred and twelve of them, and "
           "when he reached the lamp room he wiped the glass until it shone.")


def test_default_model_repeat_prompts_accept_drafts_and_equal_greedy(default_engine, default_tokenizer):
    tokenizer = default_tokenizer
    asks = ["Repeat the following text exactly.", "Copy this paragraph word for word.",
            "Write the text below again, unchanged."]
    requests = [Request(tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{ask}\n\n{PASSAGE}"}]), add_special_tokens=False),
        SamplingParams(temperature=0.0, max_tokens=40)) for ask in asks]
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=4, prompt_lookup_min=2)
    base, _ = _run_tok(default_engine, tokenizer, requests, None)
    fast, stats = _run_tok(default_engine, tokenizer, requests, spec)
    for a, b in zip(base, fast):
        assert b.token_ids == a.token_ids and b.text == a.text
    # the answers quote the passage: most drafts are right
    assert stats.spec_accepted_tokens > stats.spec_draft_tokens / 2 > 0


def _run_tok(engine, tokenizer, requests, spec):
    scheduler = Scheduler(engine, OutputProcessor(tokenizer), SchedulerConfig(speculative=spec))
    scheduler.start()
    try:
        return scheduler.generate([Request(r.prompt_ids, r.params) for r in requests]), scheduler.stats()
    finally:
        scheduler.shutdown(timeout=5)


def test_penalized_and_logprob_requests_speculate_and_equal_greedy(spec_engine):
    """Greedy with penalties (each verified row sees the drafts before it), a logit bias and logprobs (reported for
    each accepted draft): tokens and logprobs as without speculation. Drawn requests draft too."""
    rnd = random.Random(17)
    requests = []
    for i, prompt in enumerate(_prompts(rnd, 16)):
        params = [dict(temperature=0.0, presence_penalty=0.4, frequency_penalty=0.3, logprobs=2),
                  dict(temperature=0.0, repetition_penalty=1.3), dict(temperature=0.8, top_k=3, seed=i),
                  dict(temperature=0.0, logit_bias=((7, 3.0), (11, -5.0), (4, 1.5)))][i % 4]
        requests.append(Request(prompt, SamplingParams(**params, max_tokens=rnd.randint(4, 24), ignore_eos=True)))
    base, _ = _run(spec_engine, requests, None)
    spec, stats = _run(spec_engine, requests, SPEC)
    drawn = [SamplingParams(temperature=0.8, top_k=3, seed=i, max_tokens=24, ignore_eos=True) for i in range(6)]
    _, drawn_stats = _run(spec_engine, [Request([4, 5, 6] * 6, p) for p in drawn], SPEC)
    assert stats.spec_accepted_tokens > 0 and drawn_stats.spec_draft_tokens > 0
    for req, a, b in zip(requests, base, spec):
        assert len(b.token_ids) == req.params.max_tokens
        if req.params.temperature == 0.0:
            assert b.token_ids == a.token_ids, req
            if req.params.logprobs is not None:
                for x, y in zip(a.logprobs, b.logprobs):
                    assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
                    assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_greedy_equal_with_and_without_speculation_on_per_channel_int8(tiny_model):
    # int8-channel-a16 on CPU: the native kernel rounds each row by itself and sums over all of K in int32 (VNNI
    # for one row, the AMX tile unit from 4 where the CPU has it), so verifying drafts in a many-row step gives each
    # token what a one-row decode gives it
    from slipstream.engine.device.runner import EngineConfig, JaxEngine

    cfg, params = tiny_model
    engine = JaxEngine(cfg, params, EngineConfig(**{**TINY_ENGINE, "max_slots": 16, "max_num_batched_tokens": 64,
                                                    "quantize": "int8-channel-a16"}), precompile=False)
    rnd = random.Random(5)
    requests = [Request(prompt, SamplingParams(temperature=0.0, max_tokens=rnd.randint(4, 16), ignore_eos=True))
                for prompt in _prompts(rnd, 6)]
    base, _ = _run(engine, requests, None)
    spec, stats = _run(engine, requests, SPEC)
    assert [b.token_ids for b in spec] == [a.token_ids for a in base]
    assert stats.spec_accepted_tokens > 0
