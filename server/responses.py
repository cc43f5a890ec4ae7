"""POST /v1/responses, OpenAI's Responses API, over the chat path: a request's input items become chat messages
(server/openai_api.prepare_chat renders and constrains them); server/responses_output.py turns the chat format's
split of the reply into output items. Responses are kept in memory (server/response_store.py) for
`previous_response_id`. Errors name the Responses field, never the chat field it was translated to.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal

from pydantic import Field, ValidationError

from slipstream.engine.errors import InvalidParam
from slipstream.server.errors import ServiceError, renamed
from slipstream.server.openai_api import prepare_chat
from slipstream.server.protocol import (ChatCompletionRequest, ChatMessage, MessageFunction, MessageToolCall, Text,
                                        TokenCount, _Request, valid_unicode)
from slipstream.server.response_store import ResponseStore
from slipstream.server.generation import Generation, Prepared
from slipstream.server.service import Service


# ---- requests ------------------------------------------------------------------------------------


class ResponsesRequest(_Request):
    model: Text | None = None
    input: Text | list[Any]  # items are checked one by one (translate), so that errors name input[i]
    instructions: Text | None = None
    max_output_tokens: TokenCount | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    parallel_tool_calls: bool | None = None
    user: Text | None = None
    metadata: dict[str, Text] | None = None
    store: bool | None = None  # keep the response for previous_response_id and GET (the default, as OpenAI's)
    reasoning: dict[str, Any] | None = None  # accepted: a model thinks as its template says (effort is ignored)
    truncation: Literal["disabled", "auto"] | None = None
    previous_response_id: Text | None = None
    # what a client may rely on that this server does not do: a 400 naming the field, not a different answer
    conversation: Text | dict[str, Any] | None = None
    background: bool | None = None
    top_logprobs: int | None = None


class _Message(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Any  # a text or input_text/output_text parts (_text checks them, naming the part)


class _FunctionCall(_Request):
    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text


class _FunctionCallOutput(_Request):
    type: Literal["function_call_output"]
    call_id: Text
    output: Any  # a text or input_text parts


_ITEMS: dict[str, type[_Request] | None] = {
    "message": _Message, "function_call": _FunctionCall, "function_call_output": _FunctionCallOutput,
    "reasoning": None}  # an earlier turn's thinking: accepted, not shown to the model again


def _bad(param: str, message: str, code: str = "invalid_value") -> ServiceError:
    return ServiceError(400, message, param=param, code=code)


def _unsupported(req: ResponsesRequest) -> None:
    if req.conversation is not None:
        raise _bad("conversation", "conversation: this server keeps no conversations; send the conversation in "
                                   "input, or continue a response with previous_response_id", "unsupported")
    for name, on in (("background", req.background), ("top_logprobs", req.top_logprobs),
                     ("truncation", req.truncation == "auto")):
        if on:
            raise _bad(name, f"{name} is not supported by this server", "unsupported")


def _text(content: Any, param: str) -> str:
    """A message's text: a string, or its input_text / output_text parts joined."""
    if isinstance(content, str):
        return _unicode(content, param)
    if not isinstance(content, list):
        raise _bad(param, f"{param} must be a string or a list of input_text parts")
    return "".join(_part_text(part, f"{param}[{j}]") for j, part in enumerate(content))


def _part_text(part: Any, param: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in ("input_text", "output_text"):
        raise _bad(f"{param}.type", f"only input_text and output_text parts are supported, got {kind!r}",
                   "unsupported")
    if not isinstance(part.get("text"), str):
        raise _bad(f"{param}.text", f"{param}.text must be a string")
    return _unicode(part["text"], f"{param}.text")


def _content(content: Any, param: str) -> str | list[dict[str, Any]]:
    """A message's content for the chat request: its text (_text), or with input_image parts one chat part per part
    (input_image's image_url a data URL or an http(s) URL)."""
    if not (isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "input_image" for p in content)):
        return _text(content, param)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            if not isinstance(part.get("image_url"), str):
                raise _bad(f"{param}[{j}].image_url", f"{param}[{j}].image_url must be a data: or http(s) URL string "
                                                      "(file_id is not supported)")
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            parts.append({"type": "text", "text": _part_text(part, f"{param}[{j}]")})
    return parts


def _unicode(text: str, param: str) -> str:
    try:
        return valid_unicode(text)
    except ValueError as exc:
        raise _bad(param, f"{param}: {exc}") from None


def _item(raw: Any, param: str) -> _Request | None:
    if not isinstance(raw, dict):
        raise _bad(param, f"{param} must be an object")
    kind = raw.get("type", "message")
    if kind not in _ITEMS:
        raise _bad(f"{param}.type", f"input items of type {kind!r} are not supported (message, function_call, "
                                    "function_call_output, reasoning are)", "unsupported")
    model = _ITEMS[kind]
    if model is None:
        return None
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = param + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"])
        raise _bad(field, f"{field}: {err['msg']}") from None


