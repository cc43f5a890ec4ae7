"""The gRPC server over a live test server's Service, on its own event-loop thread, plus a client."""
from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Any, Coroutine, Iterator, TypeVar

import grpc

from slipstream.server.grpc_service import GrpcServer, start_grpc_server
from slipstream.server.proto import jetstream_pb2 as pb
from slipstream.server.proto import jetstream_pb2_grpc as pb_grpc
from slipstream.server.service import Service

T = TypeVar("T")


class LoopThread:
    """An asyncio event loop running on a daemon thread, as uvicorn's loop does in the server."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-grpc-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if self._thread.is_alive():
            raise RuntimeError("test event loop did not stop within 5 s")
        self.loop.close()


@dataclasses.dataclass
class GrpcLive:
    server: GrpcServer
    loop: LoopThread
    channel: grpc.Channel
    stub: pb_grpc.OrchestratorStub

    def stop(self) -> None:
        self.channel.close()
        self.loop.run(self.server.stop(0))
        self.loop.close()


def start_grpc(service: Service, *, api_key: str | None = None, loop: LoopThread | None = None) -> GrpcLive:
    loop = loop or LoopThread()
    server = loop.run(start_grpc_server(service, host="127.0.0.1", port=0, api_key=api_key))
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    return GrpcLive(server, loop, channel, pb_grpc.OrchestratorStub(channel))


def text_request(text: str, max_tokens: int, **kwargs: Any) -> pb.DecodeRequest:
    return pb.DecodeRequest(text_content=pb.DecodeRequest.TextContent(text=text), max_tokens=max_tokens, **kwargs)


def token_request(ids: list[int], max_tokens: int, **kwargs: Any) -> pb.DecodeRequest:
    return pb.DecodeRequest(token_content=pb.DecodeRequest.TokenContent(token_ids=ids), max_tokens=max_tokens,
                            **kwargs)


def collect(responses: Iterator[pb.DecodeResponse]) -> tuple[list[str], list[list[int]], int]:
    """Per-sample text and token ids over a whole stream, and how many responses there were.

    Checks the stream's shape: only stream_content, the same number of samples in each."""
    texts: list[str] = []
    ids: list[list[int]] = []
    count = 0
    for response in responses:
        assert response.WhichOneof("content") == "stream_content"
        samples = response.stream_content.samples
        if not texts:
            texts, ids = [""] * len(samples), [[] for _ in samples]
        assert len(samples) == len(texts), "every StreamContent carries one Sample per sample"
        for i, sample in enumerate(samples):
            texts[i] += sample.text
            ids[i].extend(sample.token_ids)
        count += 1
    return texts, ids, count
