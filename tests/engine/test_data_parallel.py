"""Data parallel. Routing (engine/replicas.py) on MockEngine schedulers, without JAX: load spread,
prefix-cache affinity, cancel reaching the request's replica, a failed replica. Then the JAX engine
on 8 virtual CPU devices, in one subprocess (XLA_FLAGS must be set before JAX starts): replicas at
TP=1 x DP=2 and TP=2 x DP=2 give the single-device greedy tokens, on disjoint devices."""
from __future__ import annotations

import contextlib
import dataclasses
import os

import pytest

from slipstream.engine.mock_engine import MockEngine
from slipstream.engine.distributed.replicas import ReplicaSet
from slipstream.engine.request import FinishReason
from slipstream.engine.scheduler import EngineUnavailable, OutputProcessor, Scheduler, SchedulerConfig
from tests.conftest import virtual_devices
from tests.engine.scheduler_helpers import WAIT, ByteTokenizer, chain, req, wait_for


@contextlib.contextmanager
def replica_set(*engines: MockEngine, **kwargs):
    rs = ReplicaSet([Scheduler(e, OutputProcessor(ByteTokenizer()), SchedulerConfig()) for e in engines], **kwargs)
    rs.start()
    try:
        yield rs
    finally:
        rs.shutdown(timeout=5)


def prompt_tokens(rs: ReplicaSet) -> list[int]:
    return [s.prompt_tokens for s in rs.replica_stats()]


def test_requests_spread_by_load_and_take_turns_on_ties():
    with replica_set(MockEngine(step_sleep_s=0.005), MockEngine(step_sleep_s=0.005)) as rs:
        assert rs.ready
        # submitted back to back: each goes where fewer requests run or wait; equal loads take turns
        streams = [rs.submit(req([40 + j for j in range(n)], 4)) for n in (1, 2, 4, 8)]
        assert prompt_tokens(rs) == [1 + 4, 2 + 8]
        assert [s.result(timeout=WAIT).token_ids for s in streams] == [
            chain([40 + n - 1], 4) for n in (1, 2, 4, 8)]
        for n in (3, 5):  # idle: still taking turns, one after the other
            rs.submit(req([90] * n, 2)).result(timeout=WAIT)
        assert prompt_tokens(rs) == [5 + 3, 10 + 5]
        assert rs.stats().prompt_tokens == 1 + 2 + 4 + 8 + 3 + 5


def test_prefix_affinity_unless_that_replica_is_much_busier():
    page = 4
    shared = list(range(30, 30 + 3 * page))  # three full pages
    engines = [MockEngine(page_size=page, max_slots=8, num_pages=256, step_sleep_s=0.005) for _ in range(2)]
    with replica_set(*engines, affinity_slack=2) as rs:
        rs.submit(req(shared + [1], 2)).result(timeout=WAIT)   # replica 0 (first turn) caches 3 pages
        assert prompt_tokens(rs) == [13, 0]
        # equal loads and replica 1's turn, but replica 0 holds the prefix
        rs.submit(req(shared + [2, 3], 2)).result(timeout=WAIT)
        assert prompt_tokens(rs) == [13 + 14, 0]
        assert [s.prefix_hit_tokens for s in rs.replica_stats()] == [3 * page, 0]
        # longer requests with the prefix stay with it while replica 0 has at most 2 more than replica 1
        held = [rs.submit(req(shared + [10 + i], 100)) for i in range(3)]
        assert prompt_tokens(rs) == [27 + 3 * 13, 0]
        # a fourth would make it 4 to 0: it goes to the idle replica, prefix or not
        held.append(rs.submit(req(shared + [20], 100)))
        assert prompt_tokens(rs) == [66, 13]
        assert [s.running + s.waiting for s in rs.replica_stats()] == [3, 1]
        for stream in held:
            stream.cancel()


def test_cancel_reaches_the_replica_holding_the_request():
    with replica_set(MockEngine(step_sleep_s=0.005), MockEngine(step_sleep_s=0.005)) as rs:
        first, second = rs.submit(req([40], 100)), rs.submit(req([50], 20))
        assert prompt_tokens(rs) == [1, 1]
        wait_for(lambda: [s.running for s in rs.replica_stats()] == [1, 1])
        rs.cancel(first.request_id)
        rs.cancel("no-such-request")  # unknown ids are ignored, as by one scheduler
        done = first.result(timeout=WAIT)
        assert done.finish_reason is FinishReason.CANCELLED and len(done.token_ids) < 100
        assert second.result(timeout=WAIT).token_ids == chain([50], 20)
        assert [s.cancellations for s in rs.replica_stats()] == [1, 0]
        # request ids are unique across the replicas, not only within one
        kept = rs.submit(req([60], 100))
        with pytest.raises(ValueError, match="already in flight"):
            rs.submit(dataclasses.replace(req([61], 2), request_id=kept.request_id))
        kept.cancel()


