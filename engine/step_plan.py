"""What the planner decides for one step, as plain data: the chunks it runs (Chunk, Plan, and the engine's
StepBatch built from them) and whom admission let in or turned away (Admission). No JAX."""
from __future__ import annotations

import dataclasses

from slipstream.engine.api import StepBatch, StepSeq, image_rows
from slipstream.engine.sequence import Sequence


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Tokens [start, start + length) of one sequence, fed in this step."""

    seq: Sequence
    start: int
    length: int
    sample: bool  # the chunk reaches the sequence's last known token
    # speculative drafts fed after a decode's one known token (length counts them): the step
    # samples at the known token and at every draft, and the scheduler accepts a prefix of them
    draft: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def prompt(self) -> bool:
        """Its (first) token is a prompt token; with roles no chunk crosses its prompt's end (StepPlanner.plan)."""
        return self.start < self.seq.prompt_len

    @property
    def known_end(self) -> int:
        """The end of its known tokens: drafts are computed but count only once accepted."""
        return self.end - len(self.draft)

    def step_seq(self) -> StepSeq:
        seq = self.seq
        return StepSeq(slot=seq.slot, token_ids=seq.token_slice(self.start, self.known_end) + self.draft,
                       start_pos=self.start, page_ids=tuple(seq.pages), sample=self.sample,
                       num_samples=1 + len(self.draft), lora_slot=seq.lora_slot,
                       targets=seq.score_targets(self.start, self.known_end),
                       pool=seq.pool_rows(self.start, self.known_end),
                       images=image_rows(seq.request.images, self.start, self.known_end) if seq.request.images else ())


@dataclasses.dataclass(frozen=True)
class Plan:
    """One step: decodes first (oldest admitted first), then prefill chunks; with roles (StepPlanner), chunks of
    prompt tokens after all others (a decode of a prompt's last token, the rest of it cached, among them)."""

    chunks: list[Chunk]
    preempted: list[Sequence]  # back in the waiting queue, their slots and pages released
    freed_slots: list[int]     # engine slots the preempted sequences were bound to

    def batch(self) -> StepBatch:
        return StepBatch(tuple(c.step_seq() for c in self.chunks))

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.chunks)

    @property
    def sampled(self) -> list[Sequence]:
        """The sequences that get one token each from the step, in batch order."""
        return [c.seq for c in self.chunks if c.sample]

    @property
    def prefill_tokens(self) -> int:
        """Tokens the step computes that were known at admission (prompt, or a preempted
        sequence's recompute), as opposed to decodes of freshly sampled tokens."""
        total = 0
        for c in self.chunks:  # a loop, not a sum over every decode's properties: this runs every step
            end = c.seq.prefill_end
            if c.start < end:
                total += min(c.known_end, end) - c.start
        return total


@dataclasses.dataclass(frozen=True)
class Admission:
    admitted: list[Sequence]            # now running, with a slot and pages; to insert
    rejected: list[tuple[Sequence, str]]  # can never fit in the KV cache: fail with this error
    preempted: list[Sequence] = dataclasses.field(default_factory=list)  # less urgent, for an admitted one
    freed_slots: list[int] = dataclasses.field(default_factory=list)     # engine slots they were bound to
