"""Shared fixtures: tiny random Llama-family checkpoints built with transformers, and the default model."""
from __future__ import annotations

import contextlib
import functools
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# The suite compiles hundreds of small programs and runs each a few times: XLA:CPU's code generation at optimisation
# level 0 (LLVM's level; the HLO passes still run) compiles them about a quarter faster. Read when JAX's CPU backend
# starts, so set before any test touches JAX; the servers and workers the tests start inherit it.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()


def virtual_devices(n: int) -> str:
    """XLA_FLAGS for a subprocess with `n` virtual CPU devices (and the suite's own flags)."""
    return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}".strip()


def build_tiny_hf(path: str, family: str = "llama", *, tie: bool = False, seed: int = 0) -> str:
    """Save a tiny random HF model of the given family (GQA: 4 heads over 2 KV heads) to `path`."""
    import torch
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=tie, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    if family == "llama":
        cfg = transformers.LlamaConfig(**common, rope_theta=10000.0)
        model = transformers.LlamaForCausalLM(cfg)
    elif family == "llama3":
        cfg = transformers.LlamaConfig(**common, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
        model = transformers.LlamaForCausalLM(cfg)
    elif family == "llama_yarn":
        # YaRN with every optional field: the ramp over dimensions 1-4 of 8 (a low base and a short original
        # context), not rounded, and an attention factor from mscale / mscale_all_dim
        cfg = transformers.LlamaConfig(**common, rope_parameters={
            "rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "original_max_position_embeddings": 64,
            "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.5, "mscale_all_dim": 0.5, "truncate": False})
        model = transformers.LlamaForCausalLM(cfg)
    elif family == "qwen3_yarn":  # Qwen3's long-context setting: factor and original context only
        cfg = transformers.Qwen3Config(**common, head_dim=16, rope_parameters={
            "rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "original_max_position_embeddings": 64})
        model = transformers.Qwen3ForCausalLM(cfg)
        _randomize_norms(model, torch)
    elif family in ("phi3", "phi3_short"):
        # fused qkv / gate_up, RoPE on 12 of head_dim's 16 (Phi-4-mini's 0.75), LongRoPE: "phi3" a context past the
        # original 4 (the long factors, as transformers takes them for any sequence longer than 4), "phi3_short" the
        # original context (the short factors) and a sliding window of 8
        long = family == "phi3"
        factors = torch.Generator().manual_seed(1)
        rope = {"rope_type": "longrope", "rope_theta": 100.0,
                "short_factor": (1 + torch.rand(6, generator=factors)).tolist(),
                "long_factor": (1 + 7 * torch.rand(6, generator=factors)).tolist()}
        cfg = transformers.Phi3Config(**{**common, "max_position_embeddings": 512 if long else 64}, head_dim=16,
                                      partial_rotary_factor=0.75, original_max_position_embeddings=4 if long else 64,
                                      rope_parameters=rope, sliding_window=None if long else 8, pad_token_id=0)
        model = transformers.Phi3ForCausalLM(cfg)
    elif family == "mistral":
        cfg = transformers.MistralConfig(**common, sliding_window=8, head_dim=16)
        model = transformers.MistralForCausalLM(cfg)
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # random init leaves biases at zero; make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=16)
        model = transformers.Qwen3ForCausalLM(cfg)
        _randomize_norms(model, torch)
    elif family == "gemma3":
        # both layer kinds (local sliding window of 8, global), their own RoPE bases and a linear
        # RoPE scaling on the global layers, as Gemma 3 4B+ ships
        cfg = transformers.Gemma3TextConfig(
            **{**common, "num_hidden_layers": 3, "tie_word_embeddings": True}, head_dim=16, sliding_window=8,
            query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
            final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh", pad_token_id=0)
        cfg.architectures = ["Gemma3ForCausalLM"]
        model = transformers.Gemma3ForCausalLM(cfg)
        _randomize_norms(model, torch)
    elif family in MOE_FAMILIES:
        # 4 experts, top 2, over 3 layers; Qwen3-MoE renormalises the top-k weights, OLMoE does not (and
        # normalises q / k over the whole projection)
        moe = {**common, "num_experts_per_tok": 2, "num_hidden_layers": 3, "intermediate_size": 48}
        if family == "qwen3_moe":
            cfg = transformers.Qwen3MoeConfig(**moe, num_experts=4, moe_intermediate_size=32, head_dim=16,
                                              norm_topk_prob=True)
            model = transformers.Qwen3MoeForCausalLM(cfg)
        elif family == "mixtral":
            cfg = transformers.MixtralConfig(**moe, num_local_experts=4, head_dim=16,
                                             sliding_window=None)
            model = transformers.MixtralForCausalLM(cfg)
        else:
            cfg = transformers.OlmoeConfig(**moe, num_experts=4)
            model = transformers.OlmoeForCausalLM(cfg)
        _randomize_norms(model, torch)
        _randomize_experts(model, torch)
    else:
        raise ValueError(family)
    model.eval().save_pretrained(path, safe_serialization=True)
    return path


MOE_FAMILIES = ("qwen3_moe", "mixtral", "olmoe")


def _randomize_experts(model, torch) -> None:
    """Router logits of a few units (each token's top experts win by clear margins, and differ token to token) and
    experts large enough to move the logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") and p.ndim == 2 and "experts" not in name:
                p.normal_(0, 1.0)
            elif "experts" in name:
                p.normal_(0, 0.1)


def _randomize_norms(model, torch) -> None:
    """Random init leaves norm weights at 1 (Gemma: 0, under its 1 + w); make them matter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)


def first_layers(cfg, model, n: int):
    """(config, model) of a loaded model's first n layers, with its own embedding, final norm and head:
    a real checkpoint's shapes and weights in a model that compiles and runs in a fraction of the time."""
    import dataclasses

    from flax import nnx

    from slipstream.models.architectures import build_abstract

    short = dataclasses.replace(cfg, num_layers=n, layer_types=cfg.layer_types[:n])
    graphdef, _ = nnx.split(build_abstract(short))
    flat = [(path, var.replace(var.get_value()[:n]) if path[0] == "blocks" else var)
            for path, var in nnx.to_flat_state(nnx.state(model))]
    return short, nnx.merge(graphdef, nnx.from_flat_state(flat))


@contextlib.contextmanager
def gguf_read_once(path: str, reader):
    """transformers' own loads of the GGUF at `path` (its tokenizer, its model) handed `reader`, the run's parse
    of it (default_gguf_reader): transformers parses the file again on each load (seconds: config, tokenizer,
    weights) and builds gguf's tensor-name map once per submodule (~400 times, ~9 s); both are pure functions
    of the file."""
    import gguf

    open_reader = gguf.GGUFReader

    def read(file, *args, **kwargs):
        same = os.path.samefile(file, path) and not args and not kwargs
        return reader if same else open_reader(file, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", read)
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    return build_tiny_hf(str(tmp_path_factory.mktemp("tiny-llama")), "llama")


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from slipstream.models.registry import DEFAULT_MODEL, resolve_model

    return resolve_model(DEFAULT_MODEL)


# Tests that start other processes (servers, process groups, virtual-device meshes) or run the default
# model end to end: `make test` runs them; `make test-quick` (pytest -m "not slow") skips them.
SLOW_MODULES = ("test_multihost", "test_tensor_parallel", "test_data_parallel", "test_serve_hf_models",
                "test_presets_serve", "test_device", "test_soak", "test_fuzz", "test_default_model",
                "test_unix_socket", "test_chat_page", "test_chat_page_serving", "test_grammar_abuse",
                "test_real_engine", "test_lora_tensor_parallel", "test_embeddings_bench")

# Tests that assert the process-wide compile count across a long window, compare one request's latency
# idle and under load, or hold a fake server's stamps to its schedule within milliseconds: `make test` runs the rest on two pytest-xdist workers, then these alone
# in one process, where no other test's engine compiles or computes beside them (on 2 cores the other
# worker's load swings between the idle and the loaded measurement).
SERIAL_MODULES = ("test_lora_serving", "test_grammar_abuse", "test_trace_server")


# The slowest files, slowest first (per-file times of a full run, cold compile cache): `make test` hands whole
# files to its two workers in collection order (--dist loadfile --no-loadscope-reorder), so these start first
# and the run ends on short files instead of one worker finishing a long file alone. test_data_parallel starts
# well after test_tensor_parallel: its process's single-device engine is the one that process compiles first
# (same virtual devices, same programs), loaded from the run's XLA cache once written, not compiled beside it;
# test_speculative_engine starts well after test_speculative_draft, whose target engine (16 slots, 64-token
# steps: 23 programs, ~8 s) it precompiles again. Other files follow in their usual order.
SLOWEST_FIRST = ("test_tensor_parallel", "test_device", "test_multihost", "test_attention_tpu", "test_int8_stack_tpu",
                 "test_lora", "test_engine", "test_presets_serve", "test_layer_stack", "test_q8_matmul",
                 "test_speculative_draft", "test_bench_client", "test_int8_engine", "test_f32_stack", "test_kernel",
                 "test_tpu_int8_matmul", "test_hybrid_weights", "test_soak", "test_default_model",
                 "test_speculative_engine", "test_kernel_paths", "test_data_parallel", "test_real_engine",
                 "test_embeddings_bench", "test_kv_write_float_tpu", "test_fuzz", "test_kv_write_tpu", "test_presets",
                 "test_attention_native", "test_serve_hf_models", "test_loader", "test_architectures_vs_hf",
                 "test_unix_socket", "test_groupwise", "test_lora_tensor_parallel")


def pytest_ignore_collect(collection_path, config):
    """`pytest -m serial` (the second part of `make test`) imports only the serial files: collecting
    the whole suite to deselect all but those costs seconds."""
    if (config.getoption("markexpr") == "serial" and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_") and collection_path.stem not in SERIAL_MODULES):
        return True
    return None


def _module(item) -> str:
    return item.module.__name__.rpartition(".")[2]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(_module(item), len(rank)))  # stable: a file's tests keep their order
    for item in items:
        name = _module(item)
        if name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
        if name in SERIAL_MODULES:
            item.add_marker(pytest.mark.serial)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts other processes or runs the default model end to end "
                                       "(deselect with -m 'not slow')")
    config.addinivalue_line("markers", "serial: run alone in one process after the parallel part of `make test`")
    # One persistent XLA cache for the whole run (and later runs): engines built by different
    # tests compile the same buckets, and the cache turns those repeats into loads.
    # The processes the tests start (virtual-device meshes in tests/engine/test_tensor_parallel.py and
    # test_data_parallel.py) inherit the path and use the same cache (`subprocess_compile_cache`).
    from slipstream.engine.device.compile_count import enable_compilation_cache

    os.environ.setdefault("SLIPSTREAM_TEST_COMPILE_CACHE", os.path.expanduser("~/.cache/slipstream/test-jax-cache"))
    enable_compilation_cache(os.environ["SLIPSTREAM_TEST_COMPILE_CACHE"])


def subprocess_compile_cache() -> None:
    """In a process a test started: the run's persistent XLA cache (pytest_configure's), so a repeated
    run (or a program another process of this run compiled) loads instead of compiling."""
    from slipstream.engine.device.compile_count import enable_compilation_cache

    enable_compilation_cache(os.environ.get("SLIPSTREAM_TEST_COMPILE_CACHE"))


def compile_cache_env() -> dict[str, str]:
    """Environment variables that point a child process's JAX at the run's persistent XLA cache, for children
    that cannot call subprocess_compile_cache (benchmarks/device's phases process): JAX reads JAX_* options."""
    path = os.environ.get("SLIPSTREAM_TEST_COMPILE_CACHE")
    return {"JAX_COMPILATION_CACHE_DIR": path, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"} if path else {}


# f32 weights: these engines are checked against f32 references (the CPU default would be q8_0-a16)
TINY_ENGINE = dict(max_slots=4, page_size=8, max_seq_len=128, num_pages=48, max_num_batched_tokens=32,
                   quantize="none")


@pytest.fixture(scope="session")
def tiny_model(tiny_llama_dir):
    from slipstream.models.loader import load_hf_dir

    return load_hf_dir(tiny_llama_dir)


@pytest.fixture(scope="session")
def tiny_engine(tiny_model):
    """A precompiled engine over the tiny model, shared by tests that leave it clean (all slots free)."""
    from slipstream.engine.device.runner import EngineConfig, JaxEngine

    cfg, params = tiny_model
    return JaxEngine(cfg, params, EngineConfig(**TINY_ENGINE))


@pytest.fixture(scope="session")
def tiny_lora_adapters(tiny_llama_dir, tmp_path_factory) -> tuple[str, dict[str, str]]:
    """(--lora-root, name -> directory) of tests/engine/lora_helpers.py's 3 peft adapters of the tiny Llama."""
    pytest.importorskip("peft")
    from tests.engine.lora_helpers import make_adapters

    root = str(tmp_path_factory.mktemp("lora-root"))
    return root, make_adapters(tiny_llama_dir, root)


@pytest.fixture(scope="session")
def tiny_lora_engine(tiny_model):
    """The tiny engine with 2 LoRA slots of rank 8 (tests leave its sampling slots free)."""
    from slipstream.engine.device.runner import EngineConfig, JaxEngine

    cfg, params = tiny_model
    return JaxEngine(cfg, params, EngineConfig(**TINY_ENGINE, max_loras=2, max_lora_rank=8))


@pytest.fixture(scope="session")
def default_gguf_reader(default_model_path):
    """The default model's GGUF opened once for the run (the gguf package parses its metadata, the
    tokenizer's 49k tokens and merges, in seconds each time), as the CLI opens it once for weights and
    tokenizer. Read-only: its tensors are views of the file."""
    from slipstream.models.loader import read_gguf

    return read_gguf(default_model_path)


@pytest.fixture(scope="session")
def default_tokenizer(default_model_path, default_gguf_reader):
    """The default model's tokenizer, built once for the run; tests use it read-only."""
    from slipstream.models.registry import load_tokenizer

    return load_tokenizer(default_model_path, default_gguf_reader)


@pytest.fixture(scope="session")
def default_model(default_model_path, default_gguf_reader):
    from slipstream.models.loader import load_gguf

    return load_gguf(default_model_path, reader=default_gguf_reader)


@pytest.fixture(scope="session")
def default_engine(default_model):
    """The default model in a small engine; only the shapes used get compiled."""
    from slipstream.engine.device.runner import EngineConfig, JaxEngine

    cfg, params = default_model
    return JaxEngine(cfg, params, EngineConfig(max_slots=4, page_size=16, max_seq_len=256, num_pages=64,
                                               max_num_batched_tokens=64, quantize="none"), precompile=False)
