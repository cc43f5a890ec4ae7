"""`slipstream serve` with a per-request trace, to tell a client's timing from the server's.

    SLIPSTREAM_TRACE=/tmp/trace.jsonl python -m benchmarks.bench.trace_server serve --port 8000 ...

The server is the ordinary one; only its ASGI app is wrapped. For every completions request the wrapper
appends one JSON line: the x-request-id, the client's address (a reused connection keeps its port), and
time.perf_counter() stamps of when the app got the request, when its body was read, and when each response
chunk was written (`sends`; `first` and `last` of them). perf_counter is CLOCK_MONOTONIC on Linux, the clock both clients stamp
their requests with, so the lines join a client's --save-detailed results by request id. Diagnostics only:
not how Slipstream is served.
"""
from __future__ import annotations

import json
import os
import sys
import time


class TraceRequests:
    """ASGI middleware: one JSON line per completions request (see the module docstring)."""

    def __init__(self, app, path: str) -> None:
        self.app = app
        self.file = open(path, "a", buffering=1, encoding="utf-8")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].endswith("completions"):
            return await self.app(scope, receive, send)
        rec = {"id": dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1"),
               "client": list(scope.get("client") or ()), "dispatch": time.perf_counter(),
               "body": None, "first": None, "last": None, "chunks": 0, "sends": []}

        async def traced_receive():
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body"):
                rec["body"] = time.perf_counter()
            return message

        async def traced_send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                now = time.perf_counter()
                if rec["first"] is None:
                    rec["first"] = now
                rec["last"] = now
                rec["chunks"] += 1
                rec["sends"].append(now)
            await send(message)

        try:
            await self.app(scope, traced_receive, traced_send)
        finally:
            self.file.write(json.dumps(rec) + "\n")


def main(argv: list[str] | None = None) -> int:
    import server.app
    from server import cli

    path = os.environ.get("SLIPSTREAM_TRACE")
    if not path:
        print("trace_server: set SLIPSTREAM_TRACE to the JSONL file to append to", file=sys.stderr)
        return 2
    create_app = server.app.create_app

    def traced_create_app(*args, **kwargs):
        app = create_app(*args, **kwargs)
        app.add_middleware(TraceRequests, path=path)
        return app

    server.app.create_app = traced_create_app  # cmd_serve imports it from server.app when it runs
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
