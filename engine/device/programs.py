"""The engine's programs, compiled ahead of time: one model program per token bucket (and, with the hybrid
weights, per decode bucket for generated tokens only) and one sampling program per sample-row bucket, compiled
on every host core or loaded whole from the compile cache (engine/device/executables.py). JaxEngine's base
class: the engine (engine/device/runner.py) sets up the jitted functions, buckets and tables it fills."""
from __future__ import annotations

import atexit
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
import logging
import os
import queue
import re
import sys
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from slipstream.engine.device.executables import ExecutableStore, avals
from slipstream.engine.device.packed import Packing
from slipstream.engine.device.step_inputs import model_packing, sample_packing
from slipstream.engine.request import MAX_LOGIT_BIAS
from slipstream.engine.structured import mask_words

log = logging.getLogger(__name__)


class Programs:
    """Building, compiling and looking up the engine's programs (a base class of JaxEngine)."""

    def _model_packing(self, t: int, split: bool = True, score: bool = False, pool: bool = False,
                       images: bool = False) -> Packing:
        return model_packing(t, max_slots=self.max_slots, max_pages_per_seq=self.max_pages_per_seq,
                             sample_rows=self.buckets.sample_rows(t), lora=self.lora is not None,
                             prompt_from=self.prompt_w16 and split, targets=score, pool=pool, images=images)

    def _model_args(self, t: int, split: bool = True, score: bool = False, pool: bool = False, images: bool = False):
        packing = self._model_packing(t, split, score, pool, images)
        args = (packing, self.params, self._cache_spec, self._previous.spec, packing.spec(self._replicated),
                None if self.lora is None else self.lora.stacks)
        if images:  # the image rows [T, D] in the activation dtype (engine/device/images.py)
            args += (jax.ShapeDtypeStruct((t, self.hidden_size), self.dtype, sharding=self._replicated),)
        return args

    # The extended programs: the model program that also scores every token (prompt logprobs), pools rows
    # (embeddings) or feeds image rows (a vision-language model's prompt), or several, keyed (token bucket, score,
    # pool, images).
    EXTENDED = ((True, False), (False, True))  # the forms compile_extended makes ahead (both at once: at first use)

    def extended_bucket(self, t: int) -> int:
        """The token bucket an extended step of bucket t runs at: t, or on accelerators at least
        extended_min_tokens (there a step's time is flat up to about 128 rows, since every weight is read once
        whatever the row count, so padding a small one costs little; the ladder below it would be half the
        programs the background thread compiles, ~10 s each for Llama-3.2-1B on a v5e)."""
        return self.buckets.tokens(min(max(t, self.extended_min_tokens), self.buckets.token_counts[-1]))

    @property
    def extended_buckets(self) -> tuple[int, ...]:
        return tuple(sorted({self.extended_bucket(t) for t in self.buckets.token_counts}))

    def compile_extended(self) -> None:
        """The scoring and the pooling programs (and a vision-language model's image programs) of every token bucket,
        largest first: loaded whole from the compile cache when the engine's own programs came from there and it holds
        these too; else lowered here, now, and compiled one after another on a thread of their own (a step that needs
        one waits for it, or compiles it if the thread has not begun it), each saved to the cache. Lowering is Python
        (tracing, the Pallas kernels' lowering) and holds the GIL, which the serving thread needs between its device
        calls: lowered on the thread, it slowed every step while the ladder ran (OLMoE-1B-7B on a TPU v5e: a 1-slot
        decode step 33 ms instead of 4.5); XLA's compile releases it. Without this, the first step that scores, pools
        or feeds image rows at a bucket compiles its program."""
        # and with a vision tower the image form (the model program with an image-rows input)
        forms = [(score, pool, False) for score, pool in self.EXTENDED]
        if self.images is not None:
            forms.append((False, False, True))
        keys = [(t, *form) for t in reversed(self.extended_buckets) for form in forms
                if (t, *form) not in self._extended_exe and (t, *form) not in self._extended_compiling]
        if not keys:
            return
        start = time.perf_counter()
        store = self._executable_store()
        names = [_extended_file(key) for key in keys]
        loaded = store.load_all(names) if store is not None and self.programs_loaded else None
        if loaded:
            self._extended_exe.update((key, loaded[name]) for key, name in zip(keys, names))
            self.programs_loaded += len(loaded)
            log.info("loaded %d prompt-scoring, pooling and image programs in %.1f s", len(loaded),
                     time.perf_counter() - start)
            return
        if self._compile_thread is None:
            self._previous  # noqa: B018 - made on this thread: the compile's arguments read its spec
            self._compile_thread = CompileQueue()
        for key in keys:
            lowered = self._lower_extended(key)
            self._extended_compiling[key] = self._compile_thread.submit(self._compile_extended, key, lowered, store)
        seconds = time.perf_counter() - start
        self.lower_seconds += seconds
        log.info("lowered %d prompt-scoring, pooling and image programs in %.1f s; compiling them on a thread",
                 len(keys), seconds)

    def wait_extended(self, timeout: float | None = None) -> float:
        """Wait for the thread's compiles (benchmarks time steps once they are done); the seconds waited."""
        start = time.perf_counter()
        for compiling in list(self._extended_compiling.values()):
            compiling.result(timeout=timeout)
        return time.perf_counter() - start

    def _lower_extended(self, key: tuple[int, bool, bool, bool]) -> jax.stages.Lowered:
        t, score, pool, images = key
        return self._model_jit.lower(*self._model_args(t, score=score, pool=pool, images=images))

    def _compile_extended(self, key: tuple[int, bool, bool, bool], lowered: jax.stages.Lowered | None = None,
                          store: ExecutableStore | None = None) -> jax.stages.Compiled:
        start = time.perf_counter()
        t, score, pool, images = key
        lowered = lowered or self._lower_extended(key)
        exe = store.compile(lowered) if store is not None else lowered.compile()
        if store is not None:
            store.save(_extended_file(key), exe)
        log.info("compiled the %s program (%d tokens) in %.1f s", _extended_name(score, pool, images), t,
                 time.perf_counter() - start)
        return exe

    def _extended_program(self, t: int, score: bool, pool: bool, images: bool = False) -> jax.stages.Compiled:
        """The extended program of token bucket t: compiled now if it is not yet (or waited for, if the thread is at
        it). Always the step's own bucket, whatever is compiled: every process of a multi-host group runs the same
        program."""
        key = (t, score, pool, images)
        exe = self._extended_exe.get(key)
        if exe is None:
            compiling = self._extended_compiling.pop(key, None)
            if compiling is not None and compiling.cancel():  # still queued behind others: compiled here, now
                compiling = None
            if compiling is None:
                log.info("compiling the %s program (%d tokens), asked for by a request",
                         _extended_name(score, pool, images), t)
            exe = self._extended_exe[key] = (compiling.result() if compiling is not None
                                             else self._compile_extended(key))
        return exe

    def _sample_args(self, b: int):
        packing = sample_packing(b)
        return (packing, jax.ShapeDtypeStruct((b, self.vocab_size), jnp.float32, sharding=self._replicated),
                self.sampling_state, self._previous.spec, packing.spec(self._replicated),
                jax.ShapeDtypeStruct((b, mask_words(self.vocab_size)), jnp.uint32))

    @property
    def num_programs(self) -> int:
        """Model and sampling programs."""
        return len(self.buckets.token_counts) + len(self._generated_buckets) + len(self.buckets.sample_row_counts)

    def compile_all(self, *, progress: bool = False) -> None:
        """Compile every bucket now (or load it from the persistent cache), on all host cores."""
        start = time.perf_counter()
        store = self._executable_store()
        reuse = store is not None and store.replay_kernels()  # none saved yet, or a native module is missing
        programs = [(self._sample_exe, b, f"sample-{b}", self._sample_jit, self._sample_args(b))
                    for b in self.buckets.sample_row_counts]
        programs += [(self._model_exe, t, f"model-{t}", self._model_jit, self._model_args(t))
                     for t in reversed(self.buckets.token_counts)]  # the slowest first
        programs += [(self._generated_exe, t, f"model-{t}-generated", self._model_jit,
                      self._model_args(t, split=False)) for t in self._generated_buckets]
        loaded = store.load_all([name for *_, name, _, _ in programs]) if reuse else None
        if loaded:  # all or none: an engine never mixes loaded programs with ones traced here
            for table, shape, name, _, _ in programs:
                table[shape] = loaded[name]
        jobs = [] if loaded else [(table, shape, name, jitted.lower(*args)) for table, shape, name, jitted, args in programs]
        self.lower_seconds = time.perf_counter() - start  # tracing in Python (or loading whole executables)
        # XLA compiles release the GIL, so a thread per core overlaps them
        with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
            compile_ = store.compile if store else (lambda lowered: lowered.compile())
            futures = {pool.submit(compile_, lowered): (table, shape, name) for table, shape, name, lowered in jobs}
            for future in tqdm(as_completed(futures), total=len(futures), desc="compiling buckets",
                               unit="program", file=sys.stderr, disable=not progress, leave=False):
                table, shape, name = futures[future]
                table[shape] = future.result()
                if store:
                    store.save(name, table[shape])
        if store:
            if jobs:
                store.save_kernels()
            store.prune()
            self.programs_loaded = store.loaded
        if self.lora is not None:  # and the adapter slot writer: loading adapters never compiles
            self.lora.compile()
        # the row setter is tiny: compile it now too (both forms) so steady state never compiles
        for counts_row in (np.zeros(self.vocab_size, np.int32), None):
            self.sampling_state = self._set_row_jit(
                self.sampling_state, np.int32(self.max_slots), counts_row, np.zeros(self.vocab_size, bool),
                np.zeros(MAX_LOGIT_BIAS, np.int32), np.zeros(MAX_LOGIT_BIAS, np.float32))
        self.compile_seconds = time.perf_counter() - start

    def _executable_store(self) -> ExecutableStore | None:
        """Whole compiled programs in the server's compile cache (engine/device/executables.py), keyed by
        what they are built from; on one device without a mesh (a sharded engine traces and uses JAX's cache)."""
        if self.tp is not None:
            return None

        def identity() -> str:  # object addresses in reprs are not part of it
            text = "\n".join([repr(self.model_cfg), repr(self.config), repr(self.graphdef), repr(self.buckets),
                              avals((self._model_args(self.buckets.token_counts[0]),
                                     self._sample_args(self.buckets.sample_row_counts[0])))])
            return re.sub(r"0x[0-9a-f]+", "0x", text)

        return ExecutableStore.enabled(jax.devices()[:1], identity)

    def _exe(self, table: dict, shape: int, jitted, args_fn):
        exe = table.get(shape)
        if exe is None:  # only when precompile=False (tests of a single shape)
            exe = table[shape] = jitted.lower(*args_fn(shape)).compile()
        return exe


def _extended_file(key: tuple[int, bool, bool, bool]) -> str:
    t, *on = key
    return f"model-{t}-" + "-".join(name for name, yes in zip(("score", "pool", "images"), on) if yes)


def _extended_name(score: bool, pool: bool, images: bool = False) -> str:
    return " and ".join(name for name, on in (("prompt-scoring", score), ("pooling", pool), ("image", images)) if on)


class CompileQueue:
    """One daemon thread running queued compiles in order (Programs.compile_extended). Python joins the threads of a
    ThreadPoolExecutor at exit after their whole queue: a server drained and exiting while the ladder is queued then
    waited for all of it (minutes on an accelerator). A daemon thread is not joined, and an atexit hook lets the
    compile in progress finish (none is left half done in XLA while the interpreter finalizes) and drops the rest."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="slipstream-compile", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def stop(self, timeout: float | None = None) -> None:
        """Drop what is queued, and wait for the compile in progress."""
        self._stopped = True
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None and not self._stopped:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():  # cancelled: a step compiled it itself
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for it
                future.set_exception(exc)
