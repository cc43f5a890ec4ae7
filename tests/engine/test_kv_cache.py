"""Page allocator, budget sizing and block tables: refcount invariants under random use."""
from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from slipstream.engine.kv_cache import (PageAllocator, kv_bytes_per_token, num_pages_for_budget,
                             pages_needed)


def test_allocator_rejects_too_few_pages():
    with pytest.raises(ValueError, match="at least 2"):
        PageAllocator(1)


def test_allocate_hands_out_every_usable_page_once_and_never_page_0():
    alloc = PageAllocator(5)
    assert (alloc.num_total, alloc.num_free, alloc.num_used) == (4, 4, 0)
    pages = alloc.allocate(4)
    assert sorted(pages) == [1, 2, 3, 4]
    assert [alloc.refcount(p) for p in pages] == [1, 1, 1, 1]
    assert (alloc.num_free, alloc.num_used) == (0, 4)


def test_exhaustion_returns_none_and_takes_nothing():
    alloc = PageAllocator(4)
    first = alloc.allocate(2)
    assert alloc.allocate(2) is None
    assert alloc.num_free == 1
    assert alloc.allocate(1) is not None
    assert alloc.allocate(1) is None
    alloc.free_many(first)
    assert alloc.num_free == 2


def test_freed_pages_are_handed_out_as_ascending_runs():
    """Pages come out as ascending runs, also after frees in any order (the kernel reads forward runs faster)."""
    alloc = PageAllocator(32)
    a, b = alloc.allocate(8), alloc.allocate(8)
    assert a == list(range(1, 9)) and b == list(range(9, 17))
    alloc.free_many(reversed(a))
    assert alloc.allocate(3) == [1, 2, 3]                  # the free run that fits best: 1..8, not 17..31
    alloc.free_many(b)
    assert alloc.allocate(10) == list(range(4, 14))        # 4..31 is one free run again


def test_allocate_zero_is_empty_and_negative_is_an_error():
    alloc = PageAllocator(3)
    assert alloc.allocate(0) == []
    with pytest.raises(ValueError):
        alloc.allocate(-1)


def test_shared_page_returns_to_free_only_after_last_reference():
    alloc = PageAllocator(3)
    [page] = alloc.allocate(1)
    alloc.incref(page)
    assert alloc.refcount(page) == 2
    assert alloc.decref(page) is False
    assert alloc.num_free == 1
    assert alloc.decref(page) is True
    assert alloc.num_free == 2
    assert alloc.refcount(page) == 0


