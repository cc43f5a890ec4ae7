"""A launched engine step and the samples it leaves on the device: `LaunchedStep` is JaxEngine's
StepResult (result() copies the samples to the host once, advances grammar matchers, builds logprobs);
`PreviousSamples` keeps each slot's latest sample on the device, so a decode can feed a token the host
has not collected yet (PREVIOUS_SAMPLE, engine/api.py): the model program reads it there."""
from __future__ import annotations

import functools
import time
import jax
import jax.numpy as jnp
import numpy as np

from slipstream.engine.api import Sampled
from slipstream.engine.device.buckets import Buckets
from slipstream.engine.request import TokenLogprob
from slipstream.engine.device.sampling import SampleResult
from slipstream.engine.structured import Matcher


class GrammarProgress:
    """Grammar matchers whose latest sample is launched but not collected (a slot's next step needs
    its matcher advanced first), and the seconds matchers spent consuming samples."""

    def __init__(self) -> None:
        self.unadvanced: set[Matcher] = set()
        self.advance_seconds = 0.0


class LaunchedStep:
    """A launched step; result() waits for its samples (the engine's StepResult)."""

    def __init__(self, grammar: GrammarProgress, result: SampleResult | None,
                 rows: list[tuple[int, Matcher | None]]) -> None:
        self._grammar, self._result, self._rows = grammar, result, rows  # rows: (logprobs k, matcher)
        self._samples: list[Sampled] | None = None

    def result(self) -> list[Sampled]:
        if self._samples is None:
            self._samples = self._collect()
        return self._samples

    def _collect(self) -> list[Sampled]:
        if self._result is None:
            return []
        host: SampleResult = jax.device_get(self._result)
        tokens = host.token.tolist()
        if any(m is not None for _, m in self._rows):
            start = time.perf_counter()
            for (_, matcher), token in zip(self._rows, tokens):
                if matcher is not None:
                    matcher.advance(token)
                    self._grammar.unadvanced.discard(matcher)
            self._grammar.advance_seconds += time.perf_counter() - start
        out = []
        for i, ((k, _), token) in enumerate(zip(self._rows, tokens)):
            lp = None
            if k >= 0:
                top = tuple((int(host.top_ids[i, j]), float(host.top_logprobs[i, j])) for j in range(k))
                lp = TokenLogprob(token, float(host.logprob[i]), top)
            out.append(Sampled(token, lp))
        return out


def _record(last: jax.Array, slot_ids: jax.Array, tokens: jax.Array) -> jax.Array:
    """last i32[S+1] with each sampled row's slot set to its token (padding rows hit scratch row S)."""
    return last.at[slot_ids].set(tokens)


class PreviousSamples:
    """Each slot's latest sample, kept on the device, so that a step can feed a decode the token of
    a step whose samples the host has not collected yet (PREVIOUS_SAMPLE). A tiny program records a
    step's samples; the next step's model program takes them from `last` (JaxEngine._model_step)."""

    def __init__(self, max_slots: int, sharding: jax.sharding.Sharding | None = None) -> None:
        # on the engine's devices (committed), as the samples it records are: one program per bucket
        self._put = (lambda x: x) if sharding is None else functools.partial(jax.device_put, device=sharding)
        self.last = self._put(jnp.zeros(max_slots + 1, jnp.int32))
        self._scratch = max_slots
        self._record = jax.jit(_record, donate_argnums=(0,))
        self._compiled: dict[int, jax.stages.Compiled] = {}

    def warm(self, buckets: Buckets) -> None:
        """Compile the recorder for every bucket now and keep the executables, so steady state never compiles
        (held here, not in jit's process-wide cache, where other engines' programs could evict them)."""
        for b in buckets.sample_row_counts:
            slot_ids, tokens = np.full(b, self._scratch, np.int32), self._put(jnp.zeros(b, jnp.int32))
            self._compiled[b] = self._record.lower(self.last, slot_ids, tokens).compile()
            self.record(slot_ids, tokens)

    def record(self, slot_ids: np.ndarray, tokens: jax.Array) -> None:
        self.last = self._compiled.get(len(slot_ids), self._record)(self.last, slot_ids, tokens)
