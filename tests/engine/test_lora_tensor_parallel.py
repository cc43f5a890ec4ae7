"""LoRA under tensor parallelism (2 virtual CPU devices, in a fresh process: XLA_FLAGS is read when
JAX's CPU backend starts): a step mixing the base model and two adapters gives transformers + peft's
logits, over int8 (q8_0-a16) and f32 base weights. One process runs both weight modes (each process
costs seconds of start-up)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import virtual_devices
from tests.engine.lora_helpers import reference_greedy

# No module-level importorskip("peft"): the child process imports this module for `_child`, and peft
# (with torch and transformers) took ~10 s of its start-up; tiny_lora_adapters skips without peft.

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = [5, 17, 33, 99, 7, 200, 3]
QUANTIZE = ("none", "q8_0-a16")


def _child(base_dir: str, adapter_dirs: dict[str, str], quantize: str) -> list[list[float]]:
    from slipstream.engine.api import SlotState, StepBatch, StepSeq
    from slipstream.engine.device.runner import EngineConfig, JaxEngine
    from slipstream.engine.request import SamplingParams
    from slipstream.models.loader import load_hf_dir
    from slipstream.models.lora import load_adapter, lora_targets
    from tests.conftest import TINY_ENGINE

    cfg, model = load_hf_dir(base_dir)
    targets = lora_targets(model)
    engine = JaxEngine(cfg, model, EngineConfig(**{**TINY_ENGINE, "quantize": quantize}, tensor_parallel=2,
                                                max_loras=2, max_lora_rank=8), precompile=False)
    seqs = [StepSeq(slot=0, token_ids=PROMPT, start_pos=0, page_ids=[1], sample=True)]
    engine.insert(0, SlotState(PROMPT, (), SamplingParams(temperature=0.0)))
    for i, (name, path) in enumerate(adapter_dirs.items(), 1):
        adapter = load_adapter(name, path, targets, cfg.num_layers, 8)
        engine.insert(i, SlotState(PROMPT, (), SamplingParams(temperature=0.0), lora_slot=i, lora=adapter))
        seqs.append(StepSeq(slot=i, token_ids=PROMPT, start_pos=0, page_ids=[1 + i], sample=True, lora_slot=i))
    return engine.model_logits(StepBatch(seqs)).tolist()


@pytest.fixture(scope="module")
def tp_logits(tiny_llama_dir, tiny_lora_adapters) -> dict[str, np.ndarray]:
    """quantize -> the TP=2 engine's logits [base, attn, all], both from one fresh process."""
    dirs = {n: tiny_lora_adapters[1][n] for n in ("attn", "all")}
    env = {**os.environ, "XLA_FLAGS": virtual_devices(2), "JAX_PLATFORMS": "cpu"}
    code = (f"import json, sys; sys.path.insert(0, {ROOT!r}); from tests.conftest import subprocess_compile_cache; "
            "subprocess_compile_cache(); from tests.engine.test_lora_tensor_parallel import _child; "
            f"print('RESULT', json.dumps({{q: _child({tiny_llama_dir!r}, {dirs!r}, q) for q in {QUANTIZE!r}}}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return {q: np.asarray(rows) for q, rows in json.loads(out.stdout.split("RESULT ", 1)[1]).items()}


@pytest.mark.parametrize("quantize, atol", [("none", 1e-4), ("q8_0-a16", 0.05)])
def test_adapters_under_tensor_parallel_match_peft(tiny_llama_dir, tiny_lora_adapters, tp_logits, quantize, atol):
    dirs = [tiny_lora_adapters[1][n] for n in ("attn", "all")]
    refs = [reference_greedy(tiny_llama_dir, d, PROMPT, 1)[1][0] for d in (None, *dirs)]
    logits = tp_logits[quantize]
    assert len(logits) == len(refs)
    for row, ref in zip(logits, refs):
        np.testing.assert_allclose(row, ref, atol=atol)
        assert row.argmax() == ref.argmax()
