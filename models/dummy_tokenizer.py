"""A deterministic byte-level BPE tokenizer of exactly a config's vocabulary size, for models served
with dummy weights: every text encodes (the 256 byte tokens cover it), the config's bos/eos/pad ids
are special tokens, and a ChatML template makes /v1/chat/completions work (a vision-language model's image token is
<image>, which the template renders for an image part; Idefics3's tokens around its tiles are special tokens too, as
in SmolVLM's tokenizer, so an image fills as many positions as with the real one)."""
from __future__ import annotations

import itertools
import string
from collections import deque
from typing import Iterator

from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

from slipstream.models.config import ModelConfig
from slipstream.models.tokenizer import Tokenizer

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
IMAGE = "<image>"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for p in m['content'] %}{{ '<image>' if p['type'] == 'image' else p['text'] }}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# the text Idefics3's processor writes around an image's tiles (models/idefics3_processor.image_prompt)
IDEFICS3_TOKENS = ("<fake_token_around_image>", "<global-img>",
                   *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)))
# merged tokens grow from these characters (GPT-2's byte alphabet writes a leading space as "Ġ")
_WORD_START, _LETTERS = "Ġ", string.ascii_lowercase


def _byte_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode: the printable character standing for each byte 0..255, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _merges() -> Iterator[tuple[str, str]]:
    """BPE merges, breadth first: every grown token (from a leading space or a letter) plus a letter."""
    grow = deque([_WORD_START, *_LETTERS])
    while True:
        head = grow.popleft()
        for letter in _LETTERS:
            grow.append(head + letter)
            yield head, letter


def _special_ids(cfg: ModelConfig, pad_token_id: int | None) -> dict[int, str]:
    """id -> special token: the first eos is ChatML's end of turn (so a chat reply ends on an eos)."""
    specials: dict[int, str] = {}
    for i, eos in enumerate(cfg.eos_token_ids):
        specials.setdefault(eos, IM_END if i == 0 else f"<|eos_{i}|>")
    if cfg.bos_token_id is not None:
        specials.setdefault(cfg.bos_token_id, "<|bos|>")
    if pad_token_id is not None:
        specials.setdefault(pad_token_id, "<|pad|>")
    if cfg.image_token_id is not None:
        specials.setdefault(cfg.image_token_id, IMAGE)
    for token_id in specials:
        if not 0 <= token_id < cfg.vocab_size:
            raise ValueError(f"special token id {token_id} is outside the vocabulary (vocab_size {cfg.vocab_size})")
    if IM_END not in specials.values():  # no eos in the config: end of turn takes the last id
        specials[max(set(range(cfg.vocab_size)) - set(specials))] = IM_END
    return specials


def synthetic_tokenizer(cfg: ModelConfig, *, pad_token_id: int | None = None) -> Tokenizer:
    """vocab_size tokens: the config's specials at their ids, ChatML's <|im_start|> (and Idefics3's tile tokens) at the
    highest free ids, the 256 byte tokens at the lowest free ids, and merged tokens (a leading space and lowercase
    letters, grown one letter at a time, breadth first) in every id left."""
    specials = _special_ids(cfg, pad_token_id)
    added = (IM_START, *(IDEFICS3_TOKENS if cfg.architecture == "idefics3" else ()))
    needed = len(specials) + len(added) + 256
    if cfg.vocab_size < needed:
        raise ValueError(f"a synthetic byte-level tokenizer needs vocab_size >= {needed}, got {cfg.vocab_size}")
    for text in added:  # at the highest free ids
        specials[max(set(range(cfg.vocab_size)) - set(specials))] = text
    free = [i for i in range(cfg.vocab_size) if i not in specials]
    vocab = {text: token_id for token_id, text in specials.items()}
    vocab.update(zip(_byte_alphabet(), free[:256]))
    merges = list(itertools.islice(_merges(), len(free) - 256))
    vocab.update(zip((a + b for a, b in merges), free[256:]))
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    # specials are in the BPE vocabulary too, so marking them special keeps their ids
    hf.add_special_tokens([AddedToken(specials[i], special=True, normalized=False) for i in sorted(specials)])
    for token_id, text in specials.items():
        if hf.token_to_id(text) != token_id:
            raise RuntimeError(f"synthetic tokenizer put {text} at id {hf.token_to_id(text)}, not {token_id}")
    add_bos = cfg.bos_token_id is not None and not cfg.architecture.startswith("qwen")
    return Tokenizer(hf, bos_token=specials.get(cfg.bos_token_id) if cfg.bos_token_id is not None else None,
                     eos_token=IM_END, add_bos=add_bos, chat_template=CHAT_TEMPLATE,
                     extra_eos_ids=cfg.eos_token_ids)
