"""The JAX engine: ragged steps (decodes and prefill chunks of many sequences in one program) equal
the dense reference, buckets never recompile, and sampling settings behave per request."""
from __future__ import annotations

import random

import numpy as np
import pytest

from slipstream.engine.api import PREVIOUS_SAMPLE, SlotState, StepBatch, StepSeq
from slipstream.engine.request import SamplingParams
from flax import nnx

from slipstream.models.base import dense_logits

_dense = nnx.jit(dense_logits)


def dense_last_logits(cfg, model, seq, width=128):
    """Reference logits of the last token, from a fixed-width padded batch (one compile)."""
    tokens = np.zeros((1, width), np.int32)
    tokens[0, :len(seq)] = seq
    valid = np.arange(width)[None] < len(seq)
    return np.asarray(_dense(model, tokens, valid))[0, len(seq) - 1]


def _pages(engine, first: int, n: int) -> list[int]:
    return list(range(first, first + n))


class _Seq:
    def __init__(self, slot, tokens, pages, computed=0):
        self.slot, self.tokens, self.pages, self.computed = slot, list(tokens), pages, computed


def _mixed_step(engine, seqs, budget, rnd):
    """Decodes first, then prefill chunks of random lengths in the rest of the budget."""
    decodes = [s for s in seqs if len(s.tokens) - s.computed == 1]
    prefills = [s for s in seqs if len(s.tokens) - s.computed > 1]
    parts, left = [], budget - len(decodes)
    for s in decodes + prefills:
        remaining = len(s.tokens) - s.computed
        n = 1 if remaining == 1 else min(remaining, left, rnd.randint(1, remaining))
        if n <= 0:
            continue
        if remaining > 1:
            left -= n
        parts.append((s, StepSeq(s.slot, s.tokens[s.computed:s.computed + n], s.computed, s.pages,
                                 sample=s.computed + n == len(s.tokens))))
    return parts


def test_mixed_ragged_steps_match_dense_at_every_step(tiny_engine, tiny_model):
    """Several decodes plus prefill chunks of different lengths in one step, one sequence starting
    after pages another one wrote (a prefix-cache hit), padded rows and tokens: every sampled row's
    logits equal the dense reference within 1e-4, at every step."""
    cfg, params = tiny_model
    engine, ps = tiny_engine, tiny_engine.page_size
    rng, rnd = np.random.default_rng(1), random.Random(1)
    a = _Seq(0, rng.integers(3, 256, 21), _pages(engine, 1, 11))
    b = _Seq(1, rng.integers(3, 256, 5), _pages(engine, 12, 11))
    c = _Seq(2, rng.integers(3, 256, 40), _pages(engine, 23, 11))
    seqs = [a, b, c]
    shared = None
    for step in range(24):
        if step == 4:  # a's first two pages now hold its prompt: d reuses them, computing after them
            assert a.computed >= 2 * ps
            shared = _Seq(3, list(a.tokens[:2 * ps]) + list(rng.integers(3, 256, 6)),
                          a.pages[:2] + _pages(engine, 34, 9), computed=2 * ps)
            seqs.append(shared)
        parts = _mixed_step(engine, seqs, engine.max_num_batched_tokens, rnd)
        batch = StepBatch([p for _, p in parts])
        logits = engine.model_logits(batch)
        i = 0
        for s, part in parts:
            s.computed += len(part.token_ids)
            if part.sample:
                ref = dense_last_logits(cfg, params, s.tokens)
                np.testing.assert_allclose(logits[i], ref, atol=1e-4, rtol=0)
                s.tokens.append(int(ref.argmax()))
                i += 1
        assert i == len(logits)
    assert shared is not None and min(len(s.tokens) - s.computed for s in seqs) == 1


