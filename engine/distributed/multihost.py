"""Multi-host serving: joining the process group (jax.distributed) and running every engine call on
every process in the same order.

Process 0 runs the front end and the scheduler; its engine is a LockstepEngine, which sends each
engine call (insert, launch, collect, free) to the workers over a TCP control channel
(engine/control_channel.py), then makes it on its own JaxEngine. Each worker replays the calls in
order on its JaxEngine, so all processes run the same programs over the global mesh; only process 0's
samples reach the scheduler. A peer that goes away (end of stream, or silence past the peer timeout)
fails the requests in flight and ends the process non-zero: a collective whose peer died may never
return, so nothing waits on one.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import secrets
import sys
import threading
from typing import Any, Callable

from slipstream.engine.api import Sampled, SlotState, StepBatch, StepResult
# Group, Leader and the wire are imported from here by server/cli.py and the tests
from slipstream.engine.distributed.control_channel import (_FRAME, HEARTBEAT_S, TOKEN_BYTES, DistributedConfig, Group, Leader,  # noqa: F401
                                    PeerLost, decode, encode)
from slipstream.engine.request import MAX_SEED, TokenLogprob

log = logging.getLogger(__name__)


def initialize(cfg: DistributedConfig) -> bytes:
    """Join the group, before anything touches a device; returns the group's secret (process 0's,
    broadcast), which workers present on the control channel. On CPU, XLA's collectives between
    processes run over gloo."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(cfg.coordinator_address, num_processes=cfg.num_processes,
                               process_id=cfg.process_id, initialization_timeout=int(cfg.connect_timeout_s))
    mine = np.frombuffer(secrets.token_bytes(TOKEN_BYTES), np.uint8)
    token = bytes(np.asarray(multihost_utils.broadcast_one_to_all(mine), np.uint8))
    log.info("process %d of %d joined (%d devices, %d here)", jax.process_index(), jax.process_count(),
             jax.device_count(), jax.local_device_count())
    return token


def exit_now(code: int) -> None:
    """End the process without Python's exit handlers: jax.distributed's shutdown waits for every
    process, which after a peer died is forever."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_after(grace_s: float) -> Callable[[str], None]:
    """A loss handler: exit non-zero after `grace_s` (time for the failed requests' answers to go
    out), whatever the other threads are stuck in."""
    def handler(reason: str) -> None:
        timer = threading.Timer(grace_s, exit_now, args=(1,))
        timer.daemon = True
        timer.start()
    return handler


# ---- process 0 ---------------------------------------------------------------------------------

class LockstepEngine:
    """Process 0's engine: every call goes to the workers, then to the local engine (the Engine
    protocol; everything else reads through to the local engine)."""

    def __init__(self, engine: Any, group: Group) -> None:
        self._engine, self._group = engine, group
        self._steps = itertools.count()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def insert(self, slot: int, state: SlotState) -> None:
        if state.params.seed is None:  # each process would draw its own seed and sample apart
            params = dataclasses.replace(state.params, seed=secrets.randbelow(MAX_SEED + 1))
            state = dataclasses.replace(state, params=params)
        wire, lora = state, getattr(self._engine, "lora", None)
        if state.lora is not None and lora is not None and lora.holds(state.lora_slot, state.lora):
            # the workers' slot holds it too (the same inserts in the same order): its weights stay home
            wire = dataclasses.replace(state, lora=None)
        self._group.send(("insert", slot, wire))
        self._engine.insert(slot, state)

    def launch(self, batch: StepBatch) -> StepResult:
        step = next(self._steps)
        self._group.send(("launch", step, batch))
        return _LockstepResult(self._group, step, self._engine.launch(batch))

    def step(self, batch: StepBatch) -> list[Sampled]:
        return self.launch(batch).result()

    def free(self, slot: int) -> None:
        self._group.send(("free", slot))
        self._engine.free(slot)


class _LockstepResult:
    def __init__(self, group: Group, step: int, local: StepResult) -> None:
        self._group, self._step, self._local = group, step, local
        self._sent = False

    def result(self) -> list[Sampled]:
        if not self._sent:  # the workers collect where process 0 does (a grammar needs the order)
            self._group.send(("collect", self._step))
            self._sent = True
        return self._local.result()

    def scores(self) -> list[tuple[TokenLogprob, ...]]:
        return self._local.scores()

    def pooled(self) -> list:
        return self._local.pooled()


# ---- workers -----------------------------------------------------------------------------------

def worker_grammars(tokenizer: Any, engine: Any) -> Callable[[str, Any], Any]:
    """How a worker rebuilds a request's grammar: compiled against its own tokenizer as the server
    compiles it on process 0 (server/structured.py), the compiler built on first use."""
    compiler = None

    def make(text: str, constraint: Any) -> Any:
        nonlocal compiler
        from slipstream.engine.structured import Grammar, GrammarCompiler

        if compiler is None:
            eos = set(getattr(tokenizer, "eos_token_ids", ())) | set(engine.eos_token_ids)
            compiler = GrammarCompiler(tokenizer, engine.vocab_size, eos)
        return Grammar(compiler, text, constraint)
    return make


def serve_worker(engine: Any, leader: Leader) -> None:
    """Replay process 0's engine calls on this process's engine until process 0 says stop.

    An insert that fails here failed on process 0 too (same state, same code), which fails that
    request only: go on. A step that fails here leaves the group out of step: raise (and exit)."""
    steps: dict[int, StepResult] = {}
    for msg in leader.messages():
        kind = msg[0]
        if kind == "insert":
            try:
                engine.insert(msg[1], msg[2])
            except Exception:  # noqa: BLE001 - the same request failed on process 0
                log.exception("insert into slot %d failed (as on process 0)", msg[1])
        elif kind == "free":
            engine.free(msg[1])
        elif kind == "launch":
            steps[msg[1]] = engine.launch(msg[2])
        elif kind == "collect":
            steps.pop(msg[1]).result()  # a grammar's matcher advances on the sampled token
        else:
            raise ValueError(f"unknown control message {kind!r}")
