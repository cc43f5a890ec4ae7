"""Which KV pages each sequence holds: prefix-cache matching and allocation on admission, more pages
as a step's tokens cross page boundaries, registration of prefilled pages, release. Engine thread
only; plain Python (the page allocator and prefix cache do the counting)."""
from __future__ import annotations

from engine.kv_cache import PageAllocator, pages_needed
from engine.prefix_cache import PrefixCache
from engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_cache: bool) -> None:
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        self.prefix = PrefixCache(self.allocator, page_size) if enable_prefix_cache else None

    def admit(self, seq: Sequence, reserve: int = 0) -> bool:
        """Give `seq` pages for all its tokens (reusing cached ones) and set where its prefill
        starts; False, holding nothing, unless `reserve` pages stay free afterwards."""
        tokens = seq.tokens
        matched = self.prefix.match(tokens) if self.prefix else []
        # At least the last known token is computed: its logits give the next token.
        keep = (len(tokens) - 1) // self.page_size
        if len(matched) > keep:
            self.allocator.free_many(matched[keep:])
            matched = matched[:keep]
        need = pages_needed(len(tokens), self.page_size) - len(matched)
        fresh = self._allocate(need, reserve)
        if fresh is None:
            self.allocator.free_many(matched)
            return False
        seq.pages = matched + fresh
        seq.matched_pages = len(matched)
        seq.num_computed = len(matched) * self.page_size
        seq.prefill_end = len(tokens)
        return True

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Pages covering `num_tokens` positions of `seq`; False when none is left to take."""
        while len(seq.pages) < pages_needed(num_tokens, self.page_size):
            page = self._allocate(1)
            if page is None:
                return False
            seq.pages += page
        return True

    def register(self, seq: Sequence) -> bool:
        """Offer the full pages `seq` has prefilled to later requests; True if there were any."""
        if self.prefix is None or seq.prefill_end < self.page_size:
            return False
        self.prefix.insert(seq.token_slice(0, seq.prefill_end), seq.pages)
        return True

    def release(self, seq: Sequence) -> None:
        """Drop the sequence's references; cached pages stay with the cache until evicted."""
        self.allocator.free_many(seq.pages)
        seq.pages = []

    def cached_prefix_tokens(self, tokens: list[int]) -> int:
        """Prompt tokens admission would take from the prefix cache now (0 without one); changes
        nothing, and is safe from other threads (a data-parallel router's affinity hint)."""
        return self.prefix.peek(tokens) * self.page_size if self.prefix is not None else 0

    @property
    def num_cached_idle(self) -> int:
        """Prefix-cache pages no sequence holds: evictable, counted apart from the pages in use."""
        return self.prefix.num_evictable if self.prefix is not None else 0

    def _allocate(self, n: int, reserve: int = 0) -> list[int] | None:
        shortfall = n + reserve - self.allocator.num_free
        if shortfall > 0 and self.prefix is not None:
            self.prefix.evict(shortfall)
        if self.allocator.num_free < n + reserve:
            return None
        return self.allocator.allocate(n)
