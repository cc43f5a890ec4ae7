"""What a client sees when a request fails, for both front ends: `ServiceError` (HTTP status,
OpenAI error code, the field to blame), the one mapping from engine exceptions to it and from it
to gRPC codes, the API-key check and the Retry-After value. No FastAPI or grpc.aio types here.

Internal details (exception text, engine state) are logged, never put in a message."""
from __future__ import annotations

import hmac
import logging
import math
from typing import Any, Callable, TypeVar

import grpc

from slipstream.engine.errors import InvalidParam
from slipstream.engine.scheduler import EngineUnavailable, Overloaded, PromptTooLong

log = logging.getLogger(__name__)
T = TypeVar("T")


class ServiceError(Exception):
    """A request failed in a way the client should see: `status` is the HTTP status to answer with."""

    _TYPES = {429: "rate_limit_error"}  # OpenAI itself answers 401 with invalid_request_error

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    @property
    def type(self) -> str:
        if self.status >= 500:
            return "server_error"
        return self._TYPES.get(self.status, "invalid_request_error")


def service_error(exc: BaseException, *, prompt_param: str = "prompt") -> ServiceError:
    """The client-facing form of any exception raised while serving a request."""
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, InvalidParam):
        return ServiceError(400, exc.message, param=exc.field, code="invalid_value")
    if isinstance(exc, PromptTooLong):
        return ServiceError(400, str(exc), param=prompt_param, code="context_length_exceeded")
    if isinstance(exc, Overloaded):
        return ServiceError(429, f"The server is overloaded; retry in {exc.retry_after_s:.1f}s.",
                            code="overloaded", retry_after_s=exc.retry_after_s)
    if isinstance(exc, EngineUnavailable):
        log.warning("request refused: %s", exc)
        return ServiceError(503, "The engine is not available; retry on another replica.",
                            code="engine_unavailable")
    log.error("unexpected error while serving a request", exc_info=exc)
    return ServiceError(500, "internal server error", code="internal_error")


def renamed(exc: BaseException, field: Callable[[str], str]) -> ServiceError:
    """The client-facing form of an error met on the chat path by a request of another API translated onto it (the
    Responses and Anthropic APIs): its field as `field` names it, in `param` and in the message (for "messages",
    only where the message starts with it: elsewhere the word is prose)."""
    err = service_error(exc)
    if err.param is None:
        return err
    name, message = field(err.param), err.message
    if err.param == "messages":
        message = name + message[len(err.param):] if message.startswith(err.param) else message
    else:
        message = message.replace(err.param, name)
    return ServiceError(err.status, message, param=name, code=err.code, retry_after_s=err.retry_after_s)


def parse_input(field: str, what: str, parse: Callable[..., T], *args: Any) -> T:
    """The one way text a client sent is parsed (JSON arguments, schemas, grammars, templates,
    protobuf): whatever the parser raises is the client's 400 naming `field` (InvalidParam), never
    a 500. Python's parsers raise more than their documented errors on hostile text: RecursionError
    on a 5000-deep [[[...]]], ValueError past the int-string digit limit, TypeError on a list
    where a dict was assumed."""
    try:
        return parse(*args)
    except (InvalidParam, ServiceError):
        raise
    except RecursionError:
        raise InvalidParam(field, f"{field}: the {what} is nested too deeply to parse") from None
    except Exception as exc:  # noqa: BLE001 - any parser failure on client text is the client's error
        log.info("%s: %s rejected (%s)", field, what, type(exc).__name__)
        raise InvalidParam(field, f"{field}: invalid {what}: {_reason(exc)}") from None


def _reason(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if "integer string conversion" in text:  # Python's own wording names sys.set_int_max_str_digits
        return "a number has too many digits"
    if isinstance(exc, ValueError) and text:  # parsers' ValueErrors describe the input, not the server
        return text[:300]
    return "it could not be parsed"


_GRPC_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    503: grpc.StatusCode.UNAVAILABLE,
}


def grpc_code(err: ServiceError) -> grpc.StatusCode:
    return _GRPC_CODES.get(err.status, grpc.StatusCode.INTERNAL)


def retry_after(seconds: float) -> str:
    """Retry-After takes whole seconds; round up so a client never retries too early."""
    return str(max(1, math.ceil(seconds)))


def bearer_token(authorization: str | None) -> str | None:
    """The token of an 'Authorization: Bearer <token>' value (None for any other scheme)."""
    if authorization is None:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def check_api_key(expected: str | None, presented: str | None) -> None:
    """Raise 401 unless `presented` matches `expected` (no key configured: everything passes)."""
    if expected is None:
        return
    if not presented:
        raise ServiceError(401, "Missing API key: send 'Authorization: Bearer <key>'.", code="invalid_api_key")
    # Constant-time compare so the key cannot be guessed byte by byte from response timing.
    if not hmac.compare_digest(presented.encode(), expected.encode()):
        raise ServiceError(401, "Incorrect API key provided.", code="invalid_api_key")
