"""benchmarks/bench/trace_server (a server-side trace of each request, joined with a client's results) against
the fixed-schedule fake server: its stamps are the schedule; and its per-step trace."""
from __future__ import annotations

import json

from benchmarks.bench import trace_server
from tests.server.bench_fake_server import FakeServer, Schedule
from tests.server.test_bench_client import near, run_bench, shared_tokenizer, tokenizer  # noqa: F401 - fixtures


def test_the_server_trace_times_each_request_as_the_server_did(default_model_path, tokenizer, tmp_path):
    # a client's numbers against the server's own (trace_server's stamps, joined by x-request-id): on a
    # server with a fixed schedule those are the schedule, and the client adds only its transport on top
    trace = tmp_path / "trace.jsonl"
    server = FakeServer(tokenizer, str(trace))
    try:
        server.configure(Schedule(ttft_s=0.15, itl_s=0.03))
        r = run_bench(server, default_model_path, "--num-prompts", "8", "--random-input-len", "16",
                      "--random-output-len", "6", "--max-concurrency", "4", "--request-id-prefix", "run-a-")
    finally:
        server.close()
    joined = trace_server.join_trace(r, "run-a-", trace_server.read_trace(trace, "run-a-"))
    assert sorted(j["i"] for j in joined) == list(range(8))
    assert all(abs(j["server_ms"] - 150) < 15 for j in joined), [j["server_ms"] for j in joined]
    assert all(len(j["server_itl_ms"]) == 5 and all(abs(g - 30) < 10 for g in j["server_itl_ms"]) for j in joined)
    view = trace_server.server_view(joined, r)
    assert near(view["server_median_ttft_ms"], 150, 0.05) and near(view["server_median_itl_ms"], 30, 0.1)
    assert 0 <= view["client_minus_server_median_ttft_ms"] < 10
    assert abs(view["client_minus_server_median_itl_ms"]) < 3


def test_step_trace_lists_each_step_prefill_chunks_and_decodes(tmp_path):
    # SLIPSTREAM_TRACE_STEPS: one line per planned step, from the scheduler's step listener
    from slipstream.engine.mock_engine import MockEngine
    from tests.engine.scheduler_helpers import WAIT, chain, req, running

    path = tmp_path / "steps.jsonl"
    engine = MockEngine(max_slots=2, page_size=4, max_num_batched_tokens=8, step_sleep_s=0.001)
    with running(engine, enable_prefix_cache=False) as sched:
        sched.add_step_listener(trace_server.step_writer(str(path)))
        stream = sched.submit(req(list(range(40, 52)), 3))
        assert stream.result(timeout=WAIT).token_ids == chain(list(range(40, 52)), 3)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    ran = [line for line in lines if line["prefill"] or line["decodes"]]
    rid = ran[0]["prefill"][0][0]
    assert [line["prefill"] for line in ran[:2]] == [[[rid, 0, 8, False]], [[rid, 8, 4, True]]]
    assert [line["decodes"] for line in ran] == [0, 0, 1, 1]
    assert all(a["t"] <= b["t"] for a, b in zip(lines, lines[1:]))


def test_step_intervals_split_full_decode_steps_from_the_rest(tmp_path):
    path = tmp_path / "steps.jsonl"
    lines = [(0.000, 0, [["a", 0, 8, True]]), (0.010, 4, []), (0.030, 4, []), (0.050, 2, []), (0.055, 2, [])]
    path.write_text("".join(json.dumps({"t": t, "decodes": d, "running": 4, "prefill": p, "waiting": []}) + "\n"
                            for t, d, p in lines))
    got = trace_server.step_intervals(str(path), full=4)
    assert set(got) == {"prefill", "decode, full", "decode"}
    assert got["prefill"]["steps"] == 1 and abs(got["prefill"]["p50_ms"] - 10) < 1e-6
    assert got["decode, full"]["steps"] == 2 and abs(got["decode, full"]["p50_ms"] - 20) < 1e-6
    assert got["decode"]["steps"] == 1 and abs(got["decode"]["p50_ms"] - 5) < 1e-6


