"""An Engine with hand-computable outputs for scheduler and server tests: a sampling sequence's next
token is always `(last fed token + 1) % vocab_size`, and a row's last hidden state (what embeddings pool) is
(its token, its position, 1.0). It keeps a host copy of what each KV page holds
and checks every step against the slot's history and those pages, so page-table mistakes fail
loudly. A launched step's samples are computed at once but handed out by result() only, in launch
order, after a modelled device time: steps queue on one device, `step_sleep_s` each."""
from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Sequence

import numpy as np

from slipstream.engine.api import PREVIOUS_SAMPLE, Sampled, SlotState, StepBatch, StepSeq
from slipstream.engine.request import SamplingParams, TokenLogprob


class MockEngineError(RuntimeError):
    """The scheduler broke the Engine contract, or a failure was injected."""


@dataclasses.dataclass(eq=False)
class _Binding:
    """What insert bound to a slot: the sequence's history (samples appended at launch)."""

    history: list[int]
    params: SamplingParams
    inserted_len: int    # positions below this came with insert; the rest are this engine's samples
    uncollected: int = 0  # samples launched whose result() was not called yet


class MockEngine:
    """`fail_after_steps`: raise from `launch` once that many steps ran (failure injection; 0 fails
    the next one); `step_sleep_s`: device time per step, to make scheduling observable."""

    def __init__(self, max_slots: int = 4, page_size: int = 4, num_pages: int = 64,
                 max_seq_len: int = 128, vocab_size: int = 256,
                 eos_token_ids: frozenset[int] = frozenset(), max_num_batched_tokens: int = 16, *,
                 fail_after_steps: int | None = None, step_sleep_s: float = 0.0, prompt_w16: bool = False) -> None:
        for name, value in (("max_slots", max_slots), ("page_size", page_size),
                            ("max_seq_len", max_seq_len), ("vocab_size", vocab_size),
                            ("max_num_batched_tokens", max_num_batched_tokens)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is padding), got {num_pages}")
        self.max_slots = max_slots
        self.page_size = page_size
        # as JaxEngine's: a token's role decides its weights, so the scheduler plans by the roles (engine/api.StepBatch)
        # and every step is checked against them
        self.prompt_w16 = prompt_w16
        self.num_pages = num_pages
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size
        self.model_cfg = None  # no model behind it: a text-only server (no image inputs)
        self.hidden_size = 3  # (token, position, 1.0) per row
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.fail_after_steps = fail_after_steps
        self.step_sleep_s = step_sleep_s
        self.kv: dict[tuple[int, int], int] = {}  # (page, offset) -> token written there
        # One entry per step: (slot, start_pos, n_tokens, sample) per sequence, in batch order.
        self.step_log: list[tuple[tuple[int, int, int, bool], ...]] = []
        # ("launch", step index) and ("collect", step index), in the order they happened
        self.events: list[tuple[str, int]] = []
        self._slots: dict[int, _Binding] = {}
        self._prompt_len: dict[int, int] = collections.defaultdict(int)  # by slot, as inserted
        self._lock = threading.Lock()  # tests read the logs while the engine thread writes them
        self._device_free_at = 0.0     # when the last launched step's modelled device time ends
        self._launched = 0             # steps launched (the logs may be bounded: not their length)
        self._collected = 0            # steps whose result() was called

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
            history = list(state.prompt_ids) + list(state.output_ids)
            self._slots[slot] = _Binding(history, state.params, len(history))
            self._prompt_len[slot] = len(state.prompt_ids)

    def free(self, slot: int) -> None:
        self._check_slot(slot)
        with self._lock:
            self._slots.pop(slot, None)

    def step(self, batch: StepBatch) -> list[Sampled]:
        return self.launch(batch).result()

    def launch(self, batch: StepBatch) -> "MockStep":
        with self._lock:
            fail_at = self.fail_after_steps
            if fail_at is not None and self._launched >= fail_at:
                raise MockEngineError(f"injected failure after {fail_at} steps")
            if not 0 < batch.num_tokens <= self.max_num_batched_tokens:
                raise MockEngineError(f"step of {batch.num_tokens} tokens; allowed: 1.."
                                      f"{self.max_num_batched_tokens}")
            slots = [s.slot for s in batch.seqs]
            if len(set(slots)) != len(slots):
                raise MockEngineError(f"a slot appears twice in one step: {slots}")
            try:  # each chunk all prompt or all generated tokens, the prompt ones last (the hybrid weights' rule)
                if self.prompt_w16:
                    batch.prompt_rows_from(self._prompt_len)
            except ValueError as e:
                raise MockEngineError(str(e)) from None
            seqs = [self._resolve(seq) for seq in batch.seqs]
            for seq in seqs:
                self._check_seq(seq)
            written: set[tuple[int, int]] = set()
            for seq in seqs:
                for i, token in enumerate(seq.token_ids):
                    where = self._where(seq.page_ids, seq.start_pos + i)
                    if where in written:
                        raise MockEngineError(f"two sequences write KV page {where[0]} offset "
                                              f"{where[1]} in one step")
                    written.add(where)
                    self.kv[where] = int(token)
            scores = [self._score(seq) for seq in seqs if seq.targets]
            pooled = [self._pool(seq) for seq in seqs if seq.pool]
            out = [self._sample(seq) for seq in seqs if seq.sample]
            bindings = [self._slots[seq.slot] for seq in seqs if seq.sample]
            for binding in bindings:
                binding.uncollected += 1
            index = self._launched
            self._launched += 1
            self.step_log.append(tuple((s.slot, s.start_pos, len(s.token_ids), s.sample)
                                       for s in batch.seqs))
            self.events.append(("launch", index))
            self._device_free_at = max(time.monotonic(), self._device_free_at) + self.step_sleep_s
            return MockStep(self, index, out, bindings, self._device_free_at, scores, pooled)

    def _collect(self, step: "MockStep") -> None:
        with self._lock:
            if step.index != self._collected:
                raise MockEngineError(f"result() of step {step.index} before step {self._collected}'s")
            self._collected += 1
            for binding in step.bindings:
                binding.uncollected -= 1
            self.events.append(("collect", step.index))

    def _resolve(self, seq: StepSeq) -> StepSeq:
        """The step with PREVIOUS_SAMPLE replaced by the slot's latest sample, as a device would."""
        if PREVIOUS_SAMPLE not in seq.token_ids:
            return seq
        binding = self._slots.get(seq.slot)
        if binding is None:
            raise MockEngineError(f"step on slot {seq.slot}, which was never inserted")
        if len(seq.token_ids) != 1 or seq.start_pos != len(binding.history) - 1 \
                or seq.start_pos < binding.inserted_len:
            raise MockEngineError(f"slot {seq.slot}: PREVIOUS_SAMPLE at {seq.start_pos} in a chunk of "
                                  f"{len(seq.token_ids)}; only a decode of the slot's latest sample "
                                  f"(position {len(binding.history) - 1}) may feed it")
        if binding.params.constraint is not None and binding.uncollected:
            raise MockEngineError(f"slot {seq.slot} is grammar-constrained: its latest sample must be "
                                  "collected before the step that feeds it")
        return dataclasses.replace(seq, token_ids=(binding.history[-1],))

    def _check_seq(self, seq: StepSeq) -> None:
        """The tokens are the slot's history at those positions, and its pages hold the rest."""
        if seq.slot not in self._slots:
            raise MockEngineError(f"step on slot {seq.slot}, which was never inserted")
        history = self._slots[seq.slot].history
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
        binding = self._slots[seq.slot]
        history, params = binding.history, binding.params
        token = (seq.token_ids[-1] + 1) % self.vocab_size
        history.append(token)
        logprob = None
        if params.logprobs is not None:
            top = tuple(((token + i) % self.vocab_size, -float(i)) for i in range(params.logprobs))
            logprob = TokenLogprob(token_id=token, logprob=0.0, top=top)
        return Sampled(token_id=token, logprob=logprob)

    def _score(self, seq: StepSeq) -> tuple[TokenLogprob, ...]:
        """The mock model's log-probabilities of the chunk's targets: certain of its own next token (x + 1), it
        gives a token t after x the log-probability -((t - x - 1) mod V), so its top k are x + 1 + i at -i."""
        binding = self._slots[seq.slot]
        history, k = binding.history, binding.params.prompt_logprobs or 0
        if list(seq.targets) != history[seq.start_pos + 1:seq.start_pos + 1 + len(seq.targets)]:
            raise MockEngineError(f"slot {seq.slot}: targets {list(seq.targets)} at {seq.start_pos} are not the "
                                  "tokens after the chunk's")
        v = self.vocab_size
        return tuple(TokenLogprob(t, -float((t - x - 1) % v), tuple(((x + 1 + i) % v, -float(i)) for i in range(k)))
                     for x, t in zip(seq.token_ids, seq.targets))

    def _pool(self, seq: StepSeq) -> np.ndarray:
        """The sum of the chunk's last `pool` rows' hidden states: (token, position, 1.0) each."""
        if not 0 < seq.pool <= len(seq.token_ids):
            raise MockEngineError(f"slot {seq.slot}: {seq.pool} pooled rows of a {len(seq.token_ids)}-token chunk")
        if self._slots[seq.slot].params.pooling is None:
            raise MockEngineError(f"slot {seq.slot}: pooled rows for a sequence that asked for no embedding")
        rows = range(len(seq.token_ids) - seq.pool, len(seq.token_ids))
        return np.array([[seq.token_ids[i], seq.start_pos + i, 1.0] for i in rows], np.float32).sum(axis=0)

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


class MockStep:
    """A launched MockEngine step: result() waits out its modelled device time, then hands out the
    samples (collect in launch order)."""

    def __init__(self, engine: MockEngine, index: int, samples: list[Sampled],
                 bindings: list[_Binding], done_at: float, scores: list[tuple[TokenLogprob, ...]],
                 pooled: list[np.ndarray] = ()) -> None:
        self.index, self.bindings = index, bindings
        self._engine, self._samples, self._done_at = engine, samples, done_at
        self._scores, self._pooled = scores, list(pooled)
        self._collected = False

    def result(self) -> list[Sampled]:
        if not self._collected:
            time.sleep(max(0.0, self._done_at - time.monotonic()))
            self._engine._collect(self)
            self._collected = True
        return self._samples

    def scores(self) -> list[tuple[TokenLogprob, ...]]:
        if not self._collected:
            raise MockEngineError(f"scores() of step {self.index} before its result()")
        return self._scores

    def pooled(self) -> list[np.ndarray]:
        if not self._collected:
            raise MockEngineError(f"pooled() of step {self.index} before its result()")
        return self._pooled