def _generate(engine, prompts, params_list, pages_list, new_tokens, chunk=None):
    """Drive the engine directly: each step decodes every prompt that finished prefill and adds
    the next prefill chunks within the budget."""
    chunk = chunk or engine.max_num_batched_tokens
    seqs = [_Seq(slot, prompt, pages) for slot, (prompt, pages) in enumerate(zip(prompts, pages_list))]
    for s, params in zip(seqs, params_list):
        engine.insert(s.slot, SlotState(list(s.tokens), [], params))
    outs = [[] for _ in prompts]
    while any(len(o) < new_tokens for o in outs):
        parts, left = [], engine.max_num_batched_tokens
        for s in sorted(seqs, key=lambda s: len(s.tokens) - s.computed > 1):
            remaining = len(s.tokens) - s.computed
            n = min(remaining, left, chunk)
            if n <= 0 or len(outs[s.slot]) >= new_tokens:
                continue
            left -= n
            parts.append((s, StepSeq(s.slot, s.tokens[s.computed:s.computed + n], s.computed, s.pages,
                                     sample=s.computed + n == len(s.tokens))))
        sampled = iter(engine.step(StepBatch([p for _, p in parts])))
        for s, part in parts:
            s.computed += len(part.token_ids)
            if part.sample:
                token = next(sampled).token_id
                s.tokens.append(token)
                outs[s.slot].append(token)
    for slot in range(len(prompts)):
        engine.free(slot)
    return outs


