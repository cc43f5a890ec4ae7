"""`slipstream bench` against a fake server that streams on a fixed schedule: every metric must come out
as the schedule's arithmetic says, within a few percent."""
from __future__ import annotations

import argparse
import asyncio
import json

import numpy as np
import pytest

from slipstream.server.bench import run as bench
from tests.server.bench_fake_server import FakeServer, Schedule

REL = 0.04   # "within a few percent": means, medians, totals and throughputs
TAIL = 0.10  # p90/p99 of 84 ITL gaps: a client wake-up delayed ~10 ms on a loaded 2-core host stretches one gap


@pytest.fixture(scope="module")
def tokenizer(default_tokenizer):
    return default_tokenizer  # what bench.load_tokenizer gives for this path


@pytest.fixture(autouse=True)
def shared_tokenizer(tokenizer, monkeypatch):
    monkeypatch.setattr(bench, "load_tokenizer", lambda name: tokenizer)  # loading the GGUF takes seconds


@pytest.fixture(scope="module")
def fake(tokenizer):
    server = FakeServer(tokenizer)
    yield server
    server.close()


def parse(server: FakeServer, tokenizer_path: str, *flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(["--base-url", server.base_url, "--tokenizer", tokenizer_path, "--disable-tqdm",
                              "--temperature", "0", "--metric-percentiles", "50,90,99", *flags])


def run_bench(server: FakeServer, tokenizer_path: str, *flags: str) -> dict:
    return asyncio.run(bench.benchmark(parse(server, tokenizer_path, *flags)))


def near(value: float, expected: float, rel: float = REL, slack: float = 0.0) -> bool:
    return abs(value - expected) <= rel * expected + slack


class WakeupLag:
    """Wake-up delays of a 5 ms sleep in a thread of the client's process while the benchmark runs: the
    client cannot time a token closer than it is woken up (other jobs on the cores, the GIL, the GC), so
    a per-token comparison allows the typical delay (p90), and a tail statistic, which is one or two
    samples, the worst one seen. On an idle host both are well under a millisecond."""

    def __enter__(self) -> "WakeupLag":
        import threading
        import time

        self._lags: list[float] = []
        self._stop = threading.Event()

        def watch() -> None:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                time.sleep(0.005)
                self._lags.append((time.perf_counter() - t0 - 0.005) * 1000)

        self._thread = threading.Thread(target=watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.typical_ms = float(np.percentile(self._lags, 90))
        self.worst_ms = float(max(self._lags))


def stats_of(values) -> dict[str, float]:
    v = np.asarray(values) * 1000
    return {"mean": v.mean(), "median": np.median(v), "p50": np.percentile(v, 50),
            "p90": np.percentile(v, 90), "p99": np.percentile(v, 99)}


# The client reads a completions chunk's text or a chat chunk's delta (a role-only chunk is not a token), and the
# usage from whichever chunk carries it: the two cases cover each reading once (chat with llama.cpp's usage on the
# last choice chunk, and its connection closed after each stream).
@pytest.mark.parametrize("endpoint,usage_style", [("/v1/completions", "separate"), ("/v1/chat/completions", "last")])
def test_every_metric_matches_the_schedule(fake, default_model_path, endpoint, usage_style):
    ttft, itl, n_out, n_in, conc, n_req = 0.4, 0.1, 8, 64, 4, 12
    fake.configure(Schedule(ttft_s=ttft, itl_s=itl, usage_style=usage_style))
    with WakeupLag() as lag:
        r = run_bench(fake, default_model_path, "--endpoint", endpoint, "--num-prompts", str(n_req),
                      "--random-input-len", str(n_in), "--random-output-len", str(n_out),
                      "--max-concurrency", str(conc), "--ignore-eos")
    stats = fake.stats()
    assert r["completed"] == n_req and r["failed"] == 0
    assert stats.peak_active == conc
    assert r["total_input_tokens"] == n_req * n_in and r["total_output_tokens"] == n_req * n_out
    assert all(b["ignore_eos"] and b["temperature"] == 0 for b in stats.bodies)

    # What the server really did: when each request left the client, when each token chunk left the server.
    sent = [stats.sent[rid] for rid in r["request_ids"]]
    starts = r["start_times"]
    truth = {"ttft": [s[0] - t0 for s, t0 in zip(sent, starts)],
             "e2el": [s[-1] - t0 for s, t0 in zip(sent, starts)],
             "tpot": [(s[-1] - s[0]) / (n_out - 1) for s in sent],
             "itl": [b - a for s in sent for a, b in zip(s, s[1:])]}
    for metric, values in truth.items():
        expected = stats_of(values)
        for stat in ("mean", "median", "p50", "p90", "p99"):
            rel = TAIL if (metric == "itl" and stat in ("p90", "p99")) else REL
            slack = lag.worst_ms if stat in ("p90", "p99") else lag.typical_ms
            assert near(r[f"{stat}_{metric}_ms"], expected[stat], rel, slack), (
                metric, stat, r[f"{stat}_{metric}_ms"], expected[stat], lag.typical_ms, lag.worst_ms)
    duration = max(s[-1] for s in sent) - min(starts)
    assert near(r["duration"], duration, 0.02)
    assert near(r["request_throughput"], n_req / duration)
    assert near(r["output_throughput"], n_req * n_out / duration)
    assert near(r["input_throughput"], n_req * n_in / duration)
    assert near(r["total_token_throughput"], n_req * (n_in + n_out) / duration)

    # ... and that was the schedule, give or take the host's scheduling delays
    e2el = ttft + (n_out - 1) * itl
    for metric, value in (("ttft", ttft), ("tpot", itl), ("itl", itl), ("e2el", e2el)):
        assert near(r[f"median_{metric}_ms"], value * 1000, 0.1), (metric, r[f"median_{metric}_ms"])
    assert near(r["request_throughput"], conc / e2el, 0.1)  # n_req / conc waves, each e2el long


def test_prompt_and_output_lengths_are_token_exact(fake, default_model_path, tokenizer):
    from slipstream.server.bench.datasets import random_dataset

    fake.configure(Schedule(ttft_s=0.005, itl_s=0.001))
    r = run_bench(fake, default_model_path, "--num-prompts", "24", "--random-input-len", "200",
                  "--random-output-len", "20", "--random-range-ratio", "0.5", "--seed", "3")
    stats = fake.stats()
    assert r["completed"] == 24
    # the server tokenized each prompt itself; the dataset asked for these lengths
    asked = [req.prompt_len for req in random_dataset(tokenizer, num_prompts=24, input_len=200, output_len=20,
                                                       range_ratio=0.5, seed=3)]
    assert sorted(stats.prompt_tokens) == sorted(asked) == sorted(r["input_lens"])
    assert all(100 <= n <= 300 for n in asked) and len(set(asked)) > 10
    assert all(10 <= n <= 30 for n in stats.max_tokens) and len(set(stats.max_tokens)) > 5
    assert sorted(r["output_lens"]) == sorted(stats.max_tokens)


def test_dataset_prompt_lengths_are_what_the_tokenizer_counts(tokenizer):
    from slipstream.server.bench.datasets import prefix_dataset, random_dataset

    def count(text):
        return len(tokenizer.encode(text, add_special_tokens=False))

    reqs = random_dataset(tokenizer, num_prompts=40, input_len=300, output_len=10, range_ratio=0.9, seed=7)
    assert all(count(r.prompt) == r.prompt_len for r in reqs) and len({r.prompt_len for r in reqs}) > 20
    shared = random_dataset(tokenizer, num_prompts=5, input_len=50, output_len=10, prefix_len=100, seed=1)
    prefix_ids = tokenizer.encode(shared[0].prompt, add_special_tokens=False)[:100]
    for r in shared:
        ids = tokenizer.encode(r.prompt, add_special_tokens=False)
        assert len(ids) == r.prompt_len == 150 and ids[:100] == prefix_ids
    groups = prefix_dataset(tokenizer, num_prompts=12, prefix_len=64, suffix_len=32, num_prefixes=3,
                            output_len=8, seed=2)
    assert len({tuple(tokenizer.encode(r.prompt, add_special_tokens=False)[:64]) for r in groups}) == 3
    assert all(count(r.prompt) == r.prompt_len == 96 for r in groups)


class OneAtATime:
    """The tokenizer with only the per-id calls of datasets.TextTokenizer (no batch calls)."""

    def __init__(self, tok) -> None:
        self.vocab_size, self.encode, self.decode = tok.vocab_size, tok.encode, tok.decode


def _synthetic_tokenizer():
    from slipstream.models.config import ModelConfig
    from slipstream.models.dummy_tokenizer import synthetic_tokenizer

    return synthetic_tokenizer(ModelConfig(num_layers=1, hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32,
                                           intermediate_size=64, vocab_size=4096, bos_token_id=0, eos_token_ids=(1,)))


# the default model's tokenizer leaves out ids whose text is not printable; the synthetic one also ids whose
# text encodes back as two (its "baa" is "b" + "aa")
@pytest.mark.parametrize("which", ["default", "synthetic"])
def test_random_prompts_draw_from_the_ids_that_round_trip_one_at_a_time(tokenizer, which):
    # the pool is built with the tokenizer's batch calls: it holds exactly the ids that decode alone to
    # printable text encoding back to just that id, and the prompts of a seed are those of the per-id path
    from slipstream.server.bench.datasets import PromptMaker, prefix_dataset, random_dataset

    tok = tokenizer if which == "default" else _synthetic_tokenizer()

    texts = {i: tok.decode([i], skip_special_tokens=True) for i in range(tok.vocab_size)}
    printable_ids = [i for i, text in texts.items() if text and "\ufffd" not in text and text.isprintable()]
    kept = [i for i in printable_ids if tok.encode(texts[i], add_special_tokens=False) == [i]]
    pool = PromptMaker(tok, np.random.default_rng(0)).pool.tolist()
    assert pool == kept and 100 < len(pool) and len(printable_ids) < tok.vocab_size
    assert (len(kept) < len(printable_ids)) == (which == "synthetic")
    alone = OneAtATime(tok)
    assert PromptMaker(alone, np.random.default_rng(0)).pool.tolist() == pool
    for make in (lambda t: random_dataset(t, num_prompts=6, input_len=64, output_len=4, range_ratio=0.5,
                                          prefix_len=16, seed=11),
                 lambda t: prefix_dataset(t, num_prompts=4, prefix_len=24, suffix_len=12, num_prefixes=2,
                                          output_len=4, seed=11)):
        assert make(tok) == make(alone)


def test_sharegpt_is_filtered_as_vllm_does(tokenizer, tmp_path):
    from slipstream.server.bench.datasets import sharegpt_dataset

    words = lambda k: " ".join(["word"] * k)  # noqa: E731 ("word word ..." is k tokens or so)
    convs = [{"conversations": [{"from": "human", "value": words(20)}, {"from": "gpt", "value": words(30)}]},
             {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": words(30)}]},  # short prompt
             {"conversations": [{"from": "human", "value": words(1500)}, {"from": "gpt", "value": "ok"}]},  # long
             {"conversations": [{"from": "human", "value": words(40)}]},  # no reply
             {"conversations": [{"from": "human", "value": words(10)}, {"from": "gpt", "value": words(8)}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    reqs = sharegpt_dataset(tokenizer, str(path), num_prompts=2)
    assert sorted((r.prompt_len, r.expected_output_len) for r in reqs) == sorted(
        (len(tokenizer.encode(words(a), add_special_tokens=False)), len(tokenizer.encode(words(b), add_special_tokens=False)))
        for a, b in ((20, 30), (10, 8)))
    with pytest.raises(ValueError, match="only 2 conversations"):
        sharegpt_dataset(tokenizer, str(path), num_prompts=3)


def test_poisson_arrivals_set_the_duration(fake, default_model_path):
    ttft, itl, n_out, rate, n_req = 0.1, 0.02, 6, 10.0, 20
    fake.configure(Schedule(ttft_s=ttft, itl_s=itl))
    r = run_bench(fake, default_model_path, "--num-prompts", str(n_req), "--random-input-len", "16",
                  "--random-output-len", str(n_out), "--request-rate", str(rate), "--seed", "5")
    # the arrival times are scaled so the last request leaves at n/rate; it then takes one e2el
    duration = n_req / rate + ttft + (n_out - 1) * itl
    assert near(r["duration"], duration)
    assert near(r["request_throughput"], n_req / duration)
    assert fake.stats().peak_active < n_req  # spread out, not all at once


# What `vllm bench serve` 0.32 (vllm.benchmarks.serve.get_request after np.random.seed(seed), its clock
# stubbed so each yield records its send time) sends at for 8 requests, rate 0.8, burstiness 1, seed 1000,
# and for 6 requests, rate 2, burstiness 0.5, seed 7.
VLLM_SEND_TIMES = {
    (8, 0.8, 1.0, 1000): [1.3789959187890872, 1.5379191852540544, 5.442083820019548, 6.298190837102652,
                          8.977065584639718, 9.287534755473303, 9.341597019599249, 10.0],
    (6, 2.0, 0.5, 7): [0.018991068585933135, 0.6458435466671517, 0.8808593823085857, 2.5807086830885737,
                       2.8514970161282918, 3.0],
}


@pytest.mark.parametrize("case", sorted(VLLM_SEND_TIMES))
def test_a_seed_sends_at_the_moments_vllm_bench_serve_does(case):
    # The same --seed loads a server with the same arrival pattern from either client, so their runs compare.
    assert bench.arrival_offsets(*case) == pytest.approx(VLLM_SEND_TIMES[case], rel=1e-12, abs=1e-12)
    n, rate, burstiness, seed = case
    assert bench.arrival_offsets(n, rate, burstiness, seed + 1) != pytest.approx(VLLM_SEND_TIMES[case])


def test_failures_are_counted_with_their_reason_and_goodput_follows_the_slos(fake, default_model_path):
    ttft, itl = 0.1, 0.02
    fake.configure(Schedule(ttft_s=ttft, itl_s=itl, fail_every=4))
    r = run_bench(fake, default_model_path, "--num-prompts", "12", "--random-input-len", "16",
                  "--random-output-len", "4", "--max-concurrency", "6", "--goodput", "ttft:150", "tpot:30")
    assert r["completed"] == 9 and r["failed"] == 3
    assert r["failure_reasons"] == {"HTTP 503: overloaded": 3}
    assert near(r["request_goodput"], r["request_throughput"])  # every completed request met both SLOs
    fake.configure(Schedule(ttft_s=ttft, itl_s=itl))
    r = run_bench(fake, default_model_path, "--num-prompts", "6", "--random-input-len", "16",
                  "--random-output-len", "4", "--goodput", "ttft:50")
    assert r["request_goodput"] == 0.0 and r["request_throughput"] > 0


def test_warm_ups_leave_no_measured_prompt_in_the_servers_prefix_cache(fake, default_model_path):
    # `vllm bench serve` warms up with its first measured prompt, so a server with a prefix cache serves that
    # request's prefill from the cache. With all requests sent at once behind a concurrency cap c, p99 TTFT is
    # the last prefill of the first wave: c prefills for us, c - 1 for vLLM (on Slipstream at c=8 with 2
    # warm-ups, the server served 480 prompt tokens from its cache in each of vLLM's runs and none in ours).
    # Our warm-ups are extra prompts, and so is the ready check's, and no measured prompt repeats: every
    # measured TTFT is the uncached one.
    ttft, cached, warmups, n_req = 0.1, 0.01, 3, 8  # a cached prompt would answer 10x sooner
    fake.configure(Schedule(ttft_s=ttft, itl_s=0.01, cached_ttft_s=cached))
    r = run_bench(fake, default_model_path, "--num-prompts", str(n_req), "--num-warmups", str(warmups),
                  "--ready-check-timeout-sec", "30", "--random-input-len", "32", "--random-output-len", "4",
                  "--max-concurrency", "4")
    stats = fake.stats()
    assert stats.received == 1 + warmups + n_req and r["completed"] == n_req
    assert stats.cache_hits == 0
    assert min(r["ttfts"]) >= ttft, sorted(r["ttfts"])  # the server waits ttft after the request arrives


def test_saved_json_uses_vllm_keys(fake, default_model_path, tmp_path):
    fake.configure(Schedule(ttft_s=0.02, itl_s=0.005))
    args = parse(fake, default_model_path, "--num-prompts", "4", "--random-input-len", "16",
                 "--random-output-len", "4", "--max-concurrency", "2", "--save-result",
                 "--result-dir", str(tmp_path), "--num-warmups", "2")
    assert bench.run(args) == 0
    assert fake.stats().received == 6  # 2 warm-ups, then 4 measured
    (path,) = tmp_path.iterdir()
    assert path.name.startswith("openai-infqps-concurrency2-fake-model-")
    saved = json.loads(path.read_text())
    for key in ("output_throughput", "request_throughput", "total_token_throughput", "median_ttft_ms",
                "mean_tpot_ms", "p99_itl_ms", "p90_e2el_ms", "completed", "failed", "duration",
                "max_concurrency", "model_id", "num_prompts"):
        assert key in saved, key
    assert saved["model_id"] == "fake-model" and saved["completed"] == 4 and saved["num_prompts"] == 4
    assert "ttfts" not in saved  # per-request lists only with --save-detailed, as in vLLM


def test_connections_are_kept_alive_as_vllm_does_unless_asked_not_to(fake, default_model_path):
    # vllm bench serve (aiohttp) reuses its connections; a fresh one per request costs a connect and an accept
    # on the server's event loop before the server even sees the request, and that lands in TTFT
    fake.configure(Schedule(ttft_s=0.01, itl_s=0.005))
    flags = ("--num-prompts", "16", "--random-input-len", "16", "--random-output-len", "4", "--max-concurrency", "4")
    r = run_bench(fake, default_model_path, *flags, "--keep-alive")
    assert r["completed"] == 16 and len(set(fake.stats().ports)) <= 4
    fake.configure(Schedule(ttft_s=0.01, itl_s=0.005))
    r = run_bench(fake, default_model_path, *flags, "--no-keep-alive")
    assert r["completed"] == 16 and len(set(fake.stats().ports)) == 16


class ClosesEachConnectionAfterItsStream:
    """llama.cpp's server, made certain: it answers a connection's first request with a short stream under
    keep-alive headers, then closes the connection 50 ms later without answering anything else sent on it. A
    client that pools connections reuses one at once, and that request fails unless it is sent again."""

    def __init__(self) -> None:
        import threading

        self.served = self.dropped = 0
        self.loop = asyncio.new_event_loop()
        self.server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    async def _handle(self, reader, writer) -> None:
        import re

        try:
            head = await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(int(re.search(rb"(?i)content-length: *(\d+)", head).group(1)))
            self.served += 1
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
                         b"keep-alive: timeout=5, max=100\r\n\r\n")
            token = {"choices": [{"index": 0, "text": " a", "finish_reason": "length"}],
                     "usage": {"prompt_tokens": 16, "completion_tokens": 1}}
            for data in (b"data: " + json.dumps(token).encode() + b"\n\n", b"data: [DONE]\n\n"):
                writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            try:  # a request sent on this connection meanwhile is read, and never answered
                await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 0.05)
                self.dropped += 1
            except (asyncio.TimeoutError, asyncio.IncompleteReadError):
                pass
        finally:
            writer.close()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0.2), self.loop).result()  # open handlers end within 50 ms
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def test_a_server_that_closes_each_connection_after_its_stream_loses_no_request(default_model_path):
    server = ClosesEachConnectionAfterItsStream()
    try:
        r = run_bench(server, default_model_path, "--model", "m", "--num-prompts", "32", "--random-input-len", "16",
                      "--random-output-len", "1", "--max-concurrency", "4", "--keep-alive")
    finally:
        server.close()
    assert r["failed"] == 0, r["failure_reasons"]
    assert r["completed"] == server.served == 32
    assert server.dropped > 0  # the client did reuse connections the server was closing, and sent those again


def test_custom_dataset_sends_the_files_prompts_as_vllm_reads_them(fake, default_model_path, tokenizer, tmp_path):
    path = tmp_path / "prompts.jsonl"
    prompts = [f"prompt number {i} about {'x ' * i}" for i in range(6)]
    path.write_text("".join(json.dumps({"prompt": p, "output_tokens": 2 + i}) + "\n" for i, p in enumerate(prompts)))
    fake.configure(Schedule(ttft_s=0.002, itl_s=0.001))
    run_bench(fake, default_model_path, "--dataset-name", "custom", "--dataset-path", str(path), "--num-prompts", "6",
              "--skip-chat-template", "--disable-shuffle", "--custom-output-len", "-1", "--max-concurrency", "1")
    stats = fake.stats()
    assert [b["prompt"] for b in stats.bodies] == prompts and stats.max_tokens == [2, 3, 4, 5, 6, 7]

    fake.configure(Schedule(ttft_s=0.002, itl_s=0.001))
    r = run_bench(fake, default_model_path, "--dataset-name", "custom", "--dataset-path", str(path), "--num-prompts",
                  "9", "--custom-output-len", "3", "--seed", "4")
    sent = [b["prompt"] for b in fake.stats().bodies]
    wrapped = {tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True): p
               for p in prompts}
    assert r["completed"] == 9 and set(sent) <= set(wrapped) and len(set(sent)) == 6  # 3 drawn again
    assert all(n == 3 for n in fake.stats().max_tokens)
