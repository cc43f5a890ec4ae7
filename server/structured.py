"""Structured output and tool calling at the OpenAI edge: which request field asks for a grammar
(response_format, vLLM's structured_outputs / guided_*, tool_choice), the tools rendered into the
prompt, and the model's tool calls parsed back out (whole, or as OpenAI streaming deltas).

Tool calls use the Hermes/Qwen2.5 convention, <tool_call>{"name": ..., "arguments": {...}}</tool_call>,
put into the system prompt here so that it works with any chat template (SmolLM2's knows no tools).
"""
from __future__ import annotations

import dataclasses
import json
import threading
import uuid
import weakref
from typing import Any

from slipstream.engine.grammar_cost import MAX_SCHEMA_DEPTH, nesting_depth
from slipstream.engine.errors import InvalidParam
from slipstream.engine.structured import Constraint, Grammar, GrammarCompiler
from slipstream.server.errors import ServiceError, parse_input

_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
OPEN, CLOSE = "<tool_call>", "</tool_call>"

_compilers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def _bad(param: str, message: str) -> ServiceError:
    return ServiceError(400, message, param=param, code="invalid_value")


# ---- which field asks for a grammar --------------------------------------------------------------

def request_constraint(req: Any) -> Constraint | None:
    """The one constraint a completion/chat request asks for, or None (400 if it names several)."""
    found: list[Constraint] = []
    rf = getattr(req, "response_format", None)
    if rf is not None:
        kind = rf.get("type", "text")
        if kind == "json_object":
            found.append(Constraint("json_object"))
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise _bad("response_format", "response_format.json_schema must be an object with a 'schema'")
            found.append(Constraint("json_schema", spec["schema"], field="response_format"))
        elif kind != "text":
            raise _bad("response_format", f"response_format type must be text, json_object or json_schema, "
                                          f"got {kind!r}")
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        for key, kind in _STRUCTURED_OUTPUTS.items():
            if so.get(key) is not None:
                found.append(Constraint(kind, json_source(so[key], f"structured_outputs.{key}")
                                        if kind == "json_schema" else so[key], field=f"structured_outputs.{key}"))
        if so.get("json_object"):
            found.append(Constraint("json_object", field="structured_outputs.json_object"))
    for name, kind in _GUIDED.items():
        value = getattr(req, name, None)
        if value is not None:
            found.append(Constraint(kind, json_source(value, name) if kind == "json_schema" else value, field=name))
    if len(found) > 1:
        raise _bad(found[1].field, "ask for one output constraint only; got " + ", ".join(c.field for c in found))
    return found[0] if found else None


def json_source(value: Any, field: str) -> Any:
    """A schema sent as JSON text, parsed (a 400 naming `field` however the text fails)."""
    if not isinstance(value, str):
        return value
    try:
        return parse_input(field, "JSON", json.loads, value)
    except InvalidParam as e:
        raise _bad(field, e.message) from None


def compile_constraint(service: Any, constraint: Constraint) -> Grammar:
    """Compile against the served model's tokenizer (one compiler per service, built on first use)."""
    with _compilers_lock:
        compiler = _compilers.get(service)
        if compiler is None:
            eos = set(getattr(service.tokenizer, "eos_token_ids", ())) | set(service.engine.eos_token_ids)
            try:
                compiler = GrammarCompiler(service.tokenizer, service.vocab_size, eos)
            except ValueError as e:
                raise ServiceError(400, f"structured output is not available for this model: {e}",
                                   param=constraint.field, code="unsupported") from None
            _compilers[service] = compiler
    try:
        return parse_input(constraint.field, constraint.kind, compiler.compile, constraint)
    except InvalidParam as e:
        raise ServiceError(400, e.message, param=e.field, code="invalid_value") from None


