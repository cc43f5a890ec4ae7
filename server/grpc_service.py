"""JetStream-compatible gRPC front end (Orchestrator.Decode / HealthCheck) on grpc.aio.

It only translates between protobuf and `server.service`, as the HTTP routes do, so validation,
limits, API keys and metrics are the same on both; it runs on the caller's event loop (uvicorn's).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
from typing import AsyncIterator, Sequence

import grpc

from slipstream.engine.request_stream import Delta
from slipstream.engine.request import DEFAULT_MAX_TOKENS
from slipstream.server.errors import ServiceError, bearer_token, check_api_key, grpc_code, parse_input, retry_after, service_error
from slipstream.server.proto import jetstream_pb2 as pb
from slipstream.server.proto import jetstream_pb2_grpc as pb_grpc
from slipstream.server.generation import Generation, Prepared
from slipstream.server.service import Service
from slipstream.server.structured import Constraint, compile_constraint, json_source
from slipstream.server.unix_socket import DEFAULT_MODE, create_with_mode, remove

# SamplingParams names a rejected field; these are the request fields to blame.
_PARAM_NAMES = {"max_tokens": "max_tokens", "n": "num_samples",
                **{f: f"sampling.{f}" for f in ("temperature", "top_p", "top_k", "min_p", "seed", "stop",
                                                "presence_penalty", "frequency_penalty", "repetition_penalty",
                                                "logit_bias", "min_tokens", "stop_token_ids")}}
_OPTIONAL_SAMPLING = ("top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                      "repetition_penalty")
_END = object()  # the pump's end-of-stream marker


def prepare_decode(service: Service, request: pb.DecodeRequest, bos_prefix: Sequence[int]) -> Prepared:
    """Validate, then tokenize a DecodeRequest (CPU only, thread-safe, like prepare_completion).

    Without `sampling` the request decodes greedily, as JetStream engines do by default.
    """
    # JetStream's adapter field: a loaded LoRA adapter's name (NOT_FOUND for another), empty: the base model
    try:
        lora = service.check_model(request.lora_adapter_id or None)
    except ServiceError:
        raise ServiceError(404, f"the LoRA adapter {request.lora_adapter_id!r} is not loaded on this server",
                           param="lora_adapter_id", code="model_not_found") from None
    kind = request.WhichOneof("content")
    if kind is None:
        raise ServiceError(400, "the request has no prompt: set text_content or token_content", param="content",
                           code="invalid_value")
    if request.max_tokens < 0:
        raise ServiceError(400, f"max_tokens must be >= 0 (0: the server's default of {DEFAULT_MAX_TOKENS}), "
                           f"got {request.max_tokens}", param="max_tokens", code="invalid_value")
    if request.num_samples < 0:
        raise ServiceError(400, f"num_samples must be >= 0 (0: one), got {request.num_samples}",
                           param="num_samples", code="invalid_value")
    # Cheap checks before the tokenizer runs: the sampling fields, then the prompt's size (encode).
    s = request.sampling
    optional = {name: getattr(s, name) for name in _OPTIONAL_SAMPLING if s.HasField(name)}
    grammar = None
    if s.HasField("json_schema"):
        field = "sampling.json_schema"
        grammar = compile_constraint(service, Constraint("json_schema", json_source(s.json_schema, field), field=field))
    priority = service.check_priority(s.priority, "sampling.priority")
    params = service.sampling_params(
        param_names=_PARAM_NAMES, max_tokens=request.max_tokens or DEFAULT_MAX_TOKENS,
        n=request.num_samples or 1, temperature=s.temperature if s.HasField("temperature") else 0.0,
        stop=tuple(s.stop), ignore_eos=s.ignore_eos, constraint=grammar, min_tokens=s.min_tokens,
        stop_token_ids=service.token_ids(list(s.stop_token_ids), "sampling.stop_token_ids"),
        include_stop_str_in_output=s.include_stop_str_in_output,
        logit_bias=service.logit_bias(sorted(s.logit_bias.items()), "sampling.logit_bias"), **optional)
    if kind == "text_content":
        prompt, prompt_param = service.encode(request.text_content.text, param="text_content.text"), "text_content"
    else:
        prompt_param = "token_content"
        prompt = service.encode(list(request.token_content.token_ids), param="token_content.token_ids")
        if not request.has_bos:
            prompt = [*bos_prefix, *prompt]
    return Prepared(prompts=[prompt], params=params, id_prefix="decode", prompt_param=prompt_param, lora=lora,
                    priority=priority)


class OrchestratorServicer(pb_grpc.OrchestratorServicer):
    """Decode streams one StreamContent per batch of new output (one engine step, or several merged
    when the client reads slowly), with one Sample per sample in index order. The RPC ending, by
    completion, error or client cancellation, cancels whatever is still running in the engine."""

    def __init__(self, service: Service, *, api_key: str | None = None) -> None:
        self._service = service
        self._api_key = api_key
        # What the tokenizer puts before any text (BOS, or nothing): prepended to token prompts
        # that say has_bos=false, as JetStream does (never the EOS an add_eos_token vocabulary appends).
        tokenizer = service.tokenizer
        self._bos_prefix = (tokenizer.bos_token_id,) if tokenizer.add_bos else ()

    async def HealthCheck(self, request: pb.HealthCheckRequest,
                          context: grpc.aio.ServicerContext) -> pb.HealthCheckResponse:
        # No API key needed, like HTTP /ready: probes and load balancers cannot send one.
        return pb.HealthCheckResponse(is_live=self._service.ready)

    async def Decode(self, request: pb.DecodeRequest | bytes,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[pb.DecodeResponse]:
        try:
            if isinstance(request, bytes):  # the wire form (see add_servicer): parsed here, so bad bytes are a 400
                request = parse_input("request", "DecodeRequest protobuf", pb.DecodeRequest.FromString, request)
            check_api_key(self._api_key, _bearer(context.invocation_metadata()))
            gen = await self._service.start(lambda: prepare_decode(self._service, request, self._bos_prefix),
                                            _client(context))
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status, internals logged
            await self._abort(context, service_error(exc))
            return
        context.add_done_callback(lambda _: gen.cancel())
        queue: asyncio.Queue[Delta | Exception | object] = asyncio.Queue(maxsize=gen.num_choices)
        pump = asyncio.ensure_future(_pump(gen, queue))
        try:
            while True:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                deltas = [item for item in batch if isinstance(item, Delta)]
                if any(d.text or d.token_ids for d in deltas):
                    yield _stream_content(deltas, gen.num_choices)
                errors = [item for item in batch if isinstance(item, Exception)]
                if errors:
                    await self._abort(context, service_error(errors[0]))
                    return
                if _END in batch:
                    self._service.responses.count_grpc("Decode", "OK")
                    return
        except asyncio.CancelledError:
            self._service.responses.count_grpc("Decode", "CANCELLED")  # the client went away
            raise
        finally:
            pump.cancel()
            gen.cancel()

    async def _abort(self, context: grpc.aio.ServicerContext, err: ServiceError) -> None:
        self._service.responses.count_grpc("Decode", grpc_code(err).name)
        await _abort(context, err)


async def _pump(gen: Generation, queue: asyncio.Queue) -> None:
    """Move the Generation's deltas into `queue`, so Decode can take all that is ready at once."""
    try:
        async with contextlib.aclosing(gen.deltas()) as deltas:
            async for delta in deltas:
                await queue.put(delta)
    except Exception as exc:  # handed to Decode, which turns it into the RPC's status
        await queue.put(exc)
    else:
        await queue.put(_END)


