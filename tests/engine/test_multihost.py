"""Multi-host serving. In one process: the lockstep channel makes a worker's engine see exactly the
calls process 0's engine sees, a lost worker fails the group, and Scheduler.abort fails requests
while the engine thread is stuck. On loopback: two `slipstream serve` processes of 4 virtual CPU
devices each (TP=8 over both) answer HTTP completions with a one-process server's tokens, and the
death of either process makes the other fail its requests and exit non-zero. Every wait is bounded."""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from slipstream.engine.mock_engine import MockEngine
from slipstream.engine.distributed.multihost import (_FRAME, DistributedConfig, Group, Leader, LockstepEngine, PeerLost, decode, encode,
                              serve_worker, worker_grammars)
from slipstream.engine.request import FinishReason, SamplingParams
from slipstream.engine.scheduler import EngineUnavailable
from tests.conftest import virtual_devices
from tests.engine.scheduler_helpers import WAIT, ByteTokenizer, chain, req, running, wait_for
from tests.server.test_serve_hf_models import WORDS, _free_port, _save_word_tokenizer

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOKEN = bytes(range(32))


def _configs(**kw) -> tuple[DistributedConfig, DistributedConfig]:
    cfg = DistributedConfig(coordinator_address=f"127.0.0.1:{_free_port()}", num_processes=2, process_id=0,
                            control_port=_free_port(), peer_timeout_s=2.0, connect_timeout_s=WAIT, **kw)
    return cfg, dataclasses.replace(cfg, process_id=1)


class RecordingEngine(MockEngine):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.inserts: list[tuple[int, int | None]] = []  # (slot, seed)

    def insert(self, slot, state) -> None:
        super().insert(slot, state)
        self.inserts.append((slot, state.params.seed))


# ---- in one process -----------------------------------------------------------------------------

def test_worker_replays_process_0s_calls_in_order():
    cfg0, cfg1 = _configs()
    lost: list[str] = []
    group = Group(cfg0, TOKEN, on_lost=[lost.append])
    mine, theirs = RecordingEngine(max_slots=2, step_sleep_s=0.001), RecordingEngine(max_slots=2)
    finished = threading.Event()

    def worker() -> None:
        serve_worker(theirs, Leader(cfg1, TOKEN, on_lost=[lost.append]))
        finished.set()

    threading.Thread(target=worker, daemon=True).start()
    group.accept_workers()
    with running(LockstepEngine(mine, group)) as sched:
        requests = [req([40 + i], 12, temperature=1.0 if i % 2 else 0.0) for i in range(5)]
        results = sched.generate(requests)
    assert [r.token_ids for r in results] == [chain([40 + i], 12) for i in range(5)]
    group.close()
    assert finished.wait(WAIT) and not lost
    # the same steps, launched and collected in the same order, with the same seeds (drawn once)
    assert theirs.step_log == mine.step_log and len(mine.step_log) > 12
    assert theirs.events == mine.events
    assert theirs.inserts == mine.inserts and all(seed is not None for _, seed in mine.inserts)
    assert not theirs.occupied_slots and not mine.occupied_slots


def test_a_lost_worker_fails_the_group_and_its_engine_calls():
    cfg0, cfg1 = _configs()
    lost: list[str] = []
    group = Group(cfg0, TOKEN, on_lost=[lost.append])
    leaders: list[Leader] = []
    threading.Thread(target=lambda: leaders.append(Leader(cfg1, TOKEN, on_lost=[])), daemon=True).start()
    group.accept_workers()
    engine = LockstepEngine(MockEngine(), group)
    wait_for(lambda: leaders)
    time.sleep(1.5 * cfg0.peer_timeout_s)  # heartbeats keep an idle group alive
    assert not lost
    leaders[0].close()  # what the kernel does when a worker dies
    wait_for(lambda: lost)
    assert "process 1" in lost[0]
    with pytest.raises(PeerLost):
        engine.free(0)


