"""A chat request's tools: what tool_choice asks (ToolPlan: the mode, and the grammar of a forced call in the model's
syntax), how the tools and earlier calls reach the chat template (its own variables, or the system prompt), and the
reply's calls parsed back out, whole or as OpenAI streaming deltas. The model's format is server/tool_formats.py's."""
from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from slipstream.engine.grammar_cost import MAX_SCHEMA_DEPTH, nesting_depth, too_costly
from slipstream.engine.structured import Constraint
from slipstream.server.errors import ServiceError, parse_input
from slipstream.server.tool_formats import FALLBACK, ToolFormat
from slipstream.server.tool_syntax import Call, Hermes

OPEN, CLOSE = Hermes.OPEN, Hermes.CLOSE  # the fallback's tags


def _bad(param: str, message: str) -> ServiceError:
    return ServiceError(400, message, param=param, code="invalid_value")


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools mean for its prompt, its grammar and its reply."""

    tools: list[dict]           # the function definitions ({"name", "description", "parameters"})
    mode: str                   # "auto", "required" or "named"
    named: str | None = None    # the forced function's name ("named")
    fmt: ToolFormat = FALLBACK  # the served model's tool format
    parallel: bool = True       # parallel_tool_calls: false keeps a reply's first call only

    @property
    def names(self) -> set[str]:
        """The functions a reply may call."""
        return {self.named} if self.mode == "named" else {t["name"] for t in self.tools}

    def constraint(self) -> Constraint | None:
        """Forced calls are constrained to one call in the model's syntax: of the named function, or of any."""
        if self.mode == "auto":
            return None
        for i, t in enumerate(self.tools):  # before _hoist_defs, which recurses through them
            if (depth := nesting_depth(_parameters(t))) > MAX_SCHEMA_DEPTH:
                field = f"tools.{i}.function.parameters"
                raise _bad(field, f"{field} is nested {depth} levels deep; the limit is {MAX_SCHEMA_DEPTH}")
        calls = []
        for i, t in enumerate(self.tools):
            if t["name"] not in self.names:
                continue
            field, defs = f"tools.{i}.function.parameters", {}
            params = _hoist_defs(_parameters(t), defs, field)
            params = {**params, "$defs": defs} if defs else params
            # the grammar embeds the schema in Lark text, where the JSON schema's regex checks would not see it
            if (costly := too_costly("json_schema", params)) is not None:
                raise _bad(field, f"{field}: {costly}")
            calls.append(self.fmt.syntax.grammar(t["name"], params, self.fmt.token))
        rules = "".join(f"\ncall{i}: {call}" for i, call in enumerate(calls))
        return Constraint("grammar", "start: " + " | ".join(f"call{i}" for i in range(len(calls))) + rules,
                          field="tool_choice")


def _hoist_defs(schema: dict, defs: dict, field: str) -> dict:
    """The schema without its local $defs and definitions, which move into `defs` (so that the schema fits under
    another root, the call's, and its "#/$defs/..." and "#/definitions/..." references resolve there)."""
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
                    out["$ref"] = "#/$defs/" + ref[len(root):]
            return out
        if isinstance(node, list):
            return [fix(v) for v in node]
        return node

    defs.update({name: fix(d) for name, d in local.items()})
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


def tool_plan(tools: list[dict] | None, tool_choice: Any, fmt: ToolFormat = FALLBACK,
              parallel_tool_calls: bool | None = None) -> ToolPlan | None:
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
    parallel = parallel_tool_calls is not False
    if tool_choice in (None, "auto"):
        return ToolPlan(functions, "auto", fmt=fmt, parallel=parallel)
    if tool_choice == "required":
        return ToolPlan(functions, "required", fmt=fmt, parallel=parallel)
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise _bad("tool_choice", "tool_choice must be none, auto, required or "
                                  "{'type': 'function', 'function': {'name': ...}}")
    if name not in {f["name"] for f in functions}:
        raise _bad("tool_choice", f"tool_choice names function {name!r}, which is not in tools")
    return ToolPlan(functions, "named", name, fmt, parallel)


