"""`slipstream serve` and `slipstream generate`: what the flags (server/flags.py) wire together. Logs and
progress bars go to stderr; `generate` writes only the generated text to stdout."""
from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os
import signal
import sys
import time

from slipstream.models.registry import DEFAULT_MODEL, architecture_presets
from slipstream.server.flags import build_parser
from slipstream.server.lora import build_registry, lora_slots
from slipstream.server.startup_checks import check_args
from slipstream.server.unix_socket import check_path, strip_scheme

log = logging.getLogger("slipstream")


def build_engine(args: argparse.Namespace, *, max_slots: int | None = None):
    """Load, optionally quantize, and compile: (engine, tokenizer, model_path)."""
    engines, tokenizer, path = build_engines(args, max_slots=max_slots)
    return engines[0], tokenizer, path


def build_engines(args: argparse.Namespace, *, max_slots: int | None = None, data_parallel: int = 1):
    """Load (once), optionally quantize, and compile one engine per data-parallel replica, each on its
    own --tensor-parallel local devices: (engines, tokenizer, model_path)."""
    from slipstream.engine.device import executables
    from slipstream.engine.device.compile_count import enable_compilation_cache
    from slipstream.server.device_info import device_summary, kernel_summary
    from slipstream.engine.device.runner import EngineConfig, JaxEngine
    from slipstream.engine.device.sharding import replica_devices
    from slipstream.models.loader import load_model, read_gguf
    from slipstream.models.registry import load_dummy, load_tokenizer, resolve_model
    from slipstream.quantization.weights import QUANTIZED_MODES

    enable_compilation_cache(args.compile_cache)
    executables.enable(args.compile_cache)  # and whole programs: a warm start skips tracing too
    progress = sys.stderr.isatty()
    log.info("device: %s", device_summary())
    path = resolve_model(args.model, args.load_format)
    config = EngineConfig(max_slots=max_slots or args.max_slots, page_size=args.page_size,
                          max_seq_len=args.max_seq_len, kv_cache_memory=args.kv_cache_memory,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, quantize=args.quantize,
                          tensor_parallel=args.tensor_parallel, max_loras=lora_slots(args),
                          max_lora_rank=getattr(args, "max_lora_rank", 64),
                          prompt_weights=getattr(args, "prompt_weights", "auto"))
    # data parallel: each replica's devices, checked before the slow load (one replica: the default ones)
    slices = replica_devices(args.tensor_parallel, data_parallel) if data_parallel > 1 else [None]
    start = time.perf_counter()
    mode = config.weight_mode()
    quantize = mode if mode in QUANTIZED_MODES else "none"
    if args.load_format == "dummy":  # drawn tensor by tensor, int8 ones directly: no float model either
        # every mode drawn already quantized (the TPU's int8 layer by layer): no float stack exists
        model_cfg, model = load_dummy(path, dtype=config.activation_dtype(), quantize=mode, progress=progress)
        tokenizer = load_tokenizer(path)
    else:
        # group-wise int8 is built tensor by tensor while loading: the float weights never exist whole
        reader = None if os.path.isdir(path) else read_gguf(path)  # parsed once for weights and tokenizer
        model_cfg, model = load_model(path, dtype="float32", progress=progress, quantize=quantize, reader=reader)
        tokenizer = load_tokenizer(path, reader)
        del reader
    hybrid = mode == "q8_0-a16" and config.prompt_w16()
    log.info("loaded %s in %.1fs (weights: %s%s%s)", path, time.perf_counter() - start, mode,
             "; prompt tokens on a second int8-channel-w16 copy of the layers (--prompt-weights same: one form)"
             if hybrid else "", ", random: --load-format dummy" if args.load_format == "dummy" else "")
    engines = []
    for replica, devices in enumerate(slices):
        engine = JaxEngine(model_cfg, model, config, eos_token_ids=tuple(tokenizer.eos_token_ids) or (),
                           progress=progress, devices=devices)
        engines.append(engine)
        where = "" if devices is None else f"replica {replica} on {', '.join(map(str, devices))}: "
        log.info("%scompiled %d programs in %.1fs (%d loaded whole from the compile cache; %.1fs tracing or loading; "
                 "%d %s KV pages of %d tokens; steps of up to %d tokens)", where, engine.num_programs,
                 engine.compile_seconds, engine.programs_loaded, engine.lower_seconds, engine.num_pages,
                 engine.kv_dtype.name, engine.page_size, engine.max_num_batched_tokens)
    del model  # each engine holds its own (rounded, per-layer) copy of the weights, on its devices
    log.info("kernels on %s", kernel_summary())
    return engines, tokenizer, path


