"""The device's own time per op for one call, from JAX's profiler (a TPU's "XLA Ops" lines): where a
step's time goes, free of the host's launch cost."""
from __future__ import annotations

import glob
import os
import shutil
import tempfile

import jax
from jax.profiler import ProfileData


def device_ops(call, top: int = 14, per: int = 1) -> tuple[list[str], list]:
    """One call of `call` under the profiler: (the device planes' line names, the `top` device ops by time:
    (name, us per 1/per of the call, count)), e.g. per = a scan's layers for a time per layer."""
    d = tempfile.mkdtemp()
    jax.profiler.start_trace(d)
    jax.block_until_ready(call())
    jax.profiler.stop_trace()
    paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    totals: dict[str, list] = {}
    lines = []
    for plane in ProfileData.from_file(paths[0]).planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            lines.append(f"{plane.name}:{line.name}")
            if "ops" not in line.name.lower():
                continue
            for e in line.events:
                t = totals.setdefault(e.name, [0.0, 0])
                t[0] += e.duration_ns
                t[1] += 1
    shutil.rmtree(d, ignore_errors=True)
    ops = sorted(((n, v[0] / 1e3 / per, v[1]) for n, v in totals.items()), key=lambda x: -x[1])
    return lines, ops[:top]
