"""Prefix cache: reuse the KV pages of full prompt pages already computed, keyed by chained hashes.
Plain Python + numpy; it only moves references between the cache and sequences, never KV data.

How the scheduler uses it (every call on the engine thread):
  1. Admission: `pages = cache.match(prompt)` (references for the request), then
     `allocator.allocate(rest)`; on None call `cache.evict(shortfall)` and retry once; if still
     None, `allocator.free_many(pages)` and leave the request waiting (or preempt).
     Prefill starts at `len(pages) * page_size`.
  2. After the prompt's prefill has written every page: `cache.insert(prompt, seq_pages)`.
  3. On finish, cancel or preempt: `allocator.free_many(seq_pages)`; cached pages survive
     with the cache's own reference until evicted.
"""
from __future__ import annotations

import collections
import hashlib
from typing import Any, Sequence

import numpy as np

from slipstream.engine.kv_cache import PageAllocator

_DIGEST_BYTES = 16


def chain_digests(token_ids: Sequence[int], page_size: int, max_pages: int | None = None,
                  salt: bytes = b"", images: Sequence[Any] = ()) -> list[bytes]:
    """Digest of each full page, chained so that page i's digest covers tokens [0, (i+1)*page_size)
    and `salt` (what else the KV depends on: the request's LoRA adapter; b"" for the base model).
    `images` (engine.request.ImageInput: offset, length, digest): a page holding an image's rows covers its digest
    too, since those rows' KV comes from the image and not from the placeholder tokens.

    blake2b over the parent digest and the page's int32 tokens: stable across processes,
    unlike Python's `hash`.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    num_pages = len(token_ids) // page_size
    if max_pages is not None:
        num_pages = min(num_pages, max_pages)
    tokens = np.asarray(token_ids[:num_pages * page_size], dtype=np.int32)
    digests: list[bytes] = []
    parent = salt
    for i in range(num_pages):
        h = hashlib.blake2b(parent, digest_size=_DIGEST_BYTES)
        h.update(tokens[i * page_size:(i + 1) * page_size].tobytes())
        for image in images:
            if image.offset < (i + 1) * page_size and image.offset + image.length > i * page_size:
                h.update(image.digest)
        parent = h.digest()
        digests.append(parent)
    return digests


class PrefixCache:
    """Maps chained page digests to KV pages, holding one allocator reference per cached page.

    Eviction frees least recently used pages that only the cache references. Within one
    sequence a page is touched after its successors, so the tail of a prefix goes before
    its head (a page whose parent was evicted can never be matched). `evict_pages` frees
    chosen pages instead (a run of page ids for a new sequence) and drops what hangs below
    them, which could never be matched again.
    """

    def __init__(self, allocator: PageAllocator, page_size: int,
                 max_cached_pages: int | None = None) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if max_cached_pages is not None and max_cached_pages < 0:
            raise ValueError(f"max_cached_pages must be >= 0 or None, got {max_cached_pages}")
        self._allocator = allocator
        self._page_size = page_size
        self._max_cached = max_cached_pages
        self._lru: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # oldest first
        self._digest_of: dict[int, bytes] = {}
        # Chain links of cached pages: a child's digest covers its parent's tokens. A parent
        # dropped by LRU eviction keeps its children's set, so re-inserting it reconnects them.
        self._parent: dict[bytes, bytes] = {}
        self._children: dict[bytes, set[bytes]] = {}
        self._last_use = np.zeros(allocator.num_total + 1, dtype=np.int64)  # per page; 0: not cached
        self._parent_page = np.zeros(allocator.num_total + 1, dtype=np.int64)  # 0: none cached
        self._tick = 0
        self._queries = 0
        self._hits = 0
        self._hit_tokens = 0

    def match(self, token_ids: Sequence[int], salt: bytes = b"", digests: Sequence[bytes] | None = None) -> list[int]:
        """Pages of the longest cached full-page prefix, one new reference each for the caller.

        At least one token is always left uncached-by-match: the last prompt token must be fed
        to the decode step that samples the first output token. `digests`: the caller's
        chain_digests(token_ids, page_size, salt=salt), if it has them (computed here otherwise).
        """
        self._queries += 1
        cap = max(len(token_ids) - 1, 0) // self._page_size
        pages: list[int] = []
        if digests is None:
            digests = chain_digests(token_ids, self._page_size, max_pages=cap, salt=salt)
        else:
            digests = self._given(digests, len(token_ids))[:cap]
        for digest in digests:
            page = self._lru.get(digest)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            self._allocator.incref(page)
        self._touch(digests[:len(pages)])
        if pages:
            self._hits += 1
            self._hit_tokens += len(pages) * self._page_size
        return pages

    def peek(self, token_ids: Sequence[int], salt: bytes = b"") -> int:
        """How many pages `match` would return now, without its side effects: no references, no
        LRU touch, no counted query. Only dict lookups, so another thread may call it while the
        engine thread changes the cache (the answer is then already stale, as any routing hint is)."""
        cap = max(len(token_ids) - 1, 0) // self._page_size
        n = 0
        for digest in chain_digests(token_ids, self._page_size, max_pages=cap, salt=salt):
            if digest not in self._lru:
                break
            n += 1
        return n

    def insert(self, token_ids: Sequence[int], page_ids: Sequence[int], salt: bytes = b"",
               digests: Sequence[bytes] | None = None) -> None:
        """Cache the full pages of a sequence whose KV is written; page_ids[i] holds page i.
        `digests`: chain_digests(token_ids, page_size, salt=salt), if the caller has them."""
        digests = chain_digests(token_ids, self._page_size, salt=salt) if digests is None \
            else self._given(digests, len(token_ids))
        if len(page_ids) < len(digests):
            raise ValueError(f"{len(token_ids)} tokens fill {len(digests)} pages of "
                             f"{self._page_size} but only {len(page_ids)} page ids were given")
        page_ids = list(page_ids[:len(digests)])
        if len(set(page_ids)) != len(page_ids):
            raise ValueError(f"page ids {page_ids} repeat a page; each holds a different page "
                             "of tokens")
        for digest, page in zip(digests, page_ids):
            cached_digest = self._digest_of.get(page)
            if cached_digest is not None and cached_digest != digest:
                raise ValueError(f"page {page} is cached with other tokens; a page written "
                                 "since it was matched or inserted must not be re-inserted")
        # Touch first so making room for this chain's new pages evicts other chains' pages first.
        self._touch([d for d in digests if d in self._lru])
        for i, (digest, page) in enumerate(zip(digests, page_ids)):
            if digest in self._lru:
                continue
            if not self._make_room():
                break  # full of referenced pages; the pages after this one would be unreachable
            self._allocator.incref(page)
            self._lru[digest] = page
            self._digest_of[page] = digest
            if i:
                self._parent[digest] = digests[i - 1]
                self._children.setdefault(digests[i - 1], set()).add(digest)
                self._parent_page[page] = self._lru.get(digests[i - 1], 0)  # 0: made room for this one
            for child in self._children.get(digest, ()):
                self._parent_page[self._lru[child]] = page
        self._touch([d for d in digests if d in self._lru])

    def evict(self, n: int) -> int:
        """Free up to `n` pages only the cache references, oldest first; how many were freed."""
        if n < 0:
            raise ValueError(f"cannot evict a negative number of pages ({n})")
        victims = []
        for digest, page in self._lru.items():
            if len(victims) == n:
                break
            if self._allocator.refcount(page) == 1:
                victims.append(digest)
        for digest in victims:
            self._drop(digest)
        return len(victims)

    def evict_pages(self, pages: Sequence[int]) -> int:
        """Free these cached pages, which only the cache references, and drop every cached page
        chained below them (no match can reach those any more; pages that sequences hold stay
        theirs). How many pages were freed."""
        doomed = []
        for page in pages:
            digest = self._digest_of.get(page)
            if digest is None or self._allocator.refcount(page) != 1:
                raise ValueError(f"page {page} is not an idle cached page (cached: "
                                 f"{digest is not None}, refcount {self._allocator.refcount(page)})")
            doomed.append(digest)
        freed = 0
        while doomed:
            digest = doomed.pop()
            doomed.extend(self._children.get(digest, ()))
            if digest in self._lru:
                freed += self._drop(digest)
        return freed

    def evictable_last_use(self) -> np.ndarray:
        """Per page id: when the cache last used it, where `evict_pages` may take it (cached,
        no sequence holds it); 0 elsewhere. Larger is more recent."""
        return np.where(self._allocator.refcounts == 1, self._last_use, 0)

    def follows_parent(self) -> np.ndarray:
        """Per page id: cached with its parent in the page before it (a prompt's pages in one run),
        so evicting the page before drops it too."""
        return self._parent_page == np.arange(len(self._parent_page)) - 1

    def clear(self) -> None:
        """Drop every cache reference; pages still used by sequences stay theirs."""
        pages = list(self._lru.values())
        self._lru.clear()
        self._digest_of.clear()
        self._parent.clear()
        self._children.clear()
        self._last_use[:] = 0
        self._parent_page[:] = 0
        self._allocator.free_many(pages)

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    @property
    def num_evictable(self) -> int:
        """Cached pages nobody else references: what `evict` could free right now."""
        return sum(1 for page in self._lru.values() if self._allocator.refcount(page) == 1)

    @property
    def queries(self) -> int:
        return self._queries

    @property
    def hits(self) -> int:
        """`match` calls that reused at least one page."""
        return self._hits

    @property
    def hit_tokens(self) -> int:
        return self._hit_tokens

    def _given(self, digests: Sequence[bytes], num_tokens: int) -> list[bytes]:
        """A caller's digests of `num_tokens` tokens: one per full page, no more, no fewer."""
        if len(digests) != num_tokens // self._page_size:
            raise ValueError(f"{num_tokens} tokens fill {num_tokens // self._page_size} pages of {self._page_size}, "
                             f"but {len(digests)} digests were given")
        return list(digests)

    def _touch(self, digests: Sequence[bytes]) -> None:
        # Deepest page first, so the head of the prefix ends most recently used.
        for digest in reversed(digests):
            self._lru.move_to_end(digest)
            self._tick += 1
            self._last_use[self._lru[digest]] = self._tick

    def _drop(self, digest: bytes) -> bool:
        """Remove one entry and the cache's reference to its page; True if that freed the page."""
        page = self._lru.pop(digest)
        del self._digest_of[page]
        self._last_use[page] = 0
        self._parent_page[page] = 0
        for child in self._children.get(digest, ()):
            self._parent_page[self._lru[child]] = 0
        parent = self._parent.pop(digest, None)
        if parent is not None:
            siblings = self._children[parent]
            siblings.discard(digest)
            if not siblings:
                del self._children[parent]
        return self._allocator.decref(page)

    def _make_room(self) -> bool:
        if self._max_cached is None:
            return True
        excess = len(self._lru) - self._max_cached + 1
        if excess > 0:
            self.evict(excess)
        return len(self._lru) < self._max_cached
