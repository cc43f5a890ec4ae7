"""Structured output: grammars (JSON schema, regex, choice, Lark/EBNF) compiled with llguidance,
per-request matchers and the packed token bitmask they fill for the sampler. Plain Python and
numpy; no JAX here (the runner applies the mask inside its jitted sampling program).

llguidance computes masks lazily per step (tens of microseconds a token), compiles a schema in
milliseconds and has no dependencies; xgrammar pulls in PyTorch, outlines-core has no CFG support.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Any, Iterable, Sequence

import llguidance
import llguidance.numpy
import numpy as np

from slipstream.engine.grammar_cost import MAX_SCHEMA_DEPTH, nesting_depth, too_costly
from slipstream.engine.errors import InvalidParam

log = logging.getLogger(__name__)

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SOURCE_CHARS = 64 * 1024        # schema / regex / grammar text a request may send
MAX_CHOICES = 256
# llguidance compiles lazily (a 100 kB schema in ~0.15 s here); a request's grammar that still takes
# longer than this to validate and yield its first mask is refused rather than slowing the server.
MAX_COMPILE_SECONDS = 2.0
# Bounds on what one grammar may cost llguidance. Compiling touches only the first two; the
# lexer states and step fuel bound the mask time of one token (each a 400 when exceeded), but not
# that of a regex with nested counted repetition: engine/grammar_cost.py sizes those before compiling.
LIMITS = dict(max_grammar_size=200_000, initial_lexer_fuel=1_000_000, max_lexer_states=100_000,
              step_lexer_fuel=200_000, step_max_items=50_000)
# Compact JSON with the separators json.dumps uses: small models otherwise loop on whitespace.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclasses.dataclass(frozen=True)
class Reasoning:
    """A reasoning model's thinking before a constrained answer: free text between two tokens of the vocabulary
    (<think> ... </think>), which the grammar lets through before the constraint applies."""

    open_id: int
    close_id: int
    inside: bool  # the prompt opened the thinking: the output starts in it and must close it


@dataclasses.dataclass(frozen=True)
class Constraint:
    """What a request asks its output to match, before compilation (the front ends build it)."""

    kind: str                 # one of KINDS
    source: Any = None        # schema dict, regex str, list of choices, grammar str; None for json_object
    field: str = "response_format"  # the request field to blame in errors
    reasoning: Reasoning | None = None  # a thinking model: the constraint applies to the answer after it

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}")


class Grammar:
    """A compiled, validated grammar; immutable and shared by every sequence of its request."""

    def __init__(self, compiler: "GrammarCompiler", text: str, constraint: Constraint) -> None:
        self._compiler = compiler
        self.text = text          # llguidance's grammar definition
        self.constraint = constraint

    def matcher(self) -> "Matcher":
        return Matcher(llguidance.LLMatcher(self._compiler.tokenizer, self.text, log_level=0,
                                            limits=self._compiler.limits))


class Matcher:
    """One sequence's position in its grammar: fills its row of the mask, consumes sampled tokens."""

    def __init__(self, ll: llguidance.LLMatcher) -> None:
        self.ll = ll

    def advance(self, token_id: int) -> bool:
        """Consume a sampled token; False (and a logged error) if the grammar refuses it."""
        if self.ll.is_error():
            return False  # reported once already; its mask now allows EOS only
        if self.ll.is_stopped():
            return True  # EOS after the grammar completed (or ignore_eos going on): nothing to match
        if not self.ll.consume_token(token_id):
            log.warning("constrained sequence: token %d refused: %s", token_id, self.ll.get_error())
            return False
        return True

    @property
    def error(self) -> str | None:
        return self.ll.get_error() if self.ll.is_error() else None

    @property
    def done(self) -> bool:
        """The grammar is complete: only EOS is allowed next."""
        return self.ll.is_stopped()


