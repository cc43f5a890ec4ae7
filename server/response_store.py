"""The Responses API's stored responses, in memory: the last ones (by count and by size) with the conversation
that led to each, so that `previous_response_id` continues it and GET /v1/responses/{id} returns one. Nothing is
written anywhere: a restart forgets them all. Used from the event loop only (no lock)."""
from __future__ import annotations

import collections
import dataclasses
import json
from typing import Any

from slipstream.server.errors import ServiceError

MAX_RESPONSES = 1000
MAX_BYTES = 256 << 20  # the stored bodies and the new items each brought, as JSON


@dataclasses.dataclass(frozen=True)
class Stored:
    body: bytes                # the response as returned (JSON)
    items: list[dict[str, Any]]  # the conversation: every earlier input and output item, then this one's output
    size: int


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES) -> None:
        if max_responses < 1 or max_bytes < 1:
            raise ValueError(f"max_responses and max_bytes must be >= 1, got {max_responses} and {max_bytes}")
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._stored: collections.OrderedDict[str, Stored] = collections.OrderedDict()  # least recently used first
        self._bytes = 0

    def put(self, response_id: str, body: bytes, items: list[dict[str, Any]], new: list[dict[str, Any]]) -> None:
        """Keep a response; `new`: the items of `items` it added (what its size counts: earlier ones are shared)."""
        size = len(body) + len(json.dumps(new))
        if size > self.max_bytes:
            return  # larger than the whole store: kept, it would evict everything else and then itself
        self._drop(response_id)
        self._stored[response_id] = Stored(body, items, size)
        self._bytes += size
        while len(self._stored) > self.max_responses or self._bytes > self.max_bytes:
            self._drop(next(iter(self._stored)))

    def get(self, response_id: str, param: str | None = None) -> Stored:
        """The stored response (now the most recently used); 404 naming `param` when it is not kept."""
        stored = self._stored.get(response_id)
        if stored is None:
            raise ServiceError(404, f"no stored response {response_id!r}: this server keeps the last "
                               f"{self.max_responses:,} in memory, until it restarts", param=param, code="not_found")
        self._stored.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        self._drop(response_id)

    def _drop(self, response_id: str) -> None:
        stored = self._stored.pop(response_id, None)
        if stored is not None:
            self._bytes -= stored.size