def test_a_failed_replica_fails_its_requests_and_readiness_while_the_other_serves():
    healthy, failing = MockEngine(step_sleep_s=0.002), MockEngine(fail_after_steps=3, step_sleep_s=0.002)
    with replica_set(healthy, failing) as rs:
        kept = rs.submit(req([40], 40))     # replica 0
        lost = rs.submit(req([50], 40))     # replica 1: its engine fails at its fourth step
        done = lost.result(timeout=WAIT)
        assert done.finish_reason is FinishReason.ERROR and "engine failed" in done.error
        assert not rs.ready and rs.replicas[0].ready
        assert kept.result(timeout=WAIT).token_ids == chain([40], 40)
        # new requests go to the replica that still works
        assert [rs.submit(req([60 + i], 3)).result(timeout=WAIT).token_ids for i in range(3)] == [
            chain([60 + i], 3) for i in range(3)]
        assert prompt_tokens(rs) == [4, 1]
        assert rs.stats().finished == {"length": 4, "error": 1}
    with pytest.raises(EngineUnavailable, match="not accepting"):
        rs.submit(req([1], 1))  # shut down: the first replica's own reason


def test_abort_fails_every_replicas_requests():
    """What a lost multi-host peer does to the front end (Scheduler.abort), across replicas."""
    with replica_set(MockEngine(step_sleep_s=0.005), MockEngine(step_sleep_s=0.005)) as rs:
        streams = [rs.submit(req([40], 100)), rs.submit(req([50], 100))]
        assert prompt_tokens(rs) == [1, 1]
        rs.abort("peer lost")
        assert [(c.finish_reason, c.error) for c in (s.result(timeout=WAIT) for s in streams)] == [
            (FinishReason.ERROR, "peer lost")] * 2
        assert not rs.ready and not any(s.ready for s in rs.replicas)


# ---- the JAX engine: replicas on 8 virtual CPU devices, in one subprocess ------------------------

def worker(model_dir: str) -> dict:
    """Greedy tokens of each replica at TP=1 x DP=2 (f32 engines built by hand, as the tensor-parallel
    test does), then `slipstream serve`'s engines and replica set at TP=2 x DP=2 with int8 weights
    (q8_0-a16, the CPU default) serving two requests at once, one a replica: a slot and steps of up to 2
    tokens each (4 programs a replica to compile instead of 8 with 2 slots and 8 tokens; the prompts
    prefill in chunks). (TP=2 x DP=2 by hand would repeat the served replicas' checks;
    test_tensor_parallel.py's nine-heads case runs one such replica by hand.)"""
    import jax
    import numpy as np

    from slipstream.engine.device.runner import EngineConfig, JaxEngine
    from slipstream.engine.device.sharding import replica_devices
    from slipstream.models.loader import load_model
    from tests.conftest import TINY_ENGINE
    from tests.engine.test_kernel_paths import greedy
    from tests.engine.test_tensor_parallel import STEPS

    def devices(tree) -> list[int]:
        return sorted({d.id for leaf in jax.tree.leaves(tree) for d in leaf.sharding.device_set})

    def cache_shapes(engine) -> list[list[int]]:
        return sorted({tuple(s.data.shape) for s in engine.cache["k"].addressable_shards})

    cfg, model = load_model(model_dir)
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(3, cfg.vocab_size, n)] for n in (5, 9, 14)]
    report = {"devices": len(jax.devices())}
    for name, quantize in (("one", "none"), ("one_q8", "q8_0-a16")):
        engine = JaxEngine(cfg, model, EngineConfig(**{**TINY_ENGINE, "quantize": quantize}), precompile=False)
        report[name] = greedy(engine, prompts, STEPS)
        del engine
    for r, slice_ in enumerate(replica_devices(1, 2)):
        engine = JaxEngine(cfg, model, EngineConfig(**TINY_ENGINE), precompile=False, devices=slice_)
        tokens = greedy(engine, prompts, STEPS)
        before = engine.compile_count
        report[f"tp1-r{r}"] = {
            "tokens": tokens, "again": greedy(engine, prompts, STEPS), "steady_compiles": engine.compile_count - before,
            "cache": devices(engine.cache), "params": devices(engine.params), "cache_shapes": cache_shapes(engine)}
        del engine

    return {**report, **served(model_dir, prompts)}


