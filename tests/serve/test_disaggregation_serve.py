"""A disaggregated deployment (serve.llm.disaggregation: two prefill and two decode replicas,
KV over gloo between their engine processes) through run.py and HTTP: the same completions
as the aggregated engine (greedy with logprobs, seeded sampling with n=2, a request that
ends with its first token, streamed and not); prompts sharing a prefix go to the prefill
replica that holds it; /metrics shows each role's KV transfers and the TTFT split; action=test
and action=bench run against the split deployment; a client
that disconnects frees the blocks of both sides; a decode replica killed mid-request gives
its client an error or a retried completion, never a hang, and the replica Serve starts in
its place pairs with the prefill replicas; stop leaves nothing."""
from __future__ import annotations

import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from tests.serve.conftest import free_port, kill_recorded, run_py, tiny_serve_args

SMALL = ("serve.llm.engine_args.cpu_kv_cache_space_gib=0.05",)
# 2P2D: every decode replica links to each prefill replica it receives from (xPyD).
SPLIT = ("+serve.llm.disaggregation.kv_transfer=gloo",
         "+serve.llm.disaggregation.prefill.num_replicas=2",
         "+serve.llm.disaggregation.decode.num_replicas=2")
LONG = list(range(5, 60))  # 55 prompt tokens: four KV blocks of 16
BODIES = [
    {"prompt": LONG, "max_tokens": 12, "temperature": 0, "logprobs": 2},
    {"prompt": "The capital of France is", "max_tokens": 10, "temperature": 0, "stream": True},
    {"prompt": LONG[:20], "max_tokens": 10, "temperature": 1.0, "top_p": 0.9, "seed": 7, "n": 2},
    {"prompt": "Hello", "max_tokens": 1, "temperature": 0},  # ends on the prefill side
]


def completions(url: str) -> list[list[tuple]]:
    """Each body's choices: (index, text, finish_reason, token logprobs), streams joined."""
    out = []
    for body in BODIES:
        r = requests.post(f"{url}/v1/completions", json={"model": "tiny-llama", **body},
                          timeout=60, stream=bool(body.get("stream")))
        assert r.status_code == 200, r.text
        if body.get("stream"):
            text, finish = "", None
            for line in r.iter_lines():
                if line.startswith(b"data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    text, finish = text + choice["text"], choice["finish_reason"] or finish
            out.append([(0, text, finish, None)])
            continue
        out.append(sorted((c["index"], c["text"], c["finish_reason"],
                           c["logprobs"] and c["logprobs"]["token_logprobs"])
                          for c in r.json()["choices"]))
    return out


def same(a: list[list[tuple]], b: list[list[tuple]]) -> bool:
    for ca, cb in zip(a, b, strict=True):
        for (i, text, finish, lps), (j, text_b, finish_b, lps_b) in zip(ca, cb, strict=True):
            if (i, text, finish) != (j, text_b, finish_b):
                return False
            if lps is not None and max(abs(x - y) for x, y in zip(lps, lps_b, strict=True)) > 1e-4:
                return False
    return True


def serve(tmp_path, name: str, *overrides: str):
    """run.py action=run; yields the URL and the run's arguments, then stops it (or kills
    what the run recorded)."""
    port = free_port()
    args = tiny_serve_args(tmp_path / name, port, *SMALL, *overrides)
    return f"http://127.0.0.1:{port}", args


def offline(model: str) -> list[list[tuple]]:
    """BODIES through the aggregated engine in this process, shaped as completions()."""
    from flagserve import LLM, SamplingParams
    llm = LLM(model=model, device="cpu", dtype="float32")
    out = []
    for body in BODIES:
        params = SamplingParams(max_tokens=body["max_tokens"], temperature=body["temperature"],
                                top_p=body.get("top_p", 1.0), seed=body.get("seed"),
                                n=body.get("n", 1), logprobs=body.get("logprobs"))
        (result,) = llm.generate([body["prompt"]], params, use_tqdm=False)
        out.append(sorted((c.index, c.text, str(c.finish_reason), c.logprobs and [
            lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)])
            for c in result.outputs))
    return out


