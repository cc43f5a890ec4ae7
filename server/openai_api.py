"""OpenAI requests in: turns a CompletionRequest / ChatCompletionRequest into a `Prepared` (cheap checks first, then
tokenization). server/openai_formats.py turns the Deltas into response bodies and stream chunks. The HTTP routes call
these; the transport-neutral service knows nothing of OpenAI."""
from __future__ import annotations

import dataclasses
from typing import Any

from slipstream.engine.request import DEFAULT_MAX_TOKENS, SamplingParams
from slipstream.engine.structured import Reasoning
from slipstream.server.errors import ServiceError, parse_input
from slipstream.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, valid_unicode
from slipstream.server.generation import Prepared
from slipstream.server.images import LoadedImage
from slipstream.server.service import Service
from slipstream.server.structured import Constraint, compile_constraint, request_constraint
from slipstream.server.tool_calls import template_input, tool_plan

# ---- requests ------------------------------------------------------------------------------------


def prepare_completion(service: Service, req: CompletionRequest) -> Prepared:
    """Validate, then tokenize; CPU only and thread-safe, so callers may run it off the event loop."""
    lora = service.check_model(req.model)
    priority = service.check_priority(req.priority)
    if req.best_of is not None and req.best_of != req.n:
        raise ServiceError(400, "best_of is not supported (use n)", param="best_of", code="unsupported")
    items = prompt_items(req)
    if not items:
        raise ServiceError(400, "prompt must not be empty", param="prompt", code="invalid_value")
    # Everything that costs no tokenization first: 200,000 tiny prompts must not be tokenized to learn
    # that they exceed max_choices.
    service.check_choices(len(items), req.n)
    max_tokens = req.max_tokens if req.max_tokens is not None else DEFAULT_MAX_TOKENS
    if max_tokens == 0 and not req.echo:
        raise ServiceError(400, "max_tokens must be at least 1 (0, the prompt alone, needs echo)", param="max_tokens",
                           code="invalid_value")
    if req.suffix is not None:
        items = _fills(service, req, items)
    if req.echo and req.truncate_prompt_tokens is not None:
        raise ServiceError(400, "truncate_prompt_tokens cannot be used with echo (the echoed prompt would not be the "
                           "one that ran)", param="truncate_prompt_tokens", code="unsupported")
    keep = prompt_tokens_kept(service, req.truncate_prompt_tokens)
    # echo with logprobs: the prompt's tokens get theirs too, computed (never from the prefix cache)
    params = _params(service, req, max_tokens=max_tokens, logprobs=req.logprobs, constraint=request_constraint(req),
                     prompt_logprobs=req.logprobs if req.echo else None)
    prompts = [truncated(service.encode(item), keep) for item in items]
    return Prepared(prompts=prompts, params=params, id_prefix="cmpl", lora=lora, priority=priority)


