"""Benchmark prompts: random (token-exact lengths), ShareGPT (filtered as vLLM does), shared-prefix, and custom
(a JSONL file of prompts, as vLLM reads it).

Lengths are counted with the model's tokenizer, without special tokens, as `vllm bench serve` does.
A random prompt is made of random tokens whose decoded text re-encodes to exactly the length asked.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np


class TextTokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...


# ids per batch call: a block's lists die before the next, where the whole vocabulary's at once (100k lists alive)
# set off full passes of Python's collector and took longer than one id at a time
_BLOCK = 256


def _plain_tokens(tok: TextTokenizer, ids: range) -> list[int]:
    """The ids among `ids` that decode alone to printable text which encodes back to that one id: by the
    tokenizer's batch calls where it has them (models/tokenizer.Tokenizer, which spreads them over the cores),
    else one id at a time."""
    batched = hasattr(tok, "decode_batch") and hasattr(tok, "encode_batch")
    texts = (tok.decode_batch([[i] for i in ids], skip_special_tokens=True) if batched
             else [tok.decode([i], skip_special_tokens=True) for i in ids])
    plain = [(i, text) for i, text in zip(ids, texts) if text and "\ufffd" not in text and text.isprintable()]
    texts = [text for _, text in plain]
    encoded = (tok.encode_batch(texts, add_special_tokens=False) if batched
               else [tok.encode(text, add_special_tokens=False) for text in texts])
    return [i for (i, _), got in zip(plain, encoded) if got == [i]]


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int            # tokens, without special tokens
    expected_output_len: int   # max_tokens sent with the request


class PromptMaker:
    """Random text of an exact token count, optionally after a fixed prefix text."""

    def __init__(self, tokenizer: TextTokenizer, rng: np.random.Generator, max_tries: int = 30) -> None:
        self.tok = tokenizer
        self.rng = rng
        self.max_tries = max_tries
        self.pool = self._clean_token_pool()

    def _clean_token_pool(self) -> np.ndarray:
        # Only ids that decode to printable text and encode back to themselves: prompts then contain
        # no control tokens, no half UTF-8 characters, and converge to the target length in a step or two.
        vocab = self.tok.vocab_size
        keep = [i for start in range(0, vocab, _BLOCK)
                for i in _plain_tokens(self.tok, range(start, min(start + _BLOCK, vocab)))]
        if len(keep) < 100:
            raise ValueError(f"the tokenizer has only {len(keep)} plain-text tokens; cannot make random prompts")
        return np.asarray(keep, dtype=np.int64)

    def random_ids(self, n: int) -> list[int]:
        return self.rng.choice(self.pool, size=n).tolist()

    def text(self, n: int, prefix: str = "") -> str:
        """A text T with len(encode(prefix + T)) == len(encode(prefix)) + n, the prefix's tokens unchanged."""
        if n <= 0:
            return ""
        prefix_ids = self.tok.encode(prefix, add_special_tokens=False) if prefix else []
        ids = self.random_ids(n)
        for _ in range(self.max_tries):
            text = self.tok.decode(ids, skip_special_tokens=True)
            full = self.tok.encode(prefix + text, add_special_tokens=False)
            if full[:len(prefix_ids)] != prefix_ids:  # the join merged across the prefix: draw again
                ids = self.random_ids(n)
                continue
            got = full[len(prefix_ids):]
            if len(got) == n:
                return text
            ids = got[:n] if len(got) > n else got + self.random_ids(n - len(got))
        raise ValueError(f"could not make a prompt of exactly {n} tokens in {self.max_tries} tries")


def _lengths(rng: np.random.Generator, mean: int, ratio: float, n: int, minimum: int) -> list[int]:
    if not 0 <= ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    low, high = max(minimum, int(mean * (1 - ratio))), max(minimum, int(mean * (1 + ratio)))
    return rng.integers(low, high + 1, size=n).tolist()


def random_dataset(tok: TextTokenizer, *, num_prompts: int, input_len: int, output_len: int,
                   range_ratio: float = 0.0, prefix_len: int = 0, seed: int = 0) -> list[SampleRequest]:
    """vLLM's `random`: input/output lengths uniform in [len*(1-r), len*(1+r)], an optional shared prefix."""
    rng = np.random.default_rng(seed)
    maker = PromptMaker(tok, rng)
    prefix = maker.text(prefix_len)
    ins = _lengths(rng, input_len, range_ratio, num_prompts, minimum=1)
    outs = _lengths(rng, output_len, range_ratio, num_prompts, minimum=1)
    return [SampleRequest(prefix + maker.text(n, prefix), prefix_len + n, m) for n, m in zip(ins, outs)]


def prefix_dataset(tok: TextTokenizer, *, num_prompts: int, prefix_len: int, suffix_len: int,
                   num_prefixes: int, output_len: int, seed: int = 0) -> list[SampleRequest]:
    """vLLM's `prefix_repetition`: num_prefixes shared prefixes, each followed by random suffixes, shuffled."""
    if num_prefixes < 1 or num_prompts < num_prefixes:
        raise ValueError(f"--prefix-repetition-num-prefixes must be in [1, --num-prompts], got {num_prefixes}")
    rng = np.random.default_rng(seed)
    maker = PromptMaker(tok, rng)
    out = []
    for p in range(num_prefixes):
        prefix = maker.text(prefix_len)
        count = num_prompts // num_prefixes + (1 if p < num_prompts % num_prefixes else 0)
        out += [SampleRequest(prefix + maker.text(suffix_len, prefix), prefix_len + suffix_len, output_len)
                for _ in range(count)]
    random.Random(seed).shuffle(out)
    return out


