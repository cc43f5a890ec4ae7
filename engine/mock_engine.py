"""An Engine with hand-computable outputs for scheduler and server tests: a sampling sequence's next
token is always `(last fed token + 1) % vocab_size`. It keeps a host copy of what each KV page holds
and checks every step against the slot's history and those pages, so page-table mistakes fail
loudly."""
from __future__ import annotations

import threading
import time
from typing import Sequence

from engine.api import Sampled, SlotState, StepBatch, StepSeq
from engine.request import SamplingParams, TokenLogprob


class MockEngineError(RuntimeError):
    """The scheduler broke the Engine contract, or a failure was injected."""


class MockEngine:
    """`fail_after_steps`: raise from `step` once that many steps ran (failure injection; 0 fails
    the next one); `step_sleep_s`: sleep per step, to make scheduling observable."""

    def __init__(self, max_slots: int = 4, page_size: int = 4, num_pages: int = 64,
                 max_seq_len: int = 128, vocab_size: int = 256,
                 eos_token_ids: frozenset[int] = frozenset(), max_num_batched_tokens: int = 16, *,
                 fail_after_steps: int | None = None, step_sleep_s: float = 0.0) -> None:
        for name, value in (("max_slots", max_slots), ("page_size", page_size),
                            ("max_seq_len", max_seq_len), ("vocab_size", vocab_size),
                            ("max_num_batched_tokens", max_num_batched_tokens)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is padding), got {num_pages}")
        self.max_slots = max_slots
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.fail_after_steps = fail_after_steps
        self.step_sleep_s = step_sleep_s
        self.kv: dict[tuple[int, int], int] = {}  # (page, offset) -> token written there
        # One entry per step: (slot, start_pos, n_tokens, sample) per sequence, in batch order.
        self.step_log: list[tuple[tuple[int, int, int, bool], ...]] = []
        self._slots: dict[int, tuple[list[int], SamplingParams]] = {}  # slot -> (history, params)
        self._lock = threading.Lock()  # tests read the logs while the engine thread writes them

    @property
    def compile_count(self) -> int:
        return 0

    @property
    def steps(self) -> list[tuple[tuple[int, int, int, bool], ...]]:
        """A copy of the step log, safe to read while the engine thread runs."""
        with self._lock:
            return list(self.step_log)

    @property
    def tokens_fed(self) -> int:
        with self._lock:
            return sum(n for step in self.step_log for _, _, n, _ in step)

    @property
    def decode_batches(self) -> list[int]:
        """Decodes (one-token sampling sequences) per step, for the steps that had any."""
        with self._lock:
            counts = [sum(n == 1 and sample for _, _, n, sample in step) for step in self.step_log]
        return [c for c in counts if c]

    @property
    def occupied_slots(self) -> list[int]:
        with self._lock:
            return sorted(self._slots)

    def tokens_in(self, page_ids: Sequence[int], length: int) -> list[int | None]:
        """What positions [0, length) of a sequence with these pages hold (None: never written)."""
        with self._lock:
            return [self.kv.get(self._where(page_ids, pos)) for pos in range(length)]

    def insert(self, slot: int, state: SlotState) -> None:
        self._check_slot(slot)
        with self._lock:
            if slot in self._slots:
                raise MockEngineError(f"insert into occupied slot {slot}; free it first")
            self._slots[slot] = (list(state.prompt_ids) + list(state.output_ids), state.params)

    def free(self, slot: int) -> None:
        self._check_slot(slot)
        with self._lock:
            self._slots.pop(slot, None)

    def step(self, batch: StepBatch) -> list[Sampled]:
        if self.step_sleep_s:
            time.sleep(self.step_sleep_s)
        with self._lock:
            fail_at = self.fail_after_steps
            if fail_at is not None and len(self.step_log) >= fail_at:
                raise MockEngineError(f"injected failure after {fail_at} steps")
            if not 0 < batch.num_tokens <= self.max_num_batched_tokens:
                raise MockEngineError(f"step of {batch.num_tokens} tokens; allowed: 1.."
                                      f"{self.max_num_batched_tokens}")
            slots = [s.slot for s in batch.seqs]
            if len(set(slots)) != len(slots):
                raise MockEngineError(f"a slot appears twice in one step: {slots}")
            for seq in batch.seqs:
                self._check_seq(seq)
            written: set[tuple[int, int]] = set()
            for seq in batch.seqs:
                for i, token in enumerate(seq.token_ids):
                    where = self._where(seq.page_ids, seq.start_pos + i)
                    if where in written:
                        raise MockEngineError(f"two sequences write KV page {where[0]} offset "
                                              f"{where[1]} in one step")
                    written.add(where)
                    self.kv[where] = int(token)
            out = [self._sample(seq) for seq in batch.seqs if seq.sample]
            self.step_log.append(tuple((s.slot, s.start_pos, len(s.token_ids), s.sample)
                                       for s in batch.seqs))
        return out

    def _check_seq(self, seq: StepSeq) -> None:
        """The tokens are the slot's history at those positions, and its pages hold the rest."""
        if seq.slot not in self._slots:
            raise MockEngineError(f"step on slot {seq.slot}, which was never inserted")
        history, _ = self._slots[seq.slot]
        n, start, end = len(seq.token_ids), seq.start_pos, seq.end_pos
        if n == 0:
            raise MockEngineError(f"slot {seq.slot}: a sequence with no tokens")
        if end > self.max_seq_len:
            raise MockEngineError(f"slot {seq.slot}: up to position {end} exceeds "
                                  f"max_seq_len={self.max_seq_len}")
        if end > len(history) or list(seq.token_ids) != history[start:end]:
            raise MockEngineError(f"slot {seq.slot}: fed {list(seq.token_ids)} at {start}, but "
                                  f"its history there is {history[start:end]}")
        if seq.sample != (end == len(history)):
            raise MockEngineError(f"slot {seq.slot}: sample={seq.sample} for a chunk ending at "
                                  f"{end} of {len(history)} known tokens")
        # Attention reads positions [0, start): they must hold this sequence's tokens.
        seen = [self.kv.get(self._where(seq.page_ids, p)) for p in range(start)]
        if seen != history[:start]:
            bad = next(p for p in range(start) if seen[p] != history[p])
            raise MockEngineError(f"slot {seq.slot}: KV position {bad} holds {seen[bad]}, "
                                  f"expected {history[bad]} (wrong pages for this sequence)")
        self._where(seq.page_ids, end - 1)  # the pages cover the chunk

    def _sample(self, seq: StepSeq) -> Sampled:
        history, params = self._slots[seq.slot]
        token = (seq.token_ids[-1] + 1) % self.vocab_size
        history.append(token)
        logprob = None
        if params.logprobs is not None:
            top = tuple(((token + i) % self.vocab_size, -float(i)) for i in range(params.logprobs))
            logprob = TokenLogprob(token_id=token, logprob=0.0, top=top)
        return Sampled(token_id=token, logprob=logprob)

    def _where(self, page_ids: Sequence[int], pos: int) -> tuple[int, int]:
        index, offset = divmod(pos, self.page_size)
        if index >= len(page_ids):
            raise MockEngineError(f"position {pos} is past the {len(page_ids)} pages given")
        page = page_ids[index]
        if not 0 < page < self.num_pages:
            raise MockEngineError(f"page id {page} out of range [1, {self.num_pages})")
        return page, offset

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_slots:
            raise MockEngineError(f"slot {slot} out of range [0, {self.max_slots})")
