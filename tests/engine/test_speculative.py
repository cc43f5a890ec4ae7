"""The n-gram proposer, greedy acceptance and --speculative-config parsing (engine/speculative.py)."""
from __future__ import annotations

import pytest

from slipstream.engine.request import SamplingParams
from slipstream.engine.speculative import NgramProposer, SpeculativeConfig, accepted_length, may_speculate


def test_ngram_proposes_what_followed_the_most_recent_earlier_match():
    p = NgramProposer(2, 4)
    # "1 2" occurs at 0 (followed by 3 4 5) and at 5 (followed by 9 8): the most recent wins
    tokens = [1, 2, 3, 4, 5, 1, 2, 9, 8, 7, 1, 2]
    assert p.propose(tokens, 3) == [9, 8, 7]
    assert p.propose(tokens, 1) == [9]


def test_ngram_prefers_the_longest_suffix():
    p = NgramProposer(1, 3)
    # suffix "5 6 7" occurs once (followed by 8); the 1-gram "7" occurs later followed by 0
    tokens = [5, 6, 7, 8, 1, 7, 0, 5, 6, 7]
    assert p.propose(tokens, 2) == [8, 1]


def test_ngram_proposes_nothing_without_a_match_or_below_min():
    p = NgramProposer(2, 4)
    assert p.propose([1, 2, 3, 4], 4) == []
    assert p.propose([1, 2, 3, 1], 4) == []  # only a 1-gram matches; min is 2
    assert NgramProposer(1, 4).propose([1, 2, 3, 1], 4) == [2, 3, 1]
    assert p.propose([], 4) == [] and p.propose([7], 4) == []
    assert p.propose([1, 2, 1, 2], 0) == []


def test_ngram_proposal_may_run_into_the_suffix_itself():
    # a repeating run: the match just before the end proposes the run continuing
    assert NgramProposer(2, 2).propose([3, 3, 3, 3], 4) == [3]
    assert NgramProposer(2, 2).propose([1, 2, 1, 2, 1, 2], 4) == [1, 2]


def test_accepted_length_is_the_matching_prefix():
    assert accepted_length([4, 5, 6], [4, 5, 6, 7]) == 3
    assert accepted_length([4, 5, 6], [4, 9, 6, 7]) == 1
    assert accepted_length([4, 5, 6], [1, 5, 6, 7]) == 0
    assert accepted_length([], [3]) == 0


def test_config_parses_vllm_form_and_refuses_bad_values_by_name():
    c = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3, '
                                    '"prompt_lookup_max": 5, "prompt_lookup_min": 2}')
    assert (c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == (3, 5, 2)
    for text, needle in (("{", "not valid JSON"), ("[1]", "JSON object"), ('{"num_speculative_tokens": 2}', "method"),
                         ('{"method": "eagle"}', "method must be one of"),
                         ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
                         ('{"method": "ngram", "num_speculative_tokens": 2.5}', "num_speculative_tokens"),
                         ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}', "prompt_lookup_min"),
                         ('{"method": "ngram", "draft_model": "x"}', "unknown key(s) draft_model")):
        with pytest.raises(ValueError, match="speculative config") as err:
            SpeculativeConfig.from_json(text)
        assert needle in str(err.value)


def test_all_but_grammar_constrained_requests_speculate():
    class Grammar:
        def matcher(self):
            raise AssertionError("not needed")

    for params in (dict(temperature=0.0), dict(temperature=0.7, top_k=5), dict(temperature=0.0, logprobs=1),
                   dict(temperature=0.0, presence_penalty=0.5), dict(repetition_penalty=1.2), dict(n=2)):
        assert may_speculate(SamplingParams(**params))
    assert not may_speculate(SamplingParams(temperature=0.0, constraint=Grammar()))


