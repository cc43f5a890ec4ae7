"""A launched engine step and the samples it leaves on the device: `LaunchedStep` is JaxEngine's
StepResult (result() copies the samples to the host once, advances grammar matchers, builds logprobs; scores() and
pooled() the prompt scores and pooled hidden states of the sequences that asked, ScoredRows and PooledRows);
`PreviousSamples` keeps each slot's latest sample on the device, so a decode can feed a token the host
has not collected yet (PREVIOUS_SAMPLE, engine/api.py): the sampling program writes it there, the model
program reads it there."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from slipstream.engine.api import Sampled, StepBatch
from slipstream.engine.request import TokenLogprob
from slipstream.engine.device.sampling import SampleResult
from slipstream.engine.structured import Matcher
from slipstream.models.base import TokenScores


class GrammarProgress:
    """Grammar matchers whose latest sample is launched but not collected (a slot's next step needs
    its matcher advanced first), and the seconds matchers spent consuming samples."""

    def __init__(self) -> None:
        self.unadvanced: set[Matcher] = set()
        self.advance_seconds = 0.0


class ScoredRows:
    """The sequences of a step that score their tokens (StepSeq.targets): where their rows are, their targets and
    alternatives asked, and (once launched) the program's models.base.TokenScores on the device."""

    def __init__(self, rows: list[tuple[int, tuple[int, ...], int]]) -> None:
        self.rows = rows  # per scoring sequence in batch order: (its first row, its targets, alternatives)
        self.device: TokenScores | None = None

    @classmethod
    def of(cls, batch: StepBatch, slot_alternatives) -> "ScoredRows":
        """slot_alternatives: each slot's prompt_logprobs (as insert bound them)."""
        rows, at = [], 0
        for seq in batch.seqs:
            if seq.targets:
                if len(seq.targets) > len(seq.token_ids):
                    raise ValueError(f"sequence in slot {seq.slot}: {len(seq.targets)} targets for a chunk of "
                                     f"{len(seq.token_ids)} tokens")
                rows.append((at, tuple(seq.targets), int(slot_alternatives[seq.slot])))
            at += len(seq.token_ids)
        return cls(rows)

    def targets(self, t: int) -> np.ndarray:
        """i32[t]: each row's target (0 where none: its row is scored and ignored)."""
        out = np.zeros(t, np.int32)
        for at, targets, _ in self.rows:
            out[at:at + len(targets)] = targets
        return out

    def copy_to_host_async(self) -> None:
        for leaf in jax.tree.leaves(self.device):
            leaf.copy_to_host_async()

    def collect(self) -> list[tuple[TokenLogprob, ...]]:
        host: TokenScores = jax.device_get(self.device)
        out = []
        for at, targets, k in self.rows:
            rows = slice(at, at + len(targets))
            lps, ids, top_lps = (host.logprob[rows].tolist(), host.top_ids[rows, :k].tolist(),
                                 host.top_logprobs[rows, :k].tolist())
            out.append(tuple(TokenLogprob(target, lp, tuple(zip(i, v)))
                             for target, lp, i, v in zip(targets, lps, ids, top_lps)))
        return out


class PooledRows:
    """The sequences of a step that pool rows (StepSeq.pool, embeddings): each row's pooled sequence for the
    program (its index in the batch; max_slots where the row is not pooled), and (once launched) the program's
    per-sequence sums f32[max_slots, D] on the device."""

    def __init__(self, owners: np.ndarray, seqs: list[int]) -> None:
        self.owners = owners  # i32[T]
        self.seqs = seqs      # batch indices of the pooling sequences, in batch order
        self.device: jax.Array | None = None

    @classmethod
    def of(cls, batch: StepBatch, t: int, max_slots: int) -> "PooledRows":
        owners, seqs, at = np.full(t, max_slots, np.int32), [], 0
        for i, seq in enumerate(batch.seqs):
            n = len(seq.token_ids)
            if seq.pool:
                if not 0 < seq.pool <= n:
                    raise ValueError(f"sequence in slot {seq.slot}: {seq.pool} pooled rows of a {n}-token chunk")
                owners[at + n - seq.pool:at + n] = i
                seqs.append(i)
            at += n
        return cls(owners, seqs)

    def copy_to_host_async(self) -> None:
        self.device.copy_to_host_async()

    def collect(self) -> list[np.ndarray]:
        return list(np.asarray(jax.device_get(self.device))[self.seqs])  # a copy of the pooled rows only


class LaunchedStep:
    """A launched step; result() waits for its samples, scores() for its scores, pooled() for its pooled hidden
    states (the engine's StepResult)."""

    def __init__(self, grammar: GrammarProgress, result: SampleResult | None,
                 rows: list[tuple[int, Matcher | None]], scored: ScoredRows | None = None,
                 pooled: PooledRows | None = None) -> None:
        self._grammar, self._result, self._rows = grammar, result, rows  # rows: (logprobs k, matcher)
        self._samples: list[Sampled] | None = None
        self._scored, self._pooled = scored, pooled

    def result(self) -> list[Sampled]:
        if self._samples is None:
            self._samples = self._collect()
        return self._samples

    def scores(self) -> list[tuple[TokenLogprob, ...]]:
        return [] if self._scored is None else self._scored.collect()

    def pooled(self) -> list[np.ndarray]:
        return [] if self._pooled is None else self._pooled.collect()

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


def record_samples(last: jax.Array, slot_ids: jax.Array, tokens: jax.Array) -> jax.Array:
    """Inside the sampling program: last i32[S+1] with each sampled row's slot set to its token. A slot's
    latest sample is its last row's (several rows verify drafts; a scatter with repeated indices keeps an
    unspecified one), so its earlier rows, like the padding rows (slot S), write the scratch row S."""
    scratch = last.shape[0] - 1
    earlier = jnp.append(slot_ids[1:] == slot_ids[:-1], False)               # [B]: the next row is the same slot's
    return last.at[jnp.where(earlier, scratch, slot_ids)].set(tokens)


class PreviousSamples:
    """Each slot's latest sample, kept on the device, so that a step can feed a decode the token of
    a step whose samples the host has not collected yet (PREVIOUS_SAMPLE). The sampling program
    records a step's samples (record_samples); the next step's model program takes them from `last`
    (JaxEngine._model_step)."""

    def __init__(self, max_slots: int, sharding: jax.sharding.Sharding | None = None) -> None:
        # on the engine's devices (committed), as the samples recorded into it are
        last = jnp.zeros(max_slots + 1, jnp.int32)
        self.last = last if sharding is None else jax.device_put(last, sharding)
        self.spec = jax.ShapeDtypeStruct(self.last.shape, self.last.dtype, sharding=sharding)
