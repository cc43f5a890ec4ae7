"""GGUF files whose tokenizer is SentencePiece BPE (tokenizer.ggml.model "llama": Llama 2, Mistral, Mixtral): a small
vocabulary trained here and written as llama.cpp's converter writes one (scores, byte tokens, control and
user-defined tokens) encodes as llama.cpp's SPM tokenizer does (transcribed below) and as transformers' GGUF
tokenizer does, decodes back to the text, and a tiny llama file carrying it serves through the loader."""
from __future__ import annotations

import json
import os
import re

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers, trainers

from slipstream.models.base import dense_logits
from slipstream.models.loader import load_model, read_gguf
from slipstream.models.registry import load_tokenizer
from slipstream.models.tokenizer import Tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs.",
    "Mixtral and Mistral are models; Llama 2 is a model too, and these models read text.",
    "Un café crème à côté de l'église, s'il vous plaît. Déjà vu: l'été est passé.",
    "def tokenize(text):     return [piece for piece in text.split()]  # pieces of the text",
    "Numbers like 1234 and 2026 and 3.14159 appear in the corpus of this test, again and again.",
    "Tokenizers merge the pair whose merged piece scores highest; the leftmost one wins a tie.",
]
WHITESPACE_PIECES = {"\u2581\u2581": 10, "\u2581\u2581\u2581\u2581": 40, "\u2581\u2581\u2581": 120}  # piece: merge rank
CONTROL, USER_DEFINED = ["[INST]", "[/INST]"], ["<tool>"]
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, trailing  ",
    "runs of     spaces  and\ttabs",
    "line one\nline two\n\n  indented line\n",
    "Un café crème à côté, déjà vu!",
    "naïve señor Ærø — “quotes” …",
    "中文 日本語 한국어 العربية",
    "emoji 😀🎉👩‍👩‍👧 done",
    "    return [piece for piece in text.split()]",
    "1234567890 + 3.14159 = ?",
    "",
    " ",
    "<0x0A> looks like a byte token",
]
SPECIAL_TEXTS = [
    "[INST] What is a fox? [/INST] A fox is an animal.",
    "[INST]hi[/INST]",
    "call <tool> now<tool>then",
    "</s><s> bos and eos spelled out <unk>",
]


def _train() -> tuple[list[str], list[str]]:
    """(merged pieces in merge order, single characters) of a BPE trained on CORPUS over `▁`-joined words."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.train_from_iterator(CORPUS * 3, trainers.BpeTrainer(vocab_size=600, show_progress=False, special_tokens=[]))
    spec = json.loads(hf.to_str())["model"]
    merged = ["".join(m.split(" ") if isinstance(m, str) else m) for m in spec["merges"]]
    chars = sorted((t for t in spec["vocab"] if len(t) == 1), key=spec["vocab"].get)
    for piece, rank in sorted(WHITESPACE_PIECES.items(), key=lambda kv: kv[1]):  # Llama 2 has runs of `▁` too
        merged.insert(rank, piece)
    return merged, chars


def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, types) as llama.cpp's converter writes a SentencePiece BPE model: <unk> <s> </s>, the 256
    byte tokens, the merged pieces (score: minus their merge rank), the characters (scored below every merge),
    then the added control and user-defined tokens."""
    merged, chars = _train()
    t = gguf.TokenType
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + merged + chars + CONTROL + USER_DEFINED
    scores = [0.0] * 259 + [-float(i) for i in range(len(merged) + len(chars))] + [0.0] * 3
    types = ([t.UNKNOWN, t.CONTROL, t.CONTROL] + [t.BYTE] * 256 + [t.NORMAL] * (len(merged) + len(chars))
             + [t.CONTROL] * len(CONTROL) + [t.USER_DEFINED] * len(USER_DEFINED))
    return tokens, scores, [int(x) for x in types]


def llama_cpp_encode(tokens, scores, types, text: str, *, add_bos: bool, add_space_prefix: bool = True) -> list[int]:
    """llama.cpp's SPM tokenization (llama-vocab.cpp: special tokens cut out of the text, longest first; each text
    fragment, `▁`-prefixed when it follows a special token or starts the text, merged by
    llm_tokenizer_spm_session), its priority queue written as a plain scan: merge the adjacent pair whose
    concatenation is the highest-scoring piece, the leftmost of equals; what is left that is no token goes out
    as its UTF-8 bytes."""
    ids = {tok: i for i, tok in enumerate(tokens)}
    specials = sorted((tok for tok, ty in zip(tokens, types) if ty in (2, 3, 4)), key=len, reverse=True)
    out, after_special = [1] if add_bos else [], True
    for k, part in enumerate(re.split("(" + "|".join(map(re.escape, specials)) + ")", text)):
        if k % 2:
            out.append(ids[part])
            after_special = True
            continue
        if not part:
            continue
        symbols = list(((" " if add_space_prefix and after_special else "") + part).replace(" ", "\u2581"))
        while True:
            best = None
            for j in range(len(symbols) - 1):
                piece = ids.get(symbols[j] + symbols[j + 1])
                if piece is not None and (best is None or scores[piece] > best[0]):
                    best = (scores[piece], j)
            if best is None:
                break
            j = best[1]
            symbols[j:j + 2] = [symbols[j] + symbols[j + 1]]
        for s in symbols:
            out.extend([ids[s]] if s in ids else [ids[f"<0x{b:02X}>"] for b in s.encode()])
        after_special = False
    return out


