"""Speculative decoding's host side: the config (vLLM's --speculative-config form), the proposer seam
and the n-gram (prompt lookup) proposer, and the Speculator that picks which decodes draft, hands the
planner their drafts and accepts what verification kept. Plain Python: no JAX here (a draft model's
proposer lives in engine/device/draft.py and is passed in)."""
from __future__ import annotations

import collections
import dataclasses
import json
import threading
from typing import TYPE_CHECKING, Protocol, Sequence

from slipstream.engine.request import SamplingParams
from slipstream.engine.sequence import Status

if TYPE_CHECKING:
    from slipstream.engine.api import Sampled
    from slipstream.engine.sequence import Sequence as Seq

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
# A sequence whose drafting gains nothing rests 1, 2, 4 ... steps, at most this many, before it drafts
# again (Speculator.propose); a probe every MAX_REST steps finds where drafts start to hit again (a
# loop, a quote).
MAX_REST = 16
# An n-gram match whose earlier occurrence agrees with at least this many of the sequence's last tokens
# (the n-gram and the tokens before it) is a copy in progress: it drafts 2K + 1 tokens, not K
# (Speculator._ngram_drafts), unless its last verification rejected a draft (then K - 1).
LONG_MATCH = 12


class Proposer(Protocol):
    """The seam a proposer plugs into (n-gram here, a draft model in engine/device/draft.py; EAGLE/MTP
    later). Drafts are deterministic given the sequence's tokens: verification treats them as a
    proposal distribution with all its mass on the draft (engine/device/sampling.py)."""

    def draft(self, asks: list[tuple["Seq", int]]) -> list[list[int]]:
        """Up to k draft tokens for each (running sequence, k), to follow its known tokens (prompt +
        output, none in flight); [] for none. Called on the engine thread with no lock held; state kept
        for a sequence that is no longer running may be dropped."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # K: drafts verified per step and sequence
    prompt_lookup_max: int = 4       # longest suffix (n-gram) looked up
    prompt_lookup_min: int = 2       # shortest suffix looked up
    # Speculation is off for a step with this many decoding sequences or more: a large batch already
    # keeps the device busy (compute-bound), where extra query tokens cost more than they save.
    disable_by_batch_size: int = 8
    model: str | None = None         # draft_model: the draft's path or name (--model's forms)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative config: method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError('speculative config: "model" (the draft model) goes with method "draft_model", '
                             f"and only with it; got method {self.method!r} and model {self.model!r}")
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"speculative config: model must be a path or model name, got {self.model!r}")
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
        "prompt_lookup_max": 4, "prompt_lookup_min": 2} or {"model": "path", "num_speculative_tokens": 4}
        (method draft_model); unknown keys are refused by name."""
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
        if "method" not in data and "model" in data:
            data = {**data, "method": "draft_model"}  # as vLLM infers it
        if "method" not in data:
            raise ValueError('speculative config: "method" is required (one of: ngram, draft_model)')
        return cls(**data)



def may_speculate(params: SamplingParams) -> bool:
    """Requests that draft: all but grammar-constrained ones (a draft would need the grammar's mask at
    every verified position; they run without speculation). Greedy rows accept drafts equal to the
    argmax, drawn rows by speculative sampling's rule, penalties seeing the drafts before each row."""
    return params.constraint is None


