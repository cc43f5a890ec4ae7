"""POST /v1/embeddings, OpenAI's embeddings API over the served model: each input's tokens run as a prompt with no
output (SamplingParams.pooling), and its embedding is the mean of its tokens' last hidden states after the final
norm, or its last token's (--pooling), L2-normalized. Inputs share the engine's steps with generation requests.

A request of many inputs goes to the scheduler a group of at most max_choices inputs at a time, two groups in
flight: 2,048 inputs never fill the queue ahead of other clients' requests, and the engine never idles between
groups. A full queue refuses the request (429) only at its first group: a later one waits for room."""
from __future__ import annotations

import asyncio
import base64
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from slipstream.engine.request import POOLING, SamplingParams
from slipstream.server.errors import ServiceError
from slipstream.server.openai_api import as_items, is_single, prompt_tokens_kept, truncated
from slipstream.server.protocol import Embedding, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from slipstream.server.generation import Prepared
from slipstream.server.service import Service

log = logging.getLogger(__name__)

GROUPS_IN_FLIGHT = 2
QUEUE_RETRY_S = 0.05  # a later group the full queue refused tries again after this


def pooling_of(model_path: str | None) -> str | None:
    """The pooling a sentence-transformers model directory declares (modules.json's Pooling module config:
    pooling_mode_lasttoken -> "last", pooling_mode_mean_tokens -> "mean"); None when it declares none. ValueError
    for a pooling this server does not make (CLS, max, weighted mean), naming the file."""
    root = Path(model_path) if model_path is not None else None
    if root is not None and root.name == "config.json":  # --load-format dummy of a directory
        root = root.parent
    if root is None or not (root / "modules.json").is_file():
        return None
    modules = json.loads((root / "modules.json").read_text())
    pooling = next((m for m in modules if str(m.get("type", "")).endswith("Pooling")), None)
    if pooling is None:
        return None
    config_path = root / pooling.get("path", "") / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    modes = {name for name, on in config.items() if name.startswith("pooling_mode_") and on}
    if modes == {"pooling_mode_lasttoken"}:
        return "last"
    if modes == {"pooling_mode_mean_tokens"}:
        return "mean"
    raise ValueError(f"{config_path}: pooling {sorted(modes)} is not one this server makes (last token or mean); "
                     "serve it with --pooling last or --pooling mean")


class Embedder:
    """Embeds a request's inputs through the service's scheduler; `pooling`: one of engine.request.POOLING."""

    def __init__(self, service: Service, pooling: str) -> None:
        if pooling not in POOLING:
            raise ValueError(f"pooling must be one of {', '.join(POOLING)}, got {pooling!r}")
        self.service, self.pooling = service, pooling
        self.hidden_size: int = service.engine.hidden_size
        self._params = SamplingParams(max_tokens=0, temperature=0.0, pooling=pooling)

    def prepare(self, req: EmbeddingRequest) -> tuple[Any, list[list[int]]]:
        """(the LoRA adapter `model` names, each input's token ids): validated and tokenized, off the event loop."""
        service = self.service
        lora = service.check_model(req.model)
        service.check_priority(req.priority)
        if req.dimensions is not None and req.dimensions > self.hidden_size:
            raise ServiceError(400, f"dimensions must be at most the model's {self.hidden_size}, got {req.dimensions}",
                               param="dimensions", code="invalid_value")
        if not req.input:
            raise ServiceError(400, "input must not be empty", param="input", code="invalid_value")
        single, prompts = is_single(req.input), []
        keep = prompt_tokens_kept(service, req.truncate_prompt_tokens)
        for i, item in enumerate(as_items(req.input)):
            param = "input" if single else f"input[{i}]"
            ids = truncated(service.encode(item, param=param), keep)
            if len(ids) > service.max_seq_len:  # before any is embedded: a bad input fails the request at once
                raise ServiceError(400, f"{param} is {len(ids)} tokens; this server's context is {service.max_seq_len} "
                                   "tokens", param=param, code="context_length_exceeded")
            prompts.append(ids)
        return lora, prompts

    async def embed(self, req: EmbeddingRequest, client: str | None) -> EmbeddingResponse:
        """The response to `req` (ServiceError on a bad request, a full queue or an engine failure). Cancelling it
        cancels its inputs' requests in the engine."""
        lora, prompts = await asyncio.to_thread(self.prepare, req)
        release = self.service.hold_client_place(client)
        try:
            vectors = await self._embed_all(prompts, lora, req.priority)
        finally:
            release()
        data = [Embedding(index=i, embedding=self._encode(v, req)) for i, v in enumerate(vectors)]
        tokens = sum(len(p) for p in prompts)
        return EmbeddingResponse(data=data, model=req.model or self.service.model_name,
                                 usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))

    async def _embed_all(self, prompts: list[list[int]], lora: Any, priority: int) -> list[np.ndarray]:
        out: list[np.ndarray | None] = [None] * len(prompts)
        window = self.service.config.max_choices
        groups = [range(start, min(start + window, len(prompts))) for start in range(0, len(prompts), window)]
        in_flight = asyncio.Semaphore(GROUPS_IN_FLIGHT)
        first_queued = asyncio.Event()  # the first group is the request's: a full queue refuses it there

        async def run(group: range) -> None:
            prepared = Prepared(prompts=[prompts[i] for i in group], params=self._params, id_prefix="embd",
                                prompt_param="input", lora=lora, priority=priority)
            async with in_flight:
                if group.start:
                    await first_queued.wait()
                while True:
                    try:
                        gen = await self.service.start(lambda: prepared)
                        break
                    except ServiceError as exc:  # a full queue refuses a request, not one already being served
                        if exc.status != 429 or group.start == 0:
                            raise
                        await asyncio.sleep(QUEUE_RETRY_S)
                first_queued.set()
                for delta in await gen.collect():
                    out[group[delta.index]] = delta.embedding

        try:
            async with asyncio.TaskGroup() as tasks:  # one failing group cancels the others (and their requests)
                for group in groups:
                    tasks.create_task(run(group))
        except ExceptionGroup as failed:
            raise failed.exceptions[0] from None
        if any(v is None for v in out):
            log.error("the engine finished an embedding request without its embedding")
            raise ServiceError(500, "internal server error", code="internal_error")
        return out

    @staticmethod
    def _encode(vector: np.ndarray, req: EmbeddingRequest) -> list[float] | str:
        v = np.asarray(vector, np.float32)
        if req.dimensions is not None:
            v = v[:req.dimensions]
        if req.normalize:
            v = v / max(float(np.linalg.norm(v)), 1e-12)
        if req.encoding_format == "base64":
            return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
        return v.tolist()
