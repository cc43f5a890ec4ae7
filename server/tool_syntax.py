"""How each model family writes tool calls (its syntax): replies parsed into calls, calls rendered as the model writes
them, and the Lark grammar of one forced call. Plain text in, plain data out; which syntax a model uses is
server/tool_formats.py's choice."""
from __future__ import annotations

import ast
import hashlib
import json
from typing import Any, Callable, Iterable, Sequence

# the separators a JSON schema's grammar writes (engine/structured.py's): small models loop on free whitespace
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
Call = tuple[str, Any]  # a parsed call: the function's name and its arguments (a JSON value as the model wrote it)
Token = Callable[[str], str]  # a marker as a Lark expression: its special token by id, or its text
_DECODER = json.JSONDecoder()


def _space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _json_at(text: str, i: int) -> tuple[Any, int] | None:
    """The JSON value at text[i] (after whitespace) and where it ends, or None. Text Python's json cannot read
    (5000 nested brackets: RecursionError) is no value: it stays the model's text, not a 500."""
    try:
        return _DECODER.raw_decode(text, _space(text, i))
    except (ValueError, RecursionError):
        return None


def _call_of(obj: Any, names: set[str]) -> Call | None:
    """{"name": ..., "arguments" or "parameters": ...} naming one of the tools, as a Call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    return obj["name"], next((obj[k] for k in ("arguments", "parameters") if k in obj), {})


def _calls_of(value: Any, names: set[str]) -> list[Call] | None:
    """A JSON list of calls, each naming one of the tools; None for anything else."""
    if not isinstance(value, list) or not value:
        return None
    calls = [_call_of(v, names) for v in value]
    return None if None in calls else calls  # type: ignore[return-value]


def _call_schema(name: str, params: dict, key: str) -> dict:
    """One call's JSON object: the name fixed, the arguments under `key` held to the function's parameters."""
    defs = params.get("$defs")
    params = {k: v for k, v in params.items() if k != "$defs"}
    return {"type": "object", "additionalProperties": False, "required": ["name", key],
            "properties": {"name": {"const": name}, key: params}, **({"$defs": defs} if defs else {})}


def _embedded(schema: dict) -> str:
    """A JSON schema inside a Lark grammar, written with JSON_OPTIONS' separators."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS})


def json_head(name: str, key: str) -> str:
    """A call object's text up to its arguments, as the grammar writes it."""
    return "{" + f'"name": {json.dumps(name, ensure_ascii=False)}, "{key}": '


class Syntax:
    """How one model family writes tool calls."""

    name = ""
    key = "arguments"          # the call object's field for the arguments
    special: tuple[str, ...] = ()  # markers its vocabulary holds as single special tokens
    how = ""                   # the fallback system prompt's description of a call

    def markers(self, names: Iterable[str]) -> tuple[str, ...]:
        """Texts at which a call may start."""
        raise NotImplementedError

    def parse_at(self, text: str, start: int, names: set[str]) -> tuple[list[Call], int] | None:
        """The calls written from text[start] (where a marker is) and where they end, or None: not a call."""
        raise NotImplementedError

    def render(self, calls: Sequence[Call]) -> str:
        """Calls as the model writes them (earlier turns' calls, for a template that knows no tools)."""
        raise NotImplementedError

    def grammar(self, name: str, params: dict, token: Token) -> str:
        """A Lark expression for one call of `name` with arguments held to `params`."""
        raise NotImplementedError

    def frame(self, name: str) -> tuple[str, str] | None:
        """The text before and after a forced call's arguments, when they are its JSON as written (streamed as they
        come); None when they are not JSON."""
        return None

    def history_id(self, call_id: str | None) -> str | None:
        """An earlier call's id as the chat template takes it."""
        return call_id

    def parse(self, text: str, names: set[str]) -> tuple[str, list[Call]]:
        """(the text outside the calls, the calls) of a reply. A marker that starts no call stays text."""
        calls: list[Call] = []
        content, pos, markers = [], 0, self.markers(names)
        while True:
            start = min((i for m in markers if (i := text.find(m, pos)) >= 0), default=-1)
            if start < 0:
                break
            found = self.parse_at(text, start, names)
            if found is None:
                content.append(text[pos:start + 1])
                pos = start + 1
                continue
            content.append(text[pos:start])
            calls += found[0]
            pos = found[1]
        content.append(text[pos:])
        return "".join(content), calls


