"""Prefix cache, hand-written cases: chained-hash matching, LRU and chosen-page eviction, and refcount
bookkeeping with the allocator (the random admit/insert/finish/evict sequences are in
test_prefix_cache_machine.py)."""
from __future__ import annotations

import numpy as np
import pytest

from slipstream.engine.kv_cache import PageAllocator, pages_needed
from slipstream.engine.prefix_cache import PrefixCache, chain_digests

PS = 4  # page size for the hand-written tests


def _prefill(alloc: PageAllocator, cache: PrefixCache, tokens: list[int]) -> list[int]:
    """What the scheduler does for one prompt: match, allocate the rest, insert once written."""
    pages = cache.match(tokens)
    rest = alloc.allocate(pages_needed(len(tokens), PS) - len(pages))
    assert rest is not None
    pages += rest
    cache.insert(tokens, pages)
    return pages


def test_same_three_page_prefix_matches_three_pages():
    alloc = PageAllocator(32)
    cache = PrefixCache(alloc, PS)
    prefix = list(range(100, 100 + 3 * PS))
    first = _prefill(alloc, cache, prefix + [1, 2])
    matched = cache.match(prefix + [7, 8, 9])
    assert matched == first[:3]
    assert [alloc.refcount(p) for p in matched] == [3, 3, 3]  # first seq, cache, second seq
    assert (cache.queries, cache.hits, cache.hit_tokens) == (2, 1, 3 * PS)


def test_differing_token_in_page_2_matches_two_pages():
    alloc = PageAllocator(32)
    cache = PrefixCache(alloc, PS)
    tokens = list(range(3 * PS + 1))
    first = _prefill(alloc, cache, tokens)
    other = list(tokens)
    other[2 * PS + 1] = 999
    assert cache.match(other) == first[:2]


def test_match_leaves_at_least_one_token_to_compute():
    alloc = PageAllocator(32)
    cache = PrefixCache(alloc, PS)
    tokens = list(range(3 * PS))
    first = _prefill(alloc, cache, tokens)
    assert cache.num_cached == 3
    assert cache.match(tokens) == first[:2]  # all 3 pages cached, but the last token must run
    assert cache.match(tokens[:PS]) == []
    assert cache.match([]) == []
    assert (cache.queries, cache.hits) == (4, 1)


def test_equal_page_under_a_different_parent_does_not_match():
    alloc = PageAllocator(32)
    cache = PrefixCache(alloc, PS)
    a, b, c = [1] * PS, [2] * PS, [3] * PS
    _prefill(alloc, cache, a + b + c + [0])
    assert cache.match(c + b + [0]) == []        # page 1 equals, page 0 differs
    assert len(cache.match(a + b + [0])) == 2
    assert chain_digests(a + b, PS)[1] != chain_digests(c + b, PS)[1]


def test_page_whose_parent_was_evicted_is_not_matched():
    alloc = PageAllocator(32)
    cache = PrefixCache(alloc, PS)
    a, b = [1] * PS, [2] * PS
    first = _prefill(alloc, cache, a + [0])
    # Admitted before `first` was inserted, so it computed page `a` again into its own page.
    second = alloc.allocate(3)
    cache.insert(a + b + [0], second)
    assert cache.num_cached == 2              # a -> first[0] (kept), a+b -> second[1]
    alloc.free_many(first)
    assert cache.evict(1) == 1                # only first[0] is unreferenced
    assert alloc.refcount(first[0]) == 0
    assert cache.match(a + b + [0]) == []     # second[1] is cached but its parent is gone


def test_digests_are_stable_across_calls_and_input_types():
    tokens = list(range(2 * PS + 1))
    digests = chain_digests(tokens, PS)
    assert len(digests) == 2
    assert chain_digests(tuple(tokens), PS) == digests
    assert chain_digests(tokens[:PS], PS) == digests[:1]


