"""Page placement: each sequence's KV pages as one ascending run of page ids where the pool has room (the
attention kernel reads them faster), with soft claims that never cost capacity, under churn through the planner."""
from __future__ import annotations

import copy
import itertools
import random

import numpy as np
import pytest

from slipstream.engine.block_manager import BlockManager, cheapest_window
from slipstream.engine.kv_cache import PageAllocator
from slipstream.engine.request import Request, SamplingParams
from slipstream.engine.schedule import StepPlanner
from slipstream.engine.sequence import Sequence

_order = itertools.count()


def test_first_pages_start_a_run_long_enough_for_all_and_growth_takes_the_next_page():
    alloc = PageAllocator(64)
    filler = alloc.allocate(4)                                  # 1..4
    pages = alloc.allocate(3, want=6, owner=1)
    assert pages == [5, 6, 7]
    assert alloc.allocate(2) == [11, 12]                        # 8..10 are claimed by owner 1
    for _ in range(3):
        pages += alloc.allocate(1, want=6 - len(pages), owner=1, after=pages[-1])
    assert pages == [5, 6, 7, 8, 9, 10]
    assert filler == [1, 2, 3, 4]


def test_best_fit_keeps_long_runs_for_long_sequences():
    alloc = PageAllocator(32)
    held = alloc.allocate(31)
    alloc.free_many(held[2:5] + held[10:20])                    # free runs 3..5 and 11..20
    assert alloc.allocate(2, want=3, owner=1) == [3, 4]         # the 3-run, not the start of the 10-run
    assert alloc.allocate(4, want=10, owner=2) == [11, 12, 13, 14]


def test_without_a_long_enough_run_the_longest_is_used_and_the_rest_found_later():
    alloc = PageAllocator(32)
    held = alloc.allocate(31)
    alloc.free_many(held[0:2] + held[9:13] + held[20:23])      # free runs 1..2, 10..13, 21..23
    pages = alloc.allocate(3, want=6, owner=1)
    assert pages == [10, 11, 12]                                # the longest run; 13 claimed
    pages += alloc.allocate(1, want=3, owner=1, after=pages[-1])
    assert pages == [10, 11, 12, 13]
    pages += alloc.allocate(1, want=2, owner=1, after=pages[-1])  # 14 is held: a new run for the last two
    assert pages[-1] == 1 and alloc.allocate(1, want=1, owner=1, after=1) == [2]


def test_claims_are_soft_every_free_page_is_still_allocatable():
    alloc = PageAllocator(11)
    a = alloc.allocate(2, want=5, owner=1)                      # 1, 2; claims 3..5
    b = alloc.allocate(2, want=5, owner=2)                      # 6, 7; claims 8..10
    assert (a, b) == ([1, 2], [6, 7])
    rest = alloc.allocate(6)                                    # only claimed pages are left: taken
    assert sorted(rest) == [3, 4, 5, 8, 9, 10] and alloc.num_free == 0
    assert alloc.allocate(1) is None
    alloc.free_many(rest)
    # owner 1's claim was taken, so its growth goes wherever a page is open, never failing
    assert alloc.allocate(1, want=3, owner=1, after=2) == [3]


def test_release_claim_opens_the_run_to_others():
    alloc = PageAllocator(9)
    assert alloc.allocate(1, want=8, owner=1) == [1]
    assert alloc.longest_open_run() == 0 and alloc.longest_open_run(owner=1) == 7
    alloc.release_claim(1)
    assert alloc.longest_open_run() == 7
    assert alloc.allocate(7, want=7, owner=2) == list(range(2, 9))


def test_placement_keeps_refcounts_and_page_0_out():
    alloc = PageAllocator(6)
    pages = alloc.allocate(5, want=9, owner=3)
    assert sorted(pages) == [1, 2, 3, 4, 5]
    alloc.incref(pages[0])
    alloc.free_many(pages)
    assert alloc.refcount(pages[0]) == 1 and alloc.num_free == 4
    with pytest.raises(ValueError, match="owner"):
        alloc.allocate(1, owner=-1)


# ---- churn through the real planner ---------------------------------------------------------------