def build_draft_proposer(args: argparse.Namespace, engines: list, *, multihost: bool):
    """--speculative-config's draft model as a proposer: its own engine (paged KV, slots) with the
    target's settings on the target's devices; None for n-gram or no speculation."""
    spec = args.speculative_config
    if spec is None or spec.model is None:
        return None
    if len(engines) > 1 or multihost:
        raise ValueError("speculative config: a draft model serves one replica on one host; drop --data-parallel "
                         'and --num-processes, or use {"method": "ngram"}')
    from slipstream.engine.device.draft import DraftModelProposer
    from slipstream.engine.device.runner import JaxEngine
    from slipstream.models.loader import load_model
    from slipstream.models.registry import load_dummy, resolve_model
    from slipstream.quantization.weights import QUANTIZED_MODES

    target = engines[0]
    path = resolve_model(spec.model, args.load_format)
    mode = target.config.weight_mode()
    quantize = mode if mode in QUANTIZED_MODES else "none"
    if args.load_format == "dummy":
        cfg, model = load_dummy(path, dtype=target.config.activation_dtype(), quantize=quantize)
    else:
        cfg, model = load_model(path, dtype="float32", quantize=quantize)
    # its rows are all generated tokens (drafts): the hybrid's prompt copy of the weights would go unused
    config = dataclasses.replace(target.config, prompt_weights="same") if target.prompt_w16 else target.config
    engine = JaxEngine(cfg, model, config, progress=sys.stderr.isatty())
    log.info("draft model %s: compiled %d programs in %.1fs (%d KV pages)", path, engine.num_programs,
             engine.compile_seconds, engine.num_pages)
    return DraftModelProposer(engine, target.vocab_size)


def join_group(args: argparse.Namespace):
    """Multi-host: join the process group before anything touches a device; (config, the group's
    secret), or None for one process."""
    if args.num_processes == 1 and args.process_id == 0:
        return None
    from slipstream.engine.distributed.multihost import DistributedConfig, initialize

    if not args.coordinator_address:
        raise ValueError("--num-processes > 1 needs --coordinator-address host:port (process 0's)")
    dist = DistributedConfig(coordinator_address=args.coordinator_address, num_processes=args.num_processes,
                             process_id=args.process_id, control_port=args.control_port,
                             peer_timeout_s=args.peer_timeout)
    if getattr(args, "data_parallel", 1) != 1:
        raise ValueError("multi-host serves one model replica over the whole group: drop --data-parallel")
    token = initialize(dist)
    import jax

    if args.tensor_parallel != jax.device_count():
        raise ValueError(f"multi-host: --tensor-parallel must span the group's {jax.device_count()} devices "
                         f"({jax.process_count()} processes of {jax.local_device_count()}), got {args.tensor_parallel}")
    return dist, token


def lead_group(engine, joined):
    """Process 0: wait for every worker, then drive them in lockstep; (engine, group)."""
    from slipstream.engine.distributed import multihost

    dist, token = joined
    group = multihost.Group(dist, token, on_lost=[multihost.exit_after(2.0)])
    group.accept_workers()
    return multihost.LockstepEngine(engine, group), group