def test_serve_flag_parses_and_refuses_bad_json_clearly(capsys):
    from slipstream.server.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve"]).speculative_config is None
    args = parser.parse_args(["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert args.speculative_config == SpeculativeConfig(num_speculative_tokens=2)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": -1}'])
    assert "--speculative-config: speculative config: num_speculative_tokens must be" in capsys.readouterr().err


def test_bench_repeat_dataset_asks_to_repeat_a_passage_of_the_length_asked(default_tokenizer):
    from slipstream.server.bench.datasets import repeat_dataset

    tok = default_tokenizer  # tokenizer_for(DEFAULT_MODEL)'s, built once for the run
    reqs = repeat_dataset(tok, num_prompts=3, passage_len=120, seed=1)
    assert reqs == repeat_dataset(tok, num_prompts=3, passage_len=120, seed=1)  # seeded
    for r in reqs:
        passage = r.prompt.split("\n\n", 1)[1].split("<|im_end|>")[0]
        assert 110 <= len(tok.encode(passage, add_special_tokens=False)) == r.expected_output_len <= 120
        assert r.prompt.startswith("<|im_start|>") and "Repeat the following text exactly" in r.prompt
    assert len({r.prompt for r in reqs}) == 3
    with pytest.raises(ValueError, match="--repeat-passage-len"):
        repeat_dataset(tok, num_prompts=1, passage_len=2)


def test_planner_drafts_within_the_token_budget_sample_rows_and_max_tokens():
    import itertools

    from slipstream.engine.block_manager import BlockManager
    from slipstream.engine.request import Request
    from slipstream.engine.schedule import StepPlanner
    from slipstream.engine.sequence import Sequence

    order = itertools.count()

    def seq(prompt, **params):
        return Sequence(Request(list(prompt), SamplingParams(**params)), order=next(order))

    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=2,
                             disable_by_batch_size=4)
    p = StepPlanner(BlockManager(64, 4, True), max_slots=8, token_budget=32, speculative=spec, max_seq_len=64)
    a = seq([1, 2, 3, 1, 2, 3, 1, 2], temperature=0.0, max_tokens=20)
    b = seq([5, 6, 5, 6, 5], temperature=0.0, max_tokens=20)
    c = seq([9, 8, 9, 8, 9], temperature=1.0, max_tokens=20)  # sampled: drafts too, given room
    for s in (a, b, c):
        p.enqueue(s)
    assert p.admit().admitted == [a, b, c]
    p.advance(p.plan())  # the three prompts
    for s, token in ((a, 3), (b, 6), (c, 8)):
        s.add_sample(token)
    assert not p.can_overlap()  # drafting reads the latest tokens on the host
    p.token_budget = 8
    p.propose(p.may_overlap())  # the scheduler drafts with no lock held, then plans
    plan = p.plan()
    # a: 1 + 3 drafts ("2 3" last seen before at 4: 1 2 3 followed); b: 1 + 2 (the 4 tokens left keep
    # one for c); c: its one token (no room left for drafts). 8 tokens: the budget.
    assert [(c_.seq, c_.length, c_.draft) for c_ in plan.chunks] == [(a, 4, (1, 2, 3)), (b, 3, (5, 6)), (c, 1, ())]
    batch = plan.batch()
    assert batch.num_tokens == 8
    assert [(s.token_ids, s.start_pos, s.num_samples) for s in batch.seqs] == [
        ((3, 1, 2, 3), 8, 4), ((6, 5, 6), 5, 3), ((8,), 5, 1)]
    p.advance(plan)
    # drafts count as computed only once accepted: each sequence has its known tokens computed
    assert [(s.num_computed, s.in_flight) for s in (a, b, c)] == [(9, 1), (6, 1), (6, 1)]

    # sample rows: at most max_slots per step, the running sequences' own rows first
    p2 = StepPlanner(BlockManager(64, 4, True), max_slots=4, token_budget=32, speculative=spec, max_seq_len=64)
    d, e = seq([1, 2, 1, 2, 1], temperature=0.0, max_tokens=3), seq([7, 8, 7, 8, 7], temperature=0.0)
    for s in (d, e):
        p2.enqueue(s)
    p2.admit()
    p2.advance(p2.plan())
    d.add_sample(2)
    e.add_sample(8)
    p2.propose(p2.may_overlap())
    plan = p2.plan()
    # d: max_tokens 3 leaves room for 1 draft (its bonus token is the 3rd); e: 4 rows - 2 seqs - 1 = 1
    assert [c_.draft for c_ in plan.chunks] == [(1,), (7,)]

    # a batch of disable_by_batch_size decodes or more does not speculate (and may overlap)
    off = StepPlanner(BlockManager(64, 4, True), max_slots=2, token_budget=32, max_seq_len=64,
                      speculative=SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1,
                                                    disable_by_batch_size=2))
    f, g = seq([1, 2, 1, 2, 1], temperature=0.0), seq([3, 4, 3, 4, 3], temperature=0.0)
    for s in (f, g):
        off.enqueue(s)
    off.admit()
    off.advance(off.plan())
    f.add_sample(2)
    g.add_sample(4)
    assert off.can_overlap()
    off.propose(off.may_overlap())
    assert [c_.draft for c_ in off.plan().chunks] == [(), ()]



