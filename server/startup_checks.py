"""Command-line values checked before anything loads, each failing in one clear line (a ValueError
that `slipstream` prints as `slipstream: error: ...`): paths, ports, the API key file, limits."""
from __future__ import annotations

import argparse
import errno
import os
import socket


def check_args(args: argparse.Namespace) -> None:
    """Validate, and resolve --api-key-file into args.api_key (so the key never shows in `ps`)."""
    cache = getattr(args, "compile_cache", None)
    if cache and os.path.exists(cache) and not os.path.isdir(cache):
        raise ValueError(f"--compile-cache {cache} is a file, not a directory; point it at a directory "
                         "(created if missing), or pass --compile-cache '' to turn the cache off")
    if getattr(args, "command", None) != "serve":
        return
    for flag in ("port", "grpc_port"):
        value = getattr(args, flag, None)
        if value is not None and not 0 <= value <= 65535:
            raise ValueError(f"--{flag.replace('_', '-')} must be in [0, 65535], got {value}")
    limit = getattr(args, "max_requests_per_client", 0)
    if limit < 0:
        raise ValueError(f"--max-requests-per-client must be >= 0 (0: no limit), got {limit}")
    _resolve_api_key(args)
    from slipstream.server.lora import check_lora_args  # FastAPI's import: only when serving

    check_lora_args(args)
    if getattr(args, "process_id", 0) != 0:
        return  # multi-host workers serve nothing; process 0 holds the ports (maybe on this host)
    if not getattr(args, "uds", None):
        _check_port_free(args.host, args.port, "--port")
    if args.grpc_port:
        _check_port_free(args.host, args.grpc_port, "--grpc-port")


def _resolve_api_key(args: argparse.Namespace) -> None:
    path = getattr(args, "api_key_file", None)
    if not path:
        return
    if args.api_key:
        raise ValueError("give the API key once: --api-key-file, or --api-key / SLIPSTREAM_API_KEY, not both")
    try:
        with open(path, encoding="utf-8") as f:
            key = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--api-key-file {path}: cannot read it ({exc.__class__.__name__}: "
                         f"{getattr(exc, 'strerror', None) or exc})") from None
    if not key or "\n" in key:
        raise ValueError(f"--api-key-file {path} must hold the key on one line, got "
                         f"{'an empty file' if not key else 'several lines'}")
    args.api_key = key


def _check_port_free(host: str, port: int, flag: str) -> None:
    """Fail before the model loads (minutes) rather than after, when the port is taken."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(f"--host {host}: cannot resolve it ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn and grpc bind
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ValueError(f"{flag} {port}: {host}:{port} is already in use (another server?); choose "
                                 "another port") from None
            raise ValueError(f"{flag} {port}: cannot listen on {host}:{port} ({exc.strerror})") from None
