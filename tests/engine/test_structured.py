"""Structured output in the engine: grammars compile (or fail naming the problem), the packed mask
reaches the sampler, and every constrained output of a tiny random model matches its schema."""
from __future__ import annotations

import json

import jax
import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from slipstream.engine.api import PREVIOUS_SAMPLE, SlotState, StepBatch, StepSeq
from slipstream.engine.errors import InvalidParam
from slipstream.engine.request import Request, SamplingParams
from slipstream.engine.device.sampling import apply_token_bitmask
from slipstream.engine.structured import MAX_SOURCE_CHARS, Constraint, GrammarCompiler, MaskFiller

VOCAB = 49152  # SmolLM2's tokenizer, under a tiny random model of the same vocabulary
EOS = 2        # <|im_end|>


@pytest.fixture(scope="module")
def tokenizer(default_tokenizer):
    return default_tokenizer


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB, {EOS})


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A tiny random Llama over SmolLM2's vocabulary: fast steps, realistic tokens."""
    import torch
    import transformers

    from slipstream.engine.device.runner import EngineConfig, JaxEngine
    from slipstream.models.loader import load_hf_dir

    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("tiny-smol-vocab"))
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=EOS)).eval().save_pretrained(path, safe_serialization=True)
    cfg, params = load_hf_dir(path)
    return JaxEngine(cfg, params, EngineConfig(max_slots=4, page_size=16, max_seq_len=256, num_pages=80,
                                               max_num_batched_tokens=32), precompile=False)


def _allowed(mask_row: np.ndarray) -> set[int]:
    bits = np.unpackbits(mask_row.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def generate(engine, tokenizer, requests, max_steps=200):
    """Run (prompt ids, params) requests to the end in one batch, slots 0.. ; -> [(text, finish, ids)]."""
    per_seq_pages = 16
    seqs = []
    for slot, (prompt, params) in enumerate(requests):
        engine.insert(slot, SlotState(tuple(prompt), (), params))
        pages = list(range(1 + slot * per_seq_pages, 1 + (slot + 1) * per_seq_pages))
        seqs.append(dict(slot=slot, prompt=list(prompt), out=[], pages=pages, params=params, finish=None))
    try:
        for _ in range(max_steps):
            live = [s for s in seqs if s["finish"] is None]
            if not live:
                break
            batch = []
            for s in live:
                known = s["prompt"] + s["out"]
                fed = s["prompt"] if not s["out"] else known[-1:]
                batch.append(StepSeq(s["slot"], fed, len(known) - len(fed), s["pages"], True))
            for s, sampled in zip(live, engine.step(StepBatch(tuple(batch)))):
                s["out"].append(sampled.token_id)
                if sampled.token_id == EOS:
                    s["finish"] = "stop"
                elif len(s["out"]) >= s["params"].max_tokens:
                    s["finish"] = "length"
    finally:
        for s in seqs:
            engine.free(s["slot"])
    return [(tokenizer.decode([t for t in s["out"] if t != EOS]), s["finish"], s["out"]) for s in seqs]


# ---- compile errors ---------------------------------------------------------------------------

def test_invalid_schema_names_the_problem(compiler):
    with pytest.raises(InvalidParam) as e:
        compiler.compile(Constraint("json_schema", {"type": "object", "properties": {"a": {"type": "strng"}}}))
    assert e.value.field == "response_format" and "strng" in e.value.message


def test_invalid_regex_names_the_problem(compiler):
    with pytest.raises(InvalidParam) as e:
        compiler.compile(Constraint("regex", "[a-", field="guided_regex"))
    assert e.value.field == "guided_regex" and "unclosed character class" in e.value.message


def test_invalid_grammar_names_the_problem(compiler):
    with pytest.raises(InvalidParam) as e:
        compiler.compile(Constraint("grammar", "start: foo", field="guided_grammar"))
    assert "foo" in e.value.message


def test_schema_over_the_size_limit_is_refused_with_the_limit(compiler):
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)}}
    with pytest.raises(InvalidParam) as e:
        compiler.compile(Constraint("json_schema", schema))
    assert str(MAX_SOURCE_CHARS) in e.value.message


def test_grammar_slower_than_the_compile_limit_is_refused_with_the_limit(compiler, monkeypatch):
    import slipstream.engine.structured

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    compiler.compile(Constraint("json_schema", schema))
    monkeypatch.setattr(slipstream.engine.structured, "MAX_COMPILE_SECONDS", 0.0)
    with pytest.raises(InvalidParam) as e:
        compiler.compile(Constraint("json_schema", schema))
    assert "the limit is 0 s" in e.value.message


