"""Host-side KV page bookkeeping: a refcounted page allocator, budget sizing and block tables.
Plain Python + numpy; the device arrays live in the runner, never here."""
from __future__ import annotations

from typing import Iterable

import numpy as np

PAD_PAGE = 0  # reserved: padding entries of block tables point here, so it is never handed out


class PageAllocator:
    """Hands out KV pages 1..num_pages-1, counts references to each, and places each owner's
    pages as one ascending run of page ids where it can.

    A page is either free (refcount 0) or referenced (refcount >= 1); prefix sharing and the
    prefix cache add references, and the page is free again when the last one is dropped.

    Placement: the attention kernel reads a sequence's pages faster when they are consecutive
    ascending ids (a KV head's keys are then one forward run of memory; int8 KV ~1.6x, see
    git show 7a65341:benchmarks/page_placement_bench.py). An owner (a running sequence) that says how many pages it
    will hold in all gets its first pages at the start of a free run that long (best fit), and the
    rest of the run is claimed for it, so that its growth takes page last + 1. A claim is soft:
    other allocations avoid claimed pages, but take them rather than fail, so capacity is the
    same as without claims.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(
                f"num_pages={num_pages}: need at least 2 (page 0 is reserved for padding); "
                "raise the KV cache memory budget or lower the page size")
        self._num_pages = num_pages
        self._refcounts = np.zeros(num_pages, dtype=np.int32)
        self._free = np.ones(num_pages, dtype=bool)
        self._free[PAD_PAGE] = False
        self._num_free = num_pages - 1
        self._claim = np.zeros(num_pages, dtype=np.int64)  # owner id per free page, 0: unclaimed
        self._claims: dict[int, tuple[int, int]] = {}        # owner -> its claimed range [lo, hi)
        # Pages from here on were never taken nor claimed: one free, unclaimed run to the end of the pool,
        # so run searches scan only the pages below (a large pool's admission scanned all of it: 2.7 ms at
        # 196,608 pages, on the way to a request's first token).
        self._untouched = PAD_PAGE + 1

    def allocate(self, n: int, *, want: int | None = None, owner: int = 0,
                 after: int | None = None) -> list[int] | None:
        """`n` fresh pages at refcount 1, or None (nothing taken) if fewer than `n` are free.

        `owner` (> 0) will hold `want` pages from here in all (n now, the rest later through
        allocate(1, after=its last page)): the first `n` come from the start of a free run of
        `want` pages where there is one, and the rest of that run is claimed for it. `after`:
        continue from that page (take after + 1, ... when they are free and not claimed by
        another owner)."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if owner < 0:
            raise ValueError(f"owner ids are > 0 (0 means none), got {owner}")
        if n > self._num_free:
            return None
        if n == 0:
            return []
        want = max(n, want or n)
        # Growth continues its run; a new owner (after a prefix-cache hit) only where all it wants fits.
        new = not owner or owner not in self._claims
        if after is not None and self._mine(after + 1, after + 1 + (want if new else n), owner).all():
            pages = list(range(after + 1, after + 1 + n))
            if owner and new:
                self._claim_run(owner, after + 1 + n, after + 1 + want)
        else:
            pages = self._place(n, want, owner)
        taken = np.asarray(pages)
        self._untouched = max(self._untouched, int(taken.max()) + 1)
        self._free[taken] = False
        self._claim[taken] = 0
        self._refcounts[taken] = 1
        self._num_free -= n
        return pages

    def longest_open_run(self, owner: int = 0) -> int:
        """The most consecutive free pages not claimed by another owner than `owner`."""
        return int(self._open_runs(owner)[1].max(initial=0))

    def open_pages(self, owner: int = 0) -> np.ndarray:
        """Per page id: free and not claimed by another owner than `owner`."""
        return self._free & ((self._claim == 0) | (self._claim == owner))

    def release_claim(self, owner: int) -> None:
        """The owner left (finished or preempted): its claimed pages are anybody's again."""
        lo, hi = self._claims.pop(owner, (0, 0))
        part = self._claim[lo:hi]
        part[part == owner] = 0

    def incref(self, page: int) -> None:
        """Add a reference to a page that is already in use (sharing, never resurrecting)."""
        self._check_page(page)
        if self._refcounts[page] == 0:
            raise ValueError(f"incref of free page {page}: allocate it first")
        self._refcounts[page] += 1

    def decref(self, page: int) -> bool:
        """Drop one reference; True when that was the last one and the page is free again."""
        self._check_page(page)
        if self._refcounts[page] == 0:
            raise ValueError(f"decref of free page {page}: it was already released (double free)")
        self._refcounts[page] -= 1
        if self._refcounts[page] == 0:
            self._free[page] = True
            self._num_free += 1
            return True
        return False

    def free_many(self, pages: Iterable[int]) -> None:
        """Drop one reference to each page (a sequence releasing its block table)."""
        for page in pages:
            self.decref(page)

    def refcount(self, page: int) -> int:
        if not 0 <= page < self._num_pages:
            raise ValueError(f"page {page} out of range [0, {self._num_pages})")
        return int(self._refcounts[page])

    @property
    def refcounts(self) -> np.ndarray:
        """References per page id, read-only."""
        view = self._refcounts.view()
        view.flags.writeable = False
        return view

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_total - self._num_free

    @property
    def num_total(self) -> int:
        """Usable pages: all but the reserved padding page."""
        return self._num_pages - 1

    def _check_page(self, page: int) -> None:
        if page == PAD_PAGE:
            raise ValueError("page 0 is the reserved padding page; it is never allocated or shared")
        if not 0 < page < self._num_pages:
            raise ValueError(f"page {page} out of range [1, {self._num_pages})")

    def _mine(self, lo: int, hi: int, owner: int) -> np.ndarray:
        """Per page in [lo, hi) (cut at the end of the pool): free and unclaimed or `owner`'s."""
        if hi > self._num_pages:
            return np.zeros(1, dtype=bool)
        claim = self._claim[lo:hi]
        return self._free[lo:hi] & ((claim == 0) | (claim == owner))

    def _open_runs(self, owner: int) -> tuple[np.ndarray, np.ndarray]:
        """Start and length of each run of free pages not claimed by another owner, in page order."""
        hi = self._untouched
        claim = self._claim[:hi]
        open_ = self._free[:hi] & ((claim == 0) | (claim == owner))
        edges = np.flatnonzero(np.diff(open_.view(np.int8), prepend=0, append=0))
        starts, ends = edges[::2], edges[1::2]
        if hi < self._num_pages:  # the untouched pages: the last run goes on to the end of the pool
            if ends.size and ends[-1] == hi:
                ends = np.append(ends[:-1], self._num_pages)
            else:
                starts, ends = np.append(starts, hi), np.append(ends, self._num_pages)
        return starts, ends - starts

    def _claim_run(self, owner: int, lo: int, hi: int) -> None:
        """Claim for `owner` the pages from `lo` on, up to `hi`, while they are free and unclaimed."""
        hi = min(hi, self._num_pages)
        blocked = np.flatnonzero(~(self._free[lo:hi] & (self._claim[lo:hi] == 0)))
        hi = max(lo, lo + int(blocked[0]) if blocked.size else hi)
        self._claim[lo:hi] = owner
        self._untouched = max(self._untouched, hi)
        self._claims[owner] = (lo, hi)  # also when empty: the owner has been placed

    def _place(self, n: int, want: int, owner: int) -> list[int]:
        """Where `n` pages of an owner that will want `want` go, claiming the rest of their run."""
        if owner:
            self.release_claim(owner)  # a new run: pages claimed elsewhere are no use to it now
        starts, lengths = self._open_runs(0)
        fits = np.flatnonzero(lengths >= want)
        if fits.size:  # best fit: the shortest run that holds all of it keeps long runs long
            start = int(starts[fits[np.argmin(lengths[fits])]])
            if owner:
                self._claim_run(owner, start + n, start + want)
            return list(range(start, start + n))
        # No run holds all it will want: the longest runs first, the rest of the last one claimed.
        pages: list[int] = []
        for i in np.argsort(-lengths, kind="stable"):
            start, take = int(starts[i]), min(int(lengths[i]), n - len(pages))
            pages += range(start, start + take)
            if len(pages) == n:
                if owner:
                    self._claim_run(owner, start + take, start + int(lengths[i]))
                return pages
        # Only claimed pages are left: claims are soft, take them (the highest ids first).
        if owner:
            self._claims[owner] = (0, 0)
        claimed = np.flatnonzero(self._free & (self._claim != 0))
        return pages + [int(p) for p in claimed[::-1][:n - len(pages)]]