def test_double_free_and_page_0_are_errors_and_leave_counts_alone():
    alloc = PageAllocator(3)
    [page] = alloc.allocate(1)
    alloc.decref(page)
    with pytest.raises(ValueError, match="double free"):
        alloc.decref(page)
    with pytest.raises(ValueError, match="allocate it first"):
        alloc.incref(page)
    with pytest.raises(ValueError, match="page 0"):
        alloc.decref(0)
    with pytest.raises(ValueError, match="page 0"):
        alloc.incref(0)
    with pytest.raises(ValueError, match="out of range"):
        alloc.decref(3)
    assert alloc.refcount(page) == 0
    assert alloc.num_free == 2


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate (plain and placed, with claims)/incref/decref against a model of who holds which page."""

    NUM_PAGES = 9

    def __init__(self) -> None:
        super().__init__()
        self.alloc = PageAllocator(self.NUM_PAGES)
        self.refs: list[int] = []  # one entry per reference the "sequences" hold

    @rule(n=st.integers(0, 10))
    def allocate(self, n):
        free_before = self.alloc.num_free
        pages = self.alloc.allocate(n)
        if n > free_before:
            assert pages is None
            assert self.alloc.num_free == free_before
            return
        assert pages is not None and len(pages) == n == len(set(pages))
        assert 0 not in pages
        assert not set(pages) & set(self.refs), "a page was handed out while still referenced"
        self.refs.extend(pages)

    @rule(n=st.integers(0, 4), want=st.integers(0, 8), owner=st.integers(1, 3), data=st.data())
    def allocate_placed(self, n, want, owner, data):
        """A sequence's pages: a run for all it will want, growth after its last page, claims."""
        after = data.draw(st.sampled_from([None, *self.refs]))
        free_before = self.alloc.num_free
        pages = self.alloc.allocate(n, want=want, owner=owner, after=after)
        if n > free_before:
            assert pages is None and self.alloc.num_free == free_before
            return
        assert pages is not None and len(pages) == n == len(set(pages)) and 0 not in pages
        assert not set(pages) & set(self.refs), "a page was handed out while still referenced"
        self.refs.extend(pages)

    @rule(owner=st.integers(1, 3))
    def release_claim(self, owner):
        self.alloc.release_claim(owner)

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def incref(self, data):
        page = data.draw(st.sampled_from(self.refs))
        self.alloc.incref(page)
        self.refs.append(page)

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def decref(self, data):
        i = data.draw(st.integers(0, len(self.refs) - 1))
        page = self.refs.pop(i)
        assert self.alloc.decref(page) == (page not in self.refs)

    @rule(page=st.integers(0, NUM_PAGES - 1))
    def decref_unheld_page_is_rejected(self, page):
        if page in self.refs:
            return
        with pytest.raises(ValueError):
            self.alloc.decref(page)

    @invariant()
    def refcounts_match_holders(self):
        for page in range(1, self.NUM_PAGES):
            assert self.alloc.refcount(page) == self.refs.count(page)
        assert self.alloc.num_used == len(set(self.refs))
        assert self.alloc.num_free + self.alloc.num_used == self.alloc.num_total

    @invariant()
    def free_pages_are_exactly_the_unreferenced_ones(self):
        probe = copy.deepcopy(self.alloc)  # claims stay as they are: none of them may hide a free page
        free = probe.allocate(probe.num_free)
        assert set(free) == set(range(1, self.NUM_PAGES)) - set(self.refs)

    @invariant()
    def runs_are_those_of_the_whole_pool(self):
        # the run search scans only the pages below the never-touched ones: the same runs as a whole scan
        for owner in range(4):
            open_ = np.concatenate(([False], self.alloc.open_pages(owner), [False]))
            edges = np.flatnonzero(open_[1:] != open_[:-1])
            starts, lengths = self.alloc._open_runs(owner)
            assert starts.tolist() == edges[::2].tolist() and lengths.tolist() == (edges[1::2] - edges[::2]).tolist()

    def teardown(self):
        self.alloc.free_many(self.refs)
        assert self.alloc.num_free == self.alloc.num_total
        assert all(self.alloc.refcount(p) == 0 for p in range(self.NUM_PAGES))


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


@pytest.mark.parametrize("tokens, size, pages", [(0, 16, 0), (1, 16, 1), (16, 16, 1),
                                                 (17, 16, 2), (33, 8, 5)])
def test_pages_needed_rounds_up(tokens, size, pages):
    assert pages_needed(tokens, size) == pages


def test_budget_sizing_for_smollm2_135m():
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64.
    # bf16: 2 (K,V) * 30 * 3 * 64 * 2 bytes = 23040 bytes per token; a 16-token page is
    # 368640 bytes; 1 GiB = 1073741824 bytes holds 2912 of them (2913 would be 1073848320).
    bf16 = kv_bytes_per_token(num_layers=30, n_kv_heads=3, head_dim=64, dtype_bytes=2)
    assert bf16 == 23040
    assert num_pages_for_budget(1 << 30, page_size=16, bytes_per_token=bf16) == 2912
    # int8 with f32 scales: 2 * 30 * 3 * (64 * 1 + 4) = 12240 bytes per token; 195840-byte
    # pages; 1 GiB holds 5482 (5483 would be 1073790720).
    int8 = kv_bytes_per_token(num_layers=30, n_kv_heads=3, head_dim=64, dtype_bytes=1,
                              scale_bytes=4)
    assert int8 == 12240
    assert num_pages_for_budget(1 << 30, page_size=16, bytes_per_token=int8) == 5482


def test_budget_too_small_names_budget_and_minimum():
    # 2 pages of 4 tokens * 100 bytes = 800 bytes minimum.
    assert num_pages_for_budget(800, page_size=4, bytes_per_token=100) == 2
    with pytest.raises(ValueError, match=r"799 bytes.*800 bytes"):
        num_pages_for_budget(799, page_size=4, bytes_per_token=100)
