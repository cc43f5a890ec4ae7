"""The host side of a ragged step: a StepBatch laid out as the model program's input arrays
(tokens, positions, KV lengths, page table, cu_q_lens, sample rows), padded to its token bucket, and
the packings that carry each program's host arrays in one buffer (engine/device/packed.py).
Plain numpy; it checks the batch against the engine's limits and touches no device.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from slipstream.engine.api import PREVIOUS_SAMPLE, StepBatch
from slipstream.engine.device.buckets import Buckets
from slipstream.engine.device.packed import Packing
from slipstream.engine.device.sampling import DraftRows, SamplingArrays
from slipstream.engine.kv_cache import pages_needed

MODEL_INPUTS = ("tokens", "positions", "kv_lens", "page_indices", "cu_q_lens", "num_seqs", "sample_index")


@functools.cache
def model_packing(tokens: int, *, max_slots: int, max_pages_per_seq: int, sample_rows: int, lora: bool = False,
                  prompt_from: bool = False, targets: bool = False, pool: bool = False,
                  images: bool = False) -> Packing:
    """The model program's host arrays: MODEL_INPUTS, `src` i32[T] (the slot whose latest sample a
    PREVIOUS_SAMPLE position takes, -1 elsewhere), with LoRA each token's adapter slot i32[T], with the
    hybrid weights' split the first prompt row i32[], when scoring each token's next token i32[T] and the most
    alternatives a scored row wants i32[], when pooling each row's pooled sequence i32[T] (launch.PooledRows), with
    images whether each row takes the step's image rows (its `embeds` input) i32[T]."""
    t, s = tokens, max_slots
    shapes = dict(tokens=(t,), positions=(t,), kv_lens=(s,), page_indices=(s, max_pages_per_seq),
                  cu_q_lens=(s + 1,), num_seqs=(1,), sample_index=(sample_rows,), src=(t,))
    if lora:
        shapes["lora_slots"] = (t,)
    if prompt_from:
        shapes["prompt_from"] = ()
    if targets:
        shapes["targets"] = (t,)
        shapes["alternatives"] = ()
    if pool:
        shapes["pool"] = (t,)
    if images:
        shapes["embedded"] = (t,)
    return Packing(tuple((name, shape, "int32") for name, shape in shapes.items()))


@functools.cache
def sample_packing(rows: int) -> Packing:
    """The sampling program's host arrays: each row's slot (max_slots for padding), whether it is
    active, its SamplingArrays fields, and its DraftRows fields."""
    one = SamplingArrays.from_params([], [], [], 1)
    fields = [("slot_ids", (rows,), "int32"), ("active", (rows,), "bool")]
    fields += [(f.name, (rows,) + getattr(one, f.name).shape[1:], getattr(one, f.name).dtype.name)
               for f in dataclasses.fields(SamplingArrays)]
    fields += [(f.name, (rows,), "int32") for f in dataclasses.fields(DraftRows)]
    return Packing(tuple(fields))


def step_inputs(batch: StepBatch, buckets: Buckets, *, max_slots: int, max_pages_per_seq: int, max_seq_len: int,
                page_size: int, out: dict[str, np.ndarray] | None = None,
                ) -> tuple[int, tuple[np.ndarray, ...], list[int]]:
    """Host arrays of the model program for `batch`: (token bucket, inputs, sampled rows' slots); the
    inputs are MODEL_INPUTS, written into `out`'s zeroed arrays of those names (the views of a
    model_packing buffer) when given."""
    seqs = batch.seqs
    if not 0 < len(seqs) <= max_slots:
        raise ValueError(f"a step holds 1..{max_slots} sequences, got {len(seqs)}")
    t = buckets.tokens(batch.num_tokens)
    s = max_slots
    if out is None:
        out = dict(tokens=np.zeros(t, np.int32), positions=np.zeros(t, np.int32), kv_lens=np.zeros(s, np.int32),
                   page_indices=np.zeros((s, max_pages_per_seq), np.int32), cu_q_lens=np.zeros(s + 1, np.int32),
                   num_seqs=np.zeros(1, np.int32), sample_index=np.zeros(buckets.sample_rows(t), np.int32))
    tokens, positions, kv_lens, pages, cu, num_seqs, sample_index = (out[name] for name in MODEL_INPUTS)
    sample_slots: list[int] = []
    # gathered in lists and written once: numpy calls per sequence cost more than the values
    token_list: list[int] = []
    position_list: list[int] = []
    end_list: list[int] = []
    sample_list: list[int] = []
    for i, seq in enumerate(seqs):
        n, end = len(seq.token_ids), seq.end_pos
        if n == 0 or end > max_seq_len:
            raise ValueError(f"sequence in slot {seq.slot}: {n} tokens ending at {end} "
                             f"(need 1.., up to max_seq_len {max_seq_len})")
        if len(seq.page_ids) < pages_needed(end, page_size):
            raise ValueError(f"sequence in slot {seq.slot}: {len(seq.page_ids)} pages do not cover "
                             f"{end} tokens")
        token_list.extend(seq.token_ids)
        if n == 1:
            position_list.append(end - 1)
        else:
            position_list.extend(range(seq.start_pos, end))
        end_list.append(end)
        k = min(len(seq.page_ids), max_pages_per_seq)
        pages[i, :k] = seq.page_ids[:k]
        if seq.sample:
            rows = seq.num_samples
            at = len(token_list)
            if not 1 <= rows <= n or len(sample_slots) + rows > len(sample_index):
                raise ValueError(f"sequence in slot {seq.slot}: {rows} samples of a {n}-token chunk "
                                 f"(1..{n}; the step samples at most {len(sample_index)} rows)")
            sample_list.extend(range(at - rows, at))
            sample_slots.extend([seq.slot] * rows)
    at = len(token_list)
    tokens[:at] = token_list
    positions[:at] = position_list
    kv_lens[:len(seqs)] = end_list
    cu[1:len(seqs) + 1] = np.cumsum([len(seq.token_ids) for seq in seqs])
    sample_index[:len(sample_list)] = sample_list
    cu[len(seqs) + 1:] = at
    num_seqs[0] = len(seqs)
    return t, (tokens, positions, kv_lens, pages, cu, num_seqs, sample_index), sample_slots