class GrammarCompiler:
    """Compiles constraints against one tokenizer (built once per served model, ~0.5 s)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        """tokenizer: models.tokenizer.Tokenizer (its HF `tokenizers` JSON is what llguidance reads);
        vocab_size: the model's logits width, which may exceed the tokenizer's."""
        eos = sorted(set(eos_token_ids))
        if not eos:
            raise ValueError("structured output needs an EOS token to end a completed grammar")
        self.tokenizer = llguidance.LLTokenizer(_tokenizer_json(tokenizer), n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size
        self.limits = llguidance.LLParserLimits(**LIMITS)

    def compile(self, constraint: Constraint) -> Grammar:
        """A Grammar, or InvalidParam naming the request field and what is wrong (HTTP 400)."""
        field = constraint.field
        source = _source_text(constraint)
        if len(source) > MAX_SOURCE_CHARS:
            raise InvalidParam(field, f"{field}: the {constraint.kind} is {len(source)} characters; "
                                      f"the limit is {MAX_SOURCE_CHARS}")
        if constraint.kind == "json_schema" and (depth := nesting_depth(constraint.source)) > MAX_SCHEMA_DEPTH:
            raise InvalidParam(field, f"{field}: the JSON schema is nested {depth} levels deep; the limit is "
                                      f"{MAX_SCHEMA_DEPTH}")
        costly = too_costly(constraint.kind, constraint.source)
        if costly is not None:  # masks would cost milliseconds a token, on every step, for the whole batch
            raise InvalidParam(field, f"{field}: {costly}")
        try:
            text = _grammar_text(constraint)
        except ValueError as e:
            raise InvalidParam(field, f"{field}: invalid {constraint.kind}: {e}") from None
        start = time.perf_counter()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, self.tokenizer,
                                                                                 limits=self.limits)
        if is_error:
            raise InvalidParam(field, f"{field}: invalid {constraint.kind}: {_first_line(messages[0])}")
        grammar = Grammar(self, text, constraint)
        # Building the matcher runs the lexer's first pass: it fails here, not on the engine thread,
        # when a grammar is too large or too slow for the limits.
        matcher = grammar.matcher()
        llguidance.numpy.fill_next_token_bitmask(matcher.ll, llguidance.numpy.allocate_token_bitmask(
            1, self.vocab_size))
        if matcher.error is not None:
            raise InvalidParam(field, f"{field}: the {constraint.kind} exceeds a grammar limit "
                                      f"({_limits_text()}): {_first_line(matcher.error)}")
        seconds = time.perf_counter() - start
        if seconds > MAX_COMPILE_SECONDS:
            raise InvalidParam(field, f"{field}: the {constraint.kind} took {seconds:.1f} s to compile; "
                                      f"the limit is {MAX_COMPILE_SECONDS:g} s")
        return grammar


def _tokenizer_json(tokenizer) -> str:
    hf = getattr(tokenizer, "_hf", None)
    if hf is None or not hasattr(hf, "to_str"):
        raise ValueError("structured output needs a Hugging Face `tokenizers` tokenizer")
    return hf.to_str()


def _source_text(c: Constraint) -> str:
    if c.source is None:
        return ""
    return c.source if isinstance(c.source, str) else json.dumps(c.source)


def _grammar_text(c: Constraint) -> str:
    text = _answer_grammar(c)
    return text if c.reasoning is None else _after_reasoning(text, c.reasoning)


def _after_reasoning(answer: str, r: Reasoning) -> str:
    """The answer's grammar behind the thinking: `... <close>` first when the prompt opened it, else optionally
    `<open> ... <close>`, then whitespace. The thinking's text cannot hold the tag tokens (llguidance keeps a
    regex's text apart from the tokens a grammar names), so the first closing token ends it."""
    top = json.loads(answer) if answer.lstrip().startswith("{") else {"grammars": [{"lark_grammar": answer}]}
    body = {**top["grammars"][0], "name": "answer"}
    closed = f"thinking <[{r.close_id}]> gap"  # the newlines models write before the answer (Qwen3: two)
    lead = f"start: {closed} @answer\n" if r.inside else f"start: (<[{r.open_id}]> {closed})? @answer\n"
    head = {"name": "reasoning", "lark_grammar": lead + "thinking: /(.|\\n)*/\ngap: /[ \\t\\r\\n]*/\n"}
    return json.dumps({**top, "grammars": [head, body, *top["grammars"][1:]]})


