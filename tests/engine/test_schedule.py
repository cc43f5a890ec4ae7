"""What each ragged step runs: decodes first, then prefill chunks in the token budget (oldest prompt first,
then shortest remaining), and at most one long prefill ending per step."""
from __future__ import annotations

from slipstream.engine.mock_engine import MockEngine
from tests.engine.planner_helpers import Driver, planner, seq, shape
from tests.engine.scheduler_helpers import chain


def test_decodes_first_then_prefill_chunks_in_the_rest_of_the_budget():
    p = planner(budget=10)
    d = Driver(p, MockEngine(max_num_batched_tokens=10))
    a, b = seq([40, 41]), seq([50])
    d.submit(a, b)
    assert shape(d.step()) == [(b.order, 0, 1, True), (a.order, 0, 2, True)]
    prompt = seq(range(60, 80))  # 20 tokens
    d.submit(prompt)
    # a and b decode (1 token each), then the new prompt gets exactly the 8 tokens that are left
    assert shape(d.step()) == [(a.order, 2, 1, True), (b.order, 1, 1, True),
                               (prompt.order, 0, 8, False)]
    assert shape(d.step()) == [(a.order, 3, 1, True), (b.order, 2, 1, True),
                               (prompt.order, 8, 8, False)]
    # its last chunk (4 tokens) samples its first output token in the same step
    assert shape(d.step()) == [(a.order, 4, 1, True), (b.order, 3, 1, True),
                               (prompt.order, 16, 4, True)]
    assert prompt.output_ids == [80]
    assert shape(d.step())[-1] == (prompt.order, 20, 1, True)  # now it is a decode


def test_the_budget_is_filled_exactly_and_chunks_are_cut_anywhere():
    p = planner(budget=7, num_pages=128)
    d = Driver(p, MockEngine(max_num_batched_tokens=7))
    seqs = [seq(range(k, k + n), max_tokens=3) for k, n in ((40, 11), (60, 5), (80, 9))]
    d.submit(*seqs)
    totals = []
    while p.waiting or p.running:
        plan = d.step()
        assert plan.num_tokens <= 7
        totals.append(plan.num_tokens)
    assert totals[:3] == [7, 7, 7]  # 25 prompt tokens: no step runs short while work is left
    assert [s.output_ids for s in seqs] == [chain(s.request.prompt_ids, 3) for s in seqs]


def test_oldest_prompt_always_advances_then_shortest_remaining():
    p = planner(budget=36, num_pages=128)
    d = Driver(p, MockEngine(max_num_batched_tokens=36))
    old, mid, short = seq(range(100, 130)), seq(range(60, 72)), seq(range(80, 83))
    d.submit(old, mid, short)
    # old first although it is the longest, then short (3), then mid gets the 3 tokens left
    assert shape(d.step()) == [(old.order, 0, 30, True), (short.order, 0, 3, True),
                               (mid.order, 0, 3, False)]


def test_shorter_prompts_never_starve_the_oldest_one():
    p = planner(budget=8, num_pages=128)
    d = Driver(p, MockEngine(max_num_batched_tokens=8))
    old = seq(range(100, 130), max_tokens=1)
    d.submit(old)
    d.step()
    for k in range(3):  # a short prompt arrives every step; the oldest keeps its share
        d.submit(seq(range(40 + 10 * k, 43 + 10 * k), max_tokens=1))
        assert shape(d.step())[0] == (old.order, 8 * (k + 1), min(8, 30 - 8 * (k + 1)), k == 2)
    assert old.output_ids == [130]


def test_a_mixed_step_carries_decodes_and_chunks_of_several_prompts():
    p = planner(budget=16)
    engine = MockEngine(max_num_batched_tokens=16)
    d = Driver(p, engine)
    d.submit(seq([10]), seq([20]))
    d.step()
    x, y = seq(range(40, 46)), seq(range(50, 60))
    d.submit(x, y)
    plan = d.step()
    batch = plan.batch()
    assert [(s.start_pos, list(s.token_ids), s.sample) for s in batch.seqs] == [
        (1, [11], True), (1, [21], True), (0, list(range(40, 46)), True),
        (0, list(range(50, 58)), False)]
    assert batch.num_tokens == 16
    for s, c in zip(batch.seqs, plan.chunks):
        assert s.slot == c.seq.slot and list(s.page_ids) == c.seq.pages
        assert len(s.page_ids) * 4 >= s.end_pos  # pages cover the chunk
    assert engine.steps[-1] == tuple((s.slot, s.start_pos, len(s.token_ids), s.sample)
                                     for s in batch.seqs)
    assert plan.prefill_tokens == 14  # the two decodes are not prefill