def test_a_stranger_is_refused_on_the_control_port():
    cfg0, cfg1 = _configs()
    group = Group(cfg0, TOKEN, on_lost=[])
    accepted = threading.Event()
    threading.Thread(target=lambda: (group.accept_workers(), accepted.set()), daemon=True).start()
    Leader(cfg1, bytes(32), on_lost=[])   # wrong secret
    assert not accepted.wait(0.5)
    Leader(cfg1, TOKEN, on_lost=[])
    assert accepted.wait(WAIT)


def test_a_grammar_reaches_the_worker_as_its_own_compiled_copy(default_tokenizer):
    from slipstream.engine.api import SlotState
    from slipstream.engine.structured import Constraint, GrammarCompiler

    tokenizer = default_tokenizer
    engine = MockEngine(vocab_size=49152, eos_token_ids=frozenset({2}))
    grammar = GrammarCompiler(tokenizer, 49152, {2}).compile(Constraint("regex", "(yes|no)"))
    state = SlotState([5], [], SamplingParams(constraint=grammar))
    frame = encode(("insert", 3, state))
    (size,) = _FRAME.unpack(frame[:_FRAME.size])
    assert size == len(frame) - _FRAME.size
    kind, slot, got = decode(frame[_FRAME.size:], worker_grammars(tokenizer, engine))
    assert (kind, slot) == ("insert", 3)
    assert got.params.constraint is not grammar and got.params.constraint.text == grammar.text
    assert not got.params.constraint.matcher().advance(tokenizer.encode("maybe", add_special_tokens=False)[0])


def test_scheduler_abort_fails_requests_while_the_engine_is_stuck():
    release = threading.Event()

    class StuckEngine(MockEngine):  # a collective whose peer died: launch never returns
        def launch(self, batch):
            release.wait()
            return super().launch(batch)

    with running(StuckEngine()) as sched:
        stream = sched.submit(req([40], 4))
        time.sleep(0.2)
        assert sched.ready
        sched.abort("process 1 is gone")
        done = stream.result(timeout=WAIT)
        assert done.finish_reason is FinishReason.ERROR and done.error == "process 1 is gone"
        assert not sched.ready
        with pytest.raises(EngineUnavailable, match="process 1 is gone"):
            sched.submit(req([50], 4))
        release.set()


# ---- two processes on loopback ------------------------------------------------------------------

PROMPTS = [[5, 9, 17, 33, 64, 100], [200, 3, 71, 71, 150, 12, 9, 44, 250]]  # token ids

def _shards(x) -> dict:
    return {"shape": list(x.shape), "devices": len(x.sharding.device_set), "fully_addressable": x.is_fully_addressable,
            "here": sorted(list(s.data.shape) for s in x.addressable_shards)}


def placement_worker(process_id: int, coordinator: str, model_path: str) -> None:
    """One process of two (this file's __main__): the tiny model at TP=8, its greedy tokens and where
    its weights and KV pages live, as JSON on stdout."""
    from slipstream.engine.distributed.multihost import exit_now, initialize

    initialize(DistributedConfig(coordinator_address=coordinator, num_processes=2, process_id=process_id))
    from slipstream.engine.device.runner import EngineConfig, JaxEngine
    from slipstream.models.loader import load_model
    from tests.conftest import TINY_ENGINE
    from tests.engine.test_kernel_paths import greedy

    cfg, model = load_model(model_path)
    engine = JaxEngine(cfg, model, EngineConfig(**{**TINY_ENGINE, "tensor_parallel": 8}), precompile=False)
    tokens = greedy(engine, PROMPTS, 6)
    embed = next(v.get_value() for path, v in __import__("flax").nnx.to_flat_state(engine.params)
                 if path[0] == "embed")
    print(json.dumps({"tokens": tokens, "embed": _shards(embed), "k": _shards(engine.cache["k"])}), flush=True)
    exit_now(0)


