"""Tokenizer, chat template and incremental detokenizer against transformers on the default model."""
from __future__ import annotations

import os

import pytest

from slipstream.models.tokenizer import ChatTemplateError, IncrementalDetokenizer
from tests.conftest import gguf_read_once

TEXTS = [
    "Hello world!",
    "  leading spaces, trailing   \n\n\ttabs\t and runs      of spaces ",
    "emoji 😀🎉👩‍👩‍👧 ünïcödé 中文 日本語 한국어 العربية",
    "def f(x):\n    return x**2 + 12345678  # comment\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "numbers 3.14159 and 1,000,000 and 2026-11-29",
    "",
    "\u200b zero width and \u00a0 nbsp",
]


@pytest.fixture(scope="module")
def tokenizers(default_model_path, default_gguf_reader, default_tokenizer):
    """Ours (the run's, read-only) and transformers' own, both from the run's parse of the GGUF."""
    from transformers import AutoTokenizer

    with gguf_read_once(default_model_path, default_gguf_reader):
        hf = AutoTokenizer.from_pretrained(os.path.dirname(default_model_path),
                                           gguf_file=os.path.basename(default_model_path))
    return default_tokenizer, hf


@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_transformers(tokenizers, text):
    ours, hf = tokenizers
    assert ours.encode(text) == hf(text)["input_ids"]
    assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


def test_special_tokens_and_eos(tokenizers):
    ours, _ = tokenizers
    assert ours.encode("<|im_end|>") == [2]
    assert 2 in ours.eos_token_ids


def test_chat_template_equals_transformers(tokenizers):
    ours, hf = tokenizers
    conversations = [
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3? 🙂"}],
    ]
    for messages in conversations:
        for gen in (True, False):
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen)


def test_chat_template_sandbox_blocks_attribute_escape():
    from tokenizers import Tokenizer as HF, models

    from slipstream.models.tokenizer import Tokenizer

    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tok = Tokenizer(HF(models.BPE()), bos_token=None, eos_token=None, add_bos=False, chat_template=evil)
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_reads_the_variables_a_request_passes():
    """chat_template_kwargs reach the template as variables (Qwen3's enable_thinking), beside its own."""
    from tokenizers import Tokenizer as HF, models

    from slipstream.models.tokenizer import Tokenizer

    template = ("{{ messages[0].content }}|{% if enable_thinking is defined and not enable_thinking %}"
                "<think></think>{% else %}think{% endif %}|{{ add_generation_prompt }}")
    tok = Tokenizer(HF(models.BPE()), bos_token=None, eos_token=None, add_bos=False, chat_template=template)
    messages = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(messages) == "x|think|True"
    assert tok.apply_chat_template(messages, enable_thinking=False) == "x|<think></think>|True"
    assert tok.apply_chat_template(messages, add_generation_prompt=False, enable_thinking=True) == "x|think|False"


def test_incremental_detokenizer_never_splits_utf8(tokenizers):
    ours, _ = tokenizers
    text = "Ünïcödé 😀 and 中文 with emoji 🎉👩‍👩‍👧 done."
    ids = ours.encode(text)
    detok = IncrementalDetokenizer(ours)
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert any(p == "" for p in pieces)  # some multi-token characters were held back


def test_chat_template_dates_a_system_prompt_with_strftime_now():
    """Mistral Small 3's and Llama 3.x's templates call transformers' strftime_now; without it they failed to render."""
    import datetime

    from tokenizers import Tokenizer as HF, models

    from slipstream.models.tokenizer import Tokenizer

    template = "{% set today = strftime_now('%Y-%m-%d') %}Today: {{ today }}\n{{ messages[0].content }}"
    tok = Tokenizer(HF(models.BPE()), bos_token=None, eos_token=None, add_bos=False, chat_template=template)
    before = datetime.date.today().isoformat()
    text = tok.apply_chat_template([{"role": "user", "content": "x"}])
    assert text in (f"Today: {before}\nx", f"Today: {datetime.date.today().isoformat()}\nx")