@dataclasses.dataclass
class Translation:
    """A Responses request as the chat request it runs as, and which Responses field each message came from."""

    chat: ChatCompletionRequest
    origins: list[str]             # per chat message: "instructions", "previous_response_id", "input" or "input[i]"
    calls: dict[int, list[str]]    # per assistant message with tool calls: each call's input item
    items: list[dict[str, Any]]    # the conversation's items: the previous response's, then this request's
    earlier: int                   # of them, how many the previous response brought

    async def start(self, service: Service, client: str | None) -> Generation:
        """Service.start over prepare_chat; its errors name the Responses fields (a too-long prompt: input)."""
        def prepare() -> Prepared:
            return dataclasses.replace(prepare_chat(service, self.chat), id_prefix="resp", prompt_param="input")

        try:
            return await service.start(prepare, client)
        except (ServiceError, InvalidParam) as exc:
            err = renamed(exc, self.field)
            if err.code == "context_length_exceeded":
                err = ServiceError(err.status, err.message.replace("max_tokens", "max_output_tokens"), param=err.param,
                                   code=err.code)
            raise err from None

    def field(self, param: str | None) -> str | None:
        """The Responses field a chat field came from."""
        if param is None:
            return None
        if param in ("max_tokens", "max_completion_tokens"):
            return "max_output_tokens"
        if param.startswith("response_format"):
            return "text.format"
        if m := re.fullmatch(r"tools\.(\d+)\.function(.*)", param):
            return f"tools[{m[1]}]{m[2]}"
        if m := re.fullmatch(r"messages\.(\d+)\.tool_calls\.(\d+)\.function(.*)", param):
            return self.calls[int(m[1])][int(m[2])] + m[3]
        if m := re.fullmatch(r"messages\.(\d+)\.content\.(\d+)(\.image_url)?.*", param):  # an input_image's part
            return f"{self.origins[int(m[1])]}.content[{m[2]}]{m[3] or ''}"
        if m := re.fullmatch(r"messages\.(\d+)(.*)", param):
            return self.origins[int(m[1])] + m[2]
        return "input" if param == "messages" else param


def translate(req: ResponsesRequest, store: ResponseStore) -> Translation:
    """The chat request for `req` (after the conversation of the response it continues, whose instructions are not
    carried over, as on OpenAI); a 400 naming the field for what cannot be translated."""
    _unsupported(req)
    if not req.input:
        raise _bad("input", "input must not be empty")
    earlier = [] if req.previous_response_id is None else \
        store.get(req.previous_response_id, "previous_response_id").items
    items = [*earlier, *([{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input)]
    messages: list[ChatMessage] = []
    origins: list[str] = []
    calls: dict[int, list[str]] = {}
    if req.instructions is not None:
        messages.append(ChatMessage(role="system", content=req.instructions))
        origins.append("instructions")
    for i, raw in enumerate(items):
        param = "previous_response_id" if i < len(earlier) else "input" if isinstance(req.input, str) else \
            f"input[{i - len(earlier)}]"
        item = _item(raw, param)
        if isinstance(item, _Message):
            messages.append(ChatMessage(role=item.role, content=_content(item.content, f"{param}.content")))
            origins.append(param)
        elif isinstance(item, _FunctionCall):
            call = MessageToolCall(id=item.call_id, function=MessageFunction(name=item.name, arguments=item.arguments))
            last = messages[-1] if messages else None
            if last is None or last.role != "assistant":
                last = ChatMessage(role="assistant", content="")
                messages.append(last)
                origins.append(param)
            last.tool_calls = [*(last.tool_calls or ()), call]  # one turn's calls are one assistant message
            calls.setdefault(len(messages) - 1, []).append(param)
        elif isinstance(item, _FunctionCallOutput):
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                        content=_text(item.output, f"{param}.output")))
            origins.append(param)
    if not messages:
        raise _bad("input", "input holds no message")
    chat = ChatCompletionRequest(
        model=req.model, messages=messages, max_completion_tokens=req.max_output_tokens, temperature=req.temperature,
        top_p=req.top_p, tools=_tools(req.tools), tool_choice=_tool_choice(req.tool_choice),
        response_format=_response_format(req.text), parallel_tool_calls=req.parallel_tool_calls, user=req.user)
    return Translation(chat, origins, calls, items, len(earlier))


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat's {"type": "function", "function": {...}}."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise _bad(f"tools[{i}].type", f"tools[{i}].type {tool.get('type')!r} is not supported; this server "
                                           "runs function tools only", "unsupported")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise _bad(f"tools[{i}].name", f"tools[{i}].name must be a non-empty string")
        if tool.get("parameters") is not None and not isinstance(tool["parameters"], dict):
            raise _bad(f"tools[{i}].parameters", f"tools[{i}].parameters must be a JSON schema object")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                                     if tool.get(k) is not None}})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise _bad("tool_choice", "tool_choice must be none, auto, required or {'type': 'function', 'name': ...}")
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise _bad("text.format", "text.format.schema must be a JSON schema object")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    raise _bad("text.format", f"text.format type must be text, json_object or json_schema, got {kind!r}")