def pages_needed(num_tokens: int, page_size: int) -> int:
    """Pages that hold `num_tokens` tokens (the last one may be partly filled)."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return -(-num_tokens // page_size)


def kv_bytes_per_token(*, num_layers: int, n_kv_heads: int, head_dim: int, dtype_bytes: int,
                       scale_bytes: int = 0) -> int:
    """Bytes of K and V one token occupies over all layers.

    With int8 KV, `scale_bytes` is the size of the per-token-per-head scale (4 for f32),
    stored once per head for K and once for V.
    """
    for name, value in (("num_layers", num_layers), ("n_kv_heads", n_kv_heads),
                        ("head_dim", head_dim), ("dtype_bytes", dtype_bytes)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if scale_bytes < 0:
        raise ValueError(f"scale_bytes must be >= 0, got {scale_bytes}")
    return 2 * num_layers * n_kv_heads * (head_dim * dtype_bytes + scale_bytes)


def num_pages_for_budget(budget_bytes: int, *, page_size: int, bytes_per_token: int) -> int:
    """How many pages, reserved page 0 included, fit in `budget_bytes` of KV memory."""
    if page_size < 1 or bytes_per_token < 1:
        raise ValueError(f"page_size ({page_size}) and bytes_per_token ({bytes_per_token}) "
                         "must be >= 1")
    page_bytes = page_size * bytes_per_token
    num_pages = budget_bytes // page_bytes
    if num_pages < 2:
        raise ValueError(
            f"KV cache budget of {budget_bytes} bytes holds {max(num_pages, 0)} pages of "
            f"{page_bytes} bytes; at least {2 * page_bytes} bytes are needed (the padding page "
            "plus one usable page): raise --kv-cache-memory or lower the page size")
    return int(num_pages)
