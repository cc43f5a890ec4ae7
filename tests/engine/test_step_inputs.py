"""The host side of a step (engine/device/step_inputs.py): a batch laid out as the model program's arrays."""
from __future__ import annotations

import numpy as np
import pytest

from slipstream.engine.api import PREVIOUS_SAMPLE, StepBatch, StepSeq
from slipstream.engine.device.buckets import Buckets
from slipstream.engine.device.step_inputs import draft_rows, previous_sources, step_inputs

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