# ---- masks ------------------------------------------------------------------------------------

def test_choice_mask_allows_only_the_choices_then_eos(compiler, tokenizer):
    grammar = compiler.compile(Constraint("choice", ["yes", "no"]))
    matcher = grammar.matcher()
    filler = MaskFiller(VOCAB, {EOS})
    first = _allowed(filler.fill([matcher], 1)[0])
    assert tokenizer.encode("yes", add_special_tokens=False)[0] in first
    assert tokenizer.encode("no", add_special_tokens=False)[0] in first
    assert tokenizer.encode("maybe", add_special_tokens=False)[0] not in first and EOS not in first
    for t in tokenizer.encode("yes", add_special_tokens=False):
        assert matcher.advance(t)
    assert matcher.done and _allowed(filler.fill([matcher], 1)[0]) == {EOS}


def test_unconstrained_batch_gets_no_mask_and_rows_stay_all_ones(compiler):
    filler = MaskFiller(VOCAB, {EOS})
    assert filler.fill([None, None], 4) is None
    mask = filler.fill([None, compiler.compile(Constraint("json_object")).matcher()], 4)
    assert mask.shape == (4, VOCAB // 32) and mask.dtype == np.uint32
    assert (mask[0] == 0xFFFFFFFF).all() and (mask[2:] == 0xFFFFFFFF).all()
    assert _allowed(mask[1]) == {tok for tok in _allowed(mask[1])} and len(_allowed(mask[1])) < 100


def test_apply_token_bitmask_keeps_exactly_the_set_bits():
    rng = np.random.default_rng(0)
    vocab = 100  # not a multiple of 32: the last word's high bits are padding
    logits = rng.normal(size=(3, vocab)).astype(np.float32)
    mask = np.full((3, 4), 0xFFFFFFFF, np.uint32)
    mask[1] = rng.integers(0, 2**32, size=4, dtype=np.uint32)
    out = np.asarray(jax.jit(apply_token_bitmask)(logits, mask))
    np.testing.assert_array_equal(out[[0, 2]], logits[[0, 2]])
    keep = np.unpackbits(mask[1].view(np.uint8), bitorder="little")[:vocab].astype(bool)
    np.testing.assert_array_equal(out[1][keep], logits[1][keep])
    assert np.isneginf(out[1][~keep]).all()
    np.testing.assert_array_equal(np.asarray(jax.jit(apply_token_bitmask)(logits, mask[[0, 2, 0]])), logits)


# ---- through the engine -----------------------------------------------------------------------

def test_constrained_and_free_rows_share_a_step_without_recompiling(engine, tokenizer, compiler):
    prompt = tokenizer.encode("Answer:", add_special_tokens=False)
    grammar = compiler.compile(Constraint("regex", "[0-9]{3}-[a-z]{2}"))
    free = SamplingParams(temperature=1.0, seed=1, max_tokens=12)
    outs = generate(engine, tokenizer, [(prompt, SamplingParams(temperature=1.0, seed=1, max_tokens=12,
                                                                constraint=grammar)), (prompt, free)])
    text, finish, ids = outs[0]
    assert finish == "stop" and len(text) == 6 and text[:3].isdigit() and text[3] == "-" \
        and text[4:].isalpha() and text[4:].islower()
    assert outs[1][0] != text  # the free row is not masked
    # the same step shapes without any constraint reuse the programs: the mask is only an input
    before = engine.compile_count
    generate(engine, tokenizer, [(prompt, SamplingParams(temperature=1.0, seed=1, max_tokens=len(ids),
                                                         ignore_eos=True)), (prompt, free)])
    assert engine.compile_count == before


def test_a_constrained_slot_is_not_fed_before_its_sample_is_collected(engine, tokenizer, compiler):
    """Its next mask needs the token on the host: the engine refuses to launch ahead of it."""
    grammar = compiler.compile(Constraint("regex", "[0-9]{3}"))
    prompt = tokenizer.encode("Answer:", add_special_tokens=False)
    engine.insert(0, SlotState(tuple(prompt), (), SamplingParams(temperature=0.0, max_tokens=5, constraint=grammar)))
    pages = list(range(1, 17))
    try:
        first = engine.launch(StepBatch((StepSeq(0, prompt, 0, pages, True),)))
        with pytest.raises(ValueError, match="grammar-constrained"):
            engine.launch(StepBatch((StepSeq(0, [PREVIOUS_SAMPLE], len(prompt), pages, True),)))
        token = first.result()[0].token_id
        second = engine.step(StepBatch((StepSeq(0, [token], len(prompt), pages, True),)))[0].token_id
        assert tokenizer.decode([token, second]).isdigit()
    finally:
        engine.free(0)


def test_scheduler_runs_constrained_and_free_requests_together_exactly(engine, tokenizer, compiler):
    """The scheduler never launches a constrained sequence's next step ahead of its sample (the engine
    would refuse), overlaps steps when no grammar runs, and every output equals the host loop's."""
    from slipstream.engine.scheduler import OutputProcessor, Scheduler

    prompt = tokenizer.encode("Answer:", add_special_tokens=False)
    constrained = SamplingParams(temperature=1.0, seed=1, max_tokens=12,
                                 constraint=compiler.compile(Constraint("regex", "[0-9]{3}-[a-z]{2}")))
    free = SamplingParams(temperature=1.0, seed=1, max_tokens=12, ignore_eos=True)
    want = [ids for _, _, ids in generate(engine, tokenizer, [(prompt, constrained), (prompt, free)])]
    scheduler = Scheduler(engine, OutputProcessor(tokenizer))
    scheduler.start()
    try:
        alone = scheduler.submit(Request(prompt, free)).result(timeout=120)
        both = [scheduler.submit(Request(prompt, p)) for p in (constrained, free)]
        together = [s.result(timeout=120) for s in both]
    finally:
        scheduler.shutdown(timeout=5)
    assert [c.error for c in together] == [None, None]
    assert [c.token_ids for c in together] == want and alone.token_ids == want[1]


def test_preempted_sequence_resumes_its_grammar(engine, tokenizer, compiler):
    """insert() with output already generated replays it into a fresh matcher."""
    grammar = compiler.compile(Constraint("choice", ["alpha beta gamma"]))
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    done = tokenizer.encode("alpha beta", add_special_tokens=False)
    engine.insert(0, SlotState(tuple(prompt), tuple(done), SamplingParams(temperature=0.0, max_tokens=20,
                                                                          constraint=grammar)))
    known = prompt + done
    out = []
    try:
        # the recompute as the scheduler cuts it: the prompt, then the replayed output (engine/api.StepBatch)
        engine.step(StepBatch((StepSeq(0, prompt, 0, list(range(1, 17)), False),)))
        known, pre = done, len(prompt)
        for _ in range(10):
            fed = known if not out else [out[-1]]
            start = pre + len(known) + len(out) - len(fed)
            out.append(engine.step(StepBatch((StepSeq(0, fed, start, list(range(1, 17)), True),)))[0].token_id)
            if out[-1] == EOS:
                break
    finally:
        engine.free(0)
    assert tokenizer.decode(done + out[:-1]) == "alpha beta gamma" and out[-1] == EOS


def test_constrained_row_at_max_tokens_ends_with_length(engine, tokenizer, compiler):
    grammar = compiler.compile(Constraint("json_schema", {"type": "array", "items": {"type": "integer"},
                                                          "minItems": 40}))
    prompt = tokenizer.encode("List:", add_special_tokens=False)
    [(text, finish, _)] = generate(engine, tokenizer, [(prompt, SamplingParams(max_tokens=8, seed=3,
                                                                            constraint=grammar))])
    assert finish == "length" and text.startswith("[")


# ---- property: random schemas, every finished output validates ----------------------------------

_names = st.sampled_from(["id", "name", "kind", "tags", "size", "ok", "point", "items", "note"])


def _leaf():
    return st.one_of(
        st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                  st.integers(-1000, 1000), st.integers(0, 5000)),
        st.builds(lambda lo, span: {"type": "number", "minimum": lo, "maximum": lo + span},
                  st.integers(-100, 100), st.integers(1, 100)),
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 8)),
        st.lists(st.sampled_from(["red", "green", "blue", "a b", "x\"y"]), min_size=1, max_size=4,
                 unique=True).map(lambda e: {"enum": e}),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
    )


