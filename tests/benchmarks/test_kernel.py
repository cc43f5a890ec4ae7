"""benchmarks/kernel: `sampling` runs both paths of the sampling seam on a small vocab."""
from __future__ import annotations

from benchmarks import kernel
from slipstream.kernels import sampling as ks


def test_sampling_times_every_setting_on_both_paths(capsys):
    assert kernel.main(["sampling", "--rows", "2", "--vocab", "300", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "| 2 |" in line]
    assert [line.split(" | ")[0][2:] for line in rows] == list(kernel.SETTINGS)
    reference = kernel.compiled(_shapes(), native=False).as_text()
    assert ks.TARGET not in reference  # the reference column really is the reference
    if ks.native_available():
        assert ks.TARGET in kernel.compiled(_shapes(), native=True).as_text()


def _shapes():
    import jax
    import jax.numpy as jnp

    from slipstream.engine.device.sample_program import empty_state
    from slipstream.engine.device.sampling import DraftRows, SamplingArrays
    from slipstream.engine.structured import mask_words

    b, v = 2, 300
    sarrays = jax.tree.map(jnp.asarray, SamplingArrays.from_params([], [], [], b))
    return (jnp.zeros((b, v)), empty_state(3, v),
            jnp.arange(b, dtype=jnp.int32), jnp.ones(b, bool), sarrays,
            jnp.full((b, mask_words(v)), 0xFFFFFFFF, jnp.uint32), jax.tree.map(jnp.asarray, DraftRows.none(b)))


def test_attention_times_the_step_against_its_kv_read_bound(capsys):
    from benchmarks.kernel_attention import main as attention

    attention(["--seqs", "2", "--context", "32", "--layers", "2", "--reps", "2", "--kv-dtypes", "float32,int8",
               "--bandwidth-gib", "0.125"])  # 1 GiB drawn and summed 4 times took most of this test
    lines = [line for line in capsys.readouterr().out.splitlines() if "native:" in line or "reference:" in line]
    assert [line.split()[0] for line in lines] == ["float32", "int8"]
    assert all("bound" in line and "ratio" in line for line in lines)


def test_f32_compares_the_native_matmul_with_xla_on_each_shape(capsys):
    from slipstream.kernels import f32_matmul as fm

    rc = kernel.main(["f32", "--rows", "1", "--layers", "2", "--reps", "1"])
    if not fm.native_available():
        assert rc == 1
        return
    assert rc == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "(wall x" in line]
    assert len(rows) == len(kernel.SHAPES)