def test_disaggregated_outputs_match_aggregated(tmp_path, llama_path):
    reference = offline(llama_path)
    url, args = serve(tmp_path, "split", f"serve.llm.engine_args.model={llama_path}", *SPLIT)
    try:
        result = run_py(*args, "action=run", timeout=600)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "llm-prefill, llm-decode" in (tmp_path / "split/logs/server.log").read_text()
        got = completions(url)
        assert same(got, reference), (got, reference)
        routed_and_measured_by_role(url)
        smoke_and_bench_cover_the_split(args, tmp_path / "split")
        disconnect_frees_both_engines(url)
        killed_decode_replica_never_hangs(url, tmp_path / "split")
        stop_leaves_nothing(tmp_path / "split", args)
    finally:
        if run_py(*args, "action=stop", timeout=120).returncode != 0:
            kill_recorded(tmp_path / "split")


def smoke_and_bench_cover_the_split(args: list[str], exp_dir) -> None:
    """action=test and action=bench on the running split deployment (it stays running)."""
    smoke = run_py(*args, "action=test", timeout=120)
    assert smoke.returncode == 0 and "test passed" in smoke.stdout, smoke.stdout + smoke.stderr
    bench = run_py(*args, "action=bench", "experiment.bench.num_prompts=4",
                   "experiment.bench.warmup=0", "experiment.bench.output_len=4",
                   "experiment.bench.input_len=16", "experiment.bench.range_ratio=0",
                   "experiment.bench.baselines=[]", timeout=300)
    assert bench.returncode == 0, bench.stdout + bench.stderr
    result = json.loads(next((exp_dir / "bench").glob("*/result.json")).read_text())
    requests_sent = [r for rs in result["requests"].values() for r in rs]
    assert len(requests_sent) == 4 and not any(r["error"] for r in requests_sent), requests_sent
    assert all(r["output_len"] == 4 for r in requests_sent), requests_sent


def engine_metrics(url: str, name: str, labels: str = "") -> dict[tuple[str, str], float]:
    """(role, engine replica) -> value of vllm:<name> (every engine here has a role)."""
    text = requests.get(f"{url}/metrics", timeout=10).text
    return {(role, engine): float(v) for engine, role, v in re.findall(
        rf'{name}\{{engine="([^"]+)",{labels}model_name="tiny-llama",role="(\w+)"\}} (\S+)', text)}


def metric_sum(url: str, name: str, role: str, labels: str = "") -> float:
    return sum(v for (r, _), v in engine_metrics(url, name, labels).items() if r == role)


def routed_and_measured_by_role(url: str) -> None:
    """LONG[:20] shares LONG's first block: prefix_aware sent it to LONG's prefill replica,
    whose cache had it. Each request that went on to decode moved its KV once, counted in
    bytes on both sides, with a TTFT split on the decode side; nothing failed."""
    affinity = r'flagserve:router_decisions_total\{[^}]*outcome="affinity",strategy="prefix_aware"\} [1-9]'
    def bytes_moved() -> tuple[float, float]:
        return (metric_sum(url, "flagserve:kv_transfer_sent_bytes_total", "prefill"),
                metric_sum(url, "flagserve:kv_transfer_received_bytes_total", "decode"))

    # Replicas and routers push their metrics every 0.5 s, each side on its own clock: wait
    # until both sides' pushes cover the transfers.
    deadline = time.time() + 15
    while not (re.search(affinity, text := requests.get(f"{url}/metrics", timeout=10).text)
               and metric_sum(url, "flagserve:kv_transfer_received_requests_total", "decode") >= 3
               and len(set(bytes_moved())) == 1):
        assert time.time() < deadline, (
            engine_metrics(url, "flagserve:kv_transfer_sent_bytes_total"),
            engine_metrics(url, "flagserve:kv_transfer_received_bytes_total"), text)
        time.sleep(0.5)
    assert metric_sum(url, "vllm:prefix_cache_hits_total", "prefill") >= 16
    assert bytes_moved()[0] > 0
    assert metric_sum(url, "flagserve:ttft_kv_transfer_seconds_count", "decode") == 3
    assert metric_sum(url, "flagserve:kv_transfer_failures_total", "prefill") == 0


