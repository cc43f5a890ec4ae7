"""The engine's page size: --page-size when given, else the attention kernel's choice for the backend
(kernels.attention.kv_layout: 16 on CPU, 128 on TPU); the cache is allocated in that backend's layout."""
from __future__ import annotations

import jax
import pytest

from slipstream.engine.device.runner import EngineConfig, JaxEngine
from slipstream.kernels.attention import kv_layout
from tests.conftest import TINY_ENGINE


def test_default_page_size_is_the_backends_and_an_explicit_one_wins(tiny_model):
    cfg, params = tiny_model
    auto = {**TINY_ENGINE, "page_size": None}
    engine = JaxEngine(cfg, params, EngineConfig(**auto), precompile=False)
    lay = kv_layout(jax.default_backend())
    assert engine.page_size == lay.page_size == (16 if jax.default_backend() == "cpu" else lay.page_size)
    spec = lay.shapes(cfg.num_layers, cfg.num_kv_heads, engine.num_pages, engine.page_size, cfg.head_dim,
                      engine.kv_dtype)
    assert {k: v.shape for k, v in engine.cache.items()} == {k: v.shape for k, v in spec.items()}
    explicit = JaxEngine(cfg, params, EngineConfig(**{**TINY_ENGINE, "page_size": 32}), precompile=False)
    assert explicit.page_size == 32


def test_step_tokens_default_per_backend_and_an_explicit_budget_wins():
    """--max-num-batched-tokens: 288 on CPU, 1152 on accelerators (a 1024-token prompt and its BOS prefill
    in one step there), never below max_slots by default; an explicit budget is kept and checked."""
    assert EngineConfig().step_tokens("cpu") == 288
    assert EngineConfig().step_tokens("tpu") == EngineConfig().step_tokens("gpu") == 1152
    assert EngineConfig(max_slots=512).step_tokens("cpu") == 512
    assert EngineConfig(max_num_batched_tokens=64).step_tokens("tpu") == 64
    with pytest.raises(ValueError, match="max_num_batched_tokens .*max_slots"):
        EngineConfig(max_slots=64, max_num_batched_tokens=32)