def prepare_chat(service: Service, req: ChatCompletionRequest) -> Prepared:
    """Render the chat template, tokenize, validate; thread-safe like prepare_completion."""
    lora = service.check_model(req.model)
    priority = service.check_priority(req.priority)
    plan = tool_plan(req.tools, req.tool_choice, service.tool_format, req.parallel_tool_calls)
    constraint = request_constraint(req)
    forced = parse_input("tools", "tool definitions", plan.constraint) if plan is not None else None
    if forced is not None:
        if constraint is not None:
            raise ServiceError(400, f"tool_choice {plan.mode} constrains the reply already; drop {constraint.field}",
                               param=constraint.field, code="invalid_value")
        constraint = forced
    if req.top_logprobs is not None and not req.logprobs:
        raise ServiceError(400, "top_logprobs requires logprobs=true", param="top_logprobs", code="invalid_value")
    service.check_choices(1, req.n, "messages")
    keep = prompt_tokens_kept(service, req.truncate_prompt_tokens)
    images: list[LoadedImage] = []
    messages = chat_messages(req.messages, service, images)
    if images and keep is not None:
        raise ServiceError(400, "truncate_prompt_tokens cannot be used with images (it could cut an image's rows)",
                           param="truncate_prompt_tokens", code="unsupported")
    explicit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    names = {"max_tokens": "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
             "logprobs": "top_logprobs"}
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    # Validate the sampling fields before the template and the tokenizer run. Without a limit a
    # reply may fill the rest of the context (max_tokens None, resolved against the prompt at submit).
    params = _params(service, req, max_tokens=explicit, logprobs=logprobs, param_names=names, constraint=None)
    messages, variables = template_input(messages, plan, service.tool_format)
    if service.images is not None:  # a vision-language model's template reads every message's content as parts
        messages = [{**m, "content": as_parts(m["content"])} for m in messages]
    prompt = truncated(_chat_prompt(service, req, messages, variables), keep)
    image_inputs = ()
    if service.images is not None:  # each image's placeholder expanded to the rows it fills (and none without one)
        prompt, image_inputs = service.images.expand(prompt, images, "messages")
    if plan is not None and service.tool_format.special:  # the call's marker is a special token: keep it in the text
        params = service.sampling_params(base=params, skip_special_tokens=False)
    if constraint is not None:
        grammar = compile_constraint(service, _after_thinking(service, constraint, prompt))
        params = service.sampling_params(base=params, constraint=grammar)
    return Prepared(prompts=[prompt], params=params, id_prefix="chatcmpl", prompt_param="messages", lora=lora,
                    priority=priority, images=image_inputs)


def _chat_prompt(service: Service, req: ChatCompletionRequest, messages: list[dict[str, Any]],
                 variables: dict[str, Any]) -> list[int]:
    """The rendered conversation's ids: a new assistant turn opened, none, or the final assistant message left open
    (continue_final_message). `variables`: the template's tools."""
    if req.continue_final_message and (req.add_generation_prompt or messages[-1]["role"] != "assistant"):
        raise ServiceError(400, "continue_final_message goes on with a final assistant message: it needs the last "
                           "message's role to be assistant and add_generation_prompt false",
                           param="continue_final_message", code="invalid_value")
    return service.render_chat(messages, template_kwargs={**template_kwargs(req.chat_template_kwargs), **variables},
                               add_generation_prompt=req.add_generation_prompt,
                               continue_final=req.continue_final_message)


def _after_thinking(service: Service, constraint: Constraint, prompt: list[int]) -> Constraint:
    """A reasoning model thinks first: its grammar lets the thinking through (from inside it when the prompt
    opened it), then holds the answer to the constraint."""
    fmt = service.reasoning
    if fmt is None:
        return constraint
    return dataclasses.replace(constraint, reasoning=Reasoning(fmt.open_id, fmt.close_id,
                                                               inside=fmt.starts_inside(prompt)))


# the chat template's own variables, which chat_template_kwargs may not replace
_TEMPLATE_NAMES = ("messages", "add_generation_prompt", "bos_token", "eos_token")


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """chat_template_kwargs checked: a name the server sets itself is a 400 naming it."""
    for name in kwargs or {}:
        if name in _TEMPLATE_NAMES:
            raise ServiceError(400, f"chat_template_kwargs.{name} is set by the server and cannot be replaced",
                               param=f"chat_template_kwargs.{name}", code="invalid_value")
    return kwargs or {}


def _fills(service: Service, req: CompletionRequest, items: list[str | list[int]]) -> list[str]:
    """The prompts of a fill in the middle (server/fim.py): each text prompt between the model's tags with the
    suffix; a 400 naming suffix where the model has no such tags, or with echo."""
    fim = service.fim
    if fim is None:
        raise ServiceError(400, "suffix (fill in the middle) needs a model with fill-in-the-middle tokens "
                           "(<|fim_prefix|>... or <fim_prefix>...); this one has none", param="suffix",
                           code="unsupported")
    if req.echo:
        raise ServiceError(400, "suffix cannot be used with echo", param="suffix", code="unsupported")
    if not all(isinstance(item, str) for item in items):
        raise ServiceError(400, "suffix needs text prompts, not token ids", param="prompt", code="invalid_value")
    return [fim.text(item, req.suffix) for item in items]


