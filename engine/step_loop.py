"""The engine thread's side of the Scheduler (engine/scheduler.py, which sets up the state it uses): each
iteration takes cancellations, admits and inserts, plans, launches, and collects the samples of the step in
flight. Plain Python: no JAX here.

One step stays in flight while the next is planned and launched, when the planner allows it: the
device then runs step N+1 while this thread collects step N's samples and hands them on (decodes
of step N+1 feed step N's samples on the device, as PREVIOUS_SAMPLE). Not for a step that may draft
(engine/speculative.py): drafting needs each sequence's latest tokens on the host; sequences whose drafts
missed rest, and steps where all rest overlap."""
from __future__ import annotations

import logging
import time

from slipstream.engine.api import SlotState
from slipstream.engine.output import Emit
from slipstream.engine.request import FinishReason
from slipstream.engine.scheduler_api import Lifecycle, StepEvent
from slipstream.engine.sequence import Sequence, Status
from slipstream.engine.step_plan import Chunk, Plan

log = logging.getLogger(__name__)


class StepLoop:
    """The Scheduler's engine-thread methods (its base class); _cv is held for host bookkeeping only, never
    across an engine call."""

    def _loop(self) -> None:
        try:
            while self._iteration():
                pass
        except Exception as exc:  # noqa: BLE001 - any engine error must reach every waiter
            if self._failed is not None:  # aborted: this failure follows from what abort() reported
                log.warning("engine thread stopped after the abort: %r", exc)
                return
            log.exception("engine thread failed")
            self._output.put(self._records)  # e.g. cancellations already taken off the books
            self._fail_all(f"engine failed: {exc!r}", failed=True)

    def _iteration(self) -> bool:
        records = self._records = []  # kept on self: a failure mid-step still delivers them
        planner = self._planner
        with self._cv:
            while not (planner.waiting or planner.running or self._drops or self._force_stop
                       or self._in_flight is not None or self._failed is not None
                       or (self._state is not Lifecycle.RUNNING and not self._live)):
                self._cv.wait()  # idle: no spinning, woken by submit/cancel/shutdown/abort
            if self._failed is not None:
                return False  # aborted: abort() failed the requests
            if self._force_stop:
                self._fail_all("scheduler shut down before the request finished", failed=False)
                return False
            if self._state is not Lifecycle.RUNNING and not self._live:
                return False  # closing and drained
            drops, self._drops = self._drops, {}
            for request_id, counted in drops.items():
                self._drop(request_id, counted, records)
        self._admit_and_insert(records)
        if self._in_flight is not None:
            # a length finish is known ahead: then a step that will wait for arrivals is not
            # launched ahead of it
            with self._cv:
                ahead = self._may_wait() and any(s.last_in_flight for s in self._in_flight[0].sampled)
                turn = ahead and self._arrival_wait.take_turn()
                # a step verifying drafts is collected first: only its accepted samples exist
                overlap = planner.can_overlap() and not turn and not any(c.draft for c in self._in_flight[0].chunks)
            if not overlap:  # collect first: what it finishes frees room, and what arrived goes next
                finished = self._collect(records)
                if finished and not ahead:  # a stop token, seen only now
                    with self._cv:
                        turn = self._may_wait() and self._arrival_wait.take_turn()
                if finished and turn:
                    self._await_arrivals(finished, records)
                self._admit_and_insert(records)
        with self._cv:
            may_overlap = planner.may_overlap()
        planner.propose(may_overlap)  # drafts, with no lock held (a draft model runs on the device)
        with self._cv:
            started, listeners = time.perf_counter(), self._step_listeners
            plan = planner.plan()
            event = StepEvent(started, time.perf_counter() - started, plan, len(planner.running),
                              tuple(s.request_id for s in planner.waiting)) if listeners else None
            self._unbind.extend(plan.freed_slots)
            planner.advance(plan)
        for listener in listeners:
            listener(event)
        self._totals.add(preemptions=len(plan.preempted), prefilled_tokens=plan.prefill_tokens)
        self._unbind_slots()
        launched = None
        if plan.chunks:
            batch = plan.batch()
            # whose scores, and whose pooled hidden states, the step returns
            scored = [c for c, s in zip(plan.chunks, batch.seqs) if s.targets]
            pooled = [(c, s.pool) for c, s in zip(plan.chunks, batch.seqs) if s.pool]
            launched = (plan, self._engine.launch(batch), scored, pooled)
        if self._in_flight is not None:  # step N's host work, while step N + 1 runs
            self._collect(records)
        self._in_flight = launched
        self._output.put(records)
        return True

    def _may_wait(self) -> bool:
        """Whether the next step may wait for arrivals (with _cv held): on, and nothing waits."""
        return self._arrival_wait.enabled and not self._planner.waiting

    def _await_arrivals(self, finished: int, records: list[Emit]) -> None:
        """The collected step ended `finished` requests: send their last tokens now, then give new
        requests a little time to join the next step (engine/arrival_wait.py)."""
        self._output.put(list(records))
        records.clear()
        self._arrival_wait.wait(self._cv, lambda: self._arrivals, finished,
                                lambda: bool(self._drops) or self._force_stop or self._failed is not None
                                or self._state is not Lifecycle.RUNNING)

    def _admit_and_insert(self, records: list[Emit]) -> None:
        with self._cv:
            admitted = self._admit(records)
        self._unbind_slots()
        failed = [(seq, error) for seq in admitted if (error := self._insert(seq)) is not None]
        if failed:
            with self._cv:
                for seq, error in failed:
                    self._retire(seq)
                    records.append(Emit(seq.order, finish_reason=FinishReason.ERROR, error=error))

    def _collect(self, records: list[Emit]) -> int:
        """Wait for the step in flight and apply its samples; returns how many requests it ended."""
        (plan, result, scored, pooled), self._in_flight = self._in_flight, None
        sampled = result.result()
        scores = result.scores() if scored else []
        sums = result.pooled() if pooled else []
        with self._cv:
            prompt_done = self._apply_scores(scored, scores)
            embedded = self._apply_pooled(pooled, sums)
            finished = self._apply(plan, sampled, records, prompt_done, embedded)
        self._unbind_slots()
        return finished

    def _drop(self, request_id: str, counted: bool, records: list[Emit]) -> None:
        seq = self._live.get(request_id)
        if seq is None:
            return
        self._retire(seq)
        records.append(Emit(seq.order, finish_reason=FinishReason.CANCELLED))
        if counted:
            self._totals.add(cancellations=1)

    def _admit(self, records: list[Emit]) -> list[Sequence]:
        admission = self._planner.admit()
        self._unbind.extend(admission.freed_slots)  # unbound before the admitted are inserted
        if admission.preempted:
            self._totals.add(preemptions=len(admission.preempted))
        for seq, error in admission.rejected:
            self._forget(seq)
            records.append(Emit(seq.order, finish_reason=FinishReason.ERROR, error=error))
        for seq in admission.admitted:
            if not seq.admitted_once:
                seq.admitted_once = True
                records.append(Emit(seq.order, admitted_at=time.monotonic(), cached_tokens=seq.num_computed))
        return admission.admitted

    def _insert(self, seq: Sequence) -> str | None:
        """Bind its sampling state to its slot; an error message if that failed. One request's
        bad settings must fail that request only, not the engine and everyone else."""
        state = SlotState(prompt_ids=tuple(seq.request.prompt_ids),
                          output_ids=tuple(seq.output_ids), params=seq.request.params,
                          lora_slot=seq.lora_slot, lora=seq.request.lora)
        try:
            self._engine.insert(seq.slot, state)
        except Exception:  # noqa: BLE001 - per-request failure; the cause goes to the log
            log.exception("request %s: engine.insert failed; failing this request only",
                          seq.request_id)
            return ("the engine could not apply this request's sampling settings; "
                    "the server log has the cause")
        seq.inserted = True
        return None

    def _apply_scores(self, scored: list[Chunk], scores: list) -> set[Sequence]:
        """The step's prompt scores, onto their sequences; those whose prompt they complete."""
        if len(scores) != len(scored):
            raise RuntimeError(f"engine returned scores for {len(scores)} chunks, {len(scored)} asked for them")
        done = set()
        for chunk, chunk_scores in zip(scored, scores):
            if chunk.seq.status is not Status.FINISHED and chunk.seq.add_scores(chunk.start, chunk_scores):
                done.add(chunk.seq)
        return done

    def _apply_pooled(self, pooled: list[tuple[Chunk, int]], sums: list) -> set[Sequence]:
        """The step's pooled hidden states, onto their sequences; those whose embedding they complete."""
        if len(sums) != len(pooled):
            raise RuntimeError(f"engine returned pooled states for {len(sums)} chunks, {len(pooled)} asked for them")
        done = set()
        for (chunk, rows), rows_sum in zip(pooled, sums):
            if chunk.seq.status is not Status.FINISHED and chunk.seq.add_pooled(chunk.known_end, rows, rows_sum):
                done.add(chunk.seq)
        return done

    def _apply(self, plan: Plan, sampled: list, records: list[Emit], prompt_done: set[Sequence],
               embedded: set[Sequence]) -> int:
        """The step ran: hand each sequence's kept samples on (and the prompt scores or the embedding it completed)
        and retire what they finished (returns how many)."""
        finished = kept = 0
        for seq, samples, finish in self._planner.complete(plan, sampled, self._engine.eos_token_ids,
                                                           self._engine.max_seq_len):
            kept += len(samples)
            want_logprobs = seq.request.params.logprobs is not None
            records.append(Emit(seq.order, tuple(s.token_id for s in samples),
                                tuple(s.logprob for s in samples) if want_logprobs else None,
                                finish_reason=finish, prompt_logprobs=self._prompt_logprobs(seq, prompt_done),
                                embedding=seq.embedding if seq in embedded else None))
            if finish is not None:
                self._retire(seq)
                finished += 1
        for seq in list(prompt_done):  # scored in a chunk before the one that samples
            records.append(Emit(seq.order, prompt_logprobs=self._prompt_logprobs(seq, prompt_done)))
        self._totals.add(generated_tokens=kept)
        return finished

    @staticmethod
    def _prompt_logprobs(seq: Sequence, prompt_done: set[Sequence]) -> tuple | None:
        """Its prompt's scores (OpenAI's: None for the first token) once, in the record of the step that
        completed them."""
        if seq not in prompt_done:
            return None
        prompt_done.discard(seq)
        return (None, *seq.prompt_scores)

    def _retire(self, seq: Sequence) -> None:
        """It leaves for good (with _cv held); its slot is unbound after the lock is let go."""
        slot = self._planner.finish(seq)
        if slot is not None:
            self._unbind.append(slot)
        self._forget(seq)

    def _forget(self, seq: Sequence) -> None:
        del self._live[seq.request_id]
        if not self._live:
            self._cv.notify_all()  # shutdown() waits for the drain

    def _unbind_slots(self) -> None:
        slots, self._unbind = self._unbind, []
        for slot in slots:
            self._engine.free(slot)

    def _fail_all(self, message: str, *, failed: bool) -> None:
        with self._cv:
            if failed and self._failed is None:  # the first failure is the cause
                self._failed = message
            seqs = list(self._live.values())
            self._live.clear()
            self._planner.waiting.clear()
            self._planner.running.clear()
            self._drops.clear()
            self._cv.notify_all()
        self._output.put([Emit(s.order, finish_reason=FinishReason.ERROR, error=message)
                          for s in seqs])
