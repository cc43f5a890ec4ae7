"""Structured output at the OpenAI edge: which request field asks for a grammar (response_format, vLLM's
structured_outputs / guided_*), and its compilation against the served model's tokenizer. tool_choice's grammar
is server/tool_calls.py's."""
from __future__ import annotations

import json
import threading
import weakref
from typing import Any

from slipstream.engine.errors import InvalidParam
from slipstream.engine.structured import Constraint, Grammar, GrammarCompiler
from slipstream.server.errors import ServiceError, parse_input

_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}

_compilers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def _bad(param: str, message: str) -> ServiceError:
    return ServiceError(400, message, param=param, code="invalid_value")


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
