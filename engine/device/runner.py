"""The JAX engine: owns the device arrays (KV pages, penalty state) and runs the jitted ragged step.

One model program per token bucket (a power-of-two ladder up to max_num_batched_tokens) and one
sampling program per sample-row bucket (engine/device/sample_program.py), all compiled ahead of time
(engine/device/programs.py); the KV pages and the penalty state are donated, so steps update them in
place. Implements engine/api.py's Engine. Its settings are engine/engine_config.py's; a batch's host
arrays are built by engine/step_inputs.py, into one buffer per program (engine/device/packed.py): a
step makes two host->device transfers, not twenty.
"""
from __future__ import annotations

import dataclasses
import functools
from concurrent.futures import Future
import secrets
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from slipstream.engine.device import compile_count
from slipstream.engine.api import Sampled, SlotState, StepBatch
from slipstream.engine.device.attention_layer import paged_attention
from slipstream.engine.device.buckets import Buckets
from slipstream.engine.device.engine_config import EngineConfig  # imported from here across the repo too
from slipstream.engine.request import MAX_TOP_LOGPROBS
from slipstream.engine.kv_cache import kv_bytes_per_token, num_pages_for_budget, pages_needed
from slipstream.engine.device.images import ImageEncoder
from slipstream.engine.device.launch import GrammarProgress, LaunchedStep, PooledRows, PreviousSamples, ScoredRows
from slipstream.engine.device.packed import Packing
from slipstream.engine.device.programs import CompileQueue, Programs
from slipstream.engine.device.sample_program import empty_state, packed_sample_step, set_row
from slipstream.engine.device.sampling import SamplingArrays, check_token_ids, logit_bias_row, prompt_mask_row
from slipstream.engine.device.lora_slots import LoraSlots
from slipstream.engine.device.step_inputs import previous_sources, sample_inputs, step_inputs, token_lora_slots
from slipstream.engine.structured import MaskFiller, Matcher, mask_words
from slipstream.engine.device.layer_stack import index_int8_stacks, split_linears
from slipstream.engine.device.params import prepare_model
from slipstream.engine.device.sharding import TensorParallel
from flax import nnx
from slipstream.kernels.attention import kv_layout
from slipstream.kernels.lora_delta import native_available as lora_native_available
from slipstream.models.base import CausalLM, init_kv_cache, step_fn
from slipstream.models.config import ModelConfig
from slipstream.models.lora import lora_targets
from slipstream.models.loader import trim_host_heap
from slipstream.quantization.layer_forms import bind_rows


# on accelerators, the smallest token bucket a scoring or pooling step runs at (Programs.extended_bucket)
EXTENDED_MIN_TOKENS = 128


