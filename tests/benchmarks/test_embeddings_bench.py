"""benchmarks/embeddings on a tiny random checkpoint: `slipstream serve` in f32 embeds random-id passages as
transformers does, and every rate comes out positive; eval.txt's passages share no prefix and are of the stated size."""
from __future__ import annotations

import json
import os

from benchmarks import embeddings
from tests.conftest import build_tiny_hf
from tests.server.test_serve_hf_models import _save_word_tokenizer

# few programs to compile: 2 slots, steps of up to 32 tokens
SMALL = "--max-slots 2 --max-seq-len 128 --max-num-batched-tokens 32 --kv-cache-memory 1MiB"


def test_f32_embeddings_equal_transformers_and_rates_are_positive(tmp_path, capsys):
    model = build_tiny_hf(str(tmp_path / "tiny"), "llama", seed=3)
    _save_word_tokenizer(model)
    cache = os.environ.get("SLIPSTREAM_TEST_COMPILE_CACHE", "")
    out = tmp_path / "embeddings.json"
    embeddings.main(["--model", model, "--configs", f"f32=--quantize none --kv-cache-dtype float32 {SMALL} "
                     f"--compile-cache {cache}", "--no-peers", "--random-tokens", "40", "--passages", "6",
                     "--batch", "2", "--concurrency", "2", "--reps", "1", "--pooling", "mean", "--out", str(out)])
    report = json.loads(out.read_text())
    (row,) = report["results"]
    assert report["inputs"] == 6 and report["pooling"] == "mean"
    assert row["server"] == "slipstream f32"
    assert row["cosine_min"] > 0.9999 and row["repeat_cosine_min"] > 0.9999
    assert row["embed_tokens"] == row["prefill_tokens"] == 6 * 40
    for key in ("embed_inputs_per_s", "embed_tokens_per_s", "prefill_inputs_per_s", "prefill_tokens_per_s",
                "embed_vs_prefill"):
        assert row[key] > 0, key
    assert "slipstream f32" in capsys.readouterr().out


def test_passages_share_no_prefix_and_run_85_to_170_words():
    texts = embeddings.passages(256)
    assert texts[:len(embeddings.SHORT)] == embeddings.SHORT
    cut = texts[len(embeddings.SHORT):]
    assert len(cut) == 256 and len({tuple(t.split()[:6]) for t in cut}) == 256
    assert all(85 <= len(t.split()) <= 170 for t in cut)