class Hermes(Syntax):
    """Qwen2.5, Qwen3, Hermes: <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, one block a call."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    how = ("For each function call, return a json object with function name and arguments within "
           f"{OPEN}{CLOSE} XML tags:\n{OPEN}\n" '{"name": <function-name>, "arguments": <args-json-object>}\n'
           f"{CLOSE}")

    def markers(self, names: Iterable[str]) -> tuple[str, ...]:
        return (self.OPEN,)

    def parse_at(self, text: str, start: int, names: set[str]) -> tuple[list[Call], int] | None:
        close = text.find(self.CLOSE, start)
        body = text[start + len(self.OPEN):close if close >= 0 else len(text)]  # unclosed: cut short after the JSON
        got = _json_at(body, 0)
        call = _call_of(got[0], names) if got is not None and not body[got[1]:].strip() else None
        return None if call is None else ([call], close + len(self.CLOSE) if close >= 0 else len(text))

    def render(self, calls: Sequence[Call]) -> str:
        return "\n".join(f"{self.OPEN}\n" + json.dumps({"name": n, "arguments": a}, ensure_ascii=False) +
                         f"\n{self.CLOSE}" for n, a in calls)

    def grammar(self, name: str, params: dict, token: Token) -> str:
        return f'{token(self.OPEN)} "\\n" {_embedded(_call_schema(name, params, self.key))} "\\n" {token(self.CLOSE)}'

    def frame(self, name: str) -> tuple[str, str] | None:
        return json_head(name, self.key), "}\n" + self.CLOSE


class Llama3Json(Syntax):
    """Llama 3.1-3.3 (and Llama 4's template): {"name": ..., "parameters": {...}}, optionally after <|python_tag|>,
    several separated by semicolons."""

    name, key = "llama3_json", "parameters"
    TAG = "<|python_tag|>"
    special = (TAG,)
    how = 'To call a function, respond in the format {"name": <function-name>, "parameters": <args-json-object>}.'

    def markers(self, names: Iterable[str]) -> tuple[str, ...]:
        return self.TAG, '{"name"'

    def parse_at(self, text: str, start: int, names: set[str]) -> tuple[list[Call], int] | None:
        i = start + len(self.TAG) if text.startswith(self.TAG, start) else start
        calls, end = [], i
        while (got := _json_at(text, i)) is not None and (call := _call_of(got[0], names)) is not None:
            calls.append(call)
            end = got[1]
            j = _space(text, end)
            if not text.startswith(";", j):
                break
            i = j + 1
        return (calls, end) if calls else None

    def render(self, calls: Sequence[Call]) -> str:
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)

    def grammar(self, name: str, params: dict, token: Token) -> str:
        return _embedded(_call_schema(name, params, self.key))

    def frame(self, name: str) -> tuple[str, str] | None:
        return json_head(name, self.key), "}"


class Mistral(Syntax):
    """Mistral and Mixtral: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]; tokenizers of version 11 and later
    (with an [ARGS] token): [TOOL_CALLS]name[ARGS]{...} for each call. Both are parsed."""

    name = "mistral"
    CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
    special = (CALLS, ARGS)

    def __init__(self, v11: bool = False) -> None:
        self.v11 = v11
        self.how = ("To call functions, respond with " + (f"{self.CALLS}<function-name>{self.ARGS}<args-json-object> "
                                                          "for each call." if v11 else
                                                          f'{self.CALLS}[{{"name": <function-name>, "arguments": '
                                                          '<args-json-object>}, ...].'))

    def markers(self, names: Iterable[str]) -> tuple[str, ...]:
        return (self.CALLS,)

    def history_id(self, call_id: str | None) -> str | None:
        """Mistral's templates take nine letters and digits (and raise on other ids): other ids map to nine of
        their hash, the same for a call and its result."""
        if call_id is None or (len(call_id) == 9 and call_id.isascii() and call_id.isalnum()):
            return call_id
        return hashlib.sha256(call_id.encode("utf-8", "surrogatepass")).hexdigest()[:9]

    def parse_at(self, text: str, start: int, names: set[str]) -> tuple[list[Call], int] | None:
        i = _space(text, start + len(self.CALLS))
        if text.startswith("[", i):
            got = _json_at(text, i)
            calls = _calls_of(got[0], names) if got is not None else None
            return (calls, got[1]) if calls else None
        cut = text.find(self.ARGS, i)
        if cut < 0 or text[i:cut].strip() not in names or (got := _json_at(text, cut + len(self.ARGS))) is None:
            return None
        return [(text[i:cut].strip(), got[0])], got[1]

    def render(self, calls: Sequence[Call]) -> str:
        if self.v11:
            return "".join(f"{self.CALLS}{n}{self.ARGS}" + json.dumps(a, ensure_ascii=False) for n, a in calls)
        return self.CALLS + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)

    def grammar(self, name: str, params: dict, token: Token) -> str:
        if self.v11:
            return f"{token(self.CALLS)} {json.dumps(name)} {token(self.ARGS)} {_embedded(params)}"
        # a SentencePiece vocabulary's "[" after the marker may be "▁[": the space is allowed
        return f'{token(self.CALLS)} " "? "[" {_embedded(_call_schema(name, params, self.key))} "]"'

    def frame(self, name: str) -> tuple[str, str] | None:
        return (name + self.ARGS, "") if self.v11 else (json_head(name, self.key), "}]")


class Phi4Mini(Syntax):
    """Phi-4-mini: functools[{"name": ..., "arguments": {...}}, ...]."""

    name, OPEN = "phi4_mini", "functools"
    how = 'To call functions, respond with functools[{"name": <function-name>, "arguments": <args-json-object>}, ...].'

    def markers(self, names: Iterable[str]) -> tuple[str, ...]:
        return (self.OPEN + "[",)

    def parse_at(self, text: str, start: int, names: set[str]) -> tuple[list[Call], int] | None:
        got = _json_at(text, start + len(self.OPEN))
        calls = _calls_of(got[0], names) if got is not None else None
        return (calls, got[1]) if calls else None

    def render(self, calls: Sequence[Call]) -> str:
        return self.OPEN + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)

    def grammar(self, name: str, params: dict, token: Token) -> str:
        return f'"{self.OPEN}[" {_embedded(_call_schema(name, params, self.key))} "]"'

    def frame(self, name: str) -> tuple[str, str] | None:
        return json_head(name, self.key), "}]"


_LITERAL_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}
_NOT_LITERAL = object()
MAX_PYTHONIC_TRIES = 256  # closing brackets tried as the end of a pythonic call list (each try parses the text)


def _literal(node: ast.AST) -> Any:
    """A Python (or JSON) literal's value, or _NOT_LITERAL."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _LITERAL_NAMES:
        return _LITERAL_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant) \
            and isinstance(node.operand.value, (int, float)):
        return -node.operand.value
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_literal(e) for e in node.elts]
        return _NOT_LITERAL if any(v is _NOT_LITERAL for v in items) else items
    if isinstance(node, ast.Dict):
        keys, values = [_literal(k) if k is not None else None for k in node.keys], [_literal(v) for v in node.values]
        if not all(isinstance(k, str) for k in keys) or any(v is _NOT_LITERAL for v in values):
            return _NOT_LITERAL
        return dict(zip(keys, values))
    return _NOT_LITERAL


