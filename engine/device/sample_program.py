"""The sampling program's bodies, jitted by the engine (engine/device/runner.py): the draw over a step's
logits with its slots' penalty state donated and updated in place, and the writer of one slot's row of
that state. Pure functions of their arguments; the engine owns the arrays."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from slipstream.engine.device.launch import record_samples
from slipstream.engine.device.packed import Packing
from slipstream.engine.request import MAX_LOGIT_BIAS
from slipstream.engine.device.sampling import DraftRows, SamplingArrays, constrain, sample_penalized, update_counts


def packed_sample_step(packing: Packing, logits, state, last, packed, bitmask):
    """sample_step over step_inputs.sample_packing's arrays; it also records each slot's latest
    sample into `last` (PreviousSamples)."""
    x = packing.unpack(packed)
    sarrays = SamplingArrays(**{f.name: x[f.name] for f in dataclasses.fields(SamplingArrays)})
    drafts = DraftRows(**{f.name: x[f.name] for f in dataclasses.fields(DraftRows)})
    result, state = sample_step(logits, state, x["slot_ids"], x["active"], sarrays, bitmask, drafts)
    return result, state, record_samples(last, x["slot_ids"], result.token)


def sample_step(logits, state, slot_ids, active, sarrays, bitmask, drafts):
    # The draw runs outside any cond, and the [slots, V] state never leaves through one: with a
    # cond on penalties around the whole draw that also returned the counts, XLA:CPU took 2.3 ms
    # for this program at 32 greedy rows instead of 0.64 (6.98 -> 0.81 with a penalized row).
    # The counts take one add per active row, in place and in every batch, so a row's counts are
    # current whenever its penalties read them (JaxEngine.insert rebuilds a penalized request's row).
    # Verification rows add only the tokens the host keeps (the accepted drafts and the one after them).
    # state: the per-slot token counts and prompt masks [slots, V], and logit-bias ids and biases
    # [slots, MAX_LOGIT_BIAS]; only the counts change here.
    counts, pmask, bias_ids, bias_values = state
    logits = logits.astype(jnp.float32)
    penalized = constrain(logits, bitmask, sarrays, counts, pmask, slot_ids, drafts, bias=(bias_ids, bias_values))
    result = sample_penalized(logits, penalized, sarrays)
    counts = update_counts(counts, slot_ids, result.token, active & drafts.kept(result.token))
    return result, (counts, pmask, bias_ids, bias_values)


def empty_state(slots: int, vocab: int) -> tuple[jax.Array, ...]:
    """sample_step's state for `slots` slots, zeroed: counts i32 and prompt masks bool [slots, V], logit-bias
    ids i32 and biases f32 [slots, MAX_LOGIT_BIAS]."""
    return (jnp.zeros((slots, vocab), jnp.int32), jnp.zeros((slots, vocab), bool),
            jnp.zeros((slots, MAX_LOGIT_BIAS), jnp.int32), jnp.zeros((slots, MAX_LOGIT_BIAS), jnp.float32))


def set_row(state, slot, counts_row, mask_row, bias_ids_row, bias_values_row):
    """`state` (sample_step's) with slot `slot`'s rows set: its counts (None: zeros, made here, not uploaded),
    prompt mask and logit bias."""
    counts, pmask, bias_ids, bias_values = state
    if counts_row is None:
        counts_row = jnp.zeros(counts.shape[1], counts.dtype)
    return (counts.at[slot].set(counts_row), pmask.at[slot].set(mask_row), bias_ids.at[slot].set(bias_ids_row),
            bias_values.at[slot].set(bias_values_row))
