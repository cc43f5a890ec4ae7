"""Which KV pages each sequence holds: prefix-cache matching and allocation on admission, more pages
as a step's tokens cross page boundaries, registration of prefilled pages, release. Each sequence's
pages are placed as one run of page ids where the pool allows (PageAllocator's claims). Engine thread
only; plain Python (the page allocator and prefix cache do the counting)."""
from __future__ import annotations

import itertools

import numpy as np

from slipstream.engine.kv_cache import PageAllocator, pages_needed
from slipstream.engine.prefix_cache import PrefixCache, chain_digests
from slipstream.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_cache: bool, *, roles: bool = False) -> None:
        """roles: a token's role (prompt or generated) decides how its K/V is computed (the engine's prompt_w16):
        the prefix cache then holds and serves prompt positions only."""
        self.page_size = page_size
        self.roles = roles
        self.allocator = PageAllocator(num_pages)
        self.prefix = PrefixCache(self.allocator, page_size) if enable_prefix_cache else None
        # Each admission is an allocator owner: its pages are placed as one run where they can be.
        self._owners: dict[Sequence, int] = {}
        self._next_owner = itertools.count(1)

    def admit(self, seq: Sequence, reserve: int = 0) -> bool:
        """Give `seq` pages for all its tokens (reusing cached ones) and set where its prefill
        starts; False, holding nothing, unless `reserve` pages stay free afterwards."""
        tokens = seq.tokens
        salt = seq.request.cache_salt
        # its full pages' digests, computed once: the match reads them now, register() at the prefill's end
        digests = chain_digests(tokens, self.page_size, salt=salt, images=seq.request.images) if self.prefix else []
        matched = self.prefix.match(tokens, salt, digests) if self.prefix else []
        # At least the last known token is computed: its logits give the next token. With roles, only prompt
        # positions come from the cache (register() offers no others): a preempted sequence's recomputed output is
        # computed as generated tokens are (engine/api.StepBatch), whatever another request whose prompt held
        # those tokens cached.
        keep = (len(tokens) - 1) // self.page_size
        if self.roles:
            keep = min(keep, len(seq.request.prompt_ids) // self.page_size)
        if (wanted := seq.keep_computing_from) is not None:  # scores or hidden states: those positions are computed
            keep = min(keep, wanted // self.page_size)
        if len(matched) > keep:
            self.allocator.free_many(matched[keep:])
            matched = matched[:keep]
        need = pages_needed(len(tokens), self.page_size) - len(matched)
        owner = next(self._next_owner)
        fresh = self._allocate(need, reserve, want=self._pages_wanted(seq) - len(matched),
                               owner=owner, after=matched[-1] if matched else None, admitting=True)
        if fresh is None:
            self.allocator.free_many(matched)
            return False
        self._owners[seq] = owner
        seq.pages = matched + fresh
        seq.page_digests = digests
        seq.matched_pages = len(matched)
        seq.num_computed = len(matched) * self.page_size
        seq.prefill_end = len(tokens)
        return True

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Pages covering `num_tokens` positions of `seq`; False when none is left to take."""
        while len(seq.pages) < pages_needed(num_tokens, self.page_size):
            page = self._allocate(1, want=self._pages_wanted(seq) - len(seq.pages),
                                  owner=self._owners.get(seq, 0),
                                  after=seq.pages[-1] if seq.pages else None)
            if page is None:
                return False
            seq.pages += page
        return True

    def register(self, seq: Sequence) -> bool:
        """Offer the full pages `seq` has prefilled to later requests; True if there were any. With roles, those of
        its prompt only: a preempted sequence's recomputed output is not offered (a later request would read it as
        prompt tokens, which the hybrid weights compute in another form: a hit and a miss would differ)."""
        end = min(seq.prefill_end, len(seq.request.prompt_ids)) if self.roles else seq.prefill_end
        if self.prefix is None or end < self.page_size:
            return False
        self.prefix.insert(seq.token_slice(0, end), seq.pages, seq.request.cache_salt,
                           seq.page_digests[:end // self.page_size])
        return True

    def release(self, seq: Sequence) -> None:
        """Drop the sequence's references; cached pages stay with the cache until evicted."""
        self.allocator.free_many(seq.pages)
        self.allocator.release_claim(self._owners.pop(seq, 0))
        seq.pages, seq.page_digests = [], []

    def cached_prefix_tokens(self, tokens: list[int], salt: bytes = b"") -> int:
        """Prompt tokens admission would take from the prefix cache now (0 without one); changes
        nothing, and is safe from other threads (a data-parallel router's affinity hint)."""
        return self.prefix.peek(tokens, salt) * self.page_size if self.prefix is not None else 0

    @property
    def num_cached_idle(self) -> int:
        """Prefix-cache pages no sequence holds: evictable, counted apart from the pages in use."""
        return self.prefix.num_evictable if self.prefix is not None else 0

    def _pages_wanted(self, seq: Sequence) -> int:
        """Pages it holds at its last step: KV of the prompt and all but the last of max_tokens
        (never more than the pool, so a claim stays a hint)."""
        tokens = len(seq.request.prompt_ids) + seq.max_tokens - 1
        return min(pages_needed(tokens, self.page_size), self.allocator.num_total)

    def _allocate(self, n: int, reserve: int = 0, *, want: int = 0, owner: int = 0,
                  after: int | None = None, admitting: bool = False) -> list[int] | None:
        if admitting and self.prefix is not None and self.allocator.longest_open_run(owner) < want:
            self._evict_window(n + reserve, max(n, want), owner, after)
        shortfall = n + reserve - self.allocator.num_free
        if shortfall > 0 and self.prefix is not None:
            self.prefix.evict(shortfall)
        if self.allocator.num_free < n + reserve:
            return None
        return self.allocator.allocate(n, want=want, owner=owner, after=after)

    def _evict_window(self, needed: int, want: int, owner: int, after: int | None) -> None:
        """Once the prefix cache holds the rest of the pool, no `want` consecutive pages are free:
        evict exactly the cached pages of the window of `want` pages, each free or idle cached,
        that costs the cache least, so the new sequence's pages are one run (without, growth pages
        come one LRU page at a time from all over the pool; git show 7a65341:benchmarks/page_placement_bench.py).
        Nothing if there is no such window or the admission cannot get its `needed` free pages:
        the allocator then takes the longest runs, as before. After a prefix-cache hit ending at
        page `after`, the window from after + 1 wins ties, so that hit and new pages are one run."""
        last_use = self.prefix.evictable_last_use()
        if needed > self.allocator.num_free + np.count_nonzero(last_use):
            return
        start = cheapest_window(self.allocator.open_pages(owner), last_use, want,
                                self.prefix.follows_parent(), prefer=None if after is None else after + 1)
        if start is not None:
            self.prefix.evict_pages((np.flatnonzero(last_use[start:start + want]) + start).tolist())


def cheapest_window(open_: np.ndarray, last_use: np.ndarray, want: int, follows: np.ndarray,
                    prefer: int | None = None) -> int | None:
    """Start of the `want` consecutive page ids, each open (`open_`) or an evictable cached page
    (`last_use` > 0, its last use), that loses the fewest cached pages, then the least recently
    used (the oldest newest use), or `prefer` if it loses no more; None if there is none. Lost: the cached pages in the window and
    the run of pages after it chained to it (`follows`: cached, parent in the page before), which
    eviction drops with them. Fewest first: a free page that windows leave out stays free, and
    the cache holds less (git show 7a65341:benchmarks/page_placement_bench.py, f32 pool, shared heads: 310 idle
    cached pages and 6912 hit tokens when ranked by age first, 368 and 7552 so)."""
    evictable = last_use > 0
    num = len(last_use)
    if want < 1 or want > num:
        return None
    usable = np.concatenate(([0], np.cumsum(open_ | evictable)))
    starts = np.flatnonzero(usable[want:] - usable[:-want] == want)
    if not starts.size:
        return None
    cached = np.concatenate(([0], np.cumsum(evictable)))
    chained = np.append(follows, False)
    run_end = np.minimum.accumulate(np.where(chained, num, np.arange(num + 1))[::-1])[::-1]
    ends = starts + want
    lost = cached[ends] - cached[starts] + run_end[ends] - ends
    # the newest use matters only among the cheapest windows (ties: the lowest start)
    cheapest = starts[lost == lost.min()]
    if prefer is not None and np.any(cheapest == prefer):
        return int(prefer)
    return int(cheapest[np.argmin(window_max(last_use, want)[cheapest])])


def window_max(values: np.ndarray, width: int) -> np.ndarray:
    """max(values[i:i + width]) for each i in [0, len(values) - width]: by doubling spans, log2(width) passes
    over the pool instead of one row of `width` per window (a 2,500-page pool's admission spent 0.2 ms so)."""
    out, span = values, 1
    while 2 * span <= width:
        out = np.maximum(out[:-span], out[span:])  # out[i]: max of values[i:i + 2 * span]
        span *= 2
    if span < width:  # two overlapping spans cover the window
        out = np.maximum(out[:len(values) - width + 1], out[width - span:])
    return out
