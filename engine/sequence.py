"""Engine-side state of one request while the scheduler owns it: tokens, slot, pages, progress.
Touched only on the engine thread (after submit hands it over); no JAX, no output concerns."""
from __future__ import annotations

import dataclasses
import enum
from typing import Any

from slipstream.engine.api import PREVIOUS_SAMPLE
from slipstream.engine.request import FinishReason, Request, TokenLogprob


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)  # identity: the waiting list removes by `is`
class Sequence:
    """One request as the scheduler tracks it, across admissions and preemptions."""

    request: Request
    order: int                        # submit order: FCFS tie-break within a priority; the output side's key
    # Output tokens it may generate: params.max_tokens, or (None) the rest of the context as the
    # scheduler resolves it at submit.
    max_tokens: int = 0
    status: Status = Status.WAITING
    output_ids: list[int] = dataclasses.field(default_factory=list)
    # Samples of launched steps not collected yet: their positions count as tokens (a decode may
    # feed one as PREVIOUS_SAMPLE), their values are still on the device.
    in_flight: int = 0
    preempted: bool = False           # back in the queue after a preemption: goes first
    # Set on admission, cleared on preemption or finish.
    slot: int | None = None
    pages: list[int] = dataclasses.field(default_factory=list)
    admit_seq: int = -1               # admission order: the newest running one is preempted
    matched_pages: int = 0            # of `pages`, how many came from the prefix cache
    # the prefix cache's chained digests of its full pages at admission (tokens [0, prefill_end))
    page_digests: list[bytes] = dataclasses.field(default_factory=list)
    num_computed: int = 0             # tokens whose KV is in `pages` (prefix-cached or computed)
    prefill_end: int = 0              # tokens known at admission: computing them is its prefill
    inserted: bool = False            # bound to its slot with engine.insert
    lora_slot: int = 0                # its adapter's device slot while admitted (0: base model)
    admitted_once: bool = False
    # SamplingParams.prompt_logprobs: entry p is the model's log-probability of prompt token p + 1 (kept across
    # preemptions: a recomputed prompt is not scored again)
    prompt_scores: list[TokenLogprob] = dataclasses.field(default_factory=list)
    # SamplingParams.pooling: the sum of the pooled rows' hidden states so far (numpy f32[D]) and the prompt positions
    # it covers (kept across preemptions: a recomputed position is not pooled again)
    pool_sum: Any = None
    pooled_upto: int = 0

    def __post_init__(self) -> None:
        if not self.max_tokens:
            if self.request.params.max_tokens is None:
                raise ValueError("max_tokens=None (the rest of the context) needs max_tokens resolved at submit")
            self.max_tokens = self.request.params.max_tokens

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        """Known tokens plus the samples in flight."""
        return self.num_known + self.in_flight

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def num_known(self) -> int:
        return len(self.request.prompt_ids) + len(self.output_ids)

    @property
    def last_in_flight(self) -> bool:
        """Its sample in flight reaches max_tokens: no step may feed it (it ends the sequence)."""
        return self.in_flight > 0 and len(self.output_ids) + self.in_flight >= self.max_tokens

    @property
    def scored_upto(self) -> int | None:
        """The prompt positions scored so far while some are still to score (prompt_logprobs); None when
        nothing is (left) to score."""
        if self.request.params.prompt_logprobs is None or len(self.prompt_scores) >= self.prompt_len - 1:
            return None
        return len(self.prompt_scores)

    def score_targets(self, start: int, end: int) -> tuple[int, ...]:
        """The prompt tokens a chunk of positions [start, end) scores (the one after each position), while any
        are left to score; () otherwise."""
        if self.scored_upto is None:
            return ()
        prompt = self.request.prompt_ids
        return tuple(prompt[start + 1:min(end + 1, len(prompt))])

    def add_scores(self, start: int, scores: tuple[TokenLogprob, ...]) -> bool:
        """A chunk from position `start` came back with its scores; True when they complete the prompt's."""
        if start > len(self.prompt_scores):
            raise RuntimeError(f"{self.request_id}: scores from position {start} with {len(self.prompt_scores)} "
                               "known: a chunk was skipped")
        done = self.scored_upto is None
        self.prompt_scores[start:start + len(scores)] = scores
        return not done and self.scored_upto is None

    @property
    def keep_computing_from(self) -> int | None:
        """The first prompt position whose step output is still wanted (its score, or its hidden state for a mean):
        no cached page from it on is matched (a cache hit has no outputs). None when none is."""
        out = self.scored_upto
        if self.request.params.pooling == "mean" and self.pooled_upto < self.prompt_len:
            out = self.pooled_upto if out is None else min(out, self.pooled_upto)
        return out

    def pool_rows(self, start: int, end: int) -> int:
        """How many of the last rows of a chunk of positions [start, end) are pooled (SamplingParams.pooling): for a
        mean, those not pooled yet; for the last token, the chunk's last row where it is the prompt's."""
        mode = self.request.params.pooling
        if mode is None or self.pooled_upto >= self.prompt_len:
            return 0
        if mode == "last":
            return int(end == self.prompt_len)
        return max(0, min(end, self.prompt_len) - max(start, self.pooled_upto))

    def add_pooled(self, end: int, rows: int, rows_sum: Any) -> bool:
        """A chunk ending at position `end` came back with the sum of its last `rows` rows' hidden states; True
        when they complete the embedding."""
        if end - rows != (self.pooled_upto if self.request.params.pooling == "mean" else self.prompt_len - 1):
            raise RuntimeError(f"{self.request_id}: pooled rows {end - rows}..{end - 1} with {self.pooled_upto} "
                               "positions pooled: a chunk was skipped or pooled twice")
        self.pool_sum = rows_sum if self.pool_sum is None else self.pool_sum + rows_sum
        self.pooled_upto = self.prompt_len if self.request.params.pooling == "last" else end
        return self.pooled_upto >= self.prompt_len

    @property
    def embedding(self) -> Any:
        """Once pooled: the mean of the prompt's hidden states, or the last one's (numpy f32[D])."""
        if self.request.params.pooling == "mean":
            return self.pool_sum / self.prompt_len
        return self.pool_sum

    def add_sample(self, token_id: int, in_flight: bool = True) -> None:
        """The oldest sample in flight came back (in_flight=False: an accepted speculative token after
        it, from the same step)."""
        self.output_ids.append(token_id)
        self.in_flight -= in_flight

    @property
    def remaining(self) -> int:
        """Known tokens whose KV is not computed yet: 1 for a decode (its last sampled token)."""
        return self.num_tokens - self.num_computed

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.prefill_end

    @property
    def tokens(self) -> list[int]:
        """Prompt plus what was generated so far: what a (re-)admission has to recompute."""
        return [*self.request.prompt_ids, *self.output_ids]

    def token_slice(self, start: int, end: int) -> tuple[int, ...]:
        """tokens[start:end] without copying the whole history (a decode needs one token); a
        position whose sample is in flight reads PREVIOUS_SAMPLE."""
        known = self.num_known
        if end > known:
            return (*self.token_slice(start, known), *[PREVIOUS_SAMPLE] * (end - max(start, known)))
        prompt = self.request.prompt_ids
        if start >= len(prompt):
            return tuple(self.output_ids[start - len(prompt):end - len(prompt)])
        if end <= len(prompt):
            return tuple(prompt[start:end])
        return (*prompt[start:], *self.output_ids[:end - len(prompt)])

    def queue_key(self) -> tuple[int, int, int]:
        # By priority; within one, preempted sequences first: they already hold delivered tokens, and
        # letting new arrivals overtake them could starve them. (A sequence preempted for a more urgent
        # one must not go back before it.)
        return (self.request.priority, 0 if self.preempted else 1, self.order)

    def victim_key(self) -> tuple[int, int]:
        """Running sequences with the largest key are preempted first: the least urgent, the newest admitted."""
        return (self.request.priority, self.admit_seq)

    def first_page(self, page_size: int) -> tuple:
        """Its prefix-cache salt, the images in its first page and that page's tokens (() if none): what n > 1
        siblings share (under one LoRA adapter: KV is never shared across adapters)."""
        if self.num_tokens <= page_size:
            return ()
        prompt = self.request.prompt_ids
        images = tuple(image.digest for image in self.request.images if image.offset < page_size)
        return (self.request.cache_salt, *images, *(prompt[:page_size] if len(prompt) >= page_size
                                                    else self.tokens[:page_size]))

    def check_finish(self, token_id: int, eos_token_ids: frozenset[int],
                     max_seq_len: int) -> FinishReason | None:
        """Why generation ends after `token_id` was appended, or None to go on."""
        params = self.request.params
        if (not params.ignore_eos and token_id in eos_token_ids) \
                or token_id in params.stop_token_ids:
            return FinishReason.STOP
        if len(self.output_ids) >= self.max_tokens:
            return FinishReason.LENGTH
        if self.num_known >= max_seq_len:
            return FinishReason.LENGTH
        return None