def write_gguf(path: str, tokens, scores, types, *, vocab_size: int | None = None, tensors: bool = False,
               add_space_prefix: bool | None = True) -> str:
    """A llama GGUF with this tokenizer (keys as llama.cpp's convert_hf_to_gguf.py writes them); tensors: a tiny
    random model in llama.cpp's tensor layout too."""
    hidden, ff, heads, kv_heads, layers = 64, 128, 4, 2, 2
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab_size or len(tokens))
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    rng = np.random.default_rng(0)
    if tensors:
        def add(name: str, *shape: int) -> None:
            writer.add_tensor(name, (rng.standard_normal(shape) * 0.05 + (1.0 if len(shape) == 1 else 0.0))
                              .astype(np.float32))

        add("token_embd.weight", len(tokens), hidden)
        add("output_norm.weight", hidden)
        add("output.weight", len(tokens), hidden)
        kv = hidden // heads * kv_heads
        for i in range(layers):
            for name, shape in (("attn_norm", (hidden,)), ("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)),
                                ("attn_v", (kv, hidden)), ("attn_output", (hidden, hidden)), ("ffn_norm", (hidden,)),
                                ("ffn_gate", (ff, hidden)), ("ffn_up", (ff, hidden)), ("ffn_down", (hidden, ff))):
                add(f"blk.{i}.{name}.weight", *shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def vocab():
    return spm_vocab()


@pytest.fixture(scope="module")
def model_file(tmp_path_factory, vocab):
    return write_gguf(str(tmp_path_factory.mktemp("spm") / "tiny-llama-spm.gguf"), *vocab, tensors=True)


@pytest.fixture(scope="module")
def ours(model_file):
    return load_tokenizer(model_file)


@pytest.fixture(scope="module")
def transformers_tok(model_file):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(model_file), gguf_file=os.path.basename(model_file))


def test_vocabulary_has_merges_bytes_and_specials(vocab):
    tokens, _, types = vocab
    assert 300 < types.count(1) < 700 and types.count(6) == 256
    assert len(set(tokens)) == len(tokens)


@pytest.mark.parametrize("text", TEXTS + SPECIAL_TEXTS)
def test_encode_equals_llama_cpp(ours, vocab, text):
    assert ours.encode(text) == llama_cpp_encode(*vocab, text, add_bos=True)
    assert ours.encode(text, add_special_tokens=False) == llama_cpp_encode(*vocab, text, add_bos=False)


# transformers' Metaspace adds no `▁` to text that starts with a space, llama.cpp (and so Slipstream) does
@pytest.mark.parametrize("text", [text for text in TEXTS if not text.startswith(" ")])
def test_encode_and_decode_equal_transformers(ours, transformers_tok, text):
    ids = ours.encode(text)
    assert ids == transformers_tok(text)["input_ids"]
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == transformers_tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_of_encode_is_the_text(ours, text):
    assert ours.decode(ours.encode(text)) == text  # byte fallback brings back what the vocabulary lacks


def test_byte_fallback_and_special_tokens(ours, vocab):
    tokens = vocab[0]
    ids = ours.encode("a\n中", add_special_tokens=False)
    assert [tokens[i] for i in ids][-4:] == ["<0x0A>", "<0xE4>", "<0xB8>", "<0xAD>"]
    assert ours.bos_token_id == 1 and ours.add_bos and ours.eos_token_ids == {2}
    inst = ours.encode("[INST] hi [/INST]", add_special_tokens=False)
    assert inst[0] == tokens.index("[INST]") and inst[-1] == tokens.index("[/INST]")
    assert ours.decode(inst) == " hi "  # llama.cpp prefixes a space to text after a special token; one is stripped
    assert ours.decode(inst, skip_special_tokens=False) == "[INST]  hi [/INST]"
    tool = ours.encode("<tool>", add_special_tokens=False)
    assert tool == [tokens.index("<tool>")] and ours.decode(tool) == "<tool>"  # user-defined: not skipped


def test_without_space_prefix(tmp_path, vocab):
    path = write_gguf(str(tmp_path / "no-prefix.gguf"), *vocab, add_space_prefix=False)
    tok = load_tokenizer(path)
    for text in ("Hello world", " the fox", "[INST]the fox[/INST]"):
        assert tok.encode(text) == llama_cpp_encode(*vocab, text, add_bos=True, add_space_prefix=False)
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == "<s>" + text


def test_older_files_without_flags_take_llama_cpp_defaults(vocab):
    tokens, scores, types = vocab
    tok = Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
                                        "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types})
    assert tok.encode("the fox") == llama_cpp_encode(*vocab, "the fox", add_bos=True)
    assert tok.eos_token_ids == {2}


def test_missing_scores_and_unsupported_kinds_are_named(vocab):
    tokens, _, types = vocab
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types}
    with pytest.raises(ValueError, match="tokenizer.ggml.scores"):
        Tokenizer.from_gguf_metadata(meta)
    for kind in ("bert", "t5", "rwkv"):
        with pytest.raises(ValueError, match=f"'{kind}' is not supported"):
            Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.model": kind})