def _stream_content(deltas: list[Delta], num_samples: int) -> pb.DecodeResponse:
    texts: list[list[str]] = [[] for _ in range(num_samples)]
    ids: list[list[int]] = [[] for _ in range(num_samples)]
    for d in deltas:
        texts[d.index].append(d.text)
        ids[d.index].extend(d.token_ids)
    Sample = pb.DecodeResponse.StreamContent.Sample
    samples = [Sample(text="".join(t), token_ids=i) for t, i in zip(texts, ids)]
    return pb.DecodeResponse(stream_content=pb.DecodeResponse.StreamContent(samples=samples))


async def _abort(context: grpc.aio.ServicerContext, err: ServiceError) -> None:
    """End the RPC with err's status (raises grpc's AbortError)."""
    trailers: tuple[tuple[str, str], ...] = ()
    if err.retry_after_s is not None:
        trailers = (("retry-after", retry_after(err.retry_after_s)),)  # the hint HTTP sends as Retry-After
    await context.abort(grpc_code(err), err.message, trailing_metadata=trailers)


def _client(context: grpc.aio.ServicerContext) -> str:
    """As HTTP's client_of, without a `user` field: the API key, else the peer's address."""
    token = _bearer(context.invocation_metadata())
    if token:
        return "key:" + hashlib.sha256(token.encode()).hexdigest()[:16]
    return "addr:" + context.peer().rsplit(":", 1)[0]  # "ipv4:127.0.0.1:50123" without the port


