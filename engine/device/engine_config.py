"""The engine's settings: a frozen, validated EngineConfig, and what its `auto` values stand for on
the backend at hand (activation dtype, weight quantization). It holds no device arrays and builds
nothing; engine/runner.py's JaxEngine reads it.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from slipstream.quantization import MODES


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8")
PROMPT_WEIGHTS = ("auto", "w16", "same")  # EngineConfig.prompt_weights
ACCELERATORS = ("tpu", "gpu", "cuda", "rocm")  # jax.default_backend() names whose `auto` weights are "int8"


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    max_slots: int = 32
    page_size: int | None = None            # None: kernels.attention.kv_layout's (16 on CPU, 128 on TPU)
    max_seq_len: int = 2048
    kv_cache_memory: int = 768 << 20        # bytes for K/V pages (34k bf16 tokens of the default model)
    num_pages: int | None = None            # overrides kv_cache_memory (tests)
    max_num_batched_tokens: int | None = None   # tokens per step; None: step_tokens()'s backend default
    dtype: str = "auto"                     # auto: float32 on CPU, bfloat16 on GPU/TPU
    kv_cache_dtype: str = "auto"            # auto: see kv_dtype(); or float32, bfloat16, int8
    quantize: str = "auto"                  # auto: see weight_mode(); or none, q8_0, q8_0-a16, int8,
                                            # int8-channel, int8-channel-a16, int8-channel-w16 (quantization/)
    tensor_parallel: int = 1                # devices the model is split over (engine/sharding.py)
    max_loras: int = 0                      # LoRA adapter slots on the device (0: no LoRA)
    max_lora_rank: int = 64                 # every slot's rank (adapters of lower rank are zero-padded)
    prompt_weights: str = "auto"            # auto: see prompt_w16(); w16: prompt rows on int8-channel-w16 weights
                                            # (with q8_0-a16 on CPU); same: every row on the one weight form

    def __post_init__(self) -> None:
        if self.max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {self.max_slots}")
        if self.page_size is not None and (self.page_size < 1 or self.page_size & (self.page_size - 1)):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_slots:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_slots "
                             f"({self.max_slots}): every running sequence decodes in each step")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.quantize != "auto" and self.quantize not in MODES:
            raise ValueError(f"quantize must be auto or one of {', '.join(MODES)}, got {self.quantize!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be >= 1, got {self.tensor_parallel}")
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras must be >= 0 and max_lora_rank >= 1, got {self.max_loras}, "
                             f"{self.max_lora_rank}")
        if self.prompt_weights not in PROMPT_WEIGHTS:
            raise ValueError(f"prompt_weights must be one of {', '.join(PROMPT_WEIGHTS)}, got {self.prompt_weights!r}")
        if self.prompt_weights == "w16" and (self.quantize not in ("auto", "q8_0-a16") or self.tensor_parallel > 1):
            raise ValueError(f"prompt_weights w16 goes with quantize q8_0-a16 (the CPU default) on one device, not "
                             f"quantize {self.quantize} with tensor_parallel {self.tensor_parallel}")
        if (self.quantize.startswith("int8-channel") or self.quantize == "int4") and self.tensor_parallel > 1:
            # int8-channel: its one scale row per weight cannot split with a row-parallel weight (engine/sharding.py);
            # int4: its packed pairs of input groups are not split by the sharding rules
            raise ValueError(f"quantize {self.quantize} runs on one device, not with tensor_parallel "
                             f"{self.tensor_parallel}; use int8")

    def step_tokens(self, backend: str | None = None) -> int:
        """Tokens per engine step (the largest step bucket): max_num_batched_tokens, or by default a whole
        256-token chunk plus 32 decodes on CPU (288) and a whole 1024-token chunk plus 128 decodes on
        accelerators (1152), where a step's matmuls cost about the same from one row to hundreds (the
        weights' read sets it): a prompt of 1024 tokens and its BOS then prefill in one step (of 1056 rows:
        Buckets). At least max_slots either way: every running sequence decodes in a step."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        backend = backend or jax.default_backend()
        return max(self.max_slots, 1024 + 128 if backend in ACCELERATORS else 256 + 32)

    def weight_mode(self, backend: str | None = None) -> str:
        """The quantization mode `auto` stands for on `backend` (default: JAX's): on CPU, group-wise
        int8 weights with two-part int8 activations (q8_0-a16: perplexity and greedy tokens equal to
        f32 on the default model, 1.1-4x faster matmuls) when its native kernel is built, else float
        (the q8_0 reference is slow on CPU); on TPU and GPU "int8" (int8 weights dequantized inside the
        MXU's / tensor cores' dot, 1.25 bytes a weight; quantization/int8.py: on the default model
        perplexity 19.0858 as f32's, 20/20 greedy prompts equal to f32 in f32 activations on CPU)."""
        if self.quantize != "auto":
            return self.quantize
        backend = backend or jax.default_backend()
        if backend in ACCELERATORS:
            return "int8"
        if backend != "cpu":
            return "none"
        from slipstream.kernels.q8_matmul import native_available

        return "q8_0-a16" if native_available() else "none"

    def prompt_w16(self, backend: str | None = None) -> bool:
        """Whether a step's prompt rows (positions before their request's prompt length) multiply the decoder
        layers' weights in a second form, int8-channel-w16 (rounded per output channel from the q8_0-a16 groups,
        with the residual: 2 bytes a weight; the default model's server holds ~350 MB more), while generated
        tokens' rows (decodes, speculative verification, a preempted request's recomputed output) and the LM head
        keep q8_0-a16. On an AMX CPU that halves a 256-token prefill step of the default model (perplexity as
        f32's; benchmarks/results.d/intel-emerald-rapids.md), and the one-row decode keeps q8_0-a16's 0.6-1.1
        bytes a weight. `auto`: at the default weights (quantize `auto`, which is q8_0-a16 on CPU) on one device
        when the per-channel kernel runs on the AMX tile unit (an explicit quantize q8_0-a16 keeps one form);
        `w16`: wherever q8_0-a16 runs on CPU (its native kernels built); `same`: never. A row's output depends only
        on its token's role, not on the step's other rows (docs/kernels.md)."""
        if self.prompt_weights == "same" or self.tensor_parallel > 1 or (
                self.prompt_weights == "auto" and self.quantize != "auto"):
            return False
        backend = backend or jax.default_backend()
        if backend != "cpu" or self.weight_mode(backend) != "q8_0-a16":
            if self.prompt_weights == "w16":
                raise ValueError(f"prompt_weights w16 needs q8_0-a16 weights on CPU (here {backend}, "
                                 f"{self.weight_mode(backend)})")
            return False
        from slipstream.kernels import int8_channel_matmul as icm

        if not icm.native_available():
            if self.prompt_weights == "w16":
                raise ValueError("prompt_weights w16 needs the native int8_channel_matmul kernel (pip install -e .)")
            return False
        if self.prompt_weights == "w16":
            return True
        import importlib

        return importlib.import_module("slipstream.kernels._int8_channel_matmul").isa() == "amx"

    def kv_dtype(self) -> jnp.dtype:
        """The KV cache dtype `auto` stands for here: bf16 on CPU with int8 weights and the native attention
        kernel (the default mode; on the default model perplexity 19.0866 vs f32's 19.0858, 20/20 prompts
        with 16 identical greedy tokens, half the bytes per token of f32 and a faster attention step),
        else the activation dtype (f32 weights keep f32 K/V; XLA:CPU's reference runs bf16 slowly;
        accelerators run bf16 throughout)."""
        if self.kv_cache_dtype != "auto":
            return jnp.dtype(self.kv_cache_dtype)
        act = self.activation_dtype()
        if jax.default_backend() == "cpu" and act == jnp.float32 and self.weight_mode() != "none":
            from slipstream.kernels import native

            if native.load("ragged_paged_attention", "ragged_paged_attention"):
                return jnp.dtype(jnp.bfloat16)
        return act

    def activation_dtype(self) -> jnp.dtype:
        if self.dtype == "auto":
            # XLA:CPU runs bf16 matmuls several times slower than f32; accelerators want bf16
            return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
        return jnp.dtype(self.dtype)
