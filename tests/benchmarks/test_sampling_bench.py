"""benchmarks/sampling_bench.py runs both paths of the sampling seam on a small vocab."""
from __future__ import annotations

from benchmarks import sampling_bench
from kernels import sampling as ks


def test_sampling_bench_times_every_setting_on_both_paths(capsys):
    assert sampling_bench.main(["--rows", "2", "--vocab", "300", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "| 2 |" in line]
    assert [line.split(" | ")[0][2:] for line in rows] == list(sampling_bench.SETTINGS)
    reference = sampling_bench.compiled(_shapes(), native=False).as_text()
    assert ks.TARGET not in reference  # the reference column really is the reference
    if ks.native_available():
        assert ks.TARGET in sampling_bench.compiled(_shapes(), native=True).as_text()


def _shapes():
    import jax
    import jax.numpy as jnp

    from engine.sampling import SamplingArrays
    from engine.structured import mask_words

    b, v = 2, 300
    sarrays = jax.tree.map(jnp.asarray, SamplingArrays.from_params([], [], [], b))
    return (jnp.zeros((b, v)), (jnp.zeros((3, v), jnp.int32), jnp.zeros((3, v), bool)),
            jnp.arange(b, dtype=jnp.int32), jnp.ones(b, bool), sarrays,
            jnp.full((b, mask_words(v)), 0xFFFFFFFF, jnp.uint32))
