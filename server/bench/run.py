"""`slipstream bench` flags (named as in `vllm bench serve`), arrivals, the concurrency cap, warm-up and output.

The table goes to stdout; progress and notes go to stderr.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import sys
import time
import uuid
from datetime import datetime
from typing import Any, AsyncIterator, Sequence

import numpy as np

DETAILED_FIELDS = ("request_ids", "input_lens", "output_lens", "start_times", "ttfts", "itls", "latencies",
                   "generated_texts", "errors")


def add_arguments(p: argparse.ArgumentParser) -> None:
    server = p.add_argument_group("server")
    server.add_argument("--backend", "--endpoint-type", dest="backend", choices=["openai", "openai-chat"],
                        default=None, help="request format (default: openai-chat if --endpoint ends in "
                                           "chat/completions, else openai)")
    server.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000, or unix:PATH for a server on "
                                                         "a unix socket (serve --uds PATH); overrides --host/--port")
    server.add_argument("--unix-socket", default=None, metavar="PATH",
                        help="connect through this unix socket, as curl --unix-socket does (the URL then only "
                             "names the Host header)")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--endpoint", default="/v1/completions")
    server.add_argument("--model", default=None, help="model id sent in requests (default: the server's first "
                                                      "model from /v1/models)")
    server.add_argument("--served-model-name", default=None, help="name sent as 'model' if not --model")
    server.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME",
                        help="LoRA adapters the server has loaded: each request names one of them, drawn at random "
                             "(seeded by --seed), as its model")
    server.add_argument("--tokenizer", default=None,
                        help="preset name, HF directory or .gguf file whose tokenizer counts tokens "
                             "(default: --model if it is one of those, else the default model)")
    server.add_argument("--keep-alive", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse connections between requests, as vllm bench serve and the OpenAI SDK do "
                             "(default; --no-keep-alive: a fresh connection per request)")
    server.add_argument("--ready-check-timeout-sec", type=int, default=0,
                        help="retry the first prompt for up to this long before starting (0: no check)")

    data = p.add_argument_group("dataset")
    data.add_argument("--dataset-name", default="random", choices=["random", "sharegpt", "prefix", "prefix_repetition",
                                                                  "custom", "repeat"])
    data.add_argument("--dataset-path", default=None,
                      help="ShareGPT-format JSON file (sharegpt), or JSONL of {\"prompt\": ...} lines (custom)")
    data.add_argument("--num-prompts", type=int, default=1000)
    data.add_argument("--input-len", type=int, default=None, help="alias of --random-input-len")
    data.add_argument("--output-len", type=int, default=None, help="sets every dataset's output length")
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="lengths uniform in [len*(1-r), len*(1+r)]")
    data.add_argument("--random-prefix-len", type=int, default=0, help="tokens of one prefix shared by all prompts")
    data.add_argument("--sharegpt-output-len", type=int, default=None)
    data.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    data.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    data.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    data.add_argument("--prefix-repetition-output-len", type=int, default=128)
    data.add_argument("--repeat-passage-len", type=int, default=200,
                      help="repeat: tokens of the passage each prompt asks to repeat (output: as long, or --output-len)")
    data.add_argument("--custom-output-len", type=int, default=256,
                      help="custom: output tokens per request (-1: each line's \"output_tokens\")")
    data.add_argument("--skip-chat-template", action="store_true",
                      help="custom: send each prompt as it is, not wrapped in the model's chat template")
    data.add_argument("--disable-shuffle", action="store_true", help="custom: keep the file's order")
    data.add_argument("--no-oversample", action="store_true",
                      help="custom: fail rather than repeat prompts when the file has fewer than --num-prompts")

    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="requests/s (default inf: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of arrival gaps: 1 is Poisson, <1 burstier, >1 more even")
    load.add_argument("--max-concurrency", type=int, default=None)
    load.add_argument("--num-warmups", type=int, default=0, help="requests sent (and not counted) before timing")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--disable-tqdm", action="store_true")
    load.add_argument("--request-id-prefix", default=f"bench-{uuid.uuid4().hex[:8]}-",
                      help="request i is sent with the header x-request-id: PREFIX + i")

    sampling = p.add_argument_group("sampling")
    sampling.add_argument("--ignore-eos", action="store_true")
    sampling.add_argument("--temperature", type=float, default=None, help="default: the server's (0 is greedy)")
    sampling.add_argument("--top-p", type=float, default=None)
    sampling.add_argument("--top-k", type=int, default=None)

    out = p.add_argument_group("output")
    out.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    out.add_argument("--metric-percentiles", default="90,99")
    out.add_argument("--goodput", nargs="+", default=None, help="SLOs as KEY:VALUE in ms, KEY in ttft, tpot, e2el")
    out.add_argument("--save-result", action="store_true")
    out.add_argument("--save-detailed", action="store_true", help="keep per-request lists in the JSON")
    out.add_argument("--result-dir", default=None)
    out.add_argument("--result-filename", default=None)
    out.add_argument("--label", default=None)
    out.add_argument("--metadata", nargs="*", default=None, help="KEY=VALUE pairs stored in the JSON")


def load_tokenizer(name: str):
    from slipstream.models.registry import tokenizer_for

    return tokenizer_for(name)


def build_requests(args: argparse.Namespace, tok, num_prompts: int) -> list:
    from slipstream.server.bench import datasets

    name = "prefix" if args.dataset_name == "prefix_repetition" else args.dataset_name
    if name not in ("sharegpt", "custom") and args.dataset_path:
        raise ValueError(f"--dataset-path is for --dataset-name sharegpt or custom, not {args.dataset_name}")
    if name == "random":
        return datasets.random_dataset(tok, num_prompts=num_prompts, input_len=args.random_input_len,
                                       output_len=args.random_output_len, range_ratio=args.random_range_ratio,
                                       prefix_len=args.random_prefix_len, seed=args.seed)
    if name == "prefix":
        return datasets.prefix_dataset(tok, num_prompts=num_prompts, prefix_len=args.prefix_repetition_prefix_len,
                                       suffix_len=args.prefix_repetition_suffix_len,
                                       num_prefixes=args.prefix_repetition_num_prefixes,
                                       output_len=args.prefix_repetition_output_len, seed=args.seed)
    if name == "repeat":
        return datasets.repeat_dataset(tok, num_prompts=num_prompts, passage_len=args.repeat_passage_len,
                                       output_len=args.output_len, seed=args.seed,
                                       chat_template=not args.skip_chat_template)
    if not args.dataset_path:
        raise ValueError(f"--dataset-name {name} needs --dataset-path FILE")
    if name == "custom":
        return datasets.custom_dataset(tok, args.dataset_path, num_prompts=num_prompts, output_len=args.custom_output_len,
                                       seed=args.seed, shuffle=not args.disable_shuffle,
                                       chat_template=not args.skip_chat_template, oversample=not args.no_oversample)
    return datasets.sharegpt_dataset(tok, args.dataset_path, num_prompts=num_prompts,
                                     output_len=args.sharegpt_output_len, seed=args.seed)


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send time of each request, in seconds after the start, as `vllm bench serve` draws them: one gamma gap
    per request from numpy's legacy generator seeded with --seed (vLLM seeds the global one and draws nothing
    else from it first for the random, sharegpt and custom datasets), cumulated and scaled so the last lands at
    n / rate. So the same --seed sends at the same moments in both clients, and their runs load a server alike."""
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be positive, got {burstiness}")
    if rate == float("inf"):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"--request-rate must be positive, got {rate}")
    if burstiness == float("inf"):
        gaps = np.full(n, 1.0 / rate)
    else:
        draw = np.random.RandomState(seed)
        gaps = np.array([draw.gamma(shape=burstiness, scale=1.0 / (rate * burstiness)) for _ in range(n)])
    offsets = np.cumsum(gaps)
    return (offsets * (n / rate) / offsets[-1]).tolist()


