"""vLLM's runtime LoRA endpoints, POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with
--enable-lora-runtime-updates; /v1/* is behind the API key)."""
from __future__ import annotations

import asyncio
import logging
import os

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from slipstream.engine.lora_registry import LoraRegistry
from slipstream.models.lora import LoraError
from slipstream.server.errors import ServiceError

log = logging.getLogger(__name__)


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # vLLM's body carries it; names identify adapters here


def add_lora_routes(app: FastAPI, registry: LoraRegistry, base_name: str) -> None:
    """vLLM's runtime adapter endpoints. Loading reads and checks the files off the event loop; a bad
    adapter is a 400 naming the file and tensor, and changes nothing. Unloading stops new requests
    from picking it; requests already running finish with it."""
    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load(body: LoadLoraRequest) -> str:
        try:
            await asyncio.to_thread(registry.load, body.lora_name, body.lora_path, reserved=frozenset({base_name}))
        except LoraError as exc:
            # paths as the client gave them: relative to --lora-root, which stays the server's
            message = str(exc).replace(os.path.realpath(registry.root) + os.sep, "") if registry.root else str(exc)
            raise ServiceError(400, message, param="lora_path", code="invalid_value") from None
        log.info("LoRA adapter %s loaded from %s", body.lora_name, body.lora_path)
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload(body: UnloadLoraRequest) -> str:
        try:
            registry.unload(body.lora_name)
        except KeyError:
            raise ServiceError(404, f"The LoRA adapter {body.lora_name!r} is not loaded.", param="lora_name",
                               code="model_not_found") from None
        log.info("LoRA adapter %s unloaded", body.lora_name)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
