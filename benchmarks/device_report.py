"""The one-call device benchmark's report: device.md, the markdown table of what device.json holds
(benchmarks/device.py writes both as each phase ends)."""
from __future__ import annotations


def _g(x: float) -> str:
    """Three significant digits, whatever the scale (a tiny CPU model or an 8B model on a TPU)."""
    return f"{x:.0f}" if abs(x) >= 1000 else f"{x:.3g}"


def _ops(ops: list) -> str:
    return ", ".join(f"{name} {us:.0f} us (x{n})" for name, us, n in ops)


def markdown(r: dict) -> str:
    m = r.get("machine", {})
    device = (m["device"] if "device" in m else
              f"{m.get('device_kind', '?')} x{m.get('device_count', '?')} ({m.get('platform', '?')}), jax {m.get('jax', '?')}")
    lines = [f"Machine: {device}; host {m.get('cpu', '?')}; model {m.get('model', '?')} ({m.get('mode', '?')})", ""]
    if "hbm" in r:
        lines += [f"HBM read: {_g(r['hbm']['read_gbs'])} GB/s (sum over {r['hbm']['bytes'] / 2**30:.2f} GiB)", ""]
    if "matmul" in r:
        mm = r["matmul"]
        kinds = list(mm["rows"][0]["kinds"])
        lines += [f"Matmul [m, {mm['k']}] x [{mm['k']}, {mm['n']}], per layer over a scan of {mm['layers']} "
                  "(ms; TFLOP/s; GB/s of weights):", "",
                  "| m | " + " | ".join(kinds) + " |", "|---:|" + "---:|" * len(kinds)]
        for row in mm["rows"]:
            cells = [f"{_g(k['ms'])} ms; {_g(k['tflops'])}; {_g(k['weight_gbs'])}" for k in row["kinds"].values()]
            lines.append(f"| {row['m']} | " + " | ".join(cells) + " |")
        lines.append("")
    if r.get("load", {}).get("memory"):
        mem = r["load"]["memory"]
        lines += [f"Weights ready in {r['load']['seconds']:.1f} s: {(mem.get('in_use') or 0) / 1e9:.2f} GB of device memory in "
                  f"use of {mem['limit'] / 1e9:.2f} (peak {(mem.get('peak') or 0) / 1e9:.2f})", ""]
    if "fit" in r:
        lines += [f"Out of device memory at {r['fit']['asked_slots']} slots: the largest decode batch cut to "
                  f"{r['fit']['slots']} ({r['fit']['error']})", ""]
    if "engine" in r:
        e = r["engine"]
        lines += [f"Engine: {_g(e['weight_mb'])} MB of weights read per decode step, KV {e['kv_dtype']} "
                  f"({e['kv_bytes_per_token']} bytes/token), pages of {e['page_size']}, context {e['context']}, "
                  f"ready in {e['ready_s']:.1f} s ({e['programs']} programs)"
                  + (f"; steps timed after the scoring and pooling programs' background compile (waited "
                     f"{r['extended_compile']['waited_s']:.1f} s)" if "extended_compile" in r else ""), ""]
    if r.get("decode"):
        lines += ["| slots | step ms | tok/s | floor ms (weights + KV at HBM read) | step/floor | pipelined step ms "
                  "| pipelined/floor |", "|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {d['slots']} | {_g(d['step_ms'])} | {_g(d['tok_s'])} | {_g(d.get('floor_ms', 0))} | "
                  f"{d.get('step_over_floor', 0):.2f} | {_g(d.get('pipelined_ms', 0))} | "
                  f"{d.get('pipelined_over_floor', 0):.2f} |" for d in r["decode"]]
        lines += ["", "Pipelined: each step launched before the previous one's samples are read (its tokens "
                  "the device's latest samples), as the server runs decodes."]
        lines.append("")
        lines += [f"Device time of one {d['slots']}-slot step by op: {_ops(d['device_ops'])}" for d in r["decode"]
                  if d.get("device_ops")]
    if "prefill" in r:
        p = r["prefill"]
        line = (f"Prefill of {p['tokens']} tokens: {_g(p['ms'])} ms ({_g(p['tok_s'])} tok/s), "
                f"{_g(p['matmul_tflops'])} TFLOP/s of matmuls")
        if "floor_ms" in p:
            line += (f"; floor at this run's {p['matmul_kind']} rate (m={p['rate_m']}: {_g(p['rate_tflops'])} "
                     f"TFLOP/s) {_g(p['floor_ms'])} ms, prefill/floor {p['over_floor']:.2f}")
        lines += [line, ""]
        if p.get("device_ops"):
            lines += [f"Device time of the prefill step by op: {_ops(p['device_ops'])}", ""]
    lines += _spec_markdown(r)
    if "startup" in r:
        s = r["startup"]
        warm = ""
        if "warm_s" in s:
            warm = (f", warm {s['warm_s']:.1f} s ({s.get('warm_programs_loaded') or 0} programs loaded whole; "
                    f"a greedy completion {'equal to' if s.get('warm_answers_as_cold') else 'DIFFERENT from'} the cold "
                    "server's)")
        lines += [f"Server ready: cold cache {s['cold_s']:.1f} s{warm}", ""]
    if "serving" in r:
        s = r["serving"]
        lines += [f"Serving ({s['prompts']} prompts {s['input_len']} in / {s['output_len']} out, concurrency "
                  f"{s['concurrency']}, unix socket): {_g(s['output_tok_s'])} output tok/s, TTFT p50 "
                  f"{_g(s['ttft_p50_ms'])} ms, TPOT p50 {_g(s['tpot_p50_ms'])} ms ({s['completed']} completed, "
                  f"{s['failed']} failed)"]
    if "serving_trace" in r:
        t, parts = r["serving_trace"], dict(r["serving_trace"]["ttft_parts_ms"])
        n = parts.pop("requests")
        lines += ["", f"The same run traced (benchmarks.bench.trace_server, warm restart): client TTFT p50 "
                  f"{_g(t['client']['ttft_p50_ms'])} ms; the server's, median of {n} requests (ms): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in parts.items())]
    if "errors" in r:
        lines += ["", *[f"- {phase} failed: {msg}" for phase, msg in r["errors"].items()]]
    return "\n".join(lines).rstrip()


def _spec_markdown(r: dict) -> list[str]:
    """device.md's lines for the spec phase (benchmarks/device_spec.py)."""
    lines = []
    if "spec_steps" in r:
        e = r.get("spec_engine", {})
        lines += [f"Speculative verification steps (context {e.get('context', '?')}, K drafts per sequence fed as "
                  f"K + 1 query tokens, every one sampled; engine of {e.get('sampling_slots', '?')} sampling slots, "
                  f"ready in {e.get('ready_s', 0):.1f} s):", "",
                  "| sequences | K | query tokens | step ms | x K=0 | tok/s if all accepted |",
                  "|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {x['slots']} | {x['drafts']} | {x['query_tokens']} | {_g(x['step_ms'])} | {x['over_k0']:.2f} | "
                  f"{_g(x['tok_s_all_accepted'])} |" for x in r["spec_steps"]]
        lines += ["", "(x K=0 is also the tokens a sequence must gain per verification step to beat plain decoding.)",
                  ""]
    if "spec_identity" in r:
        s = r["spec_identity"]
        lines += [f"Greedy identity with n-gram speculation (K {s['k']}, {s['requests']} requests of {s['output_len']} "
                  f"tokens, {s['drawn']} of them drawn in the same batches): **{s['identical']}/{s['greedy']} greedy "
                  f"outputs identical**; {s['drafts']} drafts verified, {s['accepted']} accepted "
                  f"({s['acceptance_rate']:.1%}), by position {s['accepted_per_position']}", ""]
        for m in s["mismatches"]:
            tie = f", relative logit gap {m['relative_gap']:.2g}" if "relative_gap" in m else ""
            lines.append(f"- request {m['request']} differs at token {m['at']}: {m['without']} without, "
                         f"{m['with']} with speculation{tie}")
        if s["mismatches"]:
            lines.append("")
    return lines
