"""What a grammar will cost per token, bounded before it is compiled: the unrolled size of every
regex in it (a regex, a JSON schema's patterns, a Lark grammar's /.../ terminals). Plain Python.

llguidance's own limits (step fuel, lexer states) do not catch nested counted repetition: a
16-byte regex, ((a{50}){50}){50}, compiles in 0.7 s and then costs 36-200 ms of mask time per
token on every step it runs, slowing every other request in the batch 20x or more.
"""
from __future__ import annotations

import re
import re._constants as sre_constants
import re._parser as sre_parser
import warnings
from typing import Any, Iterator

# Positions of a regex unrolled (a{1000}: 1000; (a{50}){50}: 2500). Mask time grows about linearly
# with it (SmolLM2's 49k vocabulary, one core: a{2000} 0.7 ms a token, (a{100}){100} 8 ms,
# ((a{50}){50}){50} 36-200 ms), so at this limit a constrained sequence adds under ~1 ms per step.
MAX_REGEX_SIZE = 2_000
# JSON nesting of a schema: llguidance's JSON reader stops at 128 levels, counting its own wrapper.
MAX_SCHEMA_DEPTH = 100
_REPEATS = {sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT, getattr(sre_constants, "POSSESSIVE_REPEAT", None)}
_COUNT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_LARK_REGEX = re.compile(r"/((?:[^/\\\n]|\\.)+)/[imslux]*")


def regex_size(pattern: str) -> int:
    """The regex unrolled: counted repetitions multiply what they repeat, sequences and branches add.

    A pattern Python's parser cannot read (llguidance takes Rust syntax, e.g. \\p{L}) is bounded by
    the product of every count in it, as if each nested in the next: never an underestimate."""
    try:
        with warnings.catch_warnings():  # "possible nested set" and friends: not the client's concern here
            warnings.simplefilter("ignore")
            return _size(sre_parser.parse(pattern))
    except (re.error, RecursionError, OverflowError, ValueError):
        total = 1
        for low, high in _COUNT.findall(pattern):
            total *= max(int(high or low or 1), 1)
            if total > MAX_REGEX_SIZE:
                break
        return total


def _size(items: Any) -> int:
    total = 0
    for op, arg in items:
        if op in _REPEATS:
            low, high, sub = arg
            # An unbounded tail (a{50,} = a{50}a*) is one more state, not a count.
            total += max(low if high == sre_constants.MAXREPEAT else high, 1) * _size(sub)
        elif op is sre_constants.SUBPATTERN:
            total += _size(arg[-1])
        elif op is sre_constants.BRANCH:
            total += sum(_size(alt) for alt in arg[1])
        elif op in (sre_constants.ASSERT, sre_constants.ASSERT_NOT):
            total += _size(arg[1])
        else:
            total += 1
        if total > MAX_REGEX_SIZE:
            return total  # already refused: stop before the product grows huge
    return total


def regexes(kind: str, source: Any) -> Iterator[tuple[str, str]]:
    """(where, regex) of every regex in a constraint's source."""
    if kind == "regex" and isinstance(source, str):
        yield "", source
    elif kind == "grammar" and isinstance(source, str):
        for m in _LARK_REGEX.finditer(source):
            yield f" terminal /{m.group(1)[:40]}/", m.group(1)
    elif kind == "json_schema":
        stack: list[tuple[str, Any]] = [("", source)]
        while stack:  # iterative: schemas can be deep
            path, node = stack.pop()
            if isinstance(node, dict):
                if isinstance(node.get("pattern"), str):
                    yield f" at {path or '/'}pattern", node["pattern"]
                for key in node.get("patternProperties") or {}:
                    if isinstance(key, str):
                        yield f" at {path or '/'}patternProperties", key
                stack.extend((f"{path}{k}/", v) for k, v in node.items() if isinstance(v, (dict, list)))
            elif isinstance(node, list):
                stack.extend((f"{path}{i}/", v) for i, v in enumerate(node) if isinstance(v, (dict, list)))


def too_costly(kind: str, source: Any) -> str | None:
    """Why the constraint's regexes are too large to serve, or None."""
    for where, pattern in regexes(kind, source):
        size = regex_size(pattern)
        # No longer unrolled than written (a long literal or alternation): MAX_SOURCE_CHARS bounds it.
        if size > max(MAX_REGEX_SIZE, len(pattern)):
            return (f"the regex{where} unrolls to more than {MAX_REGEX_SIZE} positions (nested counted "
                    f"repetitions multiply: (a{{50}}){{50}} is 2500); the limit is {MAX_REGEX_SIZE}")
    return None


def nesting_depth(value: Any) -> int:
    """JSON nesting levels of a parsed value (objects and arrays), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest
