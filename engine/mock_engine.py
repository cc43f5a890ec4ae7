"""An Engine with hand-computable outputs for scheduler and server tests: the next token is
always `(fed token + 1) % vocab_size`. It keeps a host copy of what each KV page holds and checks
every decode step against the slot's history, so page-table mistakes fail loudly."""
from __future__ import annotations

import threading
import time
from typing import Sequence

from engine.api import DecodeRow, PrefillChunk, Sampled, SlotState
from engine.request import SamplingParams, TokenLogprob


class MockEngineError(RuntimeError):
    """The scheduler broke the Engine contract, or a failure was injected."""


class MockEngine:
    """`fail_after_steps`: raise from `generate` once that many decode steps ran (failure
    injection); `step_sleep_s`: sleep per decode step, to make scheduling observable."""

    def __init__(self, max_slots: int = 4, page_size: int = 4, num_pages: int = 64,
                 max_seq_len: int = 128, vocab_size: int = 256,
                 eos_token_ids: frozenset[int] = frozenset(), max_prefill_chunk: int = 16, *,
                 fail_after_steps: int | None = None, step_sleep_s: float = 0.0) -> None:
        for name, value in (("max_slots", max_slots), ("page_size", page_size),
                            ("max_seq_len", max_seq_len), ("vocab_size", vocab_size),
                            ("max_prefill_chunk", max_prefill_chunk)):
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
        self.max_prefill_chunk = max_prefill_chunk
        self.fail_after_steps = fail_after_steps
        self.step_sleep_s = step_sleep_s
        self.kv: dict[tuple[int, int], int] = {}          # (page, offset) -> token written there
        # (decode steps before it, start_pos, num_tokens) per chunk: groups chunks by iteration
        self.prefill_log: list[tuple[int, int, int]] = []
        self.decode_batches: list[int] = []               # rows per decode step
        self._slots: dict[int, tuple[list[int], SamplingParams]] = {}  # slot -> (history, params)
        self._lock = threading.Lock()  # tests read the logs while the engine thread writes them

    @property
    def compile_count(self) -> int:
        return 0

    @property
    def prefilled_tokens(self) -> int:
        with self._lock:
            return sum(n for _, _, n in self.prefill_log)

    @property
    def occupied_slots(self) -> list[int]:
        with self._lock:
            return sorted(self._slots)

    def tokens_in(self, page_ids: Sequence[int], length: int) -> list[int | None]:
        """What positions [0, length) of a sequence with these pages hold (None: never written)."""
        with self._lock:
            return [self.kv.get(self._where(page_ids, pos)) for pos in range(length)]

    def prefill(self, chunk: PrefillChunk) -> None:
        n = len(chunk.token_ids)
        if not 0 < n <= self.max_prefill_chunk:
            raise MockEngineError(f"prefill chunk of {n} tokens; allowed: 1.."
                                  f"{self.max_prefill_chunk}")
        if chunk.start_pos + n > self.max_seq_len:
            raise MockEngineError(f"prefill up to position {chunk.start_pos + n} exceeds "
                                  f"max_seq_len={self.max_seq_len}")
        with self._lock:
            for i, token in enumerate(chunk.token_ids):
                self.kv[self._where(chunk.page_ids, chunk.start_pos + i)] = int(token)
            self.prefill_log.append((len(self.decode_batches), chunk.start_pos, n))

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

    def generate(self, rows: Sequence[DecodeRow]) -> list[Sampled]:
        if self.step_sleep_s:
            time.sleep(self.step_sleep_s)
        with self._lock:
            fail_at = self.fail_after_steps
            if fail_at is not None and len(self.decode_batches) >= fail_at:
                raise MockEngineError(f"injected failure after {fail_at} decode steps")
            if len({row.slot for row in rows}) != len(rows):
                raise MockEngineError(f"a slot appears twice in one decode step: {rows}")
            out = [self._decode_row(row) for row in rows]
            self.decode_batches.append(len(rows))
        return out

    def _decode_row(self, row: DecodeRow) -> Sampled:
        if row.slot not in self._slots:
            raise MockEngineError(f"decode on slot {row.slot}, which was never inserted")
        history, params = self._slots[row.slot]
        if row.position != len(history) - 1 or row.token_id != history[-1]:
            raise MockEngineError(
                f"slot {row.slot}: fed token {row.token_id} at position {row.position}, but its "
                f"history ends with {history[-1]} at position {len(history) - 1}")
        if row.position >= self.max_seq_len:
            raise MockEngineError(f"slot {row.slot}: position {row.position} >= max_seq_len")
        # Attention would read positions [0, position): they must hold this sequence's tokens.
        seen = [self.kv.get(self._where(row.page_ids, p)) for p in range(row.position)]
        if seen != history[:row.position]:
            bad = next(p for p in range(row.position) if seen[p] != history[p])
            raise MockEngineError(f"slot {row.slot}: KV position {bad} holds {seen[bad]}, "
                                  f"expected {history[bad]} (wrong pages for this sequence)")
        self.kv[self._where(row.page_ids, row.position)] = row.token_id
        token = (row.token_id + 1) % self.vocab_size
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
