"""Data parallel: one front end over M schedulers, each driving its own engine replica (its own
devices, KV cache and compiled programs). It presents the Scheduler's surface to the service, the
metrics and the app, and routes each request by load and prefix-cache affinity. No JAX here."""
from __future__ import annotations

import dataclasses
import functools
import threading
import time
from typing import Callable, Sequence

from slipstream.engine.output import RequestMetrics
from slipstream.engine.request_stream import Completion, RequestStream
from slipstream.engine.request import Request
from slipstream.engine.scheduler import Scheduler, SchedulerStats, generate_all


class ReplicaSet:
    """Routes each request to one replica: the one whose prefix cache holds the longest prefix of
    the prompt, unless it has more than `affinity_slack` requests (running + waiting) beyond the
    least loaded replica; then, and among equal prefixes, the least loaded; ties take turns.
    A replica whose engine failed gets no new requests and makes `ready` false (the server then
    drains and exits); the other replicas finish what they hold."""

    def __init__(self, schedulers: Sequence[Scheduler], *, affinity_slack: int = 4) -> None:
        if not schedulers:
            raise ValueError("a replica set needs at least one scheduler")
        if affinity_slack < 0:
            raise ValueError(f"affinity_slack must be >= 0, got {affinity_slack}")
        self.replicas: tuple[Scheduler, ...] = tuple(schedulers)
        self._slack = affinity_slack
        self._lock = threading.Lock()      # routing decisions and the request -> replica map
        self._owner: dict[str, int] = {}   # request id -> replica, until the request finishes
        self._turn = 0
        for i, scheduler in enumerate(self.replicas):
            scheduler.add_listener(functools.partial(self._finished, i))

    # ---- the Scheduler surface -----------------------------------------------------------------

    def start(self) -> None:
        for scheduler in self.replicas:
            scheduler.start()

    @property
    def ready(self) -> bool:
        return all(s.ready for s in self.replicas)

    @property
    def max_num_batched_tokens(self) -> int:
        return self.replicas[0].max_num_batched_tokens

    @property
    def max_queue(self) -> int:
        """Requests that may wait at once over all replicas (each refuses past its own queue)."""
        return sum(s.max_queue for s in self.replicas)

    def submit(self, request: Request) -> RequestStream:
        with self._lock:  # held across the submit: concurrent callers see each other's load
            if request.request_id in self._owner:
                raise ValueError(f"request id {request.request_id!r} is already in flight")
            i = self._route(request.prompt_ids)
            stream = self.replicas[i].submit(request)
            self._owner[request.request_id] = i
        return stream

    def cancel(self, request_id: str) -> None:
        with self._lock:
            i = self._owner.get(request_id)
        if i is not None:
            self.replicas[i].cancel(request_id)

    def stats(self) -> SchedulerStats:
        """All replicas together (counts summed)."""
        return _sum_stats(self.replica_stats())

    def replica_stats(self) -> list[SchedulerStats]:
        return [s.stats() for s in self.replicas]

    def abort(self, message: str) -> None:
        """Fail every replica's requests and stop serving, from any thread (Scheduler.abort)."""
        for scheduler in self.replicas:
            scheduler.abort(message)

    def add_listener(self, fn: Callable[[RequestMetrics], None]) -> None:
        for scheduler in self.replicas:
            scheduler.add_listener(fn)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Every replica drains at once, within the one deadline."""
        threads = [threading.Thread(target=s.shutdown, args=(timeout,), name=f"slipstream-drain-{i}")
                   for i, s in enumerate(self.replicas)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(1.0, deadline - time.monotonic()) + 5.0)

    def generate(self, requests: list[Request]) -> list[Completion]:
        """Blocking: submit all (waiting for room when the queues are full), return all results."""
        return generate_all(self.submit, requests)

    # ---- routing ---------------------------------------------------------------------------------

    def _route(self, prompt_ids: list[int]) -> int:
        live = [i for i, s in enumerate(self.replicas) if s.ready]
        if not live:
            # none accepts: the first one's submit raises its own reason (failed, closing, not started)
            return next(i for i, s in enumerate(self.replicas) if not s.ready)
        if len(live) == 1:
            return live[0]
        loads = {}
        for i in live:
            s = self.replicas[i].stats()
            loads[i] = s.running + s.waiting
        least = min(loads.values())
        near = [i for i in live if loads[i] <= least + self._slack]
        cached = {i: self.replicas[i].cached_prefix_tokens(prompt_ids) for i in near} if len(near) > 1 else {}
        turn, self._turn = self._turn, self._turn + 1
        n = len(self.replicas)
        return min(near, key=lambda i: (-cached.get(i, 0), loads[i], (i - turn) % n))

    def _finished(self, replica: int, metrics: RequestMetrics) -> None:
        with self._lock:
            if self._owner.get(metrics.request_id) == replica:
                del self._owner[metrics.request_id]


def _sum_stats(parts: list[SchedulerStats]) -> SchedulerStats:
    values = {}
    for field in dataclasses.fields(SchedulerStats):
        items = [getattr(s, field.name) for s in parts]
        if isinstance(items[0], dict):
            merged: dict[str, int] = {}
            for d in items:
                for k, v in d.items():
                    merged[k] = merged.get(k, 0) + v
            values[field.name] = merged
        else:
            values[field.name] = sum(items)
    return SchedulerStats(**values)
