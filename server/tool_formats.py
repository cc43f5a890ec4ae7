"""Tool calls in each model's own format: the syntax its calls are written in (--tool-call-parser; auto: by the
vocabulary's markers, then the chat template) and where its chat template takes the tools (its `tools` variable, a
system message's `tools` field, or nowhere, when the system prompt describes them), read from the template's jinja
tree. Decided once at start-up; server/tool_calls.py applies it to each request."""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import jinja2
import jinja2.meta
from jinja2 import nodes

from slipstream.server.tool_syntax import SYNTAXES, Hermes, Llama3Json, Mistral, Syntax

# vLLM's names for the same syntaxes, so that its --tool-call-parser values carry over
ALIASES = {"llama4_json": "llama3_json", "llama4_pythonic": "pythonic", "phi4_mini_json": "phi4_mini"}
PARSERS = ("auto", "hermes", "llama3_json", "mistral", "phi4_mini", "pythonic", *ALIASES)


@dataclasses.dataclass(frozen=True)
class ToolFormat:
    """The served model's tool calls: their syntax and where its chat template takes tools."""

    syntax: Syntax
    place: str = "prompt"   # "template" (its `tools` variable), "system" (a system message's `tools` field, as
    #                         Phi-4-mini's), "prompt" (none: the system prompt describes them)
    calls_in_template: bool = False  # the template renders assistant messages' tool_calls itself
    special: dict[str, int] = dataclasses.field(default_factory=dict)  # markers that are special tokens, by id:
    #                         grammars name them by id, and replies with tools keep them (skip_special_tokens off)

    def token(self, marker: str) -> str:
        return f"<[{self.special[marker]}]>" if marker in self.special else json.dumps(marker)

    def describe(self) -> str:
        where = {"template": "the chat template's tools", "system": "the system message's tools field",
                 "prompt": "the system prompt (the chat template takes no tools)"}[self.place]
        return f"{self.syntax.name} calls, tools rendered into {where}"


FALLBACK = ToolFormat(Hermes())


def tool_format(tokenizer: Any, parser: str) -> ToolFormat:
    """The served model's tool format for --tool-call-parser; "auto" picks by the vocabulary's markers, then the chat
    template (ValueError for an unknown parser)."""
    if parser not in PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(PARSERS)}, got {parser!r}")
    source = getattr(tokenizer, "chat_template", None) or ""
    place, calls_in_template = template_use(source)
    tokens = {m: _token(tokenizer, m) for m in ("<tool_call>", Mistral.CALLS, Mistral.ARGS, Llama3Json.TAG)}
    name = ALIASES.get(parser, parser)
    if parser == "auto":
        if tokens["<tool_call>"] is not None:
            name = "hermes"
        elif tokens[Mistral.CALLS] is not None:
            name = "mistral"
        elif tokens[Llama3Json.TAG] is not None or re.search(r"<\|(start_header_id|header_start)\|>", source):
            name = "llama3_json"
        elif "functools" in source:
            name = "phi4_mini"
        else:
            name = "hermes"
    syntax = Mistral(v11=tokens[Mistral.ARGS] is not None) if name == "mistral" else SYNTAXES[name]()
    special = {m: tokens[m][0] for m in syntax.special if tokens.get(m) is not None and tokens[m][1]}
    return ToolFormat(syntax, place, calls_in_template, special)


def _token(tokenizer: Any, marker: str) -> tuple[int, bool] | None:
    """(id, whether it is special: decoding drops it) when `marker` is one token of the vocabulary."""
    ids = tokenizer.encode(marker, add_special_tokens=False)
    if len(ids) != 1 or tokenizer.decode(ids, skip_special_tokens=False) != marker:
        return None
    return ids[0], tokenizer.decode(ids, skip_special_tokens=True) == ""


def template_use(source: str) -> tuple[str, bool]:
    """Where a chat template's source takes tools ("template", "system" or "prompt"), and whether it renders
    assistant messages' tool_calls, from its jinja syntax tree."""
    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
    except jinja2.TemplateSyntaxError:
        return "prompt", False
    fields = {n.attr for n in tree.find_all(nodes.Getattr)} | {
        n.arg.value for n in tree.find_all(nodes.Getitem) if isinstance(n.arg, nodes.Const)}
    fields |= {n.value for n in tree.find_all(nodes.Const) if isinstance(n.value, str)}  # 'tools' in message
    if "tools" in jinja2.meta.find_undeclared_variables(tree):
        place = "template"
    elif "tools" in fields:
        place = "system"
    else:
        place = "prompt"
    return place, "tool_calls" in fields
