"""Prefill/decode disaggregation across two hosts (network namespaces, see netns.py): the
prefill replica pinned to one host, the decode replica to the other, the KV crossing between
them over gloo: completions equal to the single-process engine, `status` shows each role on
its host, stop leaves nothing."""
from __future__ import annotations

from tests.multihost.test_deploy import (
    MAX_TOKENS,
    PORT,
    PROMPTS,
    assert_nothing_left,
    complete,
    experiment,
    run_py,
)


def test_prefill_on_one_host_decode_on_the_other(netns_hosts, tmp_path, llama_path):
    head, worker = netns_hosts.hosts
    args = experiment(netns_hosts, tmp_path, "mh-pd", netns_hosts.hostfile(tmp_path / "hostfile"),
                      f"serve.llm.engine_args.model={llama_path}",
                      "serve.llm.engine_args.cpu_kv_cache_space_gib=0.05",
                      "+serve.llm.disaggregation.kv_transfer=gloo",
                      f"+serve.llm.disaggregation.prefill.host={head.address}",
                      f"+serve.llm.disaggregation.decode.host={worker.address}",
                      f"experiment.runner.deploy.host={head.address}",
                      "experiment.runner.deploy.startup_timeout_s=180")
    plan = run_py(*args, "action=plan")
    assert plan.returncode == 0, plan.stderr
    prefill, decode = plan.stdout.split("\n  llm-decode")
    assert f"replica 0 stage 0: {head.address} cpu" in prefill.split("\n  llm-prefill")[1]
    assert f"replica 0 stage 0: {worker.address} cpu" in decode.split("memory per device")[0]
    try:
        run = run_py(*args, "action=run", timeout=400)
        assert run.returncode == 0, f"run failed:\n{run.stdout}\n{run.stderr}"
        from flagserve import LLM, SamplingParams
        llm = LLM(model=llama_path, device="cpu", dtype="float32")
        expected = [o.outputs[0].text for o in
                    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))]
        assert [complete(f"http://{head.address}:{PORT}", p) for p in PROMPTS] == expected
        status = run_py(*args, "action=status", timeout=120)
        assert status.returncode == 0, f"{status.stdout}\n{status.stderr}"
        lines = status.stdout.splitlines()
        for host, role in ((head, "llm-prefill"), (worker, "llm-decode")):
            i = next(i for i, line in enumerate(lines) if line.startswith(f"  host {host.address}"))
            assert role in "\n".join(lines[i + 1:i + 6]), status.stdout
    finally:
        stop = run_py(*args, "action=stop", timeout=300)
    assert stop.returncode == 0, f"{stop.stdout}\n{stop.stderr}"
    assert_nothing_left(netns_hosts)