def prompt_tokens_kept(service: Service, k: int | None) -> int | None:
    """How many of a prompt's last tokens truncate_prompt_tokens keeps (-1: the context), None to keep them all;
    a 400 naming the field for 0 or more than the context."""
    if k is None:
        return None
    if k == 0 or k > service.max_seq_len:
        raise ServiceError(400, f"truncate_prompt_tokens must be -1 (the context) or 1 .. {service.max_seq_len} (this "
                           f"server's context), got {k}", param="truncate_prompt_tokens", code="invalid_value")
    return service.max_seq_len if k == -1 else k


def truncated(ids: list[int], keep: int | None) -> list[int]:
    """The prompt's last `keep` tokens (vLLM's truncate_prompt_tokens: the start is dropped)."""
    return ids if keep is None else ids[-keep:]


def prompt_items(req: CompletionRequest) -> list[str | list[int]]:
    """A completion request's prompts: its text, texts, ids or lists of ids, as a list."""
    return as_items(req.prompt)


def as_items(raw: str | list) -> list[str | list[int]]:
    """A text, texts, one prompt's ids or lists of ids (OpenAI's prompt and input fields), as a list of prompts."""
    return [raw] if is_single(raw) else list(raw)


def is_single(raw: str | list) -> bool:
    """Whether the field holds one prompt (a text or one prompt's ids), not a list of them."""
    return isinstance(raw, str) or bool(raw and isinstance(raw[0], int))


