"""LoRA adapters at the server: the serve flags, the registry built from them (--lora-modules loaded at
start), and per-adapter usage counters whose label values come only from the loaded adapters. The
runtime endpoints are server/lora_routes.py's."""
from __future__ import annotations

import argparse
import collections
import logging
import os
import threading
from typing import Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from slipstream.engine.lora_registry import LoraRegistry
from slipstream.models.lora import load_adapter
from slipstream.server.settings import flag_env

log = logging.getLogger(__name__)


def _module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules takes name=path, got {text!r}")
    return name, path


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA adapters (PEFT format)")
    g.add_argument("--lora-modules", nargs="+", type=_module, default=[], metavar="NAME=PATH",
                   help="adapters to load at start, each a PEFT directory under --lora-root")
    g.add_argument("--lora-root", default=flag_env("lora-root", None),
                   help="the directory adapters load from; no adapter path may reach outside it")
    g.add_argument("--max-loras", type=int, default=int(flag_env("max-loras", 0)),
                   help="adapter slots on the device (default: 4 when adapters are enabled, else 0)")
    g.add_argument("--max-lora-rank", type=int, default=int(flag_env("max-lora-rank", 64)))
    g.add_argument("--enable-lora-runtime-updates", action="store_true",
                   default=bool(flag_env("enable-lora-runtime-updates", "")),
                   help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter")


def lora_slots(args: argparse.Namespace) -> int:
    """The engine's adapter slots for these flags (0: LoRA off)."""
    wanted = bool(getattr(args, "lora_modules", None)) or getattr(args, "enable_lora_runtime_updates", False)
    return getattr(args, "max_loras", 0) or (4 if wanted else 0)


def check_lora_args(args: argparse.Namespace) -> None:
    """Before anything loads: adapters need a --lora-root that exists, and sane slot limits."""
    if getattr(args, "max_loras", 0) < 0 or getattr(args, "max_lora_rank", 64) < 1:
        raise ValueError(f"--max-loras must be >= 0 and --max-lora-rank >= 1, got {args.max_loras}, "
                         f"{args.max_lora_rank}")
    if not lora_slots(args):
        if getattr(args, "lora_modules", None):
            raise ValueError("--lora-modules needs --max-loras >= 1")
        return
    root = getattr(args, "lora_root", None)
    if not root or not os.path.isdir(root):
        raise ValueError(f"--lora-root {root!r} is not a directory; adapters load only from directories under it")


def build_registry(args: argparse.Namespace, engine) -> LoraRegistry | None:
    """The registry over `engine`'s LoRA slots, with --lora-modules loaded (a bad one stops start-up
    with its LoraError); None when LoRA is off."""
    if not lora_slots(args):
        return None
    if getattr(engine, "lora", None) is None:
        raise ValueError(f"LoRA adapters were asked for, but the {type(engine).__name__} has no LoRA slots")
    slots, layers, max_rank = engine.lora, engine.model_cfg.num_layers, engine.config.max_lora_rank
    registry = LoraRegistry(lambda name, path: load_adapter(name, path, slots.targets, layers, max_rank),
                            args.lora_root)
    for name, path in args.lora_modules:
        adapter = registry.load(name, path)
        log.info("LoRA adapter %s: rank %d on %s", name, adapter.rank, ", ".join(adapter.modules))
    return registry


class LoraUsage(Collector):
    """Requests and generated tokens per adapter; exported only for the adapters loaded now."""

    def __init__(self, registry: LoraRegistry) -> None:
        self._registry = registry
        self._lock = threading.Lock()
        self._requests: collections.Counter[str] = collections.Counter()
        self._tokens: collections.Counter[str] = collections.Counter()

    def count(self, name: str, *, requests: int = 0, tokens: int = 0) -> None:
        with self._lock:
            self._requests[name] += requests
            self._tokens[name] += tokens

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        names = sorted(self._registry.names())
        with self._lock:
            requests = CounterMetricFamily("slipstream_lora_requests", "API requests per loaded LoRA adapter.",
                                           labels=["adapter"])
            tokens = CounterMetricFamily("slipstream_lora_generated_tokens",
                                         "Tokens generated per loaded LoRA adapter.", labels=["adapter"])
            for name in names:
                requests.add_metric([name], self._requests[name])
                tokens.add_metric([name], self._tokens[name])
        yield requests
        yield tokens