def _answer_grammar(c: Constraint) -> str:
    if c.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if c.kind == "json_schema":
        if isinstance(c.source, bool):
            c = dataclasses.replace(c, source={} if c.source else {"not": {}})
        if not isinstance(c.source, dict):
            raise ValueError(f"a JSON schema is an object, got {type(c.source).__name__}")
        return llguidance.LLMatcher.grammar_from_json_schema(c.source, defaults=_JSON_OPTIONS)
    if not isinstance(c.source, list if c.kind == "choice" else str):
        raise ValueError(f"expected {'a list of strings' if c.kind == 'choice' else 'a string'}, "
                         f"got {type(c.source).__name__}")
    if c.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(c.source)
    if c.kind == "choice":
        choices = c.source
        if not isinstance(choices, list) or not choices or not all(isinstance(x, str) for x in choices):
            raise ValueError("choices must be a non-empty list of strings")
        if len(choices) > MAX_CHOICES:
            raise ValueError(f"at most {MAX_CHOICES} choices, got {len(choices)}")
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(x) for x in choices))
    return llguidance.grammar_from("grammar", c.source)  # Lark, or GBNF/EBNF (converted to Lark)


def _first_line(message: str) -> str:
    lines = [line for line in message.strip().splitlines() if line.strip()]
    return " ".join(line.strip() for line in lines[:8])[:500] if lines else "rejected by the grammar compiler"


def _limits_text() -> str:
    return ", ".join(f"{k}={v}" for k, v in LIMITS.items())


# ---- the packed mask --------------------------------------------------------------------------

def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class MaskFiller:
    """Fills rows of a packed uint32 [B, ceil(V/32)] mask (bit t of row r: token t allowed)."""

    def __init__(self, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self.vocab_size = vocab_size
        self.words = mask_words(vocab_size)
        self._eos_row = self.packed(eos_token_ids)
        self._executor: llguidance.LLExecutor | None = None

    def restrict(self, mask: np.ndarray | None, batch: int, allowed: dict[int, np.ndarray]) -> np.ndarray:
        """`mask` (None: all ones) with each row r of `allowed` limited to its packed row of tokens (allowed_token_ids;
        min_tokens: all but EOS and the request's stop tokens)."""
        out = np.full((batch, self.words), 0xFFFFFFFF, np.uint32) if mask is None else mask
        for r, row in allowed.items():
            out[r] &= row
        return out

    def packed(self, tokens: Iterable[int]) -> np.ndarray:
        """u32[ceil(V/32)]: a mask row allowing exactly `tokens`."""
        row = np.zeros(self.words, np.uint32)
        for t in tokens:
            row[t // 32] |= np.uint32(1 << (t % 32))
        return row

    def fill(self, rows: Sequence["Matcher | None"], batch: int) -> np.ndarray | None:
        """The mask of a batch of `batch` rows whose first len(rows) have these matchers (None:
        unconstrained, all ones); None when no row is constrained (the sampler skips the mask)."""
        jobs = [(m.ll, i) for i, m in enumerate(rows) if m is not None]
        if not jobs:
            return None
        mask = np.full((batch, self.words), -1, np.int32)  # llguidance writes int32 rows
        if len(jobs) == 1:
            llguidance.numpy.fill_next_token_bitmask(jobs[0][0], mask, jobs[0][1])
        else:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, jobs, mask)
        out = mask.view(np.uint32)
        for ll, i in jobs:
            if ll.is_error():  # a refused token or an exhausted step limit: end the sequence
                out[i] = self._eos_row
        return out
