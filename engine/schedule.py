"""The scheduling decision for one engine step, as plain host state in and a plain batch description
out: admission with prefix-cache matching, page growth with preemption, the token budget split
(every decode first, then prefill chunks, speculative drafts after their decode), whether the next
step may be launched before the in-flight step's samples are back, and what those samples add to their
sequences. No engine calls, no threads, no JAX; not thread-safe (the scheduler guards it with its lock;
propose() runs without it, on the engine thread)."""
from __future__ import annotations

import bisect
import heapq
import itertools

from slipstream.engine.api import Sampled
from slipstream.engine.block_manager import BlockManager
from slipstream.engine.kv_cache import pages_needed
from slipstream.engine.lora_registry import LoraSlotTable
from slipstream.engine.request import FinishReason
from slipstream.engine.sequence import Sequence, Status
from slipstream.engine.speculative import Proposer, SpeculativeConfig, Speculator
from slipstream.engine.step_plan import Admission, Chunk, Plan


class StepPlanner:
    """Waiting and running sequences, free slots and pages; decides what each step runs."""

    def __init__(self, blocks: BlockManager, *, max_slots: int, token_budget: int,
                 speculative: SpeculativeConfig | None = None, max_seq_len: int | None = None,
                 proposer: Proposer | None = None, max_loras: int = 0, token_buckets: tuple[int, ...] = (),
                 roles: bool = False) -> None:
        """roles: a token's role (prompt or generated) decides its weights (the engine's prompt_w16): no chunk
        crosses its prompt's end, chunks of prompt tokens come last, and no drafts follow a prompt token
        (engine/api.StepBatch)."""
        if token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        if speculative is not None and max_seq_len is None:
            raise ValueError("speculative decoding needs the engine's max_seq_len")
        self.blocks = blocks
        self.max_seq_len = max_seq_len
        self.speculator = (Speculator(speculative, max_seq_len, proposer, token_buckets)
                           if speculative is not None else None)
        self.token_budget = token_budget
        self.roles = roles
        self.waiting: list[Sequence] = []  # sorted by Sequence.queue_key
        self.running: list[Sequence] = []  # in admission order
        self.free_slots = list(range(max_slots))
        self.max_slots = max_slots
        self.lora = LoraSlotTable(max_loras)  # the engine's LoRA slots, by running sequences' adapters
        self._admits = itertools.count()
        self._epoch = 0                    # bumped whenever admission might newly succeed
        self._blocked_epoch = -1

    @property
    def page_size(self) -> int:
        return self.blocks.page_size

    def enqueue(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        bisect.insort(self.waiting, seq, key=Sequence.queue_key)
        self._epoch += 1

    def admit(self) -> Admission:
        """Move waiting sequences to running while slots and pages allow (priority, then FCFS). One more urgent
        than a running sequence preempts the least urgent (Sequence.victim_key) for its slot or pages."""
        admitted: list[Sequence] = []
        rejected: list[tuple[Sequence, str]] = []
        preempted: list[Sequence] = []
        freed: list[int] = []
        if not self.waiting or self.running and self._blocked_epoch == self._epoch:
            return Admission(admitted, rejected)  # none waits, or nothing changed since the head last waited
        # First pages of prompts whose new pages are still being prefilled: n > 1 siblings (or
        # requests sharing a system prompt) wait for them to reach the prefix cache instead of
        # computing them again.
        prefilling = {self._new_head(r) for r in self.running if r.prefilling}
        lora_blocked = False  # a request waits for a LoRA slot: no later one may take or hold one
        i = 0
        while i < len(self.waiting):
            seq = self.waiting[i]
            if seq.in_flight:  # preempted with a sample still in flight: once it is back
                i += 1
                continue
            # (a prompt to score or mean-pool is computed whole: it waits for no one's pages)
            head = (seq.first_page(self.page_size) if self.blocks.prefix is not None and seq.keep_computing_from is None
                    else ())
            if head and head in prefilling:
                i += 1
                continue
            if not self.free_slots and not self._preempt_for(seq, preempted, freed):
                break
            adapter = seq.request.lora
            if adapter is not None:
                if not self.lora.max_loras:
                    del self.waiting[i]
                    seq.status = Status.FINISHED
                    rejected.append((seq, f"LoRA adapter {adapter.name!r} asked of an engine without LoRA slots"))
                    continue
                # Every slot serves running requests: base-model requests may go first, but no later
                # adapter request, which would keep its slot busy (and this one waiting) forever.
                seq.lora_slot = 0 if lora_blocked else self.lora.acquire(adapter) or 0
                if not seq.lora_slot:
                    lora_blocked = True
                    i += 1
                    continue
            # One page of headroom per running sequence, so admitting does not immediately
            # force a preemption (and a wasted prefill) at the next page boundary.
            fits = self.blocks.admit(seq, reserve=len(self.running))
            while not fits and self._preempt_for(seq, preempted, freed):
                fits = self.blocks.admit(seq, reserve=len(self.running))
            if not fits:
                if seq.lora_slot:
                    self.lora.release(seq.lora_slot)
                    seq.lora_slot = 0
                if self.running:
                    self._blocked_epoch = self._epoch
                    break  # FCFS: later requests do not jump a head that waits for pages
                need = pages_needed(seq.num_tokens, self.page_size)
                del self.waiting[i]
                seq.status = Status.FINISHED
                rejected.append((seq, f"request needs {need} KV pages but only "
                                      f"{self.blocks.allocator.num_total} exist; raise the KV "
                                      "cache budget"))
                continue
            del self.waiting[i]
            seq.status = Status.RUNNING
            seq.slot = heapq.heappop(self.free_slots)
            seq.admit_seq = next(self._admits)
            self.running.append(seq)
            admitted.append(seq)
            prefilling.add(self._new_head(seq))
        return Admission(admitted, rejected, preempted, freed)

    def _preempt_for(self, seq: Sequence, preempted: list[Sequence], freed: list[int]) -> bool:
        """Preempt the least urgent running sequence if `seq` is more urgent (a lower priority value); whether
        it did. The victim waits behind `seq` (Sequence.queue_key)."""
        victim = max(self.running, key=Sequence.victim_key, default=None)
        if victim is None or victim.request.priority <= seq.request.priority:
            return False
        preempted.append(victim)
        slot = self.preempt(victim)
        if slot is not None:
            freed.append(slot)
        return True

    def plan(self) -> Plan:
        """This step's chunks within the token budget; grows pages, preempting the newest
        admitted sequences when they run out."""
        chunks: list[Chunk] = []
        preempted: list[Sequence] = []
        freed: list[int] = []
        used = 0  # tokens of `chunks` (kept as they change: summing them per decode is quadratic)

        def left() -> int:
            return self.token_budget - used

        def add(chunk: Chunk) -> None:
            nonlocal used
            chunks.append(chunk)
            used += chunk.length

        def grow(seq: Sequence, num_tokens: int) -> bool:
            nonlocal used
            while not self.blocks.grow(seq, num_tokens):
                victim = max(self.running, key=Sequence.victim_key)
                chunks[:] = [c for c in chunks if c.seq is not victim]
                used = sum(c.length for c in chunks)
                preempted.append(victim)
                slot = self.preempt(victim)
                if slot is not None:
                    freed.append(slot)
                if victim is seq:
                    return False
            return True

        # Decodes: one token left to feed (the last sampled one, maybe still in flight, or the last
        # token of a prompt whose other tokens were cached); one each, oldest first (they get pages
        # first). A sequence whose sample in flight is its last waits for it to end it.
        completes = False  # a prefill ends in this step
        decodes = [s for s in self.running if s.remaining == 1 and not s.last_in_flight]
        drafted = 0  # draft tokens so far: each is one more sampled row of the step
        for i, seq in enumerate(decodes):
            if left() == 0:
                break
            if seq.status is Status.RUNNING and grow(seq, seq.num_tokens):
                # every later decode keeps its one token; the step samples at most max_slots rows
                room = min(left() - 1 - (len(decodes) - i - 1), self.max_slots - len(self.running) - drafted)
                # with roles no drafts after a prompt token (the rest of its prompt was cached): a chunk is all
                # prompt or none (room 0 still takes the proposal, so none is left for a later position)
                if self.roles and seq.num_computed < seq.prompt_len:
                    room = 0
                draft = self._draft(seq, room)
                drafted += len(draft)
                add(Chunk(seq, seq.num_computed, 1 + len(draft), sample=True, draft=draft))
                completes |= seq.num_computed < seq.prefill_end
        # The oldest prompt always advances (no starvation); the rest go shortest-remaining first,
        # so a short request does not wait behind every long prompt admitted before it.
        pending = [s for s in self.running if s.remaining > 1]
        for seq in pending[:1] + sorted(pending[1:], key=lambda s: s.remaining):
            n = min(seq.remaining, left())
            if self.roles and seq.num_computed < seq.prompt_len:  # a recompute's chunk stops at its prompt's end
                n = min(n, seq.prompt_len - seq.num_computed)
            if n == 0:
                break
            if completes and n == seq.remaining and 2 * seq.prefill_end >= self.token_budget:
                # One long prefill ends per step: a second one keeps its last token for the next step.
                # Requests that end together come back together (a client's next request on each
                # finish), and two long prompts arriving in one step start a run of steps where every
                # arrival gets the budget's last few tokens and its first token a step late (a traced
                # closed loop at 32 concurrent, 256 in / 128 out: 25 of 96 second-wave requests).
                n -= 1
            if seq.status is Status.RUNNING and grow(seq, seq.num_computed + n):
                add(Chunk(seq, seq.num_computed, n, sample=n == seq.remaining))
                completes |= n == seq.remaining
        if self.roles:  # chunks of prompt tokens last (engine/api.StepBatch): the step's prompt rows are one range
            chunks = [c for c in chunks if not c.prompt] + [c for c in chunks if c.prompt]
        return Plan(chunks, preempted, freed)

    def propose(self, may_overlap: bool) -> None:
        """Draft for the next step's decodes (Speculator.propose; may_overlap: what may_overlap() said,
        read under the lock): with no lock held, as a draft model runs on the device; plan() takes the
        drafts."""
        if self.speculator is not None:
            self.speculator.propose(self.running, may_overlap)

    def _draft(self, seq: Sequence, room: int) -> tuple[int, ...]:
        """Drafts proposed for `seq`, at most `room`, within the pages it can get without preempting
        anyone."""
        draft = self.speculator.take(seq, room) if self.speculator is not None else ()
        if draft:
            self.blocks.grow(seq, seq.num_tokens + len(draft))  # may stop short: no preemption for drafts
            draft = draft[:len(seq.pages) * self.page_size - seq.num_tokens]
        return tuple(draft)

    def advance(self, plan: Plan) -> bool:
        """The step is launched: its tokens' KV is written before any later step reads it, and each
        sampling chunk has one sample in flight (a drafting chunk's KV counts once its drafts are
        accepted: complete()). Registers finished prefills with the prefix cache;
        True when that may let waiting siblings in."""
        registered = False
        for c in plan.chunks:
            seq = c.seq
            if seq.status is not Status.RUNNING:
                continue
            seq.num_computed = c.known_end
            if c.sample:
                seq.in_flight += 1
            if c.start < seq.prefill_end <= c.known_end and self.blocks.register(seq):
                registered = True
        if registered:
            self._epoch += 1
        return registered

    def complete(self, plan: Plan, sampled: list[Sampled], eos_token_ids: frozenset[int], max_seq_len: int
                 ) -> list[tuple[Sequence, list[Sampled], FinishReason | None]]:
        """The launched step's samples are back: append them to their sequences, each checked for a
        finish; per sequence still live, the samples it kept and why it finished (None: it goes on). A
        sequence that left while the step was in flight drops its samples, a preempted one keeps
        them; a drafting chunk keeps its accepted drafts and the token after them (Speculator.accept)."""
        chunks = [c for c in plan.chunks if c.sample]
        rows = sum(1 + len(c.draft) for c in chunks)
        if len(sampled) != rows:
            raise RuntimeError(f"engine returned {len(sampled)} samples for {len(chunks)} "
                               f"sampling sequences ({rows} rows)")
        out, at = [], 0
        for c in chunks:
            seq, samples = c.seq, sampled[at:at + 1 + len(c.draft)]
            at += len(samples)
            if c.draft:
                samples = self.speculator.accept(c, samples)
            if seq.status is Status.FINISHED:
                continue
            if seq.max_tokens == 0:  # the prompt only (its scores, its embedding): the sample is no output
                seq.in_flight -= 1
                out.append((seq, [], FinishReason.LENGTH))
                continue
            finish = None
            for i, s in enumerate(samples):
                seq.add_sample(s.token_id, in_flight=i == 0)
                finish = seq.check_finish(s.token_id, eos_token_ids, max_seq_len)
                if finish is not None:
                    samples = samples[:i + 1]
                    break
            out.append((seq, samples, finish))
        return out

    def can_overlap(self) -> bool:
        """Whether the next step may be planned and launched before the in-flight step's samples
        are back. Not when a sequence needs its latest token on the host (a grammar's next mask),
        nor when a request waits for the slot or pages a finishing one would free. A step planned
        ahead also leaves out requests that arrive meanwhile, one step later than without overlap:
        so only when every slot is taken (an arrival could not start anyway), or when one sequence
        runs alone (its steps are the shortest, and host time the largest share of them)."""
        if self.speculator is not None and self.speculator.active(self.running):
            # drafting reads the sequence's latest tokens on the host, and its verified step returns
            # several samples, of which only the accepted ones exist: no step is planned ahead of it
            return False
        return self.may_overlap()

    def may_overlap(self) -> bool:
        """can_overlap() without speculation: whether a step that drafts for no one may overlap."""
        if self.waiting or any(s.request.params.constraint is not None for s in self.running):
            return False
        return not self.free_slots or len(self.running) == 1

    def preempt(self, seq: Sequence) -> int | None:
        """Recompute later: drop slot and pages, keep the output, requeue at the front. Returns
        the engine slot to free, if it was bound."""
        slot = self.release(seq)
        seq.preempted = True
        self.enqueue(seq)
        return slot

    def finish(self, seq: Sequence) -> int | None:
        """It leaves (done, cancelled, failed), running or waiting; the engine slot to free."""
        slot = self.release(seq)
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
            self._epoch += 1  # it may have been the head that could not get pages
        seq.status = Status.FINISHED
        return slot

    def release(self, seq: Sequence) -> int | None:
        """Give back the slot and page references of a running sequence (no-op otherwise); the
        slot, if engine.insert had bound it."""
        if seq.status is not Status.RUNNING:
            return None
        slot = seq.slot if seq.inserted else None
        self.blocks.release(seq)
        if seq.lora_slot:
            self.lora.release(seq.lora_slot)
            seq.lora_slot = 0
        heapq.heappush(self.free_slots, seq.slot)
        self.running.remove(seq)
        seq.slot, seq.inserted, seq.num_computed = None, False, 0
        self._epoch += 1
        return slot

    def too_long(self, prompt: int, max_tokens: int) -> tuple[str, int, int] | None:
        """Why a request of `prompt` tokens and that output limit can never run (its tokens exceed the
        context or the KV cache): (message, limit, its tokens); None if it fits."""
        total = prompt + max_tokens
        for limit, what in ((self.max_seq_len, "the model's context"),
                            (self.blocks.allocator.num_total * self.page_size, "the KV cache's capacity")):
            if limit is not None and total > limit:
                return (f"prompt ({prompt} tokens) + max_tokens ({max_tokens}) = {total} exceeds {what} of "
                        f"{limit} tokens; shorten the prompt or lower max_tokens", limit, total)
        return None

    def stats(self) -> dict:
        """The SchedulerStats fields the planner knows: queues, slots, pages, prefix and speculation."""
        prefix = self.blocks.prefix
        spec = self.speculator
        drafts, accepted, per_pos = spec.counters.snapshot() if spec is not None else (0, 0, {})
        return dict(waiting=len(self.waiting), running=len(self.running),
                    slots_used=self.max_slots - len(self.free_slots), pages_used=self.pages_used,
                    pages_cached=self.pages_cached, pages_total=self.blocks.allocator.num_total,
                    prefix_queries=prefix.queries if prefix else 0, prefix_hits=prefix.hits if prefix else 0,
                    prefix_hit_tokens=prefix.hit_tokens if prefix else 0, spec_draft_tokens=drafts,
                    spec_accepted_tokens=accepted, spec_accepted_per_pos=per_pos)

    @property
    def pages_cached(self) -> int:
        return self.blocks.num_cached_idle

    @property
    def pages_used(self) -> int:
        """Pages held by running sequences (a cached page they hold counts here, not as cached)."""
        return self.blocks.allocator.num_used - self.blocks.num_cached_idle

    def _new_head(self, seq: Sequence) -> tuple[int, ...]:
        """Its first page if its prefill will add full pages to the prefix cache, else ()."""
        if self.blocks.prefix is None or seq.prefill_end // self.page_size <= seq.matched_pages:
            return ()
        return seq.first_page(self.page_size)