def disconnect_frees_both_engines(url: str) -> None:
    """A stream closed after its first chunk: the decode engine aborts the request (2,000
    tokens take it seconds) and neither engine holds a block or a request after."""
    body = {"model": "tiny-llama", "prompt": LONG, "max_tokens": 1990, "ignore_eos": True,
            "stream": True}
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=60) as r:
        assert next(line for line in r.iter_lines() if line.startswith(b"data: {"))
    deadline = time.time() + 30  # replicas push their metrics every 0.5 s
    while time.time() < deadline:
        aborted = engine_metrics(url, "vllm:request_success_total", 'finished_reason="abort",')
        usage = engine_metrics(url, "vllm:kv_cache_usage_perc")
        running = engine_metrics(url, "vllm:num_requests_running")
        if sum(aborted.values()) == 1 and not any(usage.values()) and not any(running.values()):
            return
        time.sleep(0.5)
    raise AssertionError(f"after the disconnect: aborted {aborted}, KV usage {usage}, "
                         f"running {running}")


def long_request(url: str) -> tuple[int, str]:
    body = {"model": "tiny-llama", "prompt": LONG, "max_tokens": 1990, "ignore_eos": True}
    r = requests.post(f"{url}/v1/completions", json=body, timeout=120)
    return r.status_code, r.text


def decode_replica_pids(exp_dir) -> list[int]:
    from flagserve.cluster.records import ExpPaths, load_processes
    from flagserve.runner.launcher import session_members
    return [p.pid for r in load_processes(ExpPaths(exp_dir)) for p in session_members(r)
            if "ServeReplica" in " ".join(p.cmdline()) and "llm-decode" in " ".join(p.cmdline())]


def both_decoding(url: str, futures) -> bool:
    """Wait until the decode engines report two running requests; False if one ended
    first (replicas push their metrics every 0.5 s)."""
    deadline = time.time() + 60
    while metric_sum(url, "vllm:num_requests_running", "decode") < 2:
        if any(f.done() for f in futures):
            return False
        assert time.time() < deadline
        time.sleep(0.2)
    return True


def killed_decode_replica_never_hangs(url: str, exp_dir) -> None:
    """Two long requests on the decode replicas; one replica's process is killed: a request
    it held is retried (or fails with why) within a bound, the other completes. Serve starts
    a new decode replica, which links to the prefill replicas on first use and serves."""
    before = {e for r, e in engine_metrics(url, "vllm:num_requests_running") if r == "decode"}
    with ThreadPoolExecutor(2) as pool:
        for _ in range(3):  # a round lasts ~5 s: on a loaded machine the metrics may miss it
            futures = [pool.submit(long_request, url) for _ in range(2)]
            if both_decoding(url, futures):
                break
            missed = [f.result(timeout=120) for f in futures]
            assert all(code == 200 for code, _ in missed), missed
            time.sleep(1)  # let the pushed metrics show the round ended
        else:
            raise AssertionError(f"two requests never seen decoding at once: {missed}")
        pids = decode_replica_pids(exp_dir)
        assert len(pids) == 2, pids
        os.kill(pids[0], signal.SIGKILL)
        start = time.time()
        results = [f.result(timeout=120) for f in futures]
    assert time.time() - start < 90
    assert any(code == 200 for code, _ in results), results
    for code, text in results:  # a retried completion, or an error that says what happened
        assert code == 200 or "decode" in text, (code, text)
    deadline = time.time() + 120
    while True:  # the replacement: a decode engine not seen before serves its share
        r = requests.post(f"{url}/v1/completions", timeout=60,
                          json={"model": "tiny-llama", "prompt": LONG, "max_tokens": 2})
        assert r.status_code == 200, r.text
        served = engine_metrics(url, "vllm:request_success_total", 'finished_reason="length",')
        if any(n > 0 for (r, e), n in served.items() if r == "decode" and e not in before):
            break
        assert time.time() < deadline, served
        time.sleep(0.5)
    # All sent or withdrawn: the last release and the metrics push (every 0.5 s) may still
    # be on their way when the response has arrived.
    deadline = time.time() + 15
    while (usage := metric_sum(url, "vllm:kv_cache_usage_perc", "prefill")) != 0:
        assert time.time() < deadline, usage
        time.sleep(0.5)


def stop_leaves_nothing(exp_dir, args: list[str]) -> None:
    from flagserve.cluster.records import ExpPaths, load_processes
    from flagserve.runner.launcher import session_members
    records = load_processes(ExpPaths(exp_dir))
    cores = [p for p in session_members(records[0])
             if "flagserve.engine.core.process" in " ".join(p.cmdline())]
    assert len(cores) == 4  # the engine processes of 2 prefill and 2 decode replicas
    result = run_py(*args, "action=stop", timeout=120)
    assert result.returncode == 0 and "no process left" in result.stdout, result.stdout + result.stderr
    assert all(not session_members(r) for r in records)
