"""A draft model as speculative decoding's proposer (engine/speculative.py's Proposer): a second, smaller
JaxEngine with its own paged KV and slots on the same devices, which catches up on each drafting
sequence's new tokens and then decodes its K drafts greedily. Engine thread only."""
from __future__ import annotations

import dataclasses
import heapq

from slipstream.engine.api import SlotState, StepBatch, StepSeq
from slipstream.engine.kv_cache import PageAllocator, pages_needed
from slipstream.engine.request import SamplingParams
from slipstream.engine.sequence import Sequence, Status

_GREEDY = SamplingParams(temperature=0.0)


@dataclasses.dataclass
class _Draft:
    """One sequence in the draft engine: its slot, its pages, and the tokens whose K/V they hold."""

    slot: int
    pages: list[int]
    fed: list[int]  # from position 0: the sequence's tokens, then the drafts fed after them


@dataclasses.dataclass
class _Work:
    ask: int        # index into draft()'s asks
    state: _Draft
    tokens: list[int]
    k: int
    drafts: list[int]


class DraftModelProposer:
    """Drafts from `engine` (a JaxEngine over a model with the target's vocabulary). A sequence keeps
    its draft slot and pages while it runs: each call feeds only what it has not seen (the tokens
    accepted since, and the bonus token), after rolling back the drafts verification rejected."""

    def __init__(self, engine, vocab_size: int) -> None:
        if engine.vocab_size != vocab_size:
            raise ValueError(f"speculative config: the draft model's vocabulary ({engine.vocab_size} tokens) must be "
                             f"the target model's ({vocab_size}); pick a draft with the same tokenizer")
        self.engine = engine
        self.pages = PageAllocator(engine.num_pages)
        self.free_slots = list(range(engine.max_slots))
        self._states: dict[Sequence, _Draft] = {}
        for slot in self.free_slots:  # bound once: every draft slot decodes greedily
            engine.insert(slot, SlotState((), (), _GREEDY))

    @property
    def num_sequences(self) -> int:
        """Sequences holding a draft slot (and pages)."""
        return len(self._states)

    def draft(self, asks: list[tuple[Sequence, int]]) -> list[list[int]]:
        self._forget_finished()
        out: list[list[int]] = [[] for _ in asks]
        work = []
        for i, (seq, k) in enumerate(asks):
            tokens = seq.tokens
            k = min(k, self.engine.max_seq_len - len(tokens) + 1)  # the last draft is never fed
            state = self._states.get(seq) or self._bind(seq)
            if k < 1 or state is None:
                continue
            same = 0
            for a, b in zip(state.fed, tokens):
                if a != b:
                    break
                same += 1
            # rejected drafts go (their K/V is overwritten by what is fed next); the last token is
            # always fed again, as its logits give the first draft
            del state.fed[min(same, len(tokens) - 1):]
            if self._grow(state, len(tokens) + k - 1):
                work.append(_Work(i, state, tokens, k, out[i]))
        self._catch_up(work)
        while live := [w for w in work if len(w.drafts) < w.k]:
            self._run([(w, [w.drafts[-1]]) for w in live])
        return out

    def _catch_up(self, work: list[_Work]) -> None:
        """Feed each sequence's tokens the draft has not seen, in steps within the draft engine's token
        budget; the step that feeds a sequence's last token samples its first draft."""
        pending = list(work)
        while pending:
            left, batch = self.engine.max_num_batched_tokens, []
            for w in pending:
                n = min(len(w.tokens) - len(w.state.fed), left)
                if n == 0:
                    break
                start = len(w.state.fed)
                batch.append((w, w.tokens[start:start + n]))
                left -= n
            self._run(batch)
            pending = [w for w in pending if len(w.state.fed) < len(w.tokens)]

    def _run(self, batch: list[tuple[_Work, list[int]]]) -> None:
        """One draft step: each (work, tokens) feeds tokens after what its pages hold; a feed that
        reaches the end of the sequence's known tokens plus drafts samples the next draft."""
        seqs, sampled = [], []
        for w, tokens in batch:
            start = len(w.state.fed)
            w.state.fed.extend(tokens)
            sample = len(w.state.fed) == len(w.tokens) + len(w.drafts)
            seqs.append(StepSeq(w.state.slot, tuple(tokens), start, tuple(w.state.pages), sample))
            if sample:
                sampled.append(w)
        for w, s in zip(sampled, self.engine.step(StepBatch(seqs))):
            w.drafts.append(s.token_id)

    def _bind(self, seq: Sequence) -> _Draft | None:
        if not self.free_slots:
            return None
        state = self._states[seq] = _Draft(heapq.heappop(self.free_slots), [], [])
        return state

    def _grow(self, state: _Draft, num_tokens: int) -> bool:
        """Pages covering num_tokens positions; False when the draft's KV cache has no more (no draft)."""
        while len(state.pages) < pages_needed(num_tokens, self.engine.page_size):
            page = self.pages.allocate(1, after=state.pages[-1] if state.pages else None)
            if page is None:
                return False
            state.pages += page
        return True

    def _forget_finished(self) -> None:
        """Sequences that finished or were preempted give their draft slot and pages back."""
        for seq in [s for s in self._states if s.status is not Status.RUNNING]:
            state = self._states.pop(seq)
            self.pages.free_many(state.pages)
            heapq.heappush(self.free_slots, state.slot)