def _schemas():
    def extend(inner):
        objects = st.dictionaries(_names, inner, min_size=1, max_size=3).map(
            lambda props: {"type": "object", "properties": props, "required": sorted(props),
                           "additionalProperties": False})
        arrays = st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n},
                           inner, st.integers(0, 3))
        return st.one_of(objects, arrays)

    return st.recursive(_leaf(), extend, max_leaves=6).map(
        lambda s: s if s.get("type") == "object" else {"type": "object", "properties": {"value": s},
                                                       "required": ["value"], "additionalProperties": False})


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schemas=st.lists(_schemas(), min_size=4, max_size=4), seed=st.integers(0, 2**31))
def test_every_constrained_output_validates_against_its_random_schema(engine, tokenizer, compiler, schemas,
                                                                       seed):
    prompt = tokenizer.encode("JSON:", add_special_tokens=False)
    requests = [(prompt, SamplingParams(temperature=1.0, seed=seed + i, max_tokens=160,
                                        constraint=compiler.compile(Constraint("json_schema", s))))
                for i, s in enumerate(schemas)]
    for schema, (text, finish, _) in zip(schemas, generate(engine, tokenizer, requests)):
        assert finish == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("kind, source", [("regex", ["a"]), ("grammar", 5), ("choice", "a"), ("choice", []),
                                          ("choice", ["a", 1]), ("json_schema", [1]), ("json_schema", "x")])
