"""The embedded default model (SmolLM2-135M-Instruct GGUF): our loader + paged engine vs transformers."""
from __future__ import annotations

import os

import pytest
import torch

from slipstream.engine.request import SamplingParams
from tests.conftest import gguf_read_once
from tests.engine.test_runner import _generate as drive_engine

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n"]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_model(default_model_path, default_gguf_reader):
    """transformers' own load of the GGUF (its dequantization and name mapping), handed the run's parsed
    file (it would parse it twice, config then weights, ~6 s each)."""
    from transformers import AutoModelForCausalLM

    with gguf_read_once(default_model_path, default_gguf_reader):
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(default_model_path),
                                                    gguf_file=os.path.basename(default_model_path),
                                                    dtype=torch.float32).eval()


def engine_greedy(engine, prompts: list[list[int]]) -> list[list[int]]:
    """All prompts decoded together in one batch, not stopping at EOS."""
    pages = [list(range(1 + 4 * i, 5 + 4 * i)) for i in range(len(prompts))]
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return drive_engine(engine, prompts, [greedy] * len(prompts), pages, NEW_TOKENS)


def test_greedy_tokens_equal_transformers(default_engine, hf_model, default_tokenizer):
    tok = default_tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    ours = engine_greedy(default_engine, prompts)
    for prompt, text, out in zip(prompts, PROMPTS, ours):
        assert out == hf_greedy(hf_model, prompt), text


def hf_greedy(hf_model, prompt: list[int]) -> list[int]:
    """Plain greedy, not stopping at EOS (as ignore_eos does), one token a step over transformers' own KV
    cache (recomputing the whole sequence per token took minutes on a busy 2-core host). On one torch
    thread: beside XLA's thread pool in this process (and another test process on 2 cores) two threads
    made each one-token step several times slower."""
    ids = list(prompt)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            step = hf_model(torch.tensor([ids]), use_cache=True)
            for i in range(NEW_TOKENS):
                ids.append(int(step.logits[0, -1].argmax()))
                if i + 1 < NEW_TOKENS:
                    step = hf_model(torch.tensor([ids[-1:]]), past_key_values=step.past_key_values, use_cache=True)
    finally:
        torch.set_num_threads(threads)
    return ids[len(prompt):]
