"""How the lab measures: the round-robin timer every engine and kernel number comes from, CPU-time
rates, this host's copy and read speed, its name and f32 FMA peak, XLA ops by time (profiler), and
what the engine's step is judged against in the same run: a jitted program of only the decode step's
matmuls on the engine's own weights (the roofline) and the weight bytes a decode step must read.
Nothing here builds or steps an engine.
"""
from __future__ import annotations

import collections
import functools
import glob
import gzip
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from typing import TYPE_CHECKING, Callable

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:  # models (and flax) only where a model is measured: the TPU scripts import the timing helpers
    from slipstream.models.config import ModelConfig


def median_ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1e3


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def interleaved(fns: dict[str, Callable[[], object]], reps: int, warmup: int) -> dict[str, list[float]]:
    """Round-robin timing: every function sees the same background load, so ratios are fair."""
    for _ in range(warmup):
        for fn in fns.values():
            jax.block_until_ready(fn())
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(_timed(fn))
    return times


def cpu_timed(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """(median wall seconds, CPU seconds per call / cores): the second ignores other processes."""
    jax.block_until_ready(fn())
    times = []
    cpu = time.process_time()
    for _ in range(reps):
        times.append(_timed(fn))
    return statistics.median(times), (time.process_time() - cpu) / reps / (os.cpu_count() or 1)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _peak(program: str, flags: list[str], args: list[str]) -> float | None:
    """Builds benchmarks/<program>.c with `flags` and runs it with `args`: the rate it prints, or None without a
    C compiler (or when it prints 0: the CPU or OS lacks what it measures)."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, program)
        src = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{program}.c")
        subprocess.run([cc, "-O2", *flags, "-pthread", src, "-o", exe], check=True)
        rate = float(subprocess.run([exe, *args], check=True, capture_output=True, text=True).stdout)
        return rate or None


def fma_peak_gflops(threads: int) -> float | None:
    """This machine's f32 FMA peak over `threads` cores (benchmarks/fma_peak.c, per CPU-second)."""
    return _peak("fma_peak", ["-march=native"], [str(threads)])


def amx_peak(threads: int, kind: str) -> float | None:
    """This machine's AMX tile-unit peak over `threads` cores (benchmarks/amx_peak.c, per CPU-second): int8
    GOP/s or bf16 GFLOP/s of dense tile products; None where the OS grants no tile state."""
    return _peak("amx_peak", ["-mamx-tile", "-mamx-int8", "-mamx-bf16"], [str(threads), kind])


def copy_seconds(nbytes: int, reps: int) -> tuple[float, float]:
    """Median seconds to copy nbytes between two existing buffers (memcpy) and to read them once
    (an XLA sum). A jitted jnp.copy is no use here: its fresh 256 MB output is page-faulted in on
    every call, which measured ~1 GB/s on this host instead of the ~10 GB/s memcpy gets."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.zeros_like(src)
    x = jnp.asarray(src)
    times = interleaved({"copy": lambda: np.copyto(dst, src), "read": lambda: _read(x)}, reps, warmup=2)
    return statistics.median(times["copy"]), statistics.median(times["read"])


@jax.jit
def _read(x: jax.Array) -> jax.Array:
    return jnp.sum(x)


# Host-side runtime events, not XLA ops
_HOST = ("$", "Thunk", "Pjit", "PjRt", "Allocate", "Handle", "Parse", "Execute", "Await")


def profile_ops(fn: Callable[[], object], reps: int, top: int) -> list[tuple[str, float, int]]:
    """XLA ops by total time per call, from a profiler trace: (name, ms per call, calls per step).
    Ops on the two host threads overlap, so the sum exceeds the step's wall time."""
    jax.block_until_ready(fn())
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(reps):
                jax.block_until_ready(fn())
        with gzip.open(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)[0]) as f:
            events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and "dur" in e and not any(k in e["name"] for k in _HOST):
            total[e["name"]] += e["dur"]
            count[e["name"]] += 1
    return [(name, us / reps / 1e3, count[name] // reps) for name, us in total.most_common(top)]


def _leaf_bytes(tree) -> int:
    """Bytes of a params tree as a decode step reads it: a StackedQ8's AMX tiles serve only many-row calls, and a
    StackedHybrid's prompt form only prompt rows."""
    from slipstream.quantization.layer_forms import StackedHybrid, StackedQ8

    stacks = lambda v: isinstance(v, (StackedQ8, StackedHybrid))  # noqa: E731
    return sum(_leaf_bytes((leaf.default if isinstance(leaf, StackedHybrid) else leaf).weight) if stacks(leaf)
               else leaf.nbytes for leaf in jax.tree_util.tree_leaves(tree, is_leaf=stacks))


def weight_bytes_read_per_token(params, experts_read: float = 1.0) -> int:
    """Bytes a decode step must read (params: the engine's model state): every layer weight and the
    LM head (the tied embedding table is read whole by the LM head; untied, only a few rows of it); of a
    sparse MoE's experts the share `experts_read` (expert_share)."""
    head = params["lm_head"] if params.get("lm_head") else params["embed"]
    experts = _expert_bytes(params["blocks"])
    return (_leaf_bytes(params["blocks"]) - experts + round(experts * experts_read) + _leaf_bytes(head)
            + _leaf_bytes(params["final_norm"]))


def _expert_bytes(tree) -> int:
    from slipstream.quantization.experts import ExpertStack, PackedExperts

    stacks = lambda v: isinstance(v, (ExpertStack, PackedExperts))  # noqa: E731
    return sum(_leaf_bytes(leaf) for leaf in jax.tree_util.tree_leaves(tree, is_leaf=stacks) if stacks(leaf))


def expert_share(cfg, batch: int) -> float:
    """The expected share of a sparse MoE's experts that `batch` decoding tokens choose between them (each token
    num_experts_per_tok of num_experts, routed uniformly at random); 1 for a dense model."""
    if not cfg.num_experts:
        return 1.0
    return 1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** batch


def linear_forms(params) -> dict[str, int]:
    """How many of the layer stack's linear weights the engine holds in each form (params: the engine's
    model state): the class name (StackedInt8: int8 stacks the TPU kernel reads at the layer index;
    PerLayer, StackedQ8, FusedMember, ...: XLA:CPU's forms; Int8Weight: a stack the scan slices), or
    "array" for a float stack [L, in, out]."""
    from flax import nnx

    forms = collections.Counter()
    for _, var in nnx.to_flat_state(params["blocks"]):
        value = var.get_value()
        if isinstance(value, jax.Array):
            if value.ndim != 3:  # norms and biases [L, D]
                continue
            forms["array"] += 1
        else:
            forms[type(value).__name__] += 1
    return dict(sorted(forms.items()))


_GROUPS = {"attn": (("wq", "wk", "wv"), ("wo",)), "mlp": (("w_gate", "w_up"), ("w_down",))}


def matmul_roofline(params, cfg: ModelConfig) -> Callable[[jax.Array], jax.Array]:
    """A jitted function doing only the decode step's matmuls (q/k/v, o, gate/up, down for every
    layer, then the LM head) on the engine's own weights in the engine's form: int8 stacks read at
    each layer's index (fused groups as one call), per-layer buffers as separate inputs, so no slicing
    is counted. The few adds between them only keep XLA from dropping a matmul.
    (A Llama-layout model: params["blocks"] with attn/mlp linears.)"""
    from slipstream.engine.device.layer_stack import (PackedChannel, PerLayer, StackedChannel, StackedF32,
                                                      StackedHybrid, StackedInt8, StackedQ8)
    from slipstream.models.layers import linear
    from slipstream.quantization import int8

    def weight(group, name):  # a hybrid stack's decode form
        value = params["blocks"][group][name]["w"].get_value()
        return value.default if isinstance(value, StackedHybrid) else value

    def at_layer(value, i):
        if isinstance(value, PerLayer):
            return value.layers[i]
        return jax.tree.map(lambda a: a[i], value)

    def group_call(group, names, i):
        """(callable x -> outputs of the group at layer i, the arrays it reads)"""
        first = weight(group, names[0])
        if isinstance(first, StackedQ8):
            from slipstream.kernels.q8_matmul import q8_matmul

            w = first.weight

            def run(x, arrays):
                q, scale, offset = arrays
                y = q8_matmul(x, q, scale, offset, n=w.logical[1], parts=1 if w.mode == "q8_0" else 2, layer=i)
                return tuple(y[:, o:o + n] for o, n in zip(first.offsets, first.widths))

            return run, (w.q, w.scale, w.offset)
        if isinstance(first, StackedF32):
            from slipstream.kernels.f32_matmul import f32_matmul

            def run(x, packed):
                y = f32_matmul(x, packed, n=first.offsets[-1] + first.widths[-1], layer=i)
                return tuple(y[:, o:o + n] for o, n in zip(first.offsets, first.widths))

            return run, first.packed
        if isinstance(first, StackedChannel):
            from slipstream.kernels.int8_channel_matmul import int8_channel_matmul

            def run(x, arrays):
                y = int8_channel_matmul(x, *arrays, n=first.offsets[-1] + first.widths[-1], parts=first.parts, layer=i)
                return tuple(y[:, o:o + n] for o, n in zip(first.offsets, first.widths))

            return run, (first.packed, first.scales, first.colsum)
        if isinstance(first, StackedInt8):  # the TPU's int8 stacks: each read at the layer index
            def run(x, arrays):
                return tuple(int8.matmul(x, w, layer=i).astype(x.dtype) for w in arrays)

            return run, [weight(group, name).weight for name in names]
        ws = [at_layer(weight(group, name), i) for name in names]
        return (lambda x, arrays: tuple(linear(x, a) for a in arrays)), ws

    head_tied = not params.get("lm_head")
    head = params["embed"]["table"].get_value() if head_tied else params["lm_head"]["w"].get_value()
    reps = cfg.num_heads // cfg.num_kv_heads
    calls = [[group_call(group, names, i) for group in ("attn", "mlp") for names in _GROUPS[group]]
             for i in range(cfg.num_layers)]
    fns = [[fn for fn, _ in layer] for layer in calls]
    arrays = [[a for _, a in layer] for layer in calls]

    @jax.jit
    def run(arrays, head, x):
        for (qkv, o, gate_up, down), (a_qkv, a_o, a_gu, a_down) in zip(fns, arrays):
            q, k, v = qkv(x, a_qkv)
            o_out = o(q + jnp.tile(k + v, (1, reps)), a_o)[0]
            gate, up = gate_up(o_out, a_gu)
            x = x + down(gate * up, a_down)[0]
        if head_tied:
            return jnp.einsum("bd,vd->bv", x, head.astype(x.dtype), preferred_element_type=jnp.float32)
        if isinstance(head, PackedChannel):
            return head.linears(x, (head,))[0]
        return linear(x, head)

    return functools.partial(run, arrays, head)
