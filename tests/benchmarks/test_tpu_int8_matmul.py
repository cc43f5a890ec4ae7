"""benchmarks/tpu_int8_matmul runs end to end on CPU (Pallas' TPU interpreter, one tiny shape): every kind
times, the kernel matches XLA's product, and the JSON holds it."""
from __future__ import annotations

import json

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
                                  "kernel_via_int32"}
    assert all(v["ms"] > 0 and "error" not in v for v in main["kinds"].values())
    diff = main["max_abs_diff"]
    for form in ("kernel", "kernel_reshape", "kernel_via_int32"):
        # a dequantized weight may round to the neighbouring bf16 where one side fuses q * s + o: a few
        # products off by 2^-8 of theirs; a wrong scale or offset row would be off by the product's size
        assert diff[form] <= 1e-2 * diff["max_abs_ref"]
    assert list(sweep["kinds"]) == ["kernel_256x128"] and sweep["kinds"]["kernel_256x128"]["ms"] > 0
    assert "done in" in capsys.readouterr().out