def tools_prompt(plan: ToolPlan) -> str:
    listing = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in plan.tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listing}\n"
            f"</tools>\n\n{plan.fmt.syntax.how}")


def template_input(messages: list[dict[str, Any]], plan: ToolPlan | None,
                   fmt: ToolFormat = FALLBACK) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and the template variables that render a chat request's tools as the model's format has them:
    the template's `tools` (OpenAI's tool objects, as transformers passes them) and earlier calls as `tool_calls`
    with their arguments as objects; a system message's `tools` field (JSON text); or the system prompt
    (with_tools), for a template that takes none. A tool result without a `name` gets its call's (Hermes-2-Pro's
    template demands one)."""
    if fmt.place == "prompt":
        return with_tools(messages, plan, fmt), {}
    out, called = [], {}
    for index, m in enumerate(messages):
        m = dict(m)
        given = m.pop("tool_calls", None)
        calls = _history_calls(given, f"messages.{index}.tool_calls")
        called.update((c.get("id"), name) for c, (name, _) in zip(given or (), calls))
        if calls and fmt.calls_in_template:
            m["tool_calls"] = [{"id": fmt.syntax.history_id(c.get("id")), "type": "function",
                                "function": {"name": name, "arguments": arguments}}
                               for c, (name, arguments) in zip(given, calls)]
        elif calls:
            m["content"] = "\n".join([m.get("content") or "", fmt.syntax.render(calls)]).strip()
        if m.get("tool_call_id") is not None:
            if m["role"] == "tool" and "name" not in m and m["tool_call_id"] in called:
                m["name"] = called[m["tool_call_id"]]
            m["tool_call_id"] = fmt.syntax.history_id(m["tool_call_id"])
        out.append(m)
    if plan is None:
        return out, {}
    if fmt.place == "template":
        return out, {"tools": [{"type": "function", "function": f} for f in plan.tools]}
    listing = json.dumps(plan.tools, ensure_ascii=False)
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "role": "system", "tools": listing}
    else:
        out.insert(0, {"role": "system", "content": "", "tools": listing})
    return out, {}


def _history_calls(calls: list[dict] | None, field: str) -> list[Call]:
    """An assistant message's earlier calls as (name, arguments): JSON arguments as their value."""
    return [(c["function"]["name"], _arguments(c["function"].get("arguments"), f"{field}.{j}.function.arguments"))
            for j, c in enumerate(calls or ())]


def with_tools(messages: list[dict[str, Any]], plan: ToolPlan | None,
               fmt: ToolFormat = FALLBACK) -> list[dict[str, Any]]:
    """Messages any template can render: the tools in the system prompt, earlier calls and their
    results as text in the format's syntax."""
    out = []
    for index, m in enumerate(messages):
        m = dict(m)
        calls = _history_calls(m.pop("tool_calls", None), f"messages.{index}.tool_calls")
        if calls:
            m["content"] = "\n".join([m.get("content") or "", fmt.syntax.render(calls)]).strip()
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


_NO_JSON = object()


def _model_json(text: str) -> Any:
    """The model's JSON, or _NO_JSON. A prompt can make a model write what Python's json cannot read
    (5000 nested brackets: RecursionError): that is plain text, not a 500 after generating."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return _NO_JSON


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: Any) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def _split(plan: ToolPlan, text: str) -> tuple[str, list[Call]]:
    content, calls = plan.fmt.syntax.parse(text, plan.names)
    return content, calls if plan.parallel else calls[:1]  # as vLLM: the first call, the others dropped


def parse_reply(plan: ToolPlan, text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a finished reply; text that holds no call of the tools stays content. A named
    function's reply is its call, as OpenAI's is, with the arguments written so far when cut short."""
    if plan.mode == "named":
        return None, [_call(plan.named, _named_arguments(plan, text))]
    content, calls = _split(plan, text)
    if not calls:
        return text, []
    return content.strip() or None, [_call(name, arguments) for name, arguments in calls]


