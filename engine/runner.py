"""The JAX engine: owns the device arrays (KV pages, penalty state) and runs jitted prefill/decode.

Every (batch, pages) and (chunk, pages) bucket is compiled ahead of time; the KV pages and the
penalty state are donated, so steps update them in place. Implements engine/api.py's Engine.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import secrets
from concurrent.futures import ThreadPoolExecutor, as_completed
import sys
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from engine import compile_count
from engine.api import DecodeRow, PrefillChunk, Sampled, SlotState
from engine.buckets import Buckets
from engine.kv_cache import kv_bytes_per_token, num_pages_for_budget, pages_needed
from engine.request import TokenLogprob
from engine.sampling import (SampleResult, SamplingArrays, apply_penalties, penalties_active, prompt_mask_row,
                             sample_penalized, update_counts)
from models.config import ModelConfig
from quantization import MODES, QuantizedWeight, quantize
from models.llama import forward_paged, init_kv_cache, split_layers
from engine.params import prepare_params


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    max_slots: int = 32
    page_size: int = 16
    max_seq_len: int = 2048
    kv_cache_memory: int = 1 << 30          # bytes for K/V pages; decides num_pages
    num_pages: int | None = None            # overrides kv_cache_memory (tests)
    prefill_lengths: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
    dtype: str = "auto"                     # auto: float32 on CPU, bfloat16 on GPU/TPU
    kv_cache_dtype: str = "auto"            # auto: the activation dtype; or int8
    quantize: str = "none"                  # none, w8a16 or w8a8 (int8 weights incl. the LM head)

    def __post_init__(self) -> None:
        if self.max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {self.max_slots}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        if not self.prefill_lengths or min(self.prefill_lengths) < 1:
            raise ValueError(f"prefill_lengths must be positive, got {self.prefill_lengths}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.quantize not in MODES:
            raise ValueError(f"quantize must be one of {', '.join(MODES)}, got {self.quantize!r}")
        if self.kv_cache_dtype not in ("auto", "int8"):
            raise ValueError(f"kv_cache_dtype must be auto or int8, got {self.kv_cache_dtype!r}")

    def activation_dtype(self) -> jnp.dtype:
        if self.dtype == "auto":
            # XLA:CPU runs bf16 matmuls several times slower than f32; accelerators want bf16
            return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
        return jnp.dtype(self.dtype)


class JaxEngine:
    """Paged-KV engine over one model replica (all local devices see the same arrays)."""

    def __init__(self, model_cfg: ModelConfig, params: dict, config: EngineConfig = EngineConfig(), *,
                 eos_token_ids: Sequence[int] = (), progress: bool = False, precompile: bool = True,
                 calibration_tokens: Sequence[int] | None = None) -> None:
        """calibration_tokens: the model's tokenization of models.calibration.calibration_text(),
        for the int8 weight modes (see prepare_params); ignored without quantization."""
        compile_count.install()
        self.model_cfg, self.config = model_cfg, config
        self.dtype = config.activation_dtype()
        kv_dtype = jnp.dtype(jnp.int8) if config.kv_cache_dtype == "int8" else self.dtype
        self.params = prepare_params(params, model_cfg, config.quantize, self.dtype, progress=progress,
                                     calibration_tokens=calibration_tokens)
        if jax.default_backend() == "cpu":  # XLA:CPU copies each weight out of a stack every step
            self.params = split_layers(self.params)
        self.max_slots = config.max_slots
        self.page_size = config.page_size
        self.max_seq_len = min(config.max_seq_len, model_cfg.max_position_embeddings)
        self.max_pages_per_seq = pages_needed(self.max_seq_len, self.page_size)
        self.bytes_per_token = kv_bytes_per_token(
            num_layers=model_cfg.num_layers, n_kv_heads=model_cfg.num_kv_heads, head_dim=model_cfg.head_dim,
            dtype_bytes=kv_dtype.itemsize, scale_bytes=4 if kv_dtype == jnp.int8 else 0)
        self.num_pages = config.num_pages or num_pages_for_budget(
            config.kv_cache_memory, page_size=self.page_size, bytes_per_token=self.bytes_per_token)
        self.max_prefill_chunk = max(config.prefill_lengths)
        self.eos_token_ids = frozenset(eos_token_ids or model_cfg.eos_token_ids)
        self.vocab_size = model_cfg.vocab_size
        self.buckets = Buckets.build(max_slots=self.max_slots, max_pages_per_seq=self.max_pages_per_seq,
                                     prefill_lengths=config.prefill_lengths, page_size=self.page_size)

        self.cache = init_kv_cache(model_cfg, self.num_pages, self.page_size, kv_dtype)
        # penalty state per slot; row max_slots is a scratch row that padding rows read and write
        self.output_counts = jnp.zeros((self.max_slots + 1, self.vocab_size), jnp.int32)
        self.prompt_mask = jnp.zeros((self.max_slots + 1, self.vocab_size), bool)
        self._slot_sampling = SamplingArrays.from_params([], [], [], self.max_slots + 1)
        self._slot_steps = np.zeros(self.max_slots + 1, np.int32)
        self._slot_logprobs = np.full(self.max_slots + 1, -1, np.int32)  # -1: not asked

        self._decode_jit = jax.jit(self._decode_step, donate_argnums=(1,))
        self._sample_jit = jax.jit(self._sample_step, donate_argnums=(1,))
        self._prefill_jit = jax.jit(self._prefill_step, donate_argnums=(1,))
        self._set_row_jit = jax.jit(self._set_row, donate_argnums=(0, 1))
        self._decode_exe: dict[tuple[int, int], jax.stages.Compiled] = {}
        self._prefill_exe: dict[tuple[int, int], jax.stages.Compiled] = {}
        self._sample_exe: dict[int, jax.stages.Compiled] = {}
        self.compile_seconds = 0.0
        if precompile:
            self.compile_all(progress=progress)

    # ---- jitted bodies ----------------------------------------------------------------------

    def _decode_step(self, params, cache, tokens, positions, write_slots, block_tables):
        logits, cache = forward_paged(params, self.model_cfg, cache, tokens[:, None], positions[:, None],
                                      write_slots[:, None], block_tables, jnp.zeros_like(tokens),
                                      page_size=self.page_size, dtype=self.dtype)
        return logits, cache

    @staticmethod
    def _sample_step(logits, state, slot_ids, active, sarrays):
        # compiled per batch bucket only (not per page bucket): sampling is costly to compile
        # A batch without penalties neither reads nor updates the [B, V] counts (12 MB of gather
        # and scatter at 32 rows): a row's penalties are fixed for its life and insert() rebuilds
        # its counts, so rows that never use them need not keep them.
        counts, pmask = state
        logits = logits.astype(jnp.float32)

        def penalized():
            rows_counts = counts[slot_ids]                                  # [B,V]
            result = sample_penalized(logits, apply_penalties(logits, sarrays, rows_counts, pmask[slot_ids]),
                                      sarrays)
            return result, counts.at[slot_ids].set(update_counts(rows_counts, result.token, active))

        result, counts = jax.lax.cond(penalties_active(sarrays), penalized,
                                      lambda: (sample_penalized(logits, logits, sarrays), counts))
        return result, (counts, pmask)

    def _prefill_step(self, params, cache, tokens, positions, write_slots, block_tables):
        _, cache = forward_paged(params, self.model_cfg, cache, tokens, positions, write_slots,
                                 block_tables, jnp.zeros(tokens.shape[:1], jnp.int32),
                                 page_size=self.page_size, dtype=self.dtype)
        return cache

    @staticmethod
    def _set_row(counts, pmask, slot, counts_row, mask_row):
        return counts.at[slot].set(counts_row), pmask.at[slot].set(mask_row)

    # ---- ahead-of-time compilation ----------------------------------------------------------

    def _decode_args(self, b: int, p: int):
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        return (self.params, self.cache, i32(b), i32(b), i32(b), i32(b, p))

    def _sample_args(self, b: int):
        sarrays = jax.tree.map(lambda x: jax.ShapeDtypeStruct((b,) + x.shape[1:], x.dtype), self._slot_sampling)
        return (jax.ShapeDtypeStruct((b, self.vocab_size), jnp.float32), (self.output_counts, self.prompt_mask),
                jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((b,), bool), sarrays)

    def _prefill_args(self, t: int, p: int):
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        return (self.params, self.cache, i32(1, t), i32(1, t), i32(1, t), i32(1, p))

    def compile_all(self, *, progress: bool = False) -> None:
        """Compile every bucket now (or load it from the persistent cache), on all host cores."""
        start = time.perf_counter()
        jobs = [(self._sample_exe, b, self._sample_jit.lower(*self._sample_args(b)))
                for b in self.buckets.decode_batches]
        jobs += [(self._decode_exe, s, self._decode_jit.lower(*self._decode_args(*s)))
                 for s in self.buckets.decode_shapes()]
        jobs += [(self._prefill_exe, s, self._prefill_jit.lower(*self._prefill_args(*s)))
                 for s in self.buckets.prefill_shapes()]
        # XLA compiles release the GIL, so a thread per core overlaps them
        with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
            futures = {pool.submit(lowered.compile): (table, shape) for table, shape, lowered in jobs}
            for future in tqdm(as_completed(futures), total=len(futures), desc="compiling buckets",
                               unit="bucket", file=sys.stderr, disable=not progress, leave=False):
                table, shape = futures[future]
                table[shape] = future.result()
        # the row setter is tiny: compile it now too so steady state never compiles
        self.output_counts, self.prompt_mask = self._set_row_jit(
            self.output_counts, self.prompt_mask, np.int32(self.max_slots),
            np.zeros(self.vocab_size, np.int32), np.zeros(self.vocab_size, bool))
        self.compile_seconds = time.perf_counter() - start

    def _exe(self, table: dict, shape, jitted, args_fn):
        exe = table.get(shape)
        if exe is None:  # only when precompile=False (tests of a single shape)
            args = args_fn(*shape) if isinstance(shape, tuple) else args_fn(shape)
            exe = table[shape] = jitted.lower(*args).compile()
        return exe

    @property
    def compile_count(self) -> int:
        return compile_count.compiles()

    # ---- Engine protocol --------------------------------------------------------------------

    def _block_table(self, page_lists: Sequence[Sequence[int]], batch: int, pages: int) -> np.ndarray:
        table = np.zeros((batch, pages), np.int32)
        for i, ids in enumerate(page_lists):
            n = min(len(ids), pages)
            table[i, :n] = ids[:n]
        return table

    def prefill(self, chunk: PrefillChunk) -> None:
        n = len(chunk.token_ids)
        end = chunk.start_pos + n
        if n == 0:
            return
        if end > self.max_seq_len:
            raise ValueError(f"prefill past max_seq_len ({end} > {self.max_seq_len})")
        t = self.buckets.prefill_length(n)
        p = self.buckets.pages(pages_needed(end, self.page_size))
        pages = np.asarray(chunk.page_ids, np.int32)
        tokens = np.zeros((1, t), np.int32)
        positions = np.zeros((1, t), np.int32)
        slots = np.zeros((1, t), np.int32)
        pos = np.arange(chunk.start_pos, end, dtype=np.int32)
        tokens[0, :n] = chunk.token_ids
        positions[0, :n] = pos
        slots[0, :n] = pages[pos // self.page_size] * self.page_size + pos % self.page_size
        table = self._block_table([chunk.page_ids], 1, p)
        exe = self._exe(self._prefill_exe, (t, p), self._prefill_jit, self._prefill_args)
        self.cache = exe(self.params, self.cache, tokens, positions, slots, table)

    def insert(self, slot: int, state: SlotState) -> None:
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.max_slots})")
        params = state.params
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        row = SamplingArrays.from_params([params], [seed], [0], 1)
        for field in dataclasses.fields(SamplingArrays):
            getattr(self._slot_sampling, field.name)[slot] = getattr(row, field.name)[0]
        self._slot_steps[slot] = len(state.output_ids)
        self._slot_logprobs[slot] = -1 if params.logprobs is None else params.logprobs
        counts = np.bincount(np.asarray(state.output_ids, np.int64), minlength=self.vocab_size)[:self.vocab_size]
        self.output_counts, self.prompt_mask = self._set_row_jit(
            self.output_counts, self.prompt_mask, np.int32(slot), counts.astype(np.int32),
            prompt_mask_row(state.prompt_ids, self.vocab_size))

    def free(self, slot: int) -> None:
        self._slot_logprobs[slot] = -1

    def generate(self, rows: Sequence[DecodeRow]) -> list[Sampled]:
        n = len(rows)
        if n == 0:
            return []
        b = self.buckets.decode_batch(n)
        p = self.buckets.pages(max(pages_needed(r.position + 1, self.page_size) for r in rows))
        slot_ids = np.full(b, self.max_slots, np.int32)
        tokens = np.zeros(b, np.int32)
        positions = np.zeros(b, np.int32)
        write = np.zeros(b, np.int32)
        for i, r in enumerate(rows):
            if r.position >= self.max_seq_len:
                raise ValueError(f"decode past max_seq_len ({r.position} >= {self.max_seq_len})")
            slot_ids[i], tokens[i], positions[i] = r.slot, r.token_id, r.position
            write[i] = r.page_ids[r.position // self.page_size] * self.page_size + r.position % self.page_size
        table = self._block_table([r.page_ids for r in rows], b, p)
        active = np.arange(b) < n
        sarrays = jax.tree.map(lambda x: x[slot_ids], self._slot_sampling)
        sarrays = dataclasses.replace(sarrays, step=self._slot_steps[slot_ids])
        decode = self._exe(self._decode_exe, (b, p), self._decode_jit, self._decode_args)
        logits, self.cache = decode(self.params, self.cache, tokens, positions, write, table)
        sampler = self._exe(self._sample_exe, b, self._sample_jit, self._sample_args)
        result, (self.output_counts, self.prompt_mask) = sampler(
            logits, (self.output_counts, self.prompt_mask), slot_ids, active, sarrays)
        self._slot_steps[slot_ids[:n]] += 1
        host: SampleResult = jax.device_get(result)  # the step's one device -> host copy
        out = []
        for i, r in enumerate(rows):
            k = int(self._slot_logprobs[r.slot])
            lp = None
            if k >= 0:
                top = tuple((int(host.top_ids[i, j]), float(host.top_logprobs[i, j])) for j in range(k))
                lp = TokenLogprob(int(host.token[i]), float(host.logprob[i]), top)
            out.append(Sampled(int(host.token[i]), lp))
        return out