def run_worker(engine, tokenizer, joined) -> int:
    """A worker: replay process 0's engine calls until it stops (exit 0) or goes away (exit 1)."""
    from slipstream.engine.distributed import multihost

    dist, token = joined
    # SIGTERM reaches the whole group at once: process 0 drains, and this process must run its steps
    # until process 0 says stop (or goes away)
    signal.signal(signal.SIGTERM, lambda *_: log.info("SIGTERM: waiting for process 0 to finish"))
    leader = multihost.Leader(dist, token, on_lost=[multihost.exit_after(0.0)],
                              grammar=multihost.worker_grammars(tokenizer, engine))
    print(f"slipstream: process {dist.process_id} of {dist.num_processes} running process 0's steps",
          file=sys.stderr, flush=True)
    try:
        multihost.serve_worker(engine, leader)
    except Exception:  # noqa: BLE001 - out of step with process 0: the group must restart
        log.exception("worker failed")
        multihost.exit_now(1)
    multihost.exit_now(0)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from slipstream.engine.request import Request, SamplingParams
    from slipstream.engine.scheduler import OutputProcessor, Scheduler

    joined = join_group(args)
    engine, tokenizer, _ = build_engine(args, max_slots=1)
    group = None
    if joined is not None:
        if joined[0].process_id != 0:
            return run_worker(engine, tokenizer, joined)
        engine, group = lead_group(engine, joined)
    prompt = args.prompt
    if args.chat:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    ids = tokenizer.encode(prompt, add_special_tokens=not args.chat)
    scheduler = Scheduler(engine, OutputProcessor(tokenizer))
    scheduler.start()
    try:
        start = time.perf_counter()
        stream = scheduler.submit(Request(ids, SamplingParams(temperature=0.0, max_tokens=args.max_tokens)))
        completion = stream.result()
        elapsed = time.perf_counter() - start
        if completion.error:
            print(f"slipstream: error: {completion.error}", file=sys.stderr)
            return 1
        sys.stdout.write(completion.text + "\n")
        pieces = len(completion.token_ids)
        log.info("%d tokens in %.2fs (%.1f tok/s)", pieces, elapsed, pieces / max(elapsed, 1e-9))
    finally:
        scheduler.shutdown(timeout=5)
        if group is not None:
            from slipstream.engine.distributed.multihost import exit_now

            group.close()
            exit_now(1 if group.lost else 0)
    return 0


def image_inputs(args: argparse.Namespace, engine, path: str, tokenizer):
    """A vision-language model's image inputs (the processor its directory names, the limits the flags set; Idefics3
    needs the tokenizer); None for a text-only model."""
    from slipstream.server.images import ImageInputs, ImageLimits

    limits = ImageLimits(max_images=args.max_images_per_request, max_image_bytes=args.max_image_bytes,
                         fetch_timeout_s=args.image_fetch_timeout, fetch_urls=not args.no_image_urls)
    folder = path if os.path.isdir(path) else os.path.dirname(path) if path.endswith("config.json") else None
    if engine.model_cfg is None:  # MockEngine's tests: no model
        return None
    return ImageInputs.for_model(engine.model_cfg, folder, limits, tokenizer)


