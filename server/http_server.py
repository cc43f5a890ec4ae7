"""The HTTP server around the app (server/app.py): uvicorn with a drain Kubernetes can follow, the gRPC listener
beside it, unix sockets, and the process's exit when the engine fails."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import uvicorn
from fastapi import FastAPI

from slipstream.server.gate import head_timeout_protocol
from slipstream.server.grpc_service import GrpcServer, start_grpc_server
from slipstream.server.metrics import Metrics
from slipstream.server.service import Service
from slipstream.server.unix_socket import DEFAULT_MODE, bind_stream, remove

log = logging.getLogger(__name__)


class SlipstreamServer(uvicorn.Server):
    """uvicorn with a drain Kubernetes can follow. On SIGTERM: stop admitting (/ready and new
    requests answer 503) while the listener stays open; let in-flight requests finish until the
    deadline (scheduler.shutdown); only then close the listener and the connections.

    If the engine thread dies after having been ready, the server shuts itself down and sets
    `engine_failed`, so the process can exit non-zero and be restarted instead of idling unready.

    `uds`: listen on this unix socket path instead of host:port (no TCP socket is made), the file created
    with `uds_mode` and removed on shutdown; `grpc_uds` likewise for gRPC instead of `grpc_port`.
    """

    def __init__(self, config: uvicorn.Config, app: FastAPI, *, shutdown_timeout_s: float,
                 started_at: float | None, exit_on_engine_failure: bool, grpc_port: int = 0,
                 uds: str | None = None, grpc_uds: str | None = None, uds_mode: int = DEFAULT_MODE) -> None:
        super().__init__(config)
        self._service: Service = app.state.service
        self._api_key: str | None = app.state.api_key
        self._grpc_port = grpc_port
        self.uds, self._grpc_uds, self._uds_mode = uds, grpc_uds, uds_mode
        self._uds_inode: int | None = None
        self.on_started: Callable[[], None] | None = None  # called once listening (the "ready on" line)
        self.grpc: GrpcServer | None = None
        self._metrics: Metrics = app.state.metrics
        self._shutdown_timeout_s = shutdown_timeout_s
        self._started_at = started_at
        self._exit_on_engine_failure = exit_on_engine_failure
        self._was_ready = False
        self.engine_failed = False
        self.drain_seconds: float | None = None  # how long the last drain took, listener open

    async def startup(self, sockets: list | None = None) -> None:
        if self._grpc_port or self._grpc_uds:
            # before HTTP, so a busy gRPC port fails the start before any traffic is accepted
            self.grpc = await start_grpc_server(self._service, host=self.config.host, port=self._grpc_port,
                                                uds=self._grpc_uds, uds_mode=self._uds_mode, api_key=self._api_key,
                                                max_message_bytes=self._service.config.max_prompt_bytes + 4096)
        if self.uds is not None and sockets is None:
            sock, self._uds_inode = bind_stream(self.uds, self._uds_mode, "--uds")
            sockets = [sock]
        await super().startup(sockets=sockets)
        if self._started_at is not None:
            self._metrics.set_startup_latency(time.monotonic() - self._started_at)
        if self.started and self.on_started is not None:
            self.on_started()

    async def on_tick(self, counter: int) -> bool:
        ready = self._service.scheduler.ready
        self._was_ready = self._was_ready or ready
        # The scheduler may start after the server (so /health answers during compilation):
        # only a ready -> not-ready transition outside a shutdown is a failure.
        if self._exit_on_engine_failure and self._was_ready and not ready and not self._service.draining:
            log.error("engine thread stopped; shutting the server down")
            self.engine_failed = True
            return True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list | None = None) -> None:
        self._service.begin_drain()
        started = time.monotonic()
        # gRPC refuses new RPCs at once; running ones get the same deadline as HTTP streams
        grpc_stop = asyncio.ensure_future(self.grpc.stop(self._shutdown_timeout_s + 5.0)) if self.grpc else None
        try:
            if not self.engine_failed:
                log.info("draining: /ready answers 503; waiting up to %.0f s for in-flight requests",
                         self._shutdown_timeout_s)
            # The listener stays open meanwhile, so probes see 503 instead of a refused connection.
            await asyncio.to_thread(self._service.scheduler.shutdown, self._shutdown_timeout_s)
            self.drain_seconds = time.monotonic() - started
            log.info("drained in %.2f s; closing the listener", self.drain_seconds)
            await super().shutdown(sockets=sockets)
        finally:
            if self._uds_inode is not None:
                remove(self.uds, self._uds_inode)
            if grpc_stop is not None:
                await grpc_stop


def make_server(app: FastAPI, host: str, port: int, *, shutdown_timeout_s: float = 30.0, log_level: str = "info",
                started_at: float | None = None, exit_on_engine_failure: bool = True, grpc_port: int = 0,
                header_timeout_s: float = 10.0, keep_alive_s: float = 5.0,
                max_connections: int | None = 1024, uds: str | None = None, grpc_uds: str | None = None,
                uds_mode: int = DEFAULT_MODE) -> SlipstreamServer:
    """`started_at`: a time.monotonic() stamp from process start, exported as startup latency.
    `uds` / `grpc_uds`: unix socket paths to serve HTTP / gRPC on instead of host:port (see SlipstreamServer).
    `shutdown_timeout_s`: how long in-flight requests may run after SIGTERM before they fail.
    `header_timeout_s`: deadline for each request head (slowloris); `keep_alive_s`: idle time
    between requests on a connection; `max_connections`: connections beyond it get 503."""
    if max_connections is not None and max_connections < 1:
        raise ValueError(f"max_connections must be >= 1, got {max_connections}")
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                            http=head_timeout_protocol(header_timeout_s), timeout_keep_alive=keep_alive_s,
                            limit_concurrency=max_connections,
                            # past the scheduler's deadline its streams have ended with an error, so
                            # this margin only covers writing those last events out
                            timeout_graceful_shutdown=shutdown_timeout_s + 5.0)
    return SlipstreamServer(config, app, shutdown_timeout_s=shutdown_timeout_s, started_at=started_at,
                            exit_on_engine_failure=exit_on_engine_failure, grpc_port=grpc_port, uds=uds,
                            grpc_uds=grpc_uds, uds_mode=uds_mode)