def sharegpt_dataset(tok: TextTokenizer, path: str, *, num_prompts: int, output_len: int | None = None,
                     seed: int = 0) -> list[SampleRequest]:
    """First human turn as the prompt, the reply's length as max_tokens (or a fixed --sharegpt-output-len);
    pairs shorter than 4 tokens, prompts over 1024 tokens or pairs over 2048 tokens are dropped (vLLM)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    convs = [d["conversations"] for d in data if len(d.get("conversations", [])) >= 2]
    random.Random(seed).shuffle(convs)
    out: list[SampleRequest] = []
    for conv in convs:
        if len(out) == num_prompts:
            break
        prompt, reply = conv[0]["value"], conv[1]["value"]
        prompt_len = len(tok.encode(prompt, add_special_tokens=False))
        out_len = output_len if output_len is not None else len(tok.encode(reply, add_special_tokens=False))
        too_short = prompt_len < 4 or (output_len is None and out_len < 4)
        if too_short or prompt_len > 1024 or prompt_len + out_len > 2048:
            continue
        out.append(SampleRequest(prompt, prompt_len, out_len))
    if len(out) < num_prompts:
        raise ValueError(f"{path}: only {len(out)} conversations pass the length filter, {num_prompts} asked")
    return out


def custom_dataset(tok, path: str, *, num_prompts: int, output_len: int | None, seed: int = 0,
                   shuffle: bool = True, chat_template: bool = True, oversample: bool = True) -> list[SampleRequest]:
    """vLLM's `custom`: one JSON object per line with a "prompt" (and "output_tokens", used when output_len is
    None or -1). Shuffled with the seed unless shuffle is False; wrapped in the model's chat template (as a user
    turn, with the generation prompt) unless chat_template is False; fewer lines than num_prompts are drawn
    again at random unless oversample is False."""
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if any("prompt" not in row for row in rows):
        raise ValueError(f"{path}: every line needs a 'prompt'")
    if shuffle:
        random.Random(seed).shuffle(rows)
    out: list[SampleRequest] = []
    for row in rows[:num_prompts]:
        if output_len is None or output_len == -1:
            if "output_tokens" not in row:
                raise ValueError(f"{path}: a line has no 'output_tokens'; pass --custom-output-len")
            n_out = int(row["output_tokens"])
        else:
            n_out = output_len
        prompt = row["prompt"]
        if chat_template:
            prompt = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        out.append(SampleRequest(prompt, len(tok.encode(prompt, add_special_tokens=False)), n_out))
    if len(out) < num_prompts:
        if not oversample or not out:
            raise ValueError(f"{path}: {len(out)} prompts, {num_prompts} asked")
        out += random.Random(seed).choices(out, k=num_prompts - len(out))
    return out


_SUBJECTS = ("the old sailor", "a young baker", "the village doctor", "my neighbour", "the tall gardener",
             "a quiet student", "the night guard", "our teacher", "the river pilot", "a tired painter")
_VERBS = ("carried", "painted", "repaired", "found", "counted", "cleaned", "measured", "sold", "wrapped", "watched")
_OBJECTS = ("a wooden chair", "the blue lantern", "seven copper coins", "the broken clock", "a basket of pears",
            "the narrow bridge", "an old map", "the garden gate", "a box of letters", "the iron kettle")
_PLACES = ("near the harbour", "before sunrise", "in the market", "behind the mill", "after the storm",
           "on the hill road", "beside the well", "under the bridge", "at the station", "during the fair")


def repeat_dataset(tok, *, num_prompts: int, passage_len: int = 200, output_len: int | None = None,
                   seed: int = 0, chat_template: bool = True) -> list[SampleRequest]:
    """Prompts asking to repeat a passage of about passage_len tokens word for word (seeded, plain English
    sentences): output that copies its input, where speculative decoding's prompt lookup pays off.
    max_tokens is output_len, by default the passage's length."""
    if passage_len < 8:
        raise ValueError(f"--repeat-passage-len must be >= 8, got {passage_len}")
    rng = random.Random(seed)
    out = []
    for _ in range(num_prompts):
        words: list[str] = []
        while len(tok.encode(" ".join(words), add_special_tokens=False)) < passage_len:
            sentence = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_PLACES)}."
            words += (sentence[0].upper() + sentence[1:]).split()
        while len(tok.encode(" ".join(words), add_special_tokens=False)) > passage_len:
            words.pop()
        passage = " ".join(words)
        prompt = f"Repeat the following text exactly, with nothing before or after it.\n\n{passage}"
        if chat_template:
            prompt = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        n_out = output_len if output_len is not None else len(tok.encode(passage, add_special_tokens=False))
        out.append(SampleRequest(prompt, len(tok.encode(prompt, add_special_tokens=False)), n_out))
    return out
