"""benchmarks/device on CPU with a tiny model and minimal sizes: every phase lands in device.json with
positive numbers, and every ratio is taken against this run's own measurements."""
from __future__ import annotations

import json

import jax
import pytest

from benchmarks import device
from benchmarks.bench import trace_server
from slipstream.engine.api import SlotState, StepBatch, StepSeq
from slipstream.engine.request import SamplingParams
from tests.conftest import build_tiny_hf, compile_cache_env
from tests.server.test_serve_hf_models import _save_word_tokenizer

# an 8-token budget: 4 step programs (1, 2, 4, 8 tokens); the prefill of 8 rates against the matmul row nearest it
SMALL = ["--hbm-bytes", str(8 << 20), "--matmul-m", "1,16", "--matmul-layers", "2", "--slots", "1,3",
         "--context", "24", "--prefill-tokens", "8", "--steps", "2", "--warmup", "1", "--quantize", "none"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    path = build_tiny_hf(str(tmp_path_factory.mktemp("device-tiny")), "llama")
    _save_word_tokenizer(path)
    return path


def _report(out) -> dict:
    return json.loads((out / "device.json").read_text())


def test_in_process_phases_and_decode_batches_halving_until_the_cache_fits(tiny_dir, tmp_path, monkeypatch):
    """The phases that hold the device, run here (benchmarks/device.py starts them in a child process:
    test_llama_8b_int8_script_dry_run goes that way). An engine for the largest batch that runs out of
    device memory is rebuilt for half as many slots (an 8B model on a 16 GB chip), and the report says
    so. The allocation failure is simulated: a CPU has the memory."""
    from benchmarks import device_phases

    real_build, asked = device_phases.build, []

    def build(*args, slots, **kw):
        asked.append(slots)
        if slots > 3:
            raise jax.errors.JaxRuntimeError(f"RESOURCE_EXHAUSTED: Out of memory allocating the cache of {slots} slots")
        return real_build(*args, slots=slots, **kw)

    monkeypatch.setattr(device_phases, "build", build)
    out = tmp_path / "out"
    out.mkdir()
    # random weights for the directory's config, as the TPU run draws a preset's
    assert device_phases.main(["--model", tiny_dir, "--load-format", "dummy", *SMALL, "--slots", "1,3,12",
                               "--skip-serving", "--profile", "--output-dir", str(out)]) == 0
    assert device.parse_args(["--skip-serving"]).phases == ["hbm", "matmul", "engine"]
    r = _report(out)
    assert asked == [12, 6, 3]
    assert r["fit"]["asked_slots"] == 12 and r["fit"]["slots"] == 3 and "RESOURCE_EXHAUSTED" in r["fit"]["error"]
    # --profile: the device's ops of a step (a CPU has no device planes: the lists are there, empty)
    assert all(isinstance(d["device_ops"], list) for d in r["decode"] + [r["prefill"]])
    assert r["machine"]["platform"] == "cpu" and r["machine"]["device_kind"]
    assert r["machine"]["load_format"] == "dummy"
    assert r["hbm"]["bytes"] == 8 << 20 and r["hbm"]["read_gbs"] > 0
    assert r["matmul"]["k"] == 64 and r["matmul"]["n"] == 128
    assert [row["m"] for row in r["matmul"]["rows"]] == [1, 16]
    for row in r["matmul"]["rows"]:
        assert set(row["kinds"]) == {"f32", "bf16", "w8a16", "w8a8"}
        assert all(k["ms"] > 0 and k["tflops"] > 0 for k in row["kinds"].values())
    assert r["engine"]["context"] == 24 and r["engine"]["kv_bytes_per_token"] > 0
    assert [d["slots"] for d in r["decode"]] == [1, 3]
    for d in r["decode"]:
        # the floor is this run's bytes over this run's HBM rate
        want = (r["engine"]["weight_mb"] * 1e6 + d["kv_read_mb"] * 1e6) / (r["hbm"]["read_gbs"] * 1e9) * 1e3
        assert d["floor_ms"] == pytest.approx(want) and d["step_ms"] > 0
        assert d["step_over_floor"] == pytest.approx(d["step_ms"] / d["floor_ms"])
        # steps with one in flight, as the server runs them
        assert d["pipelined_ms"] > 0 and d["pipelined_over_floor"] == pytest.approx(d["pipelined_ms"] / d["floor_ms"])
    p = r["prefill"]
    assert p["tokens"] == 8 and p["matmul_kind"] == "f32" and p["rate_m"] == 16
    assert p["rate_tflops"] == r["matmul"]["rows"][1]["kinds"]["f32"]["tflops"] and p["over_floor"] > 0
    table = (out / "device.md").read_text()
    assert "HBM read" in table and "| 3 |" in table and "Prefill of 8 tokens" in table
    assert "the largest decode batch cut to 3" in table
    assert "serving" not in r


def _serve_has_uds() -> bool:
    from slipstream.server.cli import build_parser

    _, unknown = build_parser().parse_known_args(["serve", "--uds", "/tmp/x.sock"])
    return not unknown


@pytest.mark.skipif(not _serve_has_uds(), reason="needs `slipstream serve --uds` (branch h-uds)")
def test_serving_over_a_unix_socket(tiny_dir, tmp_path):
    out = tmp_path / "out"
    # 4-token steps: 3 step programs to compile at each start, not the CPU default's 10 up to 288 tokens
    assert device.main(["--model", tiny_dir, *SMALL, "--phases", "serving", "--startup", "--serving-trace",
                        "--serving-prompts", "6",
                        "--serving-concurrency", "3", "--serving-input-len", "16", "--serving-output-len", "8",
                        "--serve-flags", "--max-num-batched-tokens 4 --kv-cache-memory 1MiB",
                        "--output-dir", str(out)]) == 0
    r = _report(out)
    s = r["serving"]
    assert s["completed"] == 6 and s["failed"] == 0
    assert s["output_tok_s"] > 0 and s["ttft_p50_ms"] > 0 and s["tpot_p50_ms"] > 0
    assert r["startup"]["cold_s"] > 0 and r["startup"]["warm_s"] > 0
    assert r["startup"]["warm_answers_as_cold"] and len(r["startup"]["tokens"]) == 16
    assert r["startup"]["warm_programs_loaded"] == 0  # CPU engines trace (engine/device/executables.py)
    assert "cpu backend" in r["machine"]["device"]  # no in-process phase: the machine as the server logged it
    # --serving-trace: the requests again under trace_server, each one's server TTFT split into its parts
    t = r["serving_trace"]
    assert t["client"]["completed"] == 6 and t["ttft_parts_ms"]["requests"] == 6
    parts = t["ttft_parts_ms"]
    # each request's stamps in order (body, submit, its sampling step's plan and launch, first chunk)
    assert all(parts[k] >= 0 for k in trace_server.TTFT_PARTS) and parts["server_ttft"] > 0, parts
    md = (out / "device.md").read_text()
    assert "Serving (6 prompts" in md and md.startswith("Machine: 1 x cpu") and "The same run traced" in md


def test_llama_8b_int8_script_dry_run(tmp_path, monkeypatch):
    """benchmarks/device_8b's engine part on a CPU: a shrunk Llama-3.1-8B config, dummy int8 weights drawn
    layer by layer, int8 KV; its serving part's KV budget covers every concurrent sequence."""
    from benchmarks import device_8b

    for name, value in compile_cache_env().items():  # the phases' process: the run's XLA cache
        monkeypatch.setenv(name, value)
    out = tmp_path / "engine"
    assert device_8b.main(["engine", "--dry-run", "--output-dir", str(out)]) == 0
    r = _report(out)
    assert r["engine"]["weight_mode"] == "int8" and r["engine"]["kv_dtype"] == "int8"
    # the forms of the 7 linears per layer, as the engine holds them: on a TPU StackedInt8
    assert r["engine"]["linear_forms"] == ({"StackedInt8": 7} if jax.default_backend() == "tpu" else {"PerLayer": 7})
    assert [d["slots"] for d in r["decode"]] == [1, 3] and r["prefill"]["matmul_kind"] == "w8a16"
    assert "errors" not in r
    from slipstream.models.registry import resolve_model

    args = device_8b.serving_args(device_8b.MODEL, device_8b.SERVING, resolve_model("llama-3.1-8b", "dummy"))
    flags = args[args.index("--serve-flags") + 1].split()
    budget = int(flags[flags.index("--kv-cache-memory") + 1])
    assert device_8b.kv_bytes_per_token(resolve_model("llama-3.1-8b", "dummy")) == 2 * 32 * 8 * (128 + 4)
    assert budget == 64 * (7 + 1) * 128 * 67584  # 64 sequences of 769 tokens in pages of 128, one spare each


SPEC = ["--phases", "spec", "--context", "16", "--steps", "2", "--warmup", "1", "--spec-slots", "1,2",
        "--spec-drafts", "0,2", "--spec-prompts", "4", "--spec-output-len", "12", "--spec-passage-len", "16"]


def test_spec_phase_times_verification_and_checks_greedy_identity(tiny_dir, tmp_path):
    """The spec phase (issue 49's TPU measurement) on a CPU: a verification step per K and batch, and
    greedy requests equal with n-gram speculation and without, drafts verified and accepted."""
    from benchmarks import device_phases

    out = tmp_path / "out"
    out.mkdir()
    assert device_phases.main(["--model", tiny_dir, "--load-format", "dummy", "--quantize", "none", *SPEC,
                               "--output-dir", str(out)]) == 0
    r = _report(out)
    assert "engine" not in r and "hbm" not in r
    assert r["spec_engine"]["sampling_slots"] == 4 * 5  # every identity request's K + 1 rows
    steps = r["spec_steps"]
    assert [(x["slots"], x["drafts"], x["query_tokens"]) for x in steps] == [(1, 0, 1), (1, 2, 3), (2, 0, 2), (2, 2, 6)]
    for x in steps:
        base = next(y for y in steps if y["slots"] == x["slots"] and y["drafts"] == 0)
        assert x["step_ms"] > 0 and x["over_k0"] == pytest.approx(x["step_ms"] / base["step_ms"])
        assert x["tok_s_all_accepted"] == pytest.approx(x["query_tokens"] / x["step_ms"] * 1e3)
    s = r["spec_identity"]
    assert s["requests"] == 4 and s["greedy"] == 3 and s["drawn"] == 1
    assert s["identical"] == 3 and s["mismatches"] == []
    # drafts were proposed and verified, and some accepted: the identity covers the accepting path
    assert s["drafts"] > 0 and s["accepted"] > 0 and s["drafts_without"] == 0
    assert s["generated_with"] == s["generated_without"] == 4 * 12
    table = (out / "device.md").read_text()
    assert "| 2 | 2 | 6 |" in table and "**3/3 greedy outputs identical**" in table


def test_spec_near_tie_reads_the_greedy_logits(tiny_engine):
    """Where a greedy output differs, the logits after the shared prefix: their argmax is greedy's token."""
    from benchmarks.device_spec import near_tie

    prompt = [5, 9, 11, 5, 9, 11, 5, 40, 41]
    tiny_engine.insert(0, SlotState(prompt, (), SamplingParams(temperature=0.0)))
    try:
        greedy = tiny_engine.step(StepBatch([StepSeq(0, prompt, 0, (1, 2), True)]))[0].token_id
    finally:
        tiny_engine.free(0)
    other = (greedy + 1) % tiny_engine.vocab_size
    got = near_tie(tiny_engine, prompt, [1, 2], greedy, other)
    assert got["argmax"] == greedy and got["second"] != greedy
    assert got["logit_a"] > got["logit_b"]
    assert got["relative_gap"] == pytest.approx((got["logit_a"] - got["logit_b"]) / abs(got["logit_a"]))