def test_weights_and_kv_pages_span_both_processes(tiny_model, tiny_llama_dir):
    """Each process holds only its own 4 devices' shards of one 8-device array, and the greedy tokens
    are the single-device engine's."""
    from slipstream.engine.device.runner import EngineConfig, JaxEngine
    from tests.conftest import TINY_ENGINE
    from tests.engine.test_kernel_paths import greedy

    coordinator = f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": virtual_devices(4)}
    procs = [subprocess.Popen([sys.executable, __file__, str(i), coordinator, tiny_llama_dir], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
             for i in (0, 1)]
    try:
        outs = [p.communicate(timeout=START_S)[0] for p in procs]
    finally:
        _stop(procs)
    assert [p.returncode for p in procs] == [0, 0]
    reports = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    cfg, params = tiny_model
    one = greedy(JaxEngine(cfg, params, EngineConfig(**TINY_ENGINE), precompile=False), PROMPTS, 6)
    for r in reports:
        assert r["tokens"] == one
        # the embedding [256, 64] split on the vocabulary over 8 devices: 4 rows of 32 here
        assert r["embed"] == {"shape": [256, 64], "devices": 8, "fully_addressable": False, "here": [[32, 64]] * 4}
        # 4 query heads over 2 KV heads do not split 8 ways: the pages are whole on each device
        assert r["k"]["devices"] == 8 and not r["k"]["fully_addressable"] and r["k"]["here"] == [r["k"]["shape"]] * 4

# steps of up to 2 tokens: each process compiles 4 programs (token buckets 1 and 2, 1 and 2 sampled rows)
# instead of 7 at 16, and the prompts prefill in chunks across both processes
SERVE = ["--max-slots", "2", "--max-seq-len", "512", "--kv-cache-memory", "1MiB", "--max-num-batched-tokens", "2",
         "--quantize", "none"]
START_S = 400  # two processes compiling on shared CPU cores
EXIT_S = 30    # a survivor fails its requests and exits within this


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from tests.conftest import build_tiny_hf

    path = build_tiny_hf(str(tmp_path_factory.mktemp("multihost")), "llama")
    _save_word_tokenizer(path)
    return path


def _serve(model: str, log: pathlib.Path, http: int, *extra: str, env: dict | None = None) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "slipstream.server.cli", "serve", "--model", model, "--port", str(http),
                                 *SERVE, "--compile-cache", os.environ.get("SLIPSTREAM_TEST_COMPILE_CACHE", ""), *extra],
                                cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _group(model: str, tmp: pathlib.Path, http: int) -> list[subprocess.Popen]:
    coordinator, control = _free_port(), _free_port()
    return [_serve(model, tmp / f"process{i}.log", http, "--tensor-parallel", "8",
                   "--coordinator-address", f"127.0.0.1:{coordinator}", "--control-port", str(control),
                   "--num-processes", "2", "--process-id", str(i), "--peer-timeout", "5",
                   env={"XLA_FLAGS": virtual_devices(4)}) for i in (0, 1)]


def _logs(tmp: pathlib.Path) -> str:
    return "\n".join(f"--- {p.name}\n" + "\n".join(line for line in p.read_text().splitlines() if "Gloo" not in line)[-3000:]
                     for p in sorted(tmp.glob("*.log")))


def _wait_ready(base: str, procs: list[subprocess.Popen], tmp: pathlib.Path) -> None:
    deadline = time.monotonic() + START_S
    while True:
        assert all(p.poll() is None for p in procs), _logs(tmp)
        try:
            if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"not ready in {START_S} s\n{_logs(tmp)}"
        time.sleep(0.5)


def _answers(base: str) -> list[list[str]]:
    """Greedy continuations of PROMPTS, and a seeded sample, as words."""
    bodies = [{"prompt": " ".join(WORDS[i - 3] for i in p), "max_tokens": 8, "temperature": 0} for p in PROMPTS]
    bodies.append({**bodies[0], "temperature": 0.8, "seed": 1234, "repetition_penalty": 1.3})
    out = []
    for body in bodies:
        r = httpx.post(f"{base}/v1/completions", timeout=60, json={**body, "ignore_eos": True})
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["text"].split())
    return out


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)


