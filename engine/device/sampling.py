"""Batched, jittable token sampling: penalties, token masks, per-row seeds, logprobs.

Every per-request setting is a [B] array, so new settings never recompile. The token itself
(greedy, temperature, top-k/top-p/min-p and the draw) is kernels.sampling.sample_tokens and the
logprobs kernels.sampling.top_logprobs: a native kernel on CPU, its JAX reference elsewhere.
Speculative verification rows (DraftRows) see the drafts before them in the penalties. A drawn row
verifying a draft needs no rule of its own: drafts are deterministic, and for a proposal with all its
mass on the draft, speculative sampling's rule (keep it with probability p(draft), else draw from p
without it) gives the same joint law of (kept, token) as drawing the row's token from p and keeping
the draft when the two are equal. Rows draw from their seed's stream at their index in the output, so a
seeded request samples the same tokens with and without speculation.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from slipstream.engine.request import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, SamplingParams
from slipstream.engine.structured import mask_words
from slipstream.kernels.sampling import sample_tokens, top_logprobs

_GREEDY = SamplingParams(temperature=0.0)
Array = jax.Array | np.ndarray  # numpy from the host-side builder, jax.Array inside jit


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling settings, all [B]; `seed` is [B, 2] uint32 (high word, low word)."""

    temperature: Array         # f32, 0 = greedy
    top_k: Array               # i32, 0 = off
    top_p: Array               # f32, 1 = off
    min_p: Array               # f32, 0 = off
    repetition_penalty: Array  # f32, 1 = off
    presence_penalty: Array    # f32
    frequency_penalty: Array   # f32
    seed: Array                # u32[B, 2]: jax.random.PRNGKey(seed)'s key data
    step: Array                # i32, index of the token being generated in its request
    logprobs: Array            # bool, the request asks for logprobs (a batch without any skips them)
    logit_bias: Array          # bool, the request biases tokens (its slot's bias rows hold them)

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams | None],
        seeds: Sequence[int],
        steps: Sequence[int],
        batch: int,
    ) -> SamplingArrays:
        """Host-side (numpy) build; rows past len(params) and None rows are greedy padding.

        `seeds` are already resolved (the runner draws one for seed=None requests).
        """
        if not (len(params) == len(seeds) == len(steps)):
            raise ValueError(
                f"params, seeds and steps must have one entry per row, got "
                f"{len(params)}, {len(seeds)} and {len(steps)}")
        if batch < 1 or len(params) > batch:
            raise ValueError(f"batch must be >= 1 and >= len(params)={len(params)}, got {batch}")
        rows = [p if p is not None else _GREEDY for p in params]
        rows += [_GREEDY] * (batch - len(rows))
        seed_words = np.zeros((batch, 2), np.uint32)
        step_arr = np.zeros(batch, np.int32)
        for i, (p, seed, step) in enumerate(zip(params, seeds, steps)):
            if p is None:
                continue
            if not (0 <= seed < 2**64):
                raise ValueError(f"seeds[{i}] must be in [0, 2**64), got {seed}")
            if not (0 <= step < 2**31):
                raise ValueError(f"steps[{i}] must be in [0, 2**31), got {step}")
            seed_words[i] = (seed >> 32, seed & 0xFFFFFFFF)
            step_arr[i] = step

        def col(field: str, dtype: type) -> np.ndarray:
            return np.asarray([getattr(p, field) for p in rows], dtype)

        return cls(
            temperature=col("temperature", np.float32),
            top_k=col("top_k", np.int32),
            top_p=col("top_p", np.float32),
            min_p=col("min_p", np.float32),
            repetition_penalty=col("repetition_penalty", np.float32),
            presence_penalty=col("presence_penalty", np.float32),
            frequency_penalty=col("frequency_penalty", np.float32),
            seed=seed_words,
            step=step_arr,
            logprobs=np.asarray([p.logprobs is not None for p in rows], bool),
            logit_bias=np.asarray([bool(p.logit_bias) for p in rows], bool),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftRows:
    """Speculative verification in a step's sample rows, all [B]: a sequence's rows are consecutive,
    row i sampling after the chunk's i-th last token; `draft` is the token the next row was fed
    (the one this row verifies), -1 for a sequence's last row and rows without drafts; `row_start`
    is the index of the sequence's first row."""

    draft: Array      # i32
    row_start: Array  # i32

    @classmethod
    def none(cls, batch: int) -> "DraftRows":
        return cls(np.full(batch, -1, np.int32), np.arange(batch, dtype=np.int32))

    def earlier_counts(self, vocab: int) -> jax.Array:
        """i32[B, V]: each row's count of the drafts fed before it in its chunk (its context's output
        tokens past what the per-slot counts hold)."""
        rows = jnp.arange(self.draft.shape[0])
        earlier = ((self.row_start[:, None] == self.row_start[None, :]) & (rows[None, :] < rows[:, None])
                   & (self.draft[None, :] >= 0))                             # [B, B]: row i counts row j's draft
        tokens = jnp.broadcast_to(jnp.maximum(self.draft, 0)[None, :], earlier.shape)
        return jnp.zeros((rows.shape[0], vocab), jnp.int32).at[rows[:, None], tokens].add(earlier.astype(jnp.int32))

    def kept(self, token: jax.Array) -> jax.Array:
        """bool[B]: the rows whose token the host keeps: no earlier row of the chunk rejected its draft
        (a row keeps its draft when it sampled it; the first row that did not holds the next token)."""
        missed = (token != self.draft).astype(jnp.int32)                     # last rows "miss" (-1)
        before = jnp.cumsum(missed) - missed                                 # misses in rows [0, i)
        return before == before[self.row_start]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleResult:
    token: jax.Array         # i32[B]
    logprob: jax.Array       # f32[B], under log_softmax of the raw logits
    top_ids: jax.Array       # i32[B, MAX_TOP_LOGPROBS], best raw logprob first
    top_logprobs: jax.Array  # f32[B, MAX_TOP_LOGPROBS]


def check_token_ids(prompt_ids: Sequence[int], vocab: int) -> np.ndarray:
    """The prompt's ids as int64[n]; ValueError unless each is in [0, vocab)."""
    ids = np.asarray(prompt_ids, np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"prompt token ids must be in [0, {vocab}), got range "
                         f"[{ids.min()}, {ids.max()}]")
    return ids


def prompt_mask_row(prompt_ids: Sequence[int], vocab: int) -> np.ndarray:
    """bool[vocab]: which tokens the prompt contains (the repetition penalty's prompt half)."""
    ids = check_token_ids(prompt_ids, vocab)
    mask = np.zeros(vocab, bool)
    mask[ids] = True
    return mask


def penalties_active(arrays: SamplingArrays) -> jax.Array:
    """bool scalar: some row has a penalty or a logit bias. Penalties 1/0/0 and no bias are the identity, so a
    batch without any may skip them (and the per-row state they read) exactly."""
    return jnp.any((arrays.repetition_penalty != 1) | (arrays.presence_penalty != 0)
                   | (arrays.frequency_penalty != 0) | arrays.logit_bias)


def logit_bias_row(bias: Sequence[tuple[int, float]], vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """A request's (token id, bias) pairs as its slot's bias rows: ids i32[MAX_LOGIT_BIAS] and biases
    f32[MAX_LOGIT_BIAS], unused places (token 0, bias 0) adding nothing."""
    ids = np.zeros(MAX_LOGIT_BIAS, np.int32)
    values = np.zeros(MAX_LOGIT_BIAS, np.float32)
    if bias:
        tokens = np.asarray([t for t, _ in bias], np.int64)
        if tokens.max() >= vocab:
            raise ValueError(f"logit_bias token ids must be in [0, {vocab}), got {int(tokens.max())}")
        ids[:len(bias)] = tokens
        values[:len(bias)] = [b for _, b in bias]
    return ids, values


def add_logit_bias(logits: jax.Array, arrays: SamplingArrays, bias_ids: jax.Array, bias_values: jax.Array
                   ) -> jax.Array:
    """logits [B, V] plus each biased row's (id, bias) pairs ([B, MAX_LOGIT_BIAS] each); rows without a bias
    (whose slot rows may hold an earlier request's) add nothing."""
    values = jnp.where(arrays.logit_bias[:, None], bias_values, 0.0)
    rows = jnp.arange(logits.shape[0], dtype=jnp.int32)[:, None]
    return logits.at[rows, bias_ids].add(values, mode="drop")


def apply_penalties(logits: jax.Array, arrays: SamplingArrays, output_counts: jax.Array,
                    prompt_mask: jax.Array) -> jax.Array:
    """HF repetition penalty over prompt + output, then OpenAI presence/frequency over output."""
    counts = output_counts.astype(jnp.float32)                               # [B, V]
    rp = arrays.repetition_penalty[:, None]                                  # [B, 1]
    seen = prompt_mask | (output_counts > 0)                                 # [B, V]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    return (logits - arrays.presence_penalty[:, None] * (counts > 0)
            - arrays.frequency_penalty[:, None] * counts)


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """-inf where a row's packed mask u32[B, ceil(V/32)] has bit t of token t clear (structured
    output). A batch whose mask is all ones (no constrained row) skips the unpacking."""
    batch, vocab = logits.shape

    def masked() -> jax.Array:
        shifts = jnp.arange(32, dtype=jnp.uint32)                                # [32]
        bits = (bitmask[:, :, None] >> shifts) & jnp.uint32(1)                   # [B, W, 32]
        allowed = bits.reshape(batch, -1)[:, :vocab].astype(bool)                # [B, V]
        return jnp.where(allowed, logits, -jnp.inf)

    return jax.lax.cond(jnp.any(bitmask != jnp.uint32(0xFFFFFFFF)), masked, lambda: logits)


def constrain(logits: jax.Array, bitmask: jax.Array, arrays: SamplingArrays, output_counts: jax.Array,
              prompt_mask: jax.Array, slot_ids: jax.Array, drafts: DraftRows | None = None,
              bias: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """The logits a batch picks from: apply_token_bitmask, then apply_penalties with the rows
    `slot_ids` of the per-slot counts (plus the drafts fed before a verification row) and prompt
    masks, then the rows' logit biases (`bias`: the per-slot ids and biases, [slots, MAX_LOGIT_BIAS] each).
    A batch with neither a constrained nor a penalized row passes through one cond (one copy
    of the logits): the [slots, V] state is read only inside it."""
    def penalized(allowed: jax.Array) -> jax.Array:
        counts = output_counts[slot_ids]                                     # [B, V]
        if drafts is not None:
            counts = counts + drafts.earlier_counts(logits.shape[1])
        out = apply_penalties(allowed, arrays, counts, prompt_mask[slot_ids])
        return out if bias is None else add_logit_bias(out, arrays, bias[0][slot_ids], bias[1][slot_ids])

    def adjusted() -> jax.Array:
        allowed = apply_token_bitmask(logits, bitmask)
        return jax.lax.cond(penalties_active(arrays), lambda: penalized(allowed), lambda: allowed)

    needed = jnp.any(bitmask != jnp.uint32(0xFFFFFFFF)) | penalties_active(arrays)
    return jax.lax.cond(needed, adjusted, lambda: logits)


def _row_uniforms(arrays: SamplingArrays) -> jax.Array:
    """One U[0, 1) per row from fold_in(PRNGKey(seed), step): independent of row and batch."""
    def one(seed_words: jax.Array, step: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.wrap_key_data(seed_words, impl="threefry2x32"), step.astype(jnp.uint32))
        return jax.random.uniform(key, ())

    return jax.vmap(one)(arrays.seed, arrays.step)


def sample(logits: jax.Array, arrays: SamplingArrays, output_counts: jax.Array,
           prompt_mask: jax.Array, bias: tuple[jax.Array, jax.Array] | None = None) -> SampleResult:
    """One token per row from logits f32[B, V]; temperature-0 rows take the penalized argmax. bias: each row's
    (ids, biases) [B, MAX_LOGIT_BIAS], read where arrays.logit_bias is set."""
    logits = logits.astype(jnp.float32)
    batch, vocab = logits.shape
    no_mask = jnp.full((batch, mask_words(vocab)), 0xFFFFFFFF, jnp.uint32)
    rows = jnp.arange(batch, dtype=jnp.int32)
    return sample_penalized(logits, constrain(logits, no_mask, arrays, output_counts, prompt_mask, rows, bias=bias),
                            arrays)


def sample_penalized(logits: jax.Array, penalized: jax.Array, arrays: SamplingArrays) -> SampleResult:
    """sample() once the penalties are applied: `penalized` picks the token, the raw `logits`
    give the reported logprobs (the model's own, as vLLM reports by default). A row verifying a
    draft samples as any other (DraftRows.kept: the draft is kept where the row's token equals it)."""
    logits = logits.astype(jnp.float32)
    batch, vocab = logits.shape
    token = sample_tokens(penalized, arrays.temperature, arrays.top_k, arrays.top_p, arrays.min_p,
                          _row_uniforms(arrays))

    n_top = min(MAX_TOP_LOGPROBS, vocab)
    pad = ((0, 0), (0, MAX_TOP_LOGPROBS - n_top))

    def logprobs() -> tuple[jax.Array, jax.Array, jax.Array]:
        chosen, top_ids, top_vals = top_logprobs(logits, token, n_top)
        return chosen, jnp.pad(top_ids, pad), jnp.pad(top_vals, pad, constant_values=-jnp.inf)

    def no_logprobs() -> tuple[jax.Array, jax.Array, jax.Array]:
        # only when asked: XLA's top-20 over the whole vocab (the reference) costs ~4 ms at 32 rows
        return (jnp.zeros(batch, jnp.float32), jnp.zeros((batch, MAX_TOP_LOGPROBS), jnp.int32),
                jnp.full((batch, MAX_TOP_LOGPROBS), -jnp.inf, jnp.float32))

    logprob, top_ids, top_lps = jax.lax.cond(jnp.any(arrays.logprobs), logprobs, no_logprobs)
    return SampleResult(token=token, logprob=logprob, top_ids=top_ids, top_logprobs=top_lps)


def update_counts(output_counts: jax.Array, slot_ids: jax.Array, tokens: jax.Array,
                  active: jax.Array) -> jax.Array:
    """Add one at (slot, sampled token) for each active row, for later steps' penalties: B
    elements written in place (rows of the [slots, V] counts neither gathered nor copied)."""
    return output_counts.at[slot_ids, tokens].add(active.astype(output_counts.dtype))