def _dense_greedy(cfg, params, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(dense_last_logits(cfg, params, ids).argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("chunk", [3, 17, None])
def test_engine_greedy_batch_equals_reference(tiny_engine, tiny_model, chunk):
    cfg, params = tiny_model
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(3, 256, n)) for n in (3, 11, 40)]   # 40 > the step budget
    pages = [_pages(tiny_engine, 1 + 8 * i, 8) for i in range(3)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    outs = _generate(tiny_engine, prompts, [greedy] * 3, pages, 12, chunk)
    for prompt, out in zip(prompts, outs):
        assert out == _dense_greedy(cfg, params, prompt, 12)


_PENALIZED = SamplingParams(temperature=0.0, frequency_penalty=1.5, presence_penalty=0.5, max_tokens=10)


def _penalized_greedy(cfg, params, prompt, n):
    """_PENALIZED's tokens by the host-side OpenAI formula over the row's own earlier tokens."""
    ids, out = list(prompt), []
    for _ in range(n):
        logits = dense_last_logits(cfg, params, ids).astype(np.float64)
        counts = np.bincount(out, minlength=logits.shape[0])[:logits.shape[0]]
        ids.append(int(np.argmax(logits - 1.5 * counts - 0.5 * (counts > 0))))
        out.append(ids[-1])
    return out


def test_penalties_count_the_generated_tokens_across_steps(tiny_engine, tiny_model):
    """A greedy row with a frequency/presence penalty follows the host-side OpenAI formula over
    its own earlier tokens, step after step, whether it shares the batch with a penalty-free row
    or runs alone."""
    cfg, params = tiny_model
    rng = np.random.default_rng(12)
    prompt = list(rng.integers(3, 256, 7))
    penalized = _PENALIZED
    expected = _penalized_greedy(cfg, params, prompt, 10)
    assert expected != _dense_greedy(cfg, params, prompt, 10)  # the penalty matters here
    other = list(rng.integers(3, 256, 5))
    plain = SamplingParams(temperature=0.0, max_tokens=10)
    mixed = _generate(tiny_engine, [other, prompt], [plain, penalized], [[1, 2, 3, 4], [5, 6, 7, 8]], 10)
    assert mixed[1] == expected
    assert mixed[0] == _dense_greedy(cfg, params, other, 10)
    assert _generate(tiny_engine, [prompt], [penalized], [[9, 10, 11, 12]], 10)[0] == expected


def test_a_slot_reused_across_penalized_and_plain_requests(tiny_engine, tiny_model):
    """A request without penalties writes no penalty state at insert (no upload, no program); its
    tokens still land in its slot's counts, and a penalized request inserted into that slot next
    counts only its own tokens. A plain request after a penalized one ignores the counts it left."""
    cfg, params = tiny_model
    prompt = list(np.random.default_rng(12).integers(3, 256, 7))
    plain = SamplingParams(temperature=0.0, max_tokens=10)
    counts, mask = tiny_engine.output_counts, tiny_engine.prompt_mask
    tiny_engine.insert(0, SlotState(list(prompt), [], plain))
    assert tiny_engine.output_counts is counts and tiny_engine.prompt_mask is mask  # nothing written
    greedy = _dense_greedy(cfg, params, prompt, 10)
    assert _generate(tiny_engine, [prompt], [plain], [[1, 2, 3, 4]], 10)[0] == greedy
    assert np.asarray(tiny_engine.output_counts[0])[greedy].min() > 0  # slot 0 holds the plain tokens
    assert _generate(tiny_engine, [prompt], [_PENALIZED], [[1, 2, 3, 4]], 10)[0] == \
        _penalized_greedy(cfg, params, prompt, 10)
    assert _generate(tiny_engine, [prompt], [plain], [[1, 2, 3, 4]], 10)[0] == greedy


def test_logit_bias_steers_greedy_and_stays_with_its_request(tiny_engine, tiny_model):
    """+100 on a token makes greedy pick it at every step, -100 on greedy's own tokens turns it away from all of
    them, and neither reaches a plain row beside it or the plain request its slot holds next (a slot's bias rows
    are read only for a request that has a bias)."""
    cfg, params = tiny_model
    rng = np.random.default_rng(13)
    prompt, other = list(rng.integers(3, 256, 7)), list(rng.integers(3, 256, 5))
    greedy = _dense_greedy(cfg, params, prompt, 6)
    plain = SamplingParams(temperature=0.0, max_tokens=6)
    forced = SamplingParams(temperature=0.0, max_tokens=6, logit_bias=((77, 100.0),))
    assert greedy != [77] * 6
    mixed = _generate(tiny_engine, [other, prompt], [plain, forced], [[1, 2, 3, 4], [5, 6, 7, 8]], 6)
    assert mixed == [_dense_greedy(cfg, params, other, 6), [77] * 6]
    banned = SamplingParams(temperature=0.0, max_tokens=6, logit_bias=tuple((t, -100.0) for t in sorted(set(greedy))))
    assert not set(_generate(tiny_engine, [prompt], [banned], [[1, 2, 3, 4]], 6)[0]) & set(greedy)
    assert _generate(tiny_engine, [prompt, other], [plain, plain], [[1, 2, 3, 4], [5, 6, 7, 8]], 6) == \
        [greedy, _dense_greedy(cfg, params, other, 6)]


def test_min_tokens_holds_back_eos_and_stop_tokens_then_lets_them_through(tiny_engine):
    """With +100 on an ending token greedy picks it at once; min_tokens k refuses it (EOS, or the request's stop
    token) for the first k tokens only, and a row beside it without min_tokens is not held back."""
    rng = np.random.default_rng(14)
    prompt, other = list(rng.integers(3, 256, 7)), list(rng.integers(3, 256, 5))
    eos = min(tiny_engine.eos_token_ids)
    to_eos = dict(temperature=0.0, max_tokens=5, logit_bias=((eos, 100.0),))
    held = SamplingParams(**to_eos, min_tokens=3)
    free = SamplingParams(**to_eos)
    out = _generate(tiny_engine, [prompt, other], [held, free], [[1, 2, 3, 4], [5, 6, 7, 8]], 5)
    assert eos not in out[0][:3] and out[0][3] == eos
    assert out[1][0] == eos
    stop77 = SamplingParams(temperature=0.0, max_tokens=4, logit_bias=((77, 100.0),), stop_token_ids=(77,),
                            min_tokens=2)
    out = _generate(tiny_engine, [prompt], [stop77], [[1, 2, 3, 4]], 4)[0]
    assert 77 not in out[:2] and out[2] == 77


def test_allowed_token_ids_limit_each_step_to_them(tiny_engine, tiny_model):
    """Greedy over the allowed ids only: never outside them, the step's best among them (+100 on a token outside
    does not get it picked), and a row beside it unaffected."""
    cfg, params = tiny_model
    rng = np.random.default_rng(15)
    prompt, other = list(rng.integers(3, 256, 7)), list(rng.integers(3, 256, 5))
    greedy = _dense_greedy(cfg, params, prompt, 6)
    allowed = tuple(sorted({*rng.integers(3, 256, 5).tolist()} - set(greedy)))
    limited = SamplingParams(temperature=0.0, max_tokens=6, allowed_token_ids=allowed,
                             logit_bias=((greedy[0], 100.0),))
    plain = SamplingParams(temperature=0.0, max_tokens=6)
    out = _generate(tiny_engine, [prompt, other], [limited, plain], [[1, 2, 3, 4], [5, 6, 7, 8]], 6)
    assert set(out[0]) <= set(allowed)
    assert out[1] == _dense_greedy(cfg, params, other, 6)
    first = dense_last_logits(cfg, params, prompt)
    assert out[0][0] == max(allowed, key=lambda t: float(first[t]))


def test_a_penalized_insert_sets_its_slots_counts_and_prompt_mask(tiny_engine):
    """A resumed request's counts are its output so far (uploaded); a new one's are zeros (written on
    the device), over whatever the slot held."""
    prompt = [3, 9, 9, 40]
    tiny_engine.insert(1, SlotState(prompt, [5, 5, 7], _PENALIZED))
    counts = np.asarray(tiny_engine.output_counts[1])
    assert (counts[5], counts[7], counts.sum()) == (2, 1, 3)
    np.testing.assert_array_equal(np.flatnonzero(np.asarray(tiny_engine.prompt_mask[1])), [3, 9, 40])
    tiny_engine.insert(1, SlotState([8], [], _PENALIZED))
    assert not np.asarray(tiny_engine.output_counts[1]).any()
    np.testing.assert_array_equal(np.flatnonzero(np.asarray(tiny_engine.prompt_mask[1])), [8])
    tiny_engine.free(1)


def test_sampling_program_updates_the_slot_state_in_place(tiny_engine):
    """The [slots, V] penalty counts and prompt masks pass through the sampling program in place:
    neither copied nor returned by a conditional. On the default model at 32 rows, a cond that
    returned the counts (around the whole draw) made the sampling step 3 ms instead of 0.6."""
    counts, masks = tiny_engine.output_counts, tiny_engine.prompt_mask
    state_shapes = [f"s32[{counts.shape[0]},{counts.shape[1]}]", f"pred[{masks.shape[0]},{masks.shape[1]}]"]
    assert tiny_engine._sample_exe
    for rows, exe in tiny_engine._sample_exe.items():
        found = []
        for line in exe.as_text().splitlines():
            for op in (" copy(", " conditional("):
                result_type = line.split(" = ", 1)[-1].split(op, 1)[0] if op in line else ""
                if any(shape in result_type for shape in state_shapes):
                    found.append(line.strip()[:160])
        assert not found, (rows, found)


def test_seeded_sampling_is_independent_of_batch(tiny_engine):
    rng = np.random.default_rng(4)
    prompt = list(rng.integers(3, 256, 9))
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10)
    alone = _generate(tiny_engine, [prompt], [seeded], [[1, 2, 3]], 10)[0]
    others = [list(rng.integers(3, 256, 6)) for _ in range(2)]
    mixed = _generate(tiny_engine, [others[0], prompt, others[1]],
                      [SamplingParams(temperature=0.7, seed=9), seeded, SamplingParams(temperature=0.0)],
                      [[4, 5, 6], [7, 8, 9], [10, 11, 12]], 10)[1]
    assert mixed == alone
    other_seed = _generate(tiny_engine, [prompt], [SamplingParams(temperature=1.0, top_p=0.9, seed=99)],
                           [[1, 2, 3]], 10)[0]
    assert other_seed != alone