def _rest_planner(prompts, max_slots):
    """A planner with n-gram (1-gram, K=2) speculation over greedy sequences of these prompts, and one
    step function: it plans and runs a step (collected before the next is planned), each sequence
    sampling the tokens given for it (fresh ones, never seen before, when None). Returns the planner,
    its sequences and the step function, which returns (whether the step could have overlapped the one
    before it, each chunk's drafts)."""
    import itertools

    from slipstream.engine.api import Sampled
    from slipstream.engine.block_manager import BlockManager
    from slipstream.engine.request import Request
    from slipstream.engine.schedule import StepPlanner
    from slipstream.engine.sequence import Sequence

    spec = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=1)
    p = StepPlanner(BlockManager(256, 4, False), max_slots=max_slots, token_budget=64, speculative=spec,
                    max_seq_len=512)
    seqs = [Sequence(Request(list(prompt), SamplingParams(temperature=0.0, max_tokens=400)), order=i)
            for i, prompt in enumerate(prompts)]
    for seq in seqs:
        p.enqueue(seq)
    p.admit()
    fresh = itertools.count(1000)

    def step(*samples):
        overlap = p.can_overlap()
        p.propose(p.may_overlap())
        plan = p.plan()
        p.advance(plan)
        rows = []
        for chunk, given in zip(plan.chunks, samples or [None] * len(plan.chunks)):
            rows += given or [next(fresh) for _ in range(1 + len(chunk.draft))]
        p.complete(plan, [Sampled(t, None) for t in rows], frozenset(), 512)
        return overlap, [chunk.draft for chunk in plan.chunks]

    return p, seqs, step


def test_a_sequence_whose_drafts_miss_rests_longer_each_time_and_its_steps_may_overlap():
    """One sequence (its steps may overlap): no draft found or none accepted -> it rests 1, 2, 4 ...
    steps (at most MAX_REST), planned without drafts and free to overlap the step in flight; a probe
    with an accepted draft ends the run of misses."""
    from slipstream.engine.speculative import MAX_REST

    p, _, step = _rest_planner([[1, 2, 3, 4]], max_slots=4)
    assert step([2]) == (False, [()])             # the prompt, then 2 (seen before, followed by 3 4)
    assert step([3, 4, 7]) == (False, [(3, 4)])   # both drafts accepted, then 7
    assert step([8]) == (False, [()])             # 7: nothing to draft -> rest 1
    assert step([1]) == (True, [()])              # resting (1 would have found 2 3)
    assert step([9, 9, 9]) == (False, [(2, 3)])   # none accepted -> rest 2
    assert step([6]) == (True, [()]) and step([1]) == (True, [()])
    # 1 at the start, where the rejected draft came from (lookup's `after`), is followed by 2 (K - 1 = 1
    # draft after a rejection): accepted, the run ends
    assert step([2, 5]) == (False, [(2,)])
    assert step() == (False, [()])                # 5: nothing -> rest 1 (not 4)
    assert p.speculator.counters.snapshot()[:2] == (5, 3)
    # fresh tokens only: probes with 1, 2, 4 ... MAX_REST resting steps between them
    expected = "o." + "oo." + "oooo." + "o" * 8 + "." + ("o" * 16 + ".") * 2 + "o" * MAX_REST + "."
    assert "".join("o" if step()[0] else "." for _ in expected) == expected