class NgramProposer:
    """Prompt lookup: find the most recent earlier occurrence of the sequence's last n tokens (n from
    max down to min) and propose the tokens that followed it."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def draft(self, asks: list[tuple["Seq", int]]) -> list[list[int]]:
        return [self.propose(seq.tokens, k) for seq, k in asks]

    def propose(self, seq_tokens: Sequence[int], k: int) -> list[int]:
        return self.lookup(seq_tokens, k)[0]

    def lookup(self, seq_tokens: Sequence[int], k: int, after: int | None = None) -> tuple[list[int], int, int]:
        """propose()'s draft; how many of the sequence's last tokens its match agrees with (the n-gram
        and the agreeing tokens before it, counted up to LONG_MATCH; 0 without a match); and where the
        draft starts in seq_tokens (-1 without a match).

        `after`: where the sequence's last accepted draft ended in seq_tokens (the text it is copying
        reads on from there). Of the n-gram's occurrences, the first one from there on is taken (a
        copy that skips ahead, as a small model repeating a text with recurring phrases does, lands on
        the next occurrence of what it wrote, not the last one); with none, or without `after`, the
        most recent one."""
        tokens = list(seq_tokens)
        size = len(tokens)
        if k < 1:
            return [], 0, -1
        for n in range(min(self.ngram_max, size - 1), self.ngram_min - 1, -1):
            suffix = tokens[size - n:]
            recent = ahead = -1
            # the occurrence must end before the suffix starts being itself: start < size - n
            for start in range(size - n - 1, -1, -1):
                if tokens[start] == suffix[0] and tokens[start:start + n] == suffix:
                    if recent < 0:
                        recent = start
                    if after is None or start < after - n:
                        break
                    ahead = start
            start = ahead if ahead >= 0 else recent
            if start >= 0:
                agree = n
                while agree < LONG_MATCH and start + n - agree > 0 and \
                        tokens[start + n - agree - 1] == tokens[size - agree - 1]:
                    agree += 1
                return tokens[start + n:start + n + k], agree, start + n
        return [], 0, -1


def accepted_length(drafts: Sequence[int], samples: Sequence[int]) -> int:
    """How many drafts verification accepted: samples[i] is what the row after the chunk's token i
    sampled, the draft itself where the device accepted it (the argmax for greedy rows, speculative
    sampling's rule for drawn ones: engine/device/sampling.py); samples[result] is the token after them."""
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


class Speculator:
    """One scheduler's speculation: which decodes draft in the next step (proposed with no lock held,
    before the step is planned), their drafts for the planner, and what verification accepts."""

    def __init__(self, config: SpeculativeConfig, max_seq_len: int, proposer: Proposer | None = None,
                 token_buckets: Sequence[int] = ()) -> None:
        if proposer is None and config.method != "ngram":
            raise ValueError(f"speculative method {config.method!r} needs its proposer built from the draft model "
                             "(engine/device/draft.py's DraftModelProposer)")
        self.config, self.max_seq_len = config, max_seq_len
        self.proposer = proposer or NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        # The engine's step sizes (ascending token counts a step is padded up to; empty: unknown). A step
        # of n-gram drafts asks for more drafts where its bucket has padded rows left (fill_bucket).
        self.token_buckets = tuple(sorted(token_buckets))
        self.counters = SpecCounters()
        self._drafts: dict["Seq", tuple[int, ...]] = {}
        self._misses: dict["Seq", int] = {}  # drafting steps in a row that gained nothing (absent: 0)
        self._rest: dict["Seq", int] = {}    # steps left before the sequence drafts again (absent: 0)
        # n-gram drafting: where each sequence's drafts start in its tokens (proposed; taken, until verified),
        # where its last accepted draft ended (NgramProposer.lookup's `after`), and whether its last
        # verification kept every draft
        self._sources: dict["Seq", int] = {}
        self._verifying: dict["Seq", int] = {}
        self._copied_to: dict["Seq", int] = {}
        self._kept_all: dict["Seq", bool] = {}

    def active(self, running: Sequence["Seq"]) -> bool:
        """Whether the next step may draft for some running sequence (its tokens must be on the
        host, so the step in flight is collected before planning it): not when every sequence that
        may speculate rests."""
        return (len(running) < self.config.disable_by_batch_size
                and any(may_speculate(s.request.params) and not self._rest.get(s) for s in running))

    def propose(self, running: Sequence["Seq"], may_overlap: bool) -> None:
        """Draft for the next step's decodes: each one that may speculate, with all its tokens on the
        host and not resting, up to K tokens within max_tokens and the context; none when the batch
        is large. A resting decode counts one step of its rest instead.

        Drafting costs a step the overlap with the step in flight (its tokens must be on the host) and,
        when drafts are fed, their compute. So a sequence rests after a verification that accepted
        none, and, when its steps could overlap otherwise (`may_overlap`: the planner's conditions
        without speculation), after a step the proposer found no draft for; each miss in a row doubles
        the rest, an accepted draft ends the run of misses."""
        self._drafts, self._sources = {}, {}
        live = set(running)
        for per_seq in (self._misses, self._rest, self._verifying, self._copied_to, self._kept_all):
            for seq in [s for s in per_seq if s not in live]:
                del per_seq[seq]
        decodes = [s for s in running if s.remaining == 1 and not s.last_in_flight]
        if len(decodes) >= self.config.disable_by_batch_size:
            return
        asks = []
        for seq in decodes:
            if seq.status is not Status.RUNNING or not may_speculate(seq.request.params):
                continue
            if self._rest.get(seq):
                self._rest[seq] -= 1
                continue
            if seq.in_flight:
                continue
            k = min(self.config.num_speculative_tokens, self._room(seq))
            if k >= 1:
                asks.append((seq, k))
        if not asks:
            return
        if isinstance(self.proposer, NgramProposer):
            self._drafts = self._ngram_drafts(asks, len(running) if len(decodes) == len(running) else 0)
        else:
            self._drafts = {seq: tuple(d[:k]) for (seq, k), d in zip(asks, self.proposer.draft(asks)) if d}
        if may_overlap:
            for seq, _ in asks:
                if seq not in self._drafts:
                    self._missed(seq)

    def _room(self, seq: "Seq") -> int:
        """Drafts `seq` can take: within its max_tokens (the token after the drafts counts) and the context."""
        return min(seq.max_tokens - len(seq.output_ids) - 1, self.max_seq_len - seq.num_tokens)

    def _ngram_drafts(self, asks: list[tuple["Seq", int]], decodes: int) -> dict["Seq", tuple[int, ...]]:
        """Prompt lookup's drafts for the asks ((sequence, K) each), looked up as far as
        MAX_SPECULATIVE_TOKENS and the room (`_room`) allow, reading on from where the last accepted draft
        ended. A sequence whose last verification rejected a draft keeps K - 1 (its step, 1 + K - 1
        tokens, fills a smaller bucket: with K = 4, 4 rows instead of 8); else a match of LONG_MATCH tokens
        or more asks for twice the rows, 2K + 1 drafts (a copy in progress goes on for more than K
        tokens), a shorter one K. In a step of only `decodes` decoding sequences (0: a prompt also runs),
        the drafts then grow into the step's padded rows (fill_bucket)."""
        found = []
        for seq, k in asks:
            draft, agree, source = self.proposer.lookup(seq.tokens, min(MAX_SPECULATIVE_TOKENS, self._room(seq)),
                                                        self._copied_to.get(seq))
            if draft:
                if self._kept_all.get(seq) is False:
                    keep = max(1, k - 1)
                else:
                    keep = 2 * k + 1 if agree >= LONG_MATCH else k
                found.append((seq, draft, min(keep, len(draft))))
                self._sources[seq] = source
        if decodes:
            found = self.fill_bucket(found, decodes)
        return {seq: tuple(draft[:k]) for seq, draft, k in found}

    def fill_bucket(self, found: list[tuple["Seq", list[int], int]], tokens: int
                    ) -> list[tuple["Seq", list[int], int]]:
        """More n-gram drafts where they are free: a step of `tokens` decodes plus the drafts kept
        ((sequence, its looked-up draft, how many of it are kept) each) is padded up to the engine's next
        token bucket, and the padded rows cost what a draft's row does (1 + K = 5 query tokens run as 8).
        So each keeps more of its draft, round-robin, until the step fills its bucket. Only prompt lookup:
        a draft model pays a forward pass per draft."""
        total = tokens + sum(k for _, _, k in found)
        bucket = next((b for b in self.token_buckets if b >= total), None)
        if bucket is None:
            return found
        spare = bucket - total
        room = [len(draft) - k for _, draft, k in found]
        grown = [k for _, _, k in found]
        while spare > 0 and any(r > 0 for r in room):
            for i in range(len(found)):
                if spare > 0 and room[i] > 0:
                    grown[i] += 1
                    room[i] -= 1
                    spare -= 1
        return [(seq, draft, k) for (seq, draft, _), k in zip(found, grown)]

    def _missed(self, seq: "Seq") -> None:
        """Drafting gained nothing for `seq`: it rests twice as long as after its last miss."""
        misses = self._misses[seq] = self._misses.get(seq, 0) + 1
        self._rest[seq] = min(1 << (misses - 1), MAX_REST)

    def take(self, seq: "Seq", room: int) -> tuple[int, ...]:
        """The drafts proposed for `seq`, at most `room` (the planner's token budget and sample rows)."""
        draft = self._drafts.pop(seq, ())[:max(room, 0)]
        if draft and seq in self._sources:
            self._verifying[seq] = self._sources[seq]
        return draft

    def accept(self, chunk, samples: list["Sampled"]) -> list["Sampled"]:
        """Verification of a drafting chunk (engine/step_plan.py's Chunk): the samples it keeps (the accepted drafts, as sampled at
        their rows, and the token after them); the accepted drafts' KV counts as computed."""
        seq, draft = chunk.seq, chunk.draft
        accepted = accepted_length(draft, [s.token_id for s in samples])
        self.counters.record(len(draft), accepted)
        source = self._verifying.pop(seq, -1)
        if source >= 0:
            self._copied_to[seq] = source + accepted
            self._kept_all[seq] = accepted == len(draft)
        if accepted:
            self._misses.pop(seq, None)
        else:
            self._missed(seq)
        if seq.status is Status.RUNNING and seq.num_computed == chunk.known_end:
            # rejected drafts' KV stays in the pages past num_computed, overwritten by later steps
            seq.num_computed += accepted
        return samples[:accepted + 1]
