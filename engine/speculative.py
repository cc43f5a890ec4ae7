"""Speculative decoding's host side: the config (vLLM's --speculative-config form), which requests may
speculate, the n-gram (prompt lookup) proposer and greedy acceptance. Plain Python: no JAX here;
the planner (engine/schedule.py) drafts, the scheduler (engine/scheduler.py) accepts."""
from __future__ import annotations

import collections
import dataclasses
import json
import threading
from typing import Protocol, Sequence

from slipstream.engine.request import SamplingParams

METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16


class Proposer(Protocol):
    def propose(self, seq_tokens: Sequence[int], k: int) -> list[int]:
        """Up to k draft tokens to follow seq_tokens (prompt + output so far); [] for none."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # K: drafts verified per step and sequence
    prompt_lookup_max: int = 4       # longest suffix (n-gram) looked up
    prompt_lookup_min: int = 2       # shortest suffix looked up
    # Speculation is off for a step with this many decoding sequences or more: a large batch already
    # keeps the device busy (compute-bound), where extra query tokens cost more than they save.
    disable_by_batch_size: int = 8

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative config: method must be one of {', '.join(METHODS)}, got {self.method!r}")
        for name, low, high in (("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS),
                                ("prompt_lookup_max", 1, 64), ("prompt_lookup_min", 1, 64),
                                ("disable_by_batch_size", 1, 1 << 20)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(f"speculative config: {name} must be an integer in [{low}, {high}], got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative config: prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def from_json(cls, text: str) -> "SpeculativeConfig":
        """Parse vLLM's JSON form, e.g. {"method": "ngram", "num_speculative_tokens": 4,
        "prompt_lookup_max": 4, "prompt_lookup_min": 2}; unknown keys are refused by name."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative config is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"speculative config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"speculative config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        if "method" not in data:
            raise ValueError('speculative config: "method" is required (one of: ngram)')
        return cls(**data)

    def proposer(self) -> Proposer:
        return NgramProposer(self.prompt_lookup_min, self.prompt_lookup_max)


def may_speculate(params: SamplingParams) -> bool:
    """Requests this slice verifies: greedy without logprobs, a grammar, penalties or n > 1 (their
    sampling needs per-token state the verification rows do not carry)."""
    return (params.temperature == 0.0 and params.logprobs is None and params.constraint is None
            and params.repetition_penalty == 1.0 and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0 and params.n == 1)


class NgramProposer:
    """Prompt lookup: find the most recent earlier occurrence of the sequence's last n tokens (n from
    max down to min) and propose the tokens that followed it."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def propose(self, seq_tokens: Sequence[int], k: int) -> list[int]:
        tokens = list(seq_tokens)
        size = len(tokens)
        if k < 1:
            return []
        for n in range(min(self.ngram_max, size - 1), self.ngram_min - 1, -1):
            suffix = tokens[size - n:]
            # the occurrence must end before the suffix starts being itself: start < size - n
            for start in range(size - n - 1, -1, -1):
                if tokens[start] == suffix[0] and tokens[start:start + n] == suffix:
                    return tokens[start + n:start + n + k]
        return []


def accepted_length(drafts: Sequence[int], samples: Sequence[int]) -> int:
    """Greedy verification: how many drafts match the argmax at their position (samples[i] is the
    argmax after the sequence's token i of the verified chunk); samples[result] is the bonus token."""
    a = 0
    while a < len(drafts) and drafts[a] == samples[a]:
        a += 1
    return a


class SpecCounters:
    """What verification accepted, vLLM's metrics: drafts verified, drafts accepted, and accepted drafts
    by their position in the draft; written on the engine thread, read by stats() from any."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._drafts = self._accepted = 0
        self._per_pos: collections.Counter[str] = collections.Counter()

    def record(self, drafts: int, accepted: int) -> None:
        with self._lock:
            self._drafts += drafts
            self._accepted += accepted
            self._per_pos.update(str(i) for i in range(accepted))

    def snapshot(self) -> tuple[int, int, dict[str, int]]:
        with self._lock:
            return self._drafts, self._accepted, dict(self._per_pos)
