"""llama.cpp's own API in: `POST /completion` (also `/completions`) and `POST /infill` (code infilling, as editor
plugins such as llama.vim and llama.vscode call it), with llama.cpp's field names and defaults, turned into a
`Prepared`. server/llamacpp_output.py writes llama.cpp's response shapes; server/llamacpp_routes.py holds the routes.

Fields llama.cpp has and this server does not implement are accepted at their neutral value only (a 400 naming the
field otherwise), as on the OpenAI routes. `repeat_penalty` applies over the prompt and the output (HF's
repetition penalty), not only over the last `repeat_last_n` tokens."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from slipstream.engine.request import MAX_INT32, MAX_N, MAX_STOP, MAX_TOP_LOGPROBS, REPETITION_PENALTY_RANGE
from slipstream.server.errors import ServiceError
from slipstream.server.generation import Prepared
from slipstream.server.protocol import StopText, Text, TokenId, _Request
from slipstream.server.service import Service
from slipstream.server.structured import Constraint, compile_constraint

# llama.cpp's "no seed": -1, or the unsigned value it reports for it
_RANDOM_SEEDS = (-1, 0xFFFFFFFF)
# the samplers of `samplers` this server has; naming others (typ_p, xtc, dry, penalties, infill) changes nothing
SAMPLERS = ("top_k", "top_p", "min_p", "temperature")
MAX_EXTRA_CHUNKS = 256


class ExtraChunk(_Request):
    filename: Text = ""
    text: Text = ""


class LlamaCompletionRequest(_Request):
    """/completion's and /infill's body (llama.cpp's defaults: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05,
    no token limit)."""

    model: Text | None = None
    prompt: Text | list[TokenId | Text] | list[Text | list[TokenId | Text]] = ""
    n_predict: int = Field(-1, ge=-1, le=MAX_INT32)  # -1: up to the context
    temperature: float = Field(0.8, le=2)            # <= 0: greedy
    top_k: int = Field(40, ge=0, le=MAX_INT32)       # 0: off
    top_p: float = Field(0.95, ge=0, le=1)           # 1 (or 0): off
    min_p: float = Field(0.05, ge=0, le=1)
    repeat_penalty: float = Field(1.0, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    repeat_last_n: int = Field(64, ge=-1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    seed: int = Field(-1, ge=-1, le=0xFFFFFFFF)
    stop: Annotated[list[StopText], Field(max_length=MAX_STOP)] = []
    ignore_eos: bool = False
    logit_bias: list[list[Any]] | dict[str, Any] | None = None
    n_probs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    n_cmpl: int = Field(1, ge=1, le=MAX_N)
    grammar: Text | None = None                      # GBNF (llama.cpp's grammar syntax), or Lark
    json_schema: dict[str, Any] | None = None
    stream: bool = False
    cache_prompt: bool = True     # the prefix cache serves every request
    return_tokens: bool = False
    timings_per_token: bool = False
    samplers: list[Text] | None = None
    response_fields: list[Text] | None = None
    n_indent: int = Field(0, ge=0, le=MAX_INT32)      # stop at a line indented less (code completion)
    t_max_predict_ms: int = Field(0, ge=0, le=MAX_INT32)  # after this long and a newline, stop at the next newline
    n_keep: int = -1              # context shifting: a prompt that does not fit is a 400 here instead
    t_max_prompt_ms: int = -1
    # llama.cpp's samplers and options this server does not have: their neutral values only
    id_slot: int = -1
    mirostat: Literal[0] = 0
    typical_p: Literal[1.0, 1] = 1.0
    dynatemp_range: Literal[0.0, 0] = 0.0
    dry_multiplier: Literal[0.0, 0] = 0.0
    xtc_probability: Literal[0.0, 0] = 0.0
    post_sampling_probs: Literal[False] = False
    return_progress: Literal[False] = False
    lora: Annotated[list[Any], Field(max_length=0)] = []
    # /infill
    input_prefix: Text = ""
    input_suffix: Text = ""
    input_extra: Annotated[list[ExtraChunk], Field(max_length=MAX_EXTRA_CHUNKS)] = []


def prepare_llama(service: Service, req: LlamaCompletionRequest, *, infill: bool = False) -> Prepared:
    """Validate, then tokenize (thread-safe, as the OpenAI routes' preparation)."""
    lora = service.check_model(req.model)
    if req.id_slot != -1:
        raise ServiceError(400, "id_slot: this server schedules requests itself (continuous batching); send -1",
                           param="id_slot", code="unsupported")
    prompts = _prompt_items(req.prompt) if not infill else [req.prompt]
    if not infill and not prompts:
        raise ServiceError(400, "prompt must not be empty", param="prompt", code="invalid_value")
    service.check_choices(len(prompts), req.n_cmpl)
    params = service.sampling_params(param_names={"max_tokens": "n_predict", "logprobs": "n_probs", "n": "n_cmpl"},
                                     **_sampling_fields(service, req))
    constraint = _constraint(req)
    if constraint is not None:
        params = service.sampling_params(base=params, constraint=compile_constraint(service, constraint))
    ids = [_infill_ids(service, req)] if infill else [_prompt_ids(service, p) for p in prompts]
    return Prepared(prompts=ids, params=params, id_prefix="cmpl", lora=lora)


def _sampling_fields(service: Service, req: LlamaCompletionRequest) -> dict[str, Any]:
    used = set(SAMPLERS if req.samplers is None else req.samplers)
    greedy = req.temperature <= 0 and "temperature" in used
    return dict(
        max_tokens=None if req.n_predict == -1 else req.n_predict,
        temperature=0.0 if greedy else req.temperature if "temperature" in used else 1.0,
        top_k=req.top_k if "top_k" in used else 0, top_p=req.top_p if "top_p" in used and req.top_p > 0 else 1.0,
        min_p=req.min_p if "min_p" in used else 0.0, repetition_penalty=req.repeat_penalty,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        seed=None if req.seed in _RANDOM_SEEDS else req.seed, stop=tuple(req.stop), ignore_eos=req.ignore_eos,
        # a matched stop string stays in the text, so the reply can name it (stopping_word) and then drop it
        include_stop_str_in_output=True, logprobs=req.n_probs or None, n=req.n_cmpl,
        logit_bias=_logit_bias(service, req.logit_bias))


def _constraint(req: LlamaCompletionRequest) -> Constraint | None:
    if req.grammar is not None and req.json_schema is not None:
        raise ServiceError(400, "give one of grammar and json_schema", param="json_schema", code="invalid_value")
    if req.json_schema is not None:
        return Constraint("json_schema", req.json_schema, field="json_schema")
    if req.grammar:
        return Constraint("grammar", _lark(req.grammar), field="grammar")
    return None


def _lark(grammar: str) -> str:
    """A GBNF grammar (llama.cpp's syntax) as the Lark syntax llguidance reads; Lark passes through."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(grammar)
    except Exception as exc:  # noqa: BLE001 - the converter's own errors name the line
        raise ServiceError(400, f"grammar is not valid GBNF: {exc}", param="grammar", code="invalid_value") from None


def _logit_bias(service: Service, bias: list[list[Any]] | dict[str, Any] | None) -> tuple[tuple[int, float], ...]:
    """llama.cpp's [[token, bias], ...] or {"token": bias}; a token is an id or a text (each of its tokens biased);
    a bias of false bans the token."""
    items = list(bias.items()) if isinstance(bias, dict) else list(bias or ())
    pairs: list[tuple[int, float]] = []
    for item in items:
        if len(item) != 2:
            raise ServiceError(400, "logit_bias entries must be [token, bias] pairs", param="logit_bias",
                               code="invalid_value")
        token, value = item
        if value is False:
            value = -100.0
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ServiceError(400, f"logit_bias values must be numbers or false, got {value!r}", param="logit_bias",
                               code="invalid_value")
        if isinstance(token, str) and token.isascii() and token.isdecimal() and isinstance(bias, dict):
            token = int(token)
        ids = [token] if isinstance(token, int) and not isinstance(token, bool) else (
            service.encode(token, add_special_tokens=False, param="logit_bias") if isinstance(token, str) else None)
        if ids is None:
            raise ServiceError(400, f"logit_bias tokens must be ids or texts, got {token!r}", param="logit_bias",
                               code="invalid_value")
        pairs += [(t, max(-100.0, min(100.0, float(value)))) for t in ids]
    return service.logit_bias(pairs)


def _prompt_items(prompt: Any) -> list[Any]:
    """One prompt (a text, ids, or ids and texts mixed), or several (a list of texts or of such lists)."""
    if isinstance(prompt, str):
        return [prompt] if prompt else []
    if prompt and all(isinstance(p, (str, list)) for p in prompt):
        return list(prompt)
    return [prompt] if prompt else []


def _prompt_ids(service: Service, prompt: str | list) -> list[int]:
    if isinstance(prompt, str):
        return service.encode(prompt)
    ids: list[int] = []
    for i, part in enumerate(prompt):  # BOS where a text comes first, as llama.cpp
        ids += service.encode(part, add_special_tokens=i == 0) if isinstance(part, str) else [part]
    return service.encode(ids)


def _infill_ids(service: Service, req: LlamaCompletionRequest) -> list[int]:
    """`input_extra`'s files, then the fill between `input_prefix` and `input_suffix` with `prompt` begun after the
    middle tag (server/fim.py). The latest files that fit the context beside the fill and the reply's room (n_predict,
    else a quarter of the context) are kept, as llama.cpp keeps the end of its extra context."""
    fim = service.fim
    if fim is None:
        raise ServiceError(400, "/infill needs a model with fill-in-the-middle tokens (<|fim_prefix|>... or "
                           "<fim_prefix>...); this one has none", param="input_prefix", code="unsupported")
    if not isinstance(req.prompt, str):
        raise ServiceError(400, "/infill's prompt must be text", param="prompt", code="invalid_value")
    fill = fim.text(req.input_prefix, req.input_suffix) + req.prompt
    room = service.max_seq_len - len(service.encode(fill, param="input_prefix")) - (
        req.n_predict if req.n_predict > 0 else service.max_seq_len // 4)
    def count(text: str) -> int:
        return len(service.tokenizer.encode(text, add_special_tokens=False)) if text else 0

    files: list[tuple[str, str]] = []
    room -= count(fim.context_head() + fim.context_tail())
    for chunk in reversed(req.input_extra):  # each file counted once (its tags are single tokens)
        room -= count(fim.context_file(chunk.filename, chunk.text))
        if room < 0:
            break
        files.insert(0, (chunk.filename, chunk.text))
    return service.encode(fim.context(files) + fill, param="input_prefix")