def test_insert_twice_does_not_take_a_second_reference():
    alloc = PageAllocator(32)
    cache = PrefixCache(alloc, PS)
    tokens = list(range(2 * PS))
    pages = _prefill(alloc, cache, tokens)
    cache.insert(tokens, pages)
    # A second sequence that computed the same prefix into its own pages: nothing new cached.
    dup = alloc.allocate(2)
    cache.insert(tokens, dup)
    assert cache.num_cached == 2
    assert [alloc.refcount(p) for p in pages] == [2, 2]
    assert [alloc.refcount(p) for p in dup] == [1, 1]
    alloc.free_many(dup)
    assert alloc.num_free == alloc.num_total - 2


def test_insert_rejects_missing_or_repeated_page_ids():
    alloc = PageAllocator(8)
    cache = PrefixCache(alloc, PS)
    pages = alloc.allocate(2)
    with pytest.raises(ValueError, match="only 1 page ids"):
        cache.insert(list(range(2 * PS)), pages[:1])
    with pytest.raises(ValueError, match="repeat"):
        cache.insert(list(range(2 * PS)), [pages[0], pages[0]])
    assert cache.num_cached == 0


def test_digests_given_by_the_caller_match_and_insert_as_computed_ones():
    """Admission's digests (one chain_digests per prompt) serve match and insert alike; a count that
    is not one per full page of the tokens is refused."""
    alloc = PageAllocator(32)
    cache = PrefixCache(alloc, PS)
    tokens = list(range(50, 50 + 3 * PS))  # whole pages: match leaves the last one to compute
    digests = chain_digests(tokens, PS, salt=b"s")
    pages = cache.match(tokens, b"s", digests) + alloc.allocate(3)
    cache.insert(tokens, pages, b"s", digests)
    assert cache.match(tokens + [1], b"s") == pages  # computed digests find the given ones
    assert cache.match(tokens + [1], b"") == []      # the salt is in them
    for wrong in (digests[:2], digests + digests[:1]):
        with pytest.raises(ValueError, match="digests were given"):
            cache.match(tokens, b"s", wrong)
        with pytest.raises(ValueError, match="digests were given"):
            cache.insert(tokens, pages, b"s", wrong)


def test_finished_sequence_pages_stay_cached_and_are_reused():
    alloc = PageAllocator(8)
    cache = PrefixCache(alloc, PS)
    tokens = list(range(2 * PS + 2))
    pages = _prefill(alloc, cache, tokens)
    alloc.free_many(pages)
    assert alloc.num_used == 2  # the two full pages, held by the cache; the partial one is free
    assert cache.match(tokens) == pages[:2]


def test_evict_frees_least_recently_used_first():
    alloc = PageAllocator(32)
    cache = PrefixCache(alloc, PS)
    old = _prefill(alloc, cache, [1] * PS + [0])
    mid = _prefill(alloc, cache, [2] * PS + [0])
    new = _prefill(alloc, cache, [3] * PS + [0])
    for pages in (old, mid, new):
        alloc.free_many(pages)
    alloc.free_many(cache.match([1] * PS + [0]))  # touching "old" makes "mid" the oldest
    assert cache.evict(1) == 1
    assert alloc.refcount(mid[0]) == 0 and alloc.refcount(new[0]) == 1
    assert cache.evict(1) == 1
    assert alloc.refcount(new[0]) == 0 and alloc.refcount(old[0]) == 1
    assert cache.match([2] * PS + [0]) == []


def test_evict_takes_the_tail_of_a_prefix_before_its_head():
    alloc = PageAllocator(32)
    cache = PrefixCache(alloc, PS)
    tokens = list(range(3 * PS + 1))
    pages = _prefill(alloc, cache, tokens)
    alloc.free_many(pages)
    assert cache.evict(1) == 1
    assert alloc.refcount(pages[2]) == 0
    assert cache.match(tokens) == pages[:2]  # the head is still usable


def test_referenced_pages_are_never_evicted():
    alloc = PageAllocator(32)
    cache = PrefixCache(alloc, PS)
    running = _prefill(alloc, cache, [5] * (2 * PS) + [0])      # still running: referenced
    done = _prefill(alloc, cache, [6] * PS + [0])
    alloc.free_many(done)
    assert cache.num_evictable == 1
    assert cache.evict(10) == 1
    assert alloc.refcount(done[0]) == 0
    assert [alloc.refcount(p) for p in running[:2]] == [2, 2]
    assert cache.evict(10) == 0
    assert cache.num_cached == 2


