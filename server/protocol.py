"""OpenAI wire shapes for /v1/completions, /v1/chat/completions and /v1/embeddings: requests, responses, stream
chunks. Pure pydantic, no FastAPI. Requests ignore unknown fields but are strict about types (`"stream": "yes"`
and `"max_tokens": "10"` are 400s, as on OpenAI). Every numeric field has its documented range here
(README, "Request fields"), so an out-of-range value is a 400 naming the field before anything is
tokenized or reaches the engine; SamplingParams checks the same ranges for gRPC."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler,
                      model_serializer)

from slipstream.engine.request import (MAX_INT32, MAX_N, MAX_SEED, MAX_STOP, MAX_STOP_CHARS, MAX_TOP_LOGPROBS,
                            REPETITION_PENALTY_RANGE)


def valid_unicode(text: str) -> str:
    """JSON may carry lone surrogates ("\\ud800"), which no tokenizer or UTF-8 encoder accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"text must be valid Unicode: lone surrogate {text[exc.start]!r} at index "
                         f"{exc.start}") from None
    return text


Text = Annotated[str, AfterValidator(valid_unicode)]
StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS), AfterValidator(valid_unicode)]
TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]
TokenCount = Annotated[int, Field(ge=1, le=MAX_INT32)]
MAX_STOP_TOKEN_IDS = 256


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class _SamplingRequest(_Request):
    """Fields both endpoints share. `None` means "not given", so the service can pick defaults."""

    model: Text | None = None  # optional like vLLM/llama.cpp; when given it must name the served model
    max_tokens: TokenCount | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    # Extensions (vLLM names). top_k=-1 is vLLM's spelling of "off".
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    ignore_eos: bool = False
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=MAX_INT32)  # keep the prompt's last k (-1: the context)
    priority: int = Field(0, ge=-MAX_INT32, le=MAX_INT32)  # vLLM's: lower runs first (--scheduling-policy priority)
    # vLLM's output controls
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>" (text may not round-trip)
    min_tokens: int = Field(0, ge=0, le=MAX_INT32)
    allowed_token_ids: list[TokenId] | None = None
    # vLLM fields this server does not implement: accepted at their neutral value only (else a 400 naming them),
    # so a client relying on one learns it instead of getting a silently different answer
    use_beam_search: bool = False
    bad_words: list[Text] | None = None
    prompt_logprobs: int | None = None
    # Known OpenAI fields this server does not implement: accepted only at their neutral value, so a
    # client relying on them gets a 400 instead of a silently different answer.
    logit_bias: dict[str, float] | None = None
    # Structured output (server/structured.py): OpenAI's response_format, and vLLM's spellings.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None


class CompletionRequest(_SamplingRequest):
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(None, ge=0, le=MAX_INT32)  # 0 only with echo: the prompt scored, no output
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # alternatives per token
    echo: bool = False  # the prompt before the output (with logprobs, its tokens' logprobs too)
    suffix: Text | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)


class MessageFunction(_Request):
    name: Text
    arguments: Text = "{}"  # JSON text, as OpenAI sends it


class MessageToolCall(_Request):
    id: Text
    type: Literal["function"] = "function"
    function: MessageFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Parts stay plain dicts (not a {type: "text"} model) so that an image part yields "unsupported" (400 from
    # the service, naming the message) instead of a pydantic union error.
    content: Text | list[dict[str, Any]] | None = None
    name: Text | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: Text | None = None                 # a tool turn: which call it answers
    # an assistant turn's thinking, as this server returned it (templates such as Qwen3's read reasoning_content)
    reasoning_content: Text | None = None
    reasoning: Text | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: TokenCount | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # needs logprobs=true
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: more variables for the chat template (Qwen3's {"enable_thinking": false}), and whether a
    # reasoning model's thinking is returned
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True
    # vLLM's: the final assistant message left open for the model to go on with it ("prefill"), instead of a new turn
    add_generation_prompt: bool = True
    continue_final_message: bool = False


# ---- responses -------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # of prompt_tokens, how many the prefix cache held (their K/V was not computed again)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []  # None: an echoed prompt's first token (nothing before it)
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """Also the streaming chunk shape (same `object`, one choice delta per chunk)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ToolCallFunction(BaseModel):
    name: str | None = None  # absent from the stream deltas after a call's first
    arguments: str = ""

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None                   # in a call's first delta only
    type: Literal["function"] | None = None
    function: ToolCallFunction

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    # a reasoning model's thinking under both names clients read (server/reasoning.py); absent otherwise
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None or k == "content"}


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    """Carries only what changed: role in a choice's first chunk, then content; {} when finishing."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "slipstream"
    max_model_len: int
    root: str | None = None    # vLLM's field; a LoRA adapter's name here (server paths stay private)
    parent: str | None = None  # a LoRA adapter's base model; None for the base model itself


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# ---- /tokenize and /detokenize (vLLM's shapes; server/tokenize_routes.py) ----------------------------------

MAX_DETOKENIZE = 1 << 20  # token ids in one /detokenize body (the body limit caps it first at default flags)


class TokenizeRequest(_Request):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # a prompt's BOS and friends; messages: the template carries them
    # llama.cpp's spelling: `content` (BOS only with add_special), and tokens as {id, piece} with with_pieces
    content: Text | None = None
    add_special: bool = False
    with_pieces: bool = False


class TokenPiece(BaseModel):
    id: int
    piece: str  # the token's text (U+FFFD where a token holds part of a character)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int] | list[TokenPiece]


class DetokenizeRequest(_Request):
    model: Text | None = None
    tokens: list[TokenId] = Field(max_length=MAX_DETOKENIZE)


class DetokenizeResponse(BaseModel):
    prompt: str
    content: str  # the same text under llama.cpp's name


# ---- /v1/embeddings (server/embeddings.py) ---------------------------------------------------------------------

MAX_EMBEDDING_INPUTS = 2048  # inputs in one request, as OpenAI's


class EmbeddingRequest(_Request):
    model: Text | None = None
    input: (Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)] | list[TokenId]
            | Annotated[list[list[TokenId]], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)])
    encoding_format: Literal["float", "base64"] = "float"  # base64: little-endian float32 bytes
    dimensions: int | None = Field(None, ge=1)  # the first this many (re-normalized); at most the model's width
    user: Text | None = None
    normalize: bool = True  # extension (vLLM's): False returns the pooled hidden state as it is
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=MAX_INT32)  # each input's last k (-1: the context)
    priority: int = Field(0, ge=-MAX_INT32, le=MAX_INT32)


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