async def _arrivals(items: Sequence, offsets: Sequence[float]) -> AsyncIterator:
    start = time.perf_counter()
    for item, offset in zip(items, offsets):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        yield item


def server_address(args: argparse.Namespace) -> tuple[str, str | None]:
    """(base URL, unix socket path or None) from --base-url (unix:PATH), --host/--port and --unix-socket."""
    from slipstream.server.unix_socket import strip_scheme

    base_url, path = args.base_url or f"http://{args.host}:{args.port}", args.unix_socket
    if base_url.startswith("unix:"):
        if path is not None:
            raise ValueError("--base-url unix:... and --unix-socket both name a socket: give one")
        base_url, path = "http://localhost", strip_scheme(base_url)
    if path is not None and not os.path.exists(path):
        raise ValueError(f"unix socket {path!r} does not exist (is the server running with --uds {path}?)")
    return base_url.rstrip("/"), path


async def _first_model(client, base_url: str, where: str) -> str:
    async with client.get(f"{base_url}/v1/models") as response:
        response.raise_for_status()
        data = (await response.json()).get("data") or []
    if not data:
        raise ValueError(f"{where}/v1/models lists no model; pass --model")
    return data[0]["id"]


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    from slipstream.server.bench import client as http
    from slipstream.server.bench import metrics as m
    from slipstream.models.registry import DEFAULT_MODEL

    if args.max_concurrency is not None and args.max_concurrency <= 0:
        raise ValueError("--max-concurrency must be greater than 0")
    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.sharegpt_output_len = args.prefix_repetition_output_len = args.output_len
        args.custom_output_len = args.output_len
    base_url, unix_socket = server_address(args)
    where = f"unix:{unix_socket}" if unix_socket else base_url  # for messages
    url = base_url + args.endpoint
    backend = args.backend or ("openai-chat" if args.endpoint.rstrip("/").endswith("chat/completions") else "openai")
    kind = "chat" if backend == "openai-chat" else "completions"
    goodput = m.parse_goodput(args.goodput)
    metric_names = [x.strip() for x in args.percentile_metrics.split(",") if x.strip()]
    percentiles = [float(x) for x in args.metric_percentiles.split(",") if x.strip()]
    unknown = set(metric_names) - set(m.METRICS)
    if unknown:
        raise ValueError(f"--percentile-metrics takes {', '.join(m.METRICS)}; got {', '.join(sorted(unknown))}")

    async with (http.new_http_client(keep_alive=args.keep_alive, max_connections=args.max_concurrency,
                                     unix_socket=unix_socket) as client,
                http.new_http_client(unix_socket=unix_socket) as fresh):
        model_id = args.model or args.served_model_name or await _first_model(client, base_url, where)
        tokenizer_id = args.tokenizer or model_id
        try:
            tok = load_tokenizer(tokenizer_id)
        except FileNotFoundError:
            if args.tokenizer:
                raise
            tokenizer_id = DEFAULT_MODEL
            print(f"note: {model_id!r} is not a local model; counting tokens with {DEFAULT_MODEL}'s tokenizer "
                  "(pass --tokenizer to choose)", file=sys.stderr)
            tok = load_tokenizer(tokenizer_id)
        # The ready check's and the warm-ups' prompts are extra ones, so the server's prefix cache holds none of
        # the measured prompts. (vllm bench serve sends its first measured prompt for both: that request's
        # prefill then comes from the cache, and with everything sent at once the first wave, which sets p99
        # TTFT, has one prefill fewer.)
        n_check = 1 if args.ready_check_timeout_sec > 0 else 0
        requests = build_requests(args, tok, args.num_prompts + args.num_warmups + n_check)
        requests, warmups, check = (requests[:args.num_prompts], requests[args.num_prompts:][:args.num_warmups],
                                    requests[args.num_prompts + args.num_warmups:])
        sampling = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p),
                                      ("top_k", args.top_k)) if v is not None}
        if "temperature" not in sampling:
            print("note: no --temperature given; the server's default applies (use --temperature 0 for greedy)",
                  file=sys.stderr)

        pick = random.Random(args.seed)

        def payload(req):
            model = pick.choice(args.lora_modules) if args.lora_modules else model_id
            return http.build_payload(kind, model, req, ignore_eos=args.ignore_eos, sampling=sampling)

        semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else contextlib.nullcontext()

        async def limited(req, bar, request_id=None):
            async with semaphore:
                out = await http.send_request(client, url, kind, payload(req), req.prompt_len, request_id, fresh)
            if bar is not None:
                bar.update(1)
            return out

        if args.ready_check_timeout_sec > 0:
            deadline = time.monotonic() + args.ready_check_timeout_sec
            while True:
                test = await http.send_request(client, url, kind, payload(check[0]), check[0].prompt_len, None, fresh)
                if test.success:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{where}{args.endpoint} did not answer within {args.ready_check_timeout_sec}s: {test.error}")
                await asyncio.sleep(2)
        if args.num_warmups > 0:
            print(f"warming up with {args.num_warmups} requests", file=sys.stderr)
            warm = await asyncio.gather(*(limited(req, None) for req in warmups))
            failed = [o.error for o in warm if not o.success]
            if failed:
                raise RuntimeError(f"{len(failed)} of {args.num_warmups} warm-up requests failed: {failed[0]}")

        offsets = arrival_offsets(len(requests), args.request_rate, args.burstiness, args.seed)
        # As vllm bench serve does: no full collection of the long-lived heap (tokenizer, prompts) mid-run
        gc.collect()
        gc.freeze()
        bar = None if args.disable_tqdm else tqdm(total=len(requests), file=sys.stderr, desc="requests")
        start = time.perf_counter()
        tasks = [asyncio.create_task(limited(req, bar, f"{args.request_id_prefix}{i}"))
                 async for i, req in _arrivals(list(enumerate(requests)), offsets)]
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        gc.unfreeze()
        if bar is not None:
            bar.close()

    body = m.calculate(outputs, duration, count_tokens=lambda t: len(tok.encode(t, add_special_tokens=False)),
                       percentiles=percentiles, metrics=metric_names, goodput=goodput)
    print(m.format_table(body, metrics=metric_names, percentiles=percentiles,
                         max_concurrency=args.max_concurrency, request_rate=args.request_rate))
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": backend, "backend": backend,
        "label": args.label, "model_id": model_id, "tokenizer_id": tokenizer_id, "num_prompts": len(requests),
        "dataset_name": args.dataset_name,
        "request_rate": args.request_rate if args.request_rate < float("inf") else "inf",
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "ignore_eos": args.ignore_eos,
        **_metadata(args.metadata), **body,
    }
    return result


def _metadata(items: Sequence[str] | None) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--metadata takes KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def result_path(args: argparse.Namespace, result: dict[str, Any]) -> str:
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    name = args.result_filename or (f"{args.label or result['backend']}-{args.request_rate}qps{concurrency}-"
                                    f"{os.path.basename(str(result['model_id']).rstrip('/'))}-{result['date']}.json")
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    return name


def run(args: argparse.Namespace) -> int:
    result = asyncio.run(benchmark(args))
    if args.save_result:
        if not args.save_detailed:
            for key in DETAILED_FIELDS:
                result.pop(key, None)
        path = result_path(args, result)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f)
        print(f"saved {path}", file=sys.stderr)
    return 0 if result["completed"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slipstream bench", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        import aiohttp  # noqa: F401 - the transport; an optional dependency of the serving install
    except ModuleNotFoundError:
        print("slipstream bench: error: the benchmark client needs aiohttp: pip install 'slipstream[bench]'",
              file=sys.stderr)
        return 2
    try:
        return run(args)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"slipstream bench: error: {e}", file=sys.stderr)
        return 2
