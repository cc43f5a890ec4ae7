"""Which XLA ops a jitted step spends its time in, read back from a jax.profiler trace."""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import tempfile
from typing import Callable

import jax

# Host-side runtime events, not XLA ops
_HOST = ("$", "Thunk", "Pjit", "PjRt", "Allocate", "Handle", "Parse", "Execute", "Await")


def profile_ops(fn: Callable[[], object], reps: int, top: int) -> list[tuple[str, float, int]]:
    """XLA ops by total time per call, from a profiler trace: (name, ms per call, calls per step).
    Ops on the two host threads overlap, so the sum exceeds the step's wall time."""
    jax.block_until_ready(fn())
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(reps):
                jax.block_until_ready(fn())
        with gzip.open(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)[0]) as f:
            events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and "dur" in e and not any(k in e["name"] for k in _HOST):
            total[e["name"]] += e["dur"]
            count[e["name"]] += 1
    return [(name, us / reps / 1e3, count[name] // reps) for name, us in total.most_common(top)]
