"""benchmarks/engine on a tiny model: every phase runs to the end and reports positive times."""
from __future__ import annotations

import json

from benchmarks import engine as engine_tool

READ = str(8 << 20)   # the bandwidth read: 8 MiB, not the tool's 1 GiB (a test checks the phases, not the rate)


def test_mixed_step_after_many_decode_phases(tiny_llama_dir, tmp_path):
    # Four slot counts then the mixed step: the positions the phases advanced used to add up past the
    # sequences' pages ("sequence in slot 0: 5 pages do not cover 41 tokens"), as on the TPU with
    # --slots 1,8,32,64 --context 384. A 16-token budget: 5 step programs (1 to 16 tokens).
    out = tmp_path / "bench.json"
    engine_tool.main(["step", "--model", tiny_llama_dir, "--slots", "1,2,3,4", "--context", "24", "--steps", "2",
                       "--warmup", "1", "--page-size", "8", "--max-num-batched-tokens", "16",
                       "--prefill-lengths", "16", "--quantize", "none", "--dtype", "float32", "--read-bytes", READ,
                       "--out", str(out)])
    report = json.loads(out.read_text())
    assert [d["slots"] for d in report["decode"]] == [1, 2, 3, 4]
    assert all(d["step_ms"] > 0 and d["tok_s"] > 0 for d in report["decode"])
    assert report["mixed"]["decodes"] == 4 and report["mixed"]["chunk"] == 12
    assert report["mixed"]["mixed_ms"] > 0 and report["mixed"]["separate_ms"] > 0
    assert report["read_gbs"] > 0


# The two breakdowns build the same engine (q8_0-a16 weights, 2 + 1 slots): the second one's programs load
# from the compile cache. Float weights' matmuls (their roofline) run in test_mixed_step_after_many_decode_phases.
BREAKDOWN_ENGINE = ["--slots", "2", "--context", "16", "--steps", "2", "--warmup", "1", "--page-size", "8",
                    "--max-num-batched-tokens", "32", "--quantize", "q8_0-a16", "--dtype", "float32",
                    "--read-bytes", READ]


def test_breakdown_times_each_part_of_a_decode_step(tiny_llama_dir, tmp_path):
    out = tmp_path / "breakdown.json"
    engine_tool.main(["step", "--model", tiny_llama_dir, *BREAKDOWN_ENGINE, "--prefill-lengths", "16", "--breakdown",
                      "--out", str(out)])
    parts = json.loads(out.read_text())["breakdown"]
    assert parts["slots"] == 2
    # stream: one read of the step's int8 weight bytes, the matmuls' floor
    for part in ("step", "model", "host_inputs", "sample", "roofline", "attention", "stream"):
        assert parts[f"{part}_ms"] > 0, part


def test_prefill_breakdown_times_each_part_of_a_chunk(tiny_llama_dir, tmp_path):
    from slipstream.kernels import native

    out = tmp_path / "prefill.json"
    engine_tool.main(["step", "--model", tiny_llama_dir, *BREAKDOWN_ENGINE, "--prefill-lengths", "24",
                      "--prefill-breakdown", "--out", str(out)])
    parts = json.loads(out.read_text())["prefill_breakdown"]
    assert parts["tokens"] == 24 and parts["model_ops"]
    for part in ("step", "model", "host_inputs", "sample"):
        assert parts[f"{part}_ms"] > 0, part
    if native.kernel_paths().get("q8_matmul") == "native":  # the q8 calls by projection, at the chunk's rows
        q8 = parts["q8"]
        assert {"qkv", "o", "gate_up", "down"} <= set(q8) and q8["all q8"]["ms"] > 0
        assert q8["qkv"]["rows"] == parts["token_bucket"]
