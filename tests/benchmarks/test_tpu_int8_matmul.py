"""benchmarks/tpu_int8_matmul runs end to end on CPU (Pallas' TPU interpreter, one tiny shape): every kind
times (int8 with f32 or bf16 scales, 4-bit packed), each form matches XLA's product of the same values, and the
JSON holds it."""
from __future__ import annotations

import json

import pytest

from benchmarks import tpu_int8_matmul


def test_interpret_run_writes_every_kind(tmp_path, capsys):
    out = tmp_path / "r.json"
    tpu_int8_matmul.main(["--interpret", "--m", "3", "--shapes", "512x256", "--sweep", "256x128",
                          "--reps", "1", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["machine"]["platform"] == "cpu" and report["hbm_read_gbs"] > 0
    main, sweep = report["rows"]
    assert (main["phase"], main["k"], main["n"], main["m"], main["blocks"]) == ("main", 512, 256, 3, [512, 256])
    assert set(main["kinds"]) == {"bf16", "xla_int8", "kernel_slice", "kernel_index", "kernel_reshape",
                                  "kernel_via_int32", "kernel_bf16_scales", "kernel_int4", "kernel_int4_bf16_scales"}
    assert all(v["ms"] > 0 and "error" not in v for v in main["kinds"].values())
    diff = main["max_abs_diff"]
    for form in ("kernel", "kernel_reshape", "kernel_via_int32", "kernel_bf16_scales", "kernel_int4",
                 "kernel_int4_bf16_scales"):
        # a dequantized weight may round to the neighbouring bf16 where one side fuses q * s + o: a few
        # products off by 2^-8 of theirs; a wrong scale or offset row would be off by the product's size
        assert diff[form] <= 1e-2 * diff["max_abs_ref"]
    q4 = main["kinds"]["kernel_int4"]
    assert q4["int8_gbs"] * q4["ms"] * 1e6 == pytest.approx(512 * 256 // 2)  # the packed bytes: half int8's
    assert list(sweep["kinds"]) == ["kernel_256x128"] and sweep["kinds"]["kernel_256x128"]["ms"] > 0
    assert "done in" in capsys.readouterr().out
