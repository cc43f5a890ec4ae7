"""llama.cpp's own routes, for clients written against its server: `POST /completion` (and `/completions`),
`POST /infill` (code infilling: llama.vim, llama.vscode), `POST /apply-template` and `GET /props`. Requests in
server/llamacpp.py, replies in server/llamacpp_output.py. Behind the API key and body limits like /v1/*."""
from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from slipstream.server.gate import client_of
from slipstream.server.http_streams import EventStream, admitted, unless_disconnected
from slipstream.server.llamacpp import SAMPLERS, LlamaCompletionRequest, prepare_llama
from slipstream.server.llamacpp_output import LlamaFormat
from slipstream.server.openai_api import chat_messages
from slipstream.server.protocol import ChatMessage, _Request
from slipstream.server.service import Service

class ApplyTemplateRequest(_Request):
    messages: list[ChatMessage]


def add_llamacpp_routes(app: FastAPI, service: Service, model_path: str | None = None) -> None:
    async def generate(body: LlamaCompletionRequest, request: Request, infill: bool) -> Response:
        started = time.monotonic()
        gen = await service.start(lambda: prepare_llama(service, body, infill=infill), client_of(request, None))
        fmt = LlamaFormat(service, gen, body, started)
        if body.stream:
            await admitted(gen)
            return EventStream(fmt.events(), gen.cancel)
        results = await unless_disconnected(request, fmt.collect(), gen.cancel)
        return JSONResponse(results[0] if len(results) == 1 else results)

    @app.post("/completion", response_model=None)
    @app.post("/completions", response_model=None, include_in_schema=False)
    async def completion(body: LlamaCompletionRequest, request: Request) -> Response:
        """llama.cpp's completion: `prompt` (a text, token ids, or ids and texts mixed; a list of such prompts gives a
        list of results), llama.cpp's sampling fields and defaults; with `stream`, partial results as server-sent
        events."""
        return await generate(body, request, infill=False)

    @app.post("/infill", response_model=None)
    async def infill(body: LlamaCompletionRequest, request: Request) -> Response:
        """Code infilling: the text between `input_prefix` and `input_suffix`, begun with `prompt`; `input_extra`
        ([{filename, text}]) adds other files as context (repository-level where the model has the tags)."""
        return await generate(body, request, infill=True)

    @app.post("/apply-template")
    async def apply_template(body: ApplyTemplateRequest) -> dict[str, str]:
        """The chat template applied to `messages` (with the assistant's turn opened), as text."""
        text = await asyncio.to_thread(service.render_chat_text, chat_messages(body.messages))
        return {"prompt": text}

    @app.get("/props")
    async def props() -> dict[str, Any]:
        """The server's settings in llama.cpp's shape (what its clients read: the context, slots, template)."""
        defaults = LlamaCompletionRequest()
        params = {"n_predict": defaults.n_predict, "temperature": defaults.temperature, "top_k": defaults.top_k,
                  "top_p": defaults.top_p, "min_p": defaults.min_p, "seed": defaults.seed,
                  "repeat_penalty": defaults.repeat_penalty, "stop": [], "samplers": list(SAMPLERS)}
        return {"default_generation_settings": {"n_ctx": service.max_seq_len, "params": params},
                "total_slots": service.engine.max_slots, "model_path": model_path or service.model_name,
                "chat_template": getattr(service.tokenizer, "chat_template", None) or "",
                "modalities": {"vision": service.images is not None, "audio": False}, "infill": service.fim is not None,
                "build_info": "slipstream"}