def _exit_code(proc: subprocess.Popen, since: float) -> tuple[int, float]:
    try:
        code = proc.wait(max(0.1, since + EXIT_S - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"process {proc.args[-3]} still running {EXIT_S} s after its peer died")
    return code, time.monotonic() - since


@pytest.fixture(scope="module")
def one_process(tiny) -> list[list[str]]:
    """What one process (one device, no mesh) answers: the CLI's engine builder and HTTP app with the
    group's flags, served on a thread of this process (no second process's start-up and imports)."""
    from slipstream.server.cli import build_parser
    from tests.models.test_presets_serve import serve_in_thread

    url, server, thread, _ = serve_in_thread(build_parser().parse_args(
        ["serve", "--model", tiny, *SERVE, "--compile-cache", ""]))
    try:
        return _answers(url)
    finally:
        server.should_exit = True
        thread.join(timeout=15)


def test_two_processes_answer_like_one_and_stop_when_process_1_dies(tiny, one_process, tmp_path):
    http = _free_port()
    base = f"http://127.0.0.1:{http}"
    procs = _group(tiny, tmp_path, http)
    try:
        _wait_ready(base, procs, tmp_path)
        assert _answers(base) == one_process
        # a long stream is in flight when process 1 dies
        body = {"prompt": "w5 w9", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
        events: list[dict] = []
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=EXIT_S) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    break  # the first token arrived
            os.kill(procs[1].pid, signal.SIGKILL)
            killed = time.monotonic()
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert events and events[-1].get("error", {}).get("code") == "engine_error", events[-3:]
        assert sum(len(e["choices"][0]["text"].split()) for e in events if "choices" in e) < 399
        ready = []
        while procs[0].poll() is None and time.monotonic() < killed + EXIT_S:
            try:
                ready.append(httpx.get(f"{base}/ready", timeout=1).status_code)
            except httpx.HTTPError:
                ready.append("refused")
            time.sleep(0.02)
        code, took = _exit_code(procs[0], killed)
        assert code != 0 and 200 not in ready, (code, ready, _logs(tmp_path))
        print(f"process 0 exited {code} {took:.2f} s after process 1 was killed; /ready meanwhile: {set(ready)}")
    finally:
        _stop(procs)


def test_process_1_exits_when_process_0_dies(tiny, tmp_path):
    http = _free_port()
    procs = _group(tiny, tmp_path, http)
    try:
        _wait_ready(f"http://127.0.0.1:{http}", procs, tmp_path)
        os.kill(procs[0].pid, signal.SIGKILL)
        code, took = _exit_code(procs[1], time.monotonic())
        assert code != 0, _logs(tmp_path)
        print(f"process 1 exited {code} {took:.2f} s after process 0 was killed")
    finally:
        _stop(procs)


def test_sigterm_drains_the_group_and_every_process_exits_0(tiny, tmp_path):
    """Kubernetes stops a group by sending SIGTERM to every pod at once: process 0 drains (the request
    in flight completes), the worker keeps running its steps until process 0 tells it to stop."""
    http = _free_port()
    base = f"http://127.0.0.1:{http}"
    procs = _group(tiny, tmp_path, http)
    try:
        _wait_ready(base, procs, tmp_path)
        body = {"prompt": "w5 w9", "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=EXIT_S) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    break
            for p in procs:
                p.send_signal(signal.SIGTERM)
            stopped = time.monotonic()
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "length", events[-1]
        assert [_exit_code(p, stopped)[0] for p in procs] == [0, 0], _logs(tmp_path)
    finally:
        _stop(procs)


if __name__ == "__main__":
    from tests.conftest import subprocess_compile_cache

    subprocess_compile_cache()
    placement_worker(int(sys.argv[1]), sys.argv[2], sys.argv[3])