def test_timed_calls_are_traced_beside_the_steps_and_left_out_of_their_intervals(tmp_path):
    # a lone request's time before its step: the scheduler's submit and the engine's launch, stamped per call
    from slipstream.engine.mock_engine import MockEngine
    from tests.engine.scheduler_helpers import WAIT, chain, req, running

    path = tmp_path / "steps.jsonl"
    engine = MockEngine(max_slots=2, page_size=4, max_num_batched_tokens=8, step_sleep_s=0.001)
    with running(engine, enable_prefix_cache=False) as sched:
        sched.add_step_listener(trace_server.step_writer(str(path)))
        trace_server.time_calls(str(path), sched, ("submit",))
        trace_server.time_calls(str(path), engine, ("launch",))
        r = req(list(range(40, 46)), 2)
        assert sched.submit(r).result(timeout=WAIT).token_ids == chain(list(range(40, 46)), 2)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    calls = [line for line in lines if "call" in line]
    submits = [c for c in calls if c["call"] == "submit"]
    assert len(submits) == 1 and submits[0]["id"] == r.request_id and submits[0]["t0"] <= submits[0]["t1"]
    launches = [c for c in calls if c["call"] == "launch"]
    steps = [line for line in lines if "prefill" in line and (line["prefill"] or line["decodes"])]
    assert len(launches) == len(steps) >= 2
    assert submits[0]["t1"] <= steps[0]["t"] <= launches[0]["t0"]
    got = trace_server.step_intervals(str(path), full=1)
    assert sum(row["steps"] for row in got.values()) == sum("prefill" in line for line in lines) - 1


def test_ttft_parts_split_each_request_at_its_submit_plan_and_launch(tmp_path):
    # two lone requests; the second's prompt takes two chunks, and only the sampling one's step counts
    def lines(path, rows):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    requests, steps = tmp_path / "requests.jsonl", tmp_path / "steps.jsonl"
    lines(requests, [
        {"id": "a", "gen_id": "cmpl-a", "dispatch": 10.0, "body": 10.001, "first": 10.030},
        {"id": "b", "gen_id": "cmpl-b", "dispatch": 20.0, "body": 20.001, "first": 20.050},
        {"id": "c", "gen_id": "cmpl-c", "dispatch": 30.0, "body": 30.001, "first": None}])  # failed: left out
    lines(steps, [  # only a's endpoint call (start) and tokenizing (encode) are stamped
        {"call": "start", "t0": 10.0015, "t1": 10.0015, "id": None},
        {"call": "encode", "t0": 10.002, "t1": 10.0025, "id": None},
        {"call": "submit", "t0": 10.003, "t1": 10.0032, "id": "cmpl-a-0"},
        {"t": 10.004, "decodes": 0, "prefill": [["cmpl-a-0", 0, 16, True]]},
        {"call": "launch", "t0": 10.0045, "t1": 10.0065, "id": None},
        {"call": "submit", "t0": 20.003, "t1": 20.0032, "id": "cmpl-b-0"},
        {"t": 20.004, "decodes": 0, "prefill": [["cmpl-b-0", 0, 16, False]]},
        {"call": "launch", "t0": 20.0045, "t1": 20.0065, "id": None},
        {"t": 20.020, "decodes": 0, "prefill": [["cmpl-b-0", 16, 4, True]]},
        {"call": "launch", "t0": 20.021, "t1": 20.022, "id": None}])
    parts = trace_server.ttft_parts(str(requests), str(steps))
    assert parts.pop("requests") == 2
    # a: read 1, to_submit 2, submit 0.2, to_plan 0.8, to_launch 0.5, launch 2, to_first_chunk 23.5
    # b: read 1, to_submit 2, submit 0.2, to_plan 16.8, to_launch 1, launch 1, to_first_chunk 28
    want = {"read": 1, "to_submit": 2, "submit": 0.2, "to_plan": 8.8, "to_launch": 0.75, "launch": 1.5,
            "to_first_chunk": 25.75, "server_ttft": 40,
            "to_start": 0.5, "to_encode": 0.5, "encode": 0.5, "encoded_to_submit": 0.5}  # a's to_submit in parts
    assert parts.keys() == want.keys()
    assert all(abs(parts[k] - v) < 1e-6 for k, v in want.items()), parts
