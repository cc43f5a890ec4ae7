"""Sections [6] and [7] of `python -m benchmarks.kernel int8` (benchmarks/kernel_int8.py's docstring): the
per-output-channel int8 kernel (kernels/int8_channel_matmul.py) against the q8 kernel at --rows, and where one
thread's time goes in its tile path (benchmarks/int8_channel_parts.cc)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernel_int8 import PREFILL_SHAPES, random_q8
from benchmarks.measure import amx_peak
from slipstream.kernels import q8_matmul as q8


CHANNEL_SHAPES = {name: shape for name, shape in PREFILL_SHAPES.items() if not name.startswith("lm_head")}


def channel_rows(rng: np.random.Generator, rows: list[int], reps: int) -> None:
    """[6]: the per-channel kernel's paths against the q8 kernel's default ones, timed alternately in one process."""
    from slipstream.kernels import int8_channel_matmul as icm

    if not icm.native_available():
        raise SystemExit("the native int8_channel_matmul kernel is not available (see the log above)")
    import slipstream.kernels._int8_channel_matmul as cext

    cores = len(os.sched_getaffinity(0))
    amx = cext.isa() == "amx"
    peak = amx_peak(cores, "int8") if amx else None
    print(f"\n[6] per-channel int8 (int8_channel_matmul isa {cext.isa()}) against q8_0 / q8_0-a16 (q8_matmul on its "
          "default paths); ms = median; GOP/s = 2*M*K*N / median (useful work, whatever the parts)"
          + (f"; AMX int8 peak on {cores} cores (benchmarks/amx_peak.c, same run): {peak:.0f} GOP/s, pk = share of it"
             if peak else ""))
    paths = [("q8_0", None), ("q8_0-a16", None)]
    for parts in (1, 2):
        paths += [(f"ch{parts} vnni", "avx512_vnni")] + ([(f"ch{parts} amx", "amx")] if amx else [])
    print(f"    {'shape':18} {'M':>4} | " + " | ".join(f"{name:>11} ms {'GOP/s':>6}" + (f" {'pk':>5}" if peak else "")
                                                     for name, _ in paths))
    prev_rows = cext.amx_rows(1)  # the tile unit at every row count where it is asked for
    try:
        for m in rows:
            for name, (k, n) in CHANNEL_SHAPES.items():
                x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
                q8w = random_q8(rng, k, n, offsets=False)
                q8o = random_q8(rng, k, n, offsets=True)
                q = rng.integers(-127, 128, (k, n)).astype(np.int8)
                packed, scales, colsum = (jnp.asarray(a) for a in icm.pack(q, rng.random(n).astype(np.float32) / 100))
                fns = {"q8_0": jax.jit(lambda x, w=q8w, n=n: q8.q8_matmul(x, *w[:2], n=n, parts=1)),
                       "q8_0-a16": jax.jit(lambda x, w=q8o, n=n: q8.q8_matmul(x, *w, n=n, parts=2))}
                for parts in (1, 2):
                    fn = jax.jit(lambda x, n=n, parts=parts: icm.int8_channel_matmul(x, packed, scales, colsum, n=n,
                                                                                     parts=parts))
                    fns[f"ch{parts} vnni"] = fns[f"ch{parts} amx"] = fn
                times: dict[str, list[float]] = {path: [] for path, _ in paths}
                for rep in range(reps + 1):  # rep 0 warms up
                    for path, isa in paths:
                        if isa:
                            cext.set_isa(isa)
                        t0 = time.perf_counter()
                        fns[path](x).block_until_ready()
                        if rep:
                            times[path].append(time.perf_counter() - t0)
                ops = 2.0 * m * k * n
                cells = []
                for path, _ in paths:
                    med = float(np.median(times[path]))
                    cells.append(f"{med * 1e3:14.3f} {ops / med / 1e9:6.0f}" + (f" {ops / med / 1e9 / peak:5.1%}" if peak else ""))
                print(f"    {name:18} {m:>4} | " + " | ".join(cells), flush=True)
    finally:
        cext.set_isa("amx" if amx else cext.isa())
        cext.amx_rows(prev_rows)


def channel_parts(rows: list[int], reps: int) -> None:
    """[7]: benchmarks/int8_channel_parts.cc on the default model's layer shapes, one and two parts."""
    if any(m % 32 for m in rows):
        raise SystemExit("--channel-parts times whole 2 x 2 tile blocks: --rows must be multiples of 32")
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise SystemExit("--channel-parts needs a C++ compiler")
    peak = amx_peak(1, "int8")
    if peak is None:
        raise SystemExit("--channel-parts needs AMX-INT8 and the OS's grant of the tile state")
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    print(f"\n[7] per-channel kernel's tile path, one thread (benchmarks/int8_channel_parts.cc; us best / median of "
          f"{reps}, thread CPU time); AMX int8 peak of one core (benchmarks/amx_peak.c, same run): {peak:.0f} GOP/s")
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "int8_channel_parts")
        libdir = sysconfig.get_config_var("LIBDIR") or ""  # the module's Python entry points link against libpython
        subprocess.run([cxx, "-O3", "-std=c++17", "-ffp-contract=off", "-fno-math-errno", "-w",
                        f"-I{os.path.join(root, 'kernels', 'cpu', 'csrc')}", f"-I{jax.ffi.include_dir()}",
                        f"-I{sysconfig.get_paths()['include']}", os.path.join(here, "int8_channel_parts.cc"), "-o", exe,
                        f"-L{libdir}", f"-lpython{sysconfig.get_python_version()}"], check=True)
        env = dict(os.environ, LD_LIBRARY_PATH=libdir)
        for m in rows:
            for name, (k, n) in CHANNEL_SHAPES.items():
                for parts in (1, 2):
                    out = subprocess.run([exe, str(m), str(k), str(n), str(parts), str(reps), f"{peak:.0f}"],
                                         check=True, capture_output=True, text=True, env=env).stdout.strip()
                    print(f"    {name:18} {out}", flush=True)
