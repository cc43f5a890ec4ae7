"""POST /v1/messages and /v1/messages/count_tokens, Anthropic's Messages API, over the chat path: a request's system
prompt and content blocks become chat messages (server/openai_api.prepare_chat renders and constrains them);
server/anthropic_output.py turns the chat format's split of the reply into content blocks. Errors name the Messages
field (`messages.1.content.0.type`), never the chat field it was translated to.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError

from slipstream.engine.errors import InvalidParam
from slipstream.engine.request import MAX_INT32, MAX_STOP
from slipstream.server.errors import ServiceError, parse_input, renamed
from slipstream.server.openai_api import prepare_chat
from slipstream.server.protocol import (ChatCompletionRequest, ChatMessage, MessageFunction, MessageToolCall, StopText,
                                        Text, TokenCount, _Request)
from slipstream.server.generation import Generation, Prepared
from slipstream.server.service import Service

# ---- requests ------------------------------------------------------------------------------------


class CountTokensRequest(_Request):
    """What /v1/messages/count_tokens takes: the conversation, without the sampling fields."""

    model: Text | None = None
    messages: list[Any] = Field(min_length=1)  # blocks are checked one by one (translate), naming messages.i...
    system: Text | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: TokenCount  # required, as on Anthropic
    temperature: float | None = Field(None, ge=0, le=1)  # Anthropic's range
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=MAX_INT32)
    stop_sequences: Annotated[list[StopText], Field(max_length=MAX_STOP)] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None  # user_id: the client, for --max-requests-per-client


class _Message(_Request):
    role: Literal["user", "assistant"]
    content: Text | list[Any]


class _TextBlock(_Request):
    type: Literal["text"]
    text: Text


class _ToolUse(_Request):
    type: Literal["tool_use"]
    id: Text
    name: Text
    input: dict[str, Any]


class _ToolResult(_Request):
    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | list[Any] = ""
    is_error: bool = False  # accepted: the model reads the error from the content, as the tool wrote it


class _Thinking(_Request):
    type: Literal["thinking"]
    thinking: Text


class _Image(_Request):
    type: Literal["image"]
    source: dict[str, Any]  # {"type": "base64", "media_type", "data"} or {"type": "url", "url"}

    def url(self, field: str) -> str:
        """As the chat's image_url: a data URL or the URL itself."""
        kind = self.source.get("type")
        if kind == "base64" and isinstance(self.source.get("data"), str):
            return f"data:{self.source.get('media_type') or 'image/png'};base64,{self.source['data']}"
        if kind == "url" and isinstance(self.source.get("url"), str):
            return self.source["url"]
        raise _bad(f"{field}.source", "an image source is {\"type\": \"base64\", \"media_type\", \"data\"} or "
                                      "{\"type\": \"url\", \"url\"}")


_BLOCKS: dict[str, type[_Request] | None] = {
    "text": _TextBlock, "tool_use": _ToolUse, "tool_result": _ToolResult, "thinking": _Thinking, "image": _Image,
    "redacted_thinking": None}  # encrypted thinking from Anthropic's models: accepted, not shown to the model
_ROLE_BLOCKS = {"user": ("text", "image", "tool_result"),
                "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}


def _bad(field: str, message: str, code: str = "invalid_value") -> ServiceError:
    """A 400 whose message starts with the field, as Anthropic's do (their error bodies have no param)."""
    return ServiceError(400, f"{field}: {message}", param=field, code=code)


def _checked(model: type[_Request], raw: Any, field: str) -> Any:
    """`raw` as `model`, or a 400 naming the first bad field under `field`."""
    if not isinstance(raw, dict):
        raise _bad(field, "must be an object")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(p) for p in err["loc"] if not re.fullmatch(r"str|list\[.*\]|function-.*", str(p))]
        raise _bad(".".join([field, *loc]), err["msg"]) from None


def _block(raw: Any, role: str, field: str) -> _Request | None:
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind not in _ROLE_BLOCKS[role]:
        what = f"{kind} blocks are" if isinstance(kind, str) else "a block without a type is"
        raise _bad(f"{field}.type", f"{what} not supported in {role} messages by this server ("
                                    f"{', '.join(_ROLE_BLOCKS[role])} are)", "unsupported")
    model = _BLOCKS[kind]
    return None if model is None else _checked(model, raw, field)


