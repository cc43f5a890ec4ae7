"""The arrival wait: after a step that ended requests, with none waiting, the next step waits a
little for new ones. Plain Python: no JAX here.

A client that keeps a fixed number of requests in flight (an agent's next call, `vllm bench serve
--max-concurrency`) sends its next request on a finish. With one step kept in flight, that request
misses the step launched meanwhile and waits for all of it (with a prefill in it, the larger part of
its time to first token). So the engine thread hands the finished requests' last tokens out first and
gives new requests up to `wait_ms` to arrive; the wait ends once as many arrived as finished. A wait
that gets none makes the next 1, 2, 4 .. 64 finishing steps skip it, so traffic that does not come
back on finishes pays for one wait in a while."""
from __future__ import annotations

import threading
import time
from typing import Callable

MAX_SKIP = 64


class ArrivalWait:
    def __init__(self, wait_ms: float) -> None:
        self.wait_s = wait_ms / 1e3
        self._skip = 0    # finishing steps still to skip
        self._misses = 0  # waits in a row that got nothing

    @property
    def enabled(self) -> bool:
        return self.wait_s > 0

    def take_turn(self) -> bool:
        """A finishing step that could wait: whether it does (a skipped one is counted here)."""
        if self._skip:
            self._skip -= 1
            return False
        return True

    def wait(self, cv: threading.Condition, arrivals: Callable[[], int], want: int,
             stop: Callable[[], bool]) -> int:
        """Wait on `cv` (notified on each arrival) until `arrivals()` grew by `want`, `stop()`, or
        the time is up; returns how many arrived, and backs off if none did."""
        deadline = time.monotonic() + self.wait_s
        with cv:
            start = arrivals()
            while arrivals() - start < want and not stop():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                cv.wait(left)
            got = arrivals() - start
        if got:
            self._misses = 0
        else:
            self._skip = min(MAX_SKIP, 2 ** self._misses)
            self._misses += 1
        return got
