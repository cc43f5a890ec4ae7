"""The host side of a step (engine/device/step_inputs.py): a batch laid out as the model and sampling programs'
arrays."""
from __future__ import annotations

import numpy as np
import pytest

from slipstream.engine.api import PREVIOUS_SAMPLE, StepBatch, StepSeq
from slipstream.engine.device.buckets import Buckets
from slipstream.engine.device.packed import Packing
from slipstream.engine.device.sampling import SamplingArrays
from slipstream.engine.device.step_inputs import (draft_rows, model_packing, previous_sources, sample_inputs,
                                                  step_inputs)
from slipstream.engine.request import SamplingParams

PAGE = 4


def _batch():
    return StepBatch((
        StepSeq(slot=3, token_ids=(PREVIOUS_SAMPLE,), start_pos=6, page_ids=(7, 2), sample=True),
        StepSeq(slot=0, token_ids=(11,), start_pos=0, page_ids=(5,), sample=True),
        StepSeq(slot=1, token_ids=(20, 21, 22, 23, 24), start_pos=2, page_ids=(1, 9), sample=True),
        StepSeq(slot=2, token_ids=(30, 31, 32), start_pos=0, page_ids=(4,), sample=False),
    ))


def _inputs(batch):
    buckets = Buckets.build(max_num_batched_tokens=16, max_slots=6)
    return step_inputs(batch, buckets, max_slots=6, max_pages_per_seq=3, max_seq_len=12, page_size=PAGE)


def test_arrays_of_a_mixed_batch():
    t, (tokens, positions, kv_lens, pages, cu, num_seqs, sample_index), slots = _inputs(_batch())
    assert t >= 10
    assert tokens[:10].tolist() == [PREVIOUS_SAMPLE, 11, 20, 21, 22, 23, 24, 30, 31, 32] and not tokens[10:].any()
    assert positions[:10].tolist() == [6, 0, 2, 3, 4, 5, 6, 0, 1, 2]
    assert kv_lens.tolist() == [7, 1, 7, 3, 0, 0]
    assert pages[:4].tolist() == [[7, 2, 0], [5, 0, 0], [1, 9, 0], [4, 0, 0]] and not pages[4:].any()
    assert cu.tolist() == [0, 1, 2, 7, 10, 10, 10]
    assert num_seqs.tolist() == [4]
    assert sample_index[:3].tolist() == [0, 1, 6] and slots == [3, 0, 1]


def test_previous_sources_point_at_their_slots():
    batch = _batch()
    _, (tokens, _, _, _, cu, _, _), _ = _inputs(batch)
    src = previous_sources(batch, tokens, cu)
    assert src[0] == 3 and (src[1:] == -1).all()
    plain = StepBatch(batch.seqs[1:])
    _, (tokens, _, _, _, cu, _, _), _ = _inputs(plain)
    assert previous_sources(plain, tokens, cu) is None


def test_previous_sample_inside_a_chunk_is_refused():
    batch = StepBatch((StepSeq(slot=0, token_ids=(11,), start_pos=0, page_ids=(5,), sample=True),
                       StepSeq(slot=4, token_ids=(12, PREVIOUS_SAMPLE), start_pos=0, page_ids=(6,), sample=True)))
    _, (tokens, _, _, _, cu, _, _), _ = _inputs(batch)
    with pytest.raises(ValueError, match="slot 4: PREVIOUS_SAMPLE is only valid as a decode's one token"):
        previous_sources(batch, tokens, cu)


def test_draft_rows_with_and_without_drafts():
    drafts, positions = draft_rows(_batch(), 4)
    assert positions.tolist() == [6, 0, 6, 0] and drafts.draft.tolist() == [-1] * 4
    assert drafts.row_start.tolist() == [0, 1, 2, 3]
    verify = StepBatch((StepSeq(slot=0, token_ids=(11, 40, 41), start_pos=4, page_ids=(5, 6), sample=True,
                                num_samples=3),
                        StepSeq(slot=1, token_ids=(12,), start_pos=2, page_ids=(7,), sample=True)))
    drafts, positions = draft_rows(verify, 5)
    assert positions.tolist() == [4, 5, 6, 2, 0]
    assert drafts.draft.tolist() == [40, 41, -1, -1, -1] and drafts.row_start.tolist() == [0, 0, 0, 3, 4]