def _texts(content: str | list[Any], field: str) -> str:
    """A system prompt's or a tool result's text: a string, or text blocks joined."""
    if isinstance(content, str):
        return content
    texts = []
    for j, raw in enumerate(content):
        if not isinstance(raw, dict) or raw.get("type") != "text":
            kind = raw.get("type") if isinstance(raw, dict) else None
            raise _bad(f"{field}.{j}.type", f"only text blocks are supported here, got {kind!r}", "unsupported")
        texts.append(_checked(_TextBlock, raw, f"{field}.{j}").text)
    return "".join(texts)


@dataclasses.dataclass
class Translation:
    """A Messages request as the chat request it runs as, and which Messages field each chat message came from."""

    chat: ChatCompletionRequest
    origins: list[str]            # per chat message: "system", "messages.i" or "messages.i.content.j" (a tool result)
    calls: dict[int, list[str]]   # per assistant message with tool calls: each call's block
    # per (chat message, content part) of a message with images: the block it came from
    parts: dict[tuple[int, int], str] = dataclasses.field(default_factory=dict)

    def prepare(self, service: Service) -> Prepared:
        return dataclasses.replace(prepare_chat(service, self.chat), id_prefix="msg")

    async def start(self, service: Service, client: str | None) -> Generation:
        """Service.start over prepare_chat; its errors name the Messages fields."""
        try:
            return await service.start(lambda: self.prepare(service), client)
        except (ServiceError, InvalidParam) as exc:
            raise renamed(exc, self.field) from None

    def count(self, service: Service) -> int:
        """The rendered prompt's tokens, as /v1/messages would run it (nothing is generated)."""
        try:
            return len(self.prepare(service).prompts[0])
        except (ServiceError, InvalidParam) as exc:
            raise renamed(exc, self.field) from None

    def field(self, param: str) -> str:
        """The Messages field a chat field came from."""
        if param == "stop":
            return "stop_sequences"
        if param == "user":
            return "metadata.user_id"
        if param == "chat_template_kwargs":
            return "thinking"
        if param == "continue_final_message":
            return self.origins[-1]  # the final (assistant) message, which the reply goes on from
        if m := re.fullmatch(r"tools\.(\d+)\.function\.parameters(.*)", param):
            return f"tools.{m[1]}.input_schema{m[2]}"
        if m := re.fullmatch(r"messages\.(\d+)\.tool_calls\.(\d+)\.function\.arguments(.*)", param):
            return f"{self.calls[int(m[1])][int(m[2])]}.input{m[3]}"
        if (m := re.fullmatch(r"messages\.(\d+)\.content\.(\d+)(.*)", param)) and (int(m[1]), int(m[2])) in self.parts:
            return self.parts[int(m[1]), int(m[2])] + (".source" if m[3].startswith(".image_url") else m[3])
        if m := re.fullmatch(r"messages\.(\d+)(.*)", param):
            return self.origins[int(m[1])] + m[2]
        return param


def translate(req: CountTokensRequest) -> Translation:
    """The chat request for `req`; a 400 naming the field for what cannot be translated. A final assistant message is
    a prefill: the reply goes on from it, as on Anthropic."""
    messages, origins, calls, parts = _conversation(req)
    last = messages[-1] if messages else None
    if last is not None and last.role == "assistant" and not last.content.strip() and not last.tool_calls:
        messages.pop()  # an empty prefill, as none: the reply is a new turn
        origins.pop()
    if len(messages) == (req.system is not None):
        raise _bad("messages", "must hold some text, tool use or tool result")
    prefill = messages[-1].role == "assistant"
    tools, choice = _tools(req.tools), _tool_choice(req.tool_choice)
    if isinstance(choice, dict) and choice["function"]["name"] not in {t["function"]["name"] for t in tools or ()}:
        raise _bad("tool_choice.name", f"names tool {choice['function']['name']!r}, which is not in tools")
    fields: dict[str, Any] = {}
    if isinstance(req, MessagesRequest):
        # a matched stop string stays in the text, for the reply to tell which one matched (and cut it there)
        fields = dict(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                      stop=req.stop_sequences, include_stop_str_in_output=bool(req.stop_sequences),
                      user=_user(req.metadata))
    if (req.tool_choice or {}).get("disable_parallel_tool_use"):
        fields["parallel_tool_calls"] = False
    chat = ChatCompletionRequest(model=req.model, messages=messages, tools=tools, tool_choice=choice,
                                 chat_template_kwargs=_thinking(req.thinking), add_generation_prompt=not prefill,
                                 continue_final_message=prefill, **fields)
    return Translation(chat, origins, calls, parts)