class JaxEngine(Programs):
    """Paged-KV engine over one model replica (all local devices see the same arrays)."""

    def __init__(self, model_cfg: ModelConfig, model: CausalLM, config: EngineConfig = EngineConfig(), *,
                 eos_token_ids: Sequence[int] = (), progress: bool = False, precompile: bool = True,
                 devices: Sequence[jax.Device] | None = None) -> None:
        """model: a loaded models.base.CausalLM (models.loader.load_model); the engine rounds and casts
        its own copy of it (the caller's module is left as it is). devices: the tensor_parallel local
        devices this replica runs on (data parallel: engine.sharding.replica_devices); by default the
        first ones."""
        compile_count.install()
        if model.cfg != model_cfg:
            raise ValueError("model_cfg is not the config the model was built from")
        self.model_cfg, self.config = model_cfg, config
        self.dtype = config.activation_dtype()
        kv_dtype = config.kv_dtype()
        self.weight_mode = config.weight_mode()
        # LoRA: adapter slots over the linears as loaded (the engine's own forms of them come next)
        # (on XLA:CPU: packed stacks the native delta kernel reads at the layer index, per token)
        packed = (config.max_loras > 0 and jax.default_backend() == "cpu" and config.tensor_parallel == 1
                  and self.dtype == jnp.float32 and lora_native_available())
        self.lora = (LoraSlots(lora_targets(model), model_cfg.num_layers, config.max_loras, config.max_lora_rank,
                               self.dtype, packed=packed) if config.max_loras else None)
        # prompt rows on a second weight form (int8-channel-w16), generated tokens' rows on q8_0-a16
        self.prompt_w16 = config.prompt_w16()
        # tensor parallel: weights and KV pages split over a mesh; None keeps one device and no mesh
        # a data-parallel replica gets a mesh even on one device: it places the arrays on its device
        # (made first: it refuses a model it cannot split before the weights are rounded and packed)
        self.tp = (TensorParallel(model_cfg, config.tensor_parallel, devices=None if devices is None else list(devices))
                   if config.tensor_parallel > 1 or devices is not None else None)
        model = prepare_model(nnx.clone(model), self.weight_mode, self.dtype, progress=progress)
        model.cfg = model_cfg.for_context(config.max_seq_len)  # LongRoPE: the factors of the context served
        if jax.default_backend() == "cpu":  # XLA:CPU copies each weight out of a stack every step
            split_linears(model, stack_int8=config.tensor_parallel == 1,  # sharding splits PerLayer
                          prompt_w16=self.prompt_w16, expert_shards=config.tensor_parallel)
        elif config.tensor_parallel == 1:  # TPU: the int8 kernel reads each layer of a stack where it lies
            index_int8_stacks(model)
        # the step is a pure function of the weights' state: split once, merged inside the programs
        self.graphdef, self.params = nnx.split(model)
        # attention through the engine's layer: per device under shard_map when tensor parallel; given targets
        # (prompt logprobs) with every token's log-probabilities too, given pooled rows (embeddings) their sequences'
        # summed hidden states
        self._forward = step_fn(self.graphdef, attention=paged_attention,
                                score_top=min(MAX_TOP_LOGPROBS, model_cfg.vocab_size), num_pooled=config.max_slots)
        self._replicated = None  # the sharding of arrays every device holds whole (None: one device)
        cache_cfg = model_cfg
        if self.tp is not None:
            self.params = self.tp.place_params(self.params)
            self._forward = self.tp.under_mesh(self._forward)
            self._replicated = self.tp.replicated
            cache_cfg = self.tp.cache_config(model_cfg)
            if self.lora is not None:  # whole on every device; the partitioner splits the deltas' matmuls
                self.lora.stacks = jax.device_put(self.lora.stacks, self._replicated)
        self.max_slots = config.max_slots
        self.page_size = config.page_size or kv_layout(jax.default_backend()).page_size
        self.max_seq_len = min(config.max_seq_len, model_cfg.max_position_embeddings)
        self.max_pages_per_seq = pages_needed(self.max_seq_len, self.page_size)
        # per device: --kv-cache-memory budgets each device's share of the pages
        self.bytes_per_token = kv_bytes_per_token(
            num_layers=model_cfg.num_layers, head_dim=model_cfg.head_dim,
            n_kv_heads=self.tp.kv_heads_per_device if self.tp else model_cfg.num_kv_heads,
            dtype_bytes=kv_dtype.itemsize, scale_bytes=4 if kv_dtype == jnp.int8 else 0)
        self.num_pages = config.num_pages or num_pages_for_budget(
            config.kv_cache_memory, page_size=self.page_size, bytes_per_token=self.bytes_per_token)
        self.max_num_batched_tokens = config.step_tokens()
        self.eos_token_ids = frozenset(eos_token_ids or model_cfg.eos_token_ids)
        self.vocab_size = model_cfg.vocab_size
        self.hidden_size = model_cfg.hidden_size
        self.buckets = Buckets.build(max_num_batched_tokens=self.max_num_batched_tokens, max_slots=self.max_slots)

        # The KV pages are allocated after compiling: compilation's working memory and the cache
        # then never add up in the peak RSS (the cache is the largest buffer the server holds).
        self.kv_dtype = kv_dtype  # the K/V pages' dtype (EngineConfig.kv_dtype)
        make_cache = functools.partial(init_kv_cache, cache_cfg, self.num_pages, self.page_size, kv_dtype)
        self._cache_spec = jax.eval_shape(make_cache)
        self.cache = None
        # sampling state per slot (penalty counts, prompt masks, logit biases); row max_slots is a scratch row that
        # padding rows read and write
        self.sampling_state = empty_state(self.max_slots + 1, self.vocab_size)
        self._slot_sampling = SamplingArrays.from_params([], [], [], self.max_slots + 1)
        self._slot_prompt_len = np.zeros(self.max_slots + 1, np.int32)  # a row's seed step: its token's index
        self._slot_logprobs = np.full(self.max_slots + 1, -1, np.int32)  # -1: not asked
        self._slot_prompt_logprobs = np.zeros(self.max_slots + 1, np.int32)  # alternatives per scored prompt token
        # min_tokens: per slot, the output index from which EOS and its stop tokens may be sampled, and the packed
        # mask row of every other token
        self._slot_min_tokens: dict[int, tuple[int, np.ndarray]] = {}
        self._slot_allowed: dict[int, np.ndarray] = {}  # allowed_token_ids: per slot, its packed mask row
        # structured output: a grammar matcher per constrained slot; the host fills their mask rows
        # while the model program runs, the sampling program applies them
        self._matchers: dict[int, Matcher] = {}
        self._mask_filler = MaskFiller(self.vocab_size, self.eos_token_ids)
        self._no_mask: dict[int, jax.Array] = {}  # sample rows -> all-ones mask
        # host time of the grammars (benchmarks report it per constrained token)
        self.mask_seconds = 0.0     # filling mask rows
        self.grammar = GrammarProgress()  # matchers waiting for their launched samples, and their time
        self.masked_rows = 0

        # the first argument of both programs is the static Packing of their one host array
        self._model_jit = jax.jit(self._model_step, static_argnums=(0,), donate_argnums=(2,))
        if self.tp is not None:  # logits and sampling state whole on every device, pages split
            self._cache_spec = self.tp.sharded_spec(self._cache_spec)
            self._model_jit = jax.jit(self._model_step, static_argnums=(0,), donate_argnums=(2,), out_shardings=(
                self._replicated, self.tp.cache_shardings(self._cache_spec)))
            self.sampling_state = jax.device_put(self.sampling_state, self._replicated)
        self._sample_jit = jax.jit(packed_sample_step, static_argnums=(0,), donate_argnums=(2, 3))
        self._set_row_jit = jax.jit(set_row, donate_argnums=(0,))
        self._model_exe: dict[int, jax.stages.Compiled] = {}
        # with the hybrid weights: the decode buckets' programs for steps of generated tokens only (no split bound:
        # q8_0-a16 alone, as without the hybrid), beside the split ones in _model_exe
        self._generated_exe: dict[int, jax.stages.Compiled] = {}
        self._generated_buckets = (tuple(t for t in self.buckets.token_counts if t <= self.max_slots)
                                   if self.prompt_w16 else ())
        self._sample_exe: dict[int, jax.stages.Compiled] = {}
        # the model programs that also score every token (prompt logprobs) or pool rows (embeddings), per token bucket
        # (Programs.EXTENDED): on accelerators compiled on a thread once the engine is up (compile_extended), on CPU
        # (seconds each, on the cores that serve) when a step first needs its bucket's
        self._extended_exe: dict[tuple[int, bool, bool, bool], jax.stages.Compiled] = {}
        self.extended_min_tokens = 1 if jax.default_backend() == "cpu" else EXTENDED_MIN_TOKENS
        self._extended_compiling: dict[tuple[int, bool, bool, bool], Future] = {}  # the thread's compiles
        # a vision-language model's tower program and the encoded rows of the images steps are feeding (at most one
        # per slot mid-prefill, and a couple that a preempted or cancelled sequence left; an image pushed out is
        # encoded again if needed); steps with image rows run the image form of the model program
        # (Programs._extended_program: compiled at first use on CPU, in the background on accelerators)
        self.images = (ImageEncoder(self.graphdef, self.dtype, self.hidden_size, max_held=self.max_slots + 2,
                                    sharding=self._replicated)
                       if model_cfg.vision is not None else None)
        self._compile_thread: CompileQueue | None = None
        self.compile_seconds = 0.0
        self.lower_seconds = 0.0
        self.programs_loaded = 0  # of them, whole executables from the cache directory (no tracing)
        if precompile:
            self.compile_all(progress=progress)
            if self.images is not None:  # the tower's program at the model's image size
                self.images.compile(self.params, model_cfg.vision.image_size)
        trim_host_heap()
        self.cache = self.tp.init_cache(make_cache, self._cache_spec) if self.tp else make_cache()
        if precompile and jax.default_backend() != "cpu":
            self.compile_extended()

    # ---- jitted bodies ----------------------------------------------------------------------

    def _model_step(self, packing: Packing, params, cache, last, packed, lora_stacks=None, embeds=None):
        """-> (logits of the sample rows, cache); with the packing's `targets` (scoring) or `pool` (embeddings),
        ((those logits, models.base.extended_step's extras), cache). embeds [T, D]: the image rows of the rows the
        packing's `embedded` marks."""
        x = packing.unpack(packed)  # step_inputs.model_packing's arrays
        # a decode fed by the step in flight (PREVIOUS_SAMPLE) takes its slot's latest sample, which
        # never left the device: src i32[T] names that slot, -1 elsewhere (one program, not two)
        tokens = jnp.where(x["src"] >= 0, last[jnp.maximum(x["src"], 0)], x["tokens"])
        if "prompt_from" in x:  # i32[]: the step's rows from it on are prompt rows (the hybrid's w16 form)
            params = bind_rows(params, x["prompt_from"])
        if lora_stacks is not None:  # LoRA deltas on the linears, by each token's slot i32[T]
            params = self.lora.attach(params, lora_stacks, x["lora_slots"])
        inputs = (tokens, x["positions"], x["kv_lens"], x["page_indices"], x["cu_q_lens"], x["num_seqs"],
                  x["sample_index"])
        extras = {name: x[name] for name in ("targets", "alternatives", "pool") if name in x}
        if "embedded" in x:
            extras.update(embeds=embeds, embedded=x["embedded"])
        return self._forward(params, cache, *inputs, **extras, dtype=self.dtype)

    @property
    def max_loras(self) -> int:
        """LoRA adapter slots on the device (0: no LoRA)."""
        return 0 if self.lora is None else self.lora.max_loras

    @property
    def compile_count(self) -> int:
        return compile_count.compiles()

    # ---- Engine protocol --------------------------------------------------------------------

    def insert(self, slot: int, state: SlotState) -> None:
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.max_slots})")
        params = state.params
        if state.lora_slot:
            if self.lora is None:
                raise ValueError(f"slot {slot}: a LoRA adapter needs an engine with LoRA slots (max_loras)")
            if state.lora is not None:
                self.lora.ensure(state.lora_slot, state.lora)
            elif not 1 <= state.lora_slot <= self.lora.max_loras or self.lora.resident[state.lora_slot] is None:
                # a multi-host worker gets an adapter's weights only with the insert that loads it
                raise ValueError(f"slot {slot}: LoRA slot {state.lora_slot} holds no adapter")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        row = SamplingArrays.from_params([params], [seed], [0], 1)
        for field in dataclasses.fields(SamplingArrays):
            getattr(self._slot_sampling, field.name)[slot] = getattr(row, field.name)[0]
        self._slot_prompt_len[slot] = len(state.prompt_ids)
        self._slot_logprobs[slot] = -1 if params.logprobs is None else params.logprobs
        self._slot_prompt_logprobs[slot] = params.prompt_logprobs or 0
        self._matchers.pop(slot, None)
        self._slot_min_tokens.pop(slot, None)
        self._slot_allowed.pop(slot, None)
        if params.allowed_token_ids is not None:
            check_token_ids(params.allowed_token_ids, self.vocab_size)
            self._slot_allowed[slot] = self._mask_filler.packed(params.allowed_token_ids)
        if params.min_tokens and params.constraint is None:  # a grammar decides where a constrained reply ends
            ending = sorted({*self.eos_token_ids, *(t for t in params.stop_token_ids if t < self.vocab_size)})
            self._slot_min_tokens[slot] = (params.min_tokens, ~self._mask_filler.packed(ending))
            if params.allowed_token_ids is not None and set(params.allowed_token_ids) <= set(ending):
                raise ValueError("allowed_token_ids holds only tokens that min_tokens refuses")
        if params.constraint is not None:
            matcher = params.constraint.matcher()
            for token in state.output_ids:  # a preempted sequence resumes where its output is
                matcher.advance(token)
            self._matchers[slot] = matcher
        check_token_ids(state.prompt_ids, self.vocab_size)
        if not params.penalized:
            # Penalties 1/0/0 leave every logit as it is whatever the slot's counts and prompt mask
            # hold, so a request without penalties reads neither: its slot's row keeps the last
            # penalized holder's state (plus this one's tokens) and no row is written: no upload of
            # two vocab-wide rows and no program per admission (a penalized one rebuilds its row).
            return
        counts = None  # no output yet (not a resumed preemption): zeros, written on the device
        if len(state.output_ids):
            counts = np.bincount(np.asarray(state.output_ids, np.int64),
                                 minlength=self.vocab_size)[:self.vocab_size].astype(np.int32)
        mask = prompt_mask_row(state.prompt_ids, self.vocab_size)
        self.sampling_state = self._set_row_jit(self.sampling_state, np.int32(slot), counts, mask,
                                                *logit_bias_row(params.logit_bias, self.vocab_size))

    @property
    def sampling_state(self) -> tuple[jax.Array, ...]:
        """The sampling program's per-slot state, donated to it and to the row setter: token counts, prompt
        masks, logit-bias ids and biases."""
        return self.output_counts, self.prompt_mask, self.bias_ids, self.bias_values

    @sampling_state.setter
    def sampling_state(self, state: tuple[jax.Array, ...]) -> None:
        self.output_counts, self.prompt_mask, self.bias_ids, self.bias_values = state

    def free(self, slot: int) -> None:
        self._slot_logprobs[slot] = -1
        self._matchers.pop(slot, None)
        self._slot_min_tokens.pop(slot, None)
        self._slot_allowed.pop(slot, None)

    def step_inputs(self, batch: StepBatch, out: dict[str, np.ndarray] | None = None,
                    ) -> tuple[int, tuple[np.ndarray, ...], list[int]]:
        """Host arrays of the model program for `batch`: (token bucket, inputs, sampled rows' slots)
        (step_inputs.step_inputs: into `out`'s arrays when given)."""
        return step_inputs(batch, self.buckets, max_slots=self.max_slots, max_pages_per_seq=self.max_pages_per_seq,
                           max_seq_len=self.max_seq_len, page_size=self.page_size, out=out)

    def prompt_rows_from(self, batch: StepBatch) -> int:
        """The step's first prompt row (StepBatch.prompt_rows_from over the prompt lengths insert bound): the
        hybrid weights' split (EngineConfig.prompt_w16)."""
        return batch.prompt_rows_from(self._slot_prompt_len)

    def _run_model(self, batch: StepBatch) -> tuple[int, jax.Array, list[int], ScoredRows | None, PooledRows | None]:
        """Launch the step's model program: (token bucket, the sample rows' logits, their slots, the scores of
        the sequences with targets and the pooled rows of those that pool, if any)."""
        score = any(seq.targets for seq in batch.seqs)
        pool = any(seq.pool for seq in batch.seqs)
        images = any(seq.images for seq in batch.seqs)
        if images and self.images is None:
            raise ValueError("a step feeds image rows to a model without a vision tower")
        t = self.buckets.tokens(batch.num_tokens)
        if score or pool or images:
            t = self.extended_bucket(t)
        prompt_from = self.prompt_rows_from(batch) if self.prompt_w16 else None
        split = prompt_from is not None and not (prompt_from == batch.num_tokens and t in self._generated_buckets)
        if score or pool or images:
            model = self._extended_program(t, score, pool, images)
        elif prompt_from is not None and not split:
            # generated tokens only (decodes, verification): the program without the prompt form's calls
            model = self._exe(self._generated_exe, t, self._model_jit, functools.partial(self._model_args, split=False))
        else:
            model = self._exe(self._model_exe, t, self._model_jit, self._model_args)
        # the program's one host array, written in place
        packed, x = self._model_packing(t, split, score=score, pool=pool, images=images).host()
        _, (tokens, *_), sample_slots = self.step_inputs(batch, x)
        src = previous_sources(batch, tokens, x["cu_q_lens"])
        x["src"][:] = -1 if src is None else src
        if self.lora is not None:
            x["lora_slots"][:] = token_lora_slots(batch, t, self.lora.max_loras)
        if split:
            x["prompt_from"][...] = prompt_from
        scored = pooled = None
        if score:
            scored = ScoredRows.of(batch, self._slot_prompt_logprobs)
            x["targets"][:] = scored.targets(t)
            x["alternatives"][...] = max(k for *_, k in scored.rows)
        if pool:
            pooled = PooledRows.of(batch, t, self.max_slots)
            x["pool"][:] = pooled.owners
        lora_stacks = None if self.lora is None else self.lora.stacks
        if images:
            embeds = self.images.embeds(self.params, batch, t, x["embedded"])
            out, self.cache = model(self.params, self.cache, self._previous.last, packed, lora_stacks, embeds)
        else:
            out, self.cache = model(self.params, self.cache, self._previous.last, packed, lora_stacks)
        if score or pool:
            out, extras = out
            if score:
                scored.device = extras["scores"]
            if pool:
                pooled.device = extras["pooled"]
        return t, out, sample_slots, scored, pooled

    @functools.cached_property
    def _previous(self) -> PreviousSamples:
        return PreviousSamples(self.max_slots, self._replicated)

    def _fill_mask(self, sample_slots: list[int], b: int, steps: np.ndarray) -> np.ndarray | jax.Array:
        """u32[b, ceil(V/32)]: the constrained rows' grammar masks, EOS and stop tokens refused in the rows short of
        their min_tokens (`steps`: each row's output index), all ones elsewhere."""
        rows = [self._matchers.get(slot) for slot in sample_slots]
        start = time.perf_counter()
        mask = self._mask_filler.fill(rows, b)
        if self._slot_min_tokens:
            short = {i: held[1] for i, slot in enumerate(sample_slots)
                     if (held := self._slot_min_tokens.get(slot)) is not None and steps[i] < held[0]}
            if short:
                mask = self._mask_filler.restrict(mask, b, short)
        if self._slot_allowed:
            limited = {i: row for i, slot in enumerate(sample_slots)
                       if (row := self._slot_allowed.get(slot)) is not None}
            if limited:
                mask = self._mask_filler.restrict(mask, b, limited)
        if mask is None:  # kept on the device: an unconstrained step uploads no mask
            if b not in self._no_mask:
                self._no_mask[b] = jax.device_put(np.full((b, mask_words(self.vocab_size)), 0xFFFFFFFF, np.uint32),
                                                  self._replicated)
            return self._no_mask[b]
        self.mask_seconds += time.perf_counter() - start
        self.masked_rows += sum(m is not None for m in rows)
        return mask

    def model_logits(self, batch: StepBatch) -> np.ndarray:
        """Run the step's model program (writing its K/V) without sampling: the logits [n, V] of the
        `sample` sequences, in order (tests and the perplexity tool)."""
        _, logits, sample_slots, *_ = self._run_model(batch)
        return np.asarray(logits)[:len(sample_slots)]  # sliced on the host: no program per row count

    def step(self, batch: StepBatch) -> list[Sampled]:
        return self.launch(batch).result()

    def launch(self, batch: StepBatch) -> LaunchedStep:
        for seq in batch.seqs:  # a grammar's mask needs the slot's latest token on the host
            if seq.sample and (matcher := self._matchers.get(seq.slot)) is not None and matcher in self.grammar.unadvanced:
                raise ValueError(f"slot {seq.slot} is grammar-constrained and its latest sample is not "
                                 "collected yet; collect the step in flight before launching its next one")
        t, logits, sample_slots, scored, pooled = self._run_model(batch)
        for extra in (scored, pooled):
            if extra is not None:
                extra.copy_to_host_async()
        n = len(sample_slots)
        if n == 0:
            return LaunchedStep(self.grammar, None, [], scored, pooled)
        b = self.buckets.sample_rows(t)
        packed, x = sample_inputs(batch, sample_slots, b, self._slot_sampling, self._slot_prompt_len)
        slot_ids = x["slot_ids"]
        bitmask = self._fill_mask(sample_slots, b, x["step"])  # on the host while the model program runs
        sampler = self._exe(self._sample_exe, b, self._sample_jit, self._sample_args)
        result, self.sampling_state, self._previous.last = sampler(
            logits, self.sampling_state, self._previous.last, packed, bitmask)
        # what the samples are read with is taken now: the slots may be rebound before result()
        matchers = self._matchers
        rows = list(zip(self._slot_logprobs[slot_ids[:n]].tolist(),
                        [matchers.get(slot) for slot in sample_slots] if matchers else [None] * n))
        if all(k < 0 for k, _ in rows):  # no logprobs asked: the tokens are all the host reads
            result = dataclasses.replace(result, logprob=None, top_ids=None, top_logprobs=None)
        for leaf in jax.tree.leaves(result):
            leaf.copy_to_host_async()  # the step's one device -> host copy starts when it is ready
        self.grammar.unadvanced.update(m for _, m in rows if m is not None)
        return LaunchedStep(self.grammar, result, rows, scored, pooled)