# ---- tools -----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools mean for its prompt, its grammar and its reply."""

    tools: list[dict]           # the function definitions ({"name", "description", "parameters"})
    mode: str                   # "auto", "required" or "named"
    named: str | None = None    # the forced function's name ("named")

    def constraint(self) -> Constraint | None:
        """Forced calls are constrained: the arguments of the named function, or one call of any."""
        if self.mode != "auto":
            for i, t in enumerate(self.tools):  # before _hoist_defs, which recurses through them
                if (depth := nesting_depth(_parameters(t))) > MAX_SCHEMA_DEPTH:
                    field = f"tools.{i}.function.parameters"
                    raise _bad(field, f"{field} is nested {depth} levels deep; the limit is {MAX_SCHEMA_DEPTH}")
        if self.mode == "named":
            fn = next(t for t in self.tools if t["name"] == self.named)
            return Constraint("json_schema", _parameters(fn), field="tool_choice")
        if self.mode == "required":
            calls, defs = [], {}
            for i, t in enumerate(self.tools):
                params = _hoist_defs(_parameters(t), f"tool{i}_", defs, f"tools.{i}.function.parameters")
                calls.append({"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                              "properties": {"name": {"const": t["name"]}, "arguments": params}})
            return Constraint("json_schema", {"anyOf": calls, **({"$defs": defs} if defs else {})},
                              field="tool_choice")
        return None


def _hoist_defs(schema: dict, prefix: str, defs: dict, field: str) -> dict:
    """The schema without its local $defs, which move into `defs` under prefixed names (so that
    several functions' schemas fit under one root and their "#/$defs/..." references still resolve)."""
    schema = dict(schema)
    local = {}
    for key in ("definitions", "$defs"):
        found = schema.pop(key, {})
        if not isinstance(found, dict):
            raise _bad(f"{field}.{key}", f"{field}.{key} must be an object of schemas, got {type(found).__name__}")
        local.update(found)

    def fix(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            out = {k: fix(v) for k, v in node.items()}
            for root in ("#/$defs/", "#/definitions/"):
                if isinstance(ref, str) and ref.startswith(root):
                    out["$ref"] = "#/$defs/" + prefix + ref[len(root):]
            return out
        if isinstance(node, list):
            return [fix(v) for v in node]
        return node

    defs.update({prefix + name: fix(d) for name, d in local.items()})
    return fix(schema)


def _check_unicode(value: Any, field: str) -> None:
    """Tool definitions go into the prompt as JSON: a lone surrogate there would be blamed on
    `messages` at an index into the rendered template. Name the tool's field instead."""
    stack = [(field, value)]
    while stack:  # iterative: parameters can nest deeply
        path, node = stack.pop()
        if isinstance(node, dict):
            stack.extend((f"{path}.{k}", v) for k, v in node.items())
            stack.extend((f"{path} (a key)", k) for k in node if isinstance(k, str))
        elif isinstance(node, list):
            stack.extend((f"{path}.{j}", v) for j, v in enumerate(node))
        elif isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise _bad(path, f"{path} must be valid Unicode: lone surrogate {node[exc.start]!r} at index "
                                 f"{exc.start}") from None


def _parameters(fn: dict) -> dict:
    return fn.get("parameters") or {"type": "object", "properties": {}}


def tool_plan(tools: list[dict] | None, tool_choice: Any) -> ToolPlan | None:
    """None when the reply is plain text: no tools, or tool_choice "none"."""
    if tool_choice is not None and not tools:
        if tool_choice == "none":
            return None
        raise _bad("tool_choice", "tool_choice needs tools")
    if not tools or tool_choice == "none":
        return None
    functions = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad("tools", f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., ...}}}}")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise _bad("tools", f"tools[{i}].function.parameters must be a JSON schema object")
        _check_unicode(fn, f"tools.{i}.function")
        functions.append(fn)
    if tool_choice in (None, "auto"):
        return ToolPlan(functions, "auto")
    if tool_choice == "required":
        return ToolPlan(functions, "required")
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise _bad("tool_choice", "tool_choice must be none, auto, required or "
                                  "{'type': 'function', 'function': {'name': ...}}")
    if name not in {f["name"] for f in functions}:
        raise _bad("tool_choice", f"tool_choice names function {name!r}, which is not in tools")
    return ToolPlan(functions, "named", name)


def tools_prompt(plan: ToolPlan) -> str:
    listing = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in plan.tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listing}\n"
            "</tools>\n\nFor each function call, return a json object with function name and arguments within "
            f"{OPEN}{CLOSE} XML tags:\n{OPEN}\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n' f"{CLOSE}")