def _seq(rng: random.Random, prompt_len: int, max_tokens: int, shared: list[int]) -> Sequence:
    prompt = shared[:prompt_len // 2] + [rng.randrange(1000) for _ in range(prompt_len - prompt_len // 2)]
    return Sequence(Request(prompt_ids=prompt, params=SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
                    order=next(_order))


def _check_books(p: StepPlanner) -> None:
    """Refcounts are the running sequences' references plus one per cached page; free pages are exactly the
    unreferenced ones, and every one of them can be allocated (on a copy: the claims do not hide any)."""
    alloc, num_pages = p.blocks.allocator, p.blocks.allocator.num_total + 1
    holders = np.zeros(num_pages, dtype=int)
    for s in p.running:
        assert len(set(s.pages)) == len(s.pages) and 0 not in s.pages
        np.add.at(holders, s.pages, 1)
    refs = np.array([alloc.refcount(i) for i in range(num_pages)])
    extra = refs - holders
    assert extra[0] == 0 and set(extra[1:]) <= {0, 1}
    assert extra.sum() == (p.blocks.prefix.num_cached if p.blocks.prefix else 0)
    free = set(np.flatnonzero(refs[1:] == 0) + 1)
    assert alloc.num_free == len(free)
    probe = copy.deepcopy(alloc)
    assert set(probe.allocate(len(free))) == free and probe.num_free == 0


def churn(*, num_pages: int, slots: int, requests: int, prefix: bool, seed: int, page_size: int = 4,
          check_every: int = 7, idle: list[int] | None = None) -> tuple[StepPlanner, list[list[int]], int]:
    """Requests of mixed lengths (most sharing a prompt head, some ending early as EOS or a cancel would),
    replaced as they finish; returns the planner, the pages each finished sequence added to its prefix-cache
    hit (all its pages without a hit), and how many preemptions there were. `idle` gets the idle prefix-cache
    pages at each step."""
    rng = random.Random(seed)
    shared = [rng.randrange(1000) for _ in range(64)]
    p = StepPlanner(BlockManager(num_pages, page_size, prefix), max_slots=slots, token_budget=24)
    tables: list[list[int]] = []
    submitted = preempted = 0

    def submit() -> None:
        nonlocal submitted
        p.enqueue(_seq(rng, rng.randrange(3, 40), rng.randrange(1, 30), shared))
        submitted += 1

    for _ in range(slots + 2):
        submit()
    for step in itertools.count():
        if not (p.running or p.waiting):
            break
        for s in p.admit().admitted:
            s.inserted = True
        plan = p.plan()
        if idle is not None:
            idle.append(p.pages_cached)
        preempted += len(plan.preempted)
        p.advance(plan)
        for s in plan.sampled:
            s.add_sample(1)
            if len(s.output_ids) >= s.request.params.max_tokens or rng.random() < 0.03:
                tables.append(s.pages[s.matched_pages:])
                p.finish(s)
                if submitted < requests:
                    submit()
        if step % check_every == 0:
            _check_books(p)
    _check_books(p)
    return p, tables, preempted


def _runs(table: list[int]) -> int:
    return 1 + int(np.count_nonzero(np.diff(table) != 1))


@pytest.mark.parametrize("prefix, num_pages", [(False, 241), (True, 1500)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_churn_with_room_gives_every_sequence_one_ascending_run(prefix, num_pages, seed):
    # 6 slots x at most 20 pages each fit twice over (and with the prefix cache, it never has to evict)
    p, tables, preempted = churn(num_pages=num_pages, slots=6, requests=120, prefix=prefix, seed=seed)
    assert preempted == 0 and len(tables) == 120
    assert [_runs(t) for t in tables] == [1] * 120
    if p.blocks.prefix:
        p.blocks.prefix.clear()
    alloc = p.blocks.allocator
    assert alloc.num_free == alloc.num_total
    assert alloc.allocate(alloc.num_total) == list(range(1, num_pages))  # nothing lost, nothing left claimed


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 5])
def test_churn_with_a_full_prefix_cache_still_places_sequences_in_one_run(seed):
    """The cache holds every page no sequence does, so free pages are what eviction frees: admission evicts the
    cached pages of one window for one run (LIFO placement here split most sequences into many runs), and no more.
    Mean idle cached pages after the first quarter of the steps, seeds 0-5: LIFO free list (80e0c42) 162-182,
    LRU eviction until a run is open (00c7880) 98-119, this 142-160 (pages a run leaves free stay free)."""
    idle: list[int] = []
    p, tables, preempted = churn(num_pages=241, slots=6, requests=120, prefix=True, seed=seed, idle=idle)
    assert preempted == 0 and p.blocks.prefix.num_cached > 100
    assert np.mean([_runs(t) == 1 for t in tables]) >= 0.95
    assert np.mean(idle[len(idle) // 4:]) >= 130


def _admit(blocks: BlockManager, prompt: list[int], max_tokens: int = 1) -> Sequence:
    seq = Sequence(Request(prompt_ids=prompt, params=SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
                   order=next(_order))
    assert blocks.admit(seq)
    return seq


def test_admission_evicts_exactly_the_least_recently_used_window():
    """A full prefix cache whose oldest pages are scattered (tails of chains A and C, all of B): the new
    sequence gets B's four pages, the oldest window, and nothing else is evicted (LRU eviction until a run
    opened evicted A's tail too)."""
    blocks = BlockManager(13, 4, enable_prefix_cache=True)
    prompts = [[k] * 16 for k in (1, 2, 3)]
    seqs = [_admit(blocks, prompt) for prompt in prompts]
    assert [s.pages for s in seqs] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    for s in seqs:
        blocks.register(s)
        blocks.release(s)
    for prompt in (prompts[0], prompts[2]):                    # A and C used again: B is the oldest window
        blocks.allocator.free_many(blocks.prefix.match(prompt))
    new = _admit(blocks, [7] * 16)
    assert new.pages == [5, 6, 7, 8]
    assert blocks.prefix.num_cached == 8
    assert blocks.prefix.peek(prompts[0]) == 3 and blocks.prefix.peek(prompts[2]) == 3
    assert blocks.prefix.peek(prompts[1]) == 0


def test_without_a_free_or_idle_window_admission_evicts_lru_and_takes_the_longest_runs_as_before():
    blocks = BlockManager(13, 4, enable_prefix_cache=True)
    seqs = [_admit(blocks, [k] * 8) for k in (1, 2, 3, 4, 5, 6)]    # 2 cached pages each, 1..12
    for s in seqs:
        blocks.register(s)
    for s in seqs[::2]:
        blocks.release(s)                                      # idle cached: 1-2, 5-6, 9-10; the rest held
    new = _admit(blocks, [9] * 20, max_tokens=4)               # 5 pages now, 6 in all: no window of 6
    assert sorted(new.pages) == [1, 2, 5, 6, 10]               # the 5 LRU pages (each chain's tail first)
    assert blocks.prefix.num_cached == 7 and blocks.prefix.peek([5] * 8) == 1  # page 9 kept


def test_window_after_a_prefix_hit_wins_only_among_the_cheapest():
    last_use = np.arange(9)                                    # pages 1..8 idle cached, 1 the oldest; 0 padding
    closed, chained = np.zeros(9, dtype=bool), np.zeros(9, dtype=bool)
    assert cheapest_window(closed, last_use, 2, chained) == 1
    assert cheapest_window(closed, last_use, 2, chained, prefer=5) == 5   # same loss: continue the hit's run
    free_6 = last_use.copy()
    free_6[6] = 0
    open_6 = closed.copy()
    open_6[6] = True
    assert cheapest_window(open_6, free_6, 2, chained, prefer=3) == 5     # [5, 6] and [6, 7] lose one page
    free_6[5] = 10                                             # 5 used last: [6, 7] is the older window...
    assert cheapest_window(open_6, free_6, 2, chained) == 6
    chained[8] = True                                          # ...but 8 hangs below 7: [6, 7] loses two
    assert cheapest_window(open_6, free_6, 2, chained) == 5
    assert cheapest_window(closed, last_use, 9, chained) is None


def _cheapest_window_by_hand(open_, last_use, want, follows, prefer=None):
    """cheapest_window's rule, window by window: fewest cached pages lost (those in it and the chained run
    after it), then the oldest newest use, then the lowest start; `prefer` where it loses no more."""
    keys = {}
    for start in range(len(last_use) - want + 1):
        window = range(start, start + want)
        if not all(open_[p] or last_use[p] > 0 for p in window):
            continue
        end = start + want
        while end < len(follows) and follows[end]:
            end += 1
        keys[start] = (sum(last_use[p] > 0 for p in window) + end - start - want, max(last_use[p] for p in window))
    if not keys:
        return None
    best = min(keys, key=lambda s: (*keys[s], s))
    return prefer if prefer in keys and keys[prefer][0] == keys[best][0] else best


def test_cheapest_window_matches_the_rule_window_by_window():
    rng = np.random.default_rng(7)
    for _ in range(3000):
        num = int(rng.integers(1, 24))
        last_use = np.where(rng.random(num) < 0.6, rng.integers(1, 6, num), 0)  # repeated uses: ties
        open_ = (last_use == 0) & (rng.random(num) < 0.7)
        follows = rng.random(num) < 0.3
        want = int(rng.integers(1, num + 2))
        prefer = int(rng.integers(0, num)) if rng.random() < 0.5 else None
        assert cheapest_window(open_, last_use, want, follows, prefer) == \
            _cheapest_window_by_hand(open_, last_use, want, follows, prefer), (open_, last_use, want, follows, prefer)
