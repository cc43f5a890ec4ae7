"""benchmarks/engine on a tiny model: every phase runs to the end and reports positive times."""
from __future__ import annotations

import json

from benchmarks import engine as engine_tool


def test_mixed_step_after_many_decode_phases(tiny_llama_dir, tmp_path):
    # Four slot counts then the mixed step: the positions the phases advanced used to add up past the
    # sequences' pages ("sequence in slot 0: 5 pages do not cover 41 tokens"), as on the TPU with
    # --slots 1,8,32,64 --context 384.
    out = tmp_path / "bench.json"
    engine_tool.main(["step", "--model", tiny_llama_dir, "--slots", "1,2,3,4", "--context", "24", "--steps", "2",
                       "--warmup", "1", "--page-size", "8", "--max-num-batched-tokens", "32",
                       "--prefill-lengths", "16", "--quantize", "none", "--dtype", "float32", "--out", str(out)])
    report = json.loads(out.read_text())
    assert [d["slots"] for d in report["decode"]] == [1, 2, 3, 4]
    assert all(d["step_ms"] > 0 and d["tok_s"] > 0 for d in report["decode"])
    assert report["mixed"]["decodes"] == 4 and report["mixed"]["chunk"] == 28
    assert report["mixed"]["mixed_ms"] > 0 and report["mixed"]["separate_ms"] > 0


def test_breakdown_times_each_part_of_a_decode_step(tiny_llama_dir, tmp_path):
    out = tmp_path / "breakdown.json"
    engine_tool.main(["step", "--model", tiny_llama_dir, "--slots", "2", "--context", "16", "--steps", "2",
                      "--warmup", "1", "--page-size", "8", "--max-num-batched-tokens", "32", "--prefill-lengths", "16",
                      "--quantize", "none", "--dtype", "float32", "--breakdown", "--out", str(out)])
    parts = json.loads(out.read_text())["breakdown"]
    assert parts["slots"] == 2
    for part in ("step", "model", "host_inputs", "sample", "roofline", "attention"):
        assert parts[f"{part}_ms"] > 0, part