def test_max_cached_pages_evicts_lru_unreferenced_on_insert():
    alloc = PageAllocator(32)
    cache = PrefixCache(alloc, PS, max_cached_pages=2)
    first = _prefill(alloc, cache, [1] * (2 * PS) + [0])
    alloc.free_many(first)
    second = _prefill(alloc, cache, [2] * PS + [0])
    assert cache.num_cached == 2
    assert alloc.refcount(first[1]) == 0   # the tail of the older prefix made room
    assert cache.match([2] * PS + [0]) == second[:1]


def test_max_cached_pages_is_a_hard_bound_when_all_are_referenced():
    alloc = PageAllocator(32)
    cache = PrefixCache(alloc, PS, max_cached_pages=1)
    pages = _prefill(alloc, cache, list(range(3 * PS)))
    assert cache.num_cached == 1
    assert [alloc.refcount(p) for p in pages] == [2, 1, 1]


def test_clear_returns_every_page_once_sequences_finish():
    alloc = PageAllocator(16)
    cache = PrefixCache(alloc, PS)
    a = _prefill(alloc, cache, list(range(2 * PS + 1)))
    b_matched = cache.match(list(range(2 * PS)) + [42, 43])
    cache.clear()
    assert cache.num_cached == 0
    assert alloc.num_used == len(a)  # b's matched pages are a's: still referenced by both
    alloc.free_many(a)
    alloc.free_many(b_matched)
    assert alloc.num_free == alloc.num_total


def test_peek_counts_what_match_would_take_and_changes_nothing():
    """A data-parallel router asks every replica's cache how much of a prompt it holds: the answer
    must be match's, and asking must not take references, reorder eviction or count as a query."""
    from slipstream.engine.block_manager import BlockManager

    alloc = PageAllocator(16)
    cache = PrefixCache(alloc, PS)
    old = _prefill(alloc, cache, [7] * (2 * PS))             # cached first: evicted first
    new = _prefill(alloc, cache, list(range(3 * PS)))
    alloc.free_many(old + new)                                # only the cache holds them now
    refcounts = [alloc.refcount(p) for p in range(16)]
    counted = (cache.queries, cache.hits, cache.hit_tokens)
    prompt = list(range(3 * PS)) + [99]
    assert [cache.peek(prompt), cache.peek(prompt[:3 * PS]), cache.peek([7] * (2 * PS) + [1]),
            cache.peek([5] * 9), cache.peek([])] == [3, 2, 2, 0, 0]
    assert [alloc.refcount(p) for p in range(16)] == refcounts
    assert (cache.queries, cache.hits, cache.hit_tokens) == counted
    assert cache.evict(2) == 2                                # still the older chain's pages, not `new`'s
    assert cache.peek([7] * (2 * PS) + [1]) == 0 and cache.peek(prompt) == 3
    assert cache.peek(prompt) == len(cache.match(prompt))

    blocks = BlockManager(16, PS, enable_prefix_cache=True)
    assert blocks.cached_prefix_tokens(prompt) == 0
    assert BlockManager(16, PS, enable_prefix_cache=False).cached_prefix_tokens(prompt) == 0


def test_evict_pages_frees_the_chosen_pages_and_the_chain_below_them():
    """Targeted eviction (a run of page ids for a new sequence) must not leave cached pages that
    no match can reach: the pages chained below the chosen one go too; its siblings stay."""
    alloc = PageAllocator(32)
    cache = PrefixCache(alloc, PS)
    a, b, c, d = [1] * PS, [2] * PS, [3] * PS, [4] * PS
    abc = _prefill(alloc, cache, a + b + c + [0])
    ad = _prefill(alloc, cache, a + d + [0])
    assert ad[0] == abc[0]
    alloc.free_many(abc + ad)
    assert cache.evict_pages([abc[1]]) == 2                    # b, and c below it
    assert [alloc.refcount(p) for p in abc[:3]] == [1, 0, 0]
    assert cache.num_cached == 2 and cache.num_evictable == 2
    assert cache.match(a + b + c + [0]) == abc[:1]
    assert cache.match(a + d + [0]) == ad[:2]
    free = alloc.allocate(alloc.num_free)
    assert abc[1] in free and abc[2] in free and ad[1] not in free  # nothing both cached and free