def test_sources_of_the_wrong_type_are_invalid_params(compiler, kind, source):
    with pytest.raises(InvalidParam) as e:
        compiler.compile(Constraint(kind, source, field="structured_outputs"))
    assert e.value.field == "structured_outputs" and kind in e.value.message


def test_a_refused_token_leaves_only_eos(compiler, tokenizer):
    """A matcher that somehow took a token its grammar refuses ends its sequence rather than
    sampling from an empty mask."""
    matcher = compiler.compile(Constraint("choice", ["yes"])).matcher()
    assert not matcher.advance(tokenizer.encode("no", add_special_tokens=False)[0])
    assert matcher.error is not None and not matcher.advance(EOS)
    assert _allowed(MaskFiller(VOCAB, {EOS}).fill([matcher], 1)[0]) == {EOS}


@pytest.fixture(scope="module")
def think_tokenizer(tokenizer):
    """SmolLM2's tokenizer plus <think> and </think> as plain added tokens, as Qwen3's holds them."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer

    from slipstream.models.tokenizer import Tokenizer

    hf = HFTokenizer.from_str(tokenizer._hf.to_str())
    hf.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in ("<think>", "</think>")])
    return Tokenizer(hf, bos_token=None, eos_token=None, add_bos=False, chat_template=None)


@pytest.mark.parametrize("kind, source, answer", [
    ("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, '{"a": 12}'),
    ("regex", r"[0-9]+ apples", "12 apples"),
    ("choice", ["yes", "no"], "no"),
    ("grammar", 'start: "A" | "B" "C"', "BC")])
def test_a_thinking_models_grammar_lets_the_thinking_through_then_constrains_the_answer(tokenizer, think_tokenizer,
                                                                                     kind, source, answer):
    from slipstream.engine.structured import Reasoning
    from slipstream.server.reasoning import reasoning_format

    assert reasoning_format(tokenizer, "auto") is None  # SmolLM2's own: "<think>" is several tokens there
    fmt = reasoning_format(think_tokenizer, "auto")
    assert fmt is not None and (fmt.open_id, fmt.close_id) == (VOCAB, VOCAB + 1)
    vocab = VOCAB + 2
    compiler = GrammarCompiler(think_tokenizer, vocab, {EOS})
    filler = MaskFiller(vocab, {EOS})
    ids = lambda text: think_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731

    def run(inside: bool, text: str) -> tuple[bool, "Matcher"]:
        thinking = Reasoning(fmt.open_id, fmt.close_id, inside)
        matcher = compiler.compile(Constraint(kind, source, reasoning=thinking)).matcher()
        return all(matcher.advance(t) for t in ids(text)), matcher

    thinking = "<think>\nIs it {x}? 7 < 8, so... no.\n</think>\n\n"
    for inside, text in [(False, thinking + answer), (False, answer), (True, thinking[7:] + answer)]:
        ok, matcher = run(inside, text)
        assert ok and matcher.done, (inside, text)
    # while thinking, anything but the tags' own order and EOS goes
    ok, matcher = run(False, "<think>Anything {[ goes")
    allowed = _allowed(filler.fill([matcher], 1)[0])
    assert ok and fmt.close_id in allowed and fmt.open_id not in allowed and EOS not in allowed
    assert set(ids(" here")) <= allowed
    # after the thinking, and with no thinking, the constraint holds
    for text in (thinking + "Hmm", "Hmm"):
        ok, matcher = run(False, text)
        assert not ok, text
    ok, matcher = run(True, "")
    first = _allowed(filler.fill([matcher], 1)[0])
    assert fmt.open_id not in first and fmt.close_id in first  # the prompt opened it: close it, don't reopen


def test_allowed_token_ids_and_a_grammar_do_not_combine(compiler):
    """Both would limit the same mask row: the grammar alone decides (an empty intersection could leave nothing)."""
    with pytest.raises(InvalidParam) as e:
        SamplingParams(max_tokens=4, constraint=compiler.compile(Constraint("choice", ["yes"])), allowed_token_ids=(5,))
    assert e.value.field == "allowed_token_ids"
