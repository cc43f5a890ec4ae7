"""Static shape buckets: every step shape the engine may run, fixed at start-up. No JAX here."""
from __future__ import annotations

import dataclasses


class ShapeOutsideBuckets(ValueError):
    """A step asked for a shape that was not compiled at start-up (a bug in the caller)."""


BOS_ROOM = 32  # rows past a power of two for its prompt's BOS and some decodes (see Buckets)


def pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class Buckets:
    """A step's flat token count is padded up a power-of-two ladder ending at the token budget. A budget
    of a power of two P plus room for decodes, more than BOS_ROOM of it, gets one more rung, P + BOS_ROOM,
    so a P-token prompt with its BOS and a few decodes is not padded to the budget (the accelerator
    default, 1024 + 128: a 1024-token prompt and its BOS took 1152 rows of matmuls, not 1056). Its
    sampled rows are padded to min(tokens, max_slots), so each token bucket has one sampling shape.
    Page tables are always [max_slots, max_pages_per_seq]: attention reads up to each sequence's
    length only, so context length needs no bucket."""

    token_counts: tuple[int, ...]     # 1, 2, 4, ... max_num_batched_tokens
    max_slots: int

    @classmethod
    def build(cls, *, max_num_batched_tokens: int, max_slots: int) -> "Buckets":
        if max_num_batched_tokens < 1 or max_slots < 1:
            raise ValueError("max_num_batched_tokens and max_slots must be >= 1")
        limit = max_num_batched_tokens
        steps = [1 << i for i in range(limit.bit_length()) if (1 << i) < limit]
        if steps and limit & (limit - 1) and limit - steps[-1] > BOS_ROOM:
            steps.append(steps[-1] + BOS_ROOM)
        return cls(tuple(steps + [limit]), max_slots)

    def tokens(self, n: int) -> int:
        for option in self.token_counts:
            if option >= n:
                return option
        raise ShapeOutsideBuckets(f"step of {n} tokens exceeds the largest compiled bucket "
                                  f"{self.token_counts[-1]} (max_num_batched_tokens)")

    def sample_rows(self, tokens: int) -> int:
        return min(tokens, self.max_slots)

    @property
    def sample_row_counts(self) -> tuple[int, ...]:
        return tuple(sorted({self.sample_rows(t) for t in self.token_counts}))