def with_tools(messages: list[dict[str, Any]], plan: ToolPlan | None) -> list[dict[str, Any]]:
    """Messages any template can render: the tools in the system prompt, earlier calls and their
    results as text in the same convention."""
    out = []
    for index, m in enumerate(messages):
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            field = f"messages.{index}.tool_calls"
            m["content"] = "\n".join([m.get("content") or ""] + [
                f"{OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                          "arguments": _arguments(c["function"].get("arguments"),
                                                                  f"{field}.{j}.function.arguments")},
                                         ensure_ascii=False) + f"\n{CLOSE}" for j, c in enumerate(calls)]).strip()
        if m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        m.pop("tool_call_id", None)
        out.append(m)
    if plan is not None:
        text = tools_prompt(plan)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "role": "system", "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _arguments(raw: Any, field: str) -> Any:
    """An earlier call's arguments as JSON when they parse, else as the text the client sent (OpenAI
    accepts any string); text Python's json cannot even read (too deep, too many digits) is a 400."""
    if isinstance(raw, str):
        return parse_input(field, "JSON", _json_or_text, raw)
    return raw if raw is not None else {}


def _json_or_text(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def partial_tail(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (0 if none): text a stream holds back."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: Any) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def _model_json(text: str) -> Any:
    """The model's JSON, or None. A prompt can make a model write what Python's json cannot read
    (5000 nested brackets: RecursionError): that is plain text, not a 500 after generating."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def parse_reply(plan: ToolPlan, text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a finished reply."""
    if plan.mode == "named":
        return None, [_call(plan.named, text)]
    if plan.mode == "required":
        call = _model_json(text)
        if not isinstance(call, dict) or "name" not in call or "arguments" not in call:
            return text, []  # cut short by max_tokens: no complete call to report
        return None, [_call(call["name"], call["arguments"])]
    names = {f["name"] for f in plan.tools}
    calls, content, rest = [], [], text
    while OPEN in rest:
        before, _, after = rest.partition(OPEN)
        body, closed, rest = after.partition(CLOSE)
        call = _model_json(body)
        ok = isinstance(call, dict) and call.get("name") in names
        content.append(before)
        if ok:
            calls.append(_call(call["name"], call.get("arguments", {})))
        else:
            content.append(OPEN + body + (CLOSE if closed else ""))
    content.append(rest)
    text_out = "".join(content).strip()
    return (text_out or None) if calls else text, calls


class ToolStream:
    """One streamed choice as OpenAI streams it: content passes through until a tool call may start;
    a named function's arguments stream as they come (its id and name first), other calls go out
    whole when the reply is complete. feed() and finish() return (content, tool_calls deltas)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""        # the whole reply so far
        self.sent = 0         # of it, how much went out (as content, or as a named call's arguments)
        self.calls: list[dict] = []

    def feed(self, piece: str) -> tuple[str, list[dict]]:
        self.text += piece
        if self.plan.mode == "named":
            if not piece:
                return "", []
            if not self.calls:
                self.calls = [_call(self.plan.named, "")]
                first = self.calls[0]
                return "", [{"index": 0, "id": first["id"], "type": "function",
                             "function": {"name": self.plan.named, "arguments": piece}}]
            return "", [{"index": 0, "function": {"arguments": piece}}]
        if self.plan.mode != "auto":
            return "", []
        start = self.text.find(OPEN, self.sent)
        if start >= 0:
            end = start
        else:  # hold back a tail that could be the start of the tag
            end = len(self.text) - partial_tail(self.text[self.sent:], OPEN)
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out, []

    def finish(self) -> tuple[str, list[dict]]:
        """What is left at the end of the reply."""
        if self.plan.mode == "named":
            return "", []
        content, calls = parse_reply(self.plan, self.text)
        self.calls = calls
        if not calls:
            rest, self.sent = self.text[self.sent:], len(self.text)
            return rest, []
        tail = ""
        if self.plan.mode == "auto" and content:
            sent = self.text[:self.sent]
            tail = content[len(sent):] if content.startswith(sent) else ""
        return tail, [{"index": i, **c} for i, c in enumerate(calls)]