def _python(value: Any) -> str:
    """A JSON value as a Python literal, its strings and numbers written as JSON writes them (as the grammar does)."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k), ensure_ascii=False)}: {_python(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_python(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def _python_calls(source: str, names: set[str]) -> list[Call] | None:
    try:
        tree = ast.parse(source, mode="eval")
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        calls = []
        for node in tree.body.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names
                    and not node.args and all(k.arg for k in node.keywords)):
                return None
            args = {k.arg: _literal(k.value) for k in node.keywords}
            if any(v is _NOT_LITERAL for v in args.values()):
                return None
            calls.append((node.func.id, args))
        return calls
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


class Pythonic(Syntax):
    """Llama 3.2's and Llama 4's alternative, Gemma 3 when prompted: [get_weather(city="Paris"), get_time()]."""

    name = "pythonic"
    how = "To call functions, respond with a Python list of calls: [function_name(argument=value, ...), ...]."

    def markers(self, names: Iterable[str]) -> tuple[str, ...]:
        return tuple(f"[{n}(" for n in names)

    def parse_at(self, text: str, start: int, names: set[str]) -> tuple[list[Call], int] | None:
        end = start
        for _ in range(MAX_PYTHONIC_TRIES):
            end = text.find("]", end) + 1
            if end == 0:
                return None
            if (calls := _python_calls(text[start:end], names)) is not None:
                return calls, end
        return None

    def render(self, calls: Sequence[Call]) -> str:
        def args(a: Any) -> str:
            items = a.items() if isinstance(a, dict) else [("arguments", a)]
            return ", ".join(f"{k}={_python(v)}" for k, v in items)

        return "[" + ", ".join(f"{n}({args(a)})" for n, a in calls) + "]"

    def grammar(self, name: str, params: dict, token: Token) -> str:
        """Keyword arguments in the schema's order, values written as JSON (which the parser reads too): the
        required ones, then each optional one or not."""
        defs = {"$defs": params["$defs"]} if params.get("$defs") else {}
        props = params.get("properties") or {}
        required = set(params.get("required") or ())
        arg = {k: f"{json.dumps(k + '=')} {_embedded({**s, **defs} if isinstance(s, dict) else {})}"
               for k, s in props.items()}
        needed = [arg[k] for k in props if k in required]
        optional = [arg[k] for k in props if k not in required]
        if needed:
            body = ' ", " '.join(needed) + "".join(f' (", " {o})?' for o in optional)
        elif optional:
            body = f"({optional[0]}" + "".join(f' (", " {o})?' for o in optional[1:]) + ")?"
        else:
            body = ""
        return f'{json.dumps(f"[{name}(")} {body} ")]"'


SYNTAXES: dict[str, Callable[[], Syntax]] = {"hermes": Hermes, "llama3_json": Llama3Json, "mistral": Mistral,
                                             "phi4_mini": Phi4Mini, "pythonic": Pythonic}
