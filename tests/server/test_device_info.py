"""The start-up log's device and kernel lines say what runs where: on a backend other than CPU the
native (CPU-only) kernels are reported as the reference they fall back to."""
from __future__ import annotations

import jax

from slipstream.kernels import native
from slipstream.server import device_info


def test_device_summary_names_the_default_backend_device():
    line = device_info.device_summary()
    assert jax.devices()[0].device_kind in line and f"{jax.default_backend()} backend" in line


def test_native_kernels_count_as_reference_off_cpu(monkeypatch):
    monkeypatch.setattr(native, "_paths", {"q8_matmul": "native", "sampling": "reference", "attention": "pallas"})
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert device_info.kernel_paths_here() == {"q8_matmul": "native", "sampling": "reference", "attention": "pallas"}
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert device_info.kernel_paths_here() == {"q8_matmul": "reference", "sampling": "reference",
                                               "attention": "pallas"}
    assert device_info.kernel_summary() == "tpu: attention pallas, q8_matmul reference, sampling reference"
