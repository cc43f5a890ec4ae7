"""Every native kernel module has the shared module glue (kernels/cpu/csrc/runtime/module.h): targets() for
kernels.native, isa() and set_isa() over the instruction sets its kernel has paths for."""
from __future__ import annotations

import importlib

import pytest

from slipstream.kernels import native

MODULES = {  # module -> (FFI targets, its instruction sets, slowest first)
    "sampling": ({"slipstream_sample_tokens", "slipstream_top_logprobs"}, ("portable", "avx2", "avx512")),
    "f32_matmul": ({"slipstream_f32_matmul"}, ("portable", "avx2", "avx512")),
    "lora_delta": ({"slipstream_lora_delta"}, ("portable", "avx2", "avx512")),
    "q8_matmul": ({"slipstream_q8_matmul", "slipstream_q8_matmul_rows"}, ("portable", "avx2", "avx512_vnni", "amx")),
    "int8_channel_matmul": ({"slipstream_int8_channel_matmul", "slipstream_int8_channel_matmul_residual",
                             "slipstream_int8_channel_matmul_residual_rows", "slipstream_int8_channel_matmul_grouped"},
                            ("portable", "avx512_vnni", "amx")),
    "ragged_paged_attention": ({"slipstream_ragged_paged_attention", "slipstream_ragged_paged_attention_int8"},
                               ("portable", "avx2", "avx512", "avx512_vnni")),
}

if native.reference_forced():
    pytest.skip("SLIPSTREAM_KERNELS=reference: the native kernels are off", allow_module_level=True)


@pytest.mark.parametrize("module", list(MODULES))
def test_module_glue(module):
    try:
        ext = importlib.import_module(f"slipstream.kernels._{module}")
    except ImportError:
        pytest.fail(f"slipstream.kernels._{module} did not build: run `pip install -e .`", pytrace=False)
    targets, isas = MODULES[module]
    assert set(ext.targets()) == targets
    best = ext.isa()
    assert best in isas
    assert ext.set_isa("portable") == best  # returns the previous choice
    try:
        assert ext.isa() == "portable"
        for isa in isas[:isas.index(best) + 1]:
            ext.set_isa(isa)
            assert ext.isa() == isa
        for isa in isas[isas.index(best) + 1:]:  # above what this CPU runs: refused, the choice kept
            with pytest.raises(ValueError, match="cannot run"):
                ext.set_isa(isa)
            assert ext.isa() == best
        for name in {"sse9", "portable", "avx2", "avx512", "avx512_vnni", "amx"} - set(isas):  # no path of that name
            with pytest.raises(ValueError, match="unknown instruction set"):
                ext.set_isa(name)
    finally:
        ext.set_isa(best)
    assert ext.isa() == best


@pytest.mark.parametrize("asked,want", [("avx512", {"q8_matmul": "avx2", "f32_matmul": "avx512"}),
                                        ("avx2", {"q8_matmul": "avx2", "f32_matmul": "avx2"}),
                                        ("portable", {"q8_matmul": "portable", "f32_matmul": "portable"})])
def test_cpu_isa_setting_caps_every_module_at_its_best_path_below(monkeypatch, asked, want):
    # SLIPSTREAM_CPU_ISA: each module runs its highest path at or below the asked set (q8_matmul has no plain
    # AVX-512 path: avx512 means its AVX2 one); an unknown name leaves the best.
    for module, isa in want.items():
        ext = importlib.import_module(f"slipstream.kernels._{module}")
        best = ext.isa()
        if native.ISAS.index(best) < native.ISAS.index(isa):
            pytest.skip(f"this CPU's best for {module} is {best}")
        try:
            monkeypatch.setenv("SLIPSTREAM_CPU_ISA", asked)
            native._cap_isa(ext)
            assert ext.isa() == isa
            monkeypatch.setenv("SLIPSTREAM_CPU_ISA", "sse9")
            ext.set_isa(best)
            native._cap_isa(ext)
            assert ext.isa() == best
        finally:
            ext.set_isa(best)
