"""The unrolled size of a grammar's regexes, computed before llguidance sees them."""
from __future__ import annotations

import pytest

from slipstream.engine.grammar_cost import MAX_REGEX_SIZE, nesting_depth, regex_size, too_costly


@pytest.mark.parametrize("pattern, size", [
    ("abc", 3), ("a{1000}", 1000), ("(a{50}){50}", 2500), ("((a{50}){50}){50}", 125_000),
    ("[a-z ]{0,500}", 500), ("a{2,}|b*", 3), (r"^\d{4}-\d{2}-\d{2}$", 12), ("(?=a{3})b", 4),
    # not Python syntax (llguidance reads Rust's): every count multiplied, never an underestimate
    (r"\p{L}{3}(x{100}){200}", 60_000),
])
def test_regex_size_multiplies_nested_counts(pattern: str, size: int) -> None:
    assert regex_size(pattern) == size


def test_too_costly_finds_regexes_in_every_kind() -> None:
    nested = "((a{50}){50}){50}"
    assert "the limit is" in too_costly("regex", nested)
    schema = {"type": "object", "properties": {"x": {"type": "array", "items": {"type": "string", "pattern": nested}}}}
    assert "properties/x/items/pattern" in too_costly("json_schema", schema)
    assert "patternProperties" in too_costly("json_schema", {"patternProperties": {nested: {}}})
    assert "terminal" in too_costly("grammar", f'start: "x" /{nested}/')
    assert too_costly("regex", "a{%d}" % MAX_REGEX_SIZE) is None
    assert too_costly("json_schema", {"type": "string", "pattern": "^[a-z]{1,20}$"}) is None


def test_nesting_depth_needs_no_recursion() -> None:
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    assert nesting_depth(deep) == 100_001 and nesting_depth({"a": [1, {"b": 2}]}) == 3 and nesting_depth(1) == 0


@pytest.fixture(scope="module")
def compiler(default_tokenizer):
    from slipstream.engine.structured import GrammarCompiler

    tokenizer = default_tokenizer
    return GrammarCompiler(tokenizer, 49152, tokenizer.eos_token_ids)


def _nested_arrays(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


def test_a_deep_schema_is_refused_as_too_deep_naming_the_limit(compiler) -> None:
    from slipstream.engine.errors import InvalidParam
    from slipstream.engine.structured import Constraint

    compiler.compile(Constraint("json_schema", _nested_arrays(90)))  # within the limit: compiles
    with pytest.raises(InvalidParam) as info:  # llguidance said "recursion limit exceeded at line 1 column 2220"
        compiler.compile(Constraint("json_schema", _nested_arrays(200), field="guided_json"))
    assert info.value.message == "guided_json: the JSON schema is nested 201 levels deep; the limit is 100"


@pytest.mark.parametrize("kind, source", [
    ("regex", "((a{50}){50}){50}"),
    ("json_schema", {"type": "string", "pattern": "^((a{50}){50}){50}$"}),
    ("grammar", 'start: /((a{50}){50}){50}/'),
])
def test_a_grammar_whose_masks_would_be_slow_is_refused_at_compile_time(compiler, kind, source) -> None:
    from slipstream.engine.errors import InvalidParam
    from slipstream.engine.structured import Constraint

    with pytest.raises(InvalidParam) as info:
        compiler.compile(Constraint(kind, source, field="f"))
    assert f"the limit is {MAX_REGEX_SIZE}" in info.value.message