def _params(service: Service, req: CompletionRequest | ChatCompletionRequest, *, max_tokens: int | None,
            logprobs: int | None, constraint: Constraint | None,
            param_names: dict[str, str] | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
    """The request's one SamplingParams (the n sub-requests differ only in their seed)."""
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    optional = {"temperature": req.temperature, "top_p": req.top_p, "min_p": req.min_p,
                "repetition_penalty": req.repetition_penalty,
                "top_k": 0 if req.top_k == -1 else req.top_k}  # -1 is vLLM's "off"
    grammar = compile_constraint(service, constraint) if constraint is not None else None
    _reject_vllm_unsupported(req)
    return service.sampling_params(
        param_names=param_names, constraint=grammar, max_tokens=max_tokens, n=req.n, stop=stop, seed=req.seed,
        stop_token_ids=service.token_ids(req.stop_token_ids or (), "stop_token_ids"),
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output, min_tokens=req.min_tokens,
        allowed_token_ids=None if req.allowed_token_ids is None else service.token_ids(req.allowed_token_ids,
                                                                                       "allowed_token_ids"),
        logit_bias=_logit_bias(service, req.logit_bias),
        logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        ignore_eos=req.ignore_eos, **{k: v for k, v in optional.items() if v is not None})


def _logit_bias(service: Service, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as (id, bias) pairs, checked by Service.logit_bias."""
    bias = bias or {}
    bad = [key for key in bias if not (key.isascii() and key.isdecimal())]
    if bad:
        raise ServiceError(400, f"logit_bias keys must be token ids in [0, {service.vocab_size}), got {bad[0]!r}",
                           param="logit_bias", code="invalid_value")
    return service.logit_bias([(int(key), value) for key, value in bias.items()])


def chat_messages(messages: list[ChatMessage], service: Service | None = None,
                  images: list[LoadedImage] | None = None) -> list[dict[str, Any]]:
    """A request's messages as the chat template takes them: text parts joined; with a vision-language model's
    service and an `images` list, a user message with images as parts ({"type": "text"} and {"type": "image"}, the
    form its template reads; as_parts gives the others that form after server.structured.with_tools) and each image
    part read into `images`; other parts a 400."""
    vision = None if service is None or images is None else service.images
    no_images = ("this route takes text only" if images is None else
                 "this model takes no images (it is a text-only model)")
    return [_message(m, i, vision, images, no_images) for i, m in enumerate(messages)]


def _message(message: ChatMessage, index: int, vision=None, images: list[LoadedImage] | None = None,
             no_images: str = "") -> dict[str, Any]:
    content = (_message_text(message, index, no_images) if vision is None
               else _message_parts(message, index, vision, images))
    entry: dict[str, Any] = {"role": message.role, "content": content}
    if message.name is not None:
        entry["name"] = message.name
    if message.tool_calls:
        entry["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    if message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    thinking = message.reasoning_content if message.reasoning_content is not None else message.reasoning
    if thinking is not None:
        entry["reasoning_content"] = thinking
    return entry


def _message_text(message: ChatMessage, index: int, no_images: str = "this route takes text only") -> str:
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    param = f"messages.{index}.content"
    return "".join(_part_text(part, param, j, no_images) for j, part in enumerate(content))


def _part_text(part: dict[str, Any], param: str, j: int, no_images: str) -> str:
    """Part j of a message's content (param) as text: a text part's, or a 400."""
    if part.get("type") == "image_url":
        raise ServiceError(400, f"{param}.{j}: {no_images}", param=f"{param}.{j}", code="unsupported")
    if part.get("type") != "text":
        raise ServiceError(400, f"only text content parts are supported, got type {part.get('type')!r}",
                           param=param, code="unsupported")
    if not isinstance(part.get("text"), str):
        got = "missing" if "text" not in part else f"a {type(part['text']).__name__}, not a string"
        raise ServiceError(400, f"{param}.{j}.text is {got}: a text part carries its text as a string",
                           param=f"{param}.{j}.text", code="invalid_value")
    try:
        return valid_unicode(part["text"])
    except ValueError as exc:
        raise ServiceError(400, str(exc), param=param, code="invalid_value") from None


def _message_parts(message: ChatMessage, index: int, vision, images: list[LoadedImage]) -> str | list[dict[str, Any]]:
    """A message's content for a vision-language model's template: its text (_message_text), or where it holds
    images, parts, with each image read into `images`. Images go in user messages only (as on OpenAI)."""
    content = message.content
    if not (isinstance(content, list) and any(part.get("type") == "image_url" for part in content)):
        return _message_text(message, index)
    parts: list[dict[str, Any]] = []
    param = f"messages.{index}.content"
    for j, part in enumerate(content):
        if part.get("type") == "image_url" and message.role != "user":
            raise ServiceError(400, f"{param}.{j}: images go in user messages, not {message.role} ones",
                               param=f"{param}.{j}", code="invalid_value")
        if part.get("type") == "image_url":
            source = part.get("image_url")
            url = source.get("url") if isinstance(source, dict) else source
            vision.check_count(len(images) + 1, f"{param}.{j}")
            images.append(vision.from_url(url, f"{param}.{j}.image_url.url"))
            parts.append({"type": "image"})
        else:
            parts.append({"type": "text", "text": _part_text(part, param, j, "")})
    return parts


def as_parts(content: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """A message's content as a list of parts (a text a single text part)."""
    return content if isinstance(content, list) else [{"type": "text", "text": content or ""}]


def _reject_vllm_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    """vLLM's fields this server does not implement, at anything but their neutral value: a 400 naming the field."""
    if req.prompt_logprobs is not None:
        raise ServiceError(400, "prompt_logprobs is not supported by this server (on /v1/completions, echo with "
                           "logprobs returns the prompt's log-probabilities)", param="prompt_logprobs",
                           code="unsupported")
    _reject_unsupported(req.use_beam_search, "use_beam_search", req.bad_words, "bad_words")


def _reject_unsupported(*pairs: Any) -> None:
    for value, name in zip(pairs[::2], pairs[1::2]):
        if value:
            raise ServiceError(400, f"{name} is not supported by this server", param=name, code="unsupported")
