"""POST /tokenize and /detokenize, in vLLM's shapes (and llama.cpp's: `content`, `with_pieces`): the token ids this server would run for a prompt (or for chat
messages, rendered by the model's template as /v1/chat/completions renders them), and the text of token ids.
Clients count tokens against `max_model_len` with them. Behind the API key and the body limits like /v1/*
(server/gate.py); tokenizing runs off the event loop."""
from __future__ import annotations

import asyncio

from fastapi import FastAPI

from slipstream.server.errors import ServiceError
from slipstream.server.openai_api import chat_messages
from slipstream.server.protocol import (DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse,
                                        TokenPiece)
from slipstream.server.service import Service


def tokenize(service: Service, req: TokenizeRequest) -> TokenizeResponse:
    """Exactly one of prompt, content (llama.cpp's) and messages, tokenized as the generation routes do (the same
    errors); with_pieces: each id with its text."""
    service.check_model(req.model)
    if sum(x is not None for x in (req.prompt, req.content, req.messages)) != 1:
        raise ServiceError(400, "give exactly one of prompt, content and messages", param="prompt",
                           code="invalid_value")
    if req.prompt is not None:
        ids = service.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    elif req.content is not None:
        ids = service.tokenizer.encode(req.content, add_special_tokens=req.add_special) if req.content else []
    else:
        ids = service.render_chat(chat_messages(req.messages))
    tokens = [TokenPiece(id=t, piece=service.token_text(t)) for t in ids] if req.with_pieces else ids
    return TokenizeResponse(count=len(ids), max_model_len=service.max_seq_len, tokens=tokens)


def detokenize(service: Service, req: DetokenizeRequest) -> DetokenizeResponse:
    service.check_model(req.model)
    bad = [t for t in req.tokens if t >= service.vocab_size]
    if bad:
        raise ServiceError(400, f"tokens contains ids outside the vocabulary [0, {service.vocab_size}): {bad[:5]}",
                           param="tokens", code="invalid_value")
    text = service.tokenizer.decode(list(req.tokens), skip_special_tokens=False)
    return DetokenizeResponse(prompt=text, content=text)


def add_tokenize_routes(app: FastAPI, service: Service) -> None:
    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize_route(body: TokenizeRequest) -> TokenizeResponse:
        return await asyncio.to_thread(tokenize, service, body)

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize_route(body: DetokenizeRequest) -> DetokenizeResponse:
        return await asyncio.to_thread(detokenize, service, body)
