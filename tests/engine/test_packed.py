"""One host array per program (engine/device/packed.py): a packed buffer unpacks to the arrays written into it,
and a step hands each of its compiled programs one host array and makes no other host->device transfer."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from slipstream.engine.api import PREVIOUS_SAMPLE, SlotState, StepBatch, StepSeq
from slipstream.engine.device.packed import Packing
from slipstream.engine.request import SamplingParams


def test_a_buffer_unpacks_to_what_was_written_into_it():
    packing = Packing((("ids", (3,), "int32"), ("table", (2, 2), "int32"), ("scale", (2,), "float32"),
                       ("seed", (2, 2), "uint32"), ("on", (3,), "bool"), ("first", (), "int32")))
    buf, x = packing.host()
    x["ids"][:] = [-1, 5, 2**31 - 1]
    x["table"][:] = [[1, 2], [3, 4]]
    x["scale"][:] = [0.25, -3.5]
    x["seed"][:] = [[2**32 - 1, 0], [7, 2**31]]
    x["on"][:] = [True, False, True]
    x["first"][...] = 9
    assert buf.dtype == np.int32 and buf.shape == (packing.size,) == (17,)
    out = jax.device_get(jax.jit(packing.unpack)(buf))
    assert out["ids"].tolist() == [-1, 5, 2**31 - 1] and out["table"].tolist() == [[1, 2], [3, 4]]
    assert out["scale"].dtype == np.float32 and out["scale"].tolist() == [0.25, -3.5]
    assert out["seed"].dtype == np.uint32 and out["seed"].tolist() == [[2**32 - 1, 0], [7, 2**31]]
    assert out["on"].dtype == bool and out["on"].tolist() == [True, False, True]
    assert out["first"].shape == () and out["first"] == 9


@pytest.mark.parametrize("fixture", ["tiny_engine", "tiny_lora_engine"])
def test_a_step_hands_each_program_one_host_array(request, fixture, monkeypatch):
    """A prefill step and a decode step fed PREVIOUS_SAMPLE: each makes two compiled calls (the model, then the
    sampler) with one numpy argument each; any other host->device transfer in launch is refused by JAX's
    transfer guard (the counted arguments are put on the device here, explicitly, which the guard allows)."""
    engine = request.getfixturevalue(fixture)
    rng = np.random.default_rng(0)
    prompts = {0: rng.integers(3, 256, 13).tolist(), 2: rng.integers(3, 256, 6).tolist()}
    pages = {0: [1, 2, 3], 2: [4, 5]}
    for slot, prompt in prompts.items():
        engine.insert(slot, SlotState(prompt, [], SamplingParams(temperature=0.8, top_p=0.9, seed=slot)))
    prefill = StepBatch([StepSeq(slot, prompt, 0, pages[slot], True) for slot, prompt in prompts.items()])
    decode = StepBatch([StepSeq(slot, [PREVIOUS_SAMPLE], len(prompt), pages[slot], True)
                        for slot, prompt in prompts.items()])

    host_arrays: list[int] = []
    original = jax.stages.Compiled.__call__

    def counted(self, *args, **kwargs):
        leaves, tree = jax.tree.flatten((args, kwargs))
        on_host = [isinstance(x, (np.ndarray, np.generic)) for x in leaves]
        host_arrays.append(sum(on_host))
        args, kwargs = jax.tree.unflatten(tree, [jax.device_put(x) if h else x for x, h in zip(leaves, on_host)])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Compiled, "__call__", counted)
    try:
        with jax.transfer_guard_host_to_device("disallow"):
            first = engine.launch(prefill)
            second = engine.launch(decode)  # before the first step's samples come back, as the scheduler does
        assert len(first.result()) == len(second.result()) == 2
    finally:
        for slot in prompts:
            engine.free(slot)
    assert host_arrays == [1, 1, 1, 1]