def test_evict_pages_leaves_held_pages_below_it_to_their_sequence():
    alloc = PageAllocator(32)
    cache = PrefixCache(alloc, PS)
    a, b = [1] * PS, [2] * PS
    first = _prefill(alloc, cache, a + [0])
    second = alloc.allocate(3)                # computed `a` itself before `first` was cached
    cache.insert(a + b + [0], second)         # caches a+b -> second[1], under first[0]
    alloc.free_many(first)
    assert cache.evict_pages([first[0]]) == 1
    assert alloc.refcount(first[0]) == 0
    assert alloc.refcount(second[1]) == 1 and cache.num_cached == 0  # still second's, no longer cached
    alloc.free_many(second)
    assert alloc.num_free == alloc.num_total


def test_evict_pages_refuses_pages_in_use_or_not_cached():
    alloc = PageAllocator(32)
    cache = PrefixCache(alloc, PS)
    running = _prefill(alloc, cache, [5] * (2 * PS) + [0])
    with pytest.raises(ValueError, match="not an idle cached page"):
        cache.evict_pages([running[0]])       # a running sequence holds it
    with pytest.raises(ValueError, match="not an idle cached page"):
        cache.evict_pages([running[2]])       # the partial page is never cached
    assert cache.num_cached == 2 and [alloc.refcount(p) for p in running] == [2, 2, 1]


def test_evictable_last_use_orders_idle_pages_as_lru_eviction_does():
    alloc = PageAllocator(32)
    cache = PrefixCache(alloc, PS)
    pages = [_prefill(alloc, cache, [k] * (2 * PS) + [0]) for k in range(4)]
    alloc.free_many(pages[0] + pages[1] + pages[3])            # pages[2] still running
    alloc.free_many(cache.match([0] * (2 * PS) + [0]))         # touch chain 0
    last_use = cache.evictable_last_use()
    idle = [int(p) for p in np.argsort(last_use) if last_use[p] > 0]
    assert sorted(idle) == sorted(pages[0][:2] + pages[1][:2] + pages[3][:2])
    lru_order = []
    while cache.evict(1):
        lru_order.append(next(p for p in idle if alloc.refcount(p) == 0 and p not in lru_order))
    assert lru_order == idle


def test_page_digests_cover_the_images_whose_rows_they_hold():
    """A page holding an image's rows keys on the image: another image changes that page's digest and every later
    one (chained), the pages before the image keep theirs; image_rows cuts a chunk's image rows."""
    from slipstream.engine.api import image_rows
    from slipstream.engine.request import ImageInput

    tokens = list(range(40))
    a, b = (ImageInput(None, 10, 12, bytes([i]) * 16) for i in (1, 2))
    plain = chain_digests(tokens, 8)
    with_a, with_b = chain_digests(tokens, 8, images=[a]), chain_digests(tokens, 8, images=[b])
    assert with_a[0] == with_b[0] == plain[0]  # positions 0..7: before the image
    assert all(x != y and x != z for x, y, z in zip(with_a[1:], with_b[1:], plain[1:]))
    assert chain_digests(tokens, 8, images=[a]) == with_a
    rows = image_rows([a], 8, 16)  # positions 10..15 of the chunk 8..15: the image's rows 0..5
    assert [(r.at, r.first, r.count, r.last) for r in rows] == [(2, 0, 6, False)]
    rows = image_rows([a], 16, 24)  # the chunk 16..23: the image's rows 6..11, its last
    assert [(r.at, r.first, r.count, r.last) for r in rows] == [(0, 6, 6, True)]
    assert image_rows([a], 22, 30) == ()