def test_logprobs_are_returned_when_asked(tiny_engine):
    prompt = [5, 6, 7, 8]
    tiny_engine.insert(0, SlotState(prompt, [], SamplingParams(temperature=0.0, logprobs=3)))
    tiny_engine.insert(1, SlotState(prompt, [], SamplingParams(temperature=0.0)))
    a, b = tiny_engine.step(StepBatch([StepSeq(0, prompt, 0, [1], True), StepSeq(1, prompt, 0, [2], True)]))
    tiny_engine.free(0)
    tiny_engine.free(1)
    assert b.logprob is None and a.token_id == b.token_id
    assert a.logprob is not None and len(a.logprob.top) == 3
    assert a.logprob.top[0][0] == a.token_id  # greedy picks the best token
    assert a.logprob.logprob == pytest.approx(a.logprob.top[0][1])
    assert a.logprob.top[0][1] >= a.logprob.top[1][1] >= a.logprob.top[2][1]


def test_only_chunks_that_reach_the_end_sample(tiny_engine):
    tiny_engine.insert(0, SlotState([5] * 12, [], SamplingParams(temperature=0.0)))
    tiny_engine.insert(1, SlotState([6] * 3, [], SamplingParams(temperature=0.0)))
    out = tiny_engine.step(StepBatch([StepSeq(0, [5] * 7, 0, [1, 2], False), StepSeq(1, [6] * 3, 0, [3], True)]))
    assert len(out) == 1
    assert tiny_engine.step(StepBatch([StepSeq(0, [5] * 7, 0, [1, 2], False)])) == []
    for slot in (0, 1):
        tiny_engine.free(slot)


