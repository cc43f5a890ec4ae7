"""Static shape buckets: every step shape the engine may run, fixed at start-up. No JAX here."""
from __future__ import annotations

import dataclasses


class ShapeOutsideBuckets(ValueError):
    """A step asked for a shape that was not compiled at start-up (a bug in the caller)."""


def pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class Buckets:
    decode_batches: tuple[int, ...]   # 1, 2, 4, ... max_slots
    page_counts: tuple[int, ...]      # pages read per sequence: 1, 2, 4, ... max_pages_per_seq
    prefill_lengths: tuple[int, ...]  # chunk lengths
    page_size: int

    @classmethod
    def build(cls, *, max_slots: int, max_pages_per_seq: int, prefill_lengths: tuple[int, ...],
              page_size: int) -> "Buckets":
        def ladder(limit: int) -> tuple[int, ...]:
            steps = [1 << i for i in range(limit.bit_length()) if (1 << i) < limit]
            return tuple(steps + [limit])

        return cls(ladder(max_slots), ladder(max_pages_per_seq), tuple(sorted(prefill_lengths)), page_size)

    @staticmethod
    def _pick(options: tuple[int, ...], n: int, what: str) -> int:
        for option in options:
            if option >= n:
                return option
        raise ShapeOutsideBuckets(f"{what} {n} exceeds the largest compiled bucket {options[-1]}")

    def decode_batch(self, rows: int) -> int:
        return self._pick(self.decode_batches, rows, "decode batch")

    def pages(self, n: int) -> int:
        return self._pick(self.page_counts, n, "pages per sequence")

    def prefill_length(self, n: int) -> int:
        return self._pick(self.prefill_lengths, n, "prefill chunk length")

    def decode_shapes(self) -> list[tuple[int, int]]:
        return [(b, p) for b in self.decode_batches for p in self.page_counts]

    def prefill_shapes(self) -> list[tuple[int, int]]:
        # a chunk in bucket T holds more tokens than the bucket below, so it spans at least that many pages
        shapes = []
        for i, t in enumerate(self.prefill_lengths):
            smaller = self.prefill_lengths[i - 1] if i else 0
            min_pages = -(-(smaller + 1) // self.page_size)
            shapes += [(t, p) for p in self.page_counts if p >= min_pages]
        return shapes
