"""SamplingParams' ranges and the engine's sampling-state build: nothing out of range reaches numpy or the
sampler, and everything accepted samples inside the vocabulary."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slipstream.engine.request import (MAX_INT32, MAX_TEMPERATURE, MAX_TOP_LOGPROBS, REPETITION_PENALTY_RANGE,
                                       InvalidParam, SamplingParams)
from slipstream.engine.device.sampling import SamplingArrays
from tests.engine.sampling_helpers import V, run


def test_builder_pads_with_greedy_rows_and_splits_seeds():
    arrays = SamplingArrays.from_params(
        [SamplingParams(temperature=0.9, top_k=7, seed=1), None], [2**40 + 7, 99], [5, 6], 4)
    np.testing.assert_array_equal(arrays.temperature, np.float32([0.9, 0.0, 0.0, 0.0]))
    np.testing.assert_array_equal(arrays.top_k, [7, 0, 0, 0])
    np.testing.assert_array_equal(arrays.seed[0], [2**8, 7])
    np.testing.assert_array_equal(arrays.step, [5, 0, 0, 0])
    with pytest.raises(ValueError, match="one entry per row"):
        SamplingArrays.from_params([SamplingParams()], [1, 2], [0], 4)
    with pytest.raises(ValueError, match="batch"):
        SamplingArrays.from_params([SamplingParams()] * 3, [1] * 3, [0] * 3, 2)
    with pytest.raises(ValueError, match="seeds\\[0\\]"):
        SamplingArrays.from_params([SamplingParams()], [-1], [0], 2)


# ---- ranges: nothing out of range reaches numpy (issue 12: top_k=2**31 killed the engine) -----

@pytest.mark.parametrize("field,value", [
    ("top_k", 2**31), ("top_k", -1), ("max_tokens", 2**31), ("max_tokens", -1),
    ("temperature", float("inf")), ("temperature", float("nan")), ("temperature", 1e39),
    ("top_p", float("nan")), ("min_p", float("nan")), ("repetition_penalty", 1e-300),
    ("repetition_penalty", float("inf")), ("presence_penalty", float("nan")),
    ("frequency_penalty", 2.5), ("seed", 2**63), ("logprobs", MAX_TOP_LOGPROBS + 1),
    ("prompt_logprobs", MAX_TOP_LOGPROBS + 1), ("prompt_logprobs", -1),
    ("n", 0), ("stop_token_ids", (2**31,)), ("max_tokens", True), ("top_k", 5.0),
    ("stop", ("x" * 1025,)), ("ignore_eos", "yes"),
])
def test_params_outside_their_range_are_rejected_naming_the_field(field, value):
    with pytest.raises(InvalidParam) as err:
        SamplingParams(**{field: value})
    assert err.value.field == field
    assert field in str(err.value)


_FLOAT = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
    [0.0, -0.0, 1.0, 1e-45, 1e-300, 3.5e38, 2.0, -2.0, MAX_TEMPERATURE, *REPETITION_PENALTY_RANGE])
_INT = st.integers() | st.sampled_from([0, 1, -1, MAX_INT32, MAX_INT32 + 1, 2**63, -(2**63)])
_FIELDS = st.fixed_dictionaries({}, optional={
    "max_tokens": _INT, "temperature": _FLOAT, "top_p": _FLOAT, "top_k": _INT, "min_p": _FLOAT,
    "repetition_penalty": _FLOAT, "presence_penalty": _FLOAT, "frequency_penalty": _FLOAT,
    "seed": _INT | st.none(), "logprobs": _INT | st.none(), "n": _INT,
    "stop_token_ids": st.lists(_INT, max_size=3).map(tuple),
})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fields=_FIELDS, step=st.integers(0, MAX_INT32))
def test_any_accepted_params_build_sampling_arrays_and_sample_in_vocab(fields, step):
    """Every SamplingParams the constructor accepts goes through the engine's sampling-state
    build and the sampler without an error, holding its values (no int32 wrap, no float32 inf)."""
    try:
        params = SamplingParams(**fields)
    except InvalidParam:
        return
    seed = params.seed if params.seed is not None else 0
    arrays = SamplingArrays.from_params([params], [seed], [step], 2)
    assert int(arrays.top_k[0]) == params.top_k
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty"):
        value = getattr(arrays, name)[0]
        assert np.isfinite(value) and value == np.float32(getattr(params, name)), name
    assert float(arrays.repetition_penalty[0]) > 0
    out = run(np.linspace(-3, 3, V)[None], [params], seeds=[seed], steps=[step])
    assert 0 <= int(out.token[0]) < V


@pytest.mark.parametrize("temperature", [3.1919527385062316e-16, 1e-45, 1e-8])
def test_a_tiny_temperature_draws_the_max(temperature):
    # found by the property test above: at T = 3e-16 the scaled logits reach ~1e16 and the jitted
    # draw lost its max to rounding, returning a padding index past the vocabulary
    out = run(np.linspace(-3, 3, V)[None], [SamplingParams(temperature=temperature)])
    assert int(out.token[0]) == V - 1