def _named_arguments(plan: ToolPlan, text: str) -> Any:
    """A forced call's arguments: the text after the grammar's head (less its tail), or parsed where they are not JSON;
    "" where the reply stopped before them."""
    frame = plan.fmt.syntax.frame(plan.named)
    if frame is None:
        calls = _split(plan, text)[1]
        return calls[0][1] if calls else ""
    head, tail = frame
    at = text.find(head)
    if at < 0:
        return ""
    args = text[at + len(head):]
    return args[:_arguments_end(args, tail)]


def _arguments_end(args: str, tail: str) -> int:
    """Where a forced call's arguments end in the text after its head: before its tail, whole or begun (a reply cut
    there), when what is left is JSON; else at the end (cut inside the arguments)."""
    for k in range(min(len(tail), len(args)), 0, -1):
        if args.endswith(tail[:k]) and _model_json(args[:len(args) - k]) is not _NO_JSON:
            return len(args) - k
    return len(args)


class ToolStream:
    """One streamed choice as OpenAI streams it: content passes through until a tool call may start;
    a named function's arguments stream as they come (its id and name first) where the model's syntax writes
    them as JSON, other calls go out whole when the reply is complete. feed() and finish() return
    (content, tool_calls deltas)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""        # the whole reply so far
        self.sent = 0         # of it, how much went out (as content, or as a named call's arguments)
        self.calls: list[dict] = []
        self.markers = plan.fmt.syntax.markers(plan.names)
        self.frame = plan.fmt.syntax.frame(plan.named) if plan.mode == "named" else None
        self.args_at = -1     # a named call: where its arguments start in the text, once its head is there

    def feed(self, piece: str) -> tuple[str, list[dict]]:
        self.text += piece
        if self.plan.mode == "named":
            return "", self._arguments(final=True)
        if self.plan.mode != "auto":
            return "", []
        start = min((i for m in self.markers if (i := self.text.find(m, self.sent)) >= 0), default=-1)
        if start >= 0:
            end = start
        else:  # hold back a tail that could be the start of a marker
            end = len(self.text) - max((partial_tail(self.text[self.sent:], m) for m in self.markers), default=0)
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out, []

    def _arguments(self, final: bool) -> list[dict]:
        """A named call's argument pieces settled so far (not what may be its tail; all of them when final), the first
        with its id and name."""
        if self.frame is None:
            return []
        head, tail = self.frame
        if self.args_at < 0:
            at = self.text.find(head)
            if at < 0:
                return []
            self.args_at = self.sent = at + len(head)
        if final:
            end = self.args_at + _arguments_end(self.text[self.args_at:], tail)
        else:
            end = len(self.text) - (len(tail) if tail and self.text.endswith(tail) else
                                    partial_tail(self.text[self.sent:], tail))
        piece, self.sent = self.text[self.sent:end], max(self.sent, end)
        if not self.calls:
            self.calls = [_call(self.plan.named, "")]
            return [{"index": 0, "id": self.calls[0]["id"], "type": "function",
                     "function": {"name": self.plan.named, "arguments": piece}}]
        return [{"index": 0, "function": {"arguments": piece}}] if piece else []

    def finish(self) -> tuple[str, list[dict]]:
        """What is left at the end of the reply."""
        if self.plan.mode == "named":
            if self.frame is None:  # arguments not written as JSON: the call goes out whole
                self.calls = [_call(self.plan.named, _named_arguments(self.plan, self.text))]
                return "", [{"index": 0, **self.calls[0]}]
            if self.args_at < 0:  # cut short before the arguments: the call has none
                self.args_at = self.sent = len(self.text)
            return "", self._arguments(final=True)
        content, calls = _split(self.plan, self.text)
        if not calls:
            rest, self.sent = self.text[self.sent:], len(self.text)
            return rest, []
        self.calls = [_call(name, arguments) for name, arguments in calls]
        tail = content[self.sent:] if self.plan.mode == "auto" else ""
        return (tail.rstrip() if self.sent else tail.strip()), [{"index": i, **c} for i, c in enumerate(self.calls)]