def test_byte_level_bpe_files_still_load():
    tokens = ["a", "b", "ab", "Ġ", "Ġab", "<|endoftext|>"]
    tok = Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
                                        "tokenizer.ggml.token_type": [1, 1, 1, 1, 1, 3],
                                        "tokenizer.ggml.merges": ["a b", "Ġ ab"], "tokenizer.ggml.eos_token_id": 5})
    assert tok.encode("ab ab<|endoftext|>") == [2, 4, 5] and not tok.add_bos
    assert tok.decode([2, 4, 5], skip_special_tokens=False) == "ab ab<|endoftext|>"


def test_model_file_with_spm_tokenizer_serves(model_file, vocab):
    reader = read_gguf(model_file)  # as `slipstream serve` opens it: once, for weights and tokenizer
    cfg, model = load_model(model_file, reader=reader)
    tok = load_tokenizer(model_file, reader)
    assert (cfg.architecture, cfg.vocab_size, cfg.bos_token_id) == ("llama", tok.vocab_size, tok.bos_token_id)
    ids = tok.encode("[INST] Un café? [/INST]")
    logits = np.asarray(nnx.jit(dense_logits)(model, jnp.asarray([ids], jnp.int32)))
    assert logits.shape == (1, len(ids), len(vocab[0])) and np.isfinite(logits).all()
    assert isinstance(tok.decode([int(logits[0, -1].argmax())], skip_special_tokens=False), str)


@pytest.mark.parametrize("text, cut", [("The quick brown fox jumps over the lazy dog.", 3),
                                       ("[INST] What is a fox? [/INST] A fox is an animal.", 9),
                                       ("Un café crème à côté, déjà vu!", 4), ("emoji 😀🎉 done", 2)])
def test_a_streamed_reply_keeps_its_first_tokens_space(ours, vocab, text, cut):
    """A reply streams as the text it adds to the prompt: its first token's "▁" is a space (a SentencePiece decoder
    strips it only at a sequence's start), as llama.cpp and vLLM stream it."""
    from slipstream.models.tokenizer import IncrementalDetokenizer

    ids = ours.encode(text)
    prompt, reply = ids[:cut], ids[cut:]
    detok = IncrementalDetokenizer(ours, context=prompt)
    streamed = "".join(detok.add(t) for t in reply) + detok.flush()
    assert streamed == ours.decode(ids)[len(ours.decode(prompt)):]
    assert (streamed[:1] == " ") == vocab[0][reply[0]].startswith("\u2581")  # the space its first token holds


def test_a_tokens_text_keeps_its_space(ours, tmp_path, vocab):
    """Logprobs and token pieces show a token as it reads inside a text: "▁fox" is " fox" (decoding it alone strips
    the space), with and without the decoder's strip (add_space_prefix false)."""
    tokens = vocab[0]
    for piece, text in (("\u2581the", " the"), ("\u2581\u2581", "  "), ("ers", "ers"), ("<s>", "<s>")):
        assert ours.token_text(tokens.index(piece)) == text, piece
    no_prefix = load_tokenizer(write_gguf(str(tmp_path / "no-prefix.gguf"), *vocab, add_space_prefix=False))
    assert no_prefix.token_text(tokens.index("\u2581the")) == " the"
    byte_level = Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "Ġ", "Ġa"],
                                               "tokenizer.ggml.merges": ["Ġ a"]})
    assert byte_level.token_text(2) == " a" and byte_level.token_text(0) == "a"