def _bearer(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            return bearer_token(value)
    return None


# ---- server --------------------------------------------------------------------------------------


def add_servicer(servicer: OrchestratorServicer, server: grpc.aio.Server) -> None:
    """The generated add_OrchestratorServicer_to_server, except that Decode takes the request's bytes:
    grpc answers a request its deserializer refuses with UNKNOWN, the exception in the details and a
    traceback in the log; Decode parses them itself and answers INVALID_ARGUMENT."""
    handlers = {
        "Decode": grpc.unary_stream_rpc_method_handler(
            servicer.Decode, request_deserializer=None, response_serializer=pb.DecodeResponse.SerializeToString),
        "HealthCheck": grpc.unary_unary_rpc_method_handler(
            servicer.HealthCheck, request_deserializer=_health_request,
            response_serializer=pb.HealthCheckResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("jetstream_proto.Orchestrator", handlers),))


def _health_request(raw: bytes) -> pb.HealthCheckRequest:
    # An empty message: nothing a probe sends needs reading (bad bytes must not fail the probe).
    return pb.HealthCheckRequest()


@dataclasses.dataclass(frozen=True)
class GrpcServer:
    """A started grpc.aio server and the port it is bound to (useful when asked for port 0), or its unix
    socket path (port 0) and that file's inode."""

    server: grpc.aio.Server
    port: int
    uds: str | None = None
    uds_inode: int | None = None

    async def stop(self, grace: float | None) -> None:
        """Refuse new RPCs now; let running ones finish for `grace` seconds, then cancel them."""
        try:
            await self.server.stop(grace)
        finally:
            if self.uds is not None and self.uds_inode is not None:
                remove(self.uds, self.uds_inode)  # grpc removes it too; not if the stop failed


async def start_grpc_server(service: Service, *, host: str, port: int, api_key: str | None = None,
                            max_message_bytes: int = 4 << 20, uds: str | None = None,
                            uds_mode: int = DEFAULT_MODE) -> GrpcServer:
    """Start serving Orchestrator on host:port (0: any free port), or on the unix socket `uds` (a path; no
    TCP socket then) created with `uds_mode`, on the running event loop.
    `max_message_bytes` bounds a request as HTTP's body limit does (grpc answers RESOURCE_EXHAUSTED)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"gRPC port must be in [0, 65535], got {port}")
    if uds is not None and port:
        raise ValueError(f"gRPC listens on a port ({port}) or a unix socket ({uds}), not both")
    # SO_REUSEPORT (grpc's default on Linux) would let a second server share a busy port silently.
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0),
                                      ("grpc.max_receive_message_length", max_message_bytes)])
    add_servicer(OrchestratorServicer(service, api_key=api_key), server)
    if uds is not None:
        # grpc would silently unlink whatever is at the path: create_with_mode refuses a live server's
        # socket or a file first, and grpc creates the socket file (at add_insecure_port) under its umask
        def bind() -> int:
            try:
                return server.add_insecure_port(f"unix:{uds}")
            except RuntimeError as exc:
                raise OSError(f"--grpc-uds {uds}: cannot listen there ({exc})") from exc

        _, inode = create_with_mode(uds, uds_mode, "--grpc-uds", bind)
        await server.start()
        return GrpcServer(server, 0, uds, inode)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise OSError(f"cannot listen for gRPC on {address} ({exc}); is the port in use? "
                      "Choose another --grpc-port, or 0 to turn gRPC off") from exc
    await server.start()
    return GrpcServer(server, bound)