def test_without_overlap_to_gain_finding_no_draft_costs_no_rest():
    """Two sequences with slots free: their steps cannot overlap anyway, so a step with no draft found
    does not make a sequence rest (a verification that accepts none still does: it cost compute)."""
    p, (a, b), step = _rest_planner([[1, 2, 3, 4], [5, 6, 7, 8]], max_slots=4)
    assert not p.may_overlap()
    step([100], [101])                                  # the prompts
    assert step([2], [102]) == (False, [(), ()])        # nothing to draft for either
    assert step([4, 0, 0], [103]) == (False, [(3, 4), ()])  # a drafts at once; none accepted
    assert step(None, [5]) == (False, [(), ()])         # a rests (4 would have found 100 2); b: nothing
    assert step(None, [6, 7, 1]) == (False, [(), (6, 7)])  # b drafts at once (5 was followed by 6 7)


def test_ngram_drafts_fill_the_step_bucket_padded_rows():
    """A step of K = 4 drafts (5 query tokens) runs as the engine's 8-token bucket: n-gram drafts grow,
    round-robin, to fill the padded rows, within max_tokens; not for a draft model (each draft costs
    it a forward pass), nor while a prompt is still prefilling (its chunk's length is not known yet)."""
    import itertools

    from slipstream.engine.block_manager import BlockManager
    from slipstream.engine.request import Request
    from slipstream.engine.schedule import StepPlanner
    from slipstream.engine.sequence import Sequence

    order = itertools.count()
    motif = list(range(10, 30))
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=2)

    def drafts(prompts, max_tokens=(100, 100), proposer=None, prefilling=False):
        p = StepPlanner(BlockManager(256, 4, False), max_slots=32, token_budget=128, speculative=spec,
                        max_seq_len=512, proposer=proposer, token_buckets=(1, 2, 4, 8, 16, 32, 64, 128))
        seqs = [Sequence(Request(list(pr), SamplingParams(temperature=0.0, max_tokens=m)), order=next(order))
                for pr, m in zip(prompts, max_tokens)]
        for s in seqs:
            p.enqueue(s)
        p.admit()
        p.advance(p.plan())  # the prompts
        for s in seqs:
            s.add_sample(motif[0])  # the motif goes on
        if prefilling:
            p.enqueue(Sequence(Request([1] * 40, SamplingParams(temperature=0.0)), order=next(order)))
            p.admit()
        p.propose(p.may_overlap())
        got = {c.seq: len(c.draft) for c in p.plan().chunks}
        return [got[s] for s in seqs]

    # the motif's first token follows 5 once before: a 2-token match, K = 4 asked
    short = [5] + motif + [7, 8, 5]
    assert drafts([short]) == [7]                           # 1 + 4 -> bucket 8: 7 drafts
    assert drafts([short, short]) == [7, 7]                 # 2 + 8 -> bucket 16: 14 drafts
    # 3 drafts left for the first (max_tokens), 2 + 7 -> bucket 16: the second takes the 7 spare rows
    assert drafts([short, short], max_tokens=(5, 100)) == [3, 11]
    assert drafts([short], prefilling=True) == [4]

    class Fixed:  # a proposer that is not prompt lookup (a draft model's place)
        def draft(self, asks):
            return [[5] * k for _, k in asks]

    assert drafts([motif * 2], proposer=Fixed()) == [4]
    # the motif repeated: its match agrees with the last 20 tokens, a copy in progress asks for 2K + 1
    assert drafts([motif * 2], prefilling=True) == [9]
    assert drafts([motif * 2]) == [15]                      # 1 + 9 -> bucket 16: 15 drafts
    assert drafts([motif * 2, short]) == [10, 4]            # 2 + 13 -> bucket 16: one spare row