def test_bad_steps_are_refused_before_the_device(tiny_engine):
    with pytest.raises(ValueError, match="pages do not cover"):
        tiny_engine.step(StepBatch([StepSeq(0, [1] * 9, 0, [1], True)]))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        tiny_engine.step(StepBatch([StepSeq(0, [1] * 33, 0, list(range(1, 6)), True)]))


def test_no_recompiles_across_randomized_workload(tiny_engine):
    """Every token bucket and sampling bucket, in random mixes, after start-up compiled them all."""
    engine = tiny_engine
    rnd = random.Random(5)
    before = engine.compile_count
    max_pages = engine.max_pages_per_seq
    seen = set()
    for _ in range(60):
        seqs, budget = [], engine.max_num_batched_tokens
        for slot in range(rnd.randint(1, engine.max_slots)):
            params = SamplingParams(temperature=rnd.choice([0.0, 0.5, 1.3]), top_k=rnd.choice([0, 5, 50]),
                                    top_p=rnd.choice([1.0, 0.8]), min_p=rnd.choice([0.0, 0.1]),
                                    presence_penalty=rnd.choice([0.0, 1.0]),
                                    repetition_penalty=rnd.choice([1.0, 1.2]), seed=rnd.randint(0, 99),
                                    logprobs=rnd.choice([None, 2]))
            engine.insert(slot, SlotState([3, 4, 5], [6] * rnd.randint(0, 3), params))
            n = rnd.choice([1, 1, rnd.randint(1, max(1, budget - (engine.max_slots - slot)))])
            start = rnd.randint(0, engine.max_seq_len - n)
            budget -= n
            token = PREVIOUS_SAMPLE if n == 1 and rnd.random() < 0.5 else rnd.randint(0, 255)
            seqs.append(StepSeq(slot, [token] * n, start, list(range(1, max_pages + 1)), rnd.random() < 0.7))
        engine.step(StepBatch(seqs))
        seen.add(engine.buckets.tokens(StepBatch(seqs).num_tokens))
    for slot in range(engine.max_slots):
        engine.free(slot)
    assert engine.compile_count == before
    assert len(seen) >= 4
    assert engine.num_programs == len(engine.buckets.token_counts) + len(engine.buckets.sample_row_counts)


def test_decodes_fed_on_the_device_equal_decodes_fed_from_the_host(tiny_engine):
    """Each step launched before the previous one's samples are collected, its decodes feeding them
    as PREVIOUS_SAMPLE (with another sequence's prefill chunks in between): the same greedy and
    seeded, penalized tokens as the host-fed loop."""
    engine = tiny_engine
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    params = [SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, seed=3, presence_penalty=0.5, logprobs=2)]
    pages = [[1, 2, 3], [4, 5, 6]]
    filler = list(range(40, 64))  # slot 2 prefills in chunks between the decodes

    def run(device_fed: bool) -> list[list[tuple[int, float | None]]]:
        for slot, (prompt, p) in enumerate(zip(prompts, params)):
            engine.insert(slot, SlotState(prompt, [], p))
        engine.insert(2, SlotState(filler, [], SamplingParams(temperature=0.0)))
        out: list[list] = [[], []]
        pending = None
        try:
            for k in range(12):
                seqs = []
                for slot, prompt in enumerate(prompts):
                    if k == 0:
                        seqs.append(StepSeq(slot, prompt, 0, pages[slot], True))
                    else:
                        fed = PREVIOUS_SAMPLE if device_fed else out[slot][-1][0]
                        seqs.append(StepSeq(slot, [fed], len(prompt) + k - 1, pages[slot], True))
                if k < 3:
                    seqs.append(StepSeq(2, filler[8 * k:8 * k + 8], 8 * k, [7, 8, 9], False))
                launched = engine.launch(StepBatch(seqs))
                if device_fed and pending is not None:  # collect step k - 1 after launching step k
                    for slot, sampled in enumerate(pending.result()):
                        out[slot].append((sampled.token_id, sampled.logprob and sampled.logprob.logprob))
                pending = launched
                if not device_fed:
                    for slot, sampled in enumerate(launched.result()):
                        out[slot].append((sampled.token_id, sampled.logprob and sampled.logprob.logprob))
            if device_fed:
                for slot, sampled in enumerate(pending.result()):
                    out[slot].append((sampled.token_id, sampled.logprob and sampled.logprob.logprob))
        finally:
            for slot in range(3):
                engine.free(slot)
        return out

    host, device = run(False), run(True)
    assert device == host
    assert len(set(host[1])) > 3  # the seeded row really samples