def served(model_dir: str, prompts: list[list[int]], tp: int = 2, dp: int = 2) -> dict:
    """`slipstream serve`'s engines and replica set (by default TP=2 x DP=2) with int8 weights (q8_0-a16) serving
    the first two prompts at once, one a replica: their greedy tokens, compiles, and where each replica's arrays
    lie."""
    import jax

    from slipstream.engine.request import Request, SamplingParams
    from slipstream.server import cli
    from tests.engine.test_tensor_parallel import STEPS

    def devices(tree) -> list[int]:
        return sorted({d.id for leaf in jax.tree.leaves(tree) for d in leaf.sharding.device_set})

    args = cli.build_parser().parse_args([
        "serve", "--model", model_dir, "--tensor-parallel", str(tp), "--data-parallel", str(dp), "--quantize", "q8_0-a16",
        "--max-slots", "1", "--max-num-batched-tokens", "2", "--page-size", "8", "--max-seq-len", "128",
        "--kv-cache-memory", "64KiB", "--compile-cache", os.environ.get("SLIPSTREAM_TEST_COMPILE_CACHE", "")])
    engines, tokenizer, _ = cli.build_engines(args, data_parallel=args.data_parallel)
    replicas = ReplicaSet([Scheduler(e, OutputProcessor(tokenizer), SchedulerConfig()) for e in engines])
    replicas.start()
    report = {}
    try:
        before = engines[0].compile_count
        streams = [replicas.submit(Request(p, SamplingParams(temperature=0.0, max_tokens=STEPS))) for p in prompts[:2]]
        report["served"] = [s.result(timeout=300).token_ids for s in streams]
        report["served_compiles"] = engines[0].compile_count - before
        report["served_prompt_tokens"] = [s.prompt_tokens for s in replicas.replica_stats()]
        report["served_cache"] = [devices(e.cache) for e in engines]
        report["served_params"] = [devices(e.params) for e in engines]
        report["served_cache_shapes"] = [sorted({tuple(s.data.shape) for s in e.cache["k"].addressable_shards})
                                         for e in engines]
    finally:
        replicas.shutdown(timeout=30)
    return report


def moe_worker(model_dir: str) -> dict:
    """A sparse MoE (tiny Qwen3-MoE): `served`'s tokens on one device, then at TP=2 x DP=2. (Served, not the
    hand-built engines' batch of three: the tiny model's int8 greedy tokens meet near-ties that a step's other rows
    tip through XLA's summation order, with or without tensor parallelism.)"""
    import jax
    import numpy as np

    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(3, 256, n)] for n in (5, 9)]
    report = {"devices": len(jax.devices()), "one_q8": served(model_dir, prompts, 1, 1)["served"]}
    return {**report, **served(model_dir, prompts)}


def _run_worker(model_dir: str, *mode: str) -> dict:
    import json
    import subprocess
    import sys

    from tests.engine.test_tensor_parallel import DEVICES, ROOT, _pythonpath

    env = {**os.environ, "XLA_FLAGS": virtual_devices(DEVICES), "PYTHONPATH": _pythonpath()}
    run = subprocess.run([sys.executable, os.path.abspath(__file__), model_dir, *mode], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["devices"] == DEVICES
    return report


def _assert_served_on_own_devices(report: dict) -> None:
    """The CLI's replica set at TP=2: one request per replica, both at once, precompiled (nothing compiles); each
    replica's KV pages and weights on its own 2 devices only, one KV head each."""
    assert report["served"] == report["one_q8"][:2]
    assert report["served_prompt_tokens"] == [5, 9]
    assert report["served_cache"] == report["served_params"] == [[0, 1], [2, 3]]
    assert [[shape[1] for shape in shapes] for shapes in report["served_cache_shapes"]] == [[1], [1]]
    assert report["served_compiles"] == 0


def test_replicas_on_disjoint_devices_give_the_single_device_tokens(tmp_path_factory):
    from tests.conftest import build_tiny_hf
    from tests.server.test_serve_hf_models import _save_word_tokenizer

    model_dir = build_tiny_hf(str(tmp_path_factory.mktemp("dp-llama")), "llama")
    _save_word_tokenizer(model_dir)  # for the CLI's engines
    report = _run_worker(model_dir)
    one = report["one"]
    for r, devices in enumerate(([0], [1])):
        rep = report[f"tp1-r{r}"]
        assert rep["tokens"] == one and rep["again"] == one, f"replica {r}"
        assert rep["steady_compiles"] == 0
        # each replica's KV pages and weights on its own device only
        assert rep["cache"] == rep["params"] == devices, f"replica {r}"
        assert rep["cache_shapes"] == [[2, 2, 48, 8, 16]]
    _assert_served_on_own_devices(report)


def test_sparse_moe_served_at_tensor_parallel_gives_the_single_device_tokens(tmp_path_factory):
    """A tiny Qwen3-MoE served by `slipstream serve`'s engines at TP=2 x DP=2 (each replica's experts split over
    its two devices, packed per device): the single-device greedy tokens."""
    from tests.conftest import build_tiny_hf
    from tests.server.test_serve_hf_models import _save_word_tokenizer

    model_dir = build_tiny_hf(str(tmp_path_factory.mktemp("dp-qwen3-moe")), "qwen3_moe")
    _save_word_tokenizer(model_dir)
    _assert_served_on_own_devices(_run_worker(model_dir, "moe"))


def test_more_replicas_than_devices_is_refused_with_how_to_get_virtual_devices():
    from slipstream.engine.device.sharding import replica_devices

    with pytest.raises(ValueError, match="x data_parallel=1024 needs 2048 devices.*xla_force_host_platform_device_count"):
        replica_devices(2, 1024)


if __name__ == "__main__":
    import json
    import sys

    from tests.conftest import subprocess_compile_cache

    subprocess_compile_cache()
    print(json.dumps((moe_worker if sys.argv[2:] == ["moe"] else worker)(sys.argv[1])))
