"""The command line: `slipstream serve` and `slipstream generate` flags and their defaults. Every serve
flag can also come from its SLIPSTREAM_<FLAG> variable (server/settings.py reads them)."""
from __future__ import annotations

import argparse
import os
import re

from slipstream.engine.request import DEFAULT_MAX_TOKENS
from slipstream.models.registry import DEFAULT_MODEL, architecture_presets
from slipstream.server.lora import add_lora_flags
from slipstream.server.reasoning import PARSERS
from slipstream.server.settings import flag_env
from slipstream.server.tool_formats import PARSERS as TOOL_CALL_PARSERS
from slipstream.server.unix_socket import parse_mode


def parse_bytes(text: str) -> int:
    """'1GiB', '512MiB', '2G', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 512MiB or 2GiB)")
    number, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    base = 1024 if binary or unit else 1
    return int(number * base ** " KMGT".index(unit or " "))


def parse_speculative(text: str):
    """--speculative-config JSON -> engine.speculative.SpeculativeConfig ('' -> None: off)."""
    from slipstream.engine.speculative import SpeculativeConfig

    if not text.strip():
        return None
    try:
        return SpeculativeConfig.from_json(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--speculative-config: {exc}") from None


def _engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=flag_env("model", DEFAULT_MODEL),
                   help=f"preset name or path to an HF directory / .gguf file (default {DEFAULT_MODEL})")
    p.add_argument("--load-format", default=flag_env("load-format", "auto"), choices=["auto", "dummy"],
                   help="dummy: random weights for --model's config (an architecture preset: "
                        f"{', '.join(architecture_presets())}; or an HF directory with a config.json), "
                        "no checkpoint read")
    p.add_argument("--dtype", default=flag_env("dtype", "auto"), choices=["auto", "float32", "bfloat16"])
    p.add_argument("--max-slots", type=int, default=int(flag_env("max-slots", 32)))
    p.add_argument("--max-seq-len", type=int, default=int(flag_env("max-seq-len", 2048)))
    page_size = flag_env("page-size", None)
    p.add_argument("--page-size", type=int, default=None if page_size is None else int(page_size),
                   help="tokens per KV page (default: the attention kernel's choice, 16 on CPU, 128 on TPU)")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=parse_bytes(flag_env("kv-cache-memory", "768MiB")))
    step_tokens = flag_env("max-num-batched-tokens", None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None if step_tokens is None else int(step_tokens),
                   help="tokens per engine step (decodes plus prefill chunks); steps are compiled on a "
                        "power-of-two ladder up to it (default: 288 on CPU, 1152 on TPU/GPU)")
    p.add_argument("--quantize", default=flag_env("quantize", "auto"),
                   choices=["auto", "none", "q8_0-a16", "q8_0", "int8", "int4", "int8-channel", "int8-channel-a16",
                            "int8-channel-w16"],
                   help="weights: auto = q8_0-a16 on CPU (group-wise int8, the native kernel), int8 on TPU/GPU "
                        "(int8 per 32 inputs, converted inside the dot); int4: 4-bit per 32 inputs, half int8's "
                        "bytes (more room for the KV cache; the LM head stays 8-bit; on CPU GGUF Q4_1's rows in "
                        "the native kernel); int8-channel: one scale per output "
                        "channel, int8 activations (on TPU/GPU in prefill chunks; on CPU every row, AMX tiles: "
                        "fastest prefill, less exact); int8-channel-a16: the same weights with ~16-bit activations "
                        "(two int8 parts on CPU); int8-channel-w16: those weights plus an int8 residual per weight "
                        "(~16 bits, 2 bytes a weight: the default's accuracy, AMX prefill); none = float")
    p.add_argument("--prompt-weights", default=flag_env("prompt-weights", "auto"), choices=["auto", "w16", "same"],
                   help="with q8_0-a16 weights on CPU: w16 runs prompt tokens on a second copy of the layer weights "
                        "(int8-channel-w16: as accurate, 2 bytes a weight, AMX prefill) and generated tokens on "
                        "q8_0-a16; same: every token on q8_0-a16; auto: w16 at --quantize auto on a CPU with AMX")
    p.add_argument("--kv-cache-dtype", default=flag_env("kv-cache-dtype", "auto"),
                   choices=["auto", "float32", "bfloat16", "int8"],
                   help="K/V page dtype; auto: bfloat16 on CPU with int8 weights (the default), else the "
                        "activation dtype")
    p.add_argument("--tensor-parallel", type=int, default=int(flag_env("tensor-parallel", 1)),
                   help="split the model over the first N local devices (a 'model' mesh axis: attention "
                        "heads, MLP hidden, vocabulary); --kv-cache-memory is then per device")
    p.add_argument("--compile-cache", default=flag_env("compile-cache", os.path.expanduser("~/.cache/slipstream/jax")),
                   help="JAX persistent compilation cache directory ('' to disable)")


def _distributed_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-host (jax.distributed)", "run the same command in every process, each with "
                             "its own --process-id: the model spans all their devices, process 0 serves")
    g.add_argument("--coordinator-address",
                   default=flag_env("coordinator-address", os.environ.get("JAX_COORDINATOR_ADDRESS")),
                   help="host:port of process 0 (jax.distributed's coordinator; also JAX_COORDINATOR_ADDRESS)")
    g.add_argument("--num-processes", type=int,
                   default=int(flag_env("num-processes", os.environ.get("JAX_NUM_PROCESSES", 1))))
    g.add_argument("--process-id", type=int, default=int(flag_env("process-id", os.environ.get("JAX_PROCESS_ID", 0))))
    g.add_argument("--control-port", type=int, default=int(flag_env("control-port", 0)) or None,
                   help="process 0's port for the step lockstep (default: the coordinator's port + 1)")
    g.add_argument("--peer-timeout", type=float, default=float(flag_env("peer-timeout", 10)),
                   help="seconds of silence after which another process counts as lost: the survivors then "
                        "fail their requests and exit non-zero, so the orchestrator restarts the group")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slipstream", description="LLM inference server on JAX")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API (and gRPC)")
    _engine_flags(serve)
    serve.add_argument("--data-parallel", type=int, default=int(flag_env("data-parallel", 1)),
                       help="serve M replicas of the model behind one front end, replica r on local devices "
                            "[r*N, (r+1)*N) for N = --tensor-parallel, each with its own KV cache (so "
                            "--kv-cache-memory is per replica too); requests go by load and prefix-cache "
                            "affinity, and /metrics labels each replica's values")
    _distributed_flags(serve)
    serve.add_argument("--host", default=flag_env("host", "127.0.0.1"))
    serve.add_argument("--port", type=int, default=int(flag_env("port", 8000)))
    serve.add_argument("--grpc-port", type=int, default=int(flag_env("grpc-port", 0)), help="0 disables gRPC")
    serve.add_argument("--uds", default=flag_env("uds", "") or None, metavar="PATH",
                       help="serve HTTP on this unix socket instead of --host/--port (no TCP socket is opened); "
                            "a dead server's socket there is replaced, and the file is removed on exit")
    serve.add_argument("--grpc-uds", default=flag_env("grpc-uds", "") or None, metavar="PATH",
                       help="serve gRPC on this unix socket (PATH or unix:PATH) instead of --grpc-port")
    serve.add_argument("--uds-mode", type=parse_mode, default=parse_mode(flag_env("uds-mode", "0600")), metavar="MODE",
                       help="permissions of the socket files, octal (default 0600: this user only; 0660 lets "
                            "the group in, e.g. a proxy's)")
    serve.add_argument("--max-queue", type=int, default=int(flag_env("max-queue", 256)))
    serve.add_argument("--no-prefix-cache", action="store_true", default=bool(flag_env("no-prefix-cache", "")))
    serve.add_argument("--arrival-wait-ms", type=float, default=float(flag_env("arrival-wait-ms", 20)),
                       help="after a step that ends requests, with none waiting: how long the next step waits "
                            "for new ones (a client's next request, sent on the finish) before it starts "
                            "without them; backs off when none come; 0 = never wait")
    serve.add_argument("--speculative-config", type=parse_speculative, metavar="JSON",
                       default=parse_speculative(flag_env("speculative-config", "")),
                       help='speculative decoding, vLLM\'s form: {"method": "ngram", "num_speculative_tokens": 4, '
                            '"prompt_lookup_max": 4, "prompt_lookup_min": 2} (prompt lookup) or {"model": PATH, '
                            '"num_speculative_tokens": 4} (a draft model with the same vocabulary); off by default')
    serve.add_argument("--api-key", default=flag_env("api-key", None),
                       help="visible in `ps`: prefer --api-key-file or SLIPSTREAM_API_KEY")
    serve.add_argument("--api-key-file", default=flag_env("api-key-file", None),
                       help="read the API key from this file (one line), e.g. a mounted Kubernetes Secret")
    serve.add_argument("--max-requests-per-client", type=int, default=int(flag_env("max-requests-per-client", 0)),
                       help="queued plus running requests per client (API key, else the `user` field); the "
                            "excess gets 429; 0 = no limit")
    serve.add_argument("--served-model-name", default=flag_env("served-model-name", None))
    serve.add_argument("--pooling", default=flag_env("pooling", "auto"), choices=["auto", "last", "mean"],
                       help="/v1/embeddings: an input's embedding is its last token's hidden state (last) or the mean "
                            "of its tokens' (mean), after the final norm; auto: what the model directory's "
                            "sentence-transformers config (modules.json) declares, else last")
    serve.add_argument("--scheduling-policy", default=flag_env("scheduling-policy", "fcfs"),
                       choices=["fcfs", "priority"],
                       help="priority: requests may carry a `priority` (lower first; a more urgent request preempts the "
                            "least urgent running one when slots or KV pages run out); fcfs: first come, first served, "
                            "and a request's priority other than 0 is a 400")
    serve.add_argument("--reasoning-parser", default=flag_env("reasoning-parser", "auto"), choices=PARSERS,
                       help="chat replies' thinking (<think>...</think>) returned apart from the answer, as "
                            "reasoning_content and reasoning; auto: when the vocabulary has both tags as tokens "
                            "(Qwen3, QwQ, DeepSeek-R1 distills); deepseek_r1 and qwen3 are names for think")
    serve.add_argument("--tool-call-parser", default=flag_env("tool-call-parser", "auto"), choices=TOOL_CALL_PARSERS,
                       help="the syntax of chat tool calls, parsed into tool_calls and used by tool_choice required or "
                            "a named function: hermes (<tool_call>, Qwen), llama3_json (Llama 3.x), mistral "
                            "([TOOL_CALLS]), phi4_mini (functools[...]), pythonic ([f(a=1)]), or vLLM's names for them; auto: by the "
                            "vocabulary's markers and the chat template (hermes when it takes no tools, which the "
                            "system prompt then describes)")
    serve.add_argument("--shutdown-timeout", type=float, default=float(flag_env("shutdown-timeout", 30)),
                       help="seconds in-flight requests may run after SIGTERM (/ready answers 503 meanwhile)")
    serve.add_argument("--header-timeout", type=float, default=float(flag_env("header-timeout", 10)),
                       help="seconds a client has to send each request's headers")
    serve.add_argument("--body-timeout", type=float, default=float(flag_env("body-timeout", 30)),
                       help="seconds a client has to send a request body (408 after)")
    serve.add_argument("--max-body-size", type=parse_bytes, default=parse_bytes(flag_env("max-body-size", "1MiB")),
                       help="largest request body (413 above); also bounds a gRPC prompt")
    serve.add_argument("--max-images-per-request", type=int, default=int(flag_env("max-images-per-request", 8)),
                       help="images one chat request may carry (a vision-language model; 400 beyond)")
    serve.add_argument("--max-image-bytes", type=parse_bytes, default=parse_bytes(flag_env("max-image-bytes", "20MiB")),
                       help="one image's encoded size, from a data URL or fetched (400 above); a data URL also "
                            "counts against --max-body-size")
    serve.add_argument("--image-fetch-timeout", type=float, default=float(flag_env("image-fetch-timeout", 10)),
                       help="seconds to connect to an http(s) image URL, and for each read of it")
    serve.add_argument("--no-image-urls", action="store_true", default=bool(flag_env("no-image-urls", "")),
                       help="take images as data URLs (and base64) only: the server fetches no http(s) URL")
    serve.add_argument("--max-connections", type=int, default=int(flag_env("max-connections", 1024)),
                       help="open HTTP connections; requests beyond get 503")
    serve.add_argument("--no-web-ui", action="store_true", default=bool(flag_env("no-web-ui", "")),
                       help="don't serve the chat page at / (the API is unchanged)")
    serve.add_argument("--log-level", default=flag_env("log-level", "info"))
    add_lora_flags(serve)

    gen = sub.add_parser("generate", help="greedy continuation of one prompt, printed to stdout")
    _engine_flags(gen)
    _distributed_flags(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)

    # Listed for --help only: main() hands `bench ...` to server/bench before parsing, so serving
    # never imports the benchmark code and its flags are defined in one place.
    sub.add_parser("bench", add_help=False,
                   help="load-test a running OpenAI-compatible server (vllm bench serve's flags; bench --help)")
    return parser