def _conversation(req: CountTokensRequest) -> tuple[list[ChatMessage], list[str], dict[int, list[str]],
                                                    dict[tuple[int, int], str]]:
    """The system prompt and the messages as chat messages (a turn's text, thinking and tool calls as one message,
    each tool result as a tool message of its own), each one's Messages field, each tool call's block, and for a turn
    with images (its content then chat parts, one per text or image block) each part's block."""
    messages: list[ChatMessage] = []
    origins: list[str] = []
    calls: dict[int, list[str]] = {}
    parts: dict[tuple[int, int], str] = {}
    if req.system is not None:
        messages.append(ChatMessage(role="system", content=_texts(req.system, "system")))
        origins.append("system")
    for i, raw in enumerate(req.messages):
        message = _checked(_Message, raw, f"messages.{i}")
        blocks = [{"type": "text", "text": message.content}] if isinstance(message.content, str) else message.content
        turn: ChatMessage | None = None  # the chat message this turn's text and calls go to
        for j, raw_block in enumerate(blocks):
            field = f"messages.{i}.content.{j}"
            block = _block(raw_block, message.role, field)
            if isinstance(block, _ToolResult):
                messages.append(ChatMessage(role="tool", tool_call_id=block.tool_use_id,
                                            content=_texts(block.content, f"{field}.content")))
                origins.append(field)
                turn = None
                continue
            if block is None:
                continue
            if turn is None:
                turn = ChatMessage(role=message.role, content="")
                messages.append(turn)
                origins.append(f"messages.{i}")
            if isinstance(block, _Image):
                if isinstance(turn.content, str):  # the turn's text so far as its first part
                    turn.content = [{"type": "text", "text": turn.content}] if turn.content else []
                parts[len(messages) - 1, len(turn.content)] = field
                turn.content.append({"type": "image_url", "image_url": {"url": block.url(field)}})
            elif isinstance(block, _TextBlock) and isinstance(turn.content, list):
                parts[len(messages) - 1, len(turn.content)] = field
                turn.content.append({"type": "text", "text": block.text})
            elif isinstance(block, _TextBlock):
                turn.content += block.text
            elif isinstance(block, _Thinking):
                turn.reasoning_content = (turn.reasoning_content or "") + block.thinking
            elif isinstance(block, _ToolUse):
                arguments = parse_input(f"{field}.input", "JSON", json.dumps, block.input)
                call = MessageToolCall(id=block.id, function=MessageFunction(name=block.name, arguments=arguments))
                turn.tool_calls = [*(turn.tool_calls or ()), call]
                calls.setdefault(len(messages) - 1, []).append(field)
    return messages, origins, calls, parts


def _user(metadata: dict[str, Any] | None) -> str | None:
    user = (metadata or {}).get("user_id")
    if user is not None and not isinstance(user, str):
        raise _bad("metadata.user_id", "must be a string")
    return user


def _tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Anthropic's client tools ({name, description, input_schema}) as chat's function tools."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise _bad(f"tools.{i}", "must be an object")
        if tool.get("type", "custom") != "custom":
            raise _bad(f"tools.{i}.type", f"{tool['type']!r}: this server runs client tools only (name, description, "
                                          "input_schema), not Anthropic's built-in tools", "unsupported")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise _bad(f"tools.{i}.name", "must be a non-empty string")
        if not isinstance(tool.get("input_schema"), dict):
            raise _bad(f"tools.{i}.input_schema", "must be a JSON schema object")
        if not isinstance(tool.get("description", ""), str):
            raise _bad(f"tools.{i}.description", "must be a string")
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if tool.get("description"):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: dict[str, Any] | None) -> str | dict[str, Any] | None:
    """auto, any (chat's required), tool (a named function) or none."""
    if choice is None:
        return None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise _bad("tool_choice.name", "a tool choice of type tool names the tool")
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("tool_choice.type", f"must be auto, any, tool or none, got {kind!r}")


def _thinking(thinking: dict[str, Any] | None) -> dict[str, Any] | None:
    """disabled: the template's enable_thinking false (Qwen3's); enabled: the model thinks as its template says
    (budget_tokens is not enforced)."""
    kind = (thinking or {}).get("type", "enabled")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise _bad("thinking.type", f"must be enabled or disabled, got {kind!r}")
    return {"enable_thinking": False} if kind == "disabled" else None