def test_arrays_written_into_a_packed_buffer_are_the_ones_built_alone():
    buckets = Buckets.build(max_num_batched_tokens=16, max_slots=6)
    t, alone, _ = _inputs(_batch())
    packing = model_packing(t, max_slots=6, max_pages_per_seq=3, sample_rows=buckets.sample_rows(t))
    buf, views = packing.host()
    _, into, _ = step_inputs(_batch(), buckets, max_slots=6, max_pages_per_seq=3, max_seq_len=12, page_size=PAGE,
                             out=views)
    for a, b in zip(alone, into):
        np.testing.assert_array_equal(a, b)
        assert np.shares_memory(b, buf)  # written in place: the buffer is what the program gets


def test_sample_inputs_gather_each_rows_settings_and_pad_with_the_scratch_slot():
    # slots 0..5 and the scratch row 6; slot 1 samples at temperature 0.5 with top_k 7, seed 2**40 + 3
    params = [None, SamplingParams(temperature=0.5, top_k=7, seed=2**40 + 3), None, SamplingParams(top_p=0.9)]
    table = SamplingArrays.from_params(params + [None] * 3, [0, 2**40 + 3, 0, 9, 0, 0, 0], [0] * 7, 7)
    prompt_len = np.array([0, 4, 0, 5, 0, 0, 0], np.int32)
    verify = StepBatch((StepSeq(slot=1, token_ids=(11, 40, 41), start_pos=4, page_ids=(5, 6), sample=True,
                                num_samples=3),
                        StepSeq(slot=3, token_ids=(12,), start_pos=6, page_ids=(7,), sample=True)))
    buf, x = sample_inputs(verify, [1, 1, 1, 3], 6, table, prompt_len)
    assert x["slot_ids"].tolist() == [1, 1, 1, 3, 6, 6] and x["active"].tolist() == [1, 1, 1, 1, 0, 0]
    assert x["temperature"].tolist() == [0.5, 0.5, 0.5, 1.0, 0.0, 0.0]
    assert x["top_k"].tolist() == [7, 7, 7, 0, 0, 0] and x["top_p"][3] == np.float32(0.9)
    assert x["seed"][0].tolist() == [2**8, 3] and x["seed"][3].tolist() == [0, 9]
    # the index in its output of the token each row samples: positions 4, 5, 6 after a 4-token prompt
    assert x["step"][:4].tolist() == [1, 2, 3, 2]
    assert x["draft"].tolist() == [40, 41, -1, -1, -1, -1] and x["row_start"].tolist() == [0, 0, 0, 3, 4, 5]
    assert all(np.shares_memory(v, buf) for v in x.values())


def test_a_packing_refuses_a_dtype_it_cannot_carry():
    with pytest.raises(ValueError, match="'bad': dtype float64"):
        Packing((("ok", (2,), "int32"), ("bad", (2,), "float64")))


def test_a_budget_past_a_power_of_two_pads_that_prompt_and_its_bos_to_one_rung_above_it():
    # the accelerator default, 1024 + 128: a 1024-token prompt and its BOS take 1056 rows, not the budget's 1152
    tpu = Buckets.build(max_num_batched_tokens=1024 + 128, max_slots=64)
    assert tpu.token_counts[-4:] == (512, 1024, 1056, 1152)
    assert [tpu.tokens(n) for n in (1024, 1025, 1056, 1057)] == [1024, 1056, 1056, 1152]
    # the CPU default, 256 + 32, has that rung as its budget; a power-of-two budget keeps its plain ladder
    assert Buckets.build(max_num_batched_tokens=256 + 32, max_slots=32).token_counts[-3:] == (128, 256, 288)
    assert Buckets.build(max_num_batched_tokens=2048, max_slots=8).token_counts[-3:] == (512, 1024, 2048)
