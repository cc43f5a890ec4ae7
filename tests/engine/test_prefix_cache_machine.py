"""The prefix cache against a model, property-tested: sequences admitted, finished and evicted (LRU and
chosen pages) in random orders, with the pages each sequence holds and their contents checked after every
step. The hand-written cases are in test_prefix_cache.py."""
from __future__ import annotations

import collections

from hypothesis import settings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from slipstream.engine.kv_cache import PageAllocator, pages_needed
from slipstream.engine.prefix_cache import PrefixCache


class PrefixCacheMachine(RuleBasedStateMachine):
    """Sequences over a 2-token alphabet (so prefixes collide often) admitted the way the
    scheduler does it, against a model of which pages each sequence holds and what they contain."""

    NUM_PAGES = 11
    PAGE = 2

    @initialize(max_cached=st.none() | st.integers(0, 8))
    def setup(self, max_cached):
        self.alloc = PageAllocator(self.NUM_PAGES)
        self.cache = PrefixCache(self.alloc, self.PAGE, max_cached_pages=max_cached)
        self.max_cached = max_cached
        self.seqs: list[tuple[list[int], list[int]]] = []  # (tokens, pages) of running sequences
        self.content: dict[int, tuple[int, ...]] = {}      # page -> tokens [0, end of page)
        self.cached: set[int] = set()                       # pages the cache references
        self.queries = 0

    def held(self) -> collections.Counter:
        return collections.Counter(p for _, pages in self.seqs for p in pages)

    def sync(self, *, may_add: bool, may_drop_held: bool) -> None:
        """Derive the cache's pages from refcounts, checking each change is one it may make."""
        held = self.held()
        for page in range(1, self.NUM_PAGES):
            extra = self.alloc.refcount(page) - held[page]
            assert extra in (0, 1), f"page {page}: refcount {extra} beyond its holders"
            if extra == 1 and page not in self.cached:
                assert may_add, f"page {page} became cached outside insert"
                assert len(self.content[page]) % self.PAGE == 0, "a partial page was cached"
                self.cached.add(page)
            elif extra == 0 and page in self.cached:
                assert may_drop_held or held[page] == 0, f"referenced page {page} was evicted"
                self.cached.discard(page)
        assert self.cache.num_cached == len(self.cached)

    @precondition(lambda self: len(self.seqs) < 4)
    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=9))
    def admit(self, tokens):
        peeked = self.cache.peek(tokens)
        matched = self.cache.match(tokens)
        assert peeked == len(matched)
        self.queries += 1
        for i, page in enumerate(matched):
            assert self.content[page] == tuple(tokens[:(i + 1) * self.PAGE])
        cap = (len(tokens) - 1) // self.PAGE
        assert len(matched) <= cap
        if len(matched) < cap:
            nxt = tuple(tokens[:(len(matched) + 1) * self.PAGE])
            assert all(self.content[p] != nxt for p in self.cached), "match stopped short"
        need = pages_needed(len(tokens), self.PAGE) - len(matched)
        held_before = self.held()
        new = self.alloc.allocate(need)
        if new is None:
            shortfall = need - self.alloc.num_free
            freed = self.cache.evict(shortfall)
            assert freed <= shortfall
            self.seqs.append((tokens, matched))  # matched refs are held while we retry
            self.sync(may_add=False, may_drop_held=False)
            self.seqs.pop()
            new = self.alloc.allocate(need)
            assert (new is not None) == (freed == shortfall)
        if new is None:
            self.alloc.free_many(matched)
            self.sync(may_add=False, may_drop_held=False)
            return
        for page in new:
            assert held_before[page] == 0 and page not in self.cached, f"page {page} owned twice"
        pages = matched + new
        for i in range(len(matched), len(pages)):
            self.content[pages[i]] = tuple(tokens[:(i + 1) * self.PAGE])  # "prefill" writes KV
        self.seqs.append((tokens, pages))
        self.sync(may_add=False, may_drop_held=False)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def insert(self, data):
        tokens, pages = data.draw(st.sampled_from(self.seqs))
        before = set(self.cached)
        self.cache.insert(tokens, pages)
        self.sync(may_add=True, may_drop_held=False)
        for page in self.cached - before:
            assert page in pages[:len(tokens) // self.PAGE]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish(self, data):
        i = data.draw(st.integers(0, len(self.seqs) - 1))
        _, pages = self.seqs.pop(i)
        self.alloc.free_many(pages)
        self.sync(may_add=False, may_drop_held=False)

    @rule(n=st.integers(0, 12))
    def evict(self, n):
        held = self.held()
        evictable = sum(1 for p in self.cached if held[p] == 0)
        assert self.cache.num_evictable == evictable
        assert self.cache.evict(n) == min(n, evictable)
        self.sync(may_add=False, may_drop_held=False)

    @precondition(lambda self: any(self.held()[p] == 0 for p in self.cached))
    @rule(data=st.data())
    def evict_pages(self, data):
        held = self.held()
        page = data.draw(st.sampled_from(sorted(p for p in self.cached if held[p] == 0)))
        heads = {self.content[p] for p in self.cached}
        head = self.content[page]

        def below(q):  # chained below `page` through cached pages only: what no match can reach
            tokens = self.content[q]
            return tokens[:len(head)] == head and all(
                tokens[:k] in heads for k in range(len(head), len(tokens), self.PAGE))
        before = set(self.cached)
        dropped = {q for q in before if below(q)}
        freed = self.cache.evict_pages([page])
        assert freed == sum(1 for q in dropped if held[q] == 0)
        self.sync(may_add=False, may_drop_held=True)   # held pages below it stay their sequences'
        assert self.cached == before - dropped

    @rule()
    def clear(self):
        self.cache.clear()
        self.sync(may_add=False, may_drop_held=True)
        assert not self.cached

    @invariant()
    def bounded_and_counted(self):
        if self.max_cached is not None:
            assert self.cache.num_cached <= self.max_cached
        assert self.cache.queries == self.queries

    @invariant()
    def free_pages_are_exactly_the_unreferenced_ones(self):
        referenced = set(self.held()) | self.cached
        free = self.alloc.allocate(self.alloc.num_free)
        assert 0 not in free
        assert set(free) == set(range(1, self.NUM_PAGES)) - referenced
        self.alloc.free_many(free)

    def teardown(self):
        for _, pages in self.seqs:
            self.alloc.free_many(pages)
        self.cache.clear()
        assert self.alloc.num_free == self.alloc.num_total
        assert all(self.alloc.refcount(p) == 0 for p in range(self.NUM_PAGES))


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)