def previous_sources(batch: StepBatch, tokens: np.ndarray, cu: np.ndarray) -> np.ndarray | None:
    """i32[T]: the slot whose latest sample each PREVIOUS_SAMPLE position feeds, -1 elsewhere;
    None when the batch feeds none."""
    where = np.flatnonzero(tokens == PREVIOUS_SAMPLE)
    if where.size == 0:
        return None
    src = np.full(len(tokens), -1, np.int32)
    owner = np.searchsorted(cu, where, side="right") - 1  # the sequence of each such position
    longer = np.flatnonzero(cu[owner + 1] - cu[owner] != 1)
    if longer.size:
        seq = batch.seqs[owner[longer[0]]]
        raise ValueError(f"sequence in slot {seq.slot}: PREVIOUS_SAMPLE is only valid as a "
                         f"decode's one token, got a chunk of {len(seq.token_ids)}")
    src[where] = np.asarray([seq.slot for seq in batch.seqs], np.int32)[owner]
    return src


def draft_rows(batch: StepBatch, rows: int) -> tuple[DraftRows, np.ndarray]:
    """The sample rows' speculative drafts (DraftRows) and positions i32[rows] (the token each row
    samples after), padded to `rows`: a sequence sampling at its chunk's last r positions verifies the
    r - 1 drafts it was fed, one per row but the last."""
    out, positions = DraftRows.none(rows), np.zeros(rows, np.int32)
    sampling = [seq for seq in batch.seqs if seq.sample]
    if all(seq.num_samples == 1 for seq in sampling):  # no drafts: a row per sequence, as none() has them
        positions[:len(sampling)] = [seq.end_pos - 1 for seq in sampling]
        return out, positions
    at = 0
    for seq in sampling:
        r = seq.num_samples
        if r > 1:
            out.draft[at:at + r - 1] = seq.token_ids[len(seq.token_ids) - r + 1:]
        out.row_start[at:at + r] = at
        positions[at:at + r] = np.arange(seq.end_pos - r, seq.end_pos)
        at += r
    return out, positions


def sample_inputs(batch: StepBatch, sample_slots: list[int], rows: int, slot_sampling: SamplingArrays,
                  slot_prompt_len: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The sampling program's host array for `batch` (a sample_packing(rows) buffer) and its views: each
    row's slot (padding rows: the scratch slot, the per-slot tables' last row), its settings from the
    per-slot tables (slot_sampling, slot_prompt_len [slots + 1]), and its drafts."""
    buf, x = sample_packing(rows).host()
    n = len(sample_slots)
    slot_ids = x["slot_ids"]
    slot_ids[:] = len(slot_prompt_len) - 1
    slot_ids[:n] = sample_slots
    x["active"][:n] = 1
    drafts, positions = draft_rows(batch, rows)
    for f in dataclasses.fields(DraftRows):
        x[f.name][:] = getattr(drafts, f.name)
    for f in dataclasses.fields(SamplingArrays):
        x[f.name][:] = getattr(slot_sampling, f.name)[slot_ids]
    # a row draws with its seed's stream at the index, in the output, of the token it samples: the
    # same for a token however the steps were cut (a row past a rejected draft is dropped unseen,
    # so the step that samples that index again may use the stream again)
    x["step"][:] = np.maximum(positions + 1 - slot_prompt_len[slot_ids], 0)
    return buf, x


def token_lora_slots(batch: StepBatch, t: int, max_loras: int) -> np.ndarray:
    """i32[t]: each token's LoRA slot (0: the base model; padding too)."""
    slots = np.zeros(t, np.int32)
    at = 0
    for seq in batch.seqs:
        n = len(seq.token_ids)
        if not 0 <= seq.lora_slot <= max_loras:
            raise ValueError(f"sequence in slot {seq.slot}: LoRA slot {seq.lora_slot} out of range "
                             f"[0, {max_loras}] (max_loras)")
        slots[at:at + n] = seq.lora_slot
        at += n
    return slots