def test_ngram_lookup_counts_how_far_its_match_agrees():
    """The match's agreement with the sequence's last tokens (the n-gram and the tokens before it), up
    to LONG_MATCH: what tells a copy in progress from a chance match; and where its draft starts."""
    from slipstream.engine.speculative import LONG_MATCH

    p = NgramProposer(2, 3)
    assert p.lookup([9, 1, 2, 3, 4, 7, 1, 2, 3], 2) == ([4, 7], 3, 4)   # the 3-gram; 9 != 7 before it
    assert p.lookup([9, 1, 2, 3, 4, 9, 1, 2, 3], 2) == ([4, 9], 4, 4)   # 9 == 9 before it, then the start
    assert p.lookup([1, 2, 5, 1, 2], 1) == ([5], 2, 2)
    assert p.lookup([1, 2, 3], 2) == ([], 0, -1)
    run = list(range(100, 130))
    assert p.lookup(run + [0] + run[:20], 3) == (run[20:23], LONG_MATCH, 20)


def test_ngram_lookup_reads_on_from_where_the_last_accepted_draft_ended():
    """With `after` (where the last accepted draft ended), the n-gram's first occurrence from there on
    is taken, not the most recent one (a copy that skipped ahead lands on the next occurrence of what
    it wrote); with none from there on, the most recent one."""
    p = NgramProposer(1, 2)
    text = [1, 2, 10, 11, 1, 2, 20, 21, 1, 2, 30, 31, 5]
    seq = text + [1, 2]                                    # [1, 2] at 0, 4 and 8
    assert p.lookup(seq, 2) == ([30, 31], 2, 10)             # the most recent
    assert p.lookup(seq, 2, after=2) == ([10, 11], 2, 2)     # the copy read up to 2: the occurrence at 0
    assert p.lookup(seq, 2, after=3) == ([20, 21], 2, 6)     # past it: the next one, at 4
    assert p.lookup(seq, 2, after=11) == ([30, 31], 2, 10)   # none from 9 on: the most recent


def test_ngram_drafting_follows_its_copy_and_drafts_fewer_after_a_rejection():
    """A sequence copying a text whose "sentences" share a phrase (7 8): after a verification that kept
    every draft, the next lookup reads on from where it ended (the next 7 8 in the text, not the most
    recent one); after one that rejected a draft it asks for K - 1 drafts (a step of K tokens: a smaller
    bucket), not K filled up to the bucket."""
    from slipstream.engine.api import Sampled
    from slipstream.engine.block_manager import BlockManager
    from slipstream.engine.request import Request
    from slipstream.engine.schedule import StepPlanner
    from slipstream.engine.sequence import Sequence

    spec = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=2)
    p = StepPlanner(BlockManager(256, 4, False), max_slots=32, token_budget=128, speculative=spec,
                    max_seq_len=512, token_buckets=(1, 2, 4, 8, 16, 32, 64, 128))
    text = [0, 1, 2, 7, 8, 31, 32, 3, 4, 7, 8, 41, 42, 5, 6, 7, 8, 51, 52, 9, 0, 1]
    seq = Sequence(Request(text, SamplingParams(temperature=0.0, max_tokens=100)), order=0)
    p.enqueue(seq)
    p.admit()

    def step(*samples):
        p.propose(p.may_overlap())
        plan = p.plan()
        p.advance(plan)
        p.complete(plan, [Sampled(t, None) for t in samples], frozenset(), 512)
        return plan.chunks[0].draft

    assert step(2) == ()                                  # the prompt; the copy of the text starts: 0 1 2
    assert step(7, 8, 31, 32) == (7, 8, 31)               # K = 2 filled to the 4-token bucket; all kept
    assert step(3, 4, 7, 8) == (3, 4, 7)                  # all kept, then 8: the copy is at 4 7 8 (9-10)
    # 7 8 was last written at 23-24 (followed by 31 32 3): the copy reads on from the text's next 7 8
    assert step(41, 5, 0, 0) == (41, 42, 5)               # 41 kept, then the copy skips to 5 (13)
    assert step(6, 7) == (6,)                             # after a rejection K - 1 = 1 draft: 2 tokens