def cmd_serve(args: argparse.Namespace) -> int:
    from slipstream.engine.distributed.replicas import ReplicaSet
    from slipstream.engine.scheduler import OutputProcessor, Scheduler, SchedulerConfig
    from slipstream.server.app import create_app
    from slipstream.server.http_server import make_server
    from slipstream.server.embeddings import pooling_of
    from slipstream.server.fim import fim_format
    from slipstream.server.reasoning import reasoning_format
    from slipstream.server.service import Service, ServiceConfig
    from slipstream.server.tool_formats import tool_format

    started = time.monotonic()
    uds, grpc_uds = check_socket_paths(args)  # before the slow load
    joined = join_group(args)
    engines, tokenizer, path = build_engines(args, data_parallel=args.data_parallel)
    engine = engines[0]
    group = None
    if joined is not None:
        if joined[0].process_id != 0:
            return run_worker(engine, tokenizer, joined)
        engine, group = lead_group(engine, joined)  # not ready before every worker is
    config = SchedulerConfig(max_queue=args.max_queue, enable_prefix_cache=not args.no_prefix_cache,
                             arrival_wait_ms=args.arrival_wait_ms, speculative=args.speculative_config,
                             proposer=build_draft_proposer(args, engines, multihost=group is not None))
    # one scheduler per data-parallel replica behind one front end (`engine`: replica 0's, as served)
    scheduler = ReplicaSet([Scheduler(e, OutputProcessor(tokenizer), config) for e in [engine, *engines[1:]]])
    named = args.model == DEFAULT_MODEL or args.model in architecture_presets()
    name = args.served_model_name or (args.model if named else os.path.basename(os.path.normpath(args.model)))
    service = Service(scheduler, engine, tokenizer,
                      ServiceConfig(model_name=name, max_prompt_bytes=args.max_body_size,
                                    max_requests_per_client=args.max_requests_per_client,
                                    priority_scheduling=args.scheduling_policy == "priority"),
                      lora=build_registry(args, engine), reasoning=reasoning_format(tokenizer, args.reasoning_parser),
                      fim=fim_format(tokenizer), images=image_inputs(args, engines[0], path, tokenizer),
                      tool_format=tool_format(tokenizer, args.tool_call_parser))
    log.info("tool calls: %s (--tool-call-parser %s)", service.tool_format.describe(), args.tool_call_parser)
    if service.reasoning is not None:
        log.info("reasoning: chat replies' %s...%s returned as reasoning_content (--reasoning-parser %s)",
                 service.reasoning.open, service.reasoning.close, args.reasoning_parser)
    pooling = args.pooling if args.pooling != "auto" else pooling_of(path) or "last"
    app = create_app(service, api_key=args.api_key, max_body_bytes=args.max_body_size,
                     body_timeout_s=args.body_timeout, web_ui=not args.no_web_ui,
                     lora_updates=args.enable_lora_runtime_updates, pooling=pooling)
    if group is not None:  # a lost peer fails the requests, and /ready answers 503
        group.add_handler(scheduler.abort)
    # Start-up made many long-lived objects (traced programs, the tokenizer, module state):
    # keep the collector from re-scanning them on every collection while serving.
    gc.collect()
    gc.freeze()
    scheduler.start()
    server = make_server(app, args.host, args.port, shutdown_timeout_s=args.shutdown_timeout,
                         log_level=args.log_level, started_at=started, grpc_port=args.grpc_port,
                         header_timeout_s=args.header_timeout, max_connections=args.max_connections,
                         uds=uds, grpc_uds=grpc_uds, uds_mode=args.uds_mode)
    grpc_note = (f", gRPC on unix:{grpc_uds}" if grpc_uds else
                 f", gRPC on {args.host}:{args.grpc_port}" if args.grpc_port else "")
    where = f"unix:{uds}" if uds else f"http://{args.host}:{args.port}"
    # a browser cannot open the wildcard address: link to this machine instead
    page_host = {"0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(args.host, args.host)
    page = "" if args.no_web_ui or uds else f"; chat page: http://{page_host}:{args.port}/"
    server.on_started = lambda: print(f"slipstream: ready on {where}{grpc_note} (model {name}, "
                                      f"{time.monotonic() - started:.1f}s to ready){page}", file=sys.stderr, flush=True)

    # uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown; a drained shutdown is a clean exit
    def clean_exit(signum, frame):
        sys.exit(1 if server.engine_failed else 0)

    signal.signal(signal.SIGTERM, clean_exit)
    signal.signal(signal.SIGINT, clean_exit)
    try:
        server.run()
    finally:
        if group is not None:  # workers exit 0 on stop; exit_now says why not a plain exit
            from slipstream.engine.distributed.multihost import exit_now

            group.close()
            exit_now(1 if server.engine_failed or group.lost else 0)
    return 1 if server.engine_failed else 0


def check_socket_paths(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """--uds and --grpc-uds as paths, checked (ValueError naming the flag) before the model loads."""
    uds = check_path(strip_scheme(args.uds), "--uds") if args.uds is not None else None
    grpc_uds = check_path(strip_scheme(args.grpc_uds), "--grpc-uds") if args.grpc_uds is not None else None
    if grpc_uds is not None and args.grpc_port:
        raise ValueError(f"--grpc-port {args.grpc_port} and --grpc-uds {grpc_uds}: choose one")
    if uds is not None and grpc_uds is not None and os.path.abspath(uds) == os.path.abspath(grpc_uds):
        raise ValueError(f"--uds and --grpc-uds are both {uds}: each needs its own path")
    return uds, grpc_uds


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the benchmark client runs no model
        from slipstream.server.bench.run import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
    except ValueError as e:
        print(f"slipstream: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=getattr(logging, str(getattr(args, "log_level", "info")).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("jax").setLevel(logging.WARNING)  # "no TPU found" notices on CPU hosts
    try:
        if args.command == "generate":
            return cmd_generate(args)
        return cmd_serve(args)
    except (OSError, ValueError) as e:  # a missing model file, a busy port, a bad socket path
        print(f"slipstream: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