def test_decodes_beyond_the_budget_wait_oldest_first():
    p = planner(budget=2)
    d = Driver(p, MockEngine(max_num_batched_tokens=2))
    seqs = [seq([40 + i], max_tokens=4) for i in range(3)]
    d.submit(*seqs)
    d.step()  # the first two one-token prompts
    assert [c.seq for c in d.step().chunks] == seqs[:2]
    d.run()
    assert all(s.output_ids == chain(s.request.prompt_ids, 4) for s in seqs)


def test_one_long_prefill_ends_per_step_short_ones_are_not_held():
    p = planner(budget=16, num_pages=128)
    d = Driver(p, MockEngine(max_num_batched_tokens=16))
    x, y = seq(range(40, 46)), seq(range(60, 66))  # 6 tokens each: under half the budget
    d.submit(x, y)
    assert shape(d.step()) == [(x.order, 0, 6, True), (y.order, 0, 6, True)]  # both end
    p = planner(budget=16, num_pages=128)
    d = Driver(p, MockEngine(max_num_batched_tokens=16))
    a, b = seq(range(70, 78)), seq(range(80, 88))  # 8 tokens each: half the budget
    d.submit(a, b)
    # both fit, but b keeps its last token for the next step, where it ends beside a's decode
    assert shape(d.step()) == [(a.order, 0, 8, True), (b.order, 0, 7, False)]
    assert shape(d.step()) == [(a.order, 8, 1, True), (b.order, 7, 1, True)]
    assert b.output_ids == [88]


def test_a_recompute_stops_its_chunk_at_the_prompt_end_and_takes_only_prompt_pages_from_the_cache():
    # with roles (the hybrid weights multiply prompt and generated tokens in different forms) a preempted
    # sequence's recompute computes its output as generated tokens, never as another request's prompt; without
    # them the recompute takes the cached pages and one chunk as before
    p = planner(budget=16, page_size=4, roles=True)
    d = Driver(p, MockEngine(max_num_batched_tokens=16, prompt_w16=True))
    s = seq(range(40, 46), max_tokens=12)  # a 6-token prompt: one full page
    d.submit(s)
    for _ in range(6):
        d.step()
    assert len(s.output_ids) == 6
    # another request whose prompt holds s's prompt and output: its pages 0-1 are cached
    other = seq(s.tokens[:9], max_tokens=1)
    d.submit(other)
    d.step()
    assert p.blocks.cached_prefix_tokens(s.tokens) == 8
    d.engine.free(p.preempt(s))
    known = len(s.tokens)
    # back: only the prompt's full page from the cache; the chunk stops at the prompt's end, the output after it
    assert shape(d.step()) == [(s.order, 4, 2, False)]
    assert shape(d.step()) == [(s.order, 6, known - 6, True)]
    assert p.blocks.prefix.num_cached == 2  # its recomputed output was not offered to later requests



def test_with_roles_a_recompute_of_generated_tokens_comes_before_a_prompt_chunk():
    for roles in (True, False):
        p = planner(budget=8, page_size=4, roles=roles)
        d = Driver(p, MockEngine(max_num_batched_tokens=8, prompt_w16=roles))
        y = seq(range(40, 44), max_tokens=12)
        d.submit(y)
        for _ in range(4):
            d.step()
        x = seq(range(60, 70), max_tokens=2)
        d.submit(x)
        assert shape(d.step()) == [(y.order, 7, 1, True), (x.order, 0, 7, False)]
        d.engine.free(p.preempt(y))
        # y back: its prompt page cached, its output recomputed as generated tokens; x's last prompt chunk
        want = [(x.order, 7, 3, True), (y.order, 4, 4, False)]
        assert shape(d.step()) == (want[::-1] if roles else want)
